"""Faults of NVML and of /proc reads against the lab, through ansible-playbook (issue 12 A1, A3, A5, E).

The lab's hangs are uninterruptible: the stand-in library has the daemon freeze the calling thread in a
cgroup v1 freezer (state D, SIGKILL pends), as a thread stuck in a real driver is. A task must still end
on time, and its process must be gone. The blocked /proc read is real: a lab container process whose
memory-map lock is held by a thread waiting on a FUSE file that never answers, with a writer queued behind
it, so that every reader of its cmdline waits in the kernel.
"""
import json
import os
import subprocess
import time

import pytest

from _enginelab import REPO, VENV_BIN, EngineLab, Play, host_alive
from _labfixture import module_lab

PLAY_LIMIT_S = 90  # before the fix these plays never end
LAB_PY = os.path.join(REPO, ".lab", "venv", "bin", "python")

lab = module_lab(lambda: EngineLab("a12nv", ["--nodes", "1", "--containers", "1", "--gpus", "2"]))


def bounded_play(lab, host, module, args):
    """One task as lab.play runs it, under a wall-clock limit: a task that never ends fails the test."""
    lab.count += 1
    tag = "%s-%d" % (host, lab.count)
    tree = os.path.join(lab.workdir, "tree-" + tag)
    book = os.path.join(lab.workdir, "play-%s.yml" % tag)
    with open(book, "w") as f:
        json.dump([{"hosts": host, "gather_facts": False,
                    "tasks": [{"name": "module under test", "gpuops.fleet." + module: args}]}], f)
    env = dict(lab.env, ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree", ANSIBLE_CALLBACK_TREE_DIR=tree)
    started = time.monotonic()
    try:
        proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", lab.inventory, book], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                              timeout=PLAY_LIMIT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("%s did not end within %ds" % (module, PLAY_LIMIT_S))
    result = None
    if os.path.exists(os.path.join(tree, host)):
        with open(os.path.join(tree, host)) as f:
            result = json.load(f)
    return Play(proc.returncode, result, proc.stdout, time.monotonic() - started)


def gpu(play, index):
    return [g for g in play["gpus"] if g["index"] == index][0]


def frozen_tasks(lab):
    """Host tids frozen by the lab's NVML hang in ct101, with their state letters."""
    group = None
    for line in open("/proc/self/mountinfo"):
        left, dummy, right = line.partition(" - ")
        if right.split()[0] == "cgroup" and "freezer" in right.split()[2]:
            group = os.path.join(left.split()[4], "gpuops-lab-" + lab.lab_id, "stuck-101-nvmlhang")
    if not group or not os.path.isdir(group):
        return {}
    out = {}
    for tid in open(os.path.join(group, "tasks")).read().split():
        try:
            out[int(tid)] = open("/proc/%s/stat" % tid).read().rsplit(")", 1)[1].split()[0]
        except OSError:
            pass
    return out


def module_processes(lab):
    """Host pids of this lab's AnsiballZ module processes still around (gpu_status / gpu_release);
    another lab's, in a parallel worker, are not this test's."""
    ours = "/gpuops-lab-%s/" % lab.lab_id
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                comm = open("/proc/%s/cmdline" % name, "rb").read(4096)
                cgroup = open("/proc/%s/cgroup" % name).read()
            except OSError:
                continue
            if b"AnsiballZ_gpu_" in comm and ours in cgroup:
                out.append(int(name))
    return out


@pytest.fixture
def fault(lab):
    """Set lab faults; every one is cleared (and frozen threads thawed) after the test."""
    set_faults = []

    def inject(*args):
        lab.labctl("fault", "--node", "pve1", *args)
        set_faults.append(args)
    yield inject
    for args in set_faults:
        if "--init" in args:
            lab.labctl("fault", "--node", "pve1", "--init", "none")
        else:
            lab.labctl("fault", "--node", "pve1", "--gpu", args[1], "--fault", "none")
    lab.cleanup()


def assert_task_gone_and_hang_real(lab, play):
    """The hang was in the 'kernel' (a frozen thread in D), and no module process outlived the task."""
    tasks = frozen_tasks(lab)
    assert tasks and set(tasks.values()) == {"D"}, "the lab's hang was not uninterruptible: %s" % tasks
    assert module_processes(lab) == [], "a module process outlived its task"
    assert play.seconds < 45, play.seconds


# ---- A5 and E: NVML hangs in the kernel ----

@pytest.mark.timing
def test_hang_in_memory_call_ends_the_task_and_leaves_nothing_behind(lab, fault):
    run = lab.run("plain", 101, [0], mib=1024)
    fault("--gpu", 1, "--fault", "hang_memory")
    play = bounded_play(lab, "ct101", "gpu_info", {"nvml_timeout": 1})
    assert play.failed and "Traceback" not in play.output, play
    assert play["msg"].startswith("GPU 1") and "nvmlDeviceGetMemoryInfo did not return within 1s (NVML hang)" in play["msg"]
    assert gpu(play, 1)["free"] is False and gpu(play, 0)["error"] is None
    assert gpu(play, 0)["holders"] == run["container_holders"]
    assert_task_gone_and_hang_real(lab, play)


@pytest.mark.timing
def test_hang_in_init_ends_the_task(lab, fault):
    fault("--init", "hang")
    play = bounded_play(lab, "ct101", "gpu_release", {"advanced": {"nvml_timeout": 1}})
    assert play.failed and "Traceback" not in play.output, play
    assert "nvmlInit did not return within 1s (NVML hang)" in play["msg"] and play["changed"] is False
    assert_task_gone_and_hang_real(lab, play)


@pytest.mark.timing
def test_hang_in_process_list_ends_a_release_without_signals(lab, fault):
    run = lab.run("plain", 101, [1], mib=1024)
    fault("--gpu", 1, "--fault", "hang_procs")
    play = bounded_play(lab, "ct101", "gpu_release", {"gpus": [1], "advanced": {"nvml_timeout": 1}})
    assert play.failed and "Traceback" not in play.output, play
    assert "nvmlDeviceGetComputeRunningProcesses did not return within 1s (NVML hang)" in play["msg"]
    assert play["changed"] is False and play["actions"] == [] and host_alive(run["holders"][0])
    assert_task_gone_and_hang_real(lab, play)


# ---- A3 and E: no v2 memory call ----

def test_no_v2_call_is_unverifiable_and_never_free_or_reset(lab, fault):
    fault("--gpu", 1, "--fault", "no_v2")
    status = bounded_play(lab, "ct101", "gpu_info", {"gpus": [1]})
    assert status.failed and gpu(status, 1)["free"] is False and status["all_free"] is False, status
    assert "memory unverifiable on this driver" in status["msg"] and "reserved_floor_mib" in status["msg"]
    lab.labctl("leak", "--node", "pve1", "--gpu", 1, "--mib", 2048)
    release = bounded_play(lab, "pve1", "gpu_release", {"gpus": [1], "containers": [101], "gpu_reset": True,
                                                        "advanced": {"verify_timeout": 1}})
    assert release.failed and "memory unverifiable on this driver" in release["msg"], release
    assert release["changed"] is False and release["actions"] == [] and release["rung_reached"] == "none"
    assert lab.used(1) == 2048  # never reset on v1 used


def test_no_v2_call_with_reserved_floor_is_an_estimate(lab, fault):
    run = lab.run("plain", 101, [1], mib=1024)
    fault("--gpu", 1, "--fault", "no_v2")
    play = bounded_play(lab, "ct101", "gpu_info", {"gpus": [1], "reserved_floor_mib": 615})
    assert not play.failed, play
    memory = gpu(play, 1)["memory"]
    assert memory["used_mib"] == 1024 and memory["v1_used_mib"] == 1024 + 615 and memory["estimated"] is True
    assert gpu(play, 1)["holders"] == run["container_holders"]
    assert any("GPU 1: memory estimated, not measured" in line for line in play["diagnosis"])
    release = bounded_play(lab, "ct101", "gpu_release", {"gpus": [1], "advanced": {"reserved_floor_mib": 615}})
    assert not release.failed and release["changed"] is True, release
    assert release["msg"].startswith("free by estimate") and "verified free" not in release["msg"], release
    assert lab.used(1) == 0 and not host_alive(run["holders"][0])


# ---- A1 and E: a blocked /proc read ----

BLOCKER = r'''
import ctypes, errno, fcntl, json, mmap, os, socket, stat, struct, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
IN, OUT = struct.Struct("<IIQQIIIHH"), struct.Struct("<IiQ")
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
SIZE = 1 << 20
MNT = "/run/a12-fuse"


def attr(ino, mode, size):
    return ATTR.pack(ino, size, (size + 511) // 512, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def serve(fd):
    """A FUSE file system with one file whose READ is never answered."""
    while True:
        try:
            buf = os.read(fd, (1 << 20) + 4096)
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.ENOENT):
                continue
            return
        opcode, unique, nodeid = IN.unpack_from(buf)[1:4]
        body, err = b"", 0
        if opcode == 26:
            ra = struct.unpack_from("<III", buf, 40)[2]
            body = struct.pack("<IIIIHHIIHHII", 7, 31, ra, 0, 16, 12, 65536, 1, 32, 0, 0, 0) + bytes(24)
        elif opcode == 1:
            body = struct.pack("<QQQQII", 2, 0, 3600, 3600, 0, 0) + attr(2, 0o100644, SIZE)
        elif opcode == 3:
            body = struct.pack("<QII", 3600, 0, 0) + (attr(1, 0o40755, 0) if nodeid == 1 else attr(2, 0o100644, SIZE))
        elif opcode in (14, 27):
            body = struct.pack("<QIi", 1, 0, 0)
        elif opcode in (15, 36):
            continue
        elif opcode not in (18, 25, 29):
            err = -errno.ENOSYS
        os.write(fd, OUT.pack(16 + len(body), err, unique) + body)


def hold_gpu(minor, mib):
    """A context as the lab's workloads make one: nodes mapped 3 times, a shared flock, an alloc."""
    fds = [os.open(p, os.O_RDWR) for p in ["/dev/nvidiactl"] + ["/dev/nvidia%d" % minor] * 3]
    for fd in fds:
        libc.mmap(None, 4096, 3, 1, fd, 0)
    fcntl.flock(fds[1], fcntl.LOCK_SH)
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ.get("NVIDIA_LAB_SOCKET", "/run/nvidia-lab/driver.sock"))
    s.sendall((json.dumps({"op": "alloc", "minor": minor, "mib": mib}) + "\n").encode())
    assert json.loads(s.makefile().readline())["ok"]
    return fds


def state(pid, tid):
    try:
        return (open("/proc/%d/task/%d/stat" % (pid, tid)).read().rsplit(")", 1)[1].split()[0],
                open("/proc/%d/task/%d/wchan" % (pid, tid)).read())
    except OSError:
        return (None, None)


minor, mib = int(sys.argv[1]), int(sys.argv[2])
if not os.path.exists("/dev/fuse"):
    os.mknod("/dev/fuse", 0o600 | stat.S_IFCHR, os.makedev(10, 229))
os.makedirs(MNT, exist_ok=True)
fuse = os.open("/dev/fuse", os.O_RDWR)
opts = "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other" % fuse
if libc.mount(b"a12-fuse", MNT.encode(), b"fuse", 0, opts.encode()) != 0:
    raise OSError(ctypes.get_errno(), "mount fuse")
out = os.dup(1)
if os.fork():
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
threading.Thread(target=serve, args=(fuse,), daemon=True).start()
target = os.fork()
if target == 0:
    os.close(fuse)
    os.close(out)
    hold_gpu(minor, mib)
    f = open(MNT + "/data", "rb")
    base = libc.mmap(None, SIZE, 1, 1, f.fileno(), 0)
    mem = os.open("/proc/self/mem", os.O_RDONLY)
    pin = threading.Thread(target=os.pread, args=(mem, 1, base), daemon=True)
    pin.start()
    time.sleep(0.5)
    libc.mmap(None, 1 << 22, 3, 0x22, -1, 0)  # queues for the mm lock for ever
    os._exit(3)
for dummy in range(100):
    threads = sorted(int(t) for t in os.listdir("/proc/%d/task" % target))
    states = [state(target, t) for t in threads]
    if len(threads) == 2 and states[0][0] == "D" and "request_wait_answer" in states[1][1]:
        break
    time.sleep(0.1)
os.write(out, (json.dumps({"target": target, "fuse": os.getpid(), "states": states}) + "\n").encode())
os.close(out)
while True:
    time.sleep(3600)
'''


@pytest.mark.timing
def test_blocked_proc_read_is_bounded_and_reported(lab):
    started = lab.exec(101, LAB_PY, "-c", BLOCKER, "0", "1536")
    assert started.returncode == 0, started.stdout
    info = json.loads(started.stdout.strip().splitlines()[-1])
    try:
        holder = info["target"]
        assert info["states"][0][0] == "D", info
        play = bounded_play(lab, "ct101", "gpu_info", {})
        assert "Traceback" not in play.output, play
        blocked = [u for u in play["unreadable"] if u["pid"] == holder]
        assert blocked and blocked[0]["reason"] == "blocked" and blocked[0]["state"] == "D", play["unreadable"]
        assert blocked[0]["wchan"] and blocked[0]["path"].endswith("/cmdline")
        assert gpu(play, 0)["free"] is False and gpu(play, 0)["memory"]["used_mib"] == 1536
        assert any(line.startswith("pid %d (python" % holder) and "unreadable: blocked" in line
                   for line in play["diagnosis"]), play["diagnosis"]
        assert play.seconds < 45
    finally:
        lab.labctl("restart", "--node", "pve1", "--vmid", 101)
        lab.wait_supervisord(101)
        lab.cleanup()
