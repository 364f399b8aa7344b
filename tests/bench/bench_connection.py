"""Benchmark gpuops.fleet.pct against community.proxmox.proxmox_pct_remote (the anchor).

Same lab node, same play, same run. The anchor comes from the `ansible` 12.x package, in its own
venv `.bench/anchor-venv` (made here when missing). Figures:
- pct invocations per module task: the node's processes are sampled from /proc every 20 ms. Each lab
  `pct` lives at least its start-up delay (0.3 s), so none is missed. A pct that becomes lxc-attach
  keeps its pid and is counted once. The count includes the play's one-off calls (the anchor's home
  directory lookup), divided by the number of tasks.
- wall time of one ansible-playbook run with 10 ansible.builtin.ping tasks into one container: anchor,
  ours with exec_method pct, ours with lxc-attach, and plain OpenSSH with pipelining to the node itself.
  Each run starts cold (new ControlPath folder). Runs alternate between variants; medians are printed.
- SSH connections opened for one ping into each of 8 containers of one node, forks=1 and forks=8:
  `Accepted publickey` lines added to the node's sshd log.
Prints a Markdown fragment on stdout; progress goes to stderr.
"""
import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, 'tests', 'lab', 'labctl')
OUR_BIN = os.path.join(REPO, '.venv', 'bin')
ANCHOR_VENV = os.path.join(REPO, '.bench', 'anchor-venv')
ANCHOR_BIN = os.path.join(ANCHOR_VENV, 'bin')
SSH_ARGS = '-o ControlMaster=auto -o ControlPersist=60s'
VARIANTS = ('anchor', 'pct', 'lxc', 'ssh')
LABELS = {'anchor': 'anchor (proxmox_pct_remote)', 'pct': 'ours, exec_method=pct',
          'lxc': 'ours, exec_method=lxc-attach', 'ssh': 'plain OpenSSH to the node, pipelining'}


def log(msg):
    sys.stderr.write('bench_connection: %s\n' % msg)
    sys.stderr.flush()


def ensure_anchor_venv():
    if os.path.exists(os.path.join(ANCHOR_BIN, 'ansible-playbook')):
        return
    log('installing the anchor (ansible 12.x from PyPI) into %s' % ANCHOR_VENV)
    subprocess.run([sys.executable, '-m', 'venv', ANCHOR_VENV], check=True)
    subprocess.run([os.path.join(ANCHOR_BIN, 'pip'), 'install', '-q', 'ansible>=12,<13', 'paramiko'], check=True)


