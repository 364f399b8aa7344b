#!/usr/bin/env python
"""Lab workloads that hold fake GPU memory the way CUDA processes do (stdlib only).

A CUDA process opens and maps the node of every GPU visible to it (GPU_FACTS rows 9-12):
- a context GPU: nvidiactl, 3 x nvidiaM, nvidia-uvm O_RDWR, flock(LOCK_SH) on nvidiaM,
  each fd mmapped MAP_SHARED (nvidiaM on 3 map lines), then `alloc` to the lab driver;
- a GPU only visible: 2 x nvidiaM, each mmapped (2 map lines), no flock, no alloc;
- a GPU hidden by CUDA_VISIBLE_DEVICES: one fd, no mapping.
The visible GPUs are the /dev/nvidiaM files present, in the driver's NVML index order.
Each scenario reproduces rows of GPU_FACTS.md; see tests/lab/README.md, "Workloads".

Without --foreground the first process forks the workload (new session),
prints one JSON line once every context is allocated, and exits.
"""

import argparse
import ctypes
import fcntl
import json
import os
import platform
import re
import select
import signal
import socket
import sys
import threading
import time

SCENARIOS = ("plain", "term_ignoring", "fork_inherit", "defunct_leader", "zombie", "mmap_only",
             "tp_server", "monitor", "bystander_gpu", "bystander_cpu", "stray_context", "tp_nccl",
             "two_parents", "ipc_consumer", "launcher_respawn", "tcp_server", "tcp_client", "mps")
CONTEXT_MAPS = 3  # map lines of /dev/nvidiaM on a context GPU (GPU_FACTS row 12)
VISIBLE_MAPS = 2  # on a GPU that is only visible (row 9)
BARE_CONTEXT_MIB = 518  # a stray or bare context (rows 13, 15, 17)
DEFAULT_SOCKET = "/run/nvidia-lab/driver.sock"
SYS_EXIT = {"x86_64": 60, "aarch64": 93}
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
RESPAWN_BACKOFF_S = 0.5  # a worker that failed on its own (not killed) is replaced after this, never in a busy loop
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1
MADV_DONTFORK = 10
PAGE = 4096
READY_TIMEOUT_S = 60

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FAILED = ctypes.c_void_p(-1).value


class WorkloadError(Exception):
    pass


# ---- reporting the result to whoever started us ----

class Reporter:
    """Writes the one JSON result line (or an error) to fd: a pipe to the launcher, or stdout."""

    def __init__(self, fd):
        self.fd = fd

    def _write(self, text):
        data = text.encode()
        while data:
            data = data[os.write(self.fd, data):]

    def report(self, scenario, roles, holders, dead=None, top=None, extra=None):
        """dead: pids that are gone on purpose (fork_inherit --kill-parent) and cannot be translated.
        top: the workload's top process when it has no role (a launcher). extra: more fields (a port)."""
        pids = ([top] if top else []) + list(roles.values())
        line = {"scenario": scenario, "pids": list(dict.fromkeys(pids)), "roles": roles,
                "holders": holders}
        line.update(extra or {})
        if dead:
            line["dead"] = dead
        self._write(json.dumps(line) + "\n")

    def error(self, message):
        try:
            self._write("ERROR %s\n" % message)
        except OSError:
            pass


# ---- the fake CUDA context ----

def driver_request(args, request):
    path = args.socket or os.environ.get("NVIDIA_LAB_SOCKET") or DEFAULT_SOCKET
    node = args.node or os.environ.get("NVIDIA_LAB_NODE")
    if node:
        request = dict(request, node=node)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        try:
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            answer = sock.makefile().read()
        except OSError as exc:
            raise WorkloadError("lab driver at %s: %s" % (path, exc)) from exc
    reply = json.loads(answer)
    if not reply.get("ok"):
        raise WorkloadError("lab driver refused %s: %s" % (request.get("op"), reply.get("error")))
    return reply


