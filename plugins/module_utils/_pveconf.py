# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Proxmox container configs: which GPUs a container is given (private helper; the read layer).

One parser for the inventory (a config from the API: keys, and raw ``lxc`` pairs) and for the
node (``/etc/pve/lxc/VMID.conf`` text, main section), so both agree on ``deny-write`` and on the
raw cgroup rules that a ``lxc.mount.entry`` device needs (pve-container: ``PVE::LXC::Config``).
"""

from __future__ import annotations

import re

NVIDIA_DEV = re.compile(r'^/dev/nvidia(\d+)$')
NVIDIA_MAJOR = 195
DEV_KEY = re.compile(r'^dev\d+$')
RULE_KEYS = {'lxc.cgroup2.devices.allow': True, 'lxc.cgroup.devices.allow': True,
             'lxc.cgroup2.devices.deny': False, 'lxc.cgroup.devices.deny': False}


def is_true(value):
    """A PVE boolean option: a bare flag, or =1/true/yes/on (deny-write=0 allows writes)."""
    return value is True or str(value).strip().lower() in ('1', 'true', 'yes', 'on')


def config_from_text(text):
    """The main section of a container config file in the API's shape: {key: value}, raw lxc.* keys as
    config["lxc"] = [[key, value], ...] in file order. Snapshots and pending changes ([...]) are left out."""
    config, raw = {}, []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            break
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key.startswith("lxc."):
            raw.append([key, value])
        else:
            config.setdefault(key, value)
    if raw:
        config["lxc"] = raw
    return config


def parse_device(value):
    """A devN value ('[path=]PATH[,deny-write][,gid=][,mode=][,uid=]', options in any order) as a dict."""
    fields = {}
    for part in str(value).split(','):
        key, sep, val = part.partition('=')
        if sep:
            fields[key] = val
        elif key.startswith('/') and 'path' not in fields:
            fields['path'] = key
        elif key:
            fields[key] = True
    return fields


def rule_letters(rule, major, minor):
    """The access letters of one raw cgroup rule value ('a', 'c 195:* rwm') when it covers char device major:minor,
    else None."""
    fields = rule.split()
    if fields == ['a']:
        fields = ['a', '*:*', 'rwm']
    if len(fields) != 3 or fields[0] not in ('a', 'c'):
        return None
    rule_major, sep, rule_minor = fields[1].partition(':')
    if not sep or rule_major not in ('*', str(major)) or rule_minor not in ('*', str(minor)):
        return None
    return set(fields[2]) & set('rwm')


def device_access(rules, major, minor):
    """Access letters ('r', 'w', 'm') that the container's raw cgroup device rules, read in order, give a char device.

    Proxmox containers start from LXC's deny-all device list: a device bound in by lxc.mount.entry opens only where
    an allow rule covers it.
    """
    access = set()
    for allow, rule in rules:
        letters = rule_letters(rule, major, minor)
        if letters is not None:
            access = access | letters if allow else access - letters
    return access


def blocking_rule(raw, major, minor):
    """Why the raw cgroup rules ([[key, value], ...] in order) leave a char device without rw, as the config writes
    it: the last deny rule that takes away a letter it lacks, else the allow rules that cover it, else none gives it."""
    rules = [(str(k), str(v)) for k, v in raw if str(k) in RULE_KEYS]
    missing = set('rw') - device_access([(RULE_KEYS[k], v) for k, v in rules], major, minor)
    covering = [(k, v, rule_letters(v, major, minor)) for k, v in rules]
    covering = [(k, v, letters) for k, v, letters in covering if letters is not None]
    denies = ['%s: %s' % (k, v) for k, v, letters in covering if not RULE_KEYS[k] and letters & missing]
    if denies:
        return denies[-1]
    if covering:
        return '%s (no %s)' % (', '.join('%s: %s' % (k, v) for k, v, dummy in covering), ''.join(sorted(missing)))
    return 'no lxc.cgroup2.devices.allow rule gives c %d:%d rw' % (major, minor)


def _dev_keys(config):
    """{minor: device} of the devN keys that pass a /dev/nvidiaN in (the first key of a minor wins)."""
    found = {}
    for key in sorted((k for k in config if DEV_KEY.match(k)), key=lambda k: int(k[3:])):
        dev = parse_device(config[key])
        match = NVIDIA_DEV.match(str(dev.get('path', '')))
        if match and int(match.group(1)) not in found:
            minor, usable = int(match.group(1)), not is_true(dev.get('deny-write'))
            found[minor] = {'minor': minor, 'device': dev['path'], 'path': dev['path'], 'source': key, 'usable': usable,
                            'rule': None if usable else 'deny-write'}
    return found


def gpu_passthrough(config):
    """The node's /dev/nvidiaN devices a container config passes in, by minor.

    A list of {minor, device (on the node), path (in the container), source (the config key), usable, rule}: devN keys
    (PVE adds their cgroup rule; deny-write makes them unusable) and lxc.mount.entry lines, whose source is the node's
    device and whose destination the container's path, usable only where the raw cgroup rules allow rw. rule: what
    makes a device unusable ('deny-write', or the raw rule that blocks it: blocking_rule), None when usable.
    """
    found = _dev_keys(config)
    raw = [entry for entry in config.get('lxc') or [] if len(entry) == 2]
    rules = [(RULE_KEYS[str(k)], str(v)) for k, v in raw if str(k) in RULE_KEYS]
    for key, value in raw:
        fields = str(value).split()
        if str(key) != 'lxc.mount.entry' or len(fields) < 2:
            continue
        match = NVIDIA_DEV.match(fields[0])
        if not match or int(match.group(1)) in found:
            continue
        minor = int(match.group(1))
        usable = set('rw') <= device_access(rules, NVIDIA_MAJOR, minor)
        found[minor] = {'minor': minor, 'device': fields[0], 'path': '/' + fields[1].lstrip('/'), 'source': 'lxc.mount.entry',
                        'usable': usable, 'rule': None if usable else blocking_rule(raw, NVIDIA_MAJOR, minor)}
    return [found[m] for m in sorted(found)]
