"""The lab's fake NVIDIA driver against GPU_FACTS.md rows 1-21, faults and reset.

Runs on the host, no lab containers: the C stand-in is built into a temporary
folder, the daemon serves a temporary STATE, workloads are real processes with
real flocks and mappings, and NVML is read by nvidia-ml-py's own ctypes code.
"""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER_DIR = REPO / "tests" / "lab" / "driver"
WORKLOAD = REPO / "tests" / "lab" / "workloads" / "workload.py"
PY = sys.executable
GPUS = 4
FREE_DELAY_S = 0.15  # the driver's default (lab.json has no free_delay_s here)
TOTAL_MIB = 143771
RESERVED_MIB = 615
RID = "%s-test%d" % (os.environ.get("LAB_ID", "drv01"), os.getpid())
VMID = "101"
CT_MINORS = [3, 1]

# A long-lived NVML client: one JSON answer per command line on stdin.
PROBE = r'''
import json, os, sys
import pynvml as n

def err(e):
    return [e.value, str(e)]

def text(v):
    return v.decode() if isinstance(v, bytes) else v

def device(i):
    h = n.nvmlDeviceGetHandleByIndex(i)
    try:
        m1 = n.nvmlDeviceGetMemoryInfo(h)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        procs = n.nvmlDeviceGetComputeRunningProcesses(h)
        return {"index": i, "minor": n.nvmlDeviceGetMinorNumber(h), "uuid": n.nvmlDeviceGetUUID(h),
                "bus_id": text(n.nvmlDeviceGetPciInfo(h).busId), "name": n.nvmlDeviceGetName(h),
                "total": m1.total >> 20, "v1_used": m1.used >> 20, "used": m2.used >> 20,
                "reserved": m2.reserved >> 20,
                "procs": sorted([p.pid, p.usedGpuMemory >> 20] for p in procs)}
    except n.NVMLError as e:
        return {"index": i, "error": err(e)}

def answer(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()

try:
    n.nvmlInit()
except n.NVMLError as e:
    answer({"init_error": err(e)})
    sys.exit(0)
answer({"pid": os.getpid(), "driver": n.nvmlSystemGetDriverVersion(), "count": n.nvmlDeviceGetCount()})
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "state":
        answer([device(i) for i in range(n.nvmlDeviceGetCount())])
    elif cmd[0] == "shutdown":
        n.nvmlShutdown()
        answer({"ok": True})
'''

# Adopts the workload's orphans (this host's pid 1 does not reap) and reaps them.
REAPER = r'''
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
launcher = os.fork()
if launcher == 0:
    os.execv(sys.argv[1], sys.argv[1:])
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
'''


def read_json_line(stream, timeout, what):
    ready = select.select([stream], [], [], timeout)[0]
    assert ready, "%s: no answer within %s s" % (what, timeout)
    line = stream.readline()
    assert line, "%s: closed without an answer" % what
    return json.loads(line)


