"""Unit tests of gpuops.fleet.pct: options, command building, quoting, error texts, streaming.

Streaming runs for real, with a stand-in `ssh` that runs the remote command with the local
/bin/sh and a stand-in `pct` that runs its argv: only the SSH hop is left out here
(tests/integration/test_connection_pct.py covers it against lab nodes).
"""
import os
import shlex
import subprocess
import sys
import textwrap
import tracemalloc
import warnings

import pytest

from ansible.errors import AnsibleAuthenticationFailure, AnsibleConnectionFailure, AnsibleError
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

with warnings.catch_warnings():  # another test module may have set the collection loader up already
    warnings.simplefilter('ignore', UserWarning)
    init_plugin_loader()

NODE = '127.0.9.1'


def make_conn(**variables):
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    base = {'ansible_host': NODE, 'pct_vmid': 101}
    base.update(variables)
    conn.set_options(var_options={k: v for k, v in base.items() if v is not None})
    conn.host = conn.get_option('host')
    return conn


def test_transport_and_pipelining_default():
    conn = make_conn()
    assert conn.transport == 'gpuops.fleet.pct'
    assert conn.has_pipelining is True
    assert conn.get_option('pipelining') is True
    assert make_conn(ansible_pipelining=False).get_option('pipelining') is False


def test_vmid_sources_pct_vmid_wins_over_proxmox_vmid():
    assert make_conn(pct_vmid=None, proxmox_vmid=205).get_option('vmid') == 205
    assert make_conn(pct_vmid=101, proxmox_vmid=205).get_option('vmid') == 101


def test_vmid_from_environment(monkeypatch):
    monkeypatch.setenv('ANSIBLE_PCT_VMID', '333')
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    conn.set_options(var_options={'ansible_host': NODE})
    assert conn.get_option('vmid') == 333


def test_missing_vmid_is_a_clear_error():
    conn = make_conn(pct_vmid=None)
    with pytest.raises(AnsibleError, match='set pct_vmid'):
        conn._connect()


@pytest.mark.parametrize('variables, expected', [
    ({}, ['/usr/sbin/pct', 'exec', '101', '--', 'X']),
    ({'pct_exec_method': 'lxc-attach'}, ['/usr/bin/lxc-attach', '-n', '101', '--keep-env', '--', 'X']),
    ({'pct_node_become': True}, ['sudo', '-n', '--', '/usr/sbin/pct', 'exec', '101', '--', 'X']),
    ({'pct_executable': '/opt/pct'}, ['/opt/pct', 'exec', '101', '--', 'X']),
])
def test_node_argv(variables, expected):
    assert make_conn(**variables)._node_argv(['X']) == expected


def test_wrap_quotes_once_for_the_node_shell():
    cmd = "/bin/sh -c 'echo \"$HOME\" `id` $(date) *' ; echo ü\nnext"
    words = shlex.split(make_conn()._wrap(cmd))
    assert words == ['/usr/sbin/pct', 'exec', '101', '--', '/bin/sh', '-c', cmd]


def test_command_timeout_wraps_inside_the_container():
    words = shlex.split(make_conn(pct_command_timeout=30)._wrap('sleep 1'))
    assert words[4:] == ['timeout', '-k', '5', '30', '/bin/sh', '-c', 'sleep 1']


def control_path(conn):
    cmd = [a.decode() for a in conn._build_command('ssh', 'ssh', conn.host, 'true')]
    return [a for a in cmd if a.startswith('ControlPath=')]


def test_control_path_is_per_node_not_per_container(tmp_path):
    cp_dir = str(tmp_path)
    first = control_path(make_conn(pct_vmid=101, ansible_user='root', ansible_control_path_dir=cp_dir))
    second = control_path(make_conn(pct_vmid=102, ansible_user='root', ansible_control_path_dir=cp_dir))
    other_node = control_path(make_conn(ansible_host='127.0.9.2', pct_vmid=101, ansible_user='root',
                                        ansible_control_path_dir=cp_dir))
    assert first and first == second
    assert other_node != first


def test_host_key_checking_is_on_by_default():
    args = [a.decode() for a in make_conn()._build_command('ssh', 'ssh', NODE, 'true')]
    assert 'StrictHostKeyChecking=no' not in args
    assert make_conn().get_option('host_key_checking') is True


