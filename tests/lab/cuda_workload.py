#!/usr/bin/env python
"""Holder side of tests/lab/gpu_facts.py --backend cuda: real CUDA memory via PyTorch.

    cuda_workload.py SCENARIO --gib N [--lifeline FD] [--lifetime S]

Scenarios (rows of GPU_FACTS.md):
  plain           one process holds N GiB (rows 2, 7, 8)
  zombie          a parent without CUDA forks a child that holds N GiB; nobody waits (row 3)
  defunct_leader  the leader allocates, starts threads, then calls SYS_exit (row 4)
  fork_inherit    the holder forks a child that never touches CUDA (row 5)
  mmap_only       the holder closes every /dev/nvidia* fd, keeps the mappings (row 6)
  monitor         nvmlInit only, no CUDA (row 8)

When the memory is held the top process prints one JSON line on stdout
{"scenario", "pid", "roles": {ROLE: PID}, "holders": [PID], "threads": [TID]}
(pids as seen in its own PID namespace), then points stdout at /dev/null and lives on.
On failure it prints {"error": "..."} and exits 1.

Every process dies on its own when the lifeline pipe closes (gpu_facts.py died)
or after --lifetime seconds, so nothing outlives the run.

--allocator lab (with --dev-dir, --minor and NVIDIA_LAB_SOCKET) makes a context of
the lab's fake driver instead of CUDA: a rehearsal of the cuda backend without a GPU.
"""

import argparse
import ctypes
import json
import os
import platform
import re
import select
import signal
import sys
import threading
import time
import traceback

SYS_EXIT = {"x86_64": 60, "aarch64": 93}
NVIDIA_PATH = re.compile(r"/dev/nvidia[^/]*$|/dev/nvidia-caps/[^/]+$")

_keep = []  # allocations live as long as the process


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["plain", "zombie", "defunct_leader", "fork_inherit", "mmap_only", "monitor"])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=4, help="extra threads for defunct_leader")
    p.add_argument("--lifeline", type=int, default=-1, help="fd of a pipe; its EOF kills every process here")
    p.add_argument("--lifetime", type=float, default=600.0, help="seconds before every process kills itself")
    p.add_argument("--allocator", choices=["torch", "lab"], default="torch",
                   help="lab: the lab's fake driver instead of CUDA (rehearsal without a GPU)")
    p.add_argument("--dev-dir", default="/dev", help="device folder (lab allocator)")
    p.add_argument("--minor", type=int, default=0, help="device minor (lab allocator)")
    return p.parse_args(argv)


def start_watchdog(args):
    """End this whole process when the lifeline closes or the lifetime ends."""
    def watch():
        deadline = time.monotonic() + args.lifetime
        poller = select.poll()
        if args.lifeline >= 0:
            poller.register(args.lifeline, select.POLLIN | select.POLLHUP | select.POLLERR)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if poller.poll(min(left, 60.0) * 1000):
                break
        os._exit(137)  # exit_group: every thread, and works for pid 1 of a namespace (SIGKILL would not)

    threading.Thread(target=watch, name="watchdog", daemon=True).start()


def quiet_stdout():
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def report(doc):
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()
    quiet_stdout()


def allocate(args):
    """Hold args.gib GiB on device 0; returns when the memory is really there."""
    if args.allocator == "lab":
        lab_context(args)
        return
    import torch  # only here: the zombie parent must never load CUDA
    buf = torch.empty(int(args.gib * 2 ** 30), dtype=torch.uint8, device="cuda:0")
    buf.zero_()
    torch.cuda.synchronize(0)
    _keep.append(buf)