def wait_until(check, timeout=30.0, step=0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def proc_state(pid):
    try:
        return Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def status_field(pid, name):
    for line in Path("/proc/%d/status" % pid).read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def fd_targets(fd_dir):
    targets = []
    for fd in os.listdir(fd_dir):
        try:
            targets.append(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            pass
    return targets


def children(pid):
    text = Path("/proc/%d/task/%d/children" % (pid, pid)).read_text()
    return [int(p) for p in text.split()]


def cgroup2_mount():
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _sep, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return left.split()[4]
    return None


class Probe:
    """A pynvml client in its own process, so that LD_LIBRARY_PATH and namespaces apply."""

    def __init__(self, lab, prefix=(), preexec_fn=None):
        self.proc = subprocess.Popen(list(prefix) + [PY, str(lab.probe_path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=lab.env(), text=True,
                                     start_new_session=True, preexec_fn=preexec_fn)
        self.hello = read_json_line(self.proc.stdout, 15, "probe start")

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return read_json_line(self.proc.stdout, 15, "probe " + command)

    def state(self):
        return {d["index"]: d for d in self.ask("state")}

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self.proc.wait(timeout=10)


class Workload:
    """A workload.py run under a reaper; kill() ends the whole workload session."""

    def __init__(self, lab, scenario, minors, mib, *extra, env=None):
        argv = [PY, "-c", REAPER, PY, str(WORKLOAD), scenario, "--minors", ",".join(map(str, minors)),
                "--mib", str(mib), "--dev-dir", str(lab.dev)] + list(extra)
        self.reaper = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=lab.env(**(env or {})),
                                       text=True, start_new_session=True)
        try:
            self.info = read_json_line(self.reaper.stdout, 30, "workload " + scenario)
        except (AssertionError, ValueError) as exc:
            self.reaper.kill()
            raise AssertionError("workload %s failed: %s" % (scenario, self.reaper.communicate(timeout=10)[1])) from exc
        self.pgids = set()
        for pid in self.info["pids"]:  # two_parents: each child leads no group of the launcher's
            try:
                self.pgids.add(os.getpgid(pid))
            except OSError:
                pass
        self.roles = self.info["roles"]

    def kill(self):
        for pgid in self.pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.reaper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.reaper.kill()
            self.reaper.wait(timeout=5)


class Lab:
    def __init__(self, state):
        self.state = state
        self.lib = state / "lib"
        self.dev = state / "nodes" / "pve1" / "dev"
        self.sock = state / "driver" / "driver.sock"
        self.probe_path = state / "probe.py"
        self.cgroup2 = cgroup2_mount()
        self.ct_cgroup = "/gpuops-lab-%s/pve1/lxc/%s/ns" % (RID, VMID)

    def env(self, **extra):
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.lib), NVIDIA_LAB_SOCKET=str(self.sock),
                   NVIDIA_LAB_DEV_DIR=str(self.dev), LC_ALL="C")
        env.update(extra)
        return env

    def write_lab_json(self, mode="modern"):
        doc = {"rid": RID, "nvml_pids": mode, "nodes": {"pve1": {
            "gpus": GPUS, "dev_dir": str(self.dev),
            "containers": {VMID: {"minors": CT_MINORS, "cgroup": self.ct_cgroup}}}}}
        tmp = self.state / "lab.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state / "lab.json")

    def raw(self, obj):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.sock))
            s.sendall(json.dumps(obj).encode() + b"\n")
            return s.makefile().read()

    def request(self, obj):
        return json.loads(self.raw(obj))

    def gpus(self):
        reply = self.request({"op": "snapshot", "node": "pve1"})
        assert reply["ok"], reply
        return {g["minor"]: g for g in reply["gpus"]}

    def smi(self, *args, timeout=20, **env):
        return subprocess.run([PY, str(DRIVER_DIR / "nvidia-smi")] + list(args), capture_output=True, text=True,
                              env=self.env(**env), timeout=timeout, check=False)

    def nvml_call(self, code, timeout):
        """Runs pynvml code in a fresh process; returns CompletedProcess or raises TimeoutExpired."""
        proc = subprocess.Popen([PY, "-c", "import pynvml, json\n" + code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=self.env(), text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    state = tmp_path_factory.mktemp("labdriver")
    lab = Lab(state)
    subprocess.run(["sh", str(DRIVER_DIR / "build.sh"), str(lab.lib)], check=True)
    (lab.dev / "nvidia-caps").mkdir(parents=True)
    for name in ["nvidia%d" % m for m in range(GPUS)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                                                         "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2"]:
        with open(lab.dev / name, "wb") as f:
            f.truncate(4096)
    lab.probe_path.write_text(PROBE)
    lab.write_lab_json()
    daemon = subprocess.Popen([PY, str(DRIVER_DIR / "labdriver.py"), "--state", str(state)],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_until(lambda: lab.sock.exists() and lab.request({"op": "ping"})["ok"], timeout=10), \
            "driver daemon did not start"
        assert (state / "driver" / "driver.pid").read_text().strip() == str(daemon.pid)
        yield lab
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=5)
    assert not lab.sock.exists(), "daemon left its socket behind"


@pytest.fixture
def workloads(lab):
    started = []

    def start(scenario, minors, mib, *extra, env=None):
        workload = Workload(lab, scenario, minors, mib, *extra, env=env)
        started.append(workload)
        return workload

    try:
        yield start
    finally:
        for workload in started:
            workload.kill()
        # Leave every GPU idle for the next test: no allocation, no leak, no fault.
        for minor in range(GPUS):
            lab.request({"op": "fault", "node": "pve1", "minor": minor, "fault": "none"})
            lab.request({"op": "reset", "node": "pve1", "minor": minor})
        lab.request({"op": "fault", "node": "pve1", "init": "none"})
        assert wait_until(lambda: all(g["used_mib"] == 0 for g in lab.gpus().values()), timeout=30), lab.gpus()


@pytest.fixture
def probe(lab):
    probes = []

    def start(**kwargs):
        p = Probe(lab, **kwargs)
        probes.append(p)
        return p

    try:
        yield start
    finally:
        for p in probes:
            p.close()


def by_minor(state):
    return {d["minor"]: d for d in state.values()}


def fuser_access(path):
    """{pid: access} from `fuser -v PATH`: pids go to stdout, the table rows to stderr, in one order."""
    out = subprocess.run(["fuser", "-v", str(path)], capture_output=True, text=True, timeout=20, check=False)
    pids = [int(p) for p in re.findall(r"(\d+)", out.stdout)]
    access = re.findall(r"^.*?\s([F.][r.][c.][e.][m.])\s+\S+$", out.stderr, re.M)
    assert len(access) == len(pids), out.stderr
    return dict(zip(pids, access))


def map_lines(pid, dev):
    """{device file name: lines of /proc/PID/maps naming it} for the files under dev."""
    counts = {}
    for line in Path("/proc/%d/maps" % pid).read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if path.startswith(str(dev) + "/"):
            name = path[len(str(dev)) + 1:]
            counts[name] = counts.get(name, 0) + 1
    return counts


def fd_counts(pid, dev):
    counts = {}
    for target in fd_targets("/proc/%d/fd" % pid):
        if target.startswith(str(dev) + "/"):
            name = target[len(str(dev)) + 1:]
            counts[name] = counts.get(name, 0) + 1
    return counts


def tcp_links(pids):
    """{frozenset(pid_a, pid_b)} joined by an established loopback TCP connection (socket inodes in /proc/PID/fd
    matched with /proc/PID/net/tcp)."""
    owner = {}
    for pid in pids:
        for target in fd_targets("/proc/%d/fd" % pid):
            if target.startswith("socket:["):
                owner[int(target[8:-1])] = pid
    conns = {}
    for pid in pids:
        for line in Path("/proc/%d/net/tcp" % pid).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "01" and int(f[9]) in owner:  # ESTABLISHED
                conns[(f[1], f[2])] = owner[int(f[9])]
    return {frozenset((a, conns[(remote, local)])) for (local, remote), a in conns.items()
            if (remote, local) in conns and conns[(remote, local)] != a}


# ---- GPU_FACTS rows ----

@pytest.mark.usefixtures("workloads")
def test_row1_idle_floor(probe):
    p = probe()
    assert p.hello["driver"] == "580.159.04"
    assert p.hello["count"] == GPUS
    state = p.state()
    assert sorted(d["minor"] for d in state.values()) == list(range(GPUS))
    for d in state.values():
        assert d["name"] == "NVIDIA H200"
        assert (d["total"], d["v1_used"], d["used"], d["reserved"]) == (TOTAL_MIB, RESERVED_MIB, 0, RESERVED_MIB)
        assert d["procs"] == []
        assert d["uuid"].startswith("GPU-")
    assert len({d["uuid"] for d in state.values()}) == GPUS
    assert state[0]["bus_id"] == "00000000:18:00.0"


def set_free_delay(lab, seconds):
    doc = json.loads((lab.state / "lab.json").read_text())
    (lab.state / "lab.json.tmp").write_text(json.dumps(dict(doc, free_delay_s=seconds)))
    os.replace(lab.state / "lab.json.tmp", lab.state / "lab.json")


@pytest.mark.timing
def test_row2_sigkill_frees_after_the_free_delay(lab, probe):
    """Memory and the NVML entry outlive the reaped holder for lab.json's free_delay_s, then go. The delay is
    long (2 s) so that "still held when waitpid returned" holds on a loaded machine; the bound that matters,
    never freed before the delay, is measured from the kill, which comes before the driver can see the death."""
    delay = 2.0
    p = probe()
    set_free_delay(lab, delay)
    try:
        for mib in (1024, 122880):
            holder = subprocess.Popen([PY, str(WORKLOAD), "plain", "--minors", "0", "--mib", str(mib), "--dev-dir",
                                       str(lab.dev), "--foreground"], stdout=subprocess.PIPE, env=lab.env(), text=True)
            try:
                info = read_json_line(holder.stdout, 30, "plain")
                assert info["holders"] == [holder.pid]
                before = by_minor(p.state())[0]
                assert before["used"] == mib and before["v1_used"] == mib + RESERVED_MIB
                assert before["procs"] == [[holder.pid, mib]]
                killed = time.monotonic()
                holder.send_signal(signal.SIGKILL)
                holder.wait()
                after = by_minor(p.state())[0]  # reaped, not yet freed
                assert (after["used"], after["procs"]) == (mib, [[holder.pid, mib]])
                assert wait_until(lambda: by_minor(p.state())[0]["used"] == 0, timeout=delay + 30, step=0.01)
                assert time.monotonic() - killed >= delay - 0.05
                assert by_minor(p.state())[0]["procs"] == []
            finally:
                holder.kill()
                holder.wait()
    finally:
        lab.write_lab_json()


def test_row3_zombie_holds_nothing(lab, probe, workloads):
    w = workloads("zombie", [1], 32768)
    zombie, parent = w.roles["zombie"], w.roles["parent"]
    assert w.info["holders"] == []
    assert proc_state(zombie) == "Z" and proc_state(parent) in ("R", "S")
    assert os.listdir("/proc/%d/fd" % zombie) == []
    p = probe()
    assert wait_until(lambda: by_minor(p.state())[1]["used"] == 0, timeout=30)  # 0.15 s after Z (row 3)
    assert by_minor(p.state())[1]["procs"] == []
    assert lab.gpus()[1]["holders"] == []


def test_row4_defunct_leader_hidden_from_fuser(lab, probe, workloads):
    leader = workloads("defunct_leader", [0], 33792, "--threads", "6").roles["leader"]
    witness = workloads("plain", [0], 1).roles["holder"]  # proves fuser sees an ordinary holder
    assert status_field(leader, "State").startswith("Z")
    assert int(status_field(leader, "Threads")) == 6 + 1  # live threads plus the defunct leader
    assert os.listdir("/proc/%d/fd" % leader) == []
    live = [int(t) for t in os.listdir("/proc/%d/task" % leader) if int(t) != leader]
    assert str(lab.dev / "nvidia0") in fd_targets("/proc/%d/task/%d/fd" % (leader, live[0]))
    d = by_minor(probe().state())[0]
    assert d["used"] == 33792 + 1
    assert d["procs"] == sorted([[leader, 33792], [witness, 1]])
    seen = fuser_access(lab.dev / "nvidia0")
    assert seen[witness] == "F...m"
    assert leader not in seen
    os.kill(live[0], signal.SIGKILL)  # any thread id kills the whole group
    assert wait_until(lambda: lab.gpus()[0]["used_mib"] == 1, timeout=30)


def test_row5_forked_child_keeps_dead_parents_memory(lab, probe, workloads):
    w = workloads("fork_inherit", [1], 33792, "--kill-parent")
    parent, child = w.roles["parent"], w.roles["child"]
    assert w.info["holders"] == [child] and w.info["dead"] == [parent]
    assert proc_state(parent) in (None, "Z")
    d = by_minor(probe().state())[1]
    assert d["used"] == 33792
    assert d["procs"] == [[parent, 33792]]  # the dead parent, never the child
    targets = fd_targets("/proc/%d/fd" % child)
    maps = Path("/proc/%d/maps" % child).read_text()
    for name in ("nvidia1", "nvidiactl", "nvidia-uvm"):
        assert str(lab.dev / name) in targets
    # As on the H200: the child inherits nvidia1/nvidiactl mappings, not nvidia-uvm's (MADV_DONTFORK).
    assert str(lab.dev / "nvidia1") in maps and str(lab.dev / "nvidiactl") in maps
    assert str(lab.dev / "nvidia-uvm") not in maps
    assert fuser_access(lab.dev / "nvidia1")[child] == "F...m"
    os.kill(child, signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[1]["used_mib"] == 0, timeout=30)


def test_fork_inherit_both_hold_nvml_names_parent(lab, probe, workloads):
    w = workloads("fork_inherit", [2], 512)
    parent, child = w.roles["parent"], w.roles["child"]
    assert w.info["holders"] == [parent, child]
    assert by_minor(probe().state())[2]["procs"] == [[parent, 512]]
    os.kill(parent, signal.SIGKILL)
    time.sleep(0.2)
    assert lab.gpus()[2]["used_mib"] == 512  # the child still holds it


def test_row6_mmap_only(lab, probe, workloads):
    holder = workloads("mmap_only", [2], 8908).roles["holder"]
    assert not [t for t in fd_targets("/proc/%d/fd" % holder) if str(lab.dev) in t]
    maps = [line for line in Path("/proc/%d/maps" % holder).read_text().splitlines() if str(lab.dev) in line]
    # 3 lines on its context GPU, 2 on every other visible GPU (rows 9, 12), all kept without an fd
    assert sorted(line.split()[-1] for line in maps) == sorted(
        [str(lab.dev / n) for n in ("nvidia2",) * 3 + ("nvidiactl", "nvidia-uvm")]
        + [str(lab.dev / ("nvidia%d" % m)) for m in (0, 1, 3) for _twice in range(2)])
    assert fuser_access(lab.dev / "nvidia2")[holder] == "....m"
    assert by_minor(probe().state())[2]["used"] == 8908
    os.kill(holder, signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[2]["used_mib"] == 0, timeout=30)


def test_row7_pid_namespaces(lab, probe):
    ns = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                           "%s %s plain --minors 3 --mib 2048 --dev-dir %s --foreground & wait"
                           % (PY, WORKLOAD, lab.dev)],
                          stdout=subprocess.PIPE, env=lab.env(), text=True, start_new_session=True)
    try:
        info = read_json_line(ns.stdout, 30, "plain in a pid namespace")
        inner = info["roles"]["holder"]
        ns_init = children(ns.pid)[0]
        host = children(ns_init)[0]
        assert status_field(host, "NSpid").split() == [str(host), str(inner)]
        assert inner == 2
        from_host = by_minor(probe().state())[3]
        assert from_host["procs"] == [[host, 2048]]
        inside = by_minor(probe(prefix=["nsenter", "-t", str(ns_init), "-p", "-m", "--"]).state())[3]
        assert inside["procs"] == [[inner, 2048]]
        other = by_minor(probe(prefix=["unshare", "--pid", "--fork", "--mount-proc"]).state())[3]
        assert (other["used"], other["procs"]) == (2048, [])  # memory shows, the pid does not
        lab.write_lab_json("legacy")
        inside = by_minor(probe(prefix=["nsenter", "-t", str(ns_init), "-p", "-m", "--"]).state())[3]
        other = by_minor(probe(prefix=["unshare", "--pid", "--fork", "--mount-proc"]).state())[3]
        assert inside["procs"] == other["procs"] == [[host, 2048]]  # host pids everywhere
    finally:
        lab.write_lab_json("modern")
        os.killpg(ns.pid, signal.SIGKILL)
        ns.wait(timeout=10)
    assert wait_until(lambda: lab.gpus()[3]["used_mib"] == 0, timeout=30)


