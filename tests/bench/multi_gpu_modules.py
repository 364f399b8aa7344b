"""gpu_status and gpu_release on a machine with two real GPUs (issue 9, "Real GPUs").

    python3 tests/bench/multi_gpu_modules.py --out DIR [--collection NAME=PATH ...] [--deadline S]

Starts ten PyTorch holders of its own (each command line holds `gpuops_mgpu_workload`, the
`match` of every gpu_release task), reads NVML's per-GPU pid lists as the truth, runs the
modules through `ansible-playbook -c local` and compares:

  gpu0_only       allocates on cuda:0, both GPUs visible
  cvd1            CUDA_VISIBLE_DEVICES=1, allocates there
  both_gpus       memory on both GPUs
  peer_copy       a tensor on cuda:0 copied to cuda:1
  bare_context0   torch.zeros(1, device="cuda:0") only
  nccl_rank0/1    two NCCL ranks (tcp:// init, all_reduce done), rank r on cuda:r
  fork_child      a holder on cuda:0 forks a child that never touches CUDA; the parent is SIGKILLed
  defunct_leader  a thread allocates on cuda:1, the leader calls SYS_exit
  ns_holder       own PID namespace (unshare --pid --fork --mount-proc), memory on cuda:1

Round 1: gpu_status (gpus [0, 1]) and check-mode gpu_release (gpus [1]) with every --collection
(default: this working tree), then the real gpu_release with the first one. Round 2 (fresh
holders), only with a collection whose gpu_release accepts `collateral`: the same with
`collateral: stop`. Round 3 (fresh holders, none on both GPUs and no NCCL pair: gpu0_only, cvd1,
bare_context0, fork_child, defunct_leader, ns_holder): the same with the default collateral
(refuse); the plan must be exactly the GPU-1 holders, the task must end "verified free", GPU 1
free, GPU 0's used MiB unchanged and every GPU-0-only process alive. Writes DIR/mgpu.json and DIR/mgpu.md (a section for docs/gpu-results.md),
prints the Markdown. Exit 0: every check passed; 1: measured, a check failed; 2: not measured.

Every holder dies with this script: a lifeline pipe (EOF ends it), PR_SET_PDEATHSIG where it has
a parent here, and --deadline + 60 s of lifetime. NVLink multicast stays off in every process.
Never resets a GPU, never changes a setting, signals only the processes it started.
`--rehearse` runs everything without a GPU (no torch, no NVML; the modules then fail).
"""
import argparse
import ctypes
import datetime
import json
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "gpuops_mgpu_workload"
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SYS_EXIT = {"x86_64": 60, "aarch64": 93}
PR_SET_PDEATHSIG = 1
RELEASE_ARGS = {"term_timeout": 5, "kill_timeout": 5, "advanced": {"verify_timeout": 10, "timeout": 60}}
PLAY_TIMEOUT = 150

# name -> what it does; MiB per cuda device index as the process sees it (distinct sizes tell them apart)
SHAPES = [
    ("gpu0_only", "allocates on cuda:0, no CUDA_VISIBLE_DEVICES", {0: 2048}),
    ("cvd1", "CUDA_VISIBLE_DEVICES=1, allocates there", {0: 2304}),
    ("both_gpus", "allocates on cuda:0 and cuda:1", {0: 2560, 1: 2816}),
    ("peer_copy", "tensor on cuda:0 copied to cuda:1", {0: 2944}),
    ("bare_context0", 'only torch.zeros(1, device="cuda:0")', {}),
    ("nccl_rank0", "NCCL rank 0 of 2 on cuda:0, all_reduce done", {0: 2176}),
    ("nccl_rank1", "NCCL rank 1 of 2 on cuda:1, all_reduce done", {1: 2432}),
    ("fork_child", "child (never touches CUDA) of a cuda:0 holder that was SIGKILLed", {0: 2688}),
    ("defunct_leader", "a thread allocates on cuda:1, the leader called SYS_exit", {1: 3072}),
    ("ns_holder", "own PID namespace (unshare --pid --fork --mount-proc), allocates on cuda:1", {1: 2112}),
]
JOBS = [("nccl_rank0", "nccl_rank1")]  # by construction: stopped together under `collateral: stop`
SHAPE_NAMES = [s[0] for s in SHAPES]
# round 3: no process on both GPUs, no job; the default collateral (refuse) must not stand in the way
ROUND3_SHAPES = ["gpu0_only", "cvd1", "bare_context0", "fork_child", "defunct_leader", "ns_holder"]
FREE_MIB = 64                 # gpu_release's default threshold_mib
GPU0_DRIFT_MIB = 16           # "GPU 0 unchanged": far below a bare context (518-612 MiB)
HOLDER_KEYS = ("pid", "name", "gpus", "maps_gpus", "context_gpus", "evidence", "gpu_minors", "unattributed",
               "ambiguous", "ambiguous_gpus", "shares_mib", "heir_of", "job", "nvml_named_on", "map_lines", "via",
               "defunct_leader", "pgrp", "session", "nspid")


class Deadline(Exception):
    pass


# ---------------------------------------------------------------- workload side (one process per shape)

_keep = []


def start_watchdog(lifeline, lifetime):
    """End this whole process (exit_group) when the lifeline closes or the lifetime is over."""
    def watch():
        deadline = time.monotonic() + lifetime
        poller = select.poll()
        if lifeline >= 0:
            poller.register(lifeline, select.POLLIN | select.POLLHUP | select.POLLERR)
        while time.monotonic() < deadline:
            if poller.poll(max(0.0, min(deadline - time.monotonic(), 30.0)) * 1000):
                break
        os._exit(137)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def set_pdeathsig():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = os.environ.get("GPUOPS_MGPU_PARENT")
    if expected and os.getppid() != int(expected):  # the parent died before prctl
        os._exit(137)


def quiet_stdout():
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def report(doc):
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    quiet_stdout()


def sleep_forever():
    while True:
        time.sleep(3600)


