#!/usr/bin/env python
"""Fake NVIDIA driver daemon of the gpuops.fleet lab (stdlib only).

A context is a shared flock on a fake /dev/nvidiaM plus an allocation record.
Truth comes from the host's /proc/locks (read at each request and every 20 ms):
an allocation's memory and NVML entry stay FREE_DELAY_S after the kernel drops
the last reference (fd, inherited fd, mmap), then vanish (GPU_FACTS rows 2, 3).
Linked TP ranks leave residue on a dead rank's GPU while a peer lives (row 19);
an IPC importer takes over a dead exporter's memory (row 17).
See tests/lab/README.md, "The fake driver".
"""

import argparse
import fcntl
import json
import logging
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import uuid

TOTAL_MIB = 143771
RESERVED_MIB = 615
DRIVER_VERSION = "580.159.04"
PCI_SLOTS = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
NS_GET_PARENT = 0xB702  # _IO(0xb7, 0x2)
# hang: every call on the GPU; hang_memory / hang_procs: the memory / process-list call; no_v2: no v2 memory call
FAULTS = ("none", "lost", "hang", "hang_memory", "hang_procs", "no_v2")
INIT_FAULTS = ("none", "not_loaded", "hang")
# Health conditions (several may hold at once); an H200 answers page retirement with Not Supported (row 29)
# unless retired_pages_pending is set, as on a GPU that retires pages.
HEALTH = ("retired_pages_pending", "row_remap_pending", "row_remap_failure", "ecc_pending", "reset_required",
          "node_reboot_required", "drain_and_reset")
RESET_KEEPS = ("row_remap_failure", "node_reboot_required")
MAX_REQUEST = 65536
FREE_DELAY_S = 0.15  # SIGKILL to memory back, measured 0.12-0.2 s (lab.json free_delay_s)
RESIDUE_MIB = 291  # what linked peers keep on a dead rank's GPU (GPU_FACTS row 19)
WATCH_INTERVAL_S = 0.02


# ---- pure helpers (unit tested with recorded text) ----

