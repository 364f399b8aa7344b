#!/usr/bin/env python
"""Lab workloads that hold fake GPU memory the way CUDA processes do (stdlib only).

A context: open nvidiactl, nvidiaM, nvidia-uvm O_RDWR, flock(LOCK_SH) on
nvidiaM, mmap all three MAP_SHARED, then `alloc` to the lab driver daemon.
Each scenario reproduces one row of GPU_FACTS.md; see docs/design.md, "Workloads".

Without --foreground the first process forks the workload (new session),
prints one JSON line once every context is allocated, and exits.
"""

import argparse
import ctypes
import fcntl
import json
import os
import platform
import select
import signal
import socket
import sys
import threading
import time

SCENARIOS = ("plain", "term_ignoring", "fork_inherit", "defunct_leader", "zombie", "mmap_only",
             "tp_server", "monitor", "bystander_gpu", "bystander_cpu")
DEFAULT_SOCKET = "/run/nvidia-lab/driver.sock"
SYS_EXIT = {"x86_64": 60, "aarch64": 93}
PR_SET_NAME = 15
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

    def report(self, scenario, roles, holders, dead=None):
        """dead: pids that are gone on purpose (fork_inherit --kill-parent) and cannot be translated."""
        line = {"scenario": scenario, "pids": list(dict.fromkeys(roles.values())), "roles": roles,
                "holders": holders}
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


class Context:
    """One fake CUDA context on one minor. The mappings are never unmapped."""

    CAPS = ("nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2")

    def __init__(self, args, minor):
        self.minor = minor
        paths = [os.path.join(args.dev_dir, name) for name in ("nvidiactl", "nvidia%d" % minor, "nvidia-uvm")]
        for path in paths:
            if not os.path.isfile(path):  # never a real NVIDIA character device
                raise WorkloadError("%s is not a lab device file" % path)
        try:
            self.fds = [os.open(path, os.O_RDWR) for path in paths]
        except OSError as exc:
            raise WorkloadError("open %s: %s" % (exc.filename, exc.strerror)) from exc
        fcntl.flock(self.fds[1], fcntl.LOCK_SH)
        self.maps = [map_shared(fd) for fd in self.fds]
        # CUDA's nvidia-uvm mappings are not inherited by a fork (measured on the H200).
        libc.madvise(ctypes.c_void_p(self.maps[2]), PAGE, MADV_DONTFORK)
        # CUDA also keeps the capability nodes open, as fds only (measured on the H200).
        for name in self.CAPS:
            path = os.path.join(args.dev_dir, name)
            if os.path.isfile(path):
                self.fds.append(os.open(path, os.O_RDONLY))
        driver_request(args, {"op": "alloc", "minor": minor, "mib": args.mib})

    def close_fds(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def make_contexts(args):
    return [Context(args, minor) for minor in args.minors]


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


def wait_ready(read_fd, count):
    """Reads count ready lines from workers; raises on a worker's error."""
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while buf.count(b"\n") < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read_fd], [], [], left)[0]:
            raise WorkloadError("workers not ready after %d s" % READY_TIMEOUT_S)
        chunk = os.read(read_fd, 4096)
        if not chunk:
            raise WorkloadError("a worker died before it was ready")
        buf += chunk
    for line in buf.decode().splitlines():
        if line.startswith("ERROR"):
            raise WorkloadError(line[6:])


def child_body(report_fd, body):
    """Runs body in a forked child; on error tells report_fd and exits."""
    try:
        body()
    except BaseException as exc:  # the child must never fall back into the parent's code
        Reporter(report_fd).error("pid %d: %s" % (os.getpid(), exc))
        os._exit(1)
    os._exit(0)


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
    contexts = make_contexts(args)
    for ctx in contexts:
        ctx.close_fds()  # the mappings keep the contexts (GPU_FACTS row 6)
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
            os.close(read_fd)
            set_name("tp_worker%d" % rank)
            one = argparse.Namespace(**dict(vars(args), minors=[minor]))
            keep = make_contexts(one)
            os.write(write_fd, b"ready\n")
            sleep_forever()
            return keep

        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            child_body(write_fd, worker)
        roles["worker%d" % rank] = child
        workers.append(child)
    os.close(write_fd)
    wait_ready(read_fd, len(workers))
    reporter.report(args.scenario, roles, workers)
    sleep_forever()


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


def run_bystander_cpu(args, reporter):
    start_sleepers(args.threads)
    reporter.report(args.scenario, {"bystander": os.getpid()}, [])
    sleep_forever()


def run_scenario(args, reporter):
    name = args.scenario
    if name in ("plain", "term_ignoring"):
        run_holder(args, reporter)
    elif name == "bystander_gpu":
        run_holder(args, reporter, role="bystander")
    else:
        {"fork_inherit": run_fork_inherit, "defunct_leader": run_defunct_leader, "zombie": run_zombie,
         "mmap_only": run_mmap_only, "tp_server": run_tp_server, "monitor": run_monitor,
         "bystander_cpu": run_bystander_cpu}[name](args, reporter)


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