def map_shared(fd):
    addr = libc.mmap(None, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        raise WorkloadError("mmap failed: %s" % os.strerror(ctypes.get_errno()))
    return addr


def dev_path(args, name):
    path = os.path.join(args.dev_dir, name)
    if not os.path.isfile(path):  # never a real NVIDIA character device
        raise WorkloadError("%s is not a lab device file" % path)
    return path


def open_all(paths, flags=os.O_RDWR):
    fds = []
    try:
        for path in paths:
            fds.append(os.open(path, flags))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise WorkloadError("open %s: %s" % (exc.filename, exc.strerror)) from exc
    return fds


def visible_minors(args):
    """Minors of the /dev/nvidiaM files present, in the NVML index order the driver shows this process."""
    if getattr(args, "visible", None) is None:
        try:
            present = {int(m.group(1)) for m in map(re.compile(r"nvidia(\d+)$").match, os.listdir(args.dev_dir)) if m}
        except OSError as exc:
            raise WorkloadError("list %s: %s" % (args.dev_dir, exc.strerror)) from exc
        try:
            order = driver_request(args, {"op": "view"})["minors"]
        except WorkloadError:
            order = sorted(present)  # an older driver: no view op
        args.visible = [m for m in order if m in present]
    return args.visible


def cuda_visible(visible):
    """The minors CUDA shows: CUDA_VISIBLE_DEVICES picks NVML indexes and stops at the first invalid one."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return list(visible)
    shown = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= len(visible):
            break
        if visible[int(item)] not in shown:
            shown.append(visible[int(item)])
    return shown


class Context:
    """One fake CUDA context on one minor. The mappings are never unmapped."""

    CAPS = ("nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2")

    def __init__(self, args, minor, mib, mps=False):
        self.minor = minor
        paths = ([dev_path(args, "nvidiactl")] + [dev_path(args, "nvidia%d" % minor)] * CONTEXT_MAPS
                 + [dev_path(args, "nvidia-uvm")])
        self.fds = open_all(paths)
        fcntl.flock(self.fds[1], fcntl.LOCK_SH)
        self.maps = [map_shared(fd) for fd in self.fds]
        # CUDA's nvidia-uvm mappings are not inherited by a fork (measured on the H200).
        libc.madvise(ctypes.c_void_p(self.maps[-1]), PAGE, MADV_DONTFORK)
        # CUDA also keeps the capability nodes open, as fds only (measured on the H200).
        caps = [os.path.join(args.dev_dir, name) for name in self.CAPS]
        self.fds += open_all([path for path in caps if os.path.isfile(path)], os.O_RDONLY)
        request = {"op": "alloc", "minor": minor, "mib": mib}
        if mps:
            request["mps"] = True   # an MPS client: NVML's MPS list names it too (GPU_FACTS row 26)
        driver_request(args, request)


class VisibleGpu:
    """A GPU CUDA can see but where this process has no context: 2 mappings (1 fd, no mapping when hidden)."""

    def __init__(self, args, minor, shown):
        path = dev_path(args, "nvidia%d" % minor)
        self.minor = minor
        self.fds = open_all([path] * (VISIBLE_MAPS if shown else 1))
        self.maps = [map_shared(fd) for fd in self.fds] if shown else []


class Runtime:
    """Everything one CUDA process holds: contexts {minor: MiB}, plus every other visible GPU."""

    def __init__(self, args, contexts, mps=False):
        visible = visible_minors(args)
        shown = cuda_visible(visible)
        for minor in contexts:
            if minor not in visible:
                raise WorkloadError("minor %d is not visible to this process (visible: %s)"
                                    % (minor, ",".join(map(str, visible)) or "none"))
            if minor not in shown:
                raise WorkloadError("minor %d is hidden by CUDA_VISIBLE_DEVICES=%s"
                                    % (minor, os.environ.get("CUDA_VISIBLE_DEVICES")))
        self.others = [VisibleGpu(args, m, m in shown) for m in visible if m not in contexts]
        self.contexts = [Context(args, minor, mib, mps) for minor, mib in contexts.items()]

    def close_fds(self):
        for part in self.others + self.contexts:
            for fd in part.fds:
                os.close(fd)
            part.fds = []


def make_contexts(args, minors=None, mib=None, mps=False):
    """A Runtime with a context of mib (default --mib) on each of minors (default --minors); mps: as an MPS
    client."""
    minors = args.minors if minors is None else minors
    return Runtime(args, {minor: args.mib if mib is None else mib for minor in minors}, mps)


# ---- process helpers ----

def set_name(name):
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def proc_state(pid):
    """One-letter state of pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_state(pid, states, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_state(pid) in states:
            return
        time.sleep(0.005)
    raise WorkloadError("pid %d did not reach state %s" % (pid, "/".join(str(s) for s in states)))


def sleep_forever():
    while True:
        time.sleep(3600)


def start_sleepers(count, prefix="worker"):
    for i in range(count):
        threading.Thread(target=sleep_forever, name="%s-%d" % (prefix, i), daemon=True).start()


def reap_children(_signum, _frame):
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def read_lines(read_fd, count):
    """Reads count lines from workers (never more); raises on a worker's error."""
    lines = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    buf = b""
    while len(lines) < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            raise WorkloadError("workers not ready after %d s" % READY_TIMEOUT_S)
        byte = os.read(read_fd, 1)
        if not byte:
            raise WorkloadError("a worker died before it was ready")
        if byte != b"\n":
            buf += byte
            continue
        line, buf = buf.decode(), b""
        if line.startswith("ERROR"):
            raise WorkloadError(line[6:])
        lines.append(line)
    return lines


def wait_ready(read_fd, count):
    read_lines(read_fd, count)


def child_body(report_fd, body):
    """Runs body in a forked child; on error tells report_fd and exits."""
    try:
        body()
    except BaseException as exc:  # the child must never fall back into the parent's code
        Reporter(report_fd).error("pid %d: %s" % (os.getpid(), exc))
        os._exit(1)
    os._exit(0)


def fork_ready_child(read_fd, write_fd, setup):
    """Forks a child that runs setup() (it returns what must stay alive), says "ready" on write_fd and lives on;
    returns its pid."""
    def body():
        os.close(read_fd)
        keep = setup()
        os.write(write_fd, b"ready\n")
        sleep_forever()
        return keep

    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        child_body(write_fd, body)
    return child


# ---- scenarios: each reports once, then lives on ----

def run_holder(args, reporter, role="holder"):
    """plain, term_ignoring, bystander_gpu: one process with a context per minor."""
    if args.scenario == "term_ignoring":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep = make_contexts(args)
    start_sleepers(args.threads)
    reporter.report(args.scenario, {role: os.getpid()}, [os.getpid()])
    sleep_forever()
    return keep


def run_mmap_only(args, reporter):
    runtime = make_contexts(args)
    runtime.close_fds()  # the mappings keep the contexts (GPU_FACTS row 6)
    start_sleepers(args.threads)
    reporter.report(args.scenario, {"holder": os.getpid()}, [os.getpid()])
    sleep_forever()


def run_fork_inherit(args, reporter):
    keep = make_contexts(args)
    parent = os.getpid()
    signal.signal(signal.SIGCHLD, reap_children)

    def dataloader():
        set_name("pt_data_worker")
        if args.kill_parent:
            os.kill(parent, signal.SIGKILL)
            wait_state(parent, ("Z", "X", None))
            reporter.report(args.scenario, {"parent": parent, "child": os.getpid()}, [os.getpid()], dead=[parent])
        sleep_forever()

    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        child_body(reporter.fd, dataloader)
    if not args.kill_parent:
        reporter.report(args.scenario, {"parent": parent, "child": child}, [parent, child])
    sleep_forever()
    return keep


def run_defunct_leader(args, reporter):
    keep = make_contexts(args)
    leader = os.getpid()
    syscall_nr = SYS_EXIT.get(platform.machine())
    if syscall_nr is None:
        raise WorkloadError("no SYS_exit number for %s" % platform.machine())

    def announce():
        try:
            wait_state(leader, ("Z",))
            reporter.report(args.scenario, {"leader": leader}, [leader])
        except WorkloadError as exc:
            reporter.error(str(exc))
        sleep_forever()

    start_sleepers(max(args.threads - 1, 0))
    threading.Thread(target=announce, name="announce", daemon=True).start()
    # Only the leader thread exits: ps shows "Zl <defunct>", threads keep the fds (GPU_FACTS row 4).
    libc.syscall(syscall_nr, 0)
    return keep


def run_zombie(args, reporter):
    read_fd, write_fd = os.pipe()

    def holder():
        os.close(read_fd)
        make_contexts(args)
        os.write(write_fd, b"ready\n")
        sleep_forever()

    child = os.fork()
    if child == 0:
        child_body(write_fd, holder)
    os.close(write_fd)
    wait_ready(read_fd, 1)
    os.kill(child, signal.SIGKILL)
    wait_state(child, ("Z",))  # never reaped: a true zombie holds nothing (GPU_FACTS row 3)
    reporter.report(args.scenario, {"parent": os.getpid(), "zombie": child}, [])
    sleep_forever()


def run_tp_server(args, reporter):
    signal.signal(signal.SIGCHLD, reap_children)
    read_fd, write_fd = os.pipe()
    roles = {"parent": os.getpid()}
    workers = []
    for rank, minor in enumerate(args.minors):
        def worker(rank=rank, minor=minor):
            set_name("tp_worker%d" % rank)
            return make_contexts(args, [minor])

        child = fork_ready_child(read_fd, write_fd, worker)
        roles["worker%d" % rank] = child
        workers.append(child)
    os.close(write_fd)
    wait_ready(read_fd, len(workers))
    reporter.report(args.scenario, roles, workers)
    sleep_forever()


MPS_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "driver", "nvidia-cuda-mps-control")


def mps_ask(pipe, command):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.path.join(pipe, "control"))
    with conn:
        conn.sendall((command + "\n").encode())
        return conn.makefile().read().strip()