def parse_proc_locks(text):
    """Set of (pid, dev_major, dev_minor, inode) of the FLOCK entries in /proc/locks text."""
    held = set()
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ 12584 fe:00:2147001 0 EOF"; "1: -> FLOCK ..." are waiters
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            held.add((pid, int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return held


def flocks_of(pid):
    """(pid, dev_major, dev_minor, inode) of the FLOCKs held through pid's open files, from /proc/PID/fdinfo.
    Exact where /proc/locks is not: the kernel serves /proc/locks a page at a time, and an entry that moves between
    two pages' reads (locks taken or dropped meanwhile by other processes) is missed."""
    try:
        tasks = sorted(os.listdir("/proc/%d/task" % pid), key=lambda tid: tid != str(pid))
    except OSError:
        return set()
    for tid in tasks:   # the leader first; a defunct leader's live threads still share its files
        base = "/proc/%d/task/%s/fdinfo" % (pid, tid)
        try:
            names = os.listdir(base)
        except OSError:
            continue
        lines = []
        for name in names:
            lines += [line.split(":", 1)[1] for line in read_text(os.path.join(base, name)).splitlines()
                      if line.startswith("lock:")]
        if names:
            return parse_proc_locks("\n".join(lines))
    return set()


def parse_nspids(status_text):
    """NSpid list (outermost first) from /proc/PID/status text, or None."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return None


def parse_cgroup_v2(cgroup_text):
    """The cgroup v2 path (the '0::' line) from /proc/PID/cgroup text, or None."""
    for line in cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip()
    return None


def in_cgroup(path, base):
    """True when cgroup path is base or below it."""
    if path is None or not base:
        return False
    base = base.rstrip("/")
    return path == base or path.startswith(base + "/")


def allocation_view(record):
    """An allocation as `labctl gpus` shows it; residue has host_pid None and residue_of the dead rank."""
    view = {"host_pid": record["host_pid"], "mib": record["mib"]}
    if record.get("residue_of") is not None:
        view["residue_of"] = record["residue_of"]
    if "gone_at" in record:
        view["freeing"] = True
    if record.get("imported_from"):
        view["imported_from"] = record["imported_from"]
    if record.get("mps"):
        view["mps"] = True
    return view


def gpu_uuid(rid, node, minor):
    return "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, "%s/%s/%d" % (rid, node, minor)))


def pci_bus_id(minor):
    slot = PCI_SLOTS[minor] if minor < len(PCI_SLOTS) else "%02X" % (0xE0 + minor)
    return "00000000:%s:00.0" % slot


def gpu_key(text):
    """("pve1", 3) from "pve1/3"."""
    node, minor = text.rsplit("/", 1)
    return node, int(minor)


def translate_pid(record, caller_pidns, mode, node_pidns=None):
    """The pid NVML reports for a record to a caller, or None when hidden (GPU_FACTS row 7).

    legacy: the host's pid; for callers on a lab node (or in its containers) the host is the node,
    so the pid in the node's pid namespace (node_pidns)."""
    if mode == "legacy":
        if node_pidns is not None and caller_pidns != pidns_inode(os.getpid()):
            for ns_inode, pid in record["chain"]:
                if ns_inode == node_pidns:
                    return pid
        return record["host_pid"]
    for ns_inode, pid in record["chain"]:
        if ns_inode == caller_pidns:
            return pid
    return None


# ---- /proc readers ----

def read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def pidns_inode(pid):
    try:
        return os.stat("/proc/%d/ns/pid" % pid).st_ino
    except OSError:
        return None


def pidns_chain(pid):
    """[(pidns inode, pid in it)] from the process's own namespace up to the daemon's."""
    nspids = parse_nspids(read_text("/proc/%d/status" % pid)) or [pid]
    inodes = []
    try:
        fd = os.open("/proc/%d/ns/pid" % pid, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = None
    while fd is not None and len(inodes) < len(nspids):
        inodes.append(os.fstat(fd).st_ino)
        try:
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
        except OSError:
            parent = None
        os.close(fd)
        fd = parent
    if fd is not None:
        os.close(fd)
    innermost_first = list(reversed(nspids))
    if len(inodes) == len(nspids):
        return list(zip(inodes, innermost_first))
    # No NS_GET_PARENT: only the innermost and the daemon's own level are known.
    chain = [(pidns_inode(pid), innermost_first[0])]
    if len(nspids) > 1:
        chain.append((pidns_inode(os.getpid()), nspids[0]))
    return chain


def proc_identity(pid):
    """[pid, start time] of a live (not zombie) process, or None."""
    text = read_text("/proc/%d/stat" % pid)
    try:
        fields = text.rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else [pid, int(fields[19])]
    except (IndexError, ValueError):
        return None


def still_alive(identity):
    return proc_identity(identity[0]) == list(identity)


def freezer_mount():
    """The cgroup v1 freezer hierarchy's mount point, or None."""
    for line in read_text("/proc/self/mountinfo").splitlines():
        left, _sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(tail) >= 3 and tail[0] == "cgroup" and "freezer" in tail[2].split(","):
            return fields[4]
    return None


def host_tid(host_pid, ns_tid):
    """The host tid of the thread of host_pid that its own PID namespace calls ns_tid, or None."""
    try:
        tids = os.listdir("/proc/%d/task" % host_pid)
    except OSError:
        return None
    for name in tids:
        nspids = parse_nspids(read_text("/proc/%d/task/%s/status" % (host_pid, name)))
        if nspids and nspids[-1] == ns_tid:
            return int(name)
    return None


def device_users(devid, exclude=()):
    """Host pids (not in exclude) that have the file devid = (major, minor, inode) open or mapped.

    The fake device files are per node, so every process of the machine is looked at: on real
    hardware any process with /dev/nvidiaN open (a monitor: nvidia-persistenced, nv-hostengine,
    dcgm-exporter, an nvmlInit) blocks a reset, not only a CUDA context."""
    major, minor, inode = devid
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        if _maps_file(name, major, minor, inode) or _has_open(name, major, minor, inode):
            found.append(int(name))
    return sorted(found)


def _maps_file(pid, major, minor, inode):
    for line in read_text("/proc/%s/maps" % pid).splitlines():
        fields = line.split(None, 5)
        if len(fields) >= 5 and fields[4] == str(inode):
            dev = fields[3].split(":")
            if len(dev) == 2 and (int(dev[0], 16), int(dev[1], 16)) == (major, minor):
                return True
    return False


def _has_open(pid, major, minor, inode):
    folder = "/proc/%s/fd" % pid
    try:
        fds = os.listdir(folder)
    except OSError:
        return False
    for fd in fds:
        try:
            st = os.stat(os.path.join(folder, fd))
        except OSError:
            continue
        if st.st_ino == inode and os.major(st.st_dev) == major and os.minor(st.st_dev) == minor:
            return True
    return False


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def peer_pid(sock):
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


# ---- the driver ----

class RequestError(Exception):
    pass


class Driver:
    def __init__(self, state_dir):
        self.state_dir = os.path.abspath(state_dir)
        self.lab_path = os.path.join(self.state_dir, "lab.json")
        self.saved_path = os.path.join(self.state_dir, "driver", "records.json")
        self.lock = threading.RLock()
        self.lab_version = None
        self.lab = {}
        self.records = []  # allocations: node, minor, dev, inode, host_pid, chain, mib
        self.leaked = {}  # (node, minor) -> MiB
        self.faults = {}  # (node, minor) -> lost|hang
        self.init_faults = {}  # node -> not_loaded
        self.health = {}  # (node, minor) -> sorted HEALTH conditions
        self.persistence = {}  # (node, minor) -> 1 where persistence mode is on (off by default)
        self._load_saved()

    # -- persistence: a restarted daemon keeps allocations, leaks and faults --
    def _load_saved(self):
        try:
            with open(self.saved_path) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return
        self.records = [dict(r, chain=[tuple(c) for c in r["chain"]]) for r in saved.get("records", [])]
        self.leaked = {gpu_key(k): v for k, v in saved.get("leaked", {}).items()}
        self.faults = {gpu_key(k): v for k, v in saved.get("faults", {}).items()}
        self.init_faults = saved.get("init_faults", {})
        self.health = {gpu_key(k): v for k, v in saved.get("health", {}).items()}
        self.persistence = {gpu_key(k): v for k, v in saved.get("persistence", {}).items()}

    def _save(self):
        data = {
            "records": self.records,
            "leaked": {"%s/%d" % k: v for k, v in self.leaked.items()},
            "faults": {"%s/%d" % k: v for k, v in self.faults.items()},
            "init_faults": self.init_faults,
            "health": {"%s/%d" % k: v for k, v in self.health.items()},
            "persistence": {"%s/%d" % k: v for k, v in self.persistence.items()},
        }
        tmp = self.saved_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.saved_path)

    # -- lab.json --
    def refresh_lab(self):
        try:
            st = os.stat(self.lab_path)
        except OSError as exc:
            raise RequestError("no lab.json in %s" % self.state_dir) from exc
        # The inode too: mtime is coarse, and lab.json is replaced by rename.
        version = (st.st_mtime_ns, st.st_ino, st.st_size)
        if version != self.lab_version:
            with open(self.lab_path) as f:
                self.lab = json.load(f)
            self.lab_version = version
        return self.lab

    def nodes(self):
        return self.refresh_lab().get("nodes", {})

    def mode(self):
        return self.refresh_lab().get("nvml_pids", "modern")

    def node_of(self, name):
        nodes = self.nodes()
        if not nodes:
            raise RequestError("lab.json has no nodes")
        if name is None:
            return next(iter(nodes))
        if name not in nodes:
            raise RequestError("unknown node %s" % name)
        return name

    def device_id(self, node, minor):
        """(dev major, dev minor, inode) of the node's fake /dev/nvidiaM, or None."""
        path = os.path.join(self.nodes()[node]["dev_dir"], "nvidia%d" % minor)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)

    # -- who is asking --
    def caller(self, pid, node_name=None):
        """(node, vmid or None, [minors in view order]) for a caller's host pid.

        A caller in a container sees that container's GPUs; one on a lab node (its cgroup below
        gpuops-lab-RID/NODE/, or its pid namespace under the node's) sees every GPU of that node,
        whatever the request names; only a caller outside every node picks the node by name."""
        cgroup = parse_cgroup_v2(read_text("/proc/%d/cgroup" % pid))
        for node, spec in self.nodes().items():
            for vmid, ct in spec.get("containers", {}).items():
                if in_cgroup(cgroup, ct.get("cgroup")):
                    return node, vmid, list(ct["minors"])
        node = self.node_of_caller(pid, cgroup) or self.node_of(node_name)
        return node, None, list(range(self.nodes()[node]["gpus"]))

    def node_of_caller(self, pid, cgroup):
        """The lab node a process outside any container runs on, or None (the host)."""
        nodes = self.nodes()
        rid = self.refresh_lab().get("rid")
        prefix = "/gpuops-lab-%s/" % rid
        if rid and cgroup and cgroup.startswith(prefix):
            name = cgroup[len(prefix):].split("/", 1)[0]
            if name in nodes:
                return name
        by_ns = {spec["pidns"]: name for name, spec in nodes.items() if spec.get("pidns")}
        if by_ns:
            for ns_inode, _pid in pidns_chain(pid):
                if ns_inode in by_ns:
                    return by_ns[ns_inode]
        return None

    # -- truth --
    def free_delay(self):
        try:
            return float(self.refresh_lab().get("free_delay_s", FREE_DELAY_S))
        except (RequestError, TypeError, ValueError):
            return FREE_DELAY_S

    def live_state(self):
        """Ages records whose last reference went (free delay, IPC hand-over, residue); returns the FLOCK
        set read now. Caller holds self.lock."""
        held = parse_proc_locks(read_text("/proc/locks"))
        # monotonic: a step of the wall clock once freed a holder's memory 0.2 s before its free delay
        now, delay = time.monotonic(), self.free_delay()
        kept, changed, confirmed = [], False, set()
        for r in self.records:
            if r.get("residue_of") is not None:
                live = any(still_alive(p) for p in r["peers"])
            else:
                key = (r["host_pid"],) + tuple(r["dev"]) + (r["inode"],)
                if key not in held and "gone_at" not in r and r["host_pid"] not in confirmed:
                    confirmed.add(r["host_pid"])    # a miss is checked in the holder's own fdinfo
                    held |= flocks_of(r["host_pid"])
                live = key in held
            if live:
                kept.append(r)
                continue
            if "gone_at" not in r:
                changed = True
                r["gone_at"] = now
                if self._hand_over(r, held):
                    continue
            if now - r["gone_at"] < delay:
                kept.append(r)
                continue
            changed = True
            residue = self._residue(r)
            if residue:
                kept.append(residue)
                logging.info("residue node=%s minor=%d of=%d mib=%d peers=%s", r["node"], r["minor"],
                             r["host_pid"], residue["mib"], [p[0] for p in residue["peers"]])
        if changed:
            self.records = kept
            self._save()
        return held

    def _hand_over(self, record, held):
        """An IPC importer still alive takes the dead exporter's memory (GPU_FACTS row 17)."""
        for importer in record.get("importers", []):
            for r in self.records:
                if (r["host_pid"] == importer[0] and r["node"] == record["node"] and r["minor"] == record["minor"]
                        and "gone_at" not in r and (r["host_pid"],) + tuple(r["dev"]) + (r["inode"],) in held):
                    r["mib"] += record["mib"]
                    r.setdefault("imported_from", []).append(record["host_pid"])
                    logging.info("ipc hand-over node=%s minor=%d from=%d to=%d mib=%d", record["node"],
                                 record["minor"], record["host_pid"], r["host_pid"], record["mib"])
                    return True
        return False

    def _residue(self, record):
        """The part of a dead rank's memory its linked peers still alive keep (GPU_FACTS row 19), or None."""
        peers = [p for p in record.get("peers", []) if still_alive(p)]
        if not peers or record.get("residue_of") is not None:
            return None
        return {"node": record["node"], "minor": record["minor"], "dev": record["dev"], "inode": record["inode"],
                "host_pid": None, "chain": [], "mib": min(RESIDUE_MIB, record["mib"]), "vmid": record.get("vmid"),
                "residue_of": record["host_pid"], "peers": peers}

    def watch(self, stop):
        """Notices released references every WATCH_INTERVAL_S, so the free delay runs from the release."""
        while not stop.wait(WATCH_INTERVAL_S):
            with self.lock:
                if not self.records:
                    continue
                try:
                    self.live_state()
                except Exception:  # keep watching; the log has the trace
                    logging.exception("watch failed")

    def gpu_truth(self, node, minor, held):
        """used (v2) MiB, records and lock holders of one GPU."""
        devid = self.device_id(node, minor)
        records = [r for r in self.records if r["node"] == node and r["minor"] == minor]
        holders = sorted({pid for (pid, ma, mi, ino) in held if devid and (ma, mi, ino) == devid})
        used = sum(r["mib"] for r in records) + self.leaked.get((node, minor), 0)
        return used, records, holders

    def owner_record(self, pid, node, minor, owner_pid):
        """The live allocation on minor of the process the caller (host pid) calls owner_pid."""
        caller_ns = pidns_inode(pid)
        for r in self.records:
            if (r["node"] == node and r["minor"] == minor and r.get("residue_of") is None and "gone_at" not in r
                    and [caller_ns, owner_pid] in [list(c) for c in r["chain"]]):
                return r
        raise RequestError("no allocation of pid %d on minor %d" % (owner_pid, minor))

    # -- requests --
    def handle(self, request, pid):
        op = request.get("op")
        with self.lock:
            if op == "snapshot" and request.get("format") == "text":
                return self.snapshot_text(pid, request.get("node"))
            if op == "snapshot":
                return self.snapshot_json(request.get("node"))
            if op == "alloc":
                return self.alloc(pid, request)
            if op == "leak":
                return self.leak(request)
            if op == "reset":
                return self.reset(pid, request)
            if op == "persistence":
                return self.set_persistence(pid, request)
            if op == "fault":
                return self.fault(request)
            if op == "hang":
                return self.hang(pid, request)
            if op == "view":
                node, vmid, minors = self.caller(pid, request.get("node"))
                return {"ok": True, "node": node, "vmid": vmid, "minors": minors}
            if op == "link":
                return self.link(pid, request)
            if op == "ipc_import":
                return self.ipc_import(pid, request)
            if op == "ping":
                return {"ok": True, "pid": os.getpid()}
        raise RequestError("unknown op %r" % op)

    def snapshot_text(self, pid, node_name):
        node, _vmid, minors = self.caller(pid, node_name)
        caller_ns = pidns_inode(pid)
        mode = self.mode()
        held = self.live_state()
        rid = self.lab.get("rid", "lab")
        lines = ["DRIVER %s" % DRIVER_VERSION, "FAULT_INIT %s" % self.init_faults.get(node, "none")]
        procs = []
        for index, minor in enumerate(minors):
            used, records, _holders = self.gpu_truth(node, minor, held)
            fault = self.faults.get((node, minor), "none")
            lines.append("DEV %d %d %s %s %d %d %d %s" % (
                index, minor, gpu_uuid(rid, node, minor), pci_bus_id(minor),
                TOTAL_MIB, RESERVED_MIB, used, fault))
            lines.append("HEALTH %d %s" % (index, " ".join(self.health.get((node, minor), [])) or "none"))
            lines.append("PERSISTENCE %d %d" % (index, self.persistence.get((node, minor), 0)))
            by_pid, mps = {}, set()
            for r in records:
                if r.get("residue_of") is not None:
                    continue  # counted in used, charged to no pid
                shown = translate_pid(r, caller_ns, mode, (self.lab["nodes"].get(node) or {}).get("pidns"))
                if shown is not None:
                    by_pid[shown] = by_pid.get(shown, 0) + r["mib"]
                    if r.get("mps"):
                        mps.add(shown)
            procs += ["PROC %d %d %d" % (index, p, m) for p, m in sorted(by_pid.items())]
            # an MPS client is in the compute list and in the MPS list (GPU_FACTS row 26)
            procs += ["MPSPROC %d %d %d" % (index, p, m) for p, m in sorted(by_pid.items()) if p in mps]
        return "\n".join(lines + procs + ["END"]) + "\n"

    def snapshot_json(self, node_name):
        nodes = self.nodes()
        names = [self.node_of(node_name)] if node_name else list(nodes)
        held = self.live_state()
        rid = self.lab.get("rid", "lab")
        gpus = []
        for node in names:
            spec = nodes[node]
            for minor in range(spec["gpus"]):
                used, records, holders = self.gpu_truth(node, minor, held)
                visible = {vmid: ct["minors"].index(minor)
                           for vmid, ct in spec.get("containers", {}).items() if minor in ct["minors"]}
                gpus.append({
                    "node": node, "minor": minor, "uuid": gpu_uuid(rid, node, minor),
                    "pci_bus_id": pci_bus_id(minor), "total_mib": TOTAL_MIB,
                    "used_mib": used, "reserved_mib": RESERVED_MIB, "v1_used_mib": used + RESERVED_MIB,
                    "leaked_mib": self.leaked.get((node, minor), 0),
                    "fault": self.faults.get((node, minor), "none"),
                    "health": self.health.get((node, minor), []),
                    "persistence_mode": self.persistence.get((node, minor), 0),
                    "visible_in": visible,
                    "nvml_pids": sorted({r["host_pid"] for r in records if r["host_pid"] is not None}),
                    "allocations": [allocation_view(r) for r in records],
                    "holders": holders,
                })
        return {"ok": True, "nvml_pids_mode": self.mode(), "gpus": gpus,
                "init_faults": {n: self.init_faults.get(n, "none") for n in names}}

    def _minor_arg(self, request, key="minor"):
        try:
            return int(request[key])
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError("%s: an integer is required" % key) from exc

    def alloc(self, pid, request):
        minor = self._minor_arg(request)
        mib = int(request.get("mib", 0))
        node, vmid, minors = self.caller(pid, request.get("node"))
        if minor not in minors:
            raise RequestError("minor %d is not visible to pid %d" % (minor, pid))
        devid = self.device_id(node, minor)
        held = self.live_state()
        if devid is not None and (pid,) + devid not in held:
            held |= flocks_of(pid)
        if devid is None or (pid,) + devid not in held:
            raise RequestError("pid %d holds no flock on %s nvidia%d" % (pid, node, minor))
        chain = pidns_chain(pid)
        for r in self.records:
            if r["host_pid"] == pid and r["node"] == node and r["minor"] == minor and "gone_at" not in r:
                r["mib"] += mib
                break
        else:
            self.records.append({"node": node, "minor": minor, "dev": list(devid[:2]), "inode": devid[2],
                                 "host_pid": pid, "chain": chain, "mib": mib, "vmid": vmid})
            if request.get("mps"):
                self.records[-1]["mps"] = True
        self._save()
        logging.info("alloc node=%s minor=%d pid=%d mib=%d chain=%s", node, minor, pid, mib, chain)
        return {"ok": True, "node": node, "minor": minor, "host_pid": pid, "mib": mib}

    def link(self, pid, request):
        """The caller keeps buffers on each peer's GPU: {"peers": [[minor, pid as the caller sees it], ...]}."""
        node, _vmid, _minors = self.caller(pid, request.get("node"))
        me = proc_identity(pid)
        if me is None:
            raise RequestError("pid %d is gone" % pid)
        peers = request.get("peers")
        if not isinstance(peers, list):
            raise RequestError("peers: a list of [minor, pid] is required")
        owners = [self.owner_record(pid, node, int(minor), int(owner)) for minor, owner in peers]
        for r in owners:
            if me not in r.setdefault("peers", []):
                r["peers"].append(me)
        self._save()
        logging.info("link node=%s pid=%d peers=%s", node, pid, [r["host_pid"] for r in owners])
        return {"ok": True, "linked": [r["host_pid"] for r in owners]}

    def ipc_import(self, pid, request):
        """The caller maps owner_pid's memory on minor; it takes that memory over when the owner dies."""
        node, _vmid, _minors = self.caller(pid, request.get("node"))
        me = proc_identity(pid)
        if me is None:
            raise RequestError("pid %d is gone" % pid)
        r = self.owner_record(pid, node, self._minor_arg(request), int(request.get("owner_pid", -1)))
        if me not in r.setdefault("importers", []):
            r["importers"].append(me)
        self._save()
        logging.info("ipc_import node=%s minor=%d pid=%d owner=%d", node, r["minor"], pid, r["host_pid"])
        return {"ok": True, "owner": r["host_pid"]}

    def leak(self, request):
        node = self.node_of(request.get("node"))
        minor = self._minor_arg(request)
        mib = int(request.get("mib", 0))
        key = (node, minor)
        self.leaked[key] = self.leaked.get(key, 0) + mib
        self._save()
        logging.info("leak node=%s minor=%d mib=%d", node, minor, mib)
        return {"ok": True, "node": node, "minor": minor, "leaked_mib": self.leaked[key]}

    def reset(self, pid, request):
        minor = self._minor_arg(request)
        node, _vmid, minors = self.caller(pid, request.get("node"))
        if minor not in minors:
            raise RequestError("minor %d is not visible to pid %d" % (minor, pid))
        held = self.live_state()
        _used, records, holders = self.gpu_truth(node, minor, held)
        listed = sorted({r["host_pid"] for r in records if r["host_pid"] is not None and "gone_at" not in r})
        devid = self.device_id(node, minor)
        users = device_users(devid, exclude=(pid, os.getpid())) if devid else []
        if self.persistence.get((node, minor)):
            logging.info("reset refused node=%s minor=%d: persistence mode on", node, minor)
            return {"ok": False, "error": "persistence mode is enabled (nvidia-smi -pm 0 first)"}
        if holders or users or listed:
            logging.info("reset refused node=%s minor=%d holders=%s users=%s nvml_pids=%s", node, minor, holders,
                         users, listed)
            return {"ok": False, "error": "in use by another process", "holders": holders, "users": users,
                    "nvml_pids": listed}
        self.leaked.pop((node, minor), None)
        self.records = [r for r in self.records if not (r["node"] == node and r["minor"] == minor)]
        # a reset applies what was pending; a failed remap and a reboot request stay
        kept = [h for h in self.health.get((node, minor), []) if h in RESET_KEEPS]
        if kept:
            self.health[(node, minor)] = kept
        else:
            self.health.pop((node, minor), None)
        self._save()
        logging.info("reset node=%s minor=%d by pid=%d", node, minor, pid)
        return {"ok": True, "node": node, "minor": minor}

    def set_persistence(self, pid, request):
        """nvidia-smi -pm: persistence mode of a GPU the caller sees (a node's, from the node)."""
        minor = self._minor_arg(request)
        node, _vmid, minors = self.caller(pid, request.get("node"))
        if minor not in minors:
            raise RequestError("minor %d is not visible to pid %d" % (minor, pid))
        if request.get("mode") not in (0, 1):
            raise RequestError("mode must be 0 or 1")
        if request["mode"]:
            self.persistence[(node, minor)] = 1
        else:
            self.persistence.pop((node, minor), None)
        self._save()
        logging.info("persistence node=%s minor=%d mode=%d by pid=%d", node, minor, request["mode"], pid)
        return {"ok": True, "node": node, "minor": minor, "mode": request["mode"]}

    def fault(self, request):
        node = self.node_of(request.get("node"))
        if "init" in request:
            if request["init"] not in INIT_FAULTS:
                raise RequestError("init fault must be one of %s" % ", ".join(INIT_FAULTS))
            if request["init"] == "none":
                self.init_faults.pop(node, None)
                self.thaw_hung(node)
            else:
                self.init_faults[node] = request["init"]
        elif "persistence" in request:
            minor = self._minor_arg(request)
            if request["persistence"] not in ("on", "off"):
                raise RequestError("persistence must be on or off")
            if request["persistence"] == "on":
                self.persistence[(node, minor)] = 1
            else:
                self.persistence.pop((node, minor), None)
        elif "health" in request:
            minor = self._minor_arg(request)
            health = request["health"]
            if health != "none" and health not in HEALTH:
                raise RequestError("health must be one of %s, or none" % ", ".join(HEALTH))
            if health == "none":
                self.health.pop((node, minor), None)
            else:
                self.health[(node, minor)] = sorted(set(self.health.get((node, minor), [])) | {health})
        else:
            minor = self._minor_arg(request)
            fault = request.get("fault")
            if fault not in FAULTS:
                raise RequestError("fault must be one of %s" % ", ".join(FAULTS))
            if fault == "none":
                self.faults.pop((node, minor), None)
                self.thaw_hung(node)
            else:
                self.faults[(node, minor)] = fault
        self._save()
        logging.info("fault %s", json.dumps(request, sort_keys=True))
        return {"ok": True}

    # -- uninterruptible hangs --
    def hang_groups(self, node):
        """Freezer groups of this node's hung NVML callers (a container's go with its `stuck-VMID-` groups)."""
        root = self.freezer_root()
        if not root or not os.path.isdir(root):
            return []
        vmids = list(self.nodes().get(node, {}).get("containers", {}))
        names = ["nvmlhang-%s" % node] + ["stuck-%s-nvmlhang" % vmid for vmid in vmids]
        return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]

    def freezer_root(self):
        mount = freezer_mount()
        return os.path.join(mount, "gpuops-lab-" + self.refresh_lab().get("rid", "lab")) if mount else None

    def hang(self, pid, request):
        """Freezes the calling thread (a cgroup v1 freezer): it is stuck in the "kernel" as in a real driver hang."""
        node, vmid, _minors = self.caller(pid, request.get("node"))
        tid = host_tid(pid, int(request.get("tid", 0)))
        root = self.freezer_root()
        if tid is None or root is None:
            raise RequestError("cannot freeze tid %s of pid %d" % (request.get("tid"), pid))
        group = os.path.join(root, "stuck-%s-nvmlhang" % vmid if vmid else "nvmlhang-%s" % node)
        os.makedirs(group, exist_ok=True)
        write_file(os.path.join(group, "tasks"), str(tid))
        write_file(os.path.join(group, "freezer.state"), "FROZEN")
        logging.info("hang node=%s vmid=%s pid=%d tid=%d frozen in %s", node, vmid, pid, tid, group)
        return {"ok": True, "tid": tid}

    def thaw_hung(self, node):
        """Thaws the node's hung callers; a group whose threads all died (they were killed) is removed."""
        groups = self.hang_groups(node)
        for group in groups:
            try:
                write_file(os.path.join(group, "freezer.state"), "THAWED")
            except OSError:
                pass
            logging.info("thawed %s", group)
        deadline = time.monotonic() + 2
        while groups and time.monotonic() < deadline:
            groups = [g for g in groups if read_text(os.path.join(g, "tasks")).strip()]
            time.sleep(0.05)
        for group in self.hang_groups(node):
            if group not in groups:
                try:
                    os.rmdir(group)
                except OSError:
                    pass
        try:
            os.rmdir(self.freezer_root())  # only when empty: a labctl lab's other freezer groups keep it
        except (OSError, TypeError):
            pass


