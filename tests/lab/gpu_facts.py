#!/usr/bin/env python
"""Run one scenario per row of GPU_FACTS.md and assert the outcomes of that table.

    gpu_facts.py --backend lab  [--json OUT]     the lab: labctl workloads, fake driver
    gpu_facts.py --backend cuda [--json OUT]     a real NVIDIA GPU: PyTorch holders, pynvml
    gpu_facts.py --backend cuda --dry-run        print the plan, touch nothing

Prints one line per row (PASS/FAIL with measured values), writes the JSON
(driver version, GPU name, date, per-row checks and measurements) and exits
non-zero on any FAIL. It only signals processes it started itself, and kills
all of them before it exits, also on error, timeout or Ctrl-C. It never resets
the GPU or changes its settings.
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKLOAD = os.path.join(HERE, "cuda_workload.py")
LABCTL = os.path.join(HERE, "labctl")
GIB_MIB = 1024

ROWS = {
    1: "idle floor",
    2: "SIGKILL frees by the time waitpid returns",
    3: "a true zombie holds nothing",
    4: "defunct leader holds memory, fuser cannot see it",
    5: "forked child keeps a dead parent's memory",
    6: "mmap-only holder",
    7: "NVML pids across PID namespaces",
    8: "NVML-only client holds fds, maps nothing",
    9: "every CUDA process maps every visible GPU",
    10: "CUDA_VISIBLE_DEVICES hides a GPU's mappings",
    11: "a TP rank maps its peers' GPUs",
    12: "memory on both GPUs: 3 maps on both",
    13: "PyTorch's stray context on GPU 0",
    14: "fork child of a dead GPU-0 parent",
    15: "defunct leader named on its threads' GPUs",
    16: "PID namespace: per-GPU pids inside and out",
    17: "CUDA IPC consumer keeps a dead producer's memory",
    18: "NVML-only monitor of both GPUs maps nothing",
    19: "a dead TP rank leaves unlisted residue",
    20: "the size of a bare context",
    21: "a TP job is linked by loopback TCP",
    29: "health calls: not applicable or nothing pending",
}
MULTI_GPU_ROWS = set(range(9, 22))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CONTEXT_MAPS, VISIBLE_MAPS = 3, 2      # map lines of /dev/nvidiaN: context / only visible (rows 9, 12)
BARE_MIB = (450.0, 700.0)              # a bare context: 518-612 MiB on an H200 (rows 13, 15, 17, 20)

PLAN = {
    1: ["read NVML memory v1 and v2 of GPU index 0 with no workload running",
        "assert v1 used - v2 used == reserved, v2 used small, reserved > 0, no compute process",
        "assert no process maps /dev/nvidia* (fuser access m)"],
    2: ["start plain (holds the memory) for each size, assert NVML shows it and lists the pid",
        "SIGKILL it, wait until reaped (waitpid / /proc gone), read NVML at once",
        "assert used back at the floor at that moment; record kill-to-reaped ms"],
    3: ["start zombie: a parent without CUDA, its child holds the memory; the parent never waits",
        "SIGKILL the child, wait for state Z, read NVML at once",
        "assert memory back while the child is still Z, child has no fds, NVML does not list it",
        "SIGKILL the parent: the zombie entry goes"],
    4: ["start defunct_leader: the leader allocates, starts threads, calls SYS_exit",
        "assert leader State Z with Threads > 1, memory held, NVML lists the leader",
        "assert /proc/PID/fd empty, a live thread's task fd shows /dev/nvidiaN, fuser does not list it",
        "SIGKILL the leader: freed by the time it is reaped"],
    5: ["start fork_inherit: the holder forks a child that never touches CUDA",
        "SIGKILL the parent and wait until reaped",
        "assert memory held, NVML lists the dead parent and never the child",
        "assert the child holds nvidiaN, nvidiactl, nvidia-uvm as fds and mappings, fuser lists it",
        "SIGKILL the child: freed; record ms"],
    6: ["start mmap_only: the holder closes every /dev/nvidia* fd after allocating",
        "assert no nvidia fd, maps lines name nvidiaN, nvidiactl, nvidia-uvm, fuser access m only, memory held",
        "SIGKILL it: freed"],
    7: ["start plain in its own PID namespace",
        "assert NSpid has two levels; NVML from the host lists the host pid; from the same namespace the namespace pid",
        "assert NVML from another namespace lists nothing while used shows the memory",
        "SIGKILL it: freed"],
    8: ["start monitor (nvmlInit only) and plain",
        "assert the monitor holds fds of nvidiactl and nvidiaN, maps none, is not listed by NVML, fuser access F without m",
        "assert the plain holder maps nvidiactl, nvidiaN, nvidia-uvm (fuser access m)"],
    9: ["start plain on GPU 0 with both GPUs visible",
        "assert NVML lists it on GPU 0 with the memory, not on GPU 1 (no memory there)",
        "assert /dev/nvidia<GPU0> 3 map lines, /dev/nvidia<GPU1> 2; fds on both, fewer on GPU 1",
        "SIGKILL it: time kill -> reaped and kill -> memory free (polled every 2 ms)"],
    10: ["start plain with CUDA_VISIBLE_DEVICES=1 (memory on GPU 1)",
         "assert NVML lists it on GPU 1 only; GPU 1 3 map lines; GPU 0 0 map lines (fds may stay)"],
    11: ["start tp_nccl: a launcher forks 2 NCCL ranks (rank r on GPU r), all_reduce",
         "assert each rank listed on its own GPU only; own GPU 3 map lines, the peer's 2"],
    12: ["start plain with memory on GPU 0 and GPU 1", "assert listed on both, 3 map lines on both"],
    13: ["start stray_context: memory on GPU 1, then torch.cuda.synchronize() (cuda) / the lab's stray",
         "assert listed on GPU 1 with the memory and on GPU 0 with a bare context; 3 map lines on both"],
    14: ["start fork_inherit on GPU 0, SIGKILL the parent",
         "assert NVML: the dead parent on GPU 0 only, GPU 1 empty; child 3 map lines GPU 0, 2 GPU 1"],
    15: ["start defunct_leader whose thread allocated on GPU 1",
         "assert NVML names the leader on GPU 1, and on exactly the GPUs its live thread maps 3 times",
         "(cuda) assert PyTorch's bare context on GPU 0 too"],
    16: ["start stray_context on GPU 1 in its own PID namespace (cuda: unshare; lab: the container)",
         "assert from the host: the host pid on both GPUs; from inside: the namespace pid on both, each "
         "GPU with its own MiB"],
    17: ["start ipc_consumer: producer with memory on GPU 0, consumer imports it through CUDA IPC",
         "assert before: producer with the memory, consumer a bare context",
         "SIGKILL the producer: consumer charged with the producer's MiB, memory not freed; 3 map lines",
         "SIGKILL the consumer: freed"],
    18: ["start monitor (nvmlInit, reads both GPUs)", "assert not listed, fds on both GPU nodes, no mapping"],
    19: ["start tp_nccl on GPUs 0,1; SIGKILL rank 1 and time it",
         "assert GPU 1: residue used, no process listed; GPU 0: rank 0 unchanged; rank 0 maps GPU 1 twice "
         "before and after; rank 0 alive --residue-wait s later, residue still there",
         "SIGKILL rank 0: GPU 1 free (the whole job stopped)"],
    20: ["start a bare context on GPU 0 (cuda: torch.zeros(1); lab: the stray context of stray_context)",
         "assert its NVML MiB within 450-700 (518-612 measured); 3 map lines on its GPU"],
    29: ["ask every GPU nvmlDeviceGetRetiredPagesPendingStatus, nvmlDeviceGetRemappedRows, nvmlDeviceGetEccMode and "
         "field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) through nvmlDeviceGetFieldValues, with no workload",
         "assert page retirement Not Supported (or nothing pending), no row remap pending or failed, ECC current == "
         "pending, recovery action 0 (none)"],
    21: ["start tp_nccl on GPUs 0,1 and an unrelated CUDA holder (cuda: same parent, group, session)",
         "match socket inodes of /proc/PID/fd with /proc/PID/net/tcp{,6}: established loopback links",
         "assert >= 1 link rank0 <-> rank1, none with the unrelated holder or the launcher; no shared "
         "/dev/shm mapping; MASTER_PORT not in environ; ranks share group, session, parent"],
}

# One NVML reader for every view: exec'd here, or run with `python -c` elsewhere.
NVML_QUERY = r'''
import json, sys
import pynvml

def nvml_read(index):
    mib = 1024.0 * 1024.0
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    return {
        "index": index, "minor": pynvml.nvmlDeviceGetMinorNumber(h),
        "v1_used_mib": round(v1.used / mib, 1), "v1_total_mib": round(v1.total / mib, 1),
        "v2_used_mib": round(v2.used / mib, 1), "reserved_mib": round(v2.reserved / mib, 1),
        "v2_total_mib": round(v2.total / mib, 1),
        "pids": sorted(p.pid for p in procs),
        "proc_mib": dict((str(p.pid), round((p.usedGpuMemory or 0) / mib, 1)) for p in procs),
    }

def nvml_read_all():
    return [nvml_read(i) for i in range(pynvml.nvmlDeviceGetCount())]

def health_one(call, *args):
    try:
        value = getattr(pynvml, call)(*args)
    except pynvml.NVMLError as exc:
        return {"error": str(exc), "code": exc.value}
    if call == "nvmlDeviceGetFieldValues":
        return {"ret": value[0].nvmlReturn, "value": value[0].value.uiVal}
    return list(value) if isinstance(value, (list, tuple)) else value

def health_read_all():
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        out.append({"index": i, "retired_pages_pending": health_one("nvmlDeviceGetRetiredPagesPendingStatus", h),
                    "remapped_rows": health_one("nvmlDeviceGetRemappedRows", h),
                    "ecc_mode": health_one("nvmlDeviceGetEccMode", h),
                    "recovery_action": health_one("nvmlDeviceGetFieldValues", h, [230])})
    return out

if __name__ == "__main__":
    pynvml.nvmlInit()
    try:
        print(json.dumps(nvml_read_all() if sys.argv[1] == "all" else health_read_all() if sys.argv[1] == "health"
                         else nvml_read(int(sys.argv[1]))))
    finally:
        pynvml.nvmlShutdown()
'''

NVIDIA_DAEMONS = ("nvidia-persiste", "nv-hostengine", "nv-fabricmanage", "dcgm-exporter", "dcgmi")
_DEV = re.compile(r"(?:^|/)dev/(nvidia[^/\s]*|nvidia-caps/[^/\s]+)(?: \(deleted\))?$")


class Deadline(BaseException):
    """The whole run took longer than --deadline (escapes row handlers, runs finally blocks)."""


class Stop(BaseException):
    """SIGTERM/SIGINT: clean up and leave."""


# ---------------------------------------------------------------- /proc helpers (host view)

def read_text(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def proc_path(pid, tid=None):
    return "/proc/%d/task/%d" % (pid, tid) if tid else "/proc/%d" % pid


def status(pid, tid=None):
    text = read_text(proc_path(pid, tid) + "/status")
    out = {}
    for line in (text or "").splitlines():
        key, value = line.split(":", 1) if ":" in line else (line, "")
        out[key] = value.strip()
    return out


def state_letter(pid):
    return (status(pid).get("State") or "?")[:1] if os.path.exists("/proc/%d" % pid) else None


def nspids(pid):
    return [int(x) for x in status(pid).get("NSpid", "").split()]


def start_time(pid):
    text = read_text("/proc/%d/stat" % pid)
    if not text:
        return None
    return text[text.rfind(")") + 2:].split()[19]


def tasks(pid):
    try:
        return sorted(int(t) for t in os.listdir("/proc/%d/task" % pid))
    except OSError:
        return []


def dev_name(path):
    """'nvidia0', 'nvidiactl', 'nvidia-uvm', 'nvidia-caps/nvidia-cap1' or None."""
    m = _DEV.search(path.strip())
    return m.group(1) if m else None


def fd_devs(pid, tid=None):
    """Device names of the fds of pid (or of one thread); None when the table cannot be read."""
    folder = proc_path(pid, tid) + "/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    found = []
    for name in names:
        try:
            dev = dev_name(os.readlink(os.path.join(folder, name)))
        except OSError:
            continue
        if dev:
            found.append(dev)
    return sorted(found)


def fd_count(pid, tid=None):
    try:
        return len(os.listdir(proc_path(pid, tid) + "/fd"))
    except OSError:
        return None


def map_devs(pid, tid=None):
    """(number of maps lines naming a device node, sorted set of names); (None, []) if unreadable."""
    text = read_text(proc_path(pid, tid) + "/maps")
    if text is None:
        return None, []
    lines = 0
    names = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        dev = dev_name(parts[5]) if len(parts) == 6 else None
        if dev:
            lines += 1
            names.add(dev)
    return lines, sorted(names)


def dev_counts(pid, tid=None):
    """{device name: {"fds": open fds, "maps": lines of /proc/PID/maps}} for every NVIDIA node."""
    out = {}
    for dev in fd_devs(pid, tid) or []:
        out.setdefault(dev, {"fds": 0, "maps": 0})["fds"] += 1
    for line in (read_text(proc_path(pid, tid) + "/maps") or "").splitlines():
        parts = line.split(None, 5)
        dev = dev_name(parts[5]) if len(parts) == 6 else None
        if dev:
            out.setdefault(dev, {"fds": 0, "maps": 0})["maps"] += 1
    return out


def node_of(counts, minor):
    return counts.get("nvidia%d" % minor, {"fds": 0, "maps": 0})


def shm_maps(pid):
    names = set()
    for line in (read_text("/proc/%d/maps" % pid) or "").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
            names.add(parts[5])
    return names


def socket_inodes(pid):
    found = set()
    try:
        names = os.listdir("/proc/%d/fd" % pid)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _tcp_addr(text):
    import ipaddress
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        ip = ip.ipv4_mapped or ip
    return str(ip), int(port, 16)


def tcp_established(pid):
    """{socket inode: (local, remote)} of pid's established TCP sockets, read in its network namespace."""
    mine = socket_inodes(pid)
    out = {}
    for table in ("tcp", "tcp6"):
        for line in (read_text("/proc/%d/net/%s" % (pid, table)) or "").splitlines()[1:]:
            parts = line.split()
            if len(parts) > 9 and parts[3] == "01" and int(parts[9]) in mine:
                out[int(parts[9])] = (_tcp_addr(parts[1]), _tcp_addr(parts[2]))
    return out