def test_row8_monitor_holds_fds_maps_nothing(lab, probe, workloads):
    holder = workloads("plain", [0], 100).roles["holder"]
    monitor = workloads("monitor", [], 0).roles["monitor"]
    targets = fd_targets("/proc/%d/fd" % monitor)
    for name in ["nvidiactl", "nvidia-uvm"] + ["nvidia%d" % m for m in range(GPUS)]:
        assert str(lab.dev / name) in targets
    assert str(lab.dev) not in Path("/proc/%d/maps" % monitor).read_text()
    state = probe().state()
    assert all(monitor not in [pid for pid, _mib in d["procs"]] for d in state.values())
    assert by_minor(state)[0]["procs"] == [[holder, 100]]
    assert lab.gpus()[1]["holders"] == []
    assert fuser_access(lab.dev / "nvidia1")[monitor] == "F...."


def test_shutdown_closes_the_fds(lab, probe):
    p = probe()
    fds = "/proc/%d/fd" % p.hello["pid"]
    assert str(lab.dev / "nvidiactl") in fd_targets(fds)
    assert p.ask("shutdown") == {"ok": True}
    assert not [t for t in fd_targets(fds) if str(lab.dev) in t]


def test_tp_server_workers_hold_parent_does_not(lab, probe, workloads):
    w = workloads("tp_server", [1, 2], 300)
    parent, workers = w.roles["parent"], [w.roles["worker0"], w.roles["worker1"]]
    assert w.info["holders"] == workers and w.info["pids"] == [parent] + workers
    assert Path("/proc/%d/comm" % workers[1]).read_text().strip() == "tp_worker1"
    assert not [t for t in fd_targets("/proc/%d/fd" % parent) if str(lab.dev) in t]
    state = by_minor(probe().state())
    assert state[1]["procs"] == [[workers[0], 300]] and state[2]["procs"] == [[workers[1], 300]]
    os.kill(workers[0], signal.SIGKILL)
    assert wait_until(lambda: proc_state(workers[0]) is None, timeout=30)  # the parent reaps it
    assert wait_until(lambda: lab.gpus()[1]["used_mib"] == 0, timeout=30)  # no links: no residue
    assert lab.gpus()[2]["used_mib"] == 300