# ---- socket server ----

class Handler(socketserver.StreamRequestHandler):
    timeout = 10  # a client that never sends its line does not keep a thread forever

    def handle(self):
        text_answer = False
        try:
            line = self.rfile.readline(MAX_REQUEST)
            request = json.loads(line)
            if not isinstance(request, dict):
                raise RequestError("request must be a JSON object")
            text_answer = request.get("format") == "text"
            answer = self.server.driver.handle(request, peer_pid(self.connection))
        except (RequestError, ValueError, KeyError, TypeError) as exc:
            answer = "ERROR %s\n" % exc if text_answer else {"ok": False, "error": str(exc)}
        except OSError as exc:  # a client that went away or never spoke
            logging.warning("request dropped: %s", exc)
            return
        except Exception as exc:  # keep serving; the log has the trace
            logging.exception("request failed")
            answer = "ERROR %s\n" % exc if text_answer else {"ok": False, "error": repr(exc)}
        if not isinstance(answer, str):
            answer = json.dumps(answer) + "\n"
        try:
            self.wfile.write(answer.encode())
        except OSError:
            pass


class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, path, driver):
        self.driver = driver
        # Bound and listening under a temporary name, then renamed: a client that finds the socket can connect.
        # Bound in place, a connect between bind and listen was refused (seen failing a lab fixture's start).
        listening = path + ".new"
        if os.path.lexists(listening):
            os.unlink(listening)
        super().__init__(listening, Handler)
        os.chmod(listening, 0o666)
        os.rename(listening, path)
        self.server_address = path


