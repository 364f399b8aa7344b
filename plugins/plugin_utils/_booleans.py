# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A plugin's boolean options, read strictly (private helper, may change any time).

ansible-core turns the value of an option of type bool into a bool with boolean(value, strict=False): a word it does
not know (maybe, ture, enabled, an empty environment variable) becomes false. For validate_certs or host_key_checking
that turns a check off without a word. This finds the value as it was given, where ansible-core took it from (the
plugin's file, a variable, a keyword, the command line, the environment or an ini file), and accepts only the
spellings of Ansible's own strict boolean: true/false, yes/no, on/off, 1/0, y/n, t/f (any case), or a real bool.
"""

from __future__ import annotations

import configparser
import os

from ansible import constants as C
from ansible.module_utils.parsing.convert_bool import boolean

BOOL_TYPES = ('bool', 'boolean')
SPELLINGS = 'yes/no, on/off, 1/0, y/n, t/f'
_INI = {}


def _ini_value(path, entries):
    """The raw text of the last of entries (ini: section, key) set in the config file path, as ansible-core reads it."""
    if path not in _INI:
        parser = configparser.ConfigParser(inline_comment_prefixes=(';',))
        try:
            with open(path, encoding='utf-8') as handle:
                parser.read_string(handle.read())
        except (OSError, UnicodeDecodeError, configparser.Error):
            parser = None
        _INI[path] = parser
    parser, value = _INI[path], None
    for entry in entries or []:
        if parser is not None and parser.has_option(entry.get('section', 'defaults'), entry['key']):
            value = parser.get(entry.get('section', 'defaults'), entry['key'], raw=True)
    return value


def _given(definition, option, origin, direct, variables, keys):
    """(value as given, where) for an option that ansible-core took from origin; (None, None) for a default."""
    kind, _sep, name = str(origin).partition(': ')
    if origin == 'Direct':
        for key in [option] + list(definition.get('aliases') or []):
            if key in (direct or {}):
                return direct[key], 'option %s' % key
    elif kind == 'var':
        return (variables or {}).get(name), 'variable %s' % name
    elif kind == 'keyword':
        return (keys or {}).get(name), 'keyword %s' % name
    elif kind == 'cli':
        from ansible import context  # pylint: disable=import-outside-toplevel  # as ansible-core's own config does
        return context.CLIARGS.get(name), 'command line option %s' % name
    elif kind == 'env':
        return os.environ.get(name), 'environment variable %s' % name
    elif origin and origin != 'default' and os.path.isfile(str(origin)):
        return _ini_value(str(origin), definition.get('ini')), 'config file %s' % origin
    return None, None


def loose_booleans(plugin_type, plugin_name, direct=None, variables=None, keys=None):
    """[(option, value as given, where)] for each bool option of the plugin whose value is no Ansible boolean.

    Asks ansible-core's config where each value came from (its own precedence), then reads it there unconverted."""
    found = []
    definitions = C.config.get_configuration_definitions(plugin_type=plugin_type, name=plugin_name) or {}
    for option in sorted(definitions):
        definition = definitions[option]
        if definition.get('type') not in BOOL_TYPES:
            continue
        dummy, origin = C.config.get_config_value_and_origin(option, plugin_type=plugin_type, plugin_name=plugin_name,
                                                             keys=keys, variables=variables, direct=direct)
        value, where = _given(definition, option, origin, direct, variables, keys)
        if where is None or value is None:
            continue
        try:
            boolean(value, strict=True)
        except TypeError:
            found.append((option, value, where))
    return found


def refusal(label, loose):
    """One line for the first of loose_booleans()'s answers, or None: the plugin, the option, the value and where."""
    if not loose:
        return None
    option, value, where = loose[0]
    return ('%s: option %s is %r (%s), not a boolean; write true or false (Ansible also reads %s, any case), '
            'since ansible-core would read it as false' % (label, option, str(value)[:80], where, SPELLINGS))
