"""gpuops.fleet.pct against a lab Proxmox node: real sshd, real ssh, real ansible-playbook.

One lab (LAB_ID=conn01 unless PCT_TEST_LAB_ID says otherwise): nodes pve1 (containers 101, 102)
and pve2 (201, 202). Container-side files go to the container's private /tmp (a tmpfs of its own).
"""
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from ansible.errors import AnsibleConnectionFailure
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

with warnings.catch_warnings():  # another test module may have set the collection loader up already
    warnings.simplefilter('ignore', UserWarning)
    init_plugin_loader()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, 'tests', 'lab', 'labctl')
VENV_BIN = os.path.dirname(os.path.abspath(sys.executable))
PLAYBOOK = os.path.join(VENV_BIN, 'ansible-playbook')
LAB_ID = os.environ.get('PCT_TEST_LAB_ID') or 'conn01-' + hashlib.sha1(os.path.realpath(REPO).encode()).hexdigest()[:6]
BIG = 50 * 1000 * 1000
ODD_NAME = "dir with space/ünïcödé 'q' \"dq\" $(echo x) *.bin"
PIPELINING = [pytest.param(True, id='pipelining'), pytest.param(False, id='no-pipelining')]


class Lab:
    """What the tests need from `labctl up` and its inventory."""

    def __init__(self, workdir):
        self.env = dict(os.environ, LAB_ID=LAB_ID, LAB_PCT_DELAY='0.1')
        self.workdir = workdir
        subprocess.run([LABCTL, 'up', '--nodes', '2', '--containers', '2', '--gpus', '1'], env=self.env,
                       check=True, stdout=subprocess.DEVNULL, timeout=300)
        self.inventory = subprocess.run([LABCTL, 'inventory'], env=self.env, check=True, capture_output=True,
                                        text=True).stdout.strip()
        with open(self.inventory) as f:
            groups = yaml.safe_load(f)['all']['children']
        self.cts = groups['gpu_containers']['hosts']
        self.nodes = {name: node['ansible_host'] for name, node in groups['pve_nodes']['hosts'].items()}
        self.ct = self.cts['ct101']
        self.node = self.ct['ansible_host']
        self.node_name = self.ct['lab_node']
        self.state = os.path.dirname(self.inventory)
        self.key = self.ct['ansible_ssh_private_key_file']
        self.known_hosts = os.path.join(self.state, 'ssh', 'known_hosts')
        self.sshd_log = os.path.join(self.state, 'nodes', self.node_name, 'sshd.log')
        self.cp_dir = os.path.join(workdir, 'cp')
        os.makedirs(self.cp_dir)

    def node_ssh(self, command):
        """Run a command on the node itself (not in a container)."""
        return subprocess.run(['ssh', '-i', self.key, '-o', 'UserKnownHostsFile=' + self.known_hosts,
                               '-o', 'BatchMode=yes', '-o', 'ControlPath=none', 'root@' + self.node, command],
                              capture_output=True, text=True, timeout=60, check=False)

    def accepted_connections(self):
        with open(self.sshd_log, errors='replace') as f:
            return f.read().count('Accepted publickey')

    def close_masters(self):
        for name in os.listdir(self.cp_dir):
            path = os.path.join(self.cp_dir, name)
            if not name.endswith('.lock'):
                subprocess.run(['ssh', '-o', 'ControlPath=' + path, '-O', 'exit', 'x'], capture_output=True,
                               timeout=30, check=False)

    def down(self):
        self.close_masters()
        subprocess.run([LABCTL, 'down'], env=self.env, stdout=subprocess.DEVNULL, timeout=300, check=False)


@pytest.fixture(scope='module')
def lab():
    workdir = tempfile.mkdtemp(prefix='gpuops-pct-test-')
    instance = None
    try:
        instance = Lab(workdir)
        yield instance
    finally:
        if instance is not None:
            instance.down()
        else:
            subprocess.run([LABCTL, 'down'], env=dict(os.environ, LAB_ID=LAB_ID), stdout=subprocess.DEVNULL,
                           check=False)
        shutil.rmtree(workdir, ignore_errors=True)


