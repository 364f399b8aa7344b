"""Unit tests of gpuops.fleet.pct: options, command building, quoting, error texts, streaming.

Streaming runs for real, with a stand-in `ssh` that runs the remote command with the local
/bin/sh and a stand-in `pct` that runs its argv: only the SSH hop is left out here
(tests/integration/test_connection_pct.py covers it against lab nodes).
"""
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import warnings

import pytest

from ansible import constants as C
from ansible.errors import AnsibleAuthenticationFailure, AnsibleConnectionFailure, AnsibleError
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

with warnings.catch_warnings():  # another test module may have set the collection loader up already
    warnings.simplefilter('ignore', UserWarning)
    init_plugin_loader()
from ansible_collections.gpuops.fleet.plugins.connection import pct as pct_plugin  # noqa: E402  (after the loader)

NODE = '127.0.9.1'


# The executables come from configuration only (issue 41): these tests give them as direct options, as an ini key or
# an environment variable would, under the names they had as host variables.
CONFIGURED = {'ansible_ssh_executable': 'ssh_executable', 'pct_executable': 'pct_executable',
              'pct_lxc_attach_executable': 'lxc_attach_executable'}


def configure(conn, variables):
    """set_options with variables, the executables among them as configuration."""
    direct = {CONFIGURED[k]: v for k, v in variables.items() if k in CONFIGURED and v is not None}
    conn.set_options(var_options={k: v for k, v in variables.items() if k not in CONFIGURED and v is not None},
                     direct=direct)


def make_conn(**variables):
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    base = {'ansible_host': NODE, 'pct_vmid': 101}
    base.update(variables)
    configure(conn, base)
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


@pytest.mark.parametrize('option, old, new, old_value, new_value', [
    ('vmid', 'pct_vmid', 'ansible_pct_vmid', 101, 202),
    ('exec_method', 'pct_exec_method', 'ansible_pct_exec_method', 'pct', 'lxc-attach'),
    ('node_become', 'pct_node_become', 'ansible_pct_node_become', False, True),
    ('transfer_timeout', 'pct_transfer_timeout', 'ansible_pct_transfer_timeout', 10, 20),
    ('command_timeout', 'pct_command_timeout', 'ansible_pct_command_timeout', 30, 40),
])
def test_ansible_pct_names_set_each_option_and_win_over_the_old_pct_aliases(option, old, new, old_value, new_value):
    assert make_conn(**{old: old_value}).get_option(option) == old_value
    assert make_conn(**{new: new_value, 'pct_vmid': 101 if old != 'pct_vmid' else None}).get_option(option) == new_value
    assert make_conn(**{old: old_value, new: new_value}).get_option(option) == new_value


@pytest.mark.parametrize('variable', ['pct_executable', 'ansible_pct_executable', 'pct_lxc_attach_executable',
                                      'ansible_pct_lxc_attach_executable', 'ansible_ssh_executable'])
def test_no_host_variable_chooses_an_executable(variable):
    """Issue 41: what the node's root runs comes from configuration only; a host variable (which a fact outranks)
    is not read."""
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    conn.set_options(var_options={'ansible_host': NODE, 'pct_vmid': 101, 'pct_exec_method': 'lxc-attach',
                                  variable: '/tmp/evil'})
    assert '/tmp/evil' not in conn._node_argv(['X'])
    assert conn.get_option('ssh_executable') == 'ssh'
    assert variable not in C.config.get_plugin_vars('connection', conn._load_name)


def test_executables_come_from_the_environment(monkeypatch):
    monkeypatch.setenv('ANSIBLE_PCT_EXECUTABLE', '/opt/pve/pct')
    assert make_conn()._node_argv(['X'])[0] == '/opt/pve/pct'


@pytest.mark.parametrize('fact, value', [('pct_vmid', 102), ('ansible_pct_vmid', 102), ('proxmox_vmid', 102),
                                         ('ansible_pct_exec_method', 'lxc-attach'), ('pct_node_become', True),
                                         ('ansible_host_key_checking', False), ('ansible_control_path', '/tmp/cp'),
                                         ('ansible_ssh_host_key_checking', False)])