class Allocator(object):
    """torch on the GPU, or nothing at all (--rehearse)."""

    def __init__(self, real):
        self.real = real
        self.torch = None
        if real:
            import torch
            self.torch = torch

    def alloc(self, device, mib):
        if not self.real:
            return None
        buf = self.torch.empty(mib * 2 ** 20, dtype=self.torch.uint8, device="cuda:%d" % device)
        buf.fill_(1)
        self.torch.cuda.synchronize(device)
        _keep.append(buf)
        return buf

    def copy(self, buf, device):
        if not self.real:
            return
        _keep.append(buf.to("cuda:%d" % device))
        self.torch.cuda.synchronize(device)

    def bare(self, device):
        if self.real:
            _keep.append(self.torch.zeros(1, device="cuda:%d" % device))
            self.torch.cuda.synchronize(device)

    def versions(self):
        if not self.real:
            return {}
        out = {"torch": self.torch.__version__, "cuda": self.torch.version.cuda}
        try:
            out["nccl"] = ".".join(str(v) for v in self.torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001  (only informative)
            pass
        return out


def allocate(alloc, sizes):
    for device, mib in sorted(sizes.items()):
        alloc.alloc(device, mib)


def worker_nccl(args, alloc, sizes):
    rank = args.rank
    if not alloc.real:  # rehearsal: a plain TCP link in place of NCCL's
        if rank == 0:
            server = socket.create_server(("127.0.0.1", args.port))
            _keep.append(server.accept())
        else:
            deadline = time.monotonic() + 60
            while True:
                try:
                    _keep.append(socket.create_connection(("127.0.0.1", args.port), timeout=5))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        return {}
    import datetime as dt
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    allocate(alloc, sizes)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % args.port, rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=90))
    value = torch.full((1 << 20,), float(rank + 1), device="cuda:%d" % rank)
    dist.all_reduce(value)
    torch.cuda.synchronize(rank)
    _keep.append(value)
    total = float(value[0].item())
    if total != 3.0:
        raise RuntimeError("all_reduce gave %s, not 3.0" % total)
    return {"all_reduce": total}


