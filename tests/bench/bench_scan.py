"""Benchmark: the gpu_status holder scan against `fuser` on a busy node, in the same run (issues 3, 20).

On this host, with fake device files in a temporary folder (regular files, as in the lab):
5,000 processes holding about 50 fds each, spread over 8 containers (each its own PID and
mount namespace, as an LXC container's processes are seen from its node), plus 3 holders:
one with fds and mappings, one with mappings only (GPU_FACTS row 6), one defunct leader
whose threads hold the files (row 4, which fuser cannot see). Both tools are timed
alternately; medians are reported. Then the bounded /proc reader alone: every process's
maps read for its device lines directly, and through the reader (one helper, then the
scan's helpers). Prints a Markdown fragment on stdout.
"""
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_engine():
    try:
        from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan
    except ImportError:
        root = tempfile.mkdtemp(prefix="gpuops-bench-")
        os.makedirs(os.path.join(root, "ansible_collections", "gpuops"))
        os.symlink(REPO, os.path.join(root, "ansible_collections", "gpuops", "fleet"))
        sys.path.insert(0, root)
        from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan
    return _procscan


PROCESSES = 5000
CONTAINERS = 8
FDS_EACH = 48          # plus stdin/stdout/stderr: about 50
ROUNDS = int(os.environ.get("BENCH_SCAN_ROUNDS", "7"))

FARM = r"""
import os, signal, sys
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(%d)]
for _ in range(%d):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
sys.stdout.write("ready\n"); sys.stdout.flush()
signal.pause()
"""

HOLDER = r"""
import ctypes, os, sys, threading, time
kind, dev = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fds = [os.open(os.path.join(dev, n), os.O_RDWR) for n in ("nvidiactl", "nvidia0", "nvidia-uvm")]
for fd in fds:
    libc.mmap(None, 4096, 3, 1, fd, 0)
if kind == "mmap_only":
    for fd in fds:
        os.close(fd)
sys.stdout.write("ready\n"); sys.stdout.flush()
if kind == "defunct":
    for _ in range(3):
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    libc.syscall(60, 0)
time.sleep(3600)
"""


def fuser_pids(paths):
    proc = subprocess.run(["fuser"] + paths, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          universal_newlines=True, check=False)
    return set(int("".join(c for c in word if c.isdigit())) for word in proc.stdout.split()
               if any(c.isdigit() for c in word))


def scan_workers(procscan, count):
    return min(len(procscan.READER.lanes), os.cpu_count() or 1) if count > 500 else 1