def test_a_fact_named_like_a_connection_variable_fails_naming_it(fact, value, monkeypatch):
    """Issue 41, attack 1: facts outrank inventory variables and ansible-core removes only its builtin connections'
    names from them. ansible_facts holds the fact without its ansible_ prefix."""
    key = fact[len('ansible_'):] if fact.startswith('ansible_') else fact
    monkeypatch.setattr(C, 'INJECT_FACTS_AS_VARS', True)
    with pytest.raises(AnsibleError, match=r'refused: .*\(ansible_facts\.%s\)' % key):
        make_conn(ansible_facts={key: value, 'distribution': 'Debian'})


def test_facts_that_ansible_core_removes_or_that_name_nothing_pass(monkeypatch):
    """ansible_host, ansible_user, ansible_ssh_executable and the like never become variables (clean_facts), and the
    executables are no variables at all: such facts, and ordinary ones, are no collision."""
    monkeypatch.setattr(C, 'INJECT_FACTS_AS_VARS', True)
    facts = {'host': 'evil', 'user': 'x', 'ssh_executable': '/tmp/x', 'pct_executable': '/tmp/x',
             'pct_lxc_attach_executable': '/tmp/x', 'ssh_host_key_rsa_public': 'AAAA', 'hostname': 'ct101'}
    conn = make_conn(ansible_facts=facts)
    assert conn._node_argv(['X'])[:3] == ['/usr/sbin/pct', 'exec', '101']


def test_with_inject_facts_as_vars_off_a_colliding_fact_is_only_warned_about(monkeypatch):
    monkeypatch.setattr(C, 'INJECT_FACTS_AS_VARS', False)
    warned = []
    monkeypatch.setattr(pct_plugin.display, 'warning', lambda msg, *a, **k: warned.append(msg))
    conn = make_conn(ansible_facts={'pct_vmid': 102})
    assert conn.get_option('vmid') == 101
    assert len(warned) == 1 and 'pct_vmid (ansible_facts.pct_vmid)' in warned[0] and 'ignored' in warned[0]


def test_the_facts_option_reads_ansible_facts_and_the_doc_says_never_set_it():
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    assert 'ansible_facts' in C.config.get_plugin_vars('connection', conn._load_name)
    assert 'never set it' in pct_plugin.DOCUMENTATION


def test_vmid_has_no_environment_or_ini_default(monkeypatch, tmp_path):
    """One default would send every host's tasks to the same container number on each node."""
    config = tmp_path / 'ansible.cfg'
    config.write_text('[pct_connection]\nvmid = 333\n')
    monkeypatch.setenv('ANSIBLE_PCT_VMID', '333')
    monkeypatch.setenv('ANSIBLE_CONFIG', str(config))
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    conn.set_options(var_options={'ansible_host': NODE})
    assert conn.get_option('vmid') is None
    with pytest.raises(AnsibleError, match='set ansible_pct_vmid'):
        conn._connect()
    doc = subprocess.run([os.path.join(os.path.dirname(sys.executable), 'ansible-doc'), '-t', 'connection', '--json',
                          'gpuops.fleet.pct'], capture_output=True, text=True, check=True).stdout
    vmid_doc = json.loads(doc)['gpuops.fleet.pct']['doc']['options']['vmid']
    assert 'env' not in vmid_doc and 'ini' not in vmid_doc


def test_missing_vmid_is_a_clear_error():
    conn = make_conn(pct_vmid=None)
    with pytest.raises(AnsibleError, match='set ansible_pct_vmid'):
        conn._connect()


@pytest.mark.parametrize('variables, expected', [
    ({}, ['/usr/sbin/pct', 'exec', '101', '--keep-env', '0', '--', 'X']),
    ({'pct_exec_method': 'lxc-attach'}, ['/usr/bin/lxc-attach', '-n', '101', '--clear-env', '--', 'X']),
    ({'pct_node_become': True}, ['sudo', '-n', '--', '/usr/sbin/pct', 'exec', '101', '--keep-env', '0', '--', 'X']),
    ({'pct_executable': '/opt/pct'}, ['/opt/pct', 'exec', '101', '--keep-env', '0', '--', 'X']),
])
def test_node_argv(variables, expected):
    assert make_conn(**variables)._node_argv(['X']) == expected