def worker_main(argv):
    p = argparse.ArgumentParser(prog="multi_gpu_modules.py %s" % TOKEN)
    p.add_argument("shape", choices=SHAPE_NAMES + ["fork_parent"])
    p.add_argument("--lifeline", type=int, default=-1)
    p.add_argument("--lifetime", type=float, default=300.0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--rehearse", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # cuda:N is NVML index N
    set_pdeathsig()
    start_watchdog(args.lifeline, args.lifetime)
    try:
        shape = "fork_child" if args.shape == "fork_parent" else args.shape
        sizes = next(s[2] for s in SHAPES if s[0] == shape)
        alloc = Allocator(not args.rehearse)
        doc = {"shape": args.shape, "pid": os.getpid(), "versions": alloc.versions()}
        if shape.startswith("nccl_rank"):
            doc.update(worker_nccl(args, alloc, sizes))
        elif shape == "peer_copy":
            buf = alloc.alloc(0, sizes[0])
            alloc.copy(buf, 1)
        elif shape == "bare_context0":
            alloc.bare(0)
        elif shape == "fork_child":
            allocate(alloc, sizes)
            child = os.fork()
            if child == 0:  # never touches CUDA; threads are gone after fork: a new watchdog
                start_watchdog(args.lifeline, args.lifetime)
                quiet_stdout()
                sleep_forever()
            doc["child"] = child
        elif shape == "defunct_leader":
            ready = []

            def holder():
                try:
                    allocate(alloc, sizes)
                    ready.append(threading.get_native_id())
                except BaseException:  # noqa: BLE001
                    ready.append(traceback.format_exc())
                sleep_forever()

            threading.Thread(target=holder, name="holder", daemon=True).start()
            deadline = time.monotonic() + 120
            while not ready and time.monotonic() < deadline:
                time.sleep(0.01)
            if not ready or not isinstance(ready[0], int):
                raise RuntimeError("allocating thread: %s" % (ready[0] if ready else "timed out"))
            doc["thread"] = ready[0]
            report(doc)
            number = SYS_EXIT[platform.machine()]
            ctypes.CDLL(None, use_errno=True).syscall(ctypes.c_long(number), ctypes.c_long(0))
            raise RuntimeError("SYS_exit returned")
        else:
            allocate(alloc, sizes)
        report(doc)
        sleep_forever()
    except BaseException:  # the driver waits for one line: always give it one
        try:
            sys.stdout.write(json.dumps({"error": traceback.format_exc()}) + "\n")
            sys.stdout.flush()
        finally:
            os._exit(1)


# ---------------------------------------------------------------- driver side

def read_stat(pid, tid=None):
    path = "/proc/%d/task/%d/stat" % (pid, tid) if tid else "/proc/%d/stat" % pid
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields


def alive(pid):
    """True while some thread of pid is not a zombie (a defunct leader with live threads is alive)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/%d/task" % pid)]
    except OSError:
        return False
    for tid in tids:
        try:
            if read_stat(pid, tid)[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue
    return False


def proc_counts(pid, minor_index):
    """{gpu index: [fds, mapping lines]} of /dev/nvidiaN, read through a live thread where the leader is gone."""
    out = {}
    tids = []
    try:
        tids = [pid] + [int(t) for t in os.listdir("/proc/%d/task" % pid) if int(t) != pid]
    except OSError:
        return out
    for tid in tids:
        base = "/proc/%d/task/%d" % (pid, tid)
        try:
            names = os.listdir(base + "/fd")
            with open(base + "/maps") as f:
                maps = f.read()
        except OSError:
            continue
        if not names and not maps:
            continue
        for minor, index in minor_index.items():
            node = "/dev/nvidia%d" % minor
            fds = 0
            for name in names:
                try:
                    fds += os.readlink("%s/fd/%s" % (base, name)) == node
                except OSError:
                    pass
            lines = sum(1 for line in maps.splitlines() if line.endswith(" " + node))
            out[index] = [fds, lines]
        break
    return out


def ns_child(pid):
    """The first child of pid (unshare --fork -> sh -> the holder), or None."""
    if not pid:
        return None
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:  # no CONFIG_PROC_CHILDREN: by ppid
        kids = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(read_stat(int(entry))[1]) == pid:
                    kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return min(kids) if kids else None


class Truth(object):
    """NVML's per-GPU lists, read in this (the host's) PID namespace."""

    def __init__(self, rehearse):
        self.rehearse = rehearse
        self.info = {}
        self.minor_index = {0: 0, 1: 1}
        if rehearse:
            return
        import pynvml
        self.nv = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        if count < 2:
            raise RuntimeError("this check needs 2 GPUs, NVML sees %d" % count)
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
        self.minor_index = dict((pynvml.nvmlDeviceGetMinorNumber(h), i) for i, h in enumerate(self.handles))
        self.info = {"driver": _text(pynvml.nvmlSystemGetDriverVersion()), "gpu_count": count,
                     "gpus": [{"index": i, "name": _text(pynvml.nvmlDeviceGetName(h)),
                               "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                               "minor": pynvml.nvmlDeviceGetMinorNumber(h)} for i, h in enumerate(self.handles)]}

    def gpus(self):
        """[{index, used_mib, processes: {pid: MiB or None}}] for GPUs 0 and 1."""
        out = []
        if self.rehearse:
            return [{"index": i, "used_mib": None, "processes": {}} for i in range(2)]
        nv = self.nv
        for index, handle in enumerate(self.handles):
            procs = {}
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                           "nvmlDeviceGetMPSComputeRunningProcesses"):
                try:
                    for p in getattr(nv, getter)(handle):
                        mib = p.usedGpuMemory // 2 ** 20 if isinstance(p.usedGpuMemory, int) else None
                        procs[p.pid] = max(procs.get(p.pid) or 0, mib or 0) if p.pid in procs else mib
                except (nv.NVMLError, AttributeError):
                    pass
            mem = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
            out.append({"index": index, "used_mib": mem.used // 2 ** 20, "processes": procs})
        return out


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


class Workloads(object):
    """One round of holders, all on one lifeline."""

    def __init__(self, driver, names=None):
        self.driver = driver
        self.names = list(names or SHAPE_NAMES)
        self.rfd, self.wfd = os.pipe()  # both non-inheritable; the read end is passed on explicitly
        self.procs = {}                 # name -> Popen
        self.docs = {}
        self.logs = {}
        self.pids = {}                  # name -> the pid that holds (host pid)
        self.nvml_pid = {}              # name -> the pid NVML names for it (the dead parent for the fork child)
        self.started = time.monotonic()

    def argv(self, shape, extra=()):
        return [sys.executable, os.path.abspath(__file__), TOKEN, shape, "--lifeline", str(self.rfd),
                "--lifetime", str(self.driver.lifetime)] + list(extra) + (["--rehearse"] if self.driver.rehearse else [])

    def spawn(self, name, argv, env_extra=None, new_session=False):
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(SAFE_ENV)
        env["GPUOPS_MGPU_PARENT"] = str(os.getpid())
        env.update(env_extra or {})
        log = open(os.path.join(self.driver.workdir, "%s-%d.log" % (name, self.driver.round_no)), "w+")
        self.logs[name] = log
        self.procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, pass_fds=(self.rfd,),
                                            env=env, start_new_session=new_session)

    def start(self):
        port = free_port()
        for name in self.names:
            if name == "fork_child":
                # its own session, as a shell job: the child's pgid and sid are the parent's pid
                self.spawn(name, self.argv("fork_parent"), new_session=True)
            elif name == "cvd1":
                self.spawn(name, self.argv(name), {"CUDA_VISIBLE_DEVICES": "1"})
            elif name.startswith("nccl_rank"):
                self.spawn(name, self.argv(name, ["--rank", name[-1], "--port", str(port)]))
            elif name == "ns_holder":
                # sh is the namespace's pid 1 and the holder pid 2, as in a container (pid 1 ignores SIGTERM)
                unshare = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                           "/bin/sh", "-c", '"$@" & wait', "sh"]
                env = {"GPUOPS_MGPU_PARENT": ""}  # its parent (sh) is checked by the lifeline alone
                self.spawn(name, unshare + self.argv(name), env)
            else:
                self.spawn(name, self.argv(name))
        pending = dict((p.stdout.fileno(), name) for name, p in self.procs.items())
        buffers = dict((fd, b"") for fd in pending)
        deadline = time.monotonic() + self.driver.start_timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("holders not ready after %d s: %s" % (
                    self.driver.start_timeout, self.describe(pending.values())))
            ready = select.select(list(pending), [], [], min(left, 1.0))[0]
            for fd in ready:
                chunk = os.read(fd, 65536)
                buffers[fd] += chunk
                if b"\n" in buffers[fd] or not chunk:
                    name = pending.pop(fd)
                    line = buffers[fd].split(b"\n", 1)[0]
                    doc = json.loads(line) if line.strip() else {"error": "exited (%s) without a word" %
                                                                 self.procs[name].poll()}
                    if "error" in doc:
                        raise RuntimeError("holder %s failed: %s%s" % (name, doc["error"], self.log_tail(name)))
                    self.docs[name] = doc
        for name, proc in self.procs.items():
            proc.stdout.close()
            pid = proc.pid
            if name == "ns_holder":
                pid = self.wait_for(lambda: ns_child(ns_child(proc.pid)), "the holder in ns_holder's namespace")
            self.pids[name] = pid
            self.nvml_pid[name] = pid
        # fork_child: SIGKILL the parent, reap it; the child holds the parent's memory
        parent = self.procs.get("fork_child")
        if parent is not None:
            parent.kill()
            parent.wait()
            self.pids["fork_child"] = self.docs["fork_child"]["child"]
            self.nvml_pid["fork_child"] = parent.pid
        self.startup_s = time.monotonic() - self.started

    def wait_for(self, probe, what, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(0.05)
        raise RuntimeError("could not find %s" % what)

    def log_tail(self, name, chars=1500):
        log = self.logs.get(name)
        if not log:
            return ""
        log.flush()
        log.seek(0)
        text = log.read()
        return "\n--- %s stderr ---\n%s" % (name, text[-chars:]) if text.strip() else ""

    def describe(self, names):
        return ", ".join("%s (exit %s)%s" % (n, self.procs[n].poll(), self.log_tail(n, 600)) for n in names)

    def stop(self):
        """Close the lifeline (every holder ends itself), then SIGKILL what is left and reap."""
        if self.wfd is not None:
            os.close(self.wfd)
            self.wfd = None
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None
        deadline = time.monotonic() + 10
        pids = list(self.pids.values()) + [p.pid for p in self.procs.values()]
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            for proc in self.procs.values():
                proc.poll()
            time.sleep(0.05)
        for pid in pids:
            if alive(pid) and self.ours(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in self.logs.values():
            log.close()

    @staticmethod
    def ours(pid):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                return TOKEN.encode() in f.read()
        except OSError:
            return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Driver(object):
    def __init__(self, args):
        self.args = args
        self.rehearse = args.rehearse
        self.deadline = time.monotonic() + args.deadline
        self.lifetime = args.deadline + 60
        self.start_timeout = args.start_timeout
        self.workdir = tempfile.mkdtemp(prefix="gpuops-mgpu-")
        self.round_no = 0
        self.plays = 0
        self.collections = []
        for spec in args.collection or ["tree=" + REPO]:
            name, path = (spec.split("=", 1) + [""])[:2]
            path = os.path.abspath(path or name)
            if not os.path.isdir(os.path.join(path, "plugins", "modules")):
                raise RuntimeError("collection %s: no plugins/modules under %s" % (name, path))
            root = os.path.join(self.workdir, "coll-" + name)
            os.makedirs(os.path.join(root, "ansible_collections", "gpuops"))
            os.symlink(path, os.path.join(root, "ansible_collections", "gpuops", "fleet"))
            self.collections.append({"name": name, "path": path, "root": root})
        self.playbook = shutil.which("ansible-playbook") or os.path.join(os.path.dirname(sys.executable),
                                                                         "ansible-playbook")
        if not os.path.exists(self.playbook):
            raise RuntimeError("ansible-playbook not found (PATH or beside %s)" % sys.executable)
        self.truth = Truth(self.rehearse)
        self.workloads = None

    def left(self):
        return self.deadline - time.monotonic()

    def play(self, coll, module, args, check=False):
        self.plays += 1
        book = os.path.join(self.workdir, "play-%d.yml" % self.plays)
        tree = os.path.join(self.workdir, "tree-%d" % self.plays)
        task = {"name": "module under test", "gpuops.fleet." + module: args}
        if check:
            task["check_mode"] = True
        with open(book, "w") as f:
            json.dump([{"hosts": "localhost", "gather_facts": False, "tasks": [task]}], f)
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=coll["root"], ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="True",
                   ANSIBLE_DEPRECATION_WARNINGS="False", ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree",
                   ANSIBLE_CALLBACK_TREE_DIR=tree, ANSIBLE_LOCAL_TEMP=os.path.join(self.workdir, "tmp"),
                   ANSIBLE_REMOTE_TMP=os.path.join(self.workdir, "rtmp"), ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="False")
        env.update(SAFE_ENV)
        started = time.monotonic()
        try:
            proc = subprocess.run([self.playbook, "-c", "local", "-i", "localhost,", "-e",
                                   "ansible_python_interpreter=" + sys.executable, book], env=env, check=False,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                                  timeout=min(PLAY_TIMEOUT, max(self.left(), 5)))
            rc, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc, output = -1, "ansible-playbook timed out: %s" % (exc.output or "")
        wall = time.monotonic() - started
        try:
            with open(os.path.join(tree, "localhost")) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {"failed": True, "msg": "no result from ansible-playbook (rc %s)" % rc}
        return {"collection": coll["name"], "module": module, "args": args, "check_mode": check, "rc": rc,
                "wall_s": round(wall, 2), "result": result, "output_tail": output[-4000:] if rc else ""}

    def snapshot(self, wl):
        gpus = self.truth.gpus()
        procs = {}
        for name, sizes in ((s[0], s[2]) for s in SHAPES if s[0] in wl.names):
            pid = wl.pids[name]
            nvml_pid = wl.nvml_pid[name]
            on = dict((g["index"], g["processes"][nvml_pid]) for g in gpus if nvml_pid in g["processes"])
            if self.rehearse:  # no NVML: the layout the shape intends stands in for it
                on = intended_gpus(name, sizes)
            procs[name] = {"pid": pid, "nvml_pid": nvml_pid, "alive": alive(pid), "nvml_mib": on,
                           "truth_gpus": sorted(on), "proc_counts": proc_counts(pid, self.truth.minor_index)}
        ours = set(wl.nvml_pid.values()) | set(wl.pids.values())
        for g in gpus:
            known = sum(m or 0 for p, m in g["processes"].items())
            g["unaccounted_mib"] = g["used_mib"] - known if g["used_mib"] is not None else None
            g["foreign_pids"] = sorted(p for p in g["processes"] if p not in ours)
        return {"time": time.time(), "gpus": gpus, "procs": procs}

    def wait_settled(self, before_pids, timeout=8.0):
        """After a release: until every dead holder's memory is gone from NVML (or timeout)."""
        deadline = time.monotonic() + timeout
        time.sleep(0.3)
        while time.monotonic() < deadline and not self.rehearse:
            listed = set(p for g in self.truth.gpus() for p in g["processes"])
            if not any(p in listed and not alive(p) for p in before_pids):
                break
            time.sleep(0.1)

    def wait_idle(self, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.rehearse:
            gpus = self.truth.gpus()
            if all(g["used_mib"] < 64 for g in gpus):
                return gpus
            time.sleep(0.1)
        return self.truth.gpus()

    def new_round(self, names=None):
        self.round_no += 1
        self.workloads = Workloads(self, names)
        self.workloads.start()
        time.sleep(0.3)  # NVML settles after the fork parent's death
        return self.workloads

    def end_round(self):
        if self.workloads:
            self.workloads.stop()
            self.workloads = None
        return self.wait_idle()

    def accepts_collateral(self, coll):
        res = self.play(coll, "gpu_release", {"gpus": ["1"], "match": TOKEN, "collateral": "stop"}, check=True)
        msg = str(res["result"].get("msg", ""))
        return not ("Unsupported parameters" in msg or "collateral" in msg and "unsupported" in msg.lower()), res


def intended_gpus(name, sizes):
    if name == "cvd1":
        return {1: sizes[0]}
    if name == "peer_copy":
        return {0: sizes[0], 1: sizes[0]}
    if name == "bare_context0":
        return {0: None}
    return dict(sizes)


def run(args):
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "host": platform.node(), "python": sys.version.split()[0], "rehearse": args.rehearse,
           "shapes": [{"name": n, "what": w, "mib": s} for n, w, s in SHAPES], "rounds": [], "checks": []}
    driver = None
    try:
        driver = Driver(args)
        doc["nvml"] = driver.truth.info
        doc["collections"] = [{"name": c["name"], "path": c["path"]} for c in driver.collections]
        doc["ansible"] = subprocess.run([driver.playbook, "--version"], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, universal_newlines=True, check=False).stdout.splitlines()[:1]
        doc["idle_before"] = driver.wait_idle(timeout=5)
        probes = [(c, driver.accepts_collateral(c)) for c in driver.collections]
        doc["collateral_probe"] = [{"collection": c["name"], "accepted": ok, "play": res} for c, (ok, res) in probes]
        first = driver.collections[0]

        # round 1: status and check mode with every collection, the real run with the first
        wl = driver.new_round()
        rnd = {"round": 1, "startup_s": round(wl.startup_s, 2), "pids": dict(wl.pids), "nvml_pids": dict(wl.nvml_pid),
               "docs": wl.docs, "plays": []}
        doc["rounds"].append(rnd)
        rnd["truth"] = driver.snapshot(wl)
        for coll in driver.collections:
            rnd["plays"].append(dict(driver.play(coll, "gpu_status", {"gpus": ["0", "1"]}), step="status"))
            rnd["plays"].append(dict(driver.play(coll, "gpu_release", dict(RELEASE_ARGS, gpus=["1"], match=TOKEN),
                                                 check=True), step="check"))
        rnd["truth_before_real"] = driver.snapshot(wl)
        rnd["plays"].append(dict(driver.play(first, "gpu_release", dict(RELEASE_ARGS, gpus=["1"], match=TOKEN)),
                                 step="real"))
        driver.wait_settled(list(wl.nvml_pid.values()))
        rnd["after"] = driver.snapshot(wl)
        rnd["idle_after_stop"] = driver.end_round()

        # round 2: collateral: stop, with the first collection that takes it
        takers = [c for c, answer in probes if answer[0]]
        if not takers:
            doc["round2_skipped"] = "no collection's gpu_release accepts `collateral` (%s)" % "; ".join(
                "%s: %s" % (c["name"], res["result"].get("msg", "")[:200]) for c, (ok, res) in probes)
        elif driver.left() < 60:
            doc["round2_skipped"] = "%.0f s left before --deadline" % driver.left()
        else:
            coll = takers[0]
            wl = driver.new_round()
            rnd = {"round": 2, "startup_s": round(wl.startup_s, 2), "pids": dict(wl.pids),
                   "nvml_pids": dict(wl.nvml_pid), "docs": wl.docs, "plays": []}
            doc["rounds"].append(rnd)
            rnd["truth"] = driver.snapshot(wl)
            args2 = dict(RELEASE_ARGS, gpus=["1"], match=TOKEN, collateral="stop")
            rnd["plays"].append(dict(driver.play(coll, "gpu_status", {"gpus": ["0", "1"]}), step="status"))
            rnd["plays"].append(dict(driver.play(coll, "gpu_release", args2, check=True), step="check"))
            rnd["truth_before_real"] = driver.snapshot(wl)
            rnd["plays"].append(dict(driver.play(coll, "gpu_release", args2), step="real"))
            driver.wait_settled(list(wl.nvml_pid.values()))
            rnd["after"] = driver.snapshot(wl)
            rnd["idle_after_stop"] = driver.end_round()

        # round 3: no holder on both GPUs, no job; the default collateral (refuse)
        if driver.left() < 60:
            doc["round3_skipped"] = "%.0f s left before --deadline" % driver.left()
        else:
            coll = takers[0] if takers else first
            wl = driver.new_round(ROUND3_SHAPES)
            rnd = {"round": 3, "shapes": list(ROUND3_SHAPES), "startup_s": round(wl.startup_s, 2),
                   "pids": dict(wl.pids), "nvml_pids": dict(wl.nvml_pid), "docs": wl.docs, "plays": []}
            doc["rounds"].append(rnd)
            rnd["truth"] = driver.snapshot(wl)
            args3 = dict(RELEASE_ARGS, gpus=["1"], match=TOKEN)
            rnd["plays"].append(dict(driver.play(coll, "gpu_status", {"gpus": ["0", "1"]}), step="status"))
            rnd["plays"].append(dict(driver.play(coll, "gpu_release", args3, check=True), step="check"))
            rnd["truth_before_real"] = driver.snapshot(wl)
            rnd["plays"].append(dict(driver.play(coll, "gpu_release", args3), step="real"))
            driver.wait_settled(list(wl.nvml_pid.values()))
            rnd["after"] = driver.snapshot(wl)
            rnd["idle_after_stop"] = driver.end_round()
    except Deadline:
        doc["error"] = "--deadline of %d s reached" % args.deadline
    except (SystemExit, KeyboardInterrupt) as exc:
        doc["error"] = "stopped by a signal (%r)" % exc
    except Exception:  # noqa: BLE001  (recorded, then the holders are stopped)
        doc["error"] = traceback.format_exc()
    finally:
        signal.alarm(0)
        if driver is not None:
            try:
                driver.end_round()
            except Exception:  # noqa: BLE001
                doc.setdefault("cleanup_error", traceback.format_exc())
    evaluate(doc)
    return doc