def tcp_links(pid_a, pid_b):
    """Established connections with one end in pid_a and the other in pid_b (same network namespace)."""
    a, b = tcp_established(pid_a), tcp_established(pid_b)
    ends_b = set((remote, local) for local, remote in b.values())
    return sorted("%s:%d <-> %s:%d" % (local + remote) for local, remote in a.values() if (local, remote) in ends_b)


def ids(pid):
    text = read_text("/proc/%d/stat" % pid) or ""
    fields = text[text.rfind(")") + 2:].split()
    return {"ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3])} if len(fields) > 3 else {}


def environ_has(pid, token):
    """True when pid, or one of its threads (a defunct leader has no mm), carries token."""
    for path in ["/proc/%d" % pid] + ["/proc/%d/task/%d" % (pid, t) for t in tasks(pid)]:
        try:
            with open(path + "/environ", "rb") as f:
                if token in f.read().split(b"\0"):
                    return True
        except OSError:
            continue
    return False


def pidns_inode(pid):
    try:
        return os.stat("/proc/%d/ns/pid" % pid).st_ino
    except OSError:
        return None


def ns_to_host(ns_inode):
    """{pid in that PID namespace: host pid} for every process of one namespace."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and pidns_inode(int(name)) == ns_inode:
            ids = nspids(int(name))
            if ids:
                out[ids[-1]] = int(name)
    return out


def parse_fuser(text):
    """Entries of `fuser -v FILE...` (stdout and stderr in one stream)."""
    entries = []
    current = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("Cannot stat") or ("USER" in line and "ACCESS" in line):
            continue
        m = re.match(r"^(\S.*?):\s*(.*)$", line)
        if m and not line[0].isspace():
            current, rest = m.group(1), m.group(2)
            if not rest.strip():
                continue
            line = " " + rest
        m = re.match(r"^\s+(\S+)\s+(\d+|kernel)\s+(\S+)\s+(.*)$", line)
        if m and m.group(2) != "kernel":
            entries.append({"file": current, "user": m.group(1), "pid": int(m.group(2)),
                            "access": m.group(3), "command": m.group(4).strip()})
    return entries


def run_cmd(cmd, timeout, env=None, check=True, **kw):
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                         env=env, text=True, check=False, **kw)
    if check and res.returncode != 0:
        raise RuntimeError("%s: rc %d: %s" % (" ".join(cmd[:4]), res.returncode, (res.stderr or res.stdout)[-800:]))
    return res


def wait_until(predicate, timeout, step=0.005):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(step)


def read_line(stream, timeout):
    """First line of a pipe, or TimeoutError; returns b'' on EOF without a line."""
    fd = stream.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no line after %.0f s" % timeout)
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n")[0]


# ---------------------------------------------------------------- workloads and backends

class Workload:
    def __init__(self, scenario, roles, holders, pids, doc, proc=None, ns_roles=None):
        self.scenario = scenario
        self.roles = roles          # role -> host pid
        self.holders = holders      # host pids holding the memory by construction
        self.pids = pids            # every host pid to kill at the end
        self.doc = doc
        self.proc = proc
        self.ns_roles = ns_roles or {}

    def __repr__(self):
        return "Workload(%s, roles=%s)" % (self.scenario, self.roles)


class Backend:
    name = "?"
    floor_expected = None   # MiB the idle floor must be (lab: the table's 615); None: record it
    tolerance_mib = 0.0     # "back at the floor" slack
    held_fraction = 1.0     # share of the allocation NVML must show

    def __init__(self, args):
        self.args = args
        self.minor = None
        self.minors = {}      # GPU index (NVML, or the container's) -> device minor
        self.alloc_mib = 0
        self.last_release = {}

    def held(self, m, base):
        return m["v2_used_mib"] - base["v2_used_mib"] >= self.held_fraction * self.alloc_mib

    def freed(self, m, base):
        return m["v2_used_mib"] <= base["v2_used_mib"] + self.tolerance_mib

    def check_freed(self, r, name, base, key="v2_used_at_reap_mib"):
        """Read NVML at once: back at the floor, or at most --grace-ms later. Returns the reading that
        showed it freed (or the last one). A late release is recorded with its lag: a /proc reader
        that holds the dying process's mm or file for a moment (fuser, ps, psutil) delays the driver's
        release just as long, on a real GPU as in the lab."""
        t0 = time.monotonic()
        first = self.nvml("host")
        after, lag_ms = first, 0.0
        if not self.freed(first, base):
            # poll v2 used the fast way (in-process NVML / the lab driver's socket), so that the lag
            # measured is the driver's, not the reader's; then one full reading
            limit = base["v2_used_mib"] + self.tolerance_mib
            wait_until(lambda: self.used_now(self.primary_index()) <= limit, 10.0, step=0.005)
            lag_ms = (time.monotonic() - t0) * 1000
            after = self.nvml("host")
        ok = self.freed(after, base) and lag_ms <= self.args.grace_ms
        detail = "v2 used %.1f MiB at once (base %.1f)" % (first["v2_used_mib"], base["v2_used_mib"])
        if after is not first:
            detail += ", %s %.0f ms later" % ("freed" if self.freed(after, base) else "still held", lag_ms)
        if key:
            r.measured[key] = first["v2_used_mib"]
            r.measured[key.replace("_mib", "_lag_ms")] = round(lag_ms, 1)
        r.check(name, ok, detail)
        self.last_release = {"v2_used_at_reap_mib": first["v2_used_mib"], "release_lag_ms": round(lag_ms, 1)}
        return after

    def wait_idle(self, timeout=10.0):
        """NVML reading once nothing is listed and v2 used is back near zero (or the last one)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.nvml("host")
            if (not m["pids"] and m["v2_used_mib"] <= 64) or time.monotonic() >= deadline:
                return m
            time.sleep(0.1)

    def wait_idle_all(self, timeout=10.0):
        """{index: NVML reading} once no GPU lists a process and every v2 used is near zero."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.nvml_gpus("host")
            if all(not g["pids"] and g["v2_used_mib"] <= 64 for g in m.values()) or time.monotonic() >= deadline:
                return m
            time.sleep(0.1)

    def kill_wait(self, pid, timeout=30.0):
        """SIGKILL pid, return ms to its exit and to its reaping (the waitpid moment)."""
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
        t0 = time.monotonic()
        self.kill(pid)
        if pidfd is not None:
            try:
                exited = select.select([pidfd], [], [], timeout)[0]
            finally:
                os.close(pidfd)
            if not exited:  # a thread stuck in the driver (D state): report, never block in waitpid
                raise TimeoutError("pid %d still running %.0f s after SIGKILL (State %s)" % (
                    pid, timeout, status(pid).get("State")))
        t_exit = time.monotonic()
        ppid = status(pid).get("PPid")
        if ppid == str(os.getpid()):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        elif not wait_until(lambda: not os.path.exists("/proc/%d" % pid), timeout, step=0.001):
            raise TimeoutError("pid %d not reaped %.0f s after SIGKILL" % (pid, timeout))
        t_reaped = time.monotonic()
        return {"kill_to_exit_ms": round((t_exit - t0) * 1000, 1),
                "kill_to_reaped_ms": round((t_reaped - t0) * 1000, 1)}

    def primary_index(self):
        """The GPU of rows 1-8: --index on the cuda backend, the container's index 0 in the lab."""
        return self.args.index if self.name == "cuda" else 0

    def gpu_count(self):
        return len(self.minors)

    def minor_of(self, index):
        return self.minors[index]

    def by_index(self, readings):
        """NVML readings (each with its minor) -> {subject index: reading}."""
        index_of = dict((m, i) for i, m in self.minors.items())
        return dict((index_of[r["minor"]], r) for r in readings if r["minor"] in index_of)

    def kill_timed(self, pid, index, base_mib, timeout=10.0):
        """SIGKILL pid; poll every 2 ms until it is reaped and GPU index's v2 used is back to base_mib.
        Returns kill -> exit / reaped / memory free (ms; None when not seen within timeout)."""
        own_child = status(pid).get("PPid") == str(os.getpid())
        t0 = time.monotonic()
        self.kill(pid)
        t = {"kill_to_reaped_ms": None, "kill_to_free_ms": None}
        while time.monotonic() - t0 < timeout:
            now_ms = round((time.monotonic() - t0) * 1000, 1)
            if t["kill_to_free_ms"] is None and self.used_now(index) <= base_mib + self.tolerance_mib:
                t["kill_to_free_ms"] = now_ms
            if t["kill_to_reaped_ms"] is None:
                if own_child:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                if not os.path.exists("/proc/%d" % pid):
                    t["kill_to_reaped_ms"] = now_ms
            if None not in t.values():
                break
            time.sleep(0.002)
        return t

    def fuser_pid(self, entries, host_pid):
        return [e for e in entries if e.get("host_pid") == host_pid]

    def reap(self):
        """Collect our own exited children (orphans come back to us as subreaper)."""
        while True:
            try:
                pid = os.waitpid(-1, os.WNOHANG)[0]
            except ChildProcessError:
                return
            if pid == 0:
                return


class CudaBackend(Backend):
    """A real GPU: holders are cuda_workload.py processes (PyTorch), NVML is pynvml here."""

    name = "cuda"
    held_fraction = 0.9
    torch_stray = True    # PyTorch's bare context on device 0 (rows 13, 15) is part of what is measured

    def __init__(self, args):
        super().__init__(args)
        self.tolerance_mib = args.tolerance_mib
        self.alloc_mib = args.gib * GIB_MIB
        self.token = "GPU_FACTS_TOKEN=%s" % uuid.uuid4().hex
        self.owned = {}       # host pid -> start time
        self.procs = []
        self.lifeline = None
        self.pynvml = None
        self.count = 0
        self.dev_dir = args.dev_dir

    # -- set-up
    def setup(self):
        import ctypes
        os.makedirs(self.args.log_dir, exist_ok=True)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of our workloads come back to us
        self.lifeline = os.pipe()   # workloads die when the write end (only here) closes
        os.set_inheritable(self.lifeline[0], True)
        import pynvml
        self.pynvml = pynvml
        pynvml.nvmlInit()
        scope = {"__name__": "nvml_query"}
        exec(compile(NVML_QUERY, "<nvml_query>", "exec"), scope)
        self._nvml_read = scope["nvml_read"]
        handle = pynvml.nvmlDeviceGetHandleByIndex(self.args.index)
        self.minor = pynvml.nvmlDeviceGetMinorNumber(handle)
        self.minors = dict((i, pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(i)))
                           for i in range(pynvml.nvmlDeviceGetCount()))

    def info(self):
        p = self.pynvml
        handle = p.nvmlDeviceGetHandleByIndex(self.args.index)

        def text(value):
            return value.decode() if isinstance(value, bytes) else value

        out = {"driver_version": text(p.nvmlSystemGetDriverVersion()),
               "nvml_version": text(p.nvmlSystemGetNVMLVersion()),
               "gpu_name": text(p.nvmlDeviceGetName(handle)),
               "gpu_uuid": text(p.nvmlDeviceGetUUID(handle)),
               "gpu_index": self.args.index, "gpu_minor": self.minor,
               "gpu_count": p.nvmlDeviceGetCount()}
        try:
            out["cuda_driver_version"] = p.nvmlSystemGetCudaDriverVersion()
        except Exception:  # older library
            pass
        return out

    def teardown(self):
        self.sweep()
        if self.pynvml and self.minors:
            self.wait_idle_all()  # the driver frees a killed job's memory (and residue) a moment later
        if self.lifeline:
            for fd in self.lifeline:
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.lifeline = None
        if self.pynvml:
            try:
                self.pynvml.nvmlShutdown()
            except Exception:
                pass

    def env(self, visible=-1):
        """visible: -1 the --index GPU alone (rows 1-8), None every GPU, or a list of NVML indexes."""
        env = dict(os.environ)
        key, value = self.token.split("=", 1)
        env[key] = value
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible == -1:
            env["CUDA_VISIBLE_DEVICES"] = str(self.args.index)
        elif visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in visible)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(NO_MULTICAST)
        return env

    # -- processes we own
    def own(self, pid):
        if not environ_has(pid, self.token.encode()) and not environ_has_any_task_gone(pid):
            raise RuntimeError("pid %d does not carry our token: refusing to own it" % pid)
        self.owned[pid] = start_time(pid)

    def is_owned(self, pid):
        return pid in self.owned and start_time(pid) == self.owned[pid]

    def kill(self, pid, sig=signal.SIGKILL):
        if not self.is_owned(pid):
            raise RuntimeError("refusing to signal pid %d: not started by this run" % pid)
        os.kill(pid, sig)

    def start(self, scenario, pidns=False, gib=None, gpus=None, visible=-1, flags=()):
        """gpus: NVML indexes that get the memory (default: the --index GPU, as CUDA device 0);
        visible: see env(); flags: more cuda_workload.py options."""
        gib = self.args.gib if gib is None else gib
        self.count += 1
        log_path = os.path.join(self.args.log_dir, "%02d-%s.log" % (self.count, scenario))
        cmd = [sys.executable, WORKLOAD, scenario, "--gib", str(gib), "--lifeline", str(self.lifeline[0]),
               "--lifetime", str(self.args.deadline + 60)]
        if gpus is not None:
            order = visible if isinstance(visible, list) else sorted(self.minors)
            cmd += ["--devices", ",".join(str(order.index(g)) for g in gpus)]
        cmd += list(flags)
        if self.args.allocator != "torch":  # rehearsal on the lab's fake driver
            cmd += ["--allocator", self.args.allocator, "--dev-dir", self.dev_dir, "--minor", str(self.minor)]
        if pidns:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] + cmd
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                    env=self.env(visible), pass_fds=(self.lifeline[0],), start_new_session=True)
        self.procs.append(proc)
        self.owned[proc.pid] = start_time(proc.pid)
        try:
            line = read_line(proc.stdout, self.args.ready_timeout)
        except TimeoutError as exc:
            raise RuntimeError("%s: %s; log %s: %s" % (scenario, exc, log_path, tail(log_path)))
        finally:
            proc.stdout.close()
        try:
            doc = json.loads(line.decode())
        except ValueError:
            raise RuntimeError("%s: no JSON line (rc %s); log %s: %s" % (scenario, proc.poll(), log_path, tail(log_path)))
        if "error" in doc:
            raise RuntimeError("%s failed: %s" % (scenario, doc["error"][-1500:]))
        top = proc.pid
        ns_roles = {}
        if pidns:
            top = wait_until(lambda: first_child(proc.pid), 10.0)
            if not top:
                raise RuntimeError("no process under unshare %d" % proc.pid)
            self.own(top)
            mapping = ns_to_host(pidns_inode(top))
            ns_roles = dict(doc["roles"])
            translate = mapping.get
        else:
            translate = int
        roles = {}
        for role, pid in doc["roles"].items():
            roles[role] = translate(pid)
        holders = [translate(p) for p in doc.get("holders", [])]
        for pid in set(roles.values()) | set(holders):
            if pid is None:
                raise RuntimeError("cannot map %s pids to host pids: %s" % (scenario, doc))
            if pid not in self.owned:
                self.own(pid)
        pids = [proc.pid] + sorted(set(roles.values()) - {proc.pid})
        if self.args.hold_s:
            time.sleep(self.args.hold_s)
        return Workload(scenario, roles, holders, pids, doc, proc=proc, ns_roles=ns_roles)

    def stop(self, workload):
        for pid in reversed(workload.pids):
            if self.is_owned(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.reap()
        if workload.proc:
            try:
                workload.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def sweep(self):
        """SIGKILL every process that carries this run's token (and every one we own), then reap."""
        token = self.token.encode()
        victims = set(pid for pid in self.owned if self.is_owned(pid))
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid() and environ_has(int(name), token):
                victims.add(int(name))
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            self.reap()
            if not [p for p in victims if state_letter(p) not in (None, "Z")]:
                break
            time.sleep(0.05)
        for proc in self.procs:
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        self.reap()

    # -- views
    def nvml(self, view="host", ref=None):
        if view == "host":
            return self._nvml_read(self.args.index)
        code = [sys.executable, "-c", NVML_QUERY, str(self.args.index)]
        if view == "same":      # inside the PID (and mount) namespace of host pid ref
            cmd = ["nsenter", "--target", str(ref), "--pid", "--mount", "--"] + code
        elif view == "other":   # a fresh PID namespace that sees none of the holders
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--"] + code
        else:
            raise ValueError(view)
        return json.loads(run_cmd(cmd, 60, env=self.env()).stdout.strip().splitlines()[-1])

    def nvml_gpus(self, view="host", ref=None):
        if view == "host":
            return self.by_index([self._nvml_read(i) for i in sorted(self.minors)])
        code = [sys.executable, "-c", NVML_QUERY, "all"]
        if view == "same":
            cmd = ["nsenter", "--target", str(ref), "--pid", "--mount", "--"] + code
        else:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--"] + code
        return self.by_index(json.loads(run_cmd(cmd, 60, env=self.env()).stdout.strip().splitlines()[-1]))

    def used_now(self, index):
        return self._nvml_read(index)["v2_used_mib"]

    def fuser(self, ref=None):
        files = [f for f in sorted(glob.glob(os.path.join(self.dev_dir, "nvidia*")) +
                                   glob.glob(os.path.join(self.dev_dir, "nvidia-caps", "*")))
                 if not os.path.isdir(f)]
        if not files:
            return []
        res = subprocess.run(["fuser", "-v"] + files, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=30, text=True, check=False)  # rc 1: nobody uses them
        entries = parse_fuser(res.stdout)
        for e in entries:
            e["host_pid"] = e["pid"]
            e["file"] = dev_name(e["file"] or "") or e["file"]
        return entries

    def plan(self, row):
        gib = self.args.gib
        work = "%s %s SCENARIO --gib %s --lifeline FD --lifetime %d" % (
            sys.executable, os.path.relpath(WORKLOAD), gib, self.args.deadline + 60)
        extra = {
            1: ["python: pynvml.nvmlDeviceGetMemoryInfo(h) and (h, version=nvmlMemory_v2), index %d" % self.args.index,
                "fuser -v %s/nvidia* %s/nvidia-caps/*" % (self.dev_dir, self.dev_dir)],
            2: [work.replace("SCENARIO", "plain").replace("--gib %s" % gib, "--gib %s" % g)
                for g in self.args.row2_gib],
            3: [work.replace("SCENARIO", "zombie")],
            4: [work.replace("SCENARIO", "defunct_leader")],
            5: [work.replace("SCENARIO", "fork_inherit")],
            6: [work.replace("SCENARIO", "mmap_only")],
            7: ["unshare --pid --fork --mount-proc --kill-child " + work.replace("SCENARIO", "plain"),
                "nsenter --target HOLDER --pid --mount -- %s -c NVML_QUERY" % sys.executable,
                "unshare --pid --fork --mount-proc --kill-child -- %s -c NVML_QUERY" % sys.executable],
            8: [work.replace("SCENARIO", "monitor"), work.replace("SCENARIO", "plain")],
        }
        every = "CUDA_VISIBLE_DEVICES unset; NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
        multi = {
            9: [every, work.replace("SCENARIO", "plain") + " --devices 0"],
            10: ["CUDA_VISIBLE_DEVICES=1 " + work.replace("SCENARIO", "plain") + " --devices 0"],
            11: [work.replace("SCENARIO", "tp_nccl") + " --devices 0,1"],
            12: [work.replace("SCENARIO", "plain") + " --devices 0,1"],
            13: [work.replace("SCENARIO", "stray_context") + " --devices 1"],
            14: [work.replace("SCENARIO", "fork_inherit") + " --devices 0"],
            15: [work.replace("SCENARIO", "defunct_leader") + " --devices 1 --alloc-in-thread"],
            16: ["unshare --pid --fork --mount-proc --kill-child " + work.replace("SCENARIO", "stray_context")
                 + " --devices 1", "nsenter --target HOLDER --pid --mount -- %s -c NVML_QUERY all" % sys.executable],
            17: [work.replace("SCENARIO", "ipc_consumer") + " --devices 0"],
            18: [work.replace("SCENARIO", "monitor")],
            19: [work.replace("SCENARIO", "tp_nccl") + " --devices 0,1"],
            20: [work.replace("SCENARIO", "bare_context") + " --devices 0"],
            21: [work.replace("SCENARIO", "tp_nccl") + " --devices 0,1 --bystander --bystander-gib 1"],
            29: ["%s -c NVML_QUERY health" % sys.executable],
        }
        extra.update(multi)
        return extra[row]


def environ_has_any_task_gone(pid):
    """A process whose every table is gone (a true zombie) carries no environ to check."""
    return state_letter(pid) == "Z" and len(tasks(pid)) <= 1


def first_child(pid):
    text = read_text("/proc/%d/task/%d/children" % (pid, pid))
    kids = [int(x) for x in (text or "").split()]
    if not kids and text is None:  # kernel without CONFIG_PROC_CHILDREN
        kids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit() and status(int(n)).get("PPid") == str(pid))
    return kids[0] if kids else None