def run_play(lab, tasks, *, pipelining=True, hosts='ct101', extra_vars=None, inventory=None, verbose=False,
             forks=5, cp_dir=None, extra_env=None):
    """ansible-playbook on one play; returns (rc, output, results saved by `save` tasks)."""
    out_dir = tempfile.mkdtemp(dir=lab.workdir)
    play = [{
        'name': 'pct connection test', 'hosts': hosts, 'gather_facts': False,
        'vars': {'out_dir': out_dir, 'ansible_remote_tmp': '/tmp/.ansible/tmp',
                 'ansible_system_tmpdirs': ['/tmp']},
        'tasks': tasks,
    }]
    play_path = os.path.join(out_dir, 'play.yml')
    with open(play_path, 'w') as f:
        yaml.safe_dump(play, f, allow_unicode=True)
    cmd = [PLAYBOOK, '-i', inventory or lab.inventory, '-f', str(forks), play_path]
    for key, value in (extra_vars or {}).items():
        cmd += ['-e', json.dumps({key: value})]
    if verbose:
        cmd.append('-vvv')
    env = dict(os.environ, ANSIBLE_PIPELINING=str(pipelining), ANSIBLE_SSH_CONTROL_PATH_DIR=cp_dir or lab.cp_dir,
               ANSIBLE_NOCOLOR='1', ANSIBLE_RETRY_FILES_ENABLED='0', ANSIBLE_LOCAL_TEMP=os.path.join(out_dir, 'tmp'),
               PATH=VENV_BIN + os.pathsep + os.environ.get('PATH', ''))
    env.pop('ANSIBLE_CONFIG', None)
    env.update(extra_env or {})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out_dir, check=False)
    results = {}
    for name in os.listdir(out_dir):
        if name.endswith('.json'):
            with open(os.path.join(out_dir, name)) as f:
                results[name[:-5]] = json.load(f)
    return proc.returncode, proc.stdout + proc.stderr, results


def save(expression):
    """A task that writes {{ expression }} as JSON on the controller, one file per host."""
    return {'name': 'Save results', 'delegate_to': 'localhost',
            'ansible.builtin.copy': {'content': '{{ %s | to_json }}' % expression,
                                     'dest': '{{ out_dir }}/{{ inventory_hostname }}.json', 'mode': '0600'}}


def sha1(path):
    digest = hashlib.sha1()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


# -- exec -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('pipelining', PIPELINING)
def test_raw_command_and_module_run_inside_the_container(lab, pipelining):
    tasks = [
        {'ansible.builtin.raw': 'cat /proc/self/cgroup; echo "sum=$((6*7))"; hostname', 'register': 'raw',
         'changed_when': False},
        {'ansible.builtin.command': {'argv': ['printf', '%s|', 'a b', '$(id)', '*', "it's", 'ü\nnewline']},
         'register': 'cmd', 'changed_when': False},
        {'ansible.builtin.command': 'cat /proc/self/cgroup', 'register': 'cgroup', 'changed_when': False},
        {'ansible.builtin.stat': {'path': '/proc/1/comm'}, 'register': 'st'},
        save("{'raw': raw.stdout, 'cmd': cmd.stdout, 'cgroup': cgroup.stdout, 'st': st.stat.exists}"),
    ]
    rc, out, results = run_play(lab, tasks, pipelining=pipelining)
    assert rc == 0, out
    got = results['ct101']
    assert '0::/.lxc' in got['raw'] and 'sum=42' in got['raw'] and 'ct101' in got['raw']
    assert got['cmd'] == "a b|$(id)|*|it's|ü\nnewline|"
    assert got['cgroup'].splitlines()[-1] == '0::/.lxc'  # LXC's cgroup namespace: lxc-attach's tasks in .lxc
    assert got['st'] is True


def test_pipelining_costs_one_pct_exec_per_module_task(lab):
    tasks = [{'ansible.builtin.ping': None}, {'ansible.builtin.ping': None}, {'ansible.builtin.ping': None}]
    rc, out, dummy = run_play(lab, tasks, pipelining=True, verbose=True)
    assert rc == 0, out
    runs = [line for line in out.splitlines() if 'SSH: EXEC' in line or 'SSH: STREAM' in line]
    assert len(runs) == 3, '\n'.join(runs)
    assert all('pct exec 101 --' in line for line in runs)