# ---------------------------------------------------------------- evaluation and report

def mispinned(play, truth, names):
    """'name: truth [..], module [..]' for each process gpu_status did not pin to exactly NVML's GPUs."""
    by_pid = holders_by_pid(play)
    wrong = []
    for n in names:
        h = by_pid.get(truth["procs"][n]["pid"])
        if h is None or sorted(h.get("gpus") or []) != truth["procs"][n]["truth_gpus"]:
            wrong.append("%s: truth %s, module %s" % (n, truth["procs"][n]["truth_gpus"], None if h is None else h.get("gpus")))
    return wrong


def holders_by_pid(play):
    return dict((h.get("pid"), h) for h in (play or {}).get("result", {}).get("holders", []) or [])


def round_names(rnd):
    """The shapes of a round, in SHAPES order (rounds 1 and 2: all of them)."""
    return rnd.get("shapes") or SHAPE_NAMES


def gpu0_only(truth, names):
    return [n for n in names if truth["procs"][n]["truth_gpus"] == [0]]


def on_gpu(truth, names, index):
    return [n for n in names if index in truth["procs"][n]["truth_gpus"]]


def nvml_gpu(snap, index):
    """The GPU entry of a snapshot, or {}."""
    for g in (snap or {}).get("gpus", []):
        if g.get("index") == index:
            return g
    return {}