def reader_rounds(procscan, devices):
    """Medians (s) of reading every process's maps for device lines: directly, through one reader helper,
    and through the scan's helpers (a thread each)."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    marker = devices.marker
    paths = ["/proc/%d/maps" % pid for pid in pids]
    batch = 2 * procscan.BATCH
    lanes = scan_workers(procscan, len(pids))

    def direct():
        for path in paths:
            try:
                data = procscan._direct_read(path)
            except OSError:
                continue
            if marker in data:
                b"\n".join(line for line in data.split(b"\n") if marker in line)

    def through(lane, part):
        for first in range(0, len(part), batch):
            procscan.READER.read_many([(procscan.KEEP_LINES, p, marker) for p in part[first:first + batch]], lane)

    def in_lanes():
        threads = [threading.Thread(target=through, args=(i, paths[i::lanes])) for i in range(lanes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    times = {"direct": [], "one": [], "lanes": []}
    for dummy in range(ROUNDS):
        for key, call in (("direct", direct), ("one", lambda: through(0, paths)), ("lanes", in_lanes)):
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    out = dict((key, statistics.median(value)) for key, value in times.items())
    out.update(count=len(pids), helpers=lanes)
    return out


def main():
    procscan = import_engine()
    dev = tempfile.mkdtemp(prefix="gpuops-bench-dev-")
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        with open(os.path.join(dev, name), "wb") as handle:
            handle.write(b"\0" * 4096)
    paths = [os.path.join(dev, n) for n in ("nvidia0", "nvidiactl", "nvidia-uvm")]
    started = []
    try:
        farms = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                                   FARM % (FDS_EACH, PROCESSES // CONTAINERS - 1)],
                                  stdout=subprocess.PIPE, start_new_session=True) for dummy in range(CONTAINERS)]
        started.extend(farms)
        for farm in farms:
            assert farm.stdout.readline().strip() == b"ready"
        holders = {}
        for kind in ("plain", "mmap_only", "defunct"):
            proc = subprocess.Popen([sys.executable, "-c", HOLDER, kind, dev], stdout=subprocess.PIPE,
                                    start_new_session=True)
            started.append(proc)
            assert proc.stdout.readline().strip() == b"ready"
            holders[kind] = proc.pid
        time.sleep(0.5)
        devices = procscan.DeviceNames(dev)
        scan_times, fuser_times = [], []
        found_scan = found_fuser = None
        for round_no in range(ROUNDS):
            order = ("scan", "fuser") if round_no % 2 == 0 else ("fuser", "scan")
            for tool in order:
                start = time.perf_counter()
                if tool == "scan":
                    result = procscan.scan("/proc", devices)
                    scan_times.append(time.perf_counter() - start)
                    found_scan = set(pid for pid, e in result.entries.items() if e.is_holder)
                    scanned = result.scanned
                else:
                    found_fuser = fuser_pids(paths)
                    fuser_times.append(time.perf_counter() - start)
        scan_med, fuser_med = statistics.median(scan_times), statistics.median(fuser_times)
        reads = reader_rounds(procscan, devices)
        lines = [
            "## Holder scan vs fuser on a busy node (`tests/bench/bench_scan.py`)",
            "",
            "%d processes with about %d fds each in %d containers (each its own PID and mount namespace, seen from "
            "the node), plus 3 holders of fake device files (fd+mmap, mmap only, defunct leader); %d processes "
            "scanned (%d reader helpers, batches of %d processes); %d rounds, tools alternated."
            % (PROCESSES, FDS_EACH + 3, CONTAINERS, scanned, scan_workers(procscan, scanned), procscan.BATCH, ROUNDS),
            "",
            "| tool | median s | min s | max s | finds plain | finds mmap-only | finds defunct leader |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, times, found in (("gpu_status scan (/proc fd + maps)", scan_times, found_scan),
                                   ("fuser (psmisc), same files", fuser_times, found_fuser)):
            lines.append("| %s | %.3f | %.3f | %.3f | %s | %s | %s |" % (
                name, statistics.median(times), min(times), max(times),
                *["yes" if holders[k] in found else "**no**" for k in ("plain", "mmap_only", "defunct")]))
        goal = scan_med <= 1.0 * fuser_med and holders["defunct"] in found_scan
        lines += ["", "Goal (issue 20: scan median at most 1.0x fuser's, and finds the defunct leader fuser misses; "
                  "every maps read and fd table goes through the bounded reader): **%s** (scan/fuser = %.2f)."
                  % ("met" if goal else "not met", scan_med / fuser_med)]
        direct = reads["direct"]
        lines += ["", "The bounded reader alone: every process's maps read for its device lines, %d processes, "
                  "medians of %d rounds." % (reads["count"], ROUNDS), "",
                  "| read | median s | us per process | x direct |", "|---|---|---|---|"]
        for name, key in (("direct, in this process", "direct"), ("bounded reader, one helper, batched", "one"),
                          ("bounded reader, the scan's %d helpers" % reads["helpers"], "lanes")):
            per_process = reads[key] / reads["count"] * 1e6
            lines.append("| %s | %.3f | %.0f | %.2f |" % (name, reads[key], per_process, reads[key] / direct))
        lines += ["", "Goal (issue 20: the reader within 1.2x of a direct read, the bounded wait kept): **%s** with one "
                  "helper (%.2fx), %s with the scan's helpers (%.2fx)." % (
                      "met" if reads["one"] <= 1.2 * direct else "not met", reads["one"] / direct,
                      "met" if reads["lanes"] <= 1.2 * direct else "not met", reads["lanes"] / direct)]
        print("\n".join(lines))
        return 0 if set(holders.values()) <= found_scan else 1
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
