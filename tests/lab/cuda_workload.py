#!/usr/bin/env python
"""Holder side of tests/lab/gpu_facts.py --backend cuda: real CUDA memory via PyTorch.

    cuda_workload.py SCENARIO --gib N [--lifeline FD] [--lifetime S]

Scenarios (rows of GPU_FACTS.md); --devices names the CUDA devices that get N GiB each (default 0):
  plain           one process holds N GiB (rows 2, 7, 8; 9, 10 and 12 with --devices)
  zombie          a parent without CUDA forks a child that holds N GiB; nobody waits (row 3)
  defunct_leader  the leader allocates, starts threads, then calls SYS_exit (row 4);
                  --alloc-in-thread: a thread allocates instead, as user code does (row 15)
  fork_inherit    the holder forks a child that never touches CUDA (rows 5, 14)
  mmap_only       the holder closes every /dev/nvidia* fd, keeps the mappings (row 6)
  monitor         nvmlInit only, no CUDA, queries every GPU (rows 8, 18)
  stray_context   N GiB on --devices, then torch.cuda.synchronize() with no device, as user
                  code does: PyTorch's stray context on device 0 (rows 13, 16)
  bare_context    torch.zeros(1) on each of --devices: a context and nothing else (row 20)
  tp_nccl         a launcher without CUDA forks one rank per device of --devices; NCCL through
                  torch.distributed (init_method tcp://127.0.0.1), N GiB each, one all_reduce
                  (rows 11, 19, 21); --bystander forks an unrelated CUDA holder beside them (row 21)
  ipc_consumer    a launcher without CUDA forks a producer (N GiB on the first of --devices) and a
                  consumer that opens that tensor through CUDA IPC (row 17)

NVLink multicast stays off in every process: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are forced into the environment before anything loads CUDA.

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
PR_SET_NAME = 15
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SCENARIOS = ("plain", "zombie", "defunct_leader", "fork_inherit", "mmap_only", "monitor", "stray_context",
             "bare_context", "tp_nccl", "ipc_consumer")
NVIDIA_PATH = re.compile(r"/dev/nvidia[^/]*$|/dev/nvidia-caps/[^/]+$")

_keep = []  # allocations live as long as the process


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--devices", default="0", help="CUDA devices (after CUDA_VISIBLE_DEVICES), comma separated")
    p.add_argument("--alloc-in-thread", action="store_true", help="defunct_leader: a thread allocates")
    p.add_argument("--bystander", action="store_true", help="tp_nccl: an unrelated holder beside the ranks")
    p.add_argument("--bystander-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=4, help="extra threads for defunct_leader")
    p.add_argument("--lifeline", type=int, default=-1, help="fd of a pipe; its EOF kills every process here")
    p.add_argument("--lifetime", type=float, default=600.0, help="seconds before every process kills itself")
    p.add_argument("--allocator", choices=["torch", "lab"], default="torch",
                   help="lab: the lab's fake driver instead of CUDA (rehearsal without a GPU)")
    p.add_argument("--dev-dir", default="/dev", help="device folder (lab allocator)")
    p.add_argument("--minor", type=int, default=0, help="device minor (lab allocator)")
    args = p.parse_args(argv)
    args.device_list = [int(x) for x in args.devices.split(",") if x.strip()]
    return args


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


def allocate(args, devices=None, gib=None, sync_current=False):
    """Hold gib GiB on each device; returns when the memory is really there. sync_current: end with
    torch.cuda.synchronize() on the current device (0), as user code does: a context there too."""
    devices = args.device_list if devices is None else devices
    gib = args.gib if gib is None else gib
    if args.allocator == "lab":
        lab_context(args, gib)
        return
    import torch  # only here: launchers and the zombie parent must never load CUDA
    for dev in devices:
        buf = torch.empty(int(gib * 2 ** 30), dtype=torch.uint8, device="cuda:%d" % dev)
        buf.zero_()
        torch.cuda.synchronize(dev)
        _keep.append(buf)
    if sync_current:
        torch.cuda.synchronize()


def lab_context(args, gib):
    """The lab driver's context (tests/lab/README.md, "The fake driver"): open, shared flock, map, then tell the daemon."""
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
    request = {"op": "alloc", "minor": args.minor, "mib": int(gib * 1024)}
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
    tids = []
    if args.alloc_in_thread:  # the thread allocates (and syncs with no device, as user code does)
        done = []

        def worker():
            try:
                allocate(args, sync_current=True)
                done.append("ok")
            except BaseException:
                done.append(traceback.format_exc())
            idle_thread(tids)

        threading.Thread(target=worker, name="alloc", daemon=True).start()
        deadline = time.monotonic() + 300
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[:1] != ["ok"]:
            raise RuntimeError("allocating thread: %s" % (done or ["timeout"])[0])
    else:
        allocate(args)
    for n in range(args.threads):
        threading.Thread(target=idle_thread, args=(tids,), name="idle%d" % n, daemon=True).start()
    want = args.threads + (1 if args.alloc_in_thread else 0)
    deadline = time.monotonic() + 10
    while len(tids) < want and time.monotonic() < deadline:
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
    for index in range(pynvml.nvmlDeviceGetCount()):  # a monitor reads every GPU
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
        pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        _keep.append(handle)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"monitor": os.getpid()}, "holders": []})
    sleep_forever()