def plan_pids(play):
    res = (play or {}).get("result", {})
    return sorted(set(p.get("pid") for p in res.get("plan", []) or []))


def signalled_pids(play):
    res = (play or {}).get("result", {})
    return sorted(set(a.get("pid") for a in res.get("actions", []) or [] if a.get("outcome") == "sent"))


def check(doc, name, ok, detail):
    doc["checks"].append({"check": name, "ok": bool(ok), "detail": detail})


def evaluate(doc):
    for rnd in doc["rounds"]:
        truth = rnd.get("truth")
        if not truth:
            continue
        r = rnd["round"]
        names = round_names(rnd)
        zero_only = gpu0_only(truth, names)
        rnd["gpu0_only"] = zero_only
        on_one = on_gpu(truth, names, 1)
        if r == 3:
            evaluate_round3(doc, rnd, names, zero_only, on_one)
            continue
        for play in rnd["plays"]:
            coll = play["collection"]
            if play["step"] == "status":
                wrong = mispinned(play, truth, names)
                check(doc, "round %d, %s: gpu_status pins every holder to NVML's GPUs" % (r, coll), not wrong
                      and play["rc"] == 0, "; ".join(wrong) or "all %d right" % len(names))
            elif play["step"] == "check":
                if not answered(play):
                    check(doc, "round %d, %s: check-mode plan for gpus [1] holds no GPU-0-only process" % (r, coll),
                          False, "no plan: %s" % play["result"].get("msg"))
                    continue
                pids = plan_pids(play)
                bad = [n for n in zero_only if truth["procs"][n]["pid"] in pids]
                if r == 2:  # collateral: stop takes the whole job: GPU-0-only job peers of GPU-1 holders may go
                    bad = [n for n in bad if not job_with(n, on_one)]
                check(doc, "round %d, %s: check-mode plan for gpus [1] holds no GPU-0-only process" % (r, coll),
                      not bad, "in the plan: %s" % (bad or "none"))
            elif play["step"] == "real":
                if not answered(play):
                    check(doc, "round %d, %s: every GPU-0-only process alive after the real gpu_release" % (r, coll),
                          False, "no decision: %s" % play["result"].get("msg"))
                    continue
                after = rnd.get("after", {}).get("procs", {})
                dead = [n for n in zero_only if not after.get(n, {}).get("alive")]
                if r == 2:
                    dead = [n for n in dead if not job_with(n, on_one)]
                check(doc, "round %d, %s: every GPU-0-only process alive after the real gpu_release" % (r, coll),
                      not dead, "killed: %s" % (dead or "none"))
    doc["passed"] = bool(doc["checks"]) and all(c["ok"] for c in doc["checks"]) and "error" not in doc