# Recorded texts: Proxmox's pct messages, and OpenSSH client errors.
@pytest.mark.parametrize('variables, rc, text, error, words', [
    ({}, 255, "container '101' not running!\n", AnsibleConnectionFailure,
     ["container '101' not running!", NODE]),
    ({}, 255, "Configuration file 'nodes/pve2/lxc/101.conf' does not exist\n", AnsibleConnectionFailure,
     ['not on node pve2', NODE, 'inventory that tracks nodes']),
    ({}, 127, 'bash: line 1: /usr/sbin/pct: No such file or directory\n', AnsibleConnectionFailure,
     ['/usr/sbin/pct not found on node', 'Proxmox VE node']),
    ({}, 255, 'root@127.0.9.1: Permission denied (publickey).\n', AnsibleAuthenticationFailure,
     ['SSH authentication to node root@' + NODE, 'Permission denied (publickey)']),
    ({}, 255, '@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n...\nHost key verification failed.\n',
     AnsibleConnectionFailure, ['does not match known_hosts', 'Host key checking stays on']),
    ({}, 255, 'No ED25519 host key is known for 127.0.9.1 and you have requested strict checking.\n'
              'Host key verification failed.\n', AnsibleConnectionFailure, ['not in known_hosts']),
    ({'pct_node_become': True}, 1, 'sudo: a password is required\n', AnsibleConnectionFailure,
     ['node_become', 'NOPASSWD']),
    ({'pct_exec_method': 'lxc-attach'}, 1, 'lxc-attach: 101: attach.c: lxc_attach: 1136 Failed to get init pid\n',
     AnsibleConnectionFailure, ['lxc-attach could not enter container 101', 'exec_method=pct']),
])
def test_explain_errors(variables, rc, text, error, words):
    variables.setdefault('ansible_user', 'root')
    clear = make_conn(**variables)._explain(rc, text)
    assert clear.__class__.__name__ == error.__name__
    message = str(clear)
    assert '\n' not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize('rc, text', [
    (0, "container '101' not running!"),          # success is never an error
    (1, "container '102' not running!"),          # another container's words, printed by a command
    (2, 'ls: cannot access x: No such file or directory'),
    (255, 'some tool exited 255'),
])
def test_explain_leaves_command_failures_alone(rc, text):
    assert make_conn(ansible_user='root')._explain(rc, text) is None


# -- streaming, with stand-ins for ssh and pct -------------------------------------------------------

@pytest.fixture
def local_node(tmp_path):
    """ssh stand-in: runs its last argument with /bin/sh; pct stand-in: `pct exec VMID -- ARGV`."""
    fake_ssh = tmp_path / 'ssh'
    fake_ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec /bin/sh -c "$last"\n')
    fake_pct = tmp_path / 'pct'
    fake_pct.write_text(textwrap.dedent("""\
        #!/bin/sh
        [ "$1" = exec ] && [ "$3" = -- ] || exit 2
        [ "$2" = 101 ] || { echo "container '$2' not running!" >&2; exit 255; }
        shift 3
        exec "$@"
        """))
    for path in (fake_ssh, fake_pct):
        path.chmod(0o755)
    return make_conn(ansible_ssh_executable=str(fake_ssh), pct_executable=str(fake_pct), ansible_ssh_args='',
                     ansible_user='root')


def test_exec_command_runs_argv_through_the_wrapping(local_node):
    cmd = '%s -c %s' % (sys.executable, shlex.quote('import sys; print(repr(sys.argv[1:]))')) + \
        " 'a b' '$(id)' '*' \"\\\"\""
    rc, out, err = local_node.exec_command(cmd, sudoable=False)
    assert (rc, err) == (0, b'')
    assert out.decode().strip() == repr(['a b', '$(id)', '*', '"'])


def test_exec_command_passes_stdin_for_pipelining(local_node):
    rc, out, dummy = local_node.exec_command('cat', in_data=b'module source\n', sudoable=False)
    assert (rc, out) == (0, b'module source\n')