@pytest.mark.parametrize('pipelining', PIPELINING)
def test_become_inside_the_container(lab, pipelining):
    tasks = [
        {'ansible.builtin.command': 'id -un', 'register': 'su_user', 'changed_when': False, 'become': True,
         'become_user': 'nobody', 'become_method': 'ansible.builtin.su', 'become_flags': '-s /bin/sh'},
        {'ansible.builtin.stat': {'path': '/proc/self', 'follow': True}, 'register': 'as_nobody', 'become': True,
         'become_user': 'nobody', 'become_method': 'ansible.builtin.su', 'become_flags': '-s /bin/sh'},
        {'ansible.builtin.command': 'id -un', 'register': 'plain', 'changed_when': False},
    ]
    keys = "'su': su_user.stdout, 'plain': plain.stdout, 'stat_uid': as_nobody.stat.uid"
    if shutil.which('sudo'):
        tasks.append({'ansible.builtin.command': 'id -un', 'register': 'sudo_user', 'changed_when': False,
                      'become': True, 'become_user': 'nobody', 'become_method': 'ansible.builtin.sudo'})
        keys += ", 'sudo': sudo_user.stdout"
    tasks.append(save('{%s}' % keys))
    rc, out, results = run_play(lab, tasks, pipelining=pipelining)
    assert rc == 0, out
    got = results['ct101']
    assert got['su'] == 'nobody' and got['plain'] == 'root'
    assert got['stat_uid'] == 65534  # /proc/self of the module's own process
    if 'sudo' in got:
        assert got['sudo'] == 'nobody'


def test_node_become_runs_pct_through_sudo(lab):
    """root on the node with node_become: the same pct call, through `sudo -n --`."""
    tasks = [{'ansible.builtin.command': 'cat /proc/self/cgroup', 'register': 'cg', 'changed_when': False},
             save("{'cgroup': cg.stdout}")]
    rc, out, results = run_play(lab, tasks, verbose=True, extra_vars={'pct_node_become': True})
    node_has_sudo = lab.node_ssh('command -v sudo').returncode == 0
    if node_has_sudo:
        assert rc == 0, out
        assert results['ct101']['cgroup'].splitlines()[-1] == '0::/.lxc'
        assert "sudo -n -- /usr/sbin/pct exec 101 --" in out
    else:
        assert rc != 0
        assert_one_clear_line(out, 'ct101', 'node_become: sudo is not installed on node')


# -- files ------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def big_file(lab):
    path = os.path.join(lab.workdir, 'big.bin')
    with open(path, 'wb') as f:
        for dummy in range(BIG // 1000000):
            f.write(os.urandom(1000000))
    return path


@pytest.mark.parametrize('pipelining', PIPELINING)
def test_copy_and_fetch_50mb_and_odd_names(lab, big_file, pipelining):
    dest = '/tmp/pct-test/' + ODD_NAME
    fetched_dir = tempfile.mkdtemp(dir=lab.workdir)
    small = os.path.join(lab.workdir, 'ünï small.txt')
    with open(small, 'w') as f:
        f.write('small file ü\n')
    tasks = [
        {'ansible.builtin.file': {'path': os.path.dirname(dest), 'state': 'directory', 'mode': '0755'}},
        {'ansible.builtin.copy': {'src': big_file, 'dest': dest, 'mode': '0600'}},
        {'ansible.builtin.copy': {'src': small, 'dest': '/tmp/pct-test/ünï small.txt', 'mode': '0644'}},
        {'ansible.builtin.stat': {'path': dest, 'checksum_algorithm': 'sha1'}, 'register': 'remote'},
        {'ansible.builtin.fetch': {'src': dest, 'dest': fetched_dir + '/', 'flat': True}},
        {'ansible.builtin.fetch': {'src': '/tmp/pct-test/ünï small.txt', 'dest': fetched_dir + '/', 'flat': True}},
        {'ansible.builtin.file': {'path': '/tmp/pct-test', 'state': 'absent'}},
        save("{'sha1': remote.stat.checksum, 'size': remote.stat.size}"),
    ]
    rc, out, results = run_play(lab, tasks, pipelining=pipelining)
    assert rc == 0, out
    expected = sha1(big_file)
    assert results['ct101'] == {'sha1': expected, 'size': BIG}
    assert sha1(os.path.join(fetched_dir, os.path.basename(dest))) == expected
    with open(os.path.join(fetched_dir, 'ünï small.txt')) as f:
        assert f.read() == 'small file ü\n'


# -- errors -----------------------------------------------------------------------------------------

def assert_one_clear_line(out, host, text):
    lines = [line for line in out.splitlines() if line.startswith('fatal: [%s]' % host)]
    assert lines, out
    assert 'UNREACHABLE' in lines[0] and text in lines[0], lines[0]
    assert 'Traceback' not in out


def test_stopped_container(lab):
    stopped = lab.node_ssh('pct stop 102')
    assert stopped.returncode == 0, stopped.stderr
    try:
        for pipelining, task in ((True, {'ansible.builtin.ping': None}), (False, {'ansible.builtin.raw': 'true'})):
            rc, out, dummy = run_play(lab, [task], hosts='ct102', pipelining=pipelining)
            assert rc != 0
            assert_one_clear_line(out, 'ct102', "container '102' not running!")
        rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], hosts='ct102',
                                  extra_vars={'pct_exec_method': 'lxc-attach'})
        assert rc != 0
        assert_one_clear_line(out, 'ct102', 'lxc-attach could not enter container 102')
    finally:
        lab.node_ssh('pct start 102')


