# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Proxmox node's view: containers of processes, container configs, scope (private helper).

On a Proxmox VE node every container process is a node process. Its container is the
first `lxc/VMID/ns` in its cgroup path (pve-container sets lxc.cgroup.dir.container =
lxc/VMID and .inner = ns); anything before is a prefix, anything after is nesting.
No AnsibleModule here.
"""

from __future__ import annotations

import os
import re
import stat as stat_mod

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _pveconf as pveconf

PVE_LXC_DIR = "/etc/pve/lxc"
PVE_NODES_DIR = "/etc/pve/nodes"
PVE_HA_RESOURCES = "/etc/pve/ha/resources.cfg"
PROXMOX_MARKERS = ("/etc/pve", "/usr/sbin/pct")
HOST = "host"
UNATTRIBUTED = "unattributed"
# the node's own tools (service managers, MPS control) run from these folders only, never from a path a process names
SYSTEM_BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
OWN_NAMESPACES = ("pid", "mnt")
_USER_SLICE_RE = re.compile(r"(?:^|/)(?:user\.slice|user@[^/]*\.service)(?:/|$)")

_CONTAINER_RE = re.compile(r"(?:^|/)lxc/(\d+)/ns(/.*)?$")
# what runs inside a container from the node (lxc-attach, as pct exec does) finds its tools in these folders only
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def attach_argv(vmid, argv, attach="lxc-attach"):
    """argv run inside container vmid by the node, with a clean environment and CONTAINER_PATH (no pct start-up)."""
    return [attach, "-n", str(vmid), "--clear-env", "--set-var", "PATH=" + CONTAINER_PATH, "--"] + list(argv)


def vmid_key(vmid):
    """The one key type of a vmid inside the engine: the string a cgroup path writes (lxc/101/ns), whether it came
    as an int (options, results) or a string (evidence); None stays None. Results carry vmids as ints."""
    return None if vmid is None else str(int(vmid))


def container_of_cgroup(path):
    """The vmid (a string) of the first lxc/VMID/ns in a cgroup path, or None."""
    match = _CONTAINER_RE.search(path or "")
    return match.group(1) if match else None


def inner_cgroup(path):
    """The cgroup path inside its container (after the first lxc/VMID/ns), or None outside any container."""
    match = _CONTAINER_RE.search(path or "")
    return (match.group(2) or "/") if match else None


def where_of_cgroup(path):
    """The vmid of a cgroup path's container, HOST when it names none, None (unknown) when it is unread or empty, or
    when a user's slice (user.slice, user@UID.service) comes before its lxc/VMID/ns: a node user may name a cgroup of
    its own so, and is never a container's."""
    if not path:
        return None
    match = _CONTAINER_RE.search(path)
    if match is None:
        return HOST
    return None if _USER_SLICE_RE.search(path[:match.start() + 1]) else match.group(1)


def in_user_slice(path):
    """True when a cgroup path is a user's (user.slice, or a user's own manager user@UID.service)."""
    return bool(_USER_SLICE_RE.search(path or ""))


def container_of_pid(pid, proc_root="/proc", table=None):
    """The vmid of a live pid, HOST when it is in no container, None when it cannot be read (unknown, never HOST).

    table: a scan with cgroups, whose reading is used for the pids it read (the same snapshot).
    """
    if table is not None and pid in table.cgroups:
        path = table.cgroups[pid]
    else:
        path = procscan.read_cgroup(pid, proc_root)
    return where_of_cgroup(path)


def _namespaces(pid, proc_root):
    """{kind: inode} of pid's pid and mount namespaces (pid may be "self"); None when one cannot be read."""
    out = dict((kind, procscan.namespace_inode(pid, kind, proc_root)) for kind in OWN_NAMESPACES)
    return None if None in out.values() else out


def in_own_namespaces(pid, proc_root="/proc"):
    """True when pid's pid and mount namespaces were read and are this reader's own (on a node: the node's), False
    when read and different, None (unknown) when either side cannot be read: never taken for the node's."""
    mine, its = _namespaces("self", proc_root), _namespaces(pid, proc_root)
    if mine is None or its is None:
        return None
    return mine == its