def test_put_and_fetch_stream_without_holding_the_file(local_node, tmp_path):
    size = 24 * 1024 * 1024
    src = tmp_path / 'src.bin'
    with open(src, 'wb') as f:
        for dummy in range(size // (1024 * 1024)):
            f.write(os.urandom(1024 * 1024))
    remote = tmp_path / "dir with space/ünï 'q' $(x).bin"
    remote.parent.mkdir()
    back = tmp_path / 'back.bin'
    tracemalloc.start()
    try:
        local_node.put_file(str(src), str(remote))
        local_node.fetch_file(str(remote), str(back))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert remote.read_bytes() == src.read_bytes()
    assert back.read_bytes() == src.read_bytes()
    assert peak < 4 * 1024 * 1024, 'peak %d bytes: the file was held in memory' % peak


def test_put_empty_file(local_node, tmp_path):
    src = tmp_path / 'empty'
    src.write_bytes(b'')
    local_node.put_file(str(src), str(tmp_path / 'copy'))
    assert (tmp_path / 'copy').read_bytes() == b''


def test_put_file_error_is_one_line(local_node, tmp_path):
    src = tmp_path / 'f'
    src.write_bytes(b'x')
    with pytest.raises(AnsibleError) as info:
        local_node.put_file(str(src), str(tmp_path / 'missing-dir' / 'f'))
    assert 'failed to put' in str(info.value) and 'container 101' in str(info.value)
    assert '\n' not in str(info.value)


def test_fetch_missing_file_leaves_no_local_file(local_node, tmp_path):
    with pytest.raises(AnsibleError, match='failed to fetch'):
        local_node.fetch_file(str(tmp_path / 'nope'), str(tmp_path / 'out'))
    assert not (tmp_path / 'out').exists()


def test_stopped_container_on_put(local_node, tmp_path):
    src = tmp_path / 'f'
    src.write_bytes(b'x')
    local_node.set_options(var_options={'ansible_host': NODE, 'pct_vmid': 102,
                                        'ansible_ssh_executable': local_node.get_option('ssh_executable'),
                                        'pct_executable': local_node.get_option('pct_executable'),
                                        'ansible_ssh_args': '', 'ansible_user': 'root'})
    with pytest.raises(AnsibleConnectionFailure, match="container '102' not running!"):
        local_node.put_file(str(src), '/tmp/x')


def test_plugin_doc_parses():
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'ansible-doc'), '-t', 'connection',
                          '--json', 'gpuops.fleet.pct'], capture_output=True, text=True, check=True).stdout
    assert '"exec_method"' in out and '"pct_vmid"' in out


@pytest.mark.parametrize('rc, text, missing', [
    (127, 'bash: line 1: /usr/sbin/pct: No such file or directory', True),
    (127, 'bash: /usr/sbin/pct: No such file or directory', True),
    (127, 'sh: 1: /usr/sbin/pct: not found', True),
    (127, 'zsh:1: no such file or directory: /usr/sbin/pct', True),
    (1, 'sudo: /usr/sbin/pct: command not found', True),
    (1, 'cat: /usr/sbin/pct: No such file or directory', False),   # a command in the container
    (127, '/bin/sh: 1: nvidia-smi: not found', False),
])
def test_missing_tool_is_told_from_the_command_failing(rc, text, missing):
    assert make_conn()._tool_missing(rc, text, '/usr/sbin/pct') is missing


def test_explain_reads_tty_output():
    """Without pipelining, output comes through a tty: CRLF line ends, stderr merged into stdout."""
    conn = make_conn(ansible_user='root', pct_node_become=True)
    assert 'sudo is not installed' in str(conn._explain(127, 'bash: line 1: sudo: command not found\r\n'))


@pytest.fixture
def recording_ssh(tmp_path):
    """ssh stand-in for `ssh -N -f`: records the call, sleeps, then makes the control socket (or fails)."""
    script = tmp_path / 'ssh'
    script.write_text(textwrap.dedent("""\
        #!/bin/sh
        echo "$*" >> %s/calls
        for arg; do case "$arg" in ControlPath=*) path=${arg#ControlPath=};; esac; done
        path=$(echo "$path" | tr -d '"')
        sleep 0.3
        [ -e %s/fail ] && exit 255
        touch "$path"
        """ % (tmp_path, tmp_path)))
    script.chmod(0o755)
    return script


def master_calls(tmp_path):
    calls = tmp_path / 'calls'
    return [line for line in calls.read_text().splitlines() if '-N -f' in line] if calls.exists() else []


def test_parallel_forks_open_one_master(tmp_path, recording_ssh):
    import threading
    conns = [make_conn(pct_vmid=vmid, ansible_ssh_executable=str(recording_ssh), ansible_user='root',
                       ansible_control_path_dir=str(tmp_path / 'cp')) for vmid in (101, 102, 103, 104)]
    threads = [threading.Thread(target=conn._ensure_master) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(master_calls(tmp_path)) == 1


def test_failed_master_is_not_retried_by_every_fork(tmp_path, recording_ssh):
    (tmp_path / 'fail').touch()
    for vmid in (101, 102, 103):
        make_conn(pct_vmid=vmid, ansible_ssh_executable=str(recording_ssh), ansible_user='root',
                  ansible_control_path_dir=str(tmp_path / 'cp'))._ensure_master()
    assert len(master_calls(tmp_path)) == 1


def test_no_master_without_control_persist(tmp_path, recording_ssh):
    make_conn(ansible_ssh_executable=str(recording_ssh), ansible_ssh_args='',
              ansible_control_path_dir=str(tmp_path / 'cp'))._ensure_master()
    assert master_calls(tmp_path) == []
