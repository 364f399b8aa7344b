"""gpuops.fleet.pct takes real booleans only (issue 45): a word that ansible-core would read as false is refused.

ansible-core reads a bool option with boolean(value, strict=False), so `ansible_host_key_checking: maybe` turns host key
checking off. The plugin refuses such a value naming the option and where it came from, before anything runs.
"""
import os
import subprocess
import sys
import warnings

import pytest

from ansible.errors import AnsibleError
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

with warnings.catch_warnings():  # another test module may have set the collection loader up already
    warnings.simplefilter('ignore', UserWarning)
    init_plugin_loader()

BIN = os.path.dirname(sys.executable)


def connect(env=None, monkeypatch=None, **variables):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    conn.set_options(var_options=dict({'ansible_host': '127.0.9.1', 'ansible_pct_vmid': 101}, **variables))
    return conn


@pytest.mark.parametrize('variable, value, option', [
    ('ansible_host_key_checking', 'maybe', 'host_key_checking'),
    ('ansible_ssh_host_key_checking', '', 'host_key_checking'),
    ('ansible_pct_node_become', 'maybe', 'node_become'),
    ('pct_node_become', 'sudo', 'node_become'),
    ('ansible_pipelining', 'sometimes', 'pipelining'),
    ('ansible_ssh_use_tty', 2, 'use_tty'),
])
def test_a_loose_boolean_variable_is_refused_naming_the_option_and_the_variable(variable, value, option):
    with pytest.raises(AnsibleError) as caught:
        connect(**{variable: value})
    text = str(caught.value)
    assert "\n" not in text.strip() and text.startswith('gpuops.fleet.pct: option %s is ' % option), text
    assert '(variable %s), not a boolean' % variable in text and 'nothing was run' in text, text


def test_a_loose_boolean_from_the_environment_is_refused_naming_it(monkeypatch):
    with pytest.raises(AnsibleError, match=r"option host_key_checking is 'maybe' \(environment variable "
                                           r"ANSIBLE_HOST_KEY_CHECKING\), not a boolean"):
        connect(env={'ANSIBLE_HOST_KEY_CHECKING': 'maybe'}, monkeypatch=monkeypatch)


@pytest.mark.parametrize('value, expected', [
    ('yes', True), ('False', False), ('on', True), ('0', False), (True, True), ('n', False), (1, True),
])
def test_ansibles_boolean_spellings_are_read_as_ansible_reads_them(value, expected):
    conn = connect(ansible_host_key_checking=value, ansible_pct_node_become=value)
    assert conn.get_option('host_key_checking') is expected and conn.get_option('node_become') is expected


def test_a_play_with_a_loose_boolean_fails_before_ssh_runs(tmp_path):
    """The product path: ansible, the pct connection, a stand-in ssh that records whether it ever ran."""
    ran = tmp_path / 'ssh-ran'
    ssh = tmp_path / 'ssh'
    ssh.write_text('#!/bin/sh\necho "$@" >> %s\nexit 255\n' % ran)
    ssh.chmod(0o755)
    inventory = tmp_path / 'hosts.yml'
    inventory.write_text('all:\n  hosts:\n    ct101:\n      ansible_connection: gpuops.fleet.pct\n'
                         '      ansible_host: 127.0.9.1\n      ansible_pct_vmid: 101\n')
    env = dict(os.environ, ANSIBLE_SSH_EXECUTABLE=str(ssh), ANSIBLE_NOCOLOR='1', ANSIBLE_HOST_KEY_CHECKING='maybe')
    proc = subprocess.run([os.path.join(BIN, 'ansible'), '-i', str(inventory), 'ct101', '-m', 'ansible.builtin.raw',
                           '-a', 'true'], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120, check=False)
    assert proc.returncode != 0, proc.stdout
    assert ("gpuops.fleet.pct: option host_key_checking is 'maybe' (environment variable ANSIBLE_HOST_KEY_CHECKING), "
            "not a boolean").replace(' ', '') in ''.join(proc.stdout.split()), proc.stdout
    assert not ran.exists(), ran.read_text()