def root_owned(pid, proc_root="/proc"):
    """True when every uid of pid (real, effective, saved, filesystem) is 0; False otherwise, or when unreadable."""
    try:
        uids = procscan.parse_status(procscan.read_text("%s/%d/status" % (proc_root, pid))).get("uids")
    except OSError:
        return False
    return bool(uids) and all(uid == 0 for uid in uids)


def node_root_process(pid, proc_root="/proc"):
    """A process of the node's own root: in the node's pid and mount namespaces (read, never assumed) and root's."""
    return in_own_namespaces(pid, proc_root) is True and root_owned(pid, proc_root)


def overflow_id(kind="uid"):
    """The uid (or gid) an owner this user namespace does not map shows as (/proc/sys/fs/overflowuid)."""
    try:
        with open("/proc/sys/fs/overflow%s" % kind) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return 65534


def _initial_user_namespace():
    """True in the node's own user namespace (the identity map of every uid), where the overflow uid is a real user
    (nobody), whose files are no root's; False in a user namespace (a lab node), where it is an unmapped owner."""
    try:
        with open("/proc/self/uid_map") as handle:
            return handle.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


def system_tool(name, dirs=None):
    """The path of tool name in a fixed system folder: a regular executable file that only root may write (owned by
    root, or by no one mapped here: a read-only rootfs seen from a user namespace); None when there is none."""
    for folder in SYSTEM_BIN_DIRS if dirs is None else dirs:
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        owner_ok = st.st_uid == 0 or (st.st_uid == overflow_id("uid") and not _initial_user_namespace())
        if stat_mod.S_ISREG(st.st_mode) and owner_ok and st.st_mode & 0o111 and not st.st_mode & 0o022:
            return path
    return None


def pid_in_container(nspid):
    """The pid at the level of the container init's PID namespace (one below the node's), or None.

    NSpid lists the pid from the reader's namespace inwards; an LXC container's namespace is a child
    of the node's, so Docker inside LXC still gives the LXC-level pid.
    """
    if nspid and len(nspid) > 1:
        return nspid[1]
    return None


def on_proxmox_node():
    return any(os.path.exists(p) for p in PROXMOX_MARKERS)


def init_environ_has_container(proc_root="/proc"):
    """True/False from pid 1's environment (LXC, podman, systemd-nspawn set container=); None when unreadable."""
    try:
        raw = procscan.read_bytes("%s/1/environ" % proc_root)
    except OSError:
        return None
    return any(item.startswith(b"container=") for item in raw.split(b"\0"))


# ---- container configs (/etc/pve/lxc/VMID.conf)
def parse_pve_conf(text):
    """The main section of a container config: {"keys": {key: value}, "minors": [GPU minors it can use],
    "devices": [every /dev/nvidiaN passed in, with "usable"]}, by the parser the inventory uses (_pveconf)."""
    config = pveconf.config_from_text(text)
    devices = pveconf.gpu_passthrough(config)
    keys = dict((k, v) for k, v in config.items() if k != "lxc")
    for key, value in config.get("lxc") or ():
        keys.setdefault(key, value)
    return {"keys": keys, "minors": sorted(d["minor"] for d in devices if d["usable"]), "devices": devices}


def device_minor(path, by_name):
    """The GPU minor of the node's device at path: its st_rdev when it is a character device (195:N, N < 254;
    another device: None), else (missing, or the lab's regular file) by_name, the minor its name says."""
    try:
        st = os.stat(path)
    except OSError:
        return by_name
    return procscan.rdev_gpu_minor(st) if stat_mod.S_ISCHR(st.st_mode) else by_name


def resolve_devices(parsed, dev_root="/"):
    """A parsed config with each passed device's minor read from the node's device (st_rdev), not its name:
    Proxmox lets /dev/nvidia3 be bound in as dev/nvidia0, and a name is only a name. "name_minor" keeps what the
    name said where the two differ."""
    devices = []
    for dev in parsed["devices"]:
        minor = device_minor(os.path.join(dev_root, dev["device"].lstrip("/")), dev["minor"])
        devices.append(dict(dev, minor=minor, name_minor=dev["minor"]) if minor != dev["minor"] else dev)
    minors = sorted(d["minor"] for d in devices if d["usable"] and d["minor"] is not None)
    return dict(parsed, devices=devices, minors=minors)


