# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who holds each GPU, and why its memory is not free (private helper; evidence layer).

Engine joins NVML's view (memory, process list) with the /proc scan, inside a container or on a Proxmox node
against host pids, into a Report (_report) whose holders and clients are read-only Holders (_holder), with its
diagnosis (_diagnose) and /dev/shm places (_shmplaces). Knows nothing of AnsibleModule: the options and their
checks are the glue's (_params).
"""

from __future__ import annotations

import os
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._diagnose import diagnose
from ansible_collections.gpuops.fleet.plugins.module_utils._jobs import find_jobs
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml, NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._procnames import mps_role, names_of, protected_name, user_name
from ansible_collections.gpuops.fleet.plugins.module_utils._redact import redact_argv
from ansible_collections.gpuops.fleet.plugins.module_utils._report import Report, gpu_entry
from ansible_collections.gpuops.fleet.plugins.module_utils._shmplaces import ShmPlaces
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import describe_gpus, resolve_gpus

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


class Engine(ShmPlaces):
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
        self.shm_prefixes = None  # (prefix, stack) pairs: read /dev/shm for residue (gpu_info); None: not read
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
        """The per-process record gpu_info returns (pinning fields are set later); table: the scan that
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
        live = sum(n for s, n in counts.items() if s not in ("Z", "X"))
        names = names_of(pid, entry.comm, argv, self.proc_root)
        record = {
            "pid": pid, "ppid": entry.ppid, "pgrp": entry.pgrp, "session": entry.session,
            "name": status.get("name") or entry.comm, "user": user_name(status.get("uid")),
            "create_time": self.create_time(entry.starttime), "starttime_ticks": entry.starttime,
            "state": entry.state, "thread_count": entry.num_threads, "thread_states": counts,
            "defunct_leader": entry.defunct_leader, "live_threads": live if entry.defunct_leader else None,
            "blocked_threads": blocked, "holder": entry.is_holder, "via": list(entry.via),
            "fd_devices": list(entry.fd_devices), "mapped_devices": list(entry.map_devices),
        }
        record.update(self._gpu_fields(entry, minor_index))
        record.update({
            "gpus": [], "evidence": [], "ambiguous_gpus": [], "shares_mib": {}, "heir_of": [], "job": None,
            "unattributed": False, "nvml_named_on": [], "mps_client_on": [], "mps_role": mps_role(names),
            "nspid": status.get("nspid"), "cgroup": cgroup,
            "container": None if self.in_container else node.where_of_cgroup(cgroup),   # unread: None, never host
            "container_pid": None if self.in_container else node.pid_in_container(status.get("nspid")),
            "parent_name": parent["comm"] if parent else None, "names": names, "protected_name": protected_name(names),
            "cmdline": redact_argv(argv, self.redact_patterns) if (self.with_cmdline and argv) else None,
            "truncated": ["cmdline"] if cut else [],
        })
        record["_argv"] = argv  # for `match`/`protect`, never returned
        record["_sockets"] = list(entry.sockets)
        return record

    def _gpu_fields(self, entry, minor_index):
        """The record's GPU fields read from its maps and fds: minors, map lines, the GPUs it maps and those it maps
        with a context's signature (CONTEXT_MAP_LINES), and those NVML cannot describe."""
        root = "%s/%d/root" % (self.proc_root, entry.table_tid if entry.defunct_leader else entry.pid)
        map_lines = {}
        for path, lines in entry.map_counts.items():
            minor = self._minor(path, root)
            if minor is not None:
                map_lines[minor] = map_lines.get(minor, 0) + lines
        gpu_minors = sorted(map_lines)
        unknown = set(m for m in gpu_minors if m not in minor_index or m in self._unknown_minors)
        return {
            "gpu_minors": gpu_minors,
            "fd_gpu_minors": sorted(set(m for m in (self._minor(p, root) for p in entry.fd_devices) if m is not None)),
            "map_lines": dict((str(minor_index.get(m, "minor%d" % m)), n) for m, n in sorted(map_lines.items())),
            "maps_gpus": sorted(minor_index[m] for m in gpu_minors if m in minor_index),
            "context_gpus": sorted(minor_index[m] for m, n in map_lines.items()
                                   if m in minor_index and n >= pinning.CONTEXT_MAP_LINES),
            # a context on a GPU NVML cannot describe: that GPU keeps its place, by its minor
            "unknown_gpus": sorted(m for m, n in map_lines.items() if m in unknown and n >= pinning.CONTEXT_MAP_LINES),
            "unknown_mapped": sorted(unknown),
        }

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
        """Report for the targeted GPU indexes (every field gpu_info returns).

        A release passes what it knows instead of setting the engine's fields: rank_deaths ({index: [{"pid", "mib",
        "survivors"}]}, the ranks of the jobs seen at its start that died since) and shm ((prefixes, since) to read
        /dev/shm for residue older than since, or False: not read). None keeps the engine's own.

        NVML is read for every GPU, since where a holder's memory is decides
        whether stopping it frees, or hits, a GPU that is not targeted. NVML is
        read before /proc: a pid NVML names has mapped its context by the time
        /proc is read, so a process that starts in between is not taken for a
        contradiction of NVML. Once pinned, every record is a read-only Holder.
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
        records = self._records(scan, views, own_tree)
        mps_servers = self._mps_servers(records)
        holders = [r for r in records.values() if r["holder"]]
        orphans, stale = pinning.pin(holders, views, slack_mib=self.threshold_mib)
        jobs, linked = find_jobs(holders, self.proc_root)
        for record in holders:
            record["unattributed"] = not record["gpus"] and not record["unknown_gpus"]
            if record["pid"] in own_tree:
                record["protected_name"] = record["protected_name"] or "an ancestor of this module"
        # the evidence is complete: from here on each record is a read-only Holder
        holders, clients = _frozen(holders, [r for r in records.values() if not r["holder"] and r["pid"] not in own_tree],
                                   jobs)
        residue = pinning.residue(orphans, holders, jobs, self.rank_deaths)
        stale_gpus = set(e["gpu"] for e in stale)
        gpu_reports = [gpu_entry(self, index, views[index], holders, clients, orphans, jobs, residue, index not in stale_gpus)
                       for index in targets]
        protected = [h for h in holders if h["pid"] in own_tree]
        for gpu_report in gpu_reports:
            gpu_report["protected_holders"] = sorted(h["pid"] for h in protected if gpu_report["index"] in h["gpus"])
            gpu_report["holders"] = [p for p in gpu_report["holders"] if p not in own_tree]
        device_findings, confs = self._node_view(gpu_reports, views, holders, clients, stale, scan)
        report = Report(self, targets, gpu_reports, [h for h in holders if h["pid"] not in own_tree], clients, scan)
        report.protected_holders = sorted(protected, key=lambda r: r["pid"])
        report.views, report.orphans, report.jobs, report.residue = views, orphans, jobs, residue
        report.nvml_stale, report.linked = stale, linked
        report.conf_vmids = None if confs is None else sorted(confs, key=int)   # the node's container configs
        report.unknown_gpus = self._unknown(holders)
        report.mps_servers = mps_servers
        report.mps_nvml_unread = dict((i, self.nvml.mps_unread.get(i) or v["error"]) for i, v in views.items()
                                      if v["procs"] is None or i in self.nvml.mps_unread)
        report.unreadable = self.blocked_reads(scan, gpu_reports)
        if places is not None:
            self._shm_report(report, places, scan, min(started, self.shm_since) if self.shm_since else started)
        report.diagnosis = device_findings + diagnose(report)
        return report

    def _records(self, scan, views, own_tree):
        """{pid: record} of the scan, a pid that contradicts NVML read once more, and each NVML view's procs with
        their status here; each record names the GPUs NVML names it on (and MPS' client lists)."""
        minor_index = self.minor_to_index()
        records = dict((pid, self.details(entry, minor_index, scan)) for pid, entry in scan.entries.items())
        named = sorted(set((p["pid"], index) for index, v in views.items() for p in v["listed"]))
        # a pid NVML names on a GPU where /proc shows it no context: one caught mid set-up maps by now
        contradicting = sorted(set(pid for pid, index in named if self._nvml_status(pid, records, own_tree) == "not_holder"
                                   or (pid in records and index not in records[pid]["context_gpus"])))
        if contradicting:
            self._read_again(contradicting, records, minor_index)
        for view_index, view in views.items():
            if view["procs"] is not None:
                view["procs"] = [dict(p, status=self._nvml_status(p["pid"], records, own_tree)) for p in view["listed"]]
            del view["listed"]
            for proc in view["procs"] or ():
                record = records.get(proc["pid"])
                if record is not None:
                    record["nvml_named_on"].append(view_index)
                    if proc.get("mps"):
                        record["mps_client_on"].append(view_index)
                        record["mps_role"] = record["mps_role"] or "client"
        return records

    def _node_view(self, gpu_reports, views, holders, clients, stale, scan):
        """Outside a container: each GPU entry's by_container, passed_into and passed_unusable (from a node, its
        containers' configs and /dev); returns (device findings, the configs or None)."""
        if self.in_container:
            return [], None
        confs = node.read_pve_confs() if self.view == "node" else None
        in_dev, device_findings = {}, []
        if confs is not None:
            in_dev, device_findings = node.check_devices(confs, self._container_devs(holders + clients))
        for gpu_report in gpu_reports:
            index, minor = gpu_report["index"], gpu_report["minor"]
            view = views[index]
            gpu_report["by_container"] = node.by_container(
                view["procs"], view["used_mib"], holders, self.proc_root,
                stale=set(e["pid"] for e in stale if e["gpu"] == index), index=index, table=scan)
            passed = node.passed_into(confs, minor)
            if passed is not None:
                passed = sorted(set(passed) | set(int(v) for v, minors in in_dev.items() if minor in minors))
            gpu_report["passed_into"] = passed
            gpu_report["passed_unusable"] = node.passed_unusable(confs, minor)
        return device_findings, confs

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

    def blocked_reads(self, scan, gpu_reports):
        """Processes whose /proc reads blocked or were cut (`unreadable`); each GPU they may hold lists them in `blocked`.

        Not _holder.may_hold: their maps were never read, so there is no record to ask; a GPU whose node such a
        process has open (every GPU with only nvidiactl open, or its fds unread) is taken as held, the upper bound."""
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


def _frozen(holders, clients, jobs):
    """(holders, clients) as read-only Holders, once pinning and jobs have set every field; each job's members are
    the same Holders."""
    by_pid = dict((h["pid"], h) for h in holder.freeze(holders + clients))
    for job in jobs.values():
        job["members"] = [by_pid[m["pid"]] for m in job["members"]]
    return [by_pid[r["pid"]] for r in holders], [by_pid[r["pid"]] for r in clients]