def test_term_ignoring_survives_sigterm_plain_does_not(lab, workloads):
    stubborn = workloads("term_ignoring", [1], 100).roles["holder"]
    plain = workloads("plain", [2], 100, "--fake-secret").roles["holder"]
    assert Path("/proc/%d/cmdline" % plain).read_bytes().split(b"\0")[-3:-1] == [b"--api-key", b"sk-secret"]
    os.kill(stubborn, signal.SIGTERM)
    os.kill(plain, signal.SIGTERM)
    assert wait_until(lambda: lab.gpus()[2]["used_mib"] == 0, timeout=30)
    time.sleep(0.2)
    assert proc_state(stubborn) in ("S", "R") and lab.gpus()[1]["used_mib"] == 100


def test_bystanders(lab, workloads):
    cpu = workloads("bystander_cpu", [], 0)
    gpu = workloads("bystander_gpu", [3], 50)
    assert cpu.info["holders"] == [] and list(cpu.roles) == ["bystander"]
    assert not [t for t in fd_targets("/proc/%d/fd" % cpu.roles["bystander"]) if str(lab.dev) in t]
    assert gpu.info["holders"] == [gpu.roles["bystander"]]
    assert lab.gpus()[3]["nvml_pids"] == [gpu.roles["bystander"]]