def test_container_on_another_node(lab):
    # ct201 lives on pve2; an inventory that still puts it on pve1 gets pct's refusal, explained.
    rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], hosts='ct201',
                              extra_vars={'ansible_host': lab.nodes['pve1']})
    assert rc != 0
    assert_one_clear_line(out, 'ct201', 'container 201 is not on node pve1 (%s)' % lab.nodes['pve1'])
    assert 'inventory that tracks nodes' in out


def test_missing_pct(lab):
    rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], extra_env={'ANSIBLE_PCT_EXECUTABLE': '/usr/sbin/pct-gone'})
    assert rc != 0
    assert_one_clear_line(out, 'ct101', '/usr/sbin/pct-gone not found on node')


def test_bad_key(lab):
    key = os.path.join(lab.workdir, 'stranger_key')
    if not os.path.exists(key):
        subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', key], check=True)
    cp_dir = tempfile.mkdtemp(dir=lab.workdir)
    rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], cp_dir=cp_dir,
                              extra_vars={'ansible_ssh_private_key_file': key})
    assert rc != 0
    assert_one_clear_line(out, 'ct101', 'SSH authentication to node root@%s failed (Permission denied' % lab.node)


def test_host_key_mismatch_and_checking_stays_on(lab):
    wrong = os.path.join(lab.workdir, 'wrong_hostkey')
    if not os.path.exists(wrong):
        subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', wrong], check=True)
    with open(wrong + '.pub') as f:
        key_type, key_b64 = f.read().split()[:2]
    known = os.path.join(lab.workdir, 'known_hosts_wrong')
    with open(known, 'w') as f:
        f.write('%s %s %s\n' % (lab.node, key_type, key_b64))
    empty = os.path.join(lab.workdir, 'known_hosts_empty')
    open(empty, 'w').close()
    for known_hosts, text in ((known, 'does not match known_hosts'), (empty, 'not in known_hosts')):
        cp_dir = tempfile.mkdtemp(dir=lab.workdir)
        rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], cp_dir=cp_dir, extra_vars={
            'ansible_ssh_common_args': '-o UserKnownHostsFile=%s -o IdentitiesOnly=yes' % known_hosts})
        assert rc != 0
        assert_one_clear_line(out, 'ct101', text)
        assert 'Host key checking stays on' in out


# -- one SSH connection per node ----------------------------------------------------------------------

@pytest.mark.parametrize('forks', [1, 2])
def test_containers_of_one_node_share_one_ssh_connection(lab, forks):
    cp_dir = tempfile.mkdtemp(dir=lab.workdir)
    before = lab.accepted_connections()
    tasks = [{'ansible.builtin.ping': None}, {'ansible.builtin.raw': 'true', 'changed_when': False}]
    rc, out, dummy = run_play(lab, tasks, hosts='ct101:ct102', forks=forks, cp_dir=cp_dir)  # both on pve1
    assert rc == 0, out
    assert out.count('ok=2') == 2
    time.sleep(0.2)
    assert lab.accepted_connections() - before == 1
    sockets = [name for name in os.listdir(cp_dir) if not name.endswith('.lock')]
    assert len(sockets) == 1
    subprocess.run(['ssh', '-o', 'ControlPath=' + os.path.join(cp_dir, sockets[0]), '-O', 'exit', 'x'],
                   capture_output=True, timeout=30, check=False)


# -- quoting, proven -----------------------------------------------------------------------------------