def container_words(conn, cmd):
    """The words after `--` of the node command, and the command alone (marker and environment line removed)."""
    lexer = shlex.shlex(conn._wrap(cmd), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    rest = words[words.index('--') + 1:]
    rest = rest[:rest.index(';')]
    head, dummy, script_cmd = rest[-1].partition('\n')
    assert conn._markers[1].decode() in head and 'export HOME=/root' in head
    return rest[:-1], script_cmd


def test_wrap_quotes_once_for_the_node_shell():
    cmd = "/bin/sh -c 'echo \"$HOME\" `id` $(date) *' ; echo ü\nnext"
    assert container_words(make_conn(), cmd) == (['/bin/sh', '-c'], cmd)


def test_command_timeout_wraps_inside_the_container():
    assert container_words(make_conn(pct_command_timeout=30), 'sleep 1') == \
        (['timeout', '-k', '5', '30', '/bin/sh', '-c'], 'sleep 1')


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


# Recorded texts: Proxmox's pct messages, and OpenSSH client errors. `stage` is how far the node command got:
# 'ssh' (no marker: ssh failed), 'node' (the node shell ran, the container shell did not start).
@pytest.mark.parametrize('variables, stage, rc, text, error, words', [
    ({}, 'node', 255, "container '101' not running!\n", AnsibleConnectionFailure,
     ["container '101' not running!", NODE]),
    ({}, 'node', 255, "Configuration file 'nodes/pve2/lxc/101.conf' does not exist\n", AnsibleConnectionFailure,
     ['not on node pve2', NODE, 'inventory that tracks nodes']),
    ({}, 'node', 127, 'bash: line 1: /usr/sbin/pct: No such file or directory\n', AnsibleConnectionFailure,
     ['/usr/sbin/pct not found on node', 'Proxmox VE node']),
    ({}, 'ssh', 255, 'root@127.0.9.1: Permission denied (publickey).\n', AnsibleAuthenticationFailure,
     ['SSH authentication to node root@' + NODE, 'Permission denied (publickey)']),
    ({}, 'ssh', 255, '@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n...\nHost key verification failed.\n',
     AnsibleConnectionFailure, ['does not match known_hosts', 'Host key checking stays on']),
    ({}, 'ssh', 255, 'No ED25519 host key is known for 127.0.9.1 and you have requested strict checking.\n'
                     'Host key verification failed.\n', AnsibleConnectionFailure, ['not in known_hosts']),
    ({}, 'ssh', 255, 'ssh: connect to host 127.0.9.1 port 22: Connection refused\n', AnsibleConnectionFailure,
     ['SSH to node root@127.0.9.1 failed: Connection refused', 'is sshd running']),
    ({'pct_node_become': True}, 'node', 1, 'sudo: a password is required\n', AnsibleConnectionFailure,
     ['node_become', 'NOPASSWD']),
    ({'pct_exec_method': 'lxc-attach'}, 'node', 1,
     'lxc-attach: 101: attach.c: lxc_attach: 1136 Failed to get init pid\n',
     AnsibleConnectionFailure, ['lxc-attach could not enter container 101', 'exec_method=pct']),
    # pct dies through Perl's die: the exit code follows errno (ENOENT 2 for a missing config, EACCES 13, ...).
    ({}, 'node', 2, "Configuration file 'nodes/pve2/lxc/101.conf' does not exist\n", AnsibleConnectionFailure,
     ['not on node pve2']),
    ({}, 'node', 13, "container '101' not running!\n", AnsibleConnectionFailure, ["container '101' not running!"]),
    ({}, 'node', 25, "Unknown option: keep-env\n400 unable to parse option\n", AnsibleConnectionFailure,
     ['does not know --keep-env', 'Proxmox VE before 8.2']),
    ({}, 'node', 9, 'something pct never said\n', AnsibleConnectionFailure,
     ['/usr/sbin/pct could not enter container 101 on node root@127.0.9.1 (exit code 9): something pct never said']),
])
def test_explain_errors(variables, stage, rc, text, error, words):
    variables.setdefault('ansible_user', 'root')
    conn = make_conn(**variables)
    clear = conn._explain_ssh(text) if stage == 'ssh' else conn._explain_node(rc, text)
    assert isinstance(clear, error)
    message = str(clear)
    assert '\n' not in message
    for word in words:
        assert word in message


def judged(conn, rc, stderr, stdout=b'', stage='finished'):
    """_judge on output shaped as the node gives it: the markers of each stage reached, around the command's stderr.

    ssh: no marker; node: pct started; container: the command started; finished: pct returned rc."""
    conn._wrap('true')
    shown = {'ssh': 0, 'node': 1, 'container': 2, 'finished': 2}[stage]
    head = b''.join(marker + b'\n' for marker in conn._markers[:shown])
    tail = conn._markers[2] + b' %d\n' % rc if stage == 'finished' else b''
    return conn._judge(rc, stdout, head + stderr + tail)


@pytest.mark.parametrize('variables, rc, text', [
    ({}, 1, b"container '102' not running!\n"),         # another container's words, printed by a command
    ({}, 2, b"Configuration file 'nodes/pve2/lxc/101.conf' does not exist\n"),   # printed by the command
    ({}, 2, b'ls: cannot access x: No such file or directory\n'),
    ({}, 255, b'some tool exited 255\n'),
    ({}, 255, b'git@github.com: Permission denied (publickey).\n'),   # an ssh inside the container
    ({}, 255, b'root@127.0.9.1: Permission denied (publickey).\n'),   # even towards the node itself
    ({'pct_node_become': True}, 1, b'sudo: a password is required\n'),  # sudo inside the container
    ({}, 127, b'/bin/sh: 1: /usr/sbin/pct: not found\n'),
])
def test_command_failures_are_the_tasks_own(variables, rc, text):
    """Once the container's shell has started, rc and output belong to the command: never UNREACHABLE."""
    conn = make_conn(ansible_user='root', **variables)
    assert judged(conn, rc, text) == (rc, b'', text)


def test_markers_are_removed_from_tty_output():
    conn = make_conn(ansible_user='root')
    conn._wrap('true')
    tty_out = b''.join(marker + b'\r\n' for marker in conn._markers[:2]) + b'{"ok": 1}\r\n' + conn._markers[2] + b' 0\r\n'
    assert conn._judge(0, tty_out, b'Shared connection to 127.0.9.1 closed.\r\n') == \
        (0, b'{"ok": 1}\r\n', b'Shared connection to 127.0.9.1 closed.\r\n')


@pytest.mark.parametrize('stage, rc, text, error, words', [
    ('ssh', 255, b'root@127.0.9.1: Permission denied (publickey).\n', AnsibleAuthenticationFailure, ['SSH authentication']),
    ('ssh', 255, b'', AnsibleConnectionFailure, ['SSH to node root@127.0.9.1 failed', 'without a message']),
    ('node', 2, b"Configuration file 'nodes/pve2/lxc/101.conf' does not exist\n", AnsibleConnectionFailure,
     ['not on node pve2']),
    ('node', 1, b"container '101' not running!\n", AnsibleConnectionFailure, ["container '101' not running!"]),
    ('container', 255, b'partial output\nConnection to 127.0.9.1 closed by remote host.\n', AnsibleConnectionFailure,
     ['dropped while the command ran in container 101 (Connection to 127.0.9.1 closed by remote host.)', 'not retried',
      'may still be running']),
    ('container', 255, b'', AnsibleConnectionFailure,     # a ControlMaster client says nothing when the master dies
     ['dropped while the command ran in container 101 (ssh exited 255 before the command ended)']),
])
def test_judge_blames_the_stage_that_failed(stage, rc, text, error, words):
    conn = make_conn(ansible_user='root')
    with pytest.raises(AnsibleError) as info:
        judged(conn, rc, text, stage=stage)
    assert isinstance(info.value, error)
    for word in words:
        assert word in str(info.value)


# -- streaming, with stand-ins for ssh and pct -------------------------------------------------------

@pytest.fixture
def local_node(tmp_path):
    """ssh stand-in: runs its last argument with /bin/sh; pct stand-in: `pct exec VMID -- ARGV`."""
    fake_ssh = tmp_path / 'ssh'
    fake_ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec /bin/sh -c "$last"\n')
    fake_pct = tmp_path / 'pct'
    fake_pct.write_text(textwrap.dedent("""\
        #!/bin/sh
        [ "$1" = exec ] || exit 2
        vmid=$2; shift 2
        [ "$1" = --keep-env ] && shift 2
        [ "$1" = -- ] || exit 2
        shift
        [ "$vmid" = 101 ] || { echo "container '$vmid' not running!" >&2; exit 255; }
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


def ssh_that_stops_reading(tmp_path, then):
    """ssh stand-in that closes its stdin at once (as ssh does when the node refuses it), then runs `then`."""
    fake_ssh = tmp_path / 'ssh'
    fake_ssh.write_text('#!/bin/sh\nexec 0<&-\n%s\n' % then)
    fake_ssh.chmod(0o755)
    return make_conn(ansible_ssh_executable=str(fake_ssh), ansible_ssh_args='', ansible_user='root')


def test_ssh_refused_while_the_module_is_sent_says_why(tmp_path):
    """ansible-core gives an ssh whose stdin broke 1 ms to exit, else the error is "Data could not be sent": an ssh
    refused by the node took longer on a loaded machine (CI, test_e_node_sshd_down). Its own words must come out."""
    conn = ssh_that_stops_reading(tmp_path, 'sleep 0.3\necho "ssh: connect to host %s port 22: Connection refused" >&2\n'
                                            'exit 255' % NODE)
    with pytest.raises(AnsibleConnectionFailure) as info:
        conn.exec_command('cat', in_data=b'x' * (1024 * 1024), sudoable=False)   # more than a pipe holds
    assert 'SSH to node root@%s failed: Connection refused (is sshd running on the node?)' % NODE in str(info.value), \
        str(info.value)


def test_an_ssh_that_stops_reading_and_lives_on_is_not_waited_for_long(tmp_path, monkeypatch):
    pidfile = tmp_path / 'ssh.pid'
    conn = ssh_that_stops_reading(tmp_path, 'echo $$ > %s\nexec sleep 60' % pidfile)
    monkeypatch.setattr(sys.modules[type(conn).__module__], 'SSH_EXIT_GRACE_S', 0.5)
    started = time.monotonic()
    try:
        with pytest.raises(AnsibleConnectionFailure) as info:
            conn.exec_command('cat', in_data=b'x' * (1024 * 1024), sudoable=False)
    finally:
        os.kill(int(pidfile.read_text()), 9)
    assert time.monotonic() - started < 30      # the stand-in sleeps 60 s
    assert 'failed before the node ran pct: Data could not be sent' in str(info.value), str(info.value)


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
    configure(local_node, {'ansible_host': NODE, 'pct_vmid': 102,
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
    assert 'sudo is not installed' in str(conn._explain_node(127, 'bash: line 1: sudo: command not found\r\n'))


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


# -- issue 12 -----------------------------------------------------------------------------------------

def stand_in(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    path.chmod(0o755)
    return str(path)


def local_conn(tmp_path, ssh, pct, **variables):
    return make_conn(ansible_ssh_executable=ssh, pct_executable=pct, ansible_ssh_args='', ansible_user='root',
                     **variables)


LOCAL_SSH = """\
    #!/bin/sh
    for last; do :; done
    exec /bin/sh -c "$last"
    """


def test_pct_errors_are_recognised_on_any_exit_code(tmp_path):
    """A real pct exits through Perl's die: exit code = errno (2 for the missing config), not 255."""
    pct = stand_in(tmp_path, 'pct', """\
        #!/bin/sh
        echo "Configuration file 'nodes/pve2/lxc/$2.conf' does not exist" >&2
        exit 2
        """)
    conn = local_conn(tmp_path, stand_in(tmp_path, 'ssh', LOCAL_SSH), pct)
    with pytest.raises(AnsibleConnectionFailure, match='container 101 is not on node pve2') as failure:
        conn.exec_command('true', sudoable=False)
    assert 'no such vmid on this node (`pct list`' in str(failure.value)   # issue 22: a mistyped vmid's remedy


def test_container_command_exiting_255_is_a_result_not_unreachable(tmp_path, local_node):
    rc, dummy, err = local_node.exec_command(
        "echo 'root@%s: Permission denied (publickey).' >&2; exit 255" % NODE, sudoable=False)
    assert rc == 255 and err == b'root@%s: Permission denied (publickey).\n' % NODE.encode()


def test_container_runs_with_a_clean_environment(tmp_path, monkeypatch):
    """The node session's variables (SSH_*, the node's locale) never reach the container."""
    monkeypatch.setenv('SSH_CONNECTION', '10.0.0.1 5555 10.0.0.2 22')
    monkeypatch.setenv('SSH_AUTH_SOCK', '/tmp/ssh-agent.sock')
    # pct/lxc-attach stand-in honouring --keep-env 0 / --clear-env as lxc-attach does: PATH and container=lxc.
    pct = stand_in(tmp_path, 'pct', """\
        #!/bin/sh
        keep=1
        case "$1" in exec) shift 2; [ "$1" = --keep-env ] && { keep=$2; shift 2; };;
                     -n) shift 2; [ "$1" = --clear-env ] && { keep=0; shift; };; esac
        shift
        [ "$keep" = 0 ] && exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin container=lxc "$@"
        exec "$@"
        """)
    ssh = stand_in(tmp_path, 'ssh', LOCAL_SSH)
    for method in ('pct', 'lxc-attach'):
        conn = local_conn(tmp_path, ssh, pct, pct_exec_method=method, pct_lxc_attach_executable=pct)
        rc, out, err = conn.exec_command('env', sudoable=False)
        assert (rc, err) == (0, b'')
        env = dict(line.split('=', 1) for line in out.decode().splitlines())
        assert 'SSH_CONNECTION' not in env and 'SSH_AUTH_SOCK' not in env and 'LC_ALL' not in env, env
        assert env['HOME'] == '/root' and env['USER'] == 'root' and env['LOGNAME'] == 'root'


def test_non_ascii_names_survive_pct_whatever_the_node_locale(tmp_path, monkeypatch):
    """pve-common decodes pct's arguments by the locale: under a node session in the C locale, a UTF-8 name
    would turn into U+FFFD. This pct stand-in decodes like Perl's decode('locale', ...)."""
    monkeypatch.setenv('LC_ALL', 'C')
    monkeypatch.setenv('LANG', 'C')
    monkeypatch.delenv('PYTHONUTF8', raising=False)
    pct = stand_in(tmp_path, 'pct', """\
        #!%s
        import locale, os, sys
        locale.setlocale(locale.LC_ALL, '')
        codeset = locale.nl_langinfo(locale.CODESET)
        args = [os.fsencode(a).decode(codeset, 'replace').encode('utf-8') for a in sys.argv[1:]]
        args = args[args.index(b'--') + 1:]
        os.execvp(args[0], args)
        """ % sys.executable)
    conn = local_conn(tmp_path, stand_in(tmp_path, 'ssh', LOCAL_SSH), pct)
    src = tmp_path / 'src'
    src.write_bytes(b'payload')
    remote = tmp_path / 'ünïcødé 名前.txt'
    conn.put_file(str(src), str(remote))
    assert sorted(os.listdir(tmp_path)) == sorted(['pct', 'ssh', 'src', remote.name])
    rc, out, dummy = conn.exec_command('printf %s "ü"', sudoable=False)
    assert (rc, out) == (0, 'ü'.encode())


BROKEN_PIPE_SSH = """\
    #!/bin/sh
    # The ControlPersist race: the first call meets a master that is going away.
    if [ ! -e %(flag)s ]; then
        : > %(flag)s
        echo 'mux_client_hello_exchange: write packet: Broken pipe' >&2
        exit 255
    fi
    echo call >> %(calls)s
    for last; do :; done
    exec /bin/sh -c "$last"
    """


@pytest.mark.parametrize('action', ['put', 'fetch', 'exec'])
def test_controlpersist_broken_pipe_is_retried_once(tmp_path, local_node, action):
    flag, calls = tmp_path / 'raced', tmp_path / 'calls'
    ssh = stand_in(tmp_path, 'ssh-race', BROKEN_PIPE_SSH % {'flag': flag, 'calls': calls})
    conn = local_conn(tmp_path, ssh, local_node.get_option('pct_executable'))
    src = tmp_path / 'src'
    src.write_bytes(b'data' * 1000)
    if action == 'put':
        conn.put_file(str(src), str(tmp_path / 'copy'))
        assert (tmp_path / 'copy').read_bytes() == src.read_bytes()
    elif action == 'fetch':
        conn.fetch_file(str(src), str(tmp_path / 'copy'))
        assert (tmp_path / 'copy').read_bytes() == src.read_bytes()
    else:
        assert conn.exec_command('echo ok', sudoable=False)[:2] == (0, b'ok\n')
    assert calls.read_text() == 'call\n'


def test_controlpersist_broken_pipe_twice_fails(tmp_path, local_node):
    ssh = stand_in(tmp_path, 'ssh-race', """\
        #!/bin/sh
        echo 'mux_client_hello_exchange: write packet: Broken pipe' >&2
        exit 255
        """)
    conn = local_conn(tmp_path, ssh, local_node.get_option('pct_executable'))
    src = tmp_path / 'src'
    src.write_bytes(b'x')
    with pytest.raises(AnsibleConnectionFailure, match='SSH to node root@127.0.9.1 failed'):
        conn.put_file(str(src), str(tmp_path / 'copy'))


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs (needs root)."""
    mount = tmp_path / 'full'
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail('needs root to mount a tmpfs')
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'b12-full', str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(['umount', '-l', str(mount)], check=False)


def test_fetch_onto_a_full_disk_stops_ssh_and_leaves_nothing(tmp_path, local_node, full_disk):
    src = tmp_path / 'big'
    with open(src, 'wb') as f:
        f.write(os.urandom(8 * 1024 * 1024))
    (full_disk / 'out').write_bytes(b'previous version')
    outcome = {}

    def fetch():
        try:
            local_node.fetch_file(str(src), str(full_disk / 'out'))
        except AnsibleError as ex:
            outcome['error'] = ex

    worker = threading.Thread(target=fetch, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), 'fetch onto a full disk hangs'
    assert time.monotonic() - start < 30
    assert 'No space left on device' in str(outcome.get('error')), outcome
    assert os.listdir(full_disk) == ['out']           # no partial file
    assert (full_disk / 'out').read_bytes() == b'previous version'   # replaced only when complete


def test_fetch_replaces_the_destination_only_when_complete(tmp_path, local_node):
    (tmp_path / 'out').write_bytes(b'previous version')
    with pytest.raises(AnsibleError, match='failed to fetch'):
        local_node.fetch_file(str(tmp_path / 'missing'), str(tmp_path / 'out'))
    assert (tmp_path / 'out').read_bytes() == b'previous version'
    assert not [name for name in os.listdir(tmp_path) if name.endswith('.part')]
    (tmp_path / 'src').write_bytes(b'new version')
    local_node.fetch_file(str(tmp_path / 'src'), str(tmp_path / 'out'))
    assert (tmp_path / 'out').read_bytes() == b'new version'
    assert oct((tmp_path / 'out').stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readme_sudoers():
    readme = os.path.join(os.path.dirname(__file__), '..', '..', '..', '..', 'README.md')
    with open(readme) as f:
        text = f.read()
    start = text.index('### Reaching containers') if '### Reaching containers' in text else text.index('## Reaching containers')
    section = text[start:text.index('\n## ', start + 3)]
    blocks = [block for block in section.split('```')[1::2] if 'NOPASSWD' in block]
    return section, blocks


def sudoers_commands(block):
    """(path, args pattern) of each command in the block's Cmnd_Alias lines, continuation lines joined."""
    joined = block.replace('\\\n', ' ')
    commands = []
    for line in joined.splitlines():
        if line.strip().startswith('Cmnd_Alias'):
            for spec in line.split('=', 1)[1].split(','):
                path, dummy, args = spec.strip().partition(' ')
                commands.append((path, args))
    return commands


def sudo_allows(commands, argv):
    """sudoers matching for a command with arguments: same path, fnmatch(pattern, args joined by spaces)."""
    return any(argv[0] == path and fnmatch.fnmatchcase(' '.join(argv[1:]), args) for path, args in commands)


def test_readme_sudoers_example_is_narrow_and_matches_what_the_plugin_runs(tmp_path):
    section, blocks = readme_sudoers()
    assert 'root-equivalent' in section and 'NOPASSWD: /usr/sbin/pct\n' not in section
    assert blocks, 'no sudoers example in the README section'
    block = blocks[0]
    if shutil.which('visudo'):
        rule = tmp_path / 'sudoers'
        rule.write_text(block.strip() + '\n')
        check = subprocess.run(['visudo', '-c', '-f', str(rule)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
    commands = sudoers_commands(block)
    for vmid in (101, 102):
        for method in ('pct', 'lxc-attach'):
            conn = make_conn(pct_vmid=vmid, pct_node_become=True, pct_exec_method=method, pct_command_timeout=30)
            argv = conn._node_argv(['/bin/sh', '-c', 'echo hi'])
            assert argv[:3] == ['sudo', '-n', '--']
            assert sudo_allows(commands, argv[3:]), argv
        assert sudo_allows(commands, ['/usr/sbin/pct', 'status', str(vmid)])
    for denied in (['/usr/sbin/pct', 'push', '101', '/etc/shadow', '/tmp/x'],
                   ['/usr/sbin/pct', 'pull', '101', '/tmp/x', '/etc/sudoers'],
                   ['/usr/sbin/pct', 'set', '101', '--mp0', '/,mp=/mnt'],
                   ['/usr/sbin/pct', 'exec', '103', '--keep-env', '0', '--', 'sh'],
                   ['/usr/sbin/pct', 'exec', '101', '--', 'sh'],
                   ['/usr/sbin/pct', 'enter', '101'],
                   ['/usr/bin/lxc-attach', '-n', '101', '-s', 'NETWORK', '--clear-env', '--', 'sh'],
                   ['/usr/bin/lxc-attach', '-n', '101', '--clear-env', '-s', 'NETWORK', '--', 'sh']):
        assert not sudo_allows(commands, denied), denied


def test_markers_are_found_behind_two_ttys():
    """ssh -tt and lxc-attach's own pty: the container's lines end in \\r\\r\\n (seen with LXC 5's lxc-attach)."""
    conn = make_conn(ansible_user='root')
    conn._wrap('true')
    node, container, end = conn._markers
    out = node + b'\r\n' + container + b'\r\r\n\r\r\n{"rc": 1}\r\r\n' + end + b' 1\r\n'
    assert conn._judge(1, out, b'Shared connection to 127.0.9.1 closed.\r\n') == \
        (1, b'\r\r\n{"rc": 1}\r\r\n', b'Shared connection to 127.0.9.1 closed.\r\n')


def test_a_transfer_stuck_on_the_node_ends_at_transfer_timeout(local_node, tmp_path):
    """Issue 18: pct itself hangs on the node (a held lock); the node's own timeout ends the transfer."""
    hung_pct = tmp_path / 'pct-hung'
    hung_pct.write_text('#!/bin/sh\nexec sleep 60\n')
    hung_pct.chmod(0o755)
    src = tmp_path / 'f'
    src.write_bytes(b'x')
    configure(local_node, {'ansible_host': NODE, 'pct_vmid': 101, 'pct_transfer_timeout': 1,
                           'ansible_ssh_executable': local_node.get_option('ssh_executable'),
                           'pct_executable': str(hung_pct), 'ansible_ssh_args': '', 'ansible_user': 'root'})
    for transfer in (lambda: local_node.put_file(str(src), str(tmp_path / 'copy')),
                     lambda: local_node.fetch_file(str(src), str(tmp_path / 'back'))):
        started = time.monotonic()
        with pytest.raises(AnsibleError) as info:
            transfer()
        assert time.monotonic() - started < 30      # the stand-in pct sleeps 60 s
        assert 'transfer_timeout' in str(info.value) and '\n' not in str(info.value), str(info.value)
    assert not (tmp_path / 'back').exists()


def test_the_private_ssh_internals_this_plugin_relies_on_by_core_version():
    """Where ansible-core's ssh plugin differs by version (make test-matrix runs 2.16 to 2.20, make test 2.21): _build_command and
    _bare_run are in every one; _init_shm (a password handed to ssh through shared memory) and sshpass_pipe set up
    front only from 2.19, so the plugin's streaming put/fetch uses them only where they exist."""
    from ansible import __version__ as core_version
    from ansible.plugins.connection import ssh
    core = tuple(int(part) for part in core_version.split('.')[:2])
    assert callable(getattr(ssh.Connection, '_build_command')) and callable(getattr(ssh.Connection, '_bare_run'))
    assert hasattr(ssh.Connection, '_init_shm') == (core >= (2, 19))