def anchor_versions():
    code = ('import json, ansible.release as r, importlib.metadata as m;'
            'c = json.load(open(__import__("os").path.join(__import__("ansible_collections.community.proxmox",'
            'fromlist=["x"]).__path__[0], "MANIFEST.json")))["collection_info"]["version"];'
            'print(json.dumps([m.version("ansible"), r.__version__, c]))')
    out = subprocess.run([os.path.join(ANCHOR_BIN, 'python'), '-c', code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


class NodeSampler:
    """Counts processes of one lab node by kind (pct, lxc-attach), sampling /proc."""

    def __init__(self, node_dir, period=0.02):
        self.node_dir = node_dir
        self.period = period
        self.seen = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            for pid in os.listdir('/proc'):
                if not pid.isdigit():
                    continue
                try:
                    with open('/proc/%s/cmdline' % pid, 'rb') as f:
                        argv = f.read().split(b'\0')
                    with open('/proc/%s/stat' % pid, 'rb') as f:
                        start = f.read().rsplit(b')', 1)[1].split()[19]
                except OSError:
                    continue
                key = (pid, start)
                if key in self.seen or self.node_dir.encode() not in argv[:6]:
                    continue
                # python3 -I .../tests/lab/node/pct --node-dir NODE_DIR ARGS
                tools = [os.path.basename(a) for a in argv[:3] if os.path.basename(a) in (b'pct', b'lxc-attach')]
                if tools:
                    self.seen[key] = tools[0].decode()
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.1)
        self._stop.set()
        self._thread.join()

    def count(self, tool):
        return sum(1 for kind in self.seen.values() if kind == tool)


class Bench:
    def __init__(self, args):
        self.args = args
        self.lab_env = dict(os.environ, LAB_ID=args.lab_id, LAB_PCT_DELAY=str(args.pct_delay))
        self.work = tempfile.mkdtemp(prefix='gpuops-bench-conn-')

    # -- lab and inventories
    def up(self):
        log('lab %s up: 1 node, 8 containers, pct delay %.2f s' % (self.args.lab_id, self.args.pct_delay))
        subprocess.run([LABCTL, 'up', '--nodes', '1', '--containers', '8', '--gpus', '1'], env=self.lab_env,
                       check=True, stdout=subprocess.DEVNULL)
        path = subprocess.run([LABCTL, 'inventory'], env=self.lab_env, check=True, capture_output=True,
                              text=True).stdout.strip()
        with open(path) as f:
            groups = yaml.safe_load(f)['all']['children']
        self.cts = groups['gpu_containers']['hosts']
        self.node_name, self.node = next(iter(groups['pve_nodes']['hosts'].items()))
        self.state = os.path.dirname(path)
        self.node_dir = os.path.join(self.state, 'nodes', self.node_name)
        self.sshd_log = os.path.join(self.node_dir, 'sshd.log')
        self.inventories = {v: self._inventory(v) for v in VARIANTS}
        # The anchor (paramiko) reads ~/.ssh/known_hosts only: give it a HOME with the lab's node keys.
        self.anchor_home = os.path.join(self.work, 'anchor-home')
        os.makedirs(os.path.join(self.anchor_home, '.ssh'), mode=0o700)
        shutil.copy(os.path.join(self.state, 'ssh', 'known_hosts'),
                    os.path.join(self.anchor_home, '.ssh', 'known_hosts'))

    def _inventory(self, variant):
        hosts = {}
        if variant == 'ssh':
            # Same interpreter as the containers', so that only the way in differs.
            python = next(iter(self.cts.values()))['ansible_python_interpreter']
            node = dict(self.node, ansible_ssh_args=SSH_ARGS, ansible_remote_tmp='/tmp/.ansible/tmp',
                        ansible_python_interpreter=python)
            hosts[self.node_name] = node
        for name, ct in self.cts.items():
            host = {k: ct[k] for k in ('ansible_host', 'ansible_user', 'ansible_ssh_private_key_file',
                                       'ansible_python_interpreter')}
            host['ansible_remote_tmp'] = '/tmp/.ansible/tmp'
            if variant == 'anchor':
                host.update(ansible_connection='community.proxmox.proxmox_pct_remote', proxmox_vmid=ct['pct_vmid'])
            elif variant in ('pct', 'lxc'):
                host.update(ansible_connection='gpuops.fleet.pct', pct_vmid=ct['pct_vmid'],
                            ansible_ssh_common_args=ct['ansible_ssh_common_args'],
                            pct_exec_method='pct' if variant == 'pct' else 'lxc-attach')
            else:
                continue
            hosts[name] = host
        path = os.path.join(self.work, 'inventory-%s.yml' % variant)
        with open(path, 'w') as f:
            yaml.safe_dump({'all': {'hosts': hosts}}, f)
        return path

    def down(self):
        subprocess.run([LABCTL, 'down'], env=self.lab_env, stdout=subprocess.DEVNULL, check=False)
        shutil.rmtree(self.work, ignore_errors=True)

    # -- one playbook run
    def play(self, variant, hosts, tasks, forks=1):
        run_dir = tempfile.mkdtemp(dir=self.work)
        play_path = os.path.join(run_dir, 'play.yml')
        with open(play_path, 'w') as f:
            yaml.safe_dump([{'name': 'bench', 'hosts': hosts, 'gather_facts': False,
                             'tasks': [{'name': 'ping %d' % i, 'ansible.builtin.ping': None}
                                       for i in range(tasks)]}], f)
        cp_dir = os.path.join(run_dir, 'cp')
        env = dict(os.environ, ANSIBLE_PIPELINING='True', ANSIBLE_SSH_CONTROL_PATH_DIR=cp_dir, ANSIBLE_NOCOLOR='1',
                   ANSIBLE_LOCAL_TEMP=os.path.join(run_dir, 'tmp'), ANSIBLE_RETRY_FILES_ENABLED='0')
        env.pop('ANSIBLE_CONFIG', None)
        binary = os.path.join(OUR_BIN, 'ansible-playbook')
        if variant == 'anchor':
            binary = os.path.join(ANCHOR_BIN, 'ansible-playbook')
            env['HOME'] = self.anchor_home
        env['PATH'] = os.path.dirname(binary) + os.pathsep + os.environ.get('PATH', '')
        start = time.monotonic()
        proc = subprocess.run([binary, '-i', self.inventories[variant], '-f', str(forks), play_path], env=env,
                              capture_output=True, text=True, cwd=run_dir, check=False)
        took = time.monotonic() - start
        for sock in glob.glob(os.path.join(cp_dir, '*')):
            if not sock.endswith('.lock'):
                subprocess.run(['ssh', '-o', 'ControlPath=' + sock, '-O', 'exit', 'x'], capture_output=True, check=False)
        if proc.returncode != 0 or 'failed=0' not in proc.stdout or 'unreachable=0' not in proc.stdout:
            raise SystemExit('bench_connection: %s run failed:\n%s' % (variant, (proc.stdout + proc.stderr)[-3000:]))
        return took

    def standin_cost(self, calls=10):
        """Seconds per call of the lab's pct exec and lxc-attach themselves, timed on the node."""
        ct = next(iter(sorted(self.cts.values(), key=lambda c: c['pct_vmid'])))
        code = ('import subprocess, sys, time\n'
                'def per_call(argv):\n'
                '    start = time.monotonic()\n'
                '    for _ in range(%d):\n'
                '        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)\n'
                '    return (time.monotonic() - start) / %d\n'
                'print(per_call(["/usr/sbin/pct", "exec", "%d", "--", "true"]),'
                ' per_call(["/usr/bin/lxc-attach", "-n", "%d", "--", "true"]), per_call(["true"]))'
                % (calls, calls, ct['pct_vmid'], ct['pct_vmid']))
        out = subprocess.run(['ssh', '-i', self.node['ansible_ssh_private_key_file'], '-o', 'BatchMode=yes',
                              '-o', 'UserKnownHostsFile=' + os.path.join(self.state, 'ssh', 'known_hosts'),
                              'root@' + self.node['ansible_host'], 'python3 -c %s' % shlex.quote(code)],
                             capture_output=True, text=True, check=True).stdout.split()
        return {'pct': float(out[0]), 'lxc-attach': float(out[1]), 'true': float(out[2])}

    @staticmethod
    def plugin_load_cost(rounds=10):
        """Seconds a forked worker spends loading a connection plugin (ansible-playbook forks one per task)."""
        code = ('import os, statistics, sys, time, warnings\n'
                'from ansible.plugins.loader import init_plugin_loader, connection_loader\n'
                'from ansible.playbook.play_context import PlayContext\n'
                'init_plugin_loader()\n'
                'connection_loader.get("ssh", class_only=True)\n'
                'def child(name):\n'
                '    r, w = os.pipe()\n'
                '    pid = os.fork()\n'
                '    if pid == 0:\n'
                '        start = time.perf_counter()\n'
                '        connection_loader.get(name, PlayContext())\n'
                '        os.write(w, str(time.perf_counter() - start).encode())\n'
                '        os._exit(0)\n'
                '    os.close(w)\n'
                '    took = float(os.read(r, 64))\n'
                '    os.waitpid(pid, 0)\n'
                '    os.close(r)\n'
                '    return took\n'
                'print(*[statistics.median(child(n) for _ in range(%d)) for n in ("ssh", "gpuops.fleet.pct")])'
                % rounds)
        out = subprocess.run([os.path.join(OUR_BIN, 'python'), '-c', code], capture_output=True, text=True,
                             check=True).stdout.split()
        return {'ssh': float(out[0]), 'pct': float(out[1])}

    def accepted(self):
        with open(self.sshd_log, errors='replace') as f:
            return f.read().count('Accepted publickey')

    # -- figures
    def run(self):
        tasks = self.args.tasks
        first_ct = sorted(self.cts)[0]
        calls = {}
        for variant in ('anchor', 'pct', 'lxc'):
            with NodeSampler(self.node_dir) as sampler:
                self.play(variant, first_ct, tasks)
            # A pct execs lxc-attach in place; one sampled only after that counts as lxc-attach. In the
            # pct variants every lxc-attach comes from a pct, so both kinds are pct calls there.
            pct, attach = sampler.count('pct'), sampler.count('lxc-attach')
            calls[variant] = {'pct': (pct + attach if variant != 'lxc' else pct) / tasks,
                              'lxc-attach': (attach if variant == 'lxc' else 0) / tasks}
            log('%s: per task %s' % (variant, calls[variant]))
        times = {v: [] for v in VARIANTS}
        for rep in range(self.args.reps):
            for variant in VARIANTS:
                hosts = self.node_name if variant == 'ssh' else first_ct
                times[variant].append(self.play(variant, hosts, tasks))
                log('rep %d %s: %.2f s' % (rep + 1, variant, times[variant][-1]))
        conns = {}
        for variant in ('anchor', 'pct'):
            for forks in (1, 8):
                before = self.accepted()
                self.play(variant, ','.join(sorted(self.cts)), 1, forks=forks)
                time.sleep(0.3)
                conns[(variant, forks)] = self.accepted() - before
                log('%s forks=%d: %d connections' % (variant, forks, conns[(variant, forks)]))
        cost = self.standin_cost()
        cost['load'] = self.plugin_load_cost()
        log('lab stand-ins per call, plugin loads: %s' % cost)
        return calls, {v: statistics.median(t) for v, t in times.items()}, times, conns, cost


def verdict(ok):
    return 'met' if ok else '**not met**'


def paired(times, top, bottom):
    """Median of the per-round ratios top/bottom (variants alternate, so each round shares the machine's load)."""
    return statistics.median(t / b for t, b in zip(times[top], times[bottom]))


def markdown(bench, calls, med, times, conns, versions, cost):
    tasks = bench.args.tasks
    speedup_pct = paired(times, 'anchor', 'pct')
    lxc_vs_ssh = paired(times, 'lxc', 'ssh')
    over_ssh = {v: (med[v] - med['ssh']) / tasks for v in ('pct', 'lxc')}
    lines = [
        '## Connection plugin: `gpuops.fleet.pct` vs `community.proxmox.proxmox_pct_remote`',
        '',
        'One lab node (real sshd on loopback, lab `pct` with a %.1f s start-up like Perl), 8 containers. '
        'Anchor: community.proxmox %s from ansible %s (ansible-core %s), in `.bench/anchor-venv`. '
        'Wall times: one `ansible-playbook` run of %d `ansible.builtin.ping` tasks into one container, started cold '
        '(no SSH master yet). There are %d rounds, and each round runs every variant once. Plain OpenSSH gets the same '
        '`ssh_args` as ours (`%s`) and the same Python.' % (
            bench.args.pct_delay, versions[2], versions[0], versions[1], tasks, bench.args.reps, SSH_ARGS),
        '',
        '| figure | %s | %s | %s | %s |' % tuple(LABELS[v] for v in VARIANTS),
        '|---|---|---|---|---|',
        '| `pct` calls per module task | %.1f | %.1f | %.1f (%.1f lxc-attach) | 0 |' % (
            calls['anchor']['pct'], calls['pct']['pct'], calls['lxc']['pct'], calls['lxc']['lxc-attach']),
        '| wall time, %d tasks (median s) | %.2f | %.2f | %.2f | %.2f |' % (
            tasks, med['anchor'], med['pct'], med['lxc'], med['ssh']),
        '| all runs (s) | %s |' % ' | '.join(', '.join('%.2f' % x for x in times[v]) for v in VARIANTS),
        '| speed-up over the anchor (median of rounds) | 1.0x | %.1fx | %.1fx | %.1fx |' % (
            speedup_pct, paired(times, 'anchor', 'lxc'), paired(times, 'anchor', 'ssh')),
        '| time / plain OpenSSH (median of rounds) | %.2f | %.2f | %.2f | 1.00 |' % (
            paired(times, 'anchor', 'ssh'), paired(times, 'pct', 'ssh'), lxc_vs_ssh),
        '| SSH connections, 8 containers, forks=1 | %d | %d | | |' % (conns[('anchor', 1)], conns[('pct', 1)]),
        '| SSH connections, 8 containers, forks=8 | %d | %d | | |' % (conns[('anchor', 8)], conns[('pct', 8)]),
        '',
        'Goals (issue 5):',
        '',
        '- 1 `pct` call per module task: %.1f, %s.' % (calls['pct']['pct'], verdict(calls['pct']['pct'] <= 1.0)),
        '- at least 4x faster than the anchor with `exec_method: pct`: %.1fx, %s.' % (
            speedup_pct, verdict(speedup_pct >= 4)),
        '- within 1.1x of plain OpenSSH with `exec_method: lxc-attach`, the real LXC `lxc-attach` (issue 10; '
        'reported, not gated): %.2fx, %s.' % (lxc_vs_ssh, verdict(lxc_vs_ssh <= 1.1)),
        '- 1 SSH connection for 8 containers with forks=1: %d, %s (forks=8: %d).' % (
            conns[('pct', 1)], verdict(conns[('pct', 1)] == 1), conns[('pct', 8)]),
        '',
        'Where the time over plain OpenSSH goes, per task: %.3f s with pct, %.3f s with lxc-attach. The lab\'s '
        'stand-ins alone, timed on the node, cost %.3f s per `pct exec` (%.1f s of it the Perl-like delay) and %.3f s '
        'per `lxc-attach` (LXC\'s own C binary, as on Proxmox). `true` alone costs %.3f s. What '
        'is left is the plugin\'s own cost, within this machine\'s noise: %.3f s per task with pct, %.3f s with '
        'lxc-attach. Of that, %.3f s is ansible-core loading the plugin in each task\'s forked worker (%.3f s for '
        'ours, %.3f s for the builtin `ssh`, whose documentation the parent process has already parsed). With one '
        'pct call per task, the best possible speed-up over the anchor here is the anchor over (plain OpenSSH + %d '
        'lab pct calls) = %.1fx.' % (
            over_ssh['pct'], over_ssh['lxc'], cost['pct'], bench.args.pct_delay, cost['lxc-attach'], cost['true'],
            over_ssh['pct'] - cost['pct'], over_ssh['lxc'] - cost['lxc-attach'],
            cost['load']['pct'] - cost['load']['ssh'], cost['load']['pct'], cost['load']['ssh'], tasks,
            med['anchor'] / (med['ssh'] + tasks * cost['pct'])),
    ]
    return '\n'.join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=3)
    parser.add_argument('--tasks', type=int, default=10)
    parser.add_argument('--pct-delay', type=float, default=float(os.environ.get('LAB_PCT_DELAY', '0.3')))
    parser.add_argument('--lab-id', default=os.environ.get('BENCH_CONN_LAB_ID', 'connbench'))
    parser.add_argument('--json', help='also write the raw figures here')
    args = parser.parse_args()
    ensure_anchor_venv()
    versions = anchor_versions()
    bench = Bench(args)
    try:
        bench.up()
        calls, med, times, conns, cost = bench.run()
    finally:
        bench.down()
    print(markdown(bench, calls, med, times, conns, versions, cost))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'calls_per_task': calls, 'median_s': med, 'runs_s': times, 'standin_s': cost,
                       'connections': {'%s_forks%d' % k: n for k, n in conns.items()}}, f, indent=1)


if __name__ == '__main__':
    main()