def plugin_connection(lab, **variables):
    conn = connection_loader.get('gpuops.fleet.pct', PlayContext())
    options = dict(lab.ct, ansible_control_path_dir=lab.cp_dir)
    options.update(variables)
    conn.set_options(var_options=options)
    return conn


ARGS = st.lists(st.text(alphabet=st.characters(blacklist_categories=('Cs',), blacklist_characters='\x00'),
                        max_size=24) | st.sampled_from(["'", '"', '$(id)', '`id`', '*', '\n', '\\', '$HOME', '-e',
                                                        "'\"'", '~', ';', '&&', '|', '#', ' ']),
                min_size=0, max_size=6)
PROPERTY = settings(max_examples=int(os.environ.get('PCT_PROPERTY_EXAMPLES', '40')), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def argv_seen_in_container(conn, args):
    """The argv that a process in the container got, read back NUL-separated."""
    cmd = "printf '%s\\0' " + ' '.join(shlex.quote(a) for a in args) if args else 'true'
    rc, out, err = conn.exec_command(cmd, sudoable=False)
    assert rc == 0, err
    return [part.decode('utf-8') for part in out.split(b'\0')[:-1]]


@PROPERTY
@given(args=ARGS)
def test_any_argv_reaches_the_container_unchanged(lab, args):
    assert argv_seen_in_container(plugin_connection(lab), args) == args


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=ARGS)
def test_any_argv_reaches_the_container_unchanged_lxc_attach(lab, args):
    assert argv_seen_in_container(plugin_connection(lab, pct_exec_method='lxc-attach'), args) == args


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(alphabet=st.characters(blacklist_categories=('Cs',), blacklist_characters='\x00/'),
                    min_size=1, max_size=30).filter(lambda n: n not in ('.', '..')),
       data=st.binary(max_size=4096))
def test_any_file_name_and_content_round_trip(lab, name, data):
    conn = plugin_connection(lab)
    local = os.path.join(lab.workdir, 'prop-src')
    back = os.path.join(lab.workdir, 'prop-back')
    with open(local, 'wb') as f:
        f.write(data)
    remote = '/tmp/' + name
    try:
        conn.put_file(local, remote)
        conn.fetch_file(remote, back)
        with open(back, 'rb') as f:
            assert f.read() == data
    finally:
        conn.exec_command('rm -f -- %s' % shlex.quote(remote), sudoable=False)


def test_plugin_api_reports_a_stopped_container(lab):
    stopped = lab.node_ssh('pct stop 102')
    assert stopped.returncode == 0, stopped.stderr
    try:
        conn = plugin_connection(lab, pct_vmid=102)
        with pytest.raises(AnsibleConnectionFailure, match=re.escape("container '102' not running!")):
            conn.exec_command('true', sudoable=False)
    finally:
        lab.node_ssh('pct start 102')


@pytest.mark.timing
def test_command_timeout_stops_the_command_in_the_container(lab):
    conn = plugin_connection(lab, pct_command_timeout=1)
    start = time.monotonic()
    rc, dummy, dummy2 = conn.exec_command('sleep 30', sudoable=False)
    assert rc == 124
    assert time.monotonic() - start < 25  # the command sleeps 30 s
    rc, out, dummy = conn.exec_command('ps -eo args', sudoable=False)
    assert b'sleep 30' not in out


def test_lab_pct_shape_is_what_the_plugin_expects(lab):
    """Guard: the lab node answers like Proxmox for a vmid it does not host."""
    result = lab.node_ssh('pct exec 999 -- true')
    assert result.returncode == 2  # Perl's die with errno ENOENT from pmxcfs (pve-container's load_config)
    assert textwrap.dedent(result.stderr).strip() == \
        "Configuration file 'nodes/%s/lxc/999.conf' does not exist" % lab.node_name


# -- issue 12: hardening ---------------------------------------------------------------------------------

def fresh_cp_dir(lab):
    return tempfile.mkdtemp(dir=lab.workdir)


def lab_status(lab):
    return json.loads(subprocess.run([LABCTL, 'status'], env=lab.env, capture_output=True, text=True, timeout=60,
                                     check=False).stdout)