def tail(path, size=1500):
    text = read_text(path) or ""
    return text[-size:].replace("\n", " | ")


class LabBackend(Backend):
    """The lab: workloads in lab containers (labctl run), NVML through the stand-in library."""

    name = "lab"
    floor_expected = 615.0
    torch_stray = False   # the lab's defunct_leader has no stray context (row 15 checks the rule, not PyTorch)

    def __init__(self, args):
        super().__init__(args)
        self.alloc_mib = args.mib
        self.node = "pve1"
        self.vmid, self.other_vmid = 101, 102
        self.started = {}     # host pid -> start time
        self.env = dict(os.environ, LAB_ID=args.lab_id)
        self.state = None
        self.lib_dir = None
        self.ct_python = {}
        self.ns_inode = None
        self.was_up = False

    def labctl(self, *argv, timeout=120, check=True):
        return run_cmd([LABCTL] + list(argv), timeout, env=self.env, check=check)

    def setup(self):
        self.state = os.path.join("/run/gpuops-lab", self.args.lab_id)
        self.labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "2",
                    "--nvml-pids", self.args.lab_nvml_pids, timeout=300)
        for vmid in (self.vmid, self.other_vmid):
            with open(os.path.join(self.state, "nodes", self.node, "containers", "%d.json" % vmid)) as f:
                ct = json.load(f)
            self.ct_python[vmid] = ct.get("python") or "python3"
            if vmid == self.vmid:
                self.ns_inode = pidns_inode(int(ct["init_host_pid"]))
        libs = glob.glob(os.path.join(self.state, "**", "libnvidia-ml.so.1"), recursive=True)
        if not libs:
            raise RuntimeError("no libnvidia-ml.so.1 under %s" % self.state)
        self.lib_dir = os.path.dirname(sorted(libs, key=len)[0])
        with open(os.path.join(self.state, "nodes", self.node, "containers", "%d.json" % self.vmid)) as f:
            self.minors = dict(enumerate(json.load(f)["minors"]))
        gpus = self.gpus()
        index0 = [g for g in gpus if str(self.vmid) in {str(k) for k in g["visible_in"]}
                  and g["visible_in"].get(str(self.vmid), g["visible_in"].get(self.vmid)) == 0]
        if not index0:
            raise RuntimeError("container %d sees no GPU index 0: %s" % (self.vmid, gpus))
        self.minor = index0[0]["minor"]

    def teardown(self):
        for pid in list(self.started):
            self.kill_quiet(pid)
        if self.state:
            self.labctl("down", timeout=180, check=False)

    def gpus(self):
        doc = json.loads(self.labctl("gpus", "--node", self.node).stdout)
        return doc["gpus"] if isinstance(doc, dict) else doc

    def info(self):
        m = self.nvml_env_query("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
                                "print(json.dumps({'driver_version': pynvml.nvmlSystemGetDriverVersion(), "
                                "'nvml_version': pynvml.nvmlSystemGetNVMLVersion(), "
                                "'gpu_name': pynvml.nvmlDeviceGetName(h), 'gpu_uuid': pynvml.nvmlDeviceGetUUID(h), "
                                "'gpu_count': pynvml.nvmlDeviceGetCount()}))")
        m.update({"gpu_index": 0, "gpu_minor": self.minor, "lab_id": self.args.lab_id,
                  "lab_view": "container %d on %s (index 0), host view = node %s" % (self.vmid, self.node, self.node)})
        return m

    def host_nvml_env(self):
        return dict(self.env, LD_LIBRARY_PATH=self.lib_dir,
                    NVIDIA_LAB_SOCKET=os.path.join(self.state, "driver", "driver.sock"),
                    NVIDIA_LAB_NODE=self.node,
                    NVIDIA_LAB_DEV_DIR=os.path.join(self.state, "nodes", self.node, "dev"))

    def nvml_env_query(self, code):
        res = run_cmd([sys.executable, "-c", "import json\n" + code], 60, env=self.host_nvml_env())
        return json.loads(res.stdout.strip().splitlines()[-1])

    def exec_ct(self, vmid, argv, timeout=60, check=True):
        return self.labctl("exec", "--node", self.node, "--vmid", str(vmid), "--", *argv, timeout=timeout, check=check)

    def nvml_gpus(self, view="host", ref=None):
        if view == "host":
            res = run_cmd([sys.executable, "-c", NVML_QUERY, "all"], 60, env=self.host_nvml_env())
        else:
            vmid = self.vmid if view == "same" else self.other_vmid
            res = self.exec_ct(vmid, [self.ct_python[vmid], "-c", NVML_QUERY, "all"])
        return self.by_index(json.loads(res.stdout.strip().splitlines()[-1]))

    def used_now(self, index):
        """v2 used of container GPU index, straight from the driver daemon (fast enough to time)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(os.path.join(self.state, "driver", "driver.sock"))
            sock.sendall(json.dumps({"op": "snapshot", "node": self.node}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        minor = self.minor_of(index)
        return next(g["used_mib"] for g in json.loads(data.decode())["gpus"] if g["minor"] == minor)

    def nvml(self, view="host", ref=None):
        if view == "host":   # the stand-in library loaded in the host namespaces
            res = run_cmd([sys.executable, "-c", NVML_QUERY, "0"], 60, env=self.host_nvml_env())
        elif view == "same":
            res = self.exec_ct(self.vmid, [self.ct_python[self.vmid], "-c", NVML_QUERY, "0"])
        elif view == "other":
            res = self.exec_ct(self.other_vmid, [self.ct_python[self.other_vmid], "-c", NVML_QUERY, "0"])
        else:
            raise ValueError(view)
        return json.loads(res.stdout.strip().splitlines()[-1])

    def in_lab(self, pid):
        return ("gpuops-lab-%s/" % self.args.lab_id) in (read_text("/proc/%d/cgroup" % pid) or "")

    def kill(self, pid, sig=signal.SIGKILL):
        if pid not in self.started or start_time(pid) != self.started[pid] or not self.in_lab(pid):
            raise RuntimeError("refusing to signal pid %d: not a workload of this run" % pid)
        os.kill(pid, sig)

    def kill_quiet(self, pid):
        try:
            self.kill(pid)
        except (RuntimeError, ProcessLookupError):
            pass

    def start(self, scenario, pidns=False, gib=None, gpus=None, visible=-1, flags=()):
        """gpus: the container's NVML indexes (default 0); visible: a list sets --cuda-visible-devices.
        flags (cuda_workload.py options) have no lab counterpart and are left out."""
        argv = ["run", scenario, "--node", self.node, "--vmid", str(self.vmid),
                "--gpus", ",".join(str(g) for g in (gpus if gpus is not None else [0]))]
        if isinstance(visible, list):
            argv += ["--cuda-visible-devices", ",".join(str(g) for g in visible)]
        if scenario != "monitor":
            argv += ["--mib", str(self.alloc_mib if gib is None else int(gib * GIB_MIB))]
        res = self.labctl(*argv, timeout=60)
        doc = json.loads(res.stdout.strip().splitlines()[-1])
        roles = {k: int(v) for k, v in doc["roles"].items() if isinstance(v, int)}
        pids = [p for p in list(doc.get("host_pids") or []) + list(roles.values()) if p is not None]
        for pid in pids:
            if pid not in self.started and os.path.exists("/proc/%d" % pid):
                self.started[pid] = start_time(pid)
        return Workload(scenario, roles, list(doc.get("holders") or []), pids, doc)

    def stop(self, workload):
        for pid in workload.pids:
            self.kill_quiet(pid)
        wait_until(lambda: all(state_letter(p) is None for p in workload.pids), 10.0, step=0.02)

    def fuser(self, ref=None):
        """fuser -v inside the container (its pids), each entry with its host pid."""
        script = "fuser -v /dev/nvidia* /dev/nvidia-caps/* 2>&1; true"
        res = self.exec_ct(self.vmid, ["sh", "-c", script], timeout=30)
        entries = parse_fuser(res.stdout)
        mapping = ns_to_host(self.ns_inode)
        for e in entries:
            e["host_pid"] = mapping.get(e["pid"])
            e["file"] = dev_name(e["file"] or "") or e["file"]
        return entries

    def plan(self, row):
        run = "LAB_ID=%s labctl run SCENARIO --node pve1 --vmid 101 --gpus 0 --mib %d" % (
            self.args.lab_id, self.alloc_mib)
        common = "labctl up --nodes 1 --containers 2 --gpus 2 (once); NVML host view: stand-in lib via LD_LIBRARY_PATH"
        extra = {
            1: [common, "labctl exec --node pve1 --vmid 101 -- sh -c 'fuser -v /dev/nvidia* ...'"],
            2: [run.replace("SCENARIO", "plain")],
            3: [run.replace("SCENARIO", "zombie")],
            4: [run.replace("SCENARIO", "defunct_leader")],
            5: [run.replace("SCENARIO", "fork_inherit")],
            6: [run.replace("SCENARIO", "mmap_only")],
            7: [run.replace("SCENARIO", "plain"), "NVML from host, from ct101 (same ns), from ct102 (other ns)"],
            8: [run.replace("SCENARIO", "monitor").replace(" --mib %d" % self.alloc_mib, ""),
                run.replace("SCENARIO", "plain")],
            9: [run.replace("SCENARIO", "plain")],
            10: [run.replace("SCENARIO", "plain").replace("--gpus 0", "--gpus 1 --cuda-visible-devices 1")],
            11: [run.replace("SCENARIO", "tp_nccl").replace("--gpus 0", "--gpus 0,1")],
            12: [run.replace("SCENARIO", "plain").replace("--gpus 0", "--gpus 0,1")],
            13: [run.replace("SCENARIO", "stray_context").replace("--gpus 0", "--gpus 1")],
            14: [run.replace("SCENARIO", "fork_inherit")],
            15: [run.replace("SCENARIO", "defunct_leader").replace("--gpus 0", "--gpus 1")],
            16: [run.replace("SCENARIO", "stray_context").replace("--gpus 0", "--gpus 1"),
                 "NVML from the host and from ct101 (its namespace)"],
            17: [run.replace("SCENARIO", "ipc_consumer")],
            18: [run.replace("SCENARIO", "monitor").replace(" --mib %d" % self.alloc_mib, "")],
            19: [run.replace("SCENARIO", "tp_nccl").replace("--gpus 0", "--gpus 0,1")],
            20: [run.replace("SCENARIO", "stray_context").replace("--gpus 0", "--gpus 1") + " (its GPU 0 context)"],
            21: [run.replace("SCENARIO", "tp_nccl").replace("--gpus 0", "--gpus 0,1"),
                 run.replace("SCENARIO", "plain") + " (the unrelated holder)"],
            29: ["NVML_QUERY health with the stand-in library, from the node"],
        }
        return extra[row]


# ---------------------------------------------------------------- the rows

class Row:
    def __init__(self, number):
        self.number = number
        self.title = ROWS[number]
        self.checks = []
        self.measured = {}
        self.error = None
        self.skipped = None
        self.seconds = 0.0

    def skip(self, reason):
        self.skipped = reason

    def check(self, name, ok, detail=""):
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        return bool(ok)

    @property
    def passed(self):
        return self.error is None and bool(self.checks) and all(c["ok"] for c in self.checks)

    @property
    def status(self):
        if self.skipped and self.error is None and not self.checks:
            return "SKIP"
        return "PASS" if self.passed else "FAIL"

    def to_json(self):
        out = {"row": self.number, "title": self.title, "status": self.status,
               "measured": self.measured, "checks": self.checks, "error": self.error,
               "seconds": round(self.seconds, 2)}
        if self.skipped:
            out["skipped"] = self.skipped
        return out


def role(w, *names):
    """Host pid of the first role present (workloads name some roles differently)."""
    for name in names:
        if name in w.roles:
            return w.roles[name]
    raise KeyError("%s: none of the roles %s in %s" % (w.scenario, names, w.roles))


def need_devs(b):
    return {"nvidia%d" % b.minor, "nvidiactl", "nvidia-uvm"}


def row1(b, r):
    m = b.wait_idle()
    floor = m["v1_used_mib"] - m["v2_used_mib"]
    r.measured.update(v1_used_mib=m["v1_used_mib"], v2_used_mib=m["v2_used_mib"], reserved_mib=m["reserved_mib"],
                      total_mib=m["v1_total_mib"], floor_mib=round(floor, 1), nvml_pids=m["pids"])
    r.check("v1 used - v2 used == reserved", abs(floor - m["reserved_mib"]) <= 1.0,
            "%.1f - %.1f vs %.1f" % (m["v1_used_mib"], m["v2_used_mib"], m["reserved_mib"]))
    r.check("v2 used small", m["v2_used_mib"] <= max(b.tolerance_mib, 1.0), "%.1f MiB" % m["v2_used_mib"])
    r.check("reserved > 0 (v1 used == 0 never passes)", m["reserved_mib"] > 0 and m["v1_used_mib"] > 0,
            "%.1f MiB" % m["reserved_mib"])
    if b.floor_expected is not None:
        r.check("floor == %.0f MiB" % b.floor_expected, abs(m["reserved_mib"] - b.floor_expected) < 0.5,
                m["reserved_mib"])
    r.check("no compute process", not m["pids"], m["pids"])
    entries = b.fuser()
    mappers = [e for e in entries if "m" in e["access"] and not e["command"].startswith(NVIDIA_DAEMONS)
               and e.get("host_pid") != os.getpid()]
    r.measured["fuser"] = ["%s %s %s %s" % (e["file"], e["pid"], e["access"], e["command"]) for e in entries]
    r.check("no process maps /dev/nvidia*", not mappers,
            ["%s %s" % (e["pid"], e["command"]) for e in mappers])


def row2(b, r):
    sizes = b.args.row2_gib if b.name == "cuda" else [b.alloc_mib / GIB_MIB]
    runs = []
    r.measured["runs"] = runs
    for gib in sizes:
        try:
            runs.append(row2_one(b, r, gib))
        except Exception as exc:  # one size failing (say, no room for 120 GiB) must not hide the others
            r.check("%g GiB run" % gib, False, "%s: %s" % (type(exc).__name__, str(exc)[-600:]))


def row2_one(b, r, gib):
    base = b.wait_idle()
    w = b.start("plain", gib=gib)
    try:
        holder = role(w, "holder")
        m = b.nvml("host")
        held = m["v2_used_mib"] - base["v2_used_mib"]
        r.check("%g GiB held" % gib, held >= b.held_fraction * gib * GIB_MIB, "%.0f MiB" % held)
        r.check("%g GiB: NVML lists the holder" % gib, holder in m["pids"], m["pids"])
        t = b.kill_wait(holder)
        after = b.check_freed(r, "%g GiB: back at the floor when reaped" % gib, base, key=None)
        r.check("%g GiB: NVML lists nothing when reaped" % gib, holder not in after["pids"], after["pids"])
        return dict(t, gib=gib, held_mib=held, **b.last_release)
    finally:
        b.stop(w)


def row3(b, r):
    base = b.wait_idle()
    w = b.start("zombie")
    try:
        parent, child = role(w, "parent"), role(w, "zombie", "child")
        if state_letter(child) != "Z":
            m = b.nvml("host")
            r.check("child holds the memory", b.held(m, base), "%.0f MiB" % m["v2_used_mib"])
            t0 = time.monotonic()
            b.kill(child)
            wait_until(lambda: state_letter(child) == "Z", 10.0, step=0.001)
            r.measured["kill_to_zombie_ms"] = round((time.monotonic() - t0) * 1000, 1)
        after = b.check_freed(r, "memory back at once while the child is a zombie", base, key="v2_used_mib")
        still_zombie = state_letter(child) == "Z"
        r.measured.update(child_state=status(child).get("State"), child_threads=status(child).get("Threads"),
                          nvml_pids=after["pids"])
        r.check("child is still a zombie after the reading", still_zombie, status(child).get("State"))
        fds = fd_count(child)
        r.measured["child_fds"] = fds
        r.check("zombie has no fds", fds == 0, fds)
        r.check("NVML does not list the zombie", child not in after["pids"], after["pids"])
        b.kill(parent)
        gone = wait_until(lambda: b.reap() or state_letter(child) is None, 10.0, step=0.01)
        r.check("killing the parent removes the zombie entry", gone, state_letter(child))
    finally:
        b.stop(w)


def row4(b, r):
    base = b.wait_idle()
    w = b.start("defunct_leader")
    try:
        leader = role(w, "leader")
        defunct = wait_until(lambda: status(leader).get("State", "").startswith("Z")
                             and int(status(leader).get("Threads", "0")) > 1, 10.0, step=0.01)
        st = status(leader)
        r.measured.update(leader_state=st.get("State"), threads=int(st.get("Threads", "0")))
        r.check("leader is Z with threads alive", defunct, "%s, Threads %s" % (st.get("State"), st.get("Threads")))
        m = b.nvml("host")
        r.measured["v2_used_mib"] = m["v2_used_mib"]
        r.check("memory held", b.held(m, base), "%.0f MiB" % m["v2_used_mib"])
        r.check("NVML lists the leader", leader in m["pids"], m["pids"])
        fds = fd_devs(leader)
        r.measured["leader_fd_entries"] = fd_count(leader)
        r.check("/proc/PID/fd of the leader is empty", fd_count(leader) == 0, fds)
        live = [t for t in tasks(leader) if t != leader]
        shown = {}
        for tid in live:
            devs = fd_devs(leader, tid)
            if devs:
                shown[tid] = devs
                break
        r.measured["live_thread_fd_devs"] = sorted(set(next(iter(shown.values()), [])))
        r.check("a live thread's task fd shows /dev/nvidia%d" % b.minor,
                any("nvidia%d" % b.minor in devs for devs in shown.values()), shown)
        entries = b.fuser()
        listed = [e for e in entries if e.get("host_pid") in set([leader] + live)]
        r.check("fuser -v /dev/nvidia* does not list it", not listed,
                ["%s %s" % (e["file"], e["access"]) for e in listed])
        r.measured.update(b.kill_wait(leader))
        b.check_freed(r, "SIGKILL frees", base)
    finally:
        b.stop(w)


def row5(b, r):
    base = b.wait_idle()
    w = b.start("fork_inherit")
    try:
        parent, child = role(w, "parent"), role(w, "child", "dataloader")
        if state_letter(parent) not in (None, "Z"):
            r.measured["parent_kill"] = b.kill_wait(parent)
        m = b.nvml("host")
        r.measured.update(v2_used_mib=m["v2_used_mib"], nvml_pids=m["pids"], parent=parent, child=child)
        r.check("memory stays after the parent died", b.held(m, base), "%.0f MiB" % m["v2_used_mib"])
        r.check("NVML lists the dead parent", parent in m["pids"], m["pids"])
        r.check("NVML never lists the child", child not in m["pids"], m["pids"])
        fds = set(fd_devs(child) or [])
        lines, mapped = map_devs(child)
        r.measured.update(child_fd_devs=sorted(fds), child_map_devs=mapped, child_map_lines=lines)
        r.check("child holds nvidia%d, nvidiactl, nvidia-uvm as fds" % b.minor, need_devs(b) <= fds, sorted(fds))
        # Measured on the H200: CUDA's nvidia-uvm mappings are not inherited (MADV_DONTFORK).
        r.check("and maps nvidia%d and nvidiactl" % b.minor, {"nvidia%d" % b.minor, "nvidiactl"} <= set(mapped), mapped)
        r.check("but not nvidia-uvm", "nvidia-uvm" not in mapped, mapped)
        entries = b.fuser()
        r.measured["child_fuser_access"] = sorted({e["access"] for e in b.fuser_pid(entries, child)})
        r.check("fuser lists the child", bool(b.fuser_pid(entries, child)), r.measured["child_fuser_access"])
        r.measured["child_kill"] = b.kill_wait(child)
        b.check_freed(r, "SIGKILL to the child frees", base)
    finally:
        b.stop(w)


def row6(b, r):
    base = b.wait_idle()
    w = b.start("mmap_only")
    try:
        holder = role(w, "holder")
        fds = {}
        for tid in tasks(holder):
            devs = fd_devs(holder, tid)
            if devs:
                fds[tid] = devs
        lines, mapped = map_devs(holder)
        m = b.nvml("host")
        r.measured.update(map_lines=lines, map_devs=mapped, v2_used_mib=m["v2_used_mib"],
                          closed_fds=w.doc.get("closed_fds"))
        r.check("no /dev/nvidia* fd", not fds, fds)
        r.check("maps lines name nvidia%d, nvidiactl, nvidia-uvm" % b.minor,
                bool(lines) and need_devs(b) <= set(mapped), "%s lines: %s" % (lines, mapped))
        r.check("memory held", b.held(m, base), "%.0f MiB" % m["v2_used_mib"])
        entries = b.fuser()
        access = sorted({e["access"] for e in b.fuser_pid(entries, holder)})
        r.measured["fuser_access"] = access
        r.check("fuser lists it with access m only", bool(access) and all(
            "m" in a and "F" not in a and "f" not in a for a in access), access)
        r.measured.update(b.kill_wait(holder))
        b.check_freed(r, "SIGKILL frees", base)
    finally:
        b.stop(w)


def row7(b, r):
    base = b.wait_idle()
    w = b.start("plain", pidns=True)
    try:
        holder = role(w, "holder")
        ids = nspids(holder)
        ns_pid = ids[-1] if ids else None
        r.measured.update(host_pid=holder, nspid=ids)
        r.check("NSpid has two levels", len(ids) >= 2 and ids[0] == holder and ids[-1] != holder, ids)
        host = b.nvml("host")
        same = b.nvml("same", holder)
        other = b.nvml("other", holder)
        r.measured.update(host_view=host["pids"], same_ns_view=same["pids"], other_ns_view=other["pids"],
                          other_ns_v2_used_mib=other["v2_used_mib"])
        r.check("from the host: the host pid", holder in host["pids"], host["pids"])
        r.check("from the same namespace: the namespace pid", ns_pid in same["pids"] and holder not in same["pids"],
                same["pids"])
        r.check("from another namespace: nothing", not other["pids"], other["pids"])
        r.check("while used shows the memory", b.held(other, base), "%.0f MiB" % other["v2_used_mib"])
        r.measured.update(b.kill_wait(holder))
        b.check_freed(r, "SIGKILL frees", base)
    finally:
        b.stop(w)


def row8(b, r):
    b.wait_idle()
    mon = b.start("monitor")
    work = None
    try:
        monitor = role(mon, "monitor")
        work = b.start("plain")
        holder = work.roles["holder"] if "holder" in work.roles else work.holders[0]
        fds = fd_devs(monitor) or []
        lines, mapped = map_devs(monitor)
        h_lines, h_mapped = map_devs(holder)
        m = b.nvml("host")
        entries = b.fuser()
        mon_access = sorted({e["access"] for e in b.fuser_pid(entries, monitor)})
        holder_access = sorted({e["access"] for e in b.fuser_pid(entries, holder)})
        r.measured.update(monitor_fd_devs=sorted(set(fds)), monitor_map_lines=lines, holder_map_devs=h_mapped,
                          monitor_fuser_access=mon_access, holder_fuser_access=holder_access, nvml_pids=m["pids"])
        r.check("monitor holds fds of nvidiactl and nvidia%d" % b.minor,
                {"nvidiactl", "nvidia%d" % b.minor} <= set(fds), sorted(set(fds)))
        r.check("monitor maps none of them", lines == 0, mapped)
        r.check("monitor not listed by NVML", monitor not in m["pids"], m["pids"])
        r.check("NVML lists the CUDA holder", holder in m["pids"], m["pids"])
        r.check("fuser: monitor F without m", bool(mon_access) and all(
            ("F" in a or "f" in a) and "m" not in a for a in mon_access), mon_access)
        r.check("holder maps nvidiactl, nvidia%d, nvidia-uvm" % b.minor, need_devs(b) <= set(h_mapped), h_mapped)
        r.check("fuser: holder has access m", any("m" in a for a in holder_access), holder_access)
    finally:
        if work:
            b.stop(work)
        b.stop(mon)


# ---------------------------------------------------------------- rows 9-21: several GPUs (A = index 0, B = index 1)

def two_gpus(b, r):
    """Minors of GPU indexes 0 and 1, or None after marking the row SKIP."""
    if b.gpu_count() < 2:
        r.skip("needs 2 GPUs, %d here" % b.gpu_count())
        return None
    return b.minor_of(0), b.minor_of(1)


def listed_mib(reading, pid):
    return reading["proc_mib"].get(str(pid)) if pid in reading["pids"] else None


def named_on(m, pid):
    return sorted(i for i, g in m.items() if pid in g["pids"])


def is_bare(mib):
    return mib is not None and BARE_MIB[0] <= mib <= BARE_MIB[1]


def record_nodes(r, key, pid, minors, tid=None):
    """Record {gpu index: {fds, maps}} of pid's /dev/nvidiaN under key; returns it."""
    counts = dev_counts(pid, tid)
    got = dict((str(i), node_of(counts, m)) for i, m in enumerate(minors))
    r.measured[key] = got
    return got


