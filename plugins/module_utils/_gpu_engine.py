# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who holds each GPU, and why its memory is not free (private helper).

Joins NVML's view (memory, process list) with the /proc scan. Knows nothing
of AnsibleModule, so it can later run on a Proxmox node against host pids.
"""

from __future__ import annotations

import os
import pwd
import sys

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import (
    HAS_PYNVML, PYNVML_IMPORT_ERROR, Nvml, NvmlFailure,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._redact import compile_patterns, redact_argv
from ansible_collections.gpuops.fleet.plugins.module_utils._release import HAS_PSUTIL, PSUTIL_IMPORT_ERROR
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import resolve_gpus

# argument_spec shared by gpu_status and gpu_release (documented in doc_fragments/_gpu.py)
GPU_COMMON_ARGS = dict(
    gpus=dict(type="list", elements="str", default=[]),
    threshold_mib=dict(type="int", default=64),
    nvml_timeout=dict(type="float", default=5.0),
    redact=dict(type="list", elements="str", default=[], no_log=False),
    cmdline=dict(type="bool", default=True),
)

# Never signalled, whatever holds what (names as in comm, argv[0] or exe).
PROTECTED_NAMES = ("nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "dcgm-exporter",
                   "sshd", "lxc-attach", "pct")

INIT_PID_NS_INODE = 0xEFFFFFFC  # the host's (initial) PID namespace


def missing_lib_message(package, import_name):
    """One line naming the package and how to install it."""
    return ("The Python library %s (import %s) is missing for %s on this host: install it with "
            "'%s -m pip install %s' (or run the gpuops.fleet.release_gpus role, which installs it)"
            % (package, import_name, sys.executable or "python3", sys.executable or "python3", package))


def check_common_params(module):
    """Fail the task on a bad GPU_COMMON_ARGS value; returns the compiled redact patterns."""
    params = module.params
    if params["threshold_mib"] < 0:
        module.fail_json(msg="threshold_mib must be 0 or more, got %s" % params["threshold_mib"])
    if params["nvml_timeout"] <= 0:
        module.fail_json(msg="nvml_timeout must be more than 0, got %s" % params["nvml_timeout"])
    try:
        patterns = compile_patterns(params["redact"])
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    return patterns


def check_libraries(module):
    """Fail the task, in one line, when psutil or nvidia-ml-py is missing on the target."""
    if not HAS_PSUTIL:
        module.fail_json(msg=missing_lib_message("psutil", "psutil"), exception=repr(PSUTIL_IMPORT_ERROR))
    if not HAS_PYNVML:
        module.fail_json(msg=missing_lib_message("nvidia-ml-py", "pynvml"), exception=repr(PYNVML_IMPORT_ERROR))


def engine_from_params(params, patterns):
    """An Engine over a new Nvml, set up from GPU_COMMON_ARGS (not started)."""
    return Engine(Nvml(timeout=params["nvml_timeout"]), redact_patterns=patterns, with_cmdline=params["cmdline"],
                  threshold_mib=params["threshold_mib"])


def fmt_mib(mib):
    if mib is None:
        return "an unknown amount"
    if mib >= 1024:
        return "%.1f GiB" % (mib / 1024.0)
    return "%d MiB" % mib


def in_container(proc_root="/proc"):
    """True when this process runs in a child PID namespace (a container)."""
    try:
        return os.stat("%s/self/ns/pid" % proc_root).st_ino != INIT_PID_NS_INODE
    except OSError:
        return False


def _clock_ticks():
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _boot_time(proc_root):
    try:
        for line in procscan.read_text("%s/stat" % proc_root).splitlines():
            if line.startswith("btime "):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _user(uid):
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _names_of(pid, comm, argv, proc_root):
    names = set()
    if comm:
        names.add(comm)
    if argv:
        names.add(os.path.basename(argv[0].split(" ")[0].rstrip(":")))
    try:
        names.add(os.path.basename(os.readlink("%s/%d/exe" % (proc_root, pid))))
    except OSError:
        pass
    names.discard("")
    return sorted(names)


def protected_name(names):
    """The protected name this process goes by, or None (comm is cut at 15 characters)."""
    for protected in PROTECTED_NAMES:
        for name in names:
            if name == protected or name == protected[:15]:
                return protected
    return None


class Engine(object):
    """One view of the GPUs of this machine, from NVML and /proc."""

    def __init__(self, nvml, proc_root="/proc", dev_dir="/dev", redact_patterns=(), with_cmdline=True,
                 threshold_mib=64, self_pid=None):
        self.nvml = nvml
        self.proc_root = proc_root
        self.devices = procscan.DeviceNames(dev_dir)
        self.redact_patterns = list(redact_patterns)
        self.with_cmdline = with_cmdline
        self.threshold_mib = threshold_mib
        self.self_pid = os.getpid() if self_pid is None else self_pid
        self.gpus = []
        self.driver_version = None
        self.in_container = in_container(proc_root)
        self._ticks = _clock_ticks()
        self._btime = _boot_time(proc_root)

    # -- setup
    def start(self):
        """nvmlInit and list the GPUs (raises NvmlFailure when NVML itself is unusable)."""
        self.nvml.init()
        self.driver_version = self.nvml.driver_version()
        self.gpus = self.nvml.list_gpus()
        return self.gpus

    def select(self, selectors):
        return resolve_gpus(selectors, self.gpus)

    def gpu(self, index):
        for gpu in self.gpus:
            if gpu["index"] == index:
                return gpu
        return None

    def minor_to_index(self):
        return dict((g["minor"], g["index"]) for g in self.gpus if g.get("minor") is not None)

    # -- pieces
    def own_tree_skip(self):
        """This process and its ancestors; pid 1 stays visible (reported, never signalled)."""
        return set([self.self_pid] + [p for p in procscan.ancestors(self.self_pid, self.proc_root) if p != 1])

    def scan(self):
        """Scan /proc, leaving out this process, its ancestors and its children."""
        skip = self.own_tree_skip()
        result = procscan.scan(self.proc_root, self.devices, skip)
        cache = {}
        for pid in list(result.entries):
            if procscan.is_descendant(pid, self.self_pid, self.proc_root, cache):
                del result.entries[pid]
        result.zombies = [z for z in result.zombies
                          if z["pid"] not in skip and not procscan.is_descendant(z["pid"], self.self_pid, self.proc_root, cache)]
        return result

    def memory(self, index):
        """Memory of one GPU, or {'error': ...}."""
        try:
            mem = self.nvml.memory(index)
        except NvmlFailure as exc:
            return {"error": exc.message, "error_kind": exc.kind}
        return mem

    def is_free(self, mem):
        return "error" not in mem and mem.get("used_mib") is not None and mem["used_mib"] <= self.threshold_mib

    def create_time(self, starttime):
        if starttime is None or self._btime is None:
            return None
        return round(self._btime + starttime / float(self._ticks), 2)

    def cmdline_of(self, entry):
        argv = []
        for tid_path in ("%s/%d/cmdline" % (self.proc_root, entry.pid),
                         "%s/%d/task/%d/cmdline" % (self.proc_root, entry.pid, entry.table_tid)):
            try:
                raw = procscan.read_bytes(tid_path)
            except OSError:
                continue
            argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
            if argv:
                break
        return argv

    def details(self, entry, minor_index, nvml_named):
        """The per-process record gpu_status returns."""
        pid = entry.pid
        status = {}
        try:
            status = procscan.parse_status(procscan.read_text("%s/%d/status" % (self.proc_root, pid)))
        except OSError:
            pass
        counts, blocked = procscan.thread_details(pid, self.proc_root)
        argv = self.cmdline_of(entry)
        parent = procscan.read_stat(entry.ppid, self.proc_root) if entry.ppid else None
        cgroup = None
        try:
            cgroup = procscan.parse_cgroup(procscan.read_text("%s/%d/cgroup" % (self.proc_root, pid)))
        except OSError:
            pass
        gpu_minors = sorted(set(c[1] for c in (self.devices.classify(p) for p in entry.map_devices) if c and c[0] == "gpu"))
        fd_minors = sorted(set(c[1] for c in (self.devices.classify(p) for p in entry.fd_devices) if c and c[0] == "gpu"))
        gpus = sorted(set(minor_index[m] for m in gpu_minors if m in minor_index))
        live = sum(n for s, n in counts.items() if s not in ("Z", "X"))
        names = _names_of(pid, entry.comm, argv, self.proc_root)
        record = {
            "pid": pid,
            "ppid": entry.ppid,
            "name": status.get("name") or entry.comm,
            "user": _user(status.get("uid")),
            "create_time": self.create_time(entry.starttime),
            "starttime_ticks": entry.starttime,
            "state": entry.state,
            "thread_count": entry.num_threads,
            "thread_states": counts,
            "defunct_leader": entry.defunct_leader,
            "live_threads": live if entry.defunct_leader else None,
            "blocked_threads": blocked,
            "holder": entry.is_holder,
            "via": list(entry.via),
            "fd_devices": list(entry.fd_devices),
            "mapped_devices": list(entry.map_devices),
            "gpu_minors": gpu_minors,
            "fd_gpu_minors": fd_minors,
            "gpus": gpus,
            "unattributed": entry.is_holder and not gpu_minors,
            "nvml_named_on": sorted(nvml_named.get(pid, ())),
            "nspid": status.get("nspid"),
            "cgroup": cgroup,
            "parent_name": parent["comm"] if parent else None,
            "names": names,
            "protected_name": protected_name(names),
            "cmdline": redact_argv(argv, self.redact_patterns) if (self.with_cmdline and argv) else None,
        }
        record["_argv"] = argv  # for `match`/`protect`, never returned
        return record

    # -- the whole picture
    def snapshot(self, targets):
        """Report for the targeted GPU indexes (every field gpu_status returns)."""
        scan = self.scan()
        minor_index = self.minor_to_index()
        gpu_reports = []
        nvml_named = {}
        nvml_lists = {}
        for index in targets:
            gpu = self.gpu(index) or {"index": index}
            if gpu.get("error"):
                nvml_lists[index] = None
                continue
            try:
                nvml_lists[index] = self.nvml.processes(index)
            except NvmlFailure:
                nvml_lists[index] = None
                continue
            for proc in nvml_lists[index]:
                nvml_named.setdefault(proc["pid"], set()).add(index)
        records = {}
        for pid, entry in scan.entries.items():
            records[pid] = self.details(entry, minor_index, nvml_named)
        holders = [r for r in records.values() if r["holder"]]
        clients = [r for r in records.values() if not r["holder"]]
        for index in targets:
            gpu_reports.append(self._gpu_report(index, holders, clients, nvml_lists.get(index), records))
        report = Report(self, targets, gpu_reports, holders, clients, scan)
        report.diagnosis = diagnose(report)
        return report

    def _gpu_report(self, index, holders, clients, nvml_list, records):
        gpu = self.gpu(index) or {"index": index}
        minor = gpu.get("minor")
        out = {
            "index": index,
            "minor": minor,
            "uuid": gpu.get("uuid"),
            "pci_bus_id": gpu.get("pci_bus_id"),
            "name": gpu.get("name"),
        }
        if gpu.get("error"):
            out.update({"memory": None, "free": False, "holders": [], "clients": [], "nvml_processes": [],
                        "unattributed_mib": None, "error": gpu["error"], "error_kind": gpu.get("error_kind")})
            return out
        mem = self.memory(index)
        pinned = [h for h in holders if minor in h["gpu_minors"]]
        named_unattributed = [h for h in holders if h["unattributed"] and index in h["nvml_named_on"]]
        out["holders"] = sorted(h["pid"] for h in pinned + named_unattributed)
        out["clients"] = sorted(c["pid"] for c in clients if minor in c["fd_gpu_minors"])
        if "error" in mem:
            out.update({"memory": None, "free": False, "nvml_processes": [], "unattributed_mib": None,
                        "error": mem["error"], "error_kind": mem["error_kind"]})
            return out
        if nvml_list is None:
            out.update({"memory": mem, "free": False, "nvml_processes": [], "unattributed_mib": None,
                        "error": "NVML could not list the GPU's processes", "error_kind": "error"})
            return out
        out["memory"] = {k: mem[k] for k in ("total_mib", "used_mib", "reserved_mib", "v1_used_mib")}
        if mem.get("api") == "v1":
            out["memory"]["note"] = "this driver has no v2 memory info: used is v1 used, floor included"
        out["free"] = self.is_free(mem)
        procs = []
        listed = 0
        for proc in nvml_list:
            record = records.get(proc["pid"])
            if record is not None and record["holder"]:
                status = "holder"
                note = "holds this GPU here" if (minor in record["gpu_minors"] or record["unattributed"]) else \
                    "is a holder here, of another GPU"
            elif record is not None:
                status = "client"
                note = "only has device files open here (an NVML client), no context"
            elif procscan.read_stat(proc["pid"], self.proc_root) is not None:
                status = "not_holder"
                note = ("exists here but holds no /dev/nvidia* node: the driver may report host pids "
                        "(legacy), or the pid was reused")
            else:
                status = "not_visible"
                note = ("not visible here: the process no longer exists, or it lives outside this PID "
                        "namespace (on the node or in another container)" if self.in_container
                        else "not visible here: the process no longer exists")
            listed += proc["used_mib"] or 0
            procs.append({"pid": proc["pid"], "used_mib": proc["used_mib"], "status": status,
                          "matches_holder": status == "holder", "note": note})
        out["nvml_processes"] = procs
        out["unattributed_mib"] = max(0, (mem["used_mib"] or 0) - listed) if not out["free"] else 0
        out["error"] = None
        return out


class Report(object):
    def __init__(self, engine, targets, gpus, holders, clients, scan):
        self.engine = engine
        self.targets = list(targets)
        self.gpus = gpus
        self.holders = sorted(holders, key=lambda r: r["pid"])
        self.clients = sorted(clients, key=lambda r: r["pid"])
        self.scan = scan
        self.zombies = []
        for zombie in scan.zombies:
            parent = procscan.read_stat(zombie["ppid"], engine.proc_root) if zombie["ppid"] else None
            self.zombies.append({"pid": zombie["pid"], "name": zombie["comm"], "ppid": zombie["ppid"],
                                 "parent_name": parent["comm"] if parent else None, "holds": []})
        self.diagnosis = []

    @property
    def all_free(self):
        return all(g["free"] for g in self.gpus)

    @property
    def errors(self):
        return [g for g in self.gpus if g.get("error")]

    def holder(self, pid):
        for record in self.holders:
            if record["pid"] == pid:
                return record
        return None

    def as_dict(self):
        def clean(record):
            return dict((k, v) for k, v in record.items() if not k.startswith("_"))
        return {
            "gpus": self.gpus,
            "holders": [clean(h) for h in self.holders],
            "clients": [clean(c) for c in self.clients],
            "zombies": self.zombies,
            "holders_unattributed": [h["pid"] for h in self.holders if h["unattributed"]],
            "all_free": self.all_free,
            "driver_version": self.engine.driver_version,
            "in_container": self.engine.in_container,
            "diagnosis": self.diagnosis,
        }


def _pname(record):
    return "pid %d (%s)" % (record["pid"], record["name"])


def _devices_text(paths):
    return ", ".join(paths) if paths else "no device"


def _heir_of_dead_pid(report, record):
    """A holder NVML does not name, on a GPU where NVML names a pid not visible here (row 5)."""
    for gpu in report.gpus:
        if gpu.get("error") or gpu["free"] or record["pid"] not in gpu.get("holders", ()):
            continue
        procs = gpu.get("nvml_processes") or ()
        if record["pid"] not in [p["pid"] for p in procs] and [p for p in procs if p["status"] == "not_visible"]:
            return True
    return False


def diagnose(report):
    """Plain sentences, one per finding, each naming the pid and the remedy."""
    lines = []
    engine = report.engine
    targeted_minors = set(g["minor"] for g in report.gpus if g.get("minor") is not None)
    for gpu in report.gpus:
        if gpu.get("error"):
            lines.append("GPU %s%s: %s; its memory state is unknown, so it is not reported free"
                         % (gpu["index"], " (%s)" % gpu["uuid"] if gpu.get("uuid") else "", gpu["error"]))
    for record in report.holders:
        relevant = record["unattributed"] or targeted_minors.intersection(record["gpu_minors"])
        if not relevant:
            continue
        devs = _devices_text(record["mapped_devices"])
        if record["blocked_threads"]:
            for thread in record["blocked_threads"]:
                stack = ""
                if thread.get("stack"):
                    stack = "; kernel stack: %s" % " <- ".join(thread["stack"][:6])
                lines.append("%s has thread %d in D state (wchan %s) holding %s: it is stuck in the kernel and "
                             "SIGKILL takes effect only when that call returns; a GPU reset is refused while it holds "
                             "the GPU; restarting its container (or the node) frees it%s"
                             % (_pname(record), thread["tid"], thread.get("wchan") or "unknown", devs, stack))
        elif record["defunct_leader"]:
            lines.append("%s is a defunct leader with %d live threads holding %s; SIGKILL to %d frees it; "
                         "fuser does not see it" % (_pname(record), record["live_threads"] or 0, devs, record["pid"]))
        elif record["unattributed"]:
            lines.append("%s maps only %s: it holds a context that cannot be pinned to one GPU (all GPUs, "
                         "unattributed); SIGKILL to %d frees it" % (_pname(record), devs, record["pid"]))
        elif "fd" not in record["via"]:
            lines.append("%s has no /dev/nvidia* file open but maps %s (fuser shows it only with access m); "
                         "SIGKILL to %d frees it" % (_pname(record), devs, record["pid"]))
        elif not _heir_of_dead_pid(report, record):
            used = [p["used_mib"] for g in report.gpus for p in g.get("nvml_processes") or ()
                    if p["pid"] == record["pid"] and p["used_mib"] is not None]
            lines.append("%s holds %s (%s)%s; SIGTERM, then SIGKILL to %d frees it"
                         % (_pname(record), devs, ", ".join(record["via"]),
                            " with %s by NVML" % fmt_mib(sum(used)) if used else "", record["pid"]))
    for gpu in report.gpus:
        if gpu.get("error") or gpu["free"]:
            continue
        label = "GPU %d (minor %s)" % (gpu["index"], gpu["minor"])
        not_visible = [p for p in gpu["nvml_processes"] if p["status"] == "not_visible"]
        named = set(p["pid"] for p in gpu["nvml_processes"])
        unnamed_holders = [report.holder(pid) for pid in gpu["holders"] if pid not in named]
        unnamed_holders = [h for h in unnamed_holders if h is not None and not h["defunct_leader"]]
        where = ("which no longer exists, or lives outside this container's PID namespace"
                 if engine.in_container else "which no longer exists")
        dead_pids = sorted(p["pid"] for p in not_visible)
        for proc in not_visible:
            # pair a dead pid with the holders started after it (child pids follow their parent's)
            later = [p for p in dead_pids if p > proc["pid"]]
            upper = later[0] if later else None
            children = [h for h in unnamed_holders if h["pid"] > proc["pid"] and (upper is None or h["pid"] < upper)]
            children = children or unnamed_holders
            if children:
                parts = []
                for holder in children:
                    how = " and ".join({"fd": "inherited fds", "mmap": "mappings"}.get(v, v) for v in holder["via"])
                    parts.append("%s, probably its forked child, through %s of %s"
                                 % (_pname(holder), how, _devices_text(holder["mapped_devices"] or holder["fd_devices"])))
                lines.append("NVML names pid %d on %s, %s; the memory is held by %s; SIGKILL to %s frees it"
                             % (proc["pid"], label, where, "; and by ".join(parts),
                                ", ".join(str(h["pid"]) for h in children)))
            else:
                lines.append("NVML names pid %d on %s with %s, %s; no process visible here holds the GPU%s"
                             % (proc["pid"], label, fmt_mib(proc["used_mib"]), where,
                                "; look from the node" if engine.in_container else ""))
        for proc in gpu["nvml_processes"]:
            if proc["status"] == "not_holder":
                lines.append("NVML names pid %d on %s, but pid %d here holds no /dev/nvidia* node: the driver "
                             "reports host pids (legacy) or the pid was reused; it is not signalled"
                             % (proc["pid"], label, proc["pid"]))
        if gpu["unattributed_mib"] and not gpu["holders"] and not [h for h in report.holders if h["unattributed"]] \
                and not not_visible:
            lines.append("%s: %s is used by no process visible here; look from the node; if nothing holds it "
                         "there either, only a GPU reset frees it (gpu_release with gpu_reset: true)"
                         % (label, fmt_mib(gpu["unattributed_mib"])))
    for zombie in [z for z in report.zombies if z["ppid"] > 1][:5]:
        lines.append("pid %d (%s) is a zombie holding nothing; its parent %s has not reaped it; it holds no GPU "
                     "memory, and killing or fixing the parent only removes the process-table entry"
                     % (zombie["pid"], zombie["name"],
                        "%d (%s)" % (zombie["ppid"], zombie["parent_name"]) if zombie["parent_name"] else str(zombie["ppid"])))
    for record in report.clients:
        if targeted_minors.intersection(record["fd_gpu_minors"]) or not record["fd_gpu_minors"]:
            lines.append("%s only has %s open and maps none: an NVML client (a monitor or exporter), not a "
                         "holder; it holds no GPU memory and is never signalled"
                         % (_pname(record), _devices_text(record["fd_devices"])))
    if report.scan.unreadable:
        lines.append("%d processes could not be read (%s); a holder among them would not be shown"
                     % (len(report.scan.unreadable), ", ".join(str(p) for p in report.scan.unreadable[:10])))
    return lines