def node_sshd(lab, node):
    """Host pid of the node's listening sshd (it runs in the node's own pid namespace, below the node's init)."""
    config = os.path.join(lab.state, 'nodes', node, 'sshd_config')   # this lab's: another worker's may run beside
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/cmdline' % name, 'rb') as f:
                argv = f.read().decode(errors='replace').split('\0')
        except OSError:
            continue
        # OpenSSH retitles its listener "sshd: /usr/sbin/sshd -D -f CONFIG [listener] ..."
        words = ' '.join(argv).split()
        if words[:1] in (['/usr/sbin/sshd'], ['sshd:']) and '-D' in words and any(w.endswith(config) for w in words):
            return int(name)
    raise AssertionError('no listening sshd of node %s' % node)


def sshd_sessions(sshd_pid):
    """The per-connection sshd processes under the node's listening sshd."""
    with open('/proc/%d/task/%d/children' % (sshd_pid, sshd_pid)) as f:
        return [int(pid) for pid in f.read().split()]


def run_play_bounded(lab, tasks, limit, **kwargs):
    """run_play, but a play that hangs is killed (with its ssh processes) after `limit` seconds."""
    out_dir = tempfile.mkdtemp(dir=lab.workdir)
    play = [{'name': 'bounded', 'hosts': kwargs.get('hosts', 'ct101'), 'gather_facts': False,
             'vars': {'out_dir': out_dir, 'ansible_remote_tmp': '/tmp/.ansible/tmp', 'ansible_system_tmpdirs': ['/tmp']},
             'tasks': tasks}]
    play_path = os.path.join(out_dir, 'play.yml')
    with open(play_path, 'w') as f:
        yaml.safe_dump(play, f, allow_unicode=True)
    env = dict(os.environ, ANSIBLE_SSH_CONTROL_PATH_DIR=kwargs.get('cp_dir') or fresh_cp_dir(lab), ANSIBLE_NOCOLOR='1',
               ANSIBLE_RETRY_FILES_ENABLED='0', ANSIBLE_LOCAL_TEMP=os.path.join(out_dir, 'tmp'),
               PATH=VENV_BIN + os.pathsep + os.environ.get('PATH', ''))
    env.pop('ANSIBLE_CONFIG', None)
    proc = subprocess.Popen([PLAYBOOK, '-i', lab.inventory, play_path], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=out_dir, start_new_session=True)
    try:
        out = proc.communicate(timeout=limit)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out = proc.communicate()[0]
        return None, out
    return proc.returncode, out


def test_b1_fetch_onto_a_full_disk_fails_fast_and_leaves_nothing(lab):
    """E 'a full disk on fetch': ssh is stopped, the partial file removed, an older copy kept, one clear error."""
    full = tempfile.mkdtemp(dir=lab.workdir)
    subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=2m', 'b12-full', full], check=True)
    try:
        with open(os.path.join(full, 'big.bin'), 'wb') as f:
            f.write(b'older copy')
        tasks = [{'ansible.builtin.command': 'dd if=/dev/urandom of=/tmp/b12-big.bin bs=1M count=20',
                  'changed_when': False},
                 {'ansible.builtin.fetch': {'src': '/tmp/b12-big.bin', 'dest': full + '/', 'flat': True}}]
        start = time.monotonic()
        rc, out = run_play_bounded(lab, tasks, limit=120)
        assert rc is not None, 'fetch onto a full disk hung for 120 s:\n' + out[-2000:]
        assert time.monotonic() - start < 120
        assert rc != 0
        assert 'No space left on device' in out, out
        assert os.listdir(full) == ['big.bin']
        with open(os.path.join(full, 'big.bin'), 'rb') as f:
            assert f.read() == b'older copy'
    finally:
        subprocess.run(['umount', '-l', full], check=False)
        plugin_connection(lab).exec_command('rm -f /tmp/b12-big.bin', sudoable=False)


def test_b2_pct_error_with_errno_exit_code_is_recognised(lab):
    """E 'a vmid on another node': Perl's die exits with errno (2 for the missing config), not 255."""
    wrapper = os.path.join(lab.workdir, 'pct-errno')
    with open(wrapper, 'w') as f:
        f.write('#!/bin/sh\n/usr/sbin/pct "$@" 2>/tmp/b12-pct-err.$$; rc=$?\ncat /tmp/b12-pct-err.$$ >&2\n'
                'grep -q "does not exist" /tmp/b12-pct-err.$$ && rc=2\nrm -f /tmp/b12-pct-err.$$\nexit $rc\n')
    os.chmod(wrapper, 0o755)
    rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], hosts='ct201',
                              extra_vars={'ansible_host': lab.nodes['pve1']}, extra_env={'ANSIBLE_PCT_EXECUTABLE': wrapper})
    assert rc != 0
    assert_one_clear_line(out, 'ct201', 'container 201 is not on node pve1 (%s)' % lab.nodes['pve1'])