def held_delta(b, m, base, index):
    return round(m[index]["v2_used_mib"] - base[index]["v2_used_mib"], 1)


def row9(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    w = b.start("plain", gpus=[0], visible=None)
    try:
        pid = role(w, "holder")
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "nodes", pid, minors)
        r.measured.update(gpu0_mib=listed_mib(m[0], pid), gpu1_pids=m[1]["pids"],
                          gpu1_used_delta_mib=held_delta(b, m, base, 1))
        r.check("GPU 0 lists it with the memory", (listed_mib(m[0], pid) or 0) >= b.held_fraction * b.alloc_mib,
                m[0]["proc_mib"])
        r.check("GPU 1 does not list it", pid not in m[1]["pids"], m[1]["pids"])
        r.check("no memory on GPU 1", held_delta(b, m, base, 1) <= b.tolerance_mib, m[1]["v2_used_mib"])
        r.check("GPU 0 node: %d map lines (context)" % CONTEXT_MAPS, nodes["0"]["maps"] == CONTEXT_MAPS, nodes["0"])
        r.check("GPU 1 node: %d map lines (visible only)" % VISIBLE_MAPS, nodes["1"]["maps"] == VISIBLE_MAPS,
                nodes["1"])
        r.check("fds on both nodes, fewer on GPU 1", nodes["0"]["fds"] > nodes["1"]["fds"] > 0, nodes)
        t = b.kill_timed(pid, 0, base[0]["v2_used_mib"])
        r.measured.update(t)
        free, reaped = t["kill_to_free_ms"], t["kill_to_reaped_ms"]
        r.check("memory free after SIGKILL", free is not None, t)
        r.check("free delay 50-500 ms (0.12-0.2 s on the H200)", free is not None and 50 <= free <= 500, t)
        r.check("back by the time it is reaped (within --grace-ms)",
                None not in (free, reaped) and free - reaped <= b.args.grace_ms, t)
    finally:
        b.stop(w)