def dev_minors(entries):
    """{minor: [names]} of the GPU character devices (195:N, N < 254) among a folder's entries (procscan.list_folder:
    a container's /dev, read bounded), by st_rdev whatever their names. None when they hold /dev/nvidiaN stand-ins
    that are not devices (the lab)."""
    out = {}
    for entry in sorted(entries, key=lambda e: e["name"]):
        if stat_mod.S_ISCHR(entry["mode"]):
            minor = procscan.rdev_minor(entry["rdev"])
            if minor is not None:
                out.setdefault(minor, []).append(entry["name"])
        elif re.match(r"^nvidia\d+$", entry["name"]) and stat_mod.S_ISREG(entry["mode"]):
            return None
    return out


def check_devices(confs, seen):
    """The running containers' devices against their configs, by device number.

    confs: {vmid: resolved config}; seen: {vmid: dev_minors() of the container's /dev, read through one of its
    processes}. Returns ({vmid: minors its /dev holds}, [findings]): a GPU in a container's /dev counts as passed
    in whatever the config says, and each difference is a finding (one its config passes in unusable is none:
    passed_unusable names it)."""
    held, lines = {}, []
    for vmid in sorted(seen, key=int):
        found = seen[vmid]
        if found is None:
            continue
        held[vmid] = sorted(found)
        conf = (confs or {}).get(vmid)
        if conf is None:
            continue
        configured = set(conf["minors"])
        denied = set(d["minor"] for d in conf.get("devices") or () if not d["usable"])    # passed_unusable says them
        extra = sorted(set(found) - configured - denied)
        missing = sorted(configured - set(found))
        renamed = ["%s is minor %d" % (name, m) for m in sorted(found) for name in found[m] if name != "nvidia%d" % m]
        if extra:
            names = ", ".join(n for m in extra for n in found[m])
            lines.append("container %s: its /dev holds GPU minor %s (%s), which its config does not pass in; it is "
                         "counted as that container's" % (vmid, ", ".join(str(m) for m in extra), names))
        if missing:
            lines.append("container %s: its config passes in GPU minor %s, but its /dev holds no such device (a "
                         "bind that failed, or a config changed since it started: restart it to apply)"
                         % (vmid, ", ".join(str(m) for m in missing)))
        if renamed:
            lines.append("container %s: %s by its device number: names are not GPUs, its GPUs are read by number"
                         % (vmid, "; ".join(renamed)))
    return held, lines


def read_pve_confs(conf_dir=PVE_LXC_DIR):
    """{vmid: parsed config} of this node's containers; None when the directory cannot be read."""
    try:
        names = os.listdir(conf_dir)
    except OSError:
        return None
    out = {}
    for name in names:
        match = re.match(r"^(\d+)\.conf$", name)
        if not match:
            continue
        try:
            with open(os.path.join(conf_dir, name)) as f:
                out[match.group(1)] = resolve_devices(parse_pve_conf(f.read()))
        except OSError:
            continue
    return out


def _conf_vmids(folder):
    """Sorted vmids (ints) of the VMID.conf files in folder; raises OSError when it cannot be listed."""
    return sorted(int(m.group(1)) for m in (re.match(r"^(\d+)\.conf$", n) for n in os.listdir(folder)) if m)