@pytest.mark.parametrize('pipelining', PIPELINING)
def test_b2_command_failures_are_the_tasks_own(lab, pipelining):
    """A command that exits 255 or prints ssh/sudo refusals fails its task; the host stays reachable."""
    tasks = [
        {'ansible.builtin.shell': "echo 'root@%s: Permission denied (publickey).' >&2; exit 255" % lab.node,
         'register': 'denied', 'ignore_errors': True},
        {'ansible.builtin.shell': "echo 'sudo: a password is required' >&2; exit 1", 'register': 'sudo',
         'ignore_errors': True},
        {'ansible.builtin.ping': None},
    ]
    rc, out, dummy = run_play(lab, tasks, pipelining=pipelining, extra_vars={'pct_node_become': True})
    assert 'UNREACHABLE' not in out, out
    assert re.search(r'ct101\s+: ok=3 .*unreachable=0 +failed=0 .*ignored=2', out), out
    assert rc == 0, out


def env_in_container(conn):
    rc, out, err = conn.exec_command('env', sudoable=False)
    assert rc == 0, err
    return dict(line.split('=', 1) for line in out.decode().splitlines() if '=' in line)


@pytest.mark.parametrize('method', ['pct', 'lxc-attach'])
def test_b3_container_environment_is_not_the_node_sessions(lab, method, tmp_path):
    agent = subprocess.run(['ssh-agent', '-s', '-a', str(tmp_path / 'agent.sock')], capture_output=True, text=True,
                           check=True).stdout
    sock = re.search(r'SSH_AUTH_SOCK=([^;]+);', agent).group(1)
    agent_pid = int(re.search(r'SSH_AGENT_PID=(\d+);', agent).group(1))
    old_sock = os.environ.get('SSH_AUTH_SOCK')
    os.environ['SSH_AUTH_SOCK'] = sock
    cp_dir = fresh_cp_dir(lab)
    try:
        conn = plugin_connection(lab, pct_exec_method=method, ansible_control_path_dir=cp_dir,
                                 ansible_ssh_extra_args='-A')
        on_node = lab.node_ssh('true')  # the node session does have these
        assert on_node.returncode == 0
        env = env_in_container(conn)
    finally:
        # end the master connection: the node's sshd then removes the forwarded agent's socket from /tmp
        for name in os.listdir(cp_dir):
            subprocess.run(['ssh', '-o', 'ControlPath=' + os.path.join(cp_dir, name), '-O', 'exit', 'node'],
                           capture_output=True, timeout=30, check=False)
        os.kill(agent_pid, 15)
        if old_sock is None:
            os.environ.pop('SSH_AUTH_SOCK', None)
        else:
            os.environ['SSH_AUTH_SOCK'] = old_sock
    leaked = sorted(name for name in env if name.startswith('SSH_') or name in ('LC_ALL', 'LANG', 'MAIL', 'SHELL'))
    assert leaked == [], env
    assert env['HOME'] == '/root' and env['USER'] == 'root' and env['LOGNAME'] == 'root', env


def test_b3_node_session_has_what_the_container_must_not_get(lab, tmp_path):
    """Guard for the test above: the node's session does carry SSH_CONNECTION and a forwarded agent."""
    agent = subprocess.run(['ssh-agent', '-s', '-a', str(tmp_path / 'agent.sock')], capture_output=True, text=True,
                           check=True).stdout
    sock = re.search(r'SSH_AUTH_SOCK=([^;]+);', agent).group(1)
    agent_pid = int(re.search(r'SSH_AGENT_PID=(\d+);', agent).group(1))
    try:
        seen = subprocess.run(['ssh', '-A', '-i', lab.key, '-o', 'UserKnownHostsFile=' + lab.known_hosts, '-o',
                               'BatchMode=yes', '-o', 'ControlPath=none', 'root@' + lab.node, 'env'],
                              env=dict(os.environ, SSH_AUTH_SOCK=sock), capture_output=True, text=True, timeout=60,
                              check=False).stdout
    finally:
        os.kill(agent_pid, 15)
    assert 'SSH_CONNECTION=' in seen and 'SSH_AUTH_SOCK=' in seen