def row10(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    w = b.start("plain", gpus=[1], visible=[1])
    try:
        pid = role(w, "holder")
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "nodes", pid, minors)
        r.measured.update(named_on=named_on(m, pid), gpu1_mib=listed_mib(m[1], pid))
        r.check("NVML lists it on GPU 1 only", named_on(m, pid) == [1], named_on(m, pid))
        r.check("with the memory", (listed_mib(m[1], pid) or 0) >= b.held_fraction * b.alloc_mib, m[1]["proc_mib"])
        r.check("GPU 0 unused", held_delta(b, m, base, 0) <= b.tolerance_mib, m[0]["v2_used_mib"])
        r.check("GPU 1 node: %d map lines" % CONTEXT_MAPS, nodes["1"]["maps"] == CONTEXT_MAPS, nodes["1"])
        r.check("hidden GPU 0: no mapping (fds may stay)", nodes["0"]["maps"] == 0, nodes["0"])
    finally:
        b.stop(w)


def tp_ranks(w, n=2):
    return [role(w, "rank%d" % i) for i in range(n)]


def row11(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("tp_nccl", gpus=[0, 1], visible=None)
    try:
        ranks = tp_ranks(w)
        m = b.nvml_gpus("host")
        for i, pid in enumerate(ranks):
            nodes = record_nodes(r, "rank%d_nodes" % i, pid, minors)
            own, peer = str(i), str(1 - i)
            r.measured["rank%d_named_on" % i] = named_on(m, pid)
            r.measured["rank%d_mib" % i] = listed_mib(m[i], pid)
            r.check("rank %d listed on its own GPU only" % i, named_on(m, pid) == [i], named_on(m, pid))
            r.check("rank %d: own GPU %d map lines, the peer's %d" % (i, CONTEXT_MAPS, VISIBLE_MAPS),
                    nodes[own]["maps"] == CONTEXT_MAPS and nodes[peer]["maps"] == VISIBLE_MAPS, nodes)
            r.check("rank %d: fds on both nodes" % i, nodes[own]["fds"] > 0 and nodes[peer]["fds"] > 0, nodes)
    finally:
        b.stop(w)


def row12(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("plain", gpus=[0, 1], visible=None)
    try:
        pid = role(w, "holder")
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "nodes", pid, minors)
        r.measured.update(named_on=named_on(m, pid), mib=[listed_mib(m[0], pid), listed_mib(m[1], pid)])
        r.check("listed on both GPUs with the memory", all(
            (listed_mib(m[i], pid) or 0) >= b.held_fraction * b.alloc_mib for i in (0, 1)), r.measured["mib"])
        r.check("%d map lines on both" % CONTEXT_MAPS, all(n["maps"] == CONTEXT_MAPS for n in nodes.values()), nodes)
    finally:
        b.stop(w)


def row13(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("stray_context", gpus=[1], visible=None)
    try:
        pid = role(w, "holder")
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "nodes", pid, minors)
        r.measured.update(gpu1_mib=listed_mib(m[1], pid), gpu0_mib=listed_mib(m[0], pid))
        r.check("listed on GPU 1 with the memory", (listed_mib(m[1], pid) or 0) >= b.held_fraction * b.alloc_mib,
                m[1]["proc_mib"])
        r.check("and on GPU 0 with a bare context (%g-%g MiB)" % BARE_MIB, is_bare(listed_mib(m[0], pid)),
                m[0]["proc_mib"])
        r.check("%d map lines on both" % CONTEXT_MAPS, all(n["maps"] == CONTEXT_MAPS for n in nodes.values()), nodes)
    finally:
        b.stop(w)


def row14(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    w = b.start("fork_inherit", gpus=[0], visible=None)
    try:
        parent, child = role(w, "parent"), role(w, "child", "dataloader")
        if state_letter(parent) not in (None, "Z"):
            r.measured["parent_kill"] = b.kill_wait(parent)
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "child_nodes", child, minors)
        r.measured.update(gpu0_pids=m[0]["pids"], gpu1_pids=m[1]["pids"], parent=parent, child=child,
                          gpu0_used_delta_mib=held_delta(b, m, base, 0))
        r.check("GPU 0 lists the dead parent only", m[0]["pids"] == [parent], m[0]["pids"])
        r.check("memory held on GPU 0", held_delta(b, m, base, 0) >= b.held_fraction * b.alloc_mib,
                m[0]["v2_used_mib"])
        r.check("GPU 1 empty", not m[1]["pids"] and held_delta(b, m, base, 1) <= b.tolerance_mib, m[1])
        r.check("child: GPU 0 node %d map lines, GPU 1 %d" % (CONTEXT_MAPS, VISIBLE_MAPS),
                nodes["0"]["maps"] == CONTEXT_MAPS and nodes["1"]["maps"] == VISIBLE_MAPS, nodes)
        r.check("child: fds on both nodes", nodes["0"]["fds"] > 0 and nodes["1"]["fds"] > 0, nodes)
    finally:
        b.stop(w)


def row15(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("defunct_leader", gpus=[1], visible=None, flags=["--alloc-in-thread"])
    try:
        leader = role(w, "leader")
        defunct = wait_until(lambda: status(leader).get("State", "").startswith("Z")
                             and int(status(leader).get("Threads", "0")) > 1, 10.0, step=0.01)
        r.check("leader is Z with threads alive", defunct, status(leader).get("State"))
        m = b.nvml_gpus("host")
        leader_nodes = dev_counts(leader)
        live = [t for t in tasks(leader) if t != leader]
        thread_nodes = record_nodes(r, "thread_nodes", leader, minors, tid=live[0]) if live else {}
        context = sorted(int(i) for i, n in thread_nodes.items() if n["maps"] >= CONTEXT_MAPS)
        r.measured.update(leader_nodes=leader_nodes, named_on=named_on(m, leader), context_gpus=context,
                          mib=[listed_mib(m[0], leader), listed_mib(m[1], leader)])
        r.check("leader's own tables name no node", not leader_nodes, leader_nodes)
        r.check("NVML names the leader on GPU 1 with the memory",
                (listed_mib(m[1], leader) or 0) >= b.held_fraction * b.alloc_mib, m[1]["proc_mib"])
        r.check("on exactly the GPUs its live thread maps %d times" % CONTEXT_MAPS,
                named_on(m, leader) == context and 1 in context, "named %s, context %s" % (named_on(m, leader), context))
        if b.torch_stray:
            r.check("PyTorch's bare context on GPU 0", is_bare(listed_mib(m[0], leader)), m[0]["proc_mib"])
    finally:
        b.stop(w)


def row16(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("stray_context", pidns=True, gpus=[1], visible=None)
    try:
        pid = role(w, "holder")
        ns_pid = nspids(pid)[-1]
        host = b.nvml_gpus("host")
        inside = b.nvml_gpus("same", pid)
        r.measured.update(host_pid=pid, ns_pid=ns_pid, host_view=dict((str(i), g["proc_mib"]) for i, g in host.items()),
                          inside_view=dict((str(i), g["proc_mib"]) for i, g in inside.items()))
        r.check("NSpid has two levels", ns_pid != pid, nspids(pid))
        r.check("from the host: the host pid on both GPUs", named_on(host, pid) == [0, 1], named_on(host, pid))
        r.check("from inside: the namespace pid on both GPUs", named_on(inside, ns_pid) == [0, 1],
                named_on(inside, ns_pid))
        r.check("each GPU with its own MiB (GPU 1 the memory, GPU 0 a bare context)",
                (listed_mib(inside[1], ns_pid) or 0) >= b.held_fraction * b.alloc_mib
                and is_bare(listed_mib(inside[0], ns_pid)), r.measured["inside_view"])
    finally:
        b.stop(w)


def row17(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    w = b.start("ipc_consumer", gpus=[0], visible=None)
    try:
        producer, consumer = w.roles.get("producer"), role(w, "consumer")
        if producer is not None:
            m = b.nvml_gpus("host")
            before = {"producer": listed_mib(m[0], producer), "consumer": listed_mib(m[0], consumer)}
            r.measured["before"] = before
            r.check("before: producer with the memory", (before["producer"] or 0) >= b.held_fraction * b.alloc_mib,
                    m[0]["proc_mib"])
            r.check("before: consumer a bare context", is_bare(before["consumer"]), m[0]["proc_mib"])
            r.measured["producer_kill"] = b.kill_wait(producer)
        else:  # the lab's scenario kills and reaps the producer itself: only "after" can be read
            r.measured["before"] = "producer killed by the scenario (%s)" % w.doc.get("dead")
        time.sleep(0.5)  # past any free delay: what stays, stays
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "consumer_nodes", consumer, minors)
        after = {"producer": listed_mib(m[0], producer) if producer else None,
                 "consumer": listed_mib(m[0], consumer), "used_delta": held_delta(b, m, base, 0)}
        r.measured["after"] = after
        r.check("after: GPU 0 lists the consumer alone (the dead producer gone)", m[0]["pids"] == [consumer],
                m[0]["pids"])
        r.check("after: consumer charged with the producer's MiB",
                (after["consumer"] or 0) >= b.held_fraction * b.alloc_mib, m[0]["proc_mib"])
        r.check("memory not freed", after["used_delta"] >= b.held_fraction * b.alloc_mib, m[0]["v2_used_mib"])
        r.check("consumer: %d map lines on GPU 0" % CONTEXT_MAPS, nodes["0"]["maps"] == CONTEXT_MAPS, nodes)
        t = b.kill_timed(consumer, 0, base[0]["v2_used_mib"])
        r.measured["consumer_kill"] = t
        r.check("SIGKILL to the consumer frees it", t["kill_to_free_ms"] is not None, t)
    finally:
        b.stop(w)


def row18(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    w = b.start("monitor", visible=None)
    try:
        pid = role(w, "monitor")
        m = b.nvml_gpus("host")
        counts = dev_counts(pid)
        nodes = record_nodes(r, "nodes", pid, minors)
        r.measured.update(named_on=named_on(m, pid), devs=counts)
        r.check("not listed by NVML", not named_on(m, pid), named_on(m, pid))
        r.check("fds on both GPU nodes", all(n["fds"] > 0 for n in nodes.values()), nodes)
        r.check("no mapping of any NVIDIA node", all(c["maps"] == 0 for c in counts.values()), counts)
    finally:
        b.stop(w)


def row19(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    w = b.start("tp_nccl", gpus=[0, 1], visible=None)
    try:
        rank0, rank1 = tp_ranks(w)
        m = b.nvml_gpus("host")
        rank0_mib = listed_mib(m[0], rank0)
        before = record_nodes(r, "rank0_nodes_before", rank0, minors)
        t = b.kill_timed(rank1, 1, base[1]["v2_used_mib"], timeout=1.0)  # the residue never frees: stop early
        r.measured["rank1_kill"] = t
        time.sleep(0.5)  # past the free delay
        m = b.nvml_gpus("host")
        residue = held_delta(b, m, base, 1)
        r.measured.update(residue_mib=residue, gpu1_pids=m[1]["pids"], rank0_mib_before=rank0_mib,
                          rank0_mib_after=listed_mib(m[0], rank0))
        r.check("rank 1 reaped", t["kill_to_reaped_ms"] is not None, t)
        r.check("GPU 1: residue used (0 < MiB < 1024), rank 1's own memory back", 0 < residue < 1024,
                "%.0f MiB" % residue)
        r.check("GPU 1: no process listed", not m[1]["pids"], m[1]["pids"])
        r.check("GPU 0: rank 0 unchanged", rank0_mib is not None and listed_mib(m[0], rank0) == rank0_mib,
                "%s -> %s" % (rank0_mib, listed_mib(m[0], rank0)))
        time.sleep(b.args.residue_wait)
        after = record_nodes(r, "rank0_nodes_after", rank0, minors)
        m = b.nvml_gpus("host")
        r.measured["residue_mib_later"] = held_delta(b, m, base, 1)
        r.check("rank 0 alive %g s later" % b.args.residue_wait, state_letter(rank0) not in (None, "Z"),
                state_letter(rank0))
        r.check("residue still there", held_delta(b, m, base, 1) > 0, m[1]["v2_used_mib"])
        r.check("rank 0 maps GPU 1 %d times, before and after: no mapping shows the residue" % VISIBLE_MAPS,
                before["1"]["maps"] == VISIBLE_MAPS and after["1"]["maps"] == VISIBLE_MAPS, [before, after])
        t0 = b.kill_timed(rank0, 1, base[1]["v2_used_mib"])
        r.measured["rank0_kill"] = t0
        r.check("GPU 1 free once the whole job stopped", t0["kill_to_free_ms"] is not None, t0)
    finally:
        b.stop(w)


def row20(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    base = b.wait_idle_all()
    if b.name == "cuda":
        w = b.start("bare_context", gpus=[0], visible=None)
    else:  # the lab's bare context: the stray one of stray_context
        w = b.start("stray_context", gpus=[1], visible=None)
    try:
        pid = role(w, "holder")
        m = b.nvml_gpus("host")
        nodes = record_nodes(r, "nodes", pid, minors)
        mib = listed_mib(m[0], pid)
        r.measured.update(bare_mib=mib, v2_used_delta_mib=held_delta(b, m, base, 0))
        r.check("a bare context: %g-%g MiB (518-612 on the H200)" % BARE_MIB, is_bare(mib), m[0]["proc_mib"])
        r.check("%d map lines on its GPU" % CONTEXT_MAPS, nodes["0"]["maps"] == CONTEXT_MAPS, nodes)
    finally:
        b.stop(w)


def row21(b, r):
    minors = two_gpus(b, r)
    if not minors:
        return
    b.wait_idle_all()
    flags = ["--bystander", "--bystander-gib", "1"]
    w = b.start("tp_nccl", gpus=[0, 1], visible=None, flags=flags)
    other = None
    try:
        rank0, rank1 = tp_ranks(w)
        parent = w.roles.get("parent")
        if "bystander" in w.roles:
            bystander, beside = w.roles["bystander"], True
        else:  # the lab: an unrelated holder started on its own
            other = b.start("plain", gpus=[0], visible=None)
            bystander, beside = role(other, "holder"), False
        links = tcp_links(rank0, rank1)
        stray = dict(("%s-%s" % (a, c), tcp_links(x, y)) for a, x in (("bystander", bystander), ("parent", parent))
                     for c, y in (("rank0", rank0), ("rank1", rank1)) if x)
        shared_shm = sorted(shm_maps(rank0) & shm_maps(rank1))
        family = dict((name, ids(pid)) for name, pid in (("rank0", rank0), ("rank1", rank1), ("bystander", bystander)))
        r.measured.update(links=links, link_count=len(links), other_links=stray, shared_shm=shared_shm,
                          ids=family, bystander_beside_ranks=beside)
        r.check(">= 1 established TCP link rank 0 <-> rank 1", len(links) >= 1, links)
        r.check("none with the unrelated holder or the launcher", not any(stray.values()), stray)
        r.check("no shared /dev/shm mapping", not shared_shm, shared_shm)
        r.check("MASTER_PORT not in the ranks' environ", not any(
            b"MASTER_PORT" in (read_text("/proc/%d/environ" % p) or "").encode() for p in (rank0, rank1)))
        r.check("ranks share process group, session and parent", family["rank0"] == family["rank1"], family)
        if beside:
            r.check("and so does the unrelated holder", family["bystander"] == family["rank0"], family)
    finally:
        if other:
            b.stop(other)
        b.stop(w)


def row29(b, r):
    env = b.host_nvml_env() if b.name == "lab" else b.env()
    gpus = json.loads(run_cmd([sys.executable, "-c", NVML_QUERY, "health"], 60, env=env).stdout.strip().splitlines()[-1])
    r.measured["gpus"] = gpus
    for g in gpus:
        pages, rows, ecc, action = g["retired_pages_pending"], g["remapped_rows"], g["ecc_mode"], g["recovery_action"]
        r.check("GPU %d: page retirement Not Supported or nothing pending" % g["index"],
                (isinstance(pages, dict) and pages.get("code") == 3) or pages == 0, pages)
        r.check("GPU %d: no row remap pending or failed" % g["index"],
                isinstance(rows, list) and len(rows) == 4 and rows[2] == 0 and rows[3] == 0, rows)
        r.check("GPU %d: ECC mode current == pending" % g["index"], isinstance(ecc, list) and ecc[0] == ecc[1], ecc)
        r.check("GPU %d: recovery action (field 230) answered, 0" % g["index"],
                isinstance(action, dict) and action.get("ret") == 0 and action.get("value") == 0, action)


ROW_FUNCS = {1: row1, 2: row2, 3: row3, 4: row4, 5: row5, 6: row6, 7: row7, 8: row8, 9: row9, 10: row10,
             11: row11, 12: row12, 13: row13, 14: row14, 15: row15, 16: row16, 17: row17, 18: row18, 19: row19,
             20: row20, 21: row21, 29: row29}


# ---------------------------------------------------------------- main

def summary(r):
    keys = {
        1: ["floor_mib", "v1_used_mib", "v2_used_mib", "reserved_mib"],
        2: ["runs"],
        3: ["kill_to_zombie_ms", "v2_used_mib", "child_state"],
        4: ["leader_state", "threads", "v2_used_mib", "kill_to_reaped_ms"],
        5: ["v2_used_mib", "nvml_pids", "child_kill"],
        6: ["map_lines", "fuser_access", "kill_to_reaped_ms"],
        7: ["nspid", "host_view", "same_ns_view", "other_ns_view", "other_ns_v2_used_mib"],
        8: ["monitor_fd_devs", "monitor_map_lines", "monitor_fuser_access", "holder_fuser_access"],
        9: ["nodes", "gpu0_mib", "gpu1_pids", "kill_to_reaped_ms", "kill_to_free_ms"],
        10: ["nodes", "named_on", "gpu1_mib"],
        11: ["rank0_nodes", "rank1_nodes", "rank0_mib", "rank1_mib"],
        12: ["nodes", "mib"],
        13: ["nodes", "gpu1_mib", "gpu0_mib"],
        14: ["child_nodes", "gpu0_pids", "gpu1_pids"],
        15: ["thread_nodes", "named_on", "context_gpus", "mib"],
        16: ["host_pid", "ns_pid", "host_view", "inside_view"],
        17: ["before", "after", "consumer_nodes"],
        18: ["nodes", "named_on"],
        19: ["residue_mib", "residue_mib_later", "gpu1_pids", "rank1_kill", "rank0_nodes_after"],
        20: ["bare_mib", "v2_used_delta_mib", "nodes"],
        21: ["link_count", "links", "other_links", "shared_shm"],
        29: ["gpus"],
    }.get(r.number, [])
    if r.status == "SKIP":
        return r.skipped
    parts = []
    for k in keys:
        if k not in r.measured:
            continue
        v = r.measured[k]
        if k == "runs":
            v = ", ".join("%g GiB %.0f ms" % (x["gib"], x["kill_to_reaped_ms"]) for x in v)
        elif k == "child_kill":
            v = "%.0f ms" % v["kill_to_reaped_ms"]
        elif k.endswith("nodes"):
            v = " ".join("%s:%s/%s" % (i, n["fds"], n["maps"]) for i, n in sorted(v.items()))
        parts.append("%s=%s" % (k, v))
    bad = [c["name"] + " (" + c["detail"][:120] + ")" for c in r.checks if not c["ok"]]
    if r.error:
        bad.append("error: " + r.error.strip().splitlines()[-1][:300])
    return "; ".join(parts) + ("  FAILED: " + "; ".join(bad) if bad else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["lab", "cuda"], required=True)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--rows", default="1-21,29", help="rows to run: '1-21,29', '9-21', '2,4'")
    p.add_argument("--residue-wait", type=float, default=3.0, help="row 19: seconds rank 0 must outlive rank 1")
    p.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    p.add_argument("--deadline", type=int, default=360, help="seconds for the whole run, then clean up and FAIL")
    p.add_argument("--log-dir", help="workload logs (default: beside --json, else a temp folder)")
    g = p.add_argument_group("cuda")
    g.add_argument("--gib", type=float, default=4.0, help="GiB per holder (cuda)")
    g.add_argument("--row2-gib", default="", help="sizes for row 2, comma separated (default: --gib)")
    g.add_argument("--index", type=int, default=0, help="NVML index of the GPU (cuda)")
    g.add_argument("--ready-timeout", type=float, default=120.0, help="seconds for a holder to allocate")
    p.add_argument("--grace-ms", type=float, default=250.0,
                   help="'freed at once' may lag this much (a concurrent /proc reader delays the release)")
    g.add_argument("--tolerance-mib", type=float, default=32.0, help="'back at the floor' slack (cuda)")
    g.add_argument("--allocator", choices=["torch", "lab"], default="torch",
                   help="lab: holders make fake-driver contexts, not CUDA ones (rehearsal without a GPU; "
                        "run with the stand-in library on LD_LIBRARY_PATH and NVIDIA_LAB_SOCKET set)")
    g.add_argument("--hold-s", type=float, default=0.0, help=argparse.SUPPRESS)  # test hook: pause after a start
    g.add_argument("--dev-dir", default="/dev", help="where the device nodes are (rehearsal: the lab node's dev)")
    g = p.add_argument_group("lab")
    g.add_argument("--mib", type=int, default=4096, help="MiB per holder (lab)")
    g.add_argument("--lab-id", default=os.environ.get("GPU_FACTS_LAB_ID", "facts"), help="LAB_ID of the lab run")
    g.add_argument("--lab-nvml-pids", choices=["modern", "legacy"], default="modern",
                   help="legacy: host pids everywhere (an old driver); row 7 must then FAIL")
    args = p.parse_args(argv)
    args.row_list = parse_rows(args.rows)
    args.row2_gib = [float(x) for x in args.row2_gib.split(",") if x.strip()] or [args.gib]
    return args


def parse_rows(text):
    rows = set()
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            rows.update(range(int(lo), int(hi) + 1))
        elif part:
            rows.add(int(part))
    bad = rows - set(ROWS)
    if bad:
        raise SystemExit("unknown rows: %s" % sorted(bad))
    return sorted(rows)


def dry_run(args, backend):
    if backend.name == "cuda":
        backend.minor = "N"
    print("plan: backend %s, rows %s, deadline %d s" % (backend.name, args.row_list, args.deadline))
    if backend.name == "cuda":
        print("  holders: %s GiB on NVML index %d (row 2 sizes %s), pynvml here; subreaper; lifeline pipe"
              % (args.gib, args.index, args.row2_gib))
    for n in args.row_list:
        print("row %d: %s" % (n, ROWS[n]))
        for step in PLAN[n]:
            print("    - " + step)
        for cmd in backend.plan(n):
            print("    $ " + cmd)
    print("  finally: SIGKILL every process this run started, reap, %s" %
          ("close the lifeline" if backend.name == "cuda" else "labctl down"))
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.log_dir is None:
        args.log_dir = (os.path.join(os.path.dirname(os.path.abspath(args.json)), "facts-logs-" + args.backend)
                        if args.json else "/tmp/gpu-facts-logs-%d" % os.getpid())
    backend = CudaBackend(args) if args.backend == "cuda" else LabBackend(args)
    if args.dry_run:
        return dry_run(args, backend)

    def on_alarm(_signum, _frame):
        raise Deadline("deadline of %d s reached" % args.deadline)

    def on_stop(signum, _frame):
        raise Stop("signal %d" % signum)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.alarm(args.deadline)
    doc = {"backend": args.backend, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname(), "kernel": platform.release(), "python": platform.python_version(),
           "argv": [os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]),
           "settings": {"gib": args.gib, "row2_gib": args.row2_gib, "mib": args.mib, "index": args.index,
                        "allocator": args.allocator, "dev_dir": args.dev_dir,
                        "lab_nvml_pids": args.lab_nvml_pids, "tolerance_mib": args.tolerance_mib,
                        "grace_ms": args.grace_ms},
           "rows": [], "ok": False}
    rows = [Row(n) for n in args.row_list]
    aborted = None
    t_start = time.monotonic()
    try:
        backend.setup()
        doc.update(backend.info())
        print("gpu-facts: backend %s, %s, driver %s, %s" % (
            args.backend, doc.get("gpu_name"), doc.get("driver_version"), doc["date"]), flush=True)
        for r in rows:
            t0 = time.monotonic()
            try:
                ROW_FUNCS[r.number](backend, r)
            except Exception:
                r.error = traceback.format_exc()
            finally:
                r.seconds = time.monotonic() - t0
            print("row %d %s %s: %s" % (r.number, r.status, r.title, summary(r)), flush=True)
    except (Deadline, Stop) as exc:
        aborted = str(exc)
    except Exception:
        aborted = traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            backend.teardown()
        except Exception:
            aborted = (aborted or "") + "\nteardown: " + traceback.format_exc()
    for r in rows:
        if not r.checks and r.error is None and not r.skipped:
            r.error = "not run: %s" % (aborted or "?").strip().splitlines()[-1]
    doc["rows"] = [r.to_json() for r in rows]
    doc["aborted"] = aborted
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    doc["ok"] = aborted is None and all(r.status != "FAIL" for r in rows)
    if aborted:
        print("gpu-facts: aborted: %s" % aborted.strip(), file=sys.stderr)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    passed = sum(r.status == "PASS" for r in rows)
    skipped = sum(r.status == "SKIP" for r in rows)
    print("gpu-facts: %d/%d rows PASS%s in %.1f s%s" % (passed, len(rows), ", %d SKIP" % skipped if skipped else "",
                                                        doc["seconds"], (" -> " + args.json) if args.json else ""))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