# ---- several GPUs (GPU_FACTS rows 9-21) ----

def others(minors):
    return [m for m in range(GPUS) if m not in minors]


def test_row9_maps_every_visible_gpu_memory_only_on_its_context(lab, probe, workloads):
    holder = workloads("plain", [0], 100).roles["holder"]
    assert {n: c for n, c in map_lines(holder, lab.dev).items() if n.startswith("nvidia") and n[6:].isdigit()} \
        == {"nvidia0": 3, "nvidia1": 2, "nvidia2": 2, "nvidia3": 2}
    fds = fd_counts(holder, lab.dev)
    assert fds["nvidia0"] > fds["nvidia1"] >= 1
    assert [m for m, g in lab.gpus().items() if g["holders"]] == [0]  # the flock only on its context GPU
    state = by_minor(probe().state())
    assert state[0]["procs"] == [[holder, 100]]
    assert all((state[m]["used"], state[m]["procs"]) == (0, []) for m in others([0]))


def test_row10_cuda_visible_devices_hides_mappings(lab, workloads):
    holder = workloads("plain", [1], 100, env={"CUDA_VISIBLE_DEVICES": "1,2"}).roles["holder"]
    maps, fds = map_lines(holder, lab.dev), fd_counts(holder, lab.dev)
    assert (maps.get("nvidia1"), maps.get("nvidia2"), maps.get("nvidia0"), maps.get("nvidia3")) == (3, 2, None, None)
    assert fds["nvidia0"] == fds["nvidia3"] == 1  # a hidden GPU keeps an fd, no mapping
    hidden = subprocess.run([PY, str(WORKLOAD), "plain", "--minors", "0", "--dev-dir", str(lab.dev)], capture_output=True,
                            text=True, env=lab.env(CUDA_VISIBLE_DEVICES="1"), timeout=30, check=False)
    assert hidden.returncode == 1 and "hidden by CUDA_VISIBLE_DEVICES=1" in hidden.stderr
    assert lab.gpus()[0]["used_mib"] == 0


def test_row13_stray_context_on_the_first_gpu(lab, probe, workloads):
    holder = workloads("stray_context", [2], 5638).roles["holder"]
    state = by_minor(probe().state())
    assert state[2]["procs"] == [[holder, 5638]] and state[0]["procs"] == [[holder, 518]]
    assert state[1]["procs"] == state[3]["procs"] == []
    maps = map_lines(holder, lab.dev)
    assert [maps["nvidia%d" % m] for m in range(GPUS)] == [3, 2, 3, 2]


def test_row14_fork_inherit_over_two_gpus(lab, probe, workloads):
    w = workloads("fork_inherit", [0, 1], 700, "--kill-parent")
    parent, child = w.roles["parent"], w.roles["child"]
    state = by_minor(probe().state())
    assert state[0]["procs"] == state[1]["procs"] == [[parent, 700]]
    assert state[2]["procs"] == state[3]["procs"] == []
    maps = map_lines(child, lab.dev)
    assert [maps["nvidia%d" % m] for m in range(GPUS)] == [3, 3, 2, 2] and "nvidia-uvm" not in maps
    os.kill(child, signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[0]["used_mib"] == lab.gpus()[1]["used_mib"] == 0, timeout=30)