def evaluate_round3(doc, rnd, names, zero_only, on_one):
    """Round 3: no holder spans both GPUs, so the default collateral (refuse) must free GPU 1 alone."""
    truth = rnd["truth"]
    both = [n for n in names if truth["procs"][n]["truth_gpus"] == [0, 1]]
    check(doc, "round 3: no holder on both GPUs (NVML), GPU-0-only and GPU-1 holders present", not both and zero_only
          and on_one, "both: %s; GPU 0 only: %s; GPU 1: %s" % (both or "none", zero_only, on_one))
    for play in rnd["plays"]:
        coll = play["collection"]
        res = play["result"]
        if play["step"] == "status":
            wrong = mispinned(play, truth, names)
            check(doc, "round 3, %s: gpu_status pins every holder to NVML's GPUs" % coll, not wrong and play["rc"] == 0,
                  "; ".join(wrong) or "all %d right" % len(names))
        elif play["step"] == "check":
            want = sorted(truth["procs"][n]["pid"] for n in on_one)
            got = plan_pids(play)
            by_pid = dict((truth["procs"][n]["pid"], n) for n in names)
            check(doc, "round 3, %s: check-mode plan for gpus [1] is exactly the GPU-1 holders" % coll,
                  play["rc"] == 0 and got == want,
                  "rc %s; plan %s; GPU-1 holders %s%s" % (
                      play["rc"], [by_pid.get(p, p) for p in got], on_one,
                      "; msg: %s" % cell(res.get("msg"))[:300] if play["rc"] else ""))
        elif play["step"] == "real":
            msg = str(res.get("msg", ""))
            check(doc, "round 3, %s: the real gpu_release succeeds (verified free)" % coll,
                  play["rc"] == 0 and not res.get("failed") and "verified free" in msg,
                  "rc %s, msg: %s" % (play["rc"], cell(msg)[:300]))
            after = rnd.get("after") or {}
            before = rnd.get("truth_before_real") or {}
            one = nvml_gpu(after, 1)
            used1 = one.get("used_mib")
            check(doc, "round 3, %s: GPU 1 free by NVML after the real run" % coll,
                  used1 is not None and used1 <= FREE_MIB and not one.get("processes"),
                  "GPU 1 v2 used %s MiB (free: at most %d), pids %s" % (
                      used1, FREE_MIB, sorted(int(p) for p in one.get("processes") or {})))
            states = after.get("procs", {})
            dead = [n for n in zero_only if not states.get(n, {}).get("alive")]
            check(doc, "round 3, %s: every GPU-0-only process alive after the real gpu_release" % coll,
                  zero_only and not dead, "GPU 0 only: %s; killed: %s" % (zero_only, dead or "none"))
            used0_before = nvml_gpu(before, 0).get("used_mib")
            used0_after = nvml_gpu(after, 0).get("used_mib")
            drift = None if used0_before is None or used0_after is None else used0_after - used0_before
            check(doc, "round 3, %s: GPU 0 used MiB unchanged by the real gpu_release" % coll,
                  drift is not None and abs(drift) <= GPU0_DRIFT_MIB,
                  "GPU 0 v2 used %s MiB before, %s after (allowed drift %d MiB)" % (
                      used0_before, used0_after, GPU0_DRIFT_MIB))
            left = [n for n in on_one if states.get(n, {}).get("alive", True)]
            check(doc, "round 3, %s: every GPU-1 process gone after the real gpu_release" % coll,
                  on_one and not left, "GPU 1: %s; still alive: %s" % (on_one, left or "none"))