def run_stray_context(args):
    allocate(args, sync_current=True)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"holder": os.getpid()},
            "holders": [os.getpid()], "stray_trigger": "torch.cuda.synchronize() with no device"})
    sleep_forever()


def run_bare_context(args):
    import torch
    for dev in args.device_list:
        _keep.append(torch.zeros(1, device="cuda:%d" % dev))
        torch.cuda.synchronize(dev)
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": {"holder": os.getpid()},
            "holders": [os.getpid()]})
    sleep_forever()


def set_comm(name):
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def fork_child(args, name, body, ready_w):
    """Fork a child that runs body(), writes one line ('ok' or 'error ...') to ready_w, then lives on."""
    pid = os.fork()
    if pid:
        return pid
    try:
        start_watchdog(args)
        set_comm(name)
        quiet_stdout()
        body()
        os.write(ready_w, ("ok %s %d\n" % (name, os.getpid())).encode())
    except BaseException:
        os.write(ready_w, ("error %s %s\n" % (name, traceback.format_exc().replace("\n", " | "))).encode())
        os._exit(1)
    sleep_forever()


def wait_ready(rfd, pids, timeout=240.0):
    """Read one 'ok' line from each child; raise on the first error or when a child died silently."""
    buf = b""
    deadline = time.monotonic() + timeout
    while buf.count(b"\n") < len(pids):
        if time.monotonic() > deadline:
            raise RuntimeError("children not ready after %.0f s: %r" % (timeout, buf))
        if select.select([rfd], [], [], 1.0)[0]:
            buf += os.read(rfd, 65536)
            for line in buf.split(b"\n"):
                if line.startswith(b"error"):
                    raise RuntimeError(line.decode(errors="replace")[:4000])
        elif [p for p in pids if not os.path.exists("/proc/%d" % p)]:
            raise RuntimeError("children %s died without a word (see the log)" % [
                p for p in pids if not os.path.exists("/proc/%d" % p)])
    return [line.decode() for line in buf.split(b"\n") if line]


def free_port():
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_rank(args, rank, world, port):
    import torch
    import torch.distributed as dist
    dev = args.device_list[rank]
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world,
                            device_id=torch.device("cuda", dev))
    allocate(args, devices=[dev])
    t = torch.ones(1 << 20, device="cuda:%d" % dev)
    dist.all_reduce(t)
    torch.cuda.synchronize(dev)
    if float(t[0]) != world:
        raise RuntimeError("all_reduce gave %s, not %d" % (float(t[0]), world))
    _keep.append(t)


def run_tp_nccl(args):
    world = len(args.device_list)
    port = free_port()
    rfd, wfd = os.pipe()
    roles = {"parent": os.getpid()}
    for rank in range(world):
        roles["rank%d" % rank] = fork_child(args, "tp_rank%d" % rank,
                                            lambda r=rank: nccl_rank(args, r, world, port), wfd)
    if args.bystander:  # unrelated to the job, same parent, group and session
        roles["bystander"] = fork_child(args, "bystander", lambda: allocate(
            args, devices=args.device_list[:1], gib=args.bystander_gib), wfd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a killed rank is reaped at once, as by a launcher
    wait_ready(rfd, [p for name, p in roles.items() if name != "parent"])
    ranks = [roles["rank%d" % r] for r in range(world)]
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": roles,
            "holders": ranks + ([roles["bystander"]] if args.bystander else []), "init_method_port": port})
    sleep_forever()


def ipc_producer(args, handle_w):
    import pickle
    import torch
    from torch.multiprocessing.reductions import reduce_tensor
    allocate(args, devices=args.device_list[:1])
    rebuild, parts = reduce_tensor(_keep[-1])
    data = pickle.dumps((rebuild, parts))
    os.write(handle_w, len(data).to_bytes(8, "little") + data)


def ipc_consumer(args, handle_r):
    import pickle
    import torch
    size = int.from_bytes(os.read(handle_r, 8), "little")
    data = b""
    while len(data) < size:
        data += os.read(handle_r, size - len(data))
    rebuild, parts = pickle.loads(data)
    tensor = rebuild(*parts)
    dev = tensor.device.index
    total = int(tensor[:4096].sum().item())  # touches the producer's memory (it zeroed it)
    torch.cuda.synchronize(dev)
    if total != 0:
        raise RuntimeError("imported tensor reads %d, not 0" % total)
    _keep.append(tensor)


def run_ipc_consumer(args):
    rfd, wfd = os.pipe()
    handle_r, handle_w = os.pipe()
    roles = {"parent": os.getpid()}
    roles["producer"] = fork_child(args, "ipc_producer", lambda: ipc_producer(args, handle_w), wfd)
    roles["consumer"] = fork_child(args, "ipc_consumer", lambda: ipc_consumer(args, handle_r), wfd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the killed producer is reaped at once
    wait_ready(rfd, [roles["producer"], roles["consumer"]])
    report({"scenario": args.scenario, "pid": os.getpid(), "roles": roles,
            "holders": [roles["producer"], roles["consumer"]]})
    sleep_forever()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA 0 == NVML index 0
    os.environ.update(NO_MULTICAST)  # never NVLink multicast, whatever the caller's environment says
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