def test_row15_defunct_leader_named_on_its_context_gpu(lab, probe, workloads):
    leader = workloads("defunct_leader", [1], 4614).roles["leader"]
    state = by_minor(probe().state())
    assert state[1]["procs"] == [[leader, 4614]] and all(state[m]["procs"] == [] for m in others([1]))
    live = [int(t) for t in os.listdir("/proc/%d/task" % leader) if int(t) != leader][0]
    text = Path("/proc/%d/task/%d/maps" % (leader, live)).read_text()
    assert text.count(str(lab.dev / "nvidia1") + "\n") == 3 and text.count(str(lab.dev / "nvidia0") + "\n") == 2


def test_row17_ipc_consumer_charged_with_the_dead_producer(lab, probe, workloads):
    w = workloads("ipc_consumer", [3], 6144)
    producer, consumer = w.roles["producer"], w.roles["consumer"]
    assert w.info["dead"] == [producer] and w.info["holders"] == [consumer]
    assert proc_state(producer) is None  # reaped
    d = by_minor(probe().state())[3]
    assert (d["used"], d["procs"]) == (6144 + 518, [[consumer, 6144 + 518]])
    time.sleep(FREE_DELAY_S + 0.1)
    assert lab.gpus()[3]["used_mib"] == 6144 + 518  # not freed: the consumer holds it
    os.kill(consumer, signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[3]["used_mib"] == 0, timeout=30)


def test_row19_tp_nccl_links_and_residue(lab, probe, workloads):
    w = workloads("tp_nccl", [0, 1, 2], 3000)
    parent, ranks = w.roles["parent"], [w.roles["rank%d" % r] for r in range(3)]
    assert w.info["holders"] == ranks
    assert Path("/proc/%d/comm" % ranks[1]).read_text().strip() == "tp_rank1"
    pairs = ((ranks[0], ranks[1]), (ranks[0], ranks[2]), (ranks[1], ranks[2]))
    assert tcp_links([parent] + ranks) == {frozenset(p) for p in pairs}
    assert not fd_counts(parent, lab.dev)
    for r, rank in enumerate(ranks):
        maps = map_lines(rank, lab.dev)
        assert [maps["nvidia%d" % m] for m in range(GPUS)] == [3 if m == r else 2 for m in range(GPUS)]
    state = by_minor(probe().state())
    assert [state[m]["procs"] for m in range(3)] == [[[rank, 3000]] for rank in ranks]
    os.kill(ranks[1], signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[1]["used_mib"] == 291, timeout=30)
    gpu1 = lab.gpus()[1]
    assert gpu1["nvml_pids"] == [] and gpu1["allocations"] == [{"host_pid": None, "mib": 291, "residue_of": ranks[1]}]
    assert by_minor(probe().state())[1]["procs"] == []
    os.kill(ranks[0], signal.SIGKILL)
    time.sleep(FREE_DELAY_S + 0.2)
    assert lab.gpus()[1]["used_mib"] == 291 and lab.gpus()[0]["used_mib"] == 291  # rank 2 still lives
    os.kill(ranks[2], signal.SIGKILL)
    assert wait_until(lambda: all(lab.gpus()[m]["used_mib"] == 0 for m in range(3)), timeout=30), lab.gpus()


def test_tp_nccl_residue_only_while_peers_live(lab, workloads):
    w = workloads("tp_nccl", [2, 3], 1000)
    os.killpg(os.getpgid(w.roles["parent"]), signal.SIGKILL)  # the whole job at once
    assert wait_until(lambda: lab.gpus()[2]["used_mib"] == lab.gpus()[3]["used_mib"] == 0, timeout=30)
    time.sleep(0.1)
    assert lab.gpus()[2]["used_mib"] == lab.gpus()[3]["used_mib"] == 0


def test_two_parents_each_child_in_its_dead_parents_session(lab, probe, workloads):
    w = workloads("two_parents", [1, 2], 1000)
    roles = w.roles
    assert w.info["dead"] == [roles["parent0"], roles["parent1"]]
    assert w.info["holders"] == [roles["child0"], roles["child1"]]
    for i in (0, 1):
        assert proc_state(roles["parent%d" % i]) is None
        child = roles["child%d" % i]
        assert os.getpgid(child) == os.getsid(child) == roles["parent%d" % i]
    state = by_minor(probe().state())
    assert state[1]["procs"] == [[roles["parent0"], 1000]] and state[2]["procs"] == [[roles["parent1"], 1000]]
    maps = map_lines(roles["child0"], lab.dev)
    assert (maps["nvidia1"], maps["nvidia2"]) == (3, 2) and "nvidia-uvm" not in maps
    os.kill(roles["child0"], signal.SIGKILL)
    assert wait_until(lambda: lab.gpus()[1]["used_mib"] == 0, timeout=30)
    assert lab.gpus()[2]["used_mib"] == 1000


