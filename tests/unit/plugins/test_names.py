"""Issue 22's conventional names, with the old ones still working: the module gpu_info (gpu_status redirects to it,
deprecated) and the callback's [callback_gpu_report] ini section (the old [gpuops_report] was removed in issue 45)."""
import os
import subprocess
import sys
import warnings

import yaml
from ansible.config.manager import ConfigManager
from ansible.plugins.loader import callback_loader, init_plugin_loader

with warnings.catch_warnings():  # another test module may have set the collection loader up already
    warnings.simplefilter('ignore', UserWarning)
    init_plugin_loader()

BIN = os.path.dirname(sys.executable)


def run_playbook(tmp_path, module):
    """One task of MODULE on localhost with a bad need_fraction: it fails in the module's own validation."""
    book = tmp_path / 'play.yml'
    book.write_text('- hosts: localhost\n  gather_facts: false\n  tasks:\n'
                    '    - %s:\n        need_fraction: 1.5\n' % module)
    env = dict(os.environ, ANSIBLE_NOCOLOR='1', ANSIBLE_DEPRECATION_WARNINGS='1', ANSIBLE_LOCALHOST_WARNING='0',
               ANSIBLE_INVENTORY_UNPARSED_WARNING='0')
    return subprocess.run([os.path.join(BIN, 'ansible-playbook'), '-c', 'local', str(book)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_gpu_info_runs_without_a_deprecation(tmp_path):
    proc = run_playbook(tmp_path, 'gpuops.fleet.gpu_info')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'need_fraction must be above 0 and at most 1, got 1.5' in proc.stdout, proc.stdout
    assert 'DEPRECATION' not in proc.stdout + proc.stderr


def test_old_gpu_status_name_runs_gpu_info_and_says_it_is_deprecated(tmp_path):
    proc = run_playbook(tmp_path, 'gpuops.fleet.gpu_status')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'need_fraction must be above 0 and at most 1, got 1.5' in proc.stdout, proc.stdout
    text = ' '.join((proc.stdout + proc.stderr).split())
    assert 'gpuops.fleet.gpu_status is now gpuops.fleet.gpu_info' in text, text
    # ansible-core 2.19 says "from collection 'gpuops.fleet' version 1.0.0", 2.16-2.18 "from gpuops.fleet in version 1.0.0"
    assert ("removed from collection 'gpuops.fleet' version 1.0.0" in text
            or "removed from gpuops.fleet in version 1.0.0" in text), text


def _report_path(tmp_path, section):
    """report_path as ansible-playbook reads it from an ansible.cfg with only SECTION: (value, origin, deprecations)."""
    config = tmp_path / 'ansible.cfg'
    config.write_text('[%s]\nreport_path = %s\n' % (section, tmp_path / 'rows.json'))
    # a config manager of this ansible.cfg with the callback's documented options, as ansible-playbook builds it
    manager = ConfigManager(conf_file=str(config))
    plugin = callback_loader.get('gpuops.fleet.gpu_report', class_only=True)
    options = yaml.safe_load(sys.modules[plugin.__module__].DOCUMENTATION)['options']
    manager.initialize_plugin_configuration_definitions('callback', 'gpuops.fleet.gpu_report', options)
    value, origin = manager.get_config_value_and_origin('report_path', plugin_type='callback',
                                                        plugin_name='gpuops.fleet.gpu_report')
    return value, origin, [name for name, dummy in manager.DEPRECATED]


def test_report_path_is_read_from_the_conventional_section(tmp_path, monkeypatch):
    monkeypatch.delenv('GPUOPS_REPORT_PATH', raising=False)
    value, origin, deprecated = _report_path(tmp_path, 'callback_gpu_report')
    assert (value, origin) == (str(tmp_path / 'rows.json'), str(tmp_path / 'ansible.cfg'))
    assert deprecated == [], deprecated


def test_the_removed_gpuops_report_section_is_not_read(tmp_path, monkeypatch):
    """Issue 45: the deprecated [gpuops_report] section is gone; a file that still has it sets nothing."""
    monkeypatch.delenv('GPUOPS_REPORT_PATH', raising=False)
    value, origin, deprecated = _report_path(tmp_path, 'gpuops_report')
    assert value is None and origin == 'default', (value, origin)
    assert deprecated == [], deprecated