def lab_context(args):
    """The lab driver's context (docs/design.md): open, shared flock, map, then tell the daemon."""
    import fcntl
    import socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fds = [os.open(os.path.join(args.dev_dir, name), os.O_RDWR)
           for name in ("nvidiactl", "nvidia%d" % args.minor, "nvidia-uvm")]
    fcntl.flock(fds[1], fcntl.LOCK_SH)
    for fd in fds:
        addr = libc.mmap(None, 4096, 3, 1, fd, 0)  # PROT_READ|PROT_WRITE, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        _keep.append((fd, addr))
    libc.madvise(ctypes.c_void_p(_keep[-1][1]), 4096, 10)  # MADV_DONTFORK on nvidia-uvm, as CUDA does
    request = {"op": "alloc", "minor": args.minor, "mib": int(args.gib * 1024)}
    if os.environ.get("NVIDIA_LAB_NODE"):
        request["node"] = os.environ["NVIDIA_LAB_NODE"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(os.environ.get("NVIDIA_LAB_SOCKET", "/run/nvidia-lab/driver.sock"))
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply = json.loads(sock.makefile().read())
    if not reply.get("ok"):
        raise RuntimeError("lab driver refused alloc: %s" % reply)


def nvidia_fds(args):
    """fds of this process whose target is a device node (or, fake, a file in --dev-dir)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink("/proc/self/fd/" + name)
        except OSError:
            continue
        if NVIDIA_PATH.search(target):
            found.append(int(name))
    return found


def sleep_forever():
    while True:
        time.sleep(3600)


def idle_thread(ready):
    ready.append(threading.get_native_id())
    sleep_forever()


def run_plain(args):
    allocate(args)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"holder": os.getpid()}, "holders": [os.getpid()]})
    sleep_forever()


def run_zombie(args):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # SIG_IGN would reap children for us
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(rfd)
        start_watchdog(args)
        try:
            allocate(args)
            os.write(wfd, b"ok\n")
        except BaseException:
            os.write(wfd, ("error " + traceback.format_exc().replace("\n", " | ") + "\n").encode())
            os._exit(1)
        quiet_stdout()
        sleep_forever()
    os.close(wfd)
    answer = b""
    with os.fdopen(rfd, "rb") as pipe:
        answer = pipe.readline()
    if not answer.startswith(b"ok"):
        raise RuntimeError("child failed: %s" % answer.decode(errors="replace").strip())
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"parent": os.getpid(), "zombie": child},
            "holders": [child]})
    sleep_forever()  # never waits: the child stays a zombie once killed


def run_defunct_leader(args):
    allocate(args)
    tids = []
    for n in range(args.threads):
        threading.Thread(target=idle_thread, args=(tids,), name="idle%d" % n, daemon=True).start()
    deadline = time.monotonic() + 10
    while len(tids) < args.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"leader": os.getpid()},
            "holders": [os.getpid()], "threads": sorted(tids)})
    number = SYS_EXIT.get(platform.machine())
    if number is None:
        raise RuntimeError("SYS_exit unknown on %s" % platform.machine())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(ctypes.c_long(number), ctypes.c_long(0))  # ends this thread only; ctypes released the GIL
    raise RuntimeError("SYS_exit returned")


def run_fork_inherit(args):
    allocate(args)
    child = os.fork()
    if child == 0:
        # the child never touches CUDA; it only inherits fds and mappings
        start_watchdog(args)
        quiet_stdout()
        sleep_forever()
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"parent": os.getpid(), "child": child},
            "holders": [os.getpid(), child]})
    sleep_forever()


def run_mmap_only(args):
    allocate(args)
    closed = nvidia_fds(args)
    for fd in closed:
        os.close(fd)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"holder": os.getpid()},
            "holders": [os.getpid()], "closed_fds": closed})
    sleep_forever()


def run_monitor(args):
    import pynvml
    pynvml.nvmlInit()
    _keep.append(pynvml.nvmlDeviceGetHandleByIndex(0))
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"monitor": os.getpid()}, "holders": []})
    sleep_forever()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA 0 == NVML index 0
    start_watchdog(args)
    try:
        globals()["run_" + args.scenario](args)
    except BaseException as exc:  # the caller waits for one line: always give it one
        if isinstance(exc, SystemExit):
            raise
        try:
            sys.stdout.write(json.dumps({"error": traceback.format_exc()}) + "\n")
            sys.stdout.flush()
        finally:
            os._exit(1)


if __name__ == "__main__":
    main()