@pytest.mark.timing
def test_free_delay_defaults_to_the_drivers_when_lab_json_has_none(lab):
    assert "free_delay_s" not in json.loads((lab.state / "lab.json").read_text())
    holder = subprocess.Popen([PY, str(WORKLOAD), "plain", "--minors", "1", "--mib", "64", "--dev-dir",
                               str(lab.dev), "--foreground"], stdout=subprocess.PIPE, env=lab.env(), text=True)
    read_json_line(holder.stdout, 30, "plain")
    killed = time.monotonic()
    holder.kill()
    holder.wait()
    assert wait_until(lambda: lab.gpus()[1]["used_mib"] == 0, timeout=30, step=0.005)
    assert time.monotonic() - killed >= FREE_DELAY_S - 0.05  # never before the default delay
    assert lab.gpus()[1]["nvml_pids"] == []


# ---- faults ----

@pytest.mark.usefixtures("workloads")
def test_fault_lost(lab, probe):
    assert lab.request({"op": "fault", "node": "pve1", "minor": 2, "fault": "lost"})["ok"]
    state = probe().state()
    lost = [d for d in state.values() if "error" in d]
    assert [d["error"] for d in lost] == [[15, "GPU is lost"]]
    assert lost[0]["index"] == 2
    smi = lab.smi("--query-gpu=index,memory.used", "--format=csv,noheader")
    assert smi.returncode == 15 and "GPU0000:3A:00.0: GPU is lost" in smi.stdout
    assert lab.request({"op": "fault", "node": "pve1", "minor": 2, "fault": "none"})["ok"]
    assert "error" not in probe().state()[2]


@pytest.mark.usefixtures("workloads")
def test_fault_hang(lab):
    assert lab.request({"op": "fault", "node": "pve1", "minor": 1, "fault": "hang"})["ok"]
    ok = lab.nvml_call("pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
                       "print(pynvml.nvmlDeviceGetMemoryInfo(h).used >> 20)", timeout=10)
    assert ok.stdout.strip() == str(RESERVED_MIB), ok.stderr
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        lab.nvml_call("pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(1)\n"
                      "pynvml.nvmlDeviceGetMemoryInfo(h)", timeout=2)
    assert time.monotonic() - started >= 2


@pytest.mark.usefixtures("workloads")
def test_fault_driver_not_loaded(lab):
    assert lab.request({"op": "fault", "node": "pve1", "init": "not_loaded"})["ok"]
    res = lab.nvml_call("try:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n"
                        "    print(json.dumps([e.value, str(e)]))", timeout=10)
    assert json.loads(res.stdout) == [9, "Driver Not Loaded"], res.stderr
    smi = lab.smi()
    assert smi.returncode == 9 and "couldn't communicate with the NVIDIA driver" in smi.stdout
    assert lab.request({"op": "fault", "node": "pve1", "init": "none"})["ok"]
    res = lab.nvml_call("pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())", timeout=10)
    assert res.stdout.strip() == str(GPUS)


def test_no_daemon_is_driver_not_loaded(lab):
    res = subprocess.run([PY, "-c", "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n"
                          "    print(e.value)"], capture_output=True, text=True, timeout=10,
                         env=lab.env(NVIDIA_LAB_SOCKET=str(lab.state / "nowhere.sock")), check=False)
    assert res.stdout.strip() == "9", res.stderr


# ---- reset, leak, nvidia-smi ----

def test_reset_refused_while_held_then_clears_leak(lab, workloads):
    holder = workloads("plain", [3], 1000)
    refused = lab.smi("--gpu-reset", "-i", "3")
    assert refused.returncode == 255
    assert "GPU 00000000:5D:00.0 is currently in use by another process." in refused.stdout
    assert "Please first kill all processes using this device" in refused.stdout
    assert lab.request({"op": "leak", "node": "pve1", "minor": 3, "mib": 5000})["ok"]
    holder.kill()

    def leaked_gpu():
        gpu = lab.gpus()[3]
        return gpu if gpu["used_mib"] == 5000 else None

    gpu = wait_until(leaked_gpu, timeout=30)
    assert gpu and gpu["holders"] == [] and gpu["nvml_pids"] == [] and gpu["leaked_mib"] == 5000
    # An NVML client (a monitor: fds on every /dev/nvidiaN, no mapping, no context) blocks a reset too,
    # as nvidia-persistenced, nv-hostengine or dcgm-exporter do on real hardware.
    monitor = workloads("monitor", [], 0)
    refused = lab.smi("--gpu-reset", "-i", "3")
    assert refused.returncode == 255 and "is currently in use by another process." in refused.stdout
    answer = lab.request({"op": "reset", "node": "pve1", "minor": 3})
    assert answer["ok"] is False and answer["holders"] == [] and answer["nvml_pids"] == []
    assert answer["users"] == [monitor.roles["monitor"]]
    assert lab.gpus()[3]["leaked_mib"] == 5000
    monitor.kill()
    done = lab.smi("--gpu-reset", "-i", "3")
    assert done.returncode == 0, done.stdout
    assert "GPU 00000000:5D:00.0 was successfully reset." in done.stdout
    assert lab.gpus()[3]["used_mib"] == 0