def test_e_ssh_dropped_mid_task_is_reported_and_not_retried(lab):
    sshd_pid = node_sshd(lab, lab.node_name)
    marker = '/tmp/b12-runs-%d' % os.getpid()
    conn = plugin_connection(lab, ansible_control_path_dir=fresh_cp_dir(lab), ansible_ssh_retries=2)
    before = set(sshd_sessions(sshd_pid))
    outcome = {}

    def run():
        try:
            outcome['result'] = conn.exec_command('echo run >> %s; sleep 60' % marker, sudoable=False)
        except AnsibleConnectionFailure as ex:
            outcome['error'] = ex

    worker = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    worker.start()
    probe = plugin_connection(lab, ansible_control_path_dir=fresh_cp_dir(lab))
    for dummy in range(100):
        if probe.exec_command('cat %s 2>/dev/null' % marker, sudoable=False)[1]:
            break
        time.sleep(0.1)
    ours = set(sshd_sessions(sshd_pid)) - before
    probe.close()
    ours = [pid for pid in ours if pid in sshd_sessions(sshd_pid)]
    assert ours
    for pid in ours:
        os.kill(pid, 9)
    worker.join(90)
    elapsed = time.monotonic() - start
    time.sleep(1)
    runs = probe.exec_command('cat %s; rm -f %s' % (marker, marker), sudoable=False)[1].decode().split()
    assert 'error' in outcome, outcome
    message = str(outcome['error'])
    assert 'dropped while the command ran in container 101' in message and 'not retried' in message, message
    assert runs == ['run'], runs
    assert elapsed < 45  # the command sleeps 60 s


def test_e_node_sshd_down(lab):
    sshd = node_sshd(lab, 'pve2')
    os.kill(sshd, 15)
    try:
        for dummy in range(50):
            if not os.path.exists('/proc/%d' % sshd):
                break
            time.sleep(0.1)
        rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}], hosts='ct201', cp_dir=fresh_cp_dir(lab))
        assert rc != 0
        assert_one_clear_line(out, 'ct201', 'SSH to node root@%s failed: Connection refused (is sshd running on the node?)'
                              % lab.nodes['pve2'])
    finally:
        # a lab node ends with its sshd (its init leaves then): build the lab afresh for the tests that follow
        subprocess.run([LABCTL, 'down'], env=lab.env, check=False, stdout=subprocess.DEVNULL, timeout=300)
        subprocess.run([LABCTL, 'up', '--nodes', '2', '--containers', '2', '--gpus', '1'], env=lab.env, check=True,
                       stdout=subprocess.DEVNULL, timeout=300)
        subprocess.run([LABCTL, 'inventory'], env=lab.env, check=True, stdout=subprocess.DEVNULL, timeout=60)


def test_e_container_stopped_while_a_command_runs(lab):
    conn = plugin_connection(lab, pct_vmid=102, ansible_control_path_dir=fresh_cp_dir(lab))
    outcome = {}

    def run():
        try:
            outcome['result'] = conn.exec_command('sleep 30', sudoable=False)
        except AnsibleConnectionFailure as ex:
            outcome['error'] = ex

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    time.sleep(2)
    try:
        stopped = lab.node_ssh('pct stop 102')
        assert stopped.returncode == 0, stopped.stderr
        worker.join(30)
        assert not worker.is_alive()
        assert 'error' in outcome, outcome
        assert "container '102' stopped while the task ran" in str(outcome['error'])
    finally:
        lab.node_ssh('pct start 102')


def test_e_container_stopped_mid_play(lab):
    stop = {'name': 'Stop the container between tasks', 'delegate_to': 'localhost',
            'ansible.builtin.command': {'argv': ['ssh', '-i', lab.key, '-o', 'UserKnownHostsFile=' + lab.known_hosts,
                                                 '-o', 'BatchMode=yes', '-o', 'ControlPath=none',
                                                 'root@' + lab.node, 'pct stop 102']}}
    try:
        rc, out, dummy = run_play(lab, [{'ansible.builtin.ping': None}, stop, {'ansible.builtin.ping': None}],
                                  hosts='ct102')
        assert rc != 0
        assert 'ok: [ct102]' in out
        assert_one_clear_line(out, 'ct102', "container '102' not running!")
    finally:
        lab.node_ssh('pct start 102')