def answered(play):
    """The module decided on these holders: a plan, a state after NVML answered, or a refusal over collateral."""
    res = play["result"]
    return bool(res.get("before")) or "collateral" in str(res.get("msg", "")).lower()


def job_with(name, on_one):
    return any(name in job and any(m in on_one for m in job if m != name) for job in JOBS)


def fmt_gpus(value):
    if value is None:
        return "absent"
    if isinstance(value, list):
        return "[%s]" % ", ".join(str(v) for v in value)
    return str(value)


def fmt_mib(on, index):
    if index not in on:
        return "-"
    return "n/a" if on[index] is None else str(on[index])


def cell(value):
    return str(value).replace("|", "/").replace("\n", " ")


def render(doc):
    out = ["## Two real GPUs: gpu_status and gpu_release per holder (`tests/bench/multi_gpu_modules.py`)", ""]
    nv = doc.get("nvml") or {}
    gpus = ", ".join("%d: %s (minor %d)" % (g["index"], g["name"], g["minor"]) for g in nv.get("gpus", []))
    versions = {}
    for rnd in doc["rounds"]:
        for d in rnd.get("docs", {}).values():
            versions.update(d.get("versions") or {})
    out.append("Measured %s on %s; driver %s; GPUs %s; Python %s, %s, torch %s (CUDA %s, NCCL %s). "
               "Collections: %s. Every holder is a process of this script (`match: %s`); NCCL_NVLS_ENABLE=0, "
               "TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 in every environment. Truth: NVML's "
               "per-GPU process lists read on the host (for the fork child, its dead parent's pid)."
               % (doc["date"], doc["host"], nv.get("driver"), gpus or "none", doc["python"],
                  (doc.get("ansible") or ["ansible ?"])[0], versions.get("torch"), versions.get("cuda"),
                  versions.get("nccl"), ", ".join("`%s` (%s)" % (c["name"], c["path"]) for c in
                                                  doc.get("collections", [])), TOKEN))
    if doc.get("rehearse"):
        out += ["", "**Rehearsal without a GPU: no torch, no NVML; the truth is the intended layout.**"]
    if doc.get("error"):
        out += ["", "**Run failed:**", "", "```", doc["error"].strip()[-3000:], "```"]
    for rnd in doc["rounds"]:
        out += render_round(rnd)
    if doc.get("round2_skipped"):
        out += ["", "Round 2 (`collateral: stop`) skipped: %s" % cell(doc["round2_skipped"])]
    if doc.get("round3_skipped"):
        out += ["", "Round 3 (GPU-1-only holders, default collateral) skipped: %s" % cell(doc["round3_skipped"])]
    out += ["", "### Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in doc["checks"]:
        out.append("| %s | %s | %s |" % (cell(c["check"]), "pass" if c["ok"] else "**FAIL**", cell(c["detail"])))
    out += ["", "Overall: %s." % ("all checks passed" if doc.get("passed") else "**not passed**")]
    return "\n".join(out) + "\n"


def render_round(rnd):
    truth = rnd.get("truth")
    if not truth:
        return []
    r = rnd["round"]
    names = round_names(rnd)
    out = ["", "### Round %d: holders and NVML (start-up %.1f s)" % (r, rnd["startup_s"]), "",
           "| # | process | pid | NVML pid | NVML GPU 0 MiB | NVML GPU 1 MiB | /dev/nvidia0 fds/maps | "
           "/dev/nvidia1 fds/maps | truth GPUs |",
           "|---|---|---|---|---|---|---|---|---|"]
    for i, name in enumerate(names):
        p = truth["procs"][name]
        on = dict((int(k), v) for k, v in p["nvml_mib"].items())
        counts = dict((int(k), v) for k, v in p["proc_counts"].items())
        out.append("| %d | `%s` | %d | %d | %s | %s | %s | %s | %s |" % (
            i + 1, name, p["pid"], p["nvml_pid"], fmt_mib(on, 0), fmt_mib(on, 1),
            "/".join(map(str, counts.get(0, ["-", "-"]))), "/".join(map(str, counts.get(1, ["-", "-"]))),
            fmt_gpus(p["truth_gpus"])))
    out.append("")
    out.append("GPU-level: " + "; ".join("GPU %d v2 used %s MiB, unaccounted %s MiB%s" % (
        g["index"], g["used_mib"], g["unaccounted_mib"],
        (", other pids %s" % g["foreign_pids"]) if g["foreign_pids"] else "") for g in truth["gpus"]) + ".")
    statuses = [p for p in rnd["plays"] if p["step"] == "status"]
    for play in statuses:
        by_pid = holders_by_pid(play)
        res = play["result"]
        out += ["", "#### gpu_status `gpus: [0, 1]`, collection `%s` (rc %s%s)" % (
            play["collection"], play["rc"], ", failed: " + cell(res.get("msg", ""))[:300] if play["rc"] else ""), "",
            "| process | truth GPUs | `gpus` | `maps_gpus` | `evidence` | `gpu_minors` | other | right? |",
            "|---|---|---|---|---|---|---|---|"]
        for name in names:
            p = truth["procs"][name]
            h = by_pid.get(p["pid"])
            if h is None:
                out.append("| `%s` | %s | not a holder | | | | | **no** |" % (name, fmt_gpus(p["truth_gpus"])))
                continue
            other = []
            for key in ("unattributed", "ambiguous", "ambiguous_gpus", "heir_of", "job", "nvml_named_on",
                        "defunct_leader"):
                if h.get(key) not in (None, False, [], {}):
                    other.append("%s=%s" % (key, json.dumps(h[key])))
            right = sorted(h.get("gpus") or []) == p["truth_gpus"]
            out.append("| `%s` | %s | %s | %s | %s | %s | %s | %s |" % (
                name, fmt_gpus(p["truth_gpus"]), fmt_gpus(h.get("gpus")), fmt_gpus(h.get("maps_gpus")),
                fmt_gpus(h.get("evidence")), fmt_gpus(h.get("gpu_minors")), cell(", ".join(other)),
                "yes" if right else "**no**"))
        per_gpu = res.get("gpus") or []
        if per_gpu:
            out.append("")
            out.append("Per GPU: " + "; ".join("GPU %s holders %s%s" % (
                g.get("index"), g.get("holders"), ", unattributed %s MiB" % g.get("unattributed_mib")
                if g.get("unattributed_mib") else "") for g in per_gpu) + ".")
    releases = [p for p in rnd["plays"] if p["step"] in ("check", "real")]
    if releases:
        after = rnd.get("after", {}).get("procs", {})
        heads = ["%s `%s`%s" % (p["step"], p["collection"], " (failed: nothing sent)" if p["rc"] else "")
                 for p in releases]
        extra = {2: ", collateral: stop", 3: ", collateral: refuse (the default)"}.get(r, "")
        out += ["", "#### gpu_release `gpus: [1]`, `match: %s`%s" % (TOKEN, extra), "",
                "| process | truth GPUs | " + " | ".join(heads) + " | alive after the real run |",
                "|---|---|" + "---|" * len(heads) + "---|"]
        for name in names:
            p = truth["procs"][name]
            cells = []
            for play in releases:
                res = play["result"]
                plan = dict((e.get("pid"), e) for e in res.get("plan", []) or [])
                skipped = dict((e.get("pid"), e) for e in res.get("not_signalled", []) or [])
                if play["step"] == "real" and p["pid"] in signalled_pids(play):
                    sent = [a["signal"] for a in res.get("actions", []) if a.get("pid") == p["pid"]]
                    cells.append("signalled (%s)" % ", ".join(sent))
                elif p["pid"] in plan:
                    e = plan[p["pid"]]
                    job = ", job %s" % e["job"] if e.get("job") else ""
                    cells.append("planned, gpus %s%s" % (fmt_gpus(e.get("gpus")), job))
                elif p["pid"] in skipped:
                    cells.append("left: %s" % cell(skipped[p["pid"]].get("reason", ""))[:90])
                else:
                    cells.append("-")
            state = after.get(name, {})
            out.append("| `%s` | %s | %s | %s |" % (name, fmt_gpus(p["truth_gpus"]), " | ".join(cells),
                                                    "yes" if state.get("alive") else "no"))
        out.append("")
        for play in releases:
            res = play["result"]
            out.append("- %s `%s`: rc %s, changed %s, failed %s, rung %s, released %s MiB, elapsed %s s%s." % (
                play["step"], play["collection"], play["rc"], res.get("changed"), bool(play["rc"] or res.get("failed")),
                res.get("rung_reached"), res.get("released_mib"), res.get("elapsed_s"),
                "; msg: " + cell(res.get("msg"))[:900] if res.get("msg") else ""))
        if r == 3 and rnd.get("truth_before_real"):
            out.append("- NVML before the real run: " + "; ".join("GPU %d used %s MiB (unaccounted %s), pids %s" % (
                g["index"], g["used_mib"], g["unaccounted_mib"], sorted(int(p) for p in g["processes"]))
                for g in rnd["truth_before_real"]["gpus"]) + ".")
        if rnd.get("after"):
            out.append("- NVML after the real run: " + "; ".join("GPU %d used %s MiB (unaccounted %s), pids %s" % (
                g["index"], g["used_mib"], g["unaccounted_mib"], sorted(int(p) for p in g["processes"]))
                for g in rnd["after"]["gpus"])
                + ".")
    return out


def driver_main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for mgpu.json and mgpu.md")
    p.add_argument("--collection", action="append",
                   help="NAME=PATH of a collection root to run the modules from (repeatable; the first one also "
                        "does the real gpu_release); default: this working tree")
    p.add_argument("--deadline", type=float, default=270.0, help="seconds for everything; holders live 60 s more")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for all holders to be ready")
    p.add_argument("--rehearse", action="store_true", help="no GPU: no torch, no NVML")
    p.add_argument("--render", metavar="JSON", help="only re-check and re-render a saved mgpu.json into --out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.render:
        with open(args.render) as f:
            doc = json.load(f)
        doc["checks"] = []
        evaluate(doc)
        text = render(doc)
        with open(os.path.join(args.out, "mgpu.md"), "w") as f:
            f.write(text)
        print(text)
        return 0 if doc["passed"] else 1

    def on_alarm(signum, frame):
        raise Deadline()

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    signal.alarm(max(1, int(args.deadline)))
    doc = run(args)
    with open(os.path.join(args.out, "mgpu.json"), "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True, default=str)
    text = render(doc)
    with open(os.path.join(args.out, "mgpu.md"), "w") as f:
        f.write(text)
    print(text)
    if not doc["rounds"]:
        return 2
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == TOKEN:
        worker_main(sys.argv[2:])
    else:
        sys.exit(driver_main(sys.argv[1:]))