def test_nvidia_smi_queries(lab, workloads):
    holder = workloads("plain", [0], 777).roles["holder"]
    uuid = lab.gpus()[0]["uuid"]
    res = lab.smi("--query-gpu=index,uuid,pci.bus_id,memory.total,memory.used,memory.reserved", "--format=csv")
    lines = res.stdout.splitlines()
    assert lines[0] == ("index, uuid, pci.bus_id, memory.total [MiB], memory.used [MiB], "
                        "memory.reserved [MiB]")
    # memory.used leaves the reserved floor out (measured on the H200, driver 580.159.04)
    assert lines[1] == "0, %s, 00000000:18:00.0, 143771 MiB, 777 MiB, 615 MiB" % uuid
    assert len(lines) == 1 + GPUS
    res = lab.smi("--query-gpu=memory.used,index", "--format=csv,noheader,nounits", "-i", "0")
    assert res.stdout.splitlines() == ["777, 0"]
    res = lab.smi("--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader")
    assert res.stdout.splitlines() == ["%d, 777 MiB, %s" % (holder, uuid)]
    table = lab.smi()
    assert table.returncode == 0 and re.search(r"\b%d\b.*777MiB" % holder, table.stdout), table.stdout
    assert lab.smi("-L").stdout.splitlines()[0] == "GPU 0: NVIDIA H200 (UUID: %s)" % uuid
    bad = lab.smi("--query-gpu=index,bogus", "--format=csv")
    assert bad.returncode == 2 and 'Field "bogus"' in bad.stderr


# ---- container view (cgroup) ----

@pytest.fixture
def container_cgroup(lab):
    assert lab.cgroup2, "no cgroup2 mount in /proc/self/mountinfo"
    top = Path(lab.cgroup2 + "/gpuops-lab-%s" % RID)
    leaf = Path(lab.cgroup2 + lab.ct_cgroup)
    leaf.mkdir(parents=True)
    try:
        yield leaf
    finally:
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            wait_until(lambda cg=path: not (cg / "cgroup.procs").read_text().strip(), timeout=30)
            path.rmdir()


@pytest.mark.usefixtures("workloads")
def test_container_sees_its_layout(lab, container_cgroup, probe):  # cgroup torn down last
    def join():
        (container_cgroup / "cgroup.procs").write_text("0")

    state = probe(preexec_fn=join).state()
    assert [state[i]["minor"] for i in sorted(state)] == CT_MINORS
    refused = subprocess.run([PY, str(WORKLOAD), "plain", "--minors", "0", "--dev-dir", str(lab.dev)],
                             capture_output=True, text=True, env=lab.env(), preexec_fn=join, timeout=30, check=False)
    assert refused.returncode == 1 and "not visible" in refused.stderr
    holder = subprocess.Popen([PY, str(WORKLOAD), "plain", "--minors", "3", "--mib", "64", "--dev-dir",
                               str(lab.dev), "--foreground"], stdout=subprocess.PIPE, env=lab.env(), text=True,
                              preexec_fn=join)
    try:
        read_json_line(holder.stdout, 30, "plain in the container")
        gpu = lab.gpus()[3]
        assert gpu["visible_in"] == {VMID: 0} and gpu["nvml_pids"] == [holder.pid]
        assert lab.gpus()[0]["visible_in"] == {}
        # Only the container's GPUs are mapped, though the dev dir here has all four.
        maps = map_lines(holder.pid, lab.dev)
        assert (maps.get("nvidia3"), maps.get("nvidia1"), maps.get("nvidia0"), maps.get("nvidia2")) == (3, 2, None, None)
        hidden = subprocess.run([PY, str(WORKLOAD), "plain", "--minors", "3", "--dev-dir", str(lab.dev)],
                                capture_output=True, text=True, env=lab.env(CUDA_VISIBLE_DEVICES="1"),
                                preexec_fn=join, timeout=30, check=False)
        assert hidden.returncode == 1 and "hidden by CUDA_VISIBLE_DEVICES" in hidden.stderr  # index 1 is minor 1
    finally:
        holder.kill()
        holder.wait()


def test_text_snapshot_is_the_callers_view(lab):
    """The text snapshot the stand-in library reads: every GPU of the node from the host, in minor order."""
    for _round in range(3):
        lines = lab.raw({"op": "snapshot", "format": "text"}).splitlines()
        assert lines[0] == "DRIVER 580.159.04" and lines[-1] == "END"
        devs = [line.split() for line in lines if line.startswith("DEV ")]
        assert [(int(d[1]), int(d[2])) for d in devs] == [(i, i) for i in range(GPUS)]
        assert all(d[-1] == "none" and int(d[-2]) == 0 for d in devs)


def test_character_devices_are_never_opened(lab, tmp_path):
    """A dev dir whose nodes are real character devices (here /dev/null) is refused, never opened."""
    for name in ("nvidiactl", "nvidia-uvm", "nvidia0"):
        (tmp_path / name).symlink_to("/dev/null")
    res = subprocess.run([PY, "-c", "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n"
                          "    print(e.value)"], capture_output=True, text=True, timeout=10,
                         env=lab.env(NVIDIA_LAB_DEV_DIR=str(tmp_path)), check=False)
    assert res.stdout.strip() == "9", res.stderr
    res = subprocess.run([PY, str(WORKLOAD), "plain", "--minors", "0", "--dev-dir", str(tmp_path)],
                         capture_output=True, text=True, env=lab.env(), timeout=30, check=False)
    assert res.returncode == 1 and "is not a lab device file" in res.stderr
    assert lab.gpus()[0]["used_mib"] == 0