def configured_containers(conf_dir=None, nodes_dir=None):
    """The evidence of which containers this node runs, from pmxcfs: {"node": this node's name (where
    /etc/pve/lxc links to; None when unknown), "here": sorted vmids (ints) with a config in /etc/pve/lxc, None when
    it cannot be listed, "error": why not (or None), "elsewhere": {vmid: node} of the configs in the other nodes'
    folders (/etc/pve/nodes/NODE/lxc)}.

    pve-container keeps a container's config in /etc/pve/nodes/NODE/lxc/VMID.conf, on the node that runs it;
    /etc/pve/lxc is a link to the local node's folder, so a config there is a container of this node, and only
    this node can run it. Reading only: the decision is _decide.unconfigured_containers'."""
    conf_dir, nodes_dir = conf_dir or PVE_LXC_DIR, nodes_dir or PVE_NODES_DIR
    out = {"node": None, "here": None, "error": None, "elsewhere": {}}
    try:
        target = os.readlink(conf_dir)
    except OSError:
        target = ""
    match = re.search(r"(?:^|/)nodes/([^/]+)/lxc/?$", target)
    out["node"] = match.group(1) if match else None
    try:
        out["here"] = _conf_vmids(conf_dir)
    except OSError as exc:
        out["error"] = "%s: %s" % (conf_dir, exc.strerror or exc)
        return out
    try:
        nodes = sorted(os.listdir(nodes_dir))
    except OSError:
        nodes = []
    for name in nodes:
        if name == out["node"]:
            continue
        try:
            vmids = _conf_vmids(os.path.join(nodes_dir, name, "lxc"))
        except OSError:
            continue
        for vmid in vmids:
            if vmid not in out["here"]:
                out["elsewhere"].setdefault(vmid, name)
    return out


def locked_containers(vmids, conf_dir=PVE_LXC_DIR):
    """{vmid: why} for the vmids whose config carries a lock (backup, migrate, snapshot ...): left out of a release."""
    confs = read_pve_confs(conf_dir) or {}
    out = {}
    for vmid in vmids:
        lock = ((confs.get(str(vmid)) or {}).get("keys") or {}).get("lock")
        if lock:
            out[str(vmid)] = ("container %s is locked (%s): a backup, migration or snapshot is running; nothing of it "
                              "was signalled or stopped; release it again when the lock is gone" % (vmid, lock))
    return out


def passed_into(confs, minor):
    """Sorted vmids (ints) whose config passes GPU minor in; None when the configs are unreadable."""
    if confs is None or minor is None:
        return None
    return sorted(int(v) for v, c in confs.items() if minor in c["minors"])


def passed_unusable(confs, minor):
    """The containers whose config passes GPU minor in but that cannot open it: [{vmid (int), source (the config key),
    device (on the node), rule (deny-write, or the raw cgroup rule that blocks it)}] by vmid; None when the configs
    are unreadable."""
    if confs is None or minor is None:
        return None
    return [{"vmid": int(vmid), "source": dev["source"], "device": dev["device"], "rule": dev.get("rule")}
            for vmid in sorted(confs, key=int) for dev in confs[vmid]["devices"]
            if dev["minor"] == minor and not dev["usable"]]