def run_mps(args, reporter):
    """An MPS control daemon (its own CUDA_MPS_PIPE_DIRECTORY), its server (66 MiB on the first minor) and one
    client per minor (--mib each), in NVML's compute and MPS lists (GPU_FACTS rows 26-28)."""
    signal.signal(signal.SIGCHLD, reap_children)
    pipe = "/tmp/gpuops-mps-%d" % os.getpid()
    os.makedirs(pipe)
    read_fd, write_fd = os.pipe()
    control = os.fork()
    if control == 0:
        os.close(read_fd)
        os.dup2(write_fd, 1)
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=pipe)
        os.execve("/usr/bin/python3", [MPS_TOOL, MPS_TOOL[:-len("nvidia-cuda-mps-control")] + "mps_control.py", "-d",
                                       "--server-minor", str(args.minors[0]), "--python", sys.executable], env)
    server = int(read_lines(read_fd, 1)[0].split()[1])
    roles = {"control": control, "server": server}
    clients = []
    for number, minor in enumerate(args.minors):
        def client(minor=minor):
            keep = make_contexts(args, [minor], mps=True)
            mps_ask(pipe, "register %d" % os.getpid())
            return keep

        child = fork_ready_child(read_fd, write_fd, client)
        roles["client%d" % number] = child
        clients.append(child)
    os.close(write_fd)
    wait_ready(read_fd, len(clients))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not wait_state_ok(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    reporter.report(args.scenario, roles, clients + [server], top=os.getpid(), extra={"mps_pipe": pipe})
    sleep_forever()


def wait_state_ok(pid):
    """The server has its context: it maps its device node."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            return "/nvidia" in f.read()
    except OSError:
        return False


def run_monitor(args, reporter):
    try:
        import pynvml
    except ImportError as exc:
        raise WorkloadError("monitor needs nvidia-ml-py (import pynvml) in %s" % sys.executable) from exc
    pynvml.nvmlInit()
    reporter.report(args.scenario, {"monitor": os.getpid()}, [])
    while True:
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
        except pynvml.NVMLError:
            pass
        time.sleep(0.5)


def run_launcher_respawn(args, reporter):
    """A launcher (comm gpu_launcher: no GPU, no device file) that keeps one holder (comm gpu_worker, a context
    on --minors like plain) alive forever: a dead worker is replaced as soon as waitpid returns (a fork, a few
    ms), faster than a SIGKILL loop can win. The launcher ignores SIGTERM; each worker dies with it
    (PR_SET_PDEATHSIG), so stopping the container or killing the launcher frees the GPU."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_name("gpu_launcher")
    launcher = os.getpid()
    read_fd, write_fd = os.pipe()  # only the first worker says it is ready
    while True:
        started = time.monotonic()
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if read_fd is not None:
                os.close(read_fd)

            def worker(ready_fd=write_fd):
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != launcher:
                    os._exit(1)
                set_name("gpu_worker")
                if ready_fd is None and args.respawn_map_delay:
                    time.sleep(args.respawn_map_delay)   # a replacement, still starting
                keep = make_contexts(args)
                if ready_fd is not None:
                    os.write(ready_fd, b"ready\n")
                    os.close(ready_fd)
                sleep_forever()
                return keep

            child_body(write_fd if write_fd is not None else os.open(os.devnull, os.O_WRONLY), worker)
        if read_fd is not None:
            os.close(write_fd)
            wait_ready(read_fd, 1)
            os.close(read_fd)
            read_fd = write_fd = None
            reporter.report(args.scenario, {"launcher": launcher, "holder": child}, [child])
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        if not os.WIFSIGNALED(status) and time.monotonic() - started < RESPAWN_BACKOFF_S:
            time.sleep(RESPAWN_BACKOFF_S)


def run_bystander_cpu(args, reporter):
    start_sleepers(args.threads)
    reporter.report(args.scenario, {"bystander": os.getpid()}, [])
    sleep_forever()


def run_stray_context(args, reporter):
    """--mib on --minors, plus a bare context on the container's first GPU (GPU_FACTS row 13)."""
    contexts = {minor: args.mib for minor in args.minors}
    shown = cuda_visible(visible_minors(args))  # PyTorch's cuda:0
    if not shown:
        raise WorkloadError("no GPU visible")
    first = shown[0]
    contexts[first] = contexts.get(first, 0) + BARE_CONTEXT_MIB
    keep = Runtime(args, contexts)
    reporter.report(args.scenario, {"holder": os.getpid()}, [os.getpid()])
    sleep_forever()
    return keep


def run_tp_nccl(args, reporter):
    """A launcher (no CUDA, no links) and one rank per GPU, every pair of ranks linked by loopback TCP
    (GPU_FACTS rows 11, 19, 21). The driver learns the links: a dead rank leaves residue while peers live."""
    signal.signal(signal.SIGCHLD, reap_children)
    ranks = len(args.minors)
    up_r, up_w = os.pipe()
    plans = [os.pipe() for dummy in range(ranks)]
    roles = {"parent": os.getpid()}
    for rank, minor in enumerate(args.minors):
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(up_r)
            for other, (plan_r, plan_w) in enumerate(plans):
                os.close(plan_w)
                if other != rank:
                    os.close(plan_r)
            child_body(up_w, lambda rank=rank, minor=minor: tp_rank(args, rank, minor, plans[rank][0], up_w))
        roles["rank%d" % rank] = child
    os.close(up_w)
    for plan_r, _plan_w in plans:
        os.close(plan_r)
    ports = {}
    for line in read_lines(up_r, ranks):
        _word, rank, port = line.split()
        ports[int(rank)] = int(port)
    plan = json.dumps({"ports": [ports[r] for r in range(ranks)],
                       "pids": [roles["rank%d" % r] for r in range(ranks)]}).encode()
    for _plan_r, plan_w in plans:
        os.write(plan_w, plan)
        os.close(plan_w)
    read_lines(up_r, ranks)
    os.close(up_r)
    reporter.report(args.scenario, roles, [roles["rank%d" % r] for r in range(ranks)])
    sleep_forever()


def tp_rank(args, rank, minor, plan_fd, up_fd):
    set_name("tp_rank%d" % rank)
    keep = make_contexts(args, [minor])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(len(args.minors))
    os.write(up_fd, b"port %d %d\n" % (rank, listener.getsockname()[1]))
    data = b""
    while True:
        chunk = os.read(plan_fd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(plan_fd)
    plan = json.loads(data)
    links = []
    for peer in range(rank + 1, len(args.minors)):
        links.append(socket.create_connection(("127.0.0.1", plan["ports"][peer]), timeout=30))
    listener.settimeout(30)
    for _peer in range(rank):
        links.append(listener.accept()[0])
    listener.close()
    peers = [[args.minors[p], plan["pids"][p]] for p in range(len(args.minors)) if p != rank]
    driver_request(args, {"op": "link", "peers": peers})
    os.write(up_fd, b"ready\n")
    sleep_forever()
    return keep, links


def run_two_parents(args, reporter):
    """Two parents, each with a context on its own GPU and a forked child that never touches CUDA;
    both parents SIGKILLed and reaped. Each parent leads its own session, so its child's sid/pgid is it."""
    if len(args.minors) != 2:
        raise WorkloadError("two_parents needs exactly two GPUs")
    up_r, up_w = os.pipe()
    parents = []
    for index, minor in enumerate(args.minors):
        def parent(index=index, minor=minor):
            os.setsid()
            set_name("parent%d" % index)
            keep = make_contexts(args, [minor])
            child = os.fork()
            if child == 0:
                set_name("child%d" % index)
                os.close(up_w)
                sleep_forever()
            os.write(up_w, b"%d %d %d\n" % (index, os.getpid(), child))
            sleep_forever()
            return keep

        pid = os.fork()
        if pid == 0:
            os.close(up_r)
            child_body(up_w, parent)
        parents.append(pid)
    os.close(up_w)
    roles = {}
    for line in sorted(read_lines(up_r, 2)):
        index, parent_pid, child = line.split()
        roles["parent" + index], roles["child" + index] = int(parent_pid), int(child)
    os.close(up_r)
    for pid in parents:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    reporter.report(args.scenario, roles, [roles["child0"], roles["child1"]],
                    dead=[roles["parent0"], roles["parent1"]], top=os.getpid())
    sleep_forever()


def run_ipc_consumer(args, reporter):
    """A producer with --mib, a consumer with a bare context that imports the producer's memory; the producer
    is SIGKILLed and reaped, and the driver charges the consumer with it (GPU_FACTS row 17)."""
    if len(args.minors) != 1:
        raise WorkloadError("ipc_consumer needs exactly one GPU")
    minor = args.minors[0]
    up_r, up_w = os.pipe()

    def producer():
        set_name("ipc_producer")
        keep = make_contexts(args, [minor])
        os.write(up_w, b"ready\n")
        sleep_forever()
        return keep

    def consumer():
        set_name("ipc_consumer")
        keep = make_contexts(args, [minor], BARE_CONTEXT_MIB)
        driver_request(args, {"op": "ipc_import", "minor": minor, "owner_pid": producer_pid})
        os.write(up_w, b"ready\n")
        sleep_forever()
        return keep

    producer_pid = os.fork()
    if producer_pid == 0:
        os.close(up_r)
        child_body(up_w, producer)
    read_lines(up_r, 1)
    consumer_pid = os.fork()
    if consumer_pid == 0:
        os.close(up_r)
        child_body(up_w, consumer)
    read_lines(up_r, 1)
    os.close(up_w)
    os.close(up_r)
    os.kill(producer_pid, signal.SIGKILL)
    os.waitpid(producer_pid, 0)
    want = args.mib + BARE_CONTEXT_MIB
    deadline = time.monotonic() + 10
    while want not in driver_procs(args, minor).values():  # legacy pids: host pids
        if time.monotonic() > deadline:
            raise WorkloadError("the driver did not charge the consumer with %d MiB" % want)
        time.sleep(0.01)
    reporter.report(args.scenario, {"producer": producer_pid, "consumer": consumer_pid}, [consumer_pid],
                    dead=[producer_pid], top=os.getpid())
    sleep_forever()


def run_tcp_server(args, reporter):
    """An inference server: a context on --minors, listening on loopback; it answers each client once it has
    accepted it, so the client's report means both ends are open fds (issue 18: a link that is not a job)."""
    set_name("api_server")
    keep = make_contexts(args)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    clients = []

    def serve():
        while True:
            conn = listener.accept()[0]
            clients.append(conn)
            conn.sendall(b"ok\n")
    threading.Thread(target=serve, daemon=True).start()
    reporter.report(args.scenario, {"server": os.getpid()}, [os.getpid()], extra={"port": listener.getsockname()[1]})
    sleep_forever()
    return keep, clients


def run_tcp_client(args, reporter):
    """A trainer: a context on --minors and one open connection to a tcp_server's --connect port."""
    if not args.connect:
        raise WorkloadError("tcp_client needs --connect PORT")
    set_name("trainer")
    keep = make_contexts(args)
    link = socket.create_connection(("127.0.0.1", args.connect), timeout=30)
    if link.makefile("rb").readline() != b"ok\n":
        raise WorkloadError("the server on port %d did not answer" % args.connect)
    reporter.report(args.scenario, {"client": os.getpid()}, [os.getpid()])
    sleep_forever()
    return keep, link


def driver_procs(args, minor):
    """{pid: MiB} NVML lists on minor for this process's view (the driver's text snapshot)."""
    path = args.socket or os.environ.get("NVIDIA_LAB_SOCKET") or DEFAULT_SOCKET
    request = {"op": "snapshot", "format": "text"}
    node = args.node or os.environ.get("NVIDIA_LAB_NODE")
    if node:
        request["node"] = node
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        text = sock.makefile().read()
    index, procs = None, {}
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] == ["DEV"] and int(fields[2]) == minor:
            index = int(fields[1])
        elif fields[:1] == ["PROC"] and index is not None and int(fields[1]) == index:
            procs[int(fields[2])] = int(fields[3])
    return procs


def run_scenario(args, reporter):
    name = args.scenario
    if name in ("plain", "term_ignoring"):
        run_holder(args, reporter)
    elif name == "bystander_gpu":
        run_holder(args, reporter, role="bystander")
    else:
        {"fork_inherit": run_fork_inherit, "defunct_leader": run_defunct_leader, "zombie": run_zombie,
         "mmap_only": run_mmap_only, "tp_server": run_tp_server, "monitor": run_monitor,
         "bystander_cpu": run_bystander_cpu, "stray_context": run_stray_context, "tp_nccl": run_tp_nccl,
         "two_parents": run_two_parents, "ipc_consumer": run_ipc_consumer,
         "launcher_respawn": run_launcher_respawn, "tcp_server": run_tcp_server,
         "tcp_client": run_tcp_client, "mps": run_mps}[name](args, reporter)


# ---- launching ----

def parse_args(argv):
    parser = argparse.ArgumentParser(description="gpuops lab workload")
    parser.add_argument("scenario", choices=SCENARIOS)
    parser.add_argument("--minors", default="", help="comma-separated device minors, e.g. 0,1")
    parser.add_argument("--mib", type=int, default=1024, help="MiB per context")
    parser.add_argument("--dev-dir", default="/dev")
    parser.add_argument("--threads", type=int, default=None, help="extra sleeping threads")
    parser.add_argument("--foreground", action="store_true", help="stay in the foreground (supervisord)")
    parser.add_argument("--kill-parent", action="store_true", help="fork_inherit: child SIGKILLs the parent")
    parser.add_argument("--respawn-map-delay", type=float, default=0.0, metavar="S",
                        help="launcher_respawn: a replacement worker waits S seconds before it maps its GPU "
                             "(a real CUDA program needs seconds to start)")
    parser.add_argument("--connect", type=int, metavar="PORT", help="tcp_client: the tcp_server's loopback port")
    parser.add_argument("--fake-secret", action="store_true", help="put '--api-key sk-secret' in the cmdline")
    parser.add_argument("--api-key", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help="driver socket (default $NVIDIA_LAB_SOCKET or %s)" % DEFAULT_SOCKET)
    parser.add_argument("--node", help="lab node, for callers outside a container (default $NVIDIA_LAB_NODE)")
    args = parser.parse_args(argv)
    args.minors = [int(m) for m in args.minors.split(",") if m.strip()]
    if args.threads is None:
        args.threads = 4 if args.scenario == "defunct_leader" else 0
    needs_gpu = args.scenario not in ("monitor", "bystander_cpu")
    if needs_gpu and not args.minors:
        parser.error("%s needs --minors" % args.scenario)
    return args


def launch(args):
    """Double-forks the workload into its own session; prints its JSON line; returns the exit code."""
    read_fd, write_fd = os.pipe()
    session = os.fork()
    if session == 0:
        os.close(read_fd)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)  # the workload's top process is not a session leader and has no parent here
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        reporter = Reporter(write_fd)
        try:
            run_scenario(args, reporter)
        except BaseException as exc:
            reporter.error(str(exc))
            os.killpg(0, signal.SIGKILL)
        os._exit(0)
    os.close(write_fd)
    os.waitpid(session, 0)
    line = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            break
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        line += chunk
    os.close(read_fd)
    text = line.decode(errors="replace").strip()
    if text.startswith("{"):
        print(text, flush=True)
        return 0
    if text.startswith("ERROR"):
        text = text[6:]
    print("workload %s failed: %s" % (args.scenario, text or "no result within %d s" % READY_TIMEOUT_S),
          file=sys.stderr)
    try:
        os.killpg(session, signal.SIGKILL)  # the session id is the first child's pid
    except OSError:
        pass
    return 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--fake-secret" in argv:
        # Re-exec so that /proc/PID/cmdline carries a secret for redaction tests.
        rest = [a for a in argv if a != "--fake-secret"]
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__)] + rest + ["--api-key", "sk-secret"])
    args = parse_args(argv)
    if args.foreground:
        try:
            run_scenario(args, Reporter(sys.stdout.fileno()))
        except WorkloadError as exc:
            print("workload %s failed: %s" % (args.scenario, exc), file=sys.stderr)
            return 1
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
