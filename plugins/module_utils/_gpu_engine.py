# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who holds each GPU, and why its memory is not free (private helper).

Joins NVML's view (memory, process list) with the /proc scan, inside a container or on a Proxmox node against host
pids. Knows nothing of AnsibleModule: the options and their checks are the glue's (_params).
"""

from __future__ import annotations

import errno
import os
import pwd
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils._jobs import find_jobs
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml, NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._redact import redact_argv
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import describe_gpus, resolve_gpus

# Never signalled, whatever holds what (names as in comm, argv[0] or exe).
PROTECTED_NAMES = ("nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "dcgm-exporter",
                   "nvidia-cuda-mps-control", "sshd", "lxc-attach", "pct")
MPS_SERVER = "nvidia-cuda-mps-server"
MPS_CONTROL = "nvidia-cuda-mps-control"

INIT_PID_NS_INODE = 0xEFFFFFFC  # the host's (initial) PID namespace


def no_gpu_message(engine, targets):
    """Why there is nothing to look at (no GPU visible, none selected), naming what NVML saw; None when there is."""
    if not engine.gpus:
        return ("NVML sees no GPU here (driver %s, nvmlDeviceGetCount returned 0): no GPU is passed into this host or "
                "container, so no GPU can be reported free" % (engine.driver_version or "unknown"))
    if not targets:
        return "no GPU selected; NVML sees %s" % describe_gpus(engine.gpus)
    return None


def engine_from_params(params, patterns):
    """An Engine over a new Nvml, set up from the options of _params.READ_ARGS (not started)."""
    nvml = Nvml(timeout=params["nvml_timeout"], reserved_floor_mib=params.get("reserved_floor_mib"))
    return Engine(nvml, redact_patterns=patterns, with_cmdline=params["cmdline"],
                  threshold_mib=params["threshold_mib"])


def fmt_bytes(count):
    if count >= 1024 * 1024:
        return fmt_mib(count // (1024 * 1024))
    return "%d KiB" % -(-count // 1024)


def fmt_mib(mib):
    if mib is None:
        return "an unknown amount"
    if mib >= 1024:
        return "%.1f GiB" % (mib / 1024.0)
    return "%d MiB" % mib


def in_container(proc_root="/proc"):
    """True when this process runs in a container.

    pid 1's environment says so (LXC sets container=lxc); a Proxmox node (/etc/pve, pct) is
    none; else a child PID namespace counts as one.
    """
    said = node.init_environ_has_container(proc_root)
    if said:
        return True
    if proc_root == "/proc" and node.on_proxmox_node():
        return False
    try:
        return os.stat("%s/self/ns/pid" % proc_root).st_ino != INIT_PID_NS_INODE
    except OSError:
        return False


def view_of(proc_root="/proc"):
    """container (inside one), node (a Proxmox node: every container's processes) or host (any other machine)."""
    if in_container(proc_root):
        return "container"
    return "node" if proc_root == "/proc" and node.on_proxmox_node() else "host"


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
    """The protected name this process goes by, or None. comm is cut at 15 characters, so a 15-character name
    matches unless a full name (argv[0], exe) with the same start says otherwise: the MPS server's comm is the
    control daemon's too (nvidia-cuda-mps)."""
    full = [n for n in names if len(n) > 15]
    for protected in PROTECTED_NAMES:
        for name in names:
            if name == protected:
                return protected
            if name == protected[:15] and not [f for f in full if f[:15] == name and f != protected]:
                return protected
    return None


def mps_role(names):
    """control (the MPS control daemon), server (an MPS server), or None, by full name (argv[0] or exe)."""
    if MPS_CONTROL in names:
        return "control"
    if MPS_SERVER in names:
        return "server"
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
        self.view = view_of(proc_root)
        self.in_container = self.view == "container"
        self._ticks = _clock_ticks()
        self._btime = _boot_time(proc_root)
        self._minor_cache, self._folders = {}, {}   # per snapshot: GPU minors by (root, path); device folders read
        self._devs_of = {}       # vmid -> dev_minors of its /dev, read once
        self.shm_prefixes = None  # (prefix, stack) pairs: read /dev/shm for residue (gpu_status); None: not read
        self.shm_dir = "/dev/shm"
        self.node_root = "/"      # the root this host's shm_dir is walked from (a container's: /proc/INIT/root)
        self.shm_since = None     # epoch: residue must be older than this too (a release's start)
        self.deadline = None      # monotonic, set by the releaser: reads through another root and MPS asks end by it
        self._unknown_minors = set()
        self.rank_deaths = {}   # set by the releaser: {index: [{"pid", "mib", "survivors"}]} seen this run
        self.generation = None  # NVML's generation when the GPUs were listed
        self.mps_silent = {}      # control daemon pid -> how it did not answer in time: not asked again

    # -- setup
    def start(self):
        """nvmlInit and list the GPUs (raises NvmlFailure when NVML itself is unusable)."""
        self.nvml.init()
        self.driver_version = self.nvml.driver_version()
        return self.relist()

    def relist(self):
        """List the GPUs again (after an NVML re-init: a reset, a new helper); GPUs stay known by UUID."""
        self.gpus = self.nvml.list_gpus()
        self.generation = self.nvml.generation
        return self.gpus

    def stale_listing(self):
        """True when NVML was opened again since the GPUs were listed: an index may name another GPU now."""
        return self.generation != self.nvml.generation

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

    def scan(self, places=None):
        """Scan /proc, leaving out this process and its children (its ancestors are scanned, never signalled);
        with places (shm_places), the shared-memory files each process uses there too."""
        skip = set([self.self_pid])
        devs = None if places is None else set(p["dev"] for p in places.values() if p["dev"] is not None)
        result = procscan.scan(self.proc_root, self.devices, skip, cgroups=self.view == "node", shm=devs)
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
        """(argv, truncated): its first ARGS_CAP bytes, and whether it had more."""
        for tid_path in ("%s/%d/cmdline" % (self.proc_root, entry.pid),
                         "%s/%d/task/%d/cmdline" % (self.proc_root, entry.pid, entry.table_tid)):
            try:
                raw = procscan.read_bytes(tid_path)
            except OSError:
                continue
            argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
            if argv:
                return argv, procscan.is_truncated(raw)
        return [], False

    def details(self, entry, minor_index, table=None):
        """The per-process record gpu_status returns (pinning fields are set later); table: the scan that
        read the entry, whose cgroups are used (None: read the cgroup now)."""
        pid = entry.pid
        status = {}
        try:
            status = procscan.parse_status(procscan.read_text("%s/%d/status" % (self.proc_root, pid)))
        except OSError:
            pass
        counts, blocked = procscan.thread_details(pid, self.proc_root)
        argv, cut = self.cmdline_of(entry)
        parent = procscan.read_stat(entry.ppid, self.proc_root) if entry.ppid else None
        cgroup = table.cgroups[pid] if table is not None and pid in table.cgroups else procscan.read_cgroup(pid, self.proc_root)
        root = "%s/%d/root" % (self.proc_root, entry.table_tid if entry.defunct_leader else pid)
        map_lines = {}
        for path, lines in entry.map_counts.items():
            minor = self._minor(path, root)
            if minor is not None:
                map_lines[minor] = map_lines.get(minor, 0) + lines
        fd_minors = sorted(set(m for m in (self._minor(p, root) for p in entry.fd_devices) if m is not None))
        gpu_minors = sorted(map_lines)
        maps_gpus = sorted(minor_index[m] for m in gpu_minors if m in minor_index)
        context_gpus = sorted(minor_index[m] for m, n in map_lines.items()
                              if m in minor_index and n >= pinning.CONTEXT_MAP_LINES)
        # a context on a GPU NVML cannot describe: that GPU keeps its place, by its minor
        unknown_gpus = sorted(m for m, n in map_lines.items()
                              if (m not in minor_index or m in self._unknown_minors) and n >= pinning.CONTEXT_MAP_LINES)
        live = sum(n for s, n in counts.items() if s not in ("Z", "X"))
        names = _names_of(pid, entry.comm, argv, self.proc_root)
        record = {
            "pid": pid,
            "ppid": entry.ppid,
            "pgrp": entry.pgrp,
            "session": entry.session,
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
            "map_lines": dict((str(minor_index.get(m, "minor%d" % m)), n) for m, n in sorted(map_lines.items())),
            "maps_gpus": maps_gpus,
            "context_gpus": context_gpus,
            "unknown_gpus": unknown_gpus,
            "unknown_mapped": sorted(m for m in gpu_minors if m not in minor_index or m in self._unknown_minors),
            "gpus": [],
            "evidence": [],
            "ambiguous_gpus": [],
            "shares_mib": {},
            "heir_of": [],
            "job": None,
            "unattributed": False,
            "nvml_named_on": [],
            "mps_client_on": [],
            "mps_role": mps_role(names),
            "nspid": status.get("nspid"),
            "cgroup": cgroup,
            "container": None if self.in_container else node.where_of_cgroup(cgroup),   # unread: None, never host
            "container_pid": None if self.in_container else node.pid_in_container(status.get("nspid")),
            "parent_name": parent["comm"] if parent else None,
            "names": names,
            "protected_name": protected_name(names),
            "cmdline": redact_argv(argv, self.redact_patterns) if (self.with_cmdline and argv) else None,
            "truncated": ["cmdline"] if cut else [],
        }
        record["_argv"] = argv  # for `match`/`protect`, never returned
        record["_sockets"] = list(entry.sockets)
        return record

    def _minor(self, path, root):
        key = (root, path)
        if key not in self._minor_cache:
            self._minor_cache[key] = procscan.gpu_minor(path, self.devices, root, self._folders, self.read_timeout())
        return self._minor_cache[key]

    def _nvml_status(self, pid, records, own_tree):
        """How a pid NVML names compares with /proc: holder, client, own_tree, not_holder or not_visible."""
        record = records.get(pid)
        if record is not None:
            return "holder" if record["holder"] else "client"
        stat = procscan.read_stat(pid, self.proc_root)
        if stat is None or (stat["state"] in ("Z", "X") and stat["num_threads"] <= 1):
            return "not_visible"
        if pid in own_tree:
            return "own_tree"
        return "not_holder"

    # -- the whole picture
    def _nvml_views(self):
        """NVML's processes and memory of every GPU (statuses are set once /proc is read)."""
        views = {}
        for gpu in self.gpus:
            index = gpu["index"]
            view = {"procs": None, "used_mib": None, "memory": None, "error": gpu.get("error"),
                    "error_kind": gpu.get("error_kind"), "listed": ()}
            views[index] = view
            if gpu.get("error"):
                continue
            try:
                view["listed"] = self.nvml.processes(index)
            except NvmlFailure as exc:
                view.update(error="NVML could not list the GPU's processes: %s" % exc.message, error_kind=exc.kind)
                continue
            mem = self.memory(index)
            if "error" in mem:
                view.update(error=mem["error"], error_kind=mem["error_kind"])
            else:
                view.update(memory=mem, used_mib=mem["used_mib"])
            view["procs"] = []
        return views

    def _read_again(self, pids, records, minor_index):
        """Read pids that contradict NVML once more: one caught between two steps of its set-up maps by now."""
        cache = {}
        again = procscan.scan_pids(self.proc_root, self.devices, [p for p in pids if p != self.self_pid])
        for pid, entry in again.entries.items():
            if not procscan.is_descendant(pid, self.self_pid, self.proc_root, cache):
                records[pid] = self.details(entry, minor_index)

    def _given(self, rank_deaths, shm):
        """snapshot's rank_deaths and shm, when given, replace the engine's own for this read and the next."""
        if rank_deaths is not None:
            self.rank_deaths = rank_deaths
        if shm is not None:
            self.shm_prefixes, self.shm_since = shm or (None, None)

    def snapshot(self, targets, rank_deaths=None, shm=None):
        """Report for the targeted GPU indexes (every field gpu_status returns).

        A release passes what it knows instead of setting the engine's fields: rank_deaths ({index: [{"pid", "mib",
        "survivors"}]}, the ranks of the jobs seen at its start that died since) and shm ((prefixes, since) to read
        /dev/shm for residue older than since, or False: not read). None keeps the engine's own.

        NVML is read for every GPU, since where a holder's memory is decides
        whether stopping it frees, or hits, a GPU that is not targeted. NVML is
        read before /proc: a pid NVML names has mapped its context by the time
        /proc is read, so a process that starts in between is not taken for a
        contradiction of NVML.
        """
        self._given(rank_deaths, shm)
        self._minor_cache, self._folders = {}, {}
        views = self._nvml_views()
        # GPUs described by NVML but whose calls failed are unknown too (their minor is known)
        self._unknown_minors = set(g["minor"] for g in self.gpus
                                   if g.get("minor") is not None and views[g["index"]]["procs"] is None)
        started = time.time()
        places = self.shm_places() if self.shm_prefixes is not None else None
        scan = self.scan(places)
        own_tree = self.own_tree_skip()
        minor_index = self.minor_to_index()
        records = dict((pid, self.details(entry, minor_index, scan)) for pid, entry in scan.entries.items())
        named = sorted(set((p["pid"], index) for index, v in views.items() for p in v["listed"]))
        # a pid NVML names on a GPU where /proc shows it no context: one caught mid set-up maps by now
        contradicting = sorted(set(pid for pid, index in named if self._nvml_status(pid, records, own_tree) == "not_holder"
                                   or (pid in records and index not in records[pid]["context_gpus"])))
        if contradicting:
            self._read_again(contradicting, records, minor_index)
        for view in views.values():
            if view["procs"] is not None:
                view["procs"] = [dict(p, status=self._nvml_status(p["pid"], records, own_tree)) for p in view["listed"]]
            del view["listed"]
        holders = [r for r in records.values() if r["holder"]]
        clients = [r for r in records.values() if not r["holder"] and r["pid"] not in own_tree]
        for view_index, view in views.items():
            for proc in view["procs"] or ():
                if proc["pid"] in records:
                    records[proc["pid"]]["nvml_named_on"].append(view_index)
                    if proc.get("mps"):
                        records[proc["pid"]]["mps_client_on"].append(view_index)
                        records[proc["pid"]]["mps_role"] = records[proc["pid"]]["mps_role"] or "client"
        mps_servers = self._mps_servers(records)
        orphans, stale = pinning.pin(holders, views, slack_mib=self.threshold_mib)
        for record in holders:
            record["unattributed"] = not record["gpus"] and not record["unknown_gpus"]
        jobs, linked = find_jobs(holders, self.proc_root)
        residue = pinning.residue(orphans, holders, jobs, self.rank_deaths)
        stale_gpus = set(e["gpu"] for e in stale)
        gpu_reports = [self._gpu_report(index, views[index], holders, clients, orphans, jobs, residue,
                                        index not in stale_gpus)
                       for index in targets]
        protected = [h for h in holders if h["pid"] in own_tree]
        for record in protected:
            record["protected_name"] = record["protected_name"] or "an ancestor of this module"
        for gpu_report in gpu_reports:
            gpu_report["protected_holders"] = sorted(h["pid"] for h in protected if gpu_report["index"] in h["gpus"])
            gpu_report["holders"] = [p for p in gpu_report["holders"] if p not in own_tree]
        device_findings, confs = [], None
        if not self.in_container:
            confs = node.read_pve_confs() if self.view == "node" else None
            in_dev = {}
            if confs is not None:
                in_dev, device_findings = node.check_devices(confs, self._container_devs(holders + clients))
            for gpu_report in gpu_reports:
                view = views[gpu_report["index"]]
                gpu_report["by_container"] = node.by_container(
                    view["procs"], view["used_mib"], holders, self.proc_root,
                    stale=set(e["pid"] for e in stale if e["gpu"] == gpu_report["index"]), index=gpu_report["index"],
                    table=scan)
                passed = node.passed_into(confs, gpu_report["minor"])
                if passed is not None:
                    passed = sorted(set(passed) | set(int(v) for v, minors in in_dev.items()
                                                      if gpu_report["minor"] in minors))
                gpu_report["passed_into"] = passed
                gpu_report["passed_unusable"] = node.passed_unusable(confs, gpu_report["minor"])
        report = Report(self, targets, gpu_reports, [h for h in holders if h["pid"] not in own_tree], clients, scan)
        report.protected_holders = sorted(protected, key=lambda r: r["pid"])
        report.views, report.orphans, report.jobs, report.residue = views, orphans, jobs, residue
        report.nvml_stale, report.linked = stale, linked
        report.conf_vmids = None if confs is None else sorted(confs, key=int)   # the node's container configs
        report.unknown_gpus = self._unknown(holders)
        report.mps_servers = mps_servers
        report.mps_nvml_unread = dict((i, self.nvml.mps_unread.get(i) or v["error"]) for i, v in views.items()
                                      if v["procs"] is None or i in self.nvml.mps_unread)
        report.unreadable = self.unreadable(scan, gpu_reports)
        if places is not None:
            self._shm_report(report, places, scan, min(started, self.shm_since) if self.shm_since else started)
        report.diagnosis = device_findings + diagnose(report)
        return report

    def read_timeout(self):
        """The wait for one read through another root: the reader's, and never past the deadline."""
        if self.deadline is None:
            return procscan.READ_TIMEOUT_S
        return max(0.05, min(procscan.READ_TIMEOUT_S, self.deadline - time.monotonic()))

    def _mps_servers(self, records):
        """With an MPS server among the processes, what the control daemons say of its clients (mps.read_servers,
        each ask bounded by the deadline); the records they list as clients get mps_role client."""
        servers = [r for r in records.values() if r["mps_role"] == "server"]
        found = mps.read_servers(servers, list(records.values()), self.proc_root, self.view == "node",
                                 self.deadline, self.mps_silent)
        for entry in found.values():
            for pid in entry["clients"] or ():
                records[pid]["mps_role"] = records[pid]["mps_role"] or "client"
        return found

    def shm_places(self):
        """{None: this host's /dev/shm, vmid: each running container's (from a node), through its init's root}, each
        read by the bounded reader one part at a time, never through a link (_read_place)."""
        parts = shm.folder_parts(self.shm_dir)
        spots = [(None, self.node_root, "self")]
        if self.view == "node":
            spots += [(vmid, "%s/%d/root" % (self.proc_root, init), init)
                      for vmid, init in sorted(node.container_inits(self.proc_root).items(), key=lambda i: int(i[0]))]
        places = dict((key, self._read_place(root, parts, procscan.namespace_inode(ns_of, "mnt", self.proc_root)))
                      for key, root, ns_of in spots)
        if self.view == "container" and places[None]["why"] is None:
            places[None]["why"] = self._foreign_why(places[None])
        return places

    def _foreign_why(self, place):
        """Inside a container, _shm.foreign_why of its /dev/shm: made outside it (a folder of the node's bound in)."""
        try:
            mountinfo = procscan.read_text("/proc/self/mountinfo")
        except OSError:
            mountinfo = ""
        return shm.foreign_why(place, self.foreign_owner(), shm.mount_of(self.shm_dir, mountinfo, place["dev"]))

    def foreign_owner(self):
        """Inside a container, the (uid, gid) an owner it does not map shows as; None elsewhere."""
        return tuple(node.overflow_id(kind) for kind in ("uid", "gid")) if self.view == "container" else None

    def _read_place(self, root, parts, mnt):
        """One /dev/shm folder: {path, label, root, parts, mnt, dev, entries (None: not read), why (not read)}."""
        label = root.rstrip("/") + "/" + "/".join(parts)
        place = {"path": self.shm_dir, "label": label, "root": root, "parts": parts, "mnt": mnt, "dev": None,
                 "ino": None, "entries": None, "why": None}
        timeout = self.read_timeout()
        try:
            place.update(procscan.list_folder(root, parts, timeout))
        except procscan.ReadBlocked:
            place["why"] = "%s did not answer within %gs (a hung mount?): not read, nothing in it is removed" % (
                label, timeout)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                place["entries"] = []
            elif exc.errno in (errno.ELOOP, errno.ENOTDIR):
                place["why"] = ("%s: a part of %s is a symbolic link or no folder (never followed): not read, nothing "
                                "in it is removed" % (label, self.shm_dir))
            else:
                place["why"] = "%s cannot be read (%s): nothing in it is removed" % (label, exc.strerror or exc)
        return place

    def _shm_key(self, pid, scan):
        """The place of a process's own /dev/shm: None (this host's), its container's vmid, or shm.UNKNOWN."""
        if self.view != "node":
            return None
        where = node.container_of_pid(pid, self.proc_root, scan)
        return None if where == node.HOST else (shm.UNKNOWN if where is None else where)

    def shm_users(self, scan, places):
        """(files some process maps or has open, {place: names its processes' fds and maps name}, [processes not
        read]) of a scan with shm: the evidence _shm.judge weighs. A name counts in its process's container's place
        and in each place seen from its mount namespace."""
        used = set()
        for files in scan.shm_files.values():
            used.update(files)
        names = {}
        for pid, paths in scan.shm_paths.items():
            mnt = procscan.namespace_inode(pid, "mnt", self.proc_root)
            keys = set([self._shm_key(pid, scan)]) | set(k for k, p in places.items() if mnt is not None and p["mnt"] == mnt)
            for key in keys:
                names.setdefault(key, set()).update(n for n in (shm.used_name(p) for p in paths) if n)
        why = dict((b["pid"], "its maps read %s" % ("was cut" if b.get("reason") == "truncated" else "blocked"))
                   for b in scan.blocked)
        unreadable = []
        for pid in scan.unreadable:
            key = self._shm_key(pid, scan)
            unreadable.append({"pid": pid, "key": key, "reason": why.get(pid), "everywhere": self.view == "node" and key is None,
                               "mnt": procscan.namespace_inode(pid, "mnt", self.proc_root)})
        return used, names, unreadable

    def _shm_report(self, report, places, scan, since):
        """The report's residue by place (shm_residue: this host's; shm_residue_by_container from a node) and the
        folders skipped, as _shm.judge weighs the places and their users."""
        used, names, unreadable = self.shm_users(scan, places)
        judged = shm.judge(places, used, names, unreadable, since, self.shm_prefixes, self.foreign_owner())
        report.shm_places, report.shm_judged = places, judged
        public = dict((key, [shm.public(e) for e in verdict["residue"]]) for key, verdict in judged.items())
        report.shm_residue = public[None]
        if self.view == "node":
            report.shm_residue_by_container = dict((k, v) for k, v in public.items() if k is not None)
        report.shm_skipped = [{"vmid": None if key is None else int(key), "path": self.shm_dir, "why": verdict["skipped"]}
                              for key, verdict in sorted(judged.items(), key=lambda i: shm.place_order(i[0]))
                              if verdict["skipped"]]

    def _container_devs(self, records):
        """{vmid: dev_minors of its /dev} of each container with a process read here, through its lowest pid's root
        (read once per task)."""
        first = {}
        for record in records:
            vmid = record.get("container")
            if vmid and vmid not in (node.HOST, node.UNATTRIBUTED) and record["pid"] < first.get(vmid, record["pid"] + 1):
                first[vmid] = record["pid"]
        for vmid, pid in first.items():
            if vmid not in self._devs_of:      # once per task: a running container's /dev does not move
                self._devs_of[vmid] = self._read_devs("%s/%d/root" % (self.proc_root, pid))
        return dict((vmid, self._devs_of[vmid]) for vmid in first)

    def _read_devs(self, root):
        """node.dev_minors of /dev under root (a container's), read bounded and never through a link; None unread."""
        try:
            return node.dev_minors(procscan.list_folder(root, ["dev"], self.read_timeout())["entries"])
        except OSError:
            return None

    def _unknown(self, holders):
        """GPUs NVML cannot describe, by minor: those its calls fail on, and nodes holders map that it does not list."""
        index_of = dict((g["minor"], g["index"]) for g in self.gpus if g.get("minor") is not None)
        minors = set(self._unknown_minors)
        for record in holders:
            minors.update(record["unknown_mapped"])
        return [{"minor": m, "index": index_of.get(m) if m in self._unknown_minors else None,
                 "held_by": sorted(h["pid"] for h in holders if m in h["unknown_gpus"])} for m in sorted(minors)]

    def unreadable(self, scan, gpu_reports):
        """Processes whose /proc reads blocked (`unreadable: blocked`); each GPU they may hold lists them in `blocked`."""
        found = dict((b["pid"], b) for b in procscan.READER.blocked_in(self.proc_root))
        found.update((b["pid"], b) for b in scan.blocked)
        out = []
        for pid in sorted(found):
            info = dict((k, v) for k, v in found[pid].items() if k != "starttime")
            info.setdefault("fd_devices", None)
            minors = set(self._minor(p, "/") for p in info["fd_devices"] or ())
            minors.discard(None)
            # maps unread: it may hold any GPU whose node it has open (every GPU when only nvidiactl or unknown)
            info["may_hold"] = pid not in scan.entries and (info["fd_devices"] is None or bool(info["fd_devices"]))
            for gpu_report in gpu_reports:
                if info["may_hold"] and (not minors or gpu_report["minor"] in minors):
                    gpu_report.setdefault("blocked", []).append(pid)
            out.append(info)
        return out

    def _gpu_report(self, index, view, holders, clients, orphans, jobs, residue, trusted):
        gpu = self.gpu(index) or {"index": index}
        minor = gpu.get("minor")
        out = {
            "index": index,
            "minor": minor,
            "uuid": gpu.get("uuid"),
            "pci_bus_id": gpu.get("pci_bus_id"),
            "name": gpu.get("name"),
            "holders": sorted(h["pid"] for h in holders if index in h["gpus"]),
            "ambiguous": sorted(h["pid"] for h in holders if index in h["ambiguous_gpus"]),
            "mapped_by": sorted(h["pid"] for h in holders if index in h["maps_gpus"]),
            "clients": sorted(c["pid"] for c in clients if minor in c["fd_gpu_minors"]),
            "residue": None,
            "nvml_pids_trusted": trusted,
        }
        if view["error"] or view["memory"] is None:
            out.update({"memory": view["memory"], "free": False, "nvml_processes": [], "unattributed_mib": None,
                        "error": view["error"] or "NVML gave no memory figures", "error_kind": view["error_kind"]})
            return out
        mem = view["memory"]
        out["memory"] = dict((k, mem[k]) for k in ("total_mib", "used_mib", "reserved_mib", "v1_used_mib"))
        if mem.get("estimated"):
            out["memory"]["estimated"] = True
            out["memory"]["note"] = ("estimated: this driver has no v2 memory call; used is v1 used minus "
                                     "reserved_floor_mib (%d MiB)" % mem["reserved_mib"])
        out["free"] = self.is_free(mem)
        notes = {
            "holder": "holds this GPU here",
            "client": "only has device files open here (an NVML client), no context",
            "own_tree": "part of this module's own process tree",
            "not_holder": "exists here but maps no /dev/nvidia* node",
            "not_visible": ("not visible here: the process no longer exists, or it lives outside this PID namespace "
                            "(on the node or in another container)" if self.in_container
                            else "not visible here: the process no longer exists"),
        }
        accepted = set(h["pid"] for h in holders if "nvml" in h["evidence"] and index in h["gpus"])
        out["nvml_processes"] = []
        for proc in view["procs"]:
            note = notes[proc["status"]]
            if proc["status"] in ("holder", "client", "not_holder") and proc["pid"] not in accepted:
                note = ("stale here: %s; the driver reports host pids (legacy) or the pid was reused, so this entry "
                        "pins nobody" % pinning.stale_why(proc["pid"], index, proc["status"]))
            out["nvml_processes"].append({"pid": proc["pid"], "used_mib": proc["used_mib"], "status": proc["status"],
                                          "matches_holder": proc["pid"] in accepted, "note": note})
        orphan = orphans.get(index)
        out["unattributed_mib"] = orphan["unaccounted"] if (orphan and not out["free"]) else 0
        if index in residue:
            job = jobs[residue[index]]
            out["residue"] = {"job": job["id"], "pids": job["pids"], "mib": pinning.orphan_mib(orphan)}
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
        self.views, self.orphans, self.jobs, self.residue = {}, {}, {}, {}
        self.nvml_stale, self.linked, self.unknown_gpus = [], [], []
        self.protected_holders = []
        self.unreadable = []
        self.shm_residue = self.shm_residue_by_container = self.shm_skipped = None
        self.shm_places, self.shm_judged = {}, {}
        self.conf_vmids = None   # node view: the vmids with a config on this node (None: unread, or not a node)
        self.mps_servers = {}    # server pid -> what its control daemon says of its clients (mps.read_servers)
        self.mps_nvml_unread = {}  # GPU index -> why NVML's MPS client list could not be read there

    @property
    def all_free(self):
        """True only when there are GPUs and each is free: no GPU is never "all free"."""
        return bool(self.gpus) and all(g["free"] for g in self.gpus)

    @property
    def errors(self):
        return [g for g in self.gpus if g.get("error")]

    def holder(self, pid):
        for record in self.holders:
            if record["pid"] == pid:
                return record
        return None

    def job_gpus(self, job_id):
        """The GPUs a job's members are pinned to, plus those holding its residue."""
        job = self.jobs[job_id]
        gpus = set(g for m in job["members"] for g in m["gpus"])
        gpus.update(index for index, owner in self.residue.items() if owner == job_id)
        return sorted(gpus)

    def as_dict(self):
        def clean(record):
            out = dict((k, v) for k, v in record.items() if not k.startswith("_"))
            if "shares_mib" in out:
                out["shares_mib"] = dict((str(k), v) for k, v in sorted(out["shares_mib"].items()))
            return out
        out = {
            "gpus": self.gpus,
            "holders": [clean(h) for h in self.holders],
            "protected_holders": [clean(h) for h in self.protected_holders],
            "clients": [clean(c) for c in self.clients],
            "zombies": self.zombies,
            "jobs": [{"id": job["id"], "pids": job["pids"], "gpus": self.job_gpus(job["id"]), "signature": job["signature"]}
                     for job in sorted(self.jobs.values(), key=lambda j: j["id"])],
            "holders_unattributed": [h["pid"] for h in self.holders if h["unattributed"]],
            "linked": [{"pids": pair["pids"], "why": pair["why"]} for pair in self.linked],
            "nvml_pids_trusted": not self.nvml_stale,
            "nvml_stale": self.nvml_stale,
            "unknown_gpus": self.unknown_gpus,
            "all_free": self.all_free,
            "driver_version": self.engine.driver_version,
            "in_container": self.engine.in_container,
            "view": self.engine.view,
            "unreadable": self.unreadable,
            "diagnosis": self.diagnosis,
        }
        if self.shm_residue is not None:
            out["shm_residue"] = self.shm_residue
        if self.shm_residue_by_container is not None:
            out["shm_residue_by_container"] = self.shm_residue_by_container
        if self.shm_skipped is not None:
            out["shm_skipped"] = self.shm_skipped
        return out


def _pname(record):
    where = record.get("container")
    if where and where != node.HOST and record.get("container_pid") is not None:
        return "pid %d (%s, container %s pid %s)" % (record["pid"], record["name"], where, record.get("container_pid"))
    return "pid %d (%s)" % (record["pid"], record["name"])


def _devices_text(paths):
    return ", ".join(paths) if paths else "no device"


def _gpu_list(indexes):
    return ("GPU " if len(indexes) == 1 else "GPUs ") + ", ".join(str(i) for i in indexes)


def _held_text(record):
    """'GPU 1 (4.4 GiB by NVML)' for what a holder is pinned to."""
    parts = []
    for index in record["gpus"]:
        mib = record["shares_mib"].get(index)
        parts.append("GPU %d (%s%s)" % (index, fmt_mib(mib), " by NVML" if "nvml" in record["evidence"] else ""))
    return ", ".join(parts)


def _holder_lines(report, record):
    """What holds what, for a holder of a targeted GPU."""
    pid = record["pid"]
    held = _held_text(record)
    if record["blocked_threads"]:
        out = []
        for thread in record["blocked_threads"]:
            stack = "; kernel stack: %s" % " <- ".join(thread["stack"][:6]) if thread.get("stack") else ""
            out.append("%s has thread %d in D state (wchan %s) holding %s: it is stuck in the kernel and SIGKILL "
                       "takes effect only when that call returns; a GPU reset is refused while it holds the GPU; "
                       "restarting its container (or the node) frees it%s"
                       % (_pname(record), thread["tid"], thread.get("wchan") or "unknown", held or "a context", stack))
        return out
    if record["defunct_leader"]:
        return ["%s is a defunct leader with %d live threads holding %s; SIGKILL to %d frees it; fuser does not see it"
                % (_pname(record), record["live_threads"] or 0, held, pid)]
    if "nvml" not in record["evidence"]:
        lines = []
        for index in record["gpus"]:
            orphan = report.orphans.get(index, {"dead": [], "stale": [], "unaccounted": 0})
            dead = ", ".join("pid %d" % p for p, dummy in orphan["dead"] + orphan.get("stale", []))
            gone = "not visible here" if report.engine.in_container else "which no longer exists"
            if dead:
                where = "NVML names %s on GPU %d, %s" % (dead, index, gone)
            else:
                where = "GPU %d has %s that no process NVML lists accounts for" % (index, fmt_mib(orphan["unaccounted"]))
            heir = [p for p in record["heir_of"] if p in [d for d, dummy in orphan["dead"]]]
            kin = (", its forked child (its %s is %d)" % ("process group" if heir[0] == record["pgrp"] else "session",
                                                          heir[0])) if heir else ""
            lines.append("%s; the memory is held by %s%s, the only holder NVML does not name that maps a context on "
                         "GPU %d; SIGKILL to %d frees it" % (where, _pname(record), kin, index, pid))
        return lines
    if "fd" not in record["via"]:
        return ["%s has no /dev/nvidia* file open but maps %s (fuser shows it only with access m); it holds %s; "
                "SIGKILL to %d frees it" % (_pname(record), _devices_text(record["mapped_devices"]), held, pid)]
    return ["%s holds %s; SIGTERM, then SIGKILL to %d frees it" % (_pname(record), held, pid)]


def _mps_lines(report):
    """MPS: the servers and the clients, and which memory is charged to whom (GPU_FACTS row 26)."""
    def shares(record):
        return ", ".join("GPU %d %s" % (i, fmt_mib(mib)) for i, mib in sorted(record["shares_mib"].items())) or \
            "no memory pinned"
    servers = [r for r in list(report.holders) + list(report.clients) if r.get("mps_role") == "server"]
    clients = [r for r in report.holders if r.get("mps_role") == "client"]
    if not servers and not clients:
        return []
    return ["MPS: server %s; clients %s. Each client's memory is its own (NVML names it with its MiB) and the server "
            "holds a share of its own; a client is stopped by terminate_client through the MPS control daemon, then "
            "SIGTERM and SIGKILL; the server only with all of its clients; the control daemon never"
            % (", ".join("pid %d (%s)" % (r["pid"], shares(r)) for r in servers) or "none seen",
               ", ".join("pid %d (%s)" % (r["pid"], shares(r)) for r in clients) or "none")] + [
        _mps_server_line(report, r["pid"]) for r in servers]


def _mps_server_line(report, pid):
    """Who an MPS server serves, as its control daemon lists them, or why that is not known."""
    entry = report.mps_servers.get(pid) or {"clients": None, "why": "its control daemons were not asked", "unseen": []}
    unread = report.mps_nvml_unread
    nvml = ("NVML lists no MPS client on GPU %s (%s)" % (", ".join(str(i) for i in sorted(unread)), "; ".join(
        sorted(set(str(w) for w in unread.values())))) if unread else "NVML's MPS client list names every MPS client")
    if entry["unseen"]:
        unseen = ", ".join(str(p) for p in entry["unseen"])
        return ("MPS server pid %d: control daemon pid %d lists clients %s (pids as it sees them) that are not seen here: "
                "it is never signalled while they may live" % (pid, entry["control"]["pid"], unseen))
    if entry["clients"] is not None:
        return "MPS server pid %d serves %s, as control daemon pid %d lists them" % (
            pid, ", ".join("pid %d" % p for p in entry["clients"]) or "no client", entry["control"]["pid"])
    if unread:
        return ("MPS server pid %d: its clients cannot be known (%s; %s): it is never signalled; end its clients' "
                "work, then stop MPS through its control daemon (quit) by hand" % (pid, entry["why"], nvml))
    return ("MPS server pid %d: its control daemon could not tell its clients (%s); %s, and those are its clients here, "
            "signalled without terminate_client" % (pid, entry["why"], nvml))


def diagnose(report):
    """Plain sentences, one per finding, each naming the pid and the remedy."""
    lines = []
    engine = report.engine
    targets = set(report.targets)
    for gpu in report.gpus:
        if gpu.get("error"):
            lines.append("GPU %s%s: %s; its memory state is unknown, so it is not reported free"
                         % (gpu["index"], " (%s)" % gpu["uuid"] if gpu.get("uuid") else "", gpu["error"]))
    for gpu in report.gpus:
        if (gpu.get("memory") or {}).get("estimated"):
            lines.append("GPU %s: memory estimated, not measured: this driver has no v2 memory call, so used is v1 used "
                         "minus reserved_floor_mib (%s MiB)" % (gpu["index"], gpu["memory"]["reserved_mib"]))
    for entry in report.nvml_stale:
        lines.append("NVML names pid %d on GPU %d, but %s: the driver reports host pids (legacy) or the pid was "
                     "reused; this entry is stale, its %s count as memory no process here is named for, and pid %d "
                     "is pinned by its own mappings alone"
                     % (entry["pid"], entry["gpu"], entry["why"], fmt_mib(entry["used_mib"]), entry["pid"]))
    for unknown in report.unknown_gpus:
        held = unknown["held_by"]
        lines.append("the GPU of minor %d%s cannot be described by NVML (lost, or its calls fail)%s: it is never "
                     "reported free, and a process with a context on it is never signalled for it (with a targeted "
                     "GPU pinned too, only with collateral: stop)"
                     % (unknown["minor"], "" if unknown["index"] is None else " (GPU %d)" % unknown["index"],
                        "; %s map a context on it" % ", ".join("pid %d" % p for p in held) if held else ""))
    lines.extend(_mps_lines(report))
    for link in report.linked:
        lines.append("pids %s are connected by TCP but are not one job (%s): each is signalled only for its own "
                     "targeted GPUs" % (", ".join(str(p) for p in link["pids"]), link["why"].split(": ", 1)[-1]))
    for record in report.holders:
        if targets & set(record["gpus"]):
            lines.extend(_holder_lines(report, record))
            others = [i for i in record["gpus"] if i not in targets]
            if others:
                lines.append("%s also holds %s, which %s not selected: stopping it stops its work there too"
                             % (_pname(record), ", ".join("GPU %d (%s)" % (i, fmt_mib(record["shares_mib"].get(i)))
                                                          for i in others), "is" if len(others) == 1 else "are"))
        elif not record["gpus"] and (targets & set(record["ambiguous_gpus"] + record["context_gpus"])
                                     or not record["maps_gpus"]):
            if record["ambiguous_gpus"]:
                rivals = sorted(set(p for i in record["ambiguous_gpus"] for p in
                                    [h["pid"] for h in report.holders if i in h["ambiguous_gpus"]]) - set([record["pid"]]))
                why = ("%s and %s each map a context on %s, where NVML shows memory no visible process it names "
                       "accounts for: the evidence fits both, so neither is pinned"
                       % (_pname(record), ", ".join("pid %d" % p for p in rivals), _gpu_list(record["ambiguous_gpus"])))
            elif record["maps_gpus"]:
                why = ("%s maps a context on %s but NVML does not name it and shows no memory there that no visible "
                       "process accounts for: it is not pinned to any GPU" % (_pname(record), _gpu_list(record["context_gpus"])))
            else:
                why = "%s maps only %s: it has a context that no evidence pins to a GPU" % (
                    _pname(record), _devices_text(record["mapped_devices"]))
            lines.append("%s; it is signalled only when every GPU it maps (%s) is targeted"
                         % (why, ", ".join(str(i) for i in record["maps_gpus"]) or "every GPU"))
    for record in report.protected_holders:
        if targets & set(record["gpus"] + record["maps_gpus"]):
            lines.append("%s is an ancestor of this module and holds %s: it is never signalled, and the GPU is not "
                         "free while it runs" % (_pname(record), _held_text(record) or "a context"))
    for gpu in report.gpus:
        if gpu.get("error") or gpu["free"]:
            continue
        label = "GPU %d (minor %s)" % (gpu["index"], gpu["minor"])
        index = gpu["index"]
        orphan = report.orphans.get(index)
        if gpu["residue"]:
            residue = gpu["residue"]
            lines.append("%s: %s are held by the surviving ranks of the job of pid %d (pids %s): a rank of that job "
                         "on this GPU died during this run and its peers keep part of its memory here, which NVML "
                         "charges to no one; the GPU is free only when the whole job stops (collateral: stop, or "
                         "target %s)"
                         % (label, fmt_mib(residue["mib"]), residue["job"], ", ".join(str(p) for p in residue["pids"]),
                            _gpu_list(report.job_gpus(residue["job"]))))
            continue
        if not orphan or gpu["holders"] or gpu["ambiguous"] or gpu.get("protected_holders"):
            continue
        for dead_pid, mib in orphan["dead"]:
            lines.append("NVML names pid %d on %s with %s, %s; no process visible here maps a context on it%s"
                         % (dead_pid, label, fmt_mib(mib),
                            "which no longer exists, or lives outside this container's PID namespace"
                            if engine.in_container else "which no longer exists",
                            "; look from the node" if engine.in_container else ""))
        if orphan["unaccounted"]:
            peers = sorted(job["id"] for job in report.jobs.values()
                           if all(index in m["maps_gpus"] and index not in m["gpus"] for m in job["members"]))
            lines.append("%s: %s is used by no process visible here%s; look from the node; if nothing holds it "
                         "there either, only a GPU reset frees it (gpu_release with gpu_reset: true)"
                         % (label, fmt_mib(orphan["unaccounted"]),
                            " (unattributed: it may be residue of a job that maps this GPU, %s, but no rank of it was "
                            "seen here; nothing is stopped for it)" % ", ".join("job of pid %d" % j for j in peers)
                            if peers else ""))
    for zombie in [z for z in report.zombies if z["ppid"] > 1][:5]:
        lines.append("pid %d (%s) is a zombie holding nothing; its parent %s has not reaped it; it holds no GPU "
                     "memory, and killing or fixing the parent only removes the process-table entry"
                     % (zombie["pid"], zombie["name"],
                        "%d (%s)" % (zombie["ppid"], zombie["parent_name"]) if zombie["parent_name"] else str(zombie["ppid"])))
    targeted_minors = set(g["minor"] for g in report.gpus if g.get("minor") is not None)
    for record in report.clients:
        if targeted_minors.intersection(record["fd_gpu_minors"]) or not record["fd_gpu_minors"]:
            lines.append("%s only has %s open and maps none: an NVML client (a monitor or exporter), not a "
                         "holder; it holds no GPU memory and is never signalled"
                         % (_pname(record), _devices_text(record["fd_devices"])))
    for info in report.unreadable:
        if info.get("reason") == "truncated":
            lines.append(truncated_line(info, report.gpus))
            continue
        what = ("its memory maps, so whether it holds a GPU is unknown; GPUs it may hold (%s) are never taken "
                "for free on its account" % (", ".join(str(g["index"]) for g in report.gpus if info["pid"] in
                                                       g.get("blocked", ())) or "none targeted")
                if info["may_hold"] else "its command line")
        lines.append("pid %d (%s) is unreadable: blocked: reading %s did not finish within %gs (state %s, wchan %s): "
                     "a thread of it is stuck in the kernel holding its memory-map lock, or others queue behind one "
                     "that does; not read: %s" % (info["pid"], info["name"], info["path"], info["waited_s"],
                                                  info["state"], info["wchan"] or "unknown", what))
    if report.scan.unreadable:
        lines.append("%d processes could not be read (%s); a holder among them would not be shown"
                     % (len(report.scan.unreadable), ", ".join(str(p) for p in report.scan.unreadable[:10])))
    places = [(None, report.shm_residue)] + sorted((report.shm_residue_by_container or {}).items(), key=lambda i: int(i[0]))
    for vmid, found in places:
        if found:
            lines.append(shm_line(vmid, found))
    for skipped in report.shm_skipped or ():
        where = "container %d: " % skipped["vmid"] if skipped["vmid"] else ""
        lines.append("%s/dev/shm was not judged: %s" % (where, skipped["why"]))
    return lines


def truncated_line(info, gpus):
    """One sentence on a process whose maps had more than the read cap."""
    may = ", ".join(str(g["index"]) for g in gpus if info["pid"] in g.get("blocked", ())) or "none targeted"
    return ("pid %d (%s) is unreadable: truncated: %s has more than %d bytes (a process can make it so), read no further: "
            "whether it holds a GPU is unknown; GPUs it may hold (%s) are never taken for free on its account, and it "
            "is never signalled on a part of its maps" % (info["pid"], info["name"], info["path"], info["cap_bytes"], may))


def shm_line(vmid, found):
    """One sentence on the shared-memory residue of one /dev/shm."""
    stacks = sorted(set(e["owner"] for e in found))
    paths = [e["path"] for e in found]
    return ("%s/dev/shm holds %d GPU stack file%s no live process uses (%s of %s: %s%s): leaked by dead processes, "
            "they can make the next launch fail; remove them before it" % (
                "container %s: " % vmid if vmid else "", len(found), "" if len(found) == 1 else "s",
                fmt_bytes(sum(e["bytes"] for e in found)), ", ".join(stacks),
                ", ".join(paths[:5]), ", ..." if len(paths) > 5 else ""))