def read_ha_resources(path=PVE_HA_RESOURCES):
    """{vmid: state} of containers managed by HA (ct: VMID sections); {} when there is no such file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    out, current = {}, None
    for line in text.splitlines():
        match = re.match(r"^(ct|vm):\s*(\d+)\s*$", line)
        if match:
            current = match.group(2) if match.group(1) == "ct" else None
            if current:
                out[current] = "started"
            continue
        parts = line.split()
        if current and len(parts) == 2 and parts[0] == "state":
            out[current] = parts[1]
    return out


# ---- the node's view of NVML memory, by container
def by_container(procs, used_mib, holders, proc_root="/proc", stale=(), index=None, table=None):
    """MiB per container of one GPU (index) from NVML's node view; the values add up to used_mib.

    A pid NVML names but /proc no longer has (a dead parent whose fork child keeps the
    memory, GPU_FACTS row 5) is charged to the container of the holder that is its heir
    (its process group or session), else to the one container whose holders were pinned to
    this GPU by that dead pid's memory (evidence dead_pid: the evidence that plans them).
    A stale entry (stale: pids whose entry on this GPU pins nobody) is unattributed: never
    charged to the container of the live process that has that number.
    """
    out = {}
    known = dict((h["pid"], h.get("container")) for h in holders if h["pid"] not in stale)
    heirs = {}
    for holder in holders:
        for dead in holder.get("heir_of") or ():
            heirs.setdefault(dead, holder.get("container"))
    pinned_by_dead = set(h.get("container") for h in holders
                         if index in (h.get("shares_mib") or {}) and "dead_pid" in (h.get("evidence") or ()))
    orphan_heir = pinned_by_dead.pop() if len(pinned_by_dead) == 1 else None
    listed = 0
    for proc in procs or ():
        mib = proc.get("used_mib") or 0
        listed += mib
        gone = None if proc["pid"] in stale else container_of_pid(proc["pid"], proc_root, table)
        where = (known.get(proc["pid"]) or gone or heirs.get(proc["pid"])
                 or (orphan_heir if proc["pid"] not in stale else None) or UNATTRIBUTED)
        out[where] = out.get(where, 0) + mib
    if used_mib is not None and used_mib > listed:
        out[UNATTRIBUTED] = out.get(UNATTRIBUTED, 0) + used_mib - listed
    return dict(sorted(out.items()))


# ---- scope: which processes a node-side release may signal
class Scope(object):
    """Containers (vmids) whose processes may be signalled, and whether processes in no container may be."""

    def __init__(self, containers=(), host_processes=False, proc_root="/proc"):
        self.containers = set(str(c) for c in containers)
        self.host_processes = bool(host_processes)
        self.proc_root = proc_root

    def allows(self, where):
        return where in self.containers or (where == HOST and self.host_processes)

    def reason(self, record):
        """Why record is out of scope (None when in scope)."""
        where = record.get("container")
        if where is None:
            return "its container cannot be read"
        if self.allows(where):
            return None
        if where == HOST:
            return "a process of the node itself, in no container (host_processes is false)"
        return "in container %s, which is not in `containers`" % where

    def recheck(self, record):
        """Membership read again at signal time; None when still in scope."""
        where = container_of_pid(record["pid"], self.proc_root)
        if where is None:
            return "pid %d: its container can no longer be read (unknown, never the node)" % record["pid"]
        if where != record.get("container") or not self.allows(where):
            return "pid %d moved to %s, out of scope" % (record["pid"], "the node" if where == HOST else "container " + where)
        return None

    def describe(self):
        parts = ["containers %s" % ", ".join(sorted(self.containers, key=int))] if self.containers else []
        if self.host_processes:
            parts.append("processes in no container")
        return " and ".join(parts) or "nothing"


def container_inits(proc_root="/proc", table=None):
    """{vmid: pid of its init}, from the processes whose NSpid is (node pid, 1) in an lxc/VMID/ns cgroup.

    With a table (a scan with cgroups), only the processes whose parent is outside their container are read.
    """
    out = {}
    if table is not None and table.cgroups:
        names = [str(pid) for pid, path in table.cgroups.items() if container_of_cgroup(path)
                 and container_of_cgroup(table.cgroups.get(table.stats[pid]["ppid"])) != container_of_cgroup(path)]
    else:
        names = os.listdir(proc_root)
    for name in names:
        if not name.isdigit():
            continue
        try:
            status = procscan.parse_status(procscan.read_text("%s/%s/status" % (proc_root, name)))
        except OSError:
            continue
        nspid = status.get("nspid") or []
        if len(nspid) != 2 or nspid[1] != 1:
            continue
        vmid = container_of_pid(int(name), proc_root, table)
        if vmid and vmid != HOST:
            out[vmid] = int(name)
    return out


def owner_of(pid, proc_root="/proc"):
    """(uid, gid) of a process on the node: container root is 100000 in an unprivileged container."""
    st = os.stat("%s/%d" % (proc_root, pid))
    return st.st_uid, st.st_gid


def processes_by_container(proc_root="/proc", table=None):
    """{vmid: [{pid, container_pid, name}]} of every process in a container, in one walk of /proc (the
    table's, a scan with cgroups, when given)."""
    out = {}
    names = [str(pid) for pid in sorted(table.cgroups)] if table is not None and table.cgroups else os.listdir(proc_root)
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        vmid = container_of_pid(pid, proc_root, table)
        if vmid in (None, HOST):
            continue
        try:
            status = procscan.parse_status(procscan.read_text("%s/%d/status" % (proc_root, pid)))
        except OSError:
            continue
        out.setdefault(vmid, []).append({"pid": pid, "container_pid": pid_in_container(status.get("nspid")),
                                         "name": status.get("name")})
    return out