def serve(state_dir, ready_fd=None):
    driver_dir = os.path.join(state_dir, "driver")
    os.makedirs(driver_dir, exist_ok=True)
    logging.basicConfig(filename=os.path.join(driver_dir, "driver.log"), level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    sock_path = os.path.join(driver_dir, "driver.sock")
    pid_path = os.path.join(driver_dir, "driver.pid")
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    driver = Driver(state_dir)
    server = Server(sock_path, driver)
    stop_watch = threading.Event()
    threading.Thread(target=driver.watch, args=(stop_watch,), name="watch", daemon=True).start()
    with open(pid_path, "w") as f:
        f.write("%d\n" % os.getpid())

    def stop(_signum, _frame):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logging.info("listening on %s (pid %d)", sock_path, os.getpid())
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stop_watch.set()
        server.server_close()
        for path in (sock_path, pid_path):
            try:
                os.unlink(path)
            except OSError:
                pass
        logging.info("stopped")


def main(argv=None):
    parser = argparse.ArgumentParser(description="gpuops lab fake NVIDIA driver daemon")
    parser.add_argument("--state", required=True, help="lab state folder (holds lab.json)")
    parser.add_argument("--daemon", action="store_true",
                        help="detach, and return once the socket listens")
    args = parser.parse_args(argv)
    state_dir = os.path.abspath(args.state)
    if not args.daemon:
        serve(state_dir)
        return 0
    read_end, write_end = os.pipe()
    if os.fork() > 0:
        os.close(write_end)
        with os.fdopen(read_end) as ready:
            ok = ready.readline().strip() == "ready"
        if not ok:
            print("labdriver: failed to start, see %s/driver/driver.log" % state_dir, file=sys.stderr)
        return 0 if ok else 1
    os.close(read_end)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    try:
        serve(state_dir, ready_fd=write_end)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
