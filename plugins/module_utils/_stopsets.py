# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stop sets, read from the node (private helper, evidence): what a stop bigger than one process would take.

A container's holder may run under its own grouping of one program: a systemd unit (the processes of its cgroup,
inside the container: lxc/VMID/ns/system.slice/NAME.service), a user's unit (user@UID.service/.../NAME.service,
stopped through that user's manager), a supervisord program (its process, which supervisord starts with
SUPERVISOR_PROCESS_NAME in its environment, and that process's tree), or a docker container (the processes under
its containerd shim, or of its cgroup). This file reads which grouping is the innermost one above a holder, never
past the container's init, and every member of it with why it is a member. Whether it may be stopped is the decide
layer's (_decide.stop_set_verdict); its stop is the act layer's (_units). A holder in a container nested inside the
container has no stop set. No AnsibleModule here.
"""

from __future__ import annotations

import os
import re
import subprocess

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _jobs as jobs
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

# names passed to the container's manager (argv, no shell): a unit may carry systemd's \x escapes
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\][A-Za-z0-9:_.@\\-]*\.(?:service|scope)$")   # never an option (-x)
_PROGRAM_RE = re.compile(r"^[A-Za-z0-9:_.@-]+$")
# docker's cgroup inside the container, only where docker's own manager puts it (never in a user's delegated subtree)
_DOCKER_CGROUP_RE = re.compile(r"^(?:/system\.slice/docker-([0-9a-f]{64})\.scope|/docker/([0-9a-f]{64}))(?:/|$)")
_SHIM_CGROUPS = ("/system.slice/containerd.service", "/system.slice/docker.service")
_CONFIG_RE = re.compile(r"^/[A-Za-z0-9._/-]+$")   # a supervisord -c passed to supervisorctl: a plain absolute path
_DOCKER_ID_RE = re.compile(r"^[0-9a-f]{64}$")
_USER_MANAGER_RE = re.compile(r"^user@(\d+)\.service$")
SHIM_PREFIX = "containerd-shim"   # comm of containerd-shim-runc-v2 (15 characters kept)
CHAIN_MAX = 64
SHELLS = ("sh", "bash", "dash", "zsh", "ksh", "fish", "tcsh", "csh")
DEPENDENT_PROPERTIES = ("RequiredBy", "BoundBy", "ConsistsOf")   # units a stop of this one stops too
LIVE_STATES = ("active", "activating", "reloading", "deactivating")


def docker_shim_id(pid, proc_root):
    """The docker container id a containerd shim runs (`-namespace moby -id ID`), or None."""
    argv = jobs.read_argv(pid, proc_root)
    options = dict(zip(argv, argv[1:]))
    found = options.get("-id")
    return found if options.get("-namespace") == "moby" and found and _DOCKER_ID_RE.match(found) else None


def supervisord_config(pid, proc_root):
    """The -c/--configuration of a supervisord process (a path inside its container), or None."""
    argv = jobs.read_argv(pid, proc_root)
    for i, arg in enumerate(argv):
        if arg in ("-c", "--configuration") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--configuration="):
            return arg.split("=", 1)[1]
    return None


def supervisord_program(pid, proc_root):
    """GROUP:NAME of pid, a program's process (supervisord puts SUPERVISOR_PROCESS_NAME and SUPERVISOR_GROUP_NAME in
    its environment), or None."""
    env = procscan.read_environ(pid, proc_root, ("SUPERVISOR_PROCESS_NAME", "SUPERVISOR_GROUP_NAME"))
    name = env.get("SUPERVISOR_PROCESS_NAME")
    group = env.get("SUPERVISOR_GROUP_NAME") or name
    if not name or not _PROGRAM_RE.match(name) or not _PROGRAM_RE.match(group):
        return None
    return "%s:%s" % (group, name)


def systemd_unit(inner):
    """(manager uid or None for the system manager, unit path, unit name) of a cgroup path inside a container: the
    first component below the slices is the system manager's unit; inside user@UID.service, the first one below that
    user's slices is the user manager's. None when the path names no unit (a nested container's cgroup, docker's
    cgroupfs folder, the container's root)."""
    parts = [p for p in str(inner or "").split("/") if p]
    uid, at = None, 0
    while True:
        while at < len(parts) and parts[at].endswith(".slice"):
            at += 1
        if at >= len(parts):
            return None
        manager = _USER_MANAGER_RE.match(parts[at])
        if manager is None or uid is not None or at + 1 >= len(parts):
            break
        uid, at = int(manager.group(1)), at + 1
    name = parts[at]
    if not name.endswith((".service", ".scope")):
        return None
    return uid, "/" + "/".join(parts[:at + 1]), name


class Processes(object):
    """The processes of one container in one walk: stat, inner cgroup and children, from the snapshot's table when
    it has them, else read now (bounded readers)."""

    def __init__(self, vmid, proc_root="/proc", table=None):
        self.vmid, self.proc_root = str(vmid), proc_root
        self.stats, self.inner, self._status = {}, {}, {}
        self._init_uid = ()   # unread
        stats = getattr(table, "stats", None) or {}
        cgroups = getattr(table, "cgroups", None) or {}
        pids = sorted(cgroups) if cgroups else [int(n) for n in os.listdir(proc_root) if n.isdigit()]
        for pid in pids:
            cgroup = cgroups[pid] if pid in cgroups else procscan.read_cgroup(pid, proc_root)
            if node.where_of_cgroup(cgroup) != self.vmid:
                continue
            stat = stats.get(pid) or procscan.read_stat(pid, proc_root)
            if stat is not None:
                self.stats[pid], self.inner[pid] = stat, node.inner_cgroup(cgroup)
        self.children = {}
        for pid, stat in self.stats.items():
            self.children.setdefault(stat["ppid"], []).append(pid)

    def name(self, pid):
        stat = self.stats.get(pid)
        return stat["comm"] if stat else None

    def status(self, pid):
        """parse_status of pid ({} when it cannot be read), read once."""
        if pid not in self._status:
            try:
                self._status[pid] = procscan.parse_status(procscan.read_text("%s/%d/status" % (self.proc_root, pid)))
            except OSError:
                self._status[pid] = {}
        return self._status[pid]

    def uid(self, pid):
        return self.status(pid).get("uid")

    def depth(self, pid):
        """How many PID namespaces deep pid is, as NSpid lists them from the node; None when it cannot be read."""
        return len(self.status(pid).get("nspid") or ()) or None

    def init_uid(self):
        """The uid (as the node sees it) of the container's init: pid 1 of the container's PID namespace, whose
        parent is outside it; None when it cannot be told. Read once."""
        if self._init_uid == ():
            tops = [p for p, stat in self.stats.items() if stat["ppid"] not in self.stats]
            inits = [p for p in tops if (self.status(p).get("nspid") or [0])[-1] == 1]
            self._init_uid = self.uid(inits[0]) if len(inits) == 1 else None
        return self._init_uid

    def tree(self, top):
        """top and every process below it in this container."""
        out, todo = [], [top]
        while todo and len(out) < 1 << 16:
            pid = todo.pop()
            out.append(pid)
            todo.extend(self.children.get(pid, ()))
        return sorted(out)

    def chain(self, pid):
        """pid and its ancestors inside this container, holder first; the container's init last (when reached)."""
        out = []
        while pid in self.stats and pid not in out and len(out) < CHAIN_MAX:
            out.append(pid)
            pid = self.stats[pid]["ppid"]
        return out


def _main(procs, pid, proc_root):
    stat = procs.stats.get(pid) or {}
    name = stat.get("comm")
    shell = name in SHELLS and stat.get("session") == pid and bool(stat.get("tty_nr"))
    return {"pid": pid, "name": name, "session_shell": shell}


def _entry(vmid, kind, name, argv, main, members, chain, evidence, manager_uid=None):
    return {"vmid": int(vmid), "kind": kind, "name": name, "argv": argv, "main": main, "members": members,
            "chain": chain, "evidence": evidence, "manager_uid": manager_uid, "problem": None}


def no_set(vmid, problem, chain=()):
    """A holder's answer when it has no stop set: problem says why (a nested container, a chain that cannot be
    read, a manager that cannot be trusted)."""
    return {"vmid": int(vmid), "kind": None, "name": None, "argv": None, "main": None, "members": [],
            "chain": list(chain), "evidence": problem, "manager_uid": None, "problem": problem}


def _members(procs, pids, why):
    return [{"pid": p, "name": procs.name(p), "uid": procs.uid(p), "why": why(p)} for p in sorted(pids)]


def _shims(procs, container_id):
    """The containerd shims of docker container container_id that docker itself runs: the container's root's, in
    containerd's or docker's unit (a user's renamed script names any id it likes)."""
    root = procs.init_uid()
    out = []
    for pid, stat in procs.stats.items():
        inner = procs.inner.get(pid) or ""
        if not stat["comm"].startswith(SHIM_PREFIX) or root is None or procs.uid(pid) != root:
            continue
        if inner.startswith(_SHIM_CGROUPS) and docker_shim_id(pid, procs.proc_root) == container_id:
            out.append(pid)
    return out


def _docker_members(procs, container_id):
    """Every process docker stop would end: of the docker container's cgroup, and under each of its shims."""
    prefixes = ("/system.slice/docker-%s.scope" % container_id, "/docker/%s" % container_id)
    pids = set(p for prefix in prefixes for p in _in_cgroup(procs, prefix))
    for shim in _shims(procs, container_id):
        pids.update(p for p in procs.tree(shim) if p != shim)
    return _members(procs, pids, lambda p: "of docker container %s (its cgroup, or under its containerd-shim)"
                    % container_id[:12])


def _docker(procs, chain, vmid, proc_root):
    """The docker container above the holder: a shim docker runs in its chain, or docker's cgroup; or None."""
    for below, shim in zip(chain, chain[1:]):
        if (procs.name(shim) or "").startswith(SHIM_PREFIX):
            container_id = docker_shim_id(shim, proc_root)
            if container_id and shim in _shims(procs, container_id):
                return _docker_entry(procs, chain, vmid, container_id, "pid %d runs under containerd-shim (pid %d on "
                                     "the node) as docker container %s" % (below, shim, container_id[:12]))
    found = _DOCKER_CGROUP_RE.match(procs.inner.get(chain[0]) or "")
    if found is None:
        return None
    return _docker_entry(procs, chain, vmid, found.group(1) or found.group(2),
                         "its cgroup in the container is %s" % procs.inner[chain[0]])


def _docker_entry(procs, chain, vmid, container_id, evidence):
    """A docker container's set: its main process is its entrypoint, the first started of the processes its shims
    or its cgroup's parent started (a `docker exec`'d one is a member, never its main)."""
    members = _docker_members(procs, container_id)
    tops = sorted(_tops(procs, [m["pid"] for m in members]), key=lambda p: (procs.stats[p]["starttime"], p))
    none = {"pid": None, "name": None, "session_shell": False, "tops": []}
    main = _main(procs, tops[0], procs.proc_root) if tops else none
    return _entry(vmid, "docker", container_id[:12], ["docker", "stop", container_id], main, members, chain, evidence)


def _in_cgroup(procs, path):
    return [p for p, inner in procs.inner.items() if inner == path or (inner or "").startswith(path + "/")]


def _tops(procs, pids):
    """The members whose parent is no member: the processes the set's manager started."""
    inside = set(pids)
    return sorted(p for p in pids if procs.stats[p]["ppid"] not in inside)


def _by_cgroup(procs, pids, proc_root):
    tops = _tops(procs, pids)
    if len(tops) == 1:
        return _main(procs, tops[0], proc_root)
    return {"pid": None, "name": None, "session_shell": False, "tops": tops}


def _supervisord(procs, chain, vmid, proc_root):
    """The supervisord program above the holder: a set, a no_set() when its supervisord cannot be trusted, or None."""
    for below, parent in zip(chain, chain[1:]):
        if procs.name(parent) != "supervisord":
            continue
        program = supervisord_program(below, proc_root)
        if program is None:
            return None
        problem = _supervisord_problem(procs, parent)
        if problem:
            return no_set(vmid, problem, chain)
        conf = supervisord_config(parent, proc_root)
        programs = [c for c in procs.children.get(parent, ()) if supervisord_program(c, proc_root) == program]
        members = _members(procs, set(p for c in programs + [below] for p in procs.tree(c)), lambda p: (
            "a process of program %s (started by supervisord pid %d, or below one)" % (program, parent)))
        argv = ["supervisorctl"] + (["-c", conf] if conf else []) + ["stop", program]
        return _entry(vmid, "supervisord", program, argv, _main(procs, below, proc_root), members, chain,
                      "pid %d runs under supervisord (pid %d on the node) as program %s" % (below, parent, program))
    return None


def _supervisord_problem(procs, pid):
    """Why a supervisord's program may not be stopped by name (supervisorctl reaches the program of that name of the
    supervisord its config names), or None: it must be the container's only one, its root's, with a plain -c."""
    others = [p for p in procs.stats if procs.name(p) == "supervisord" and p != pid]
    if others:
        return "container %s runs more than one supervisord (pids %s): a program's name cannot tell which" % (
            procs.vmid, ", ".join(str(p) for p in sorted(others + [pid])))
    root = procs.init_uid()
    if root is None or procs.uid(pid) != root:
        return "supervisord pid %d is not the container's root's (uid %s)" % (pid, procs.uid(pid))
    conf = supervisord_config(pid, procs.proc_root)
    if conf is not None and not _CONFIG_RE.match(conf):
        return "supervisord pid %d's -c is not a plain absolute path" % pid
    return None


def _systemd(procs, holder, chain, vmid, proc_root):
    unit = systemd_unit(procs.inner.get(holder))
    if unit is None or not unit[2].endswith(".service") or not _UNIT_RE.match(unit[2]):
        return None   # a scope (a login's session, docker's, init's) is started by another manager: no unit to stop
    uid, path, name = unit
    pids = _in_cgroup(procs, path)
    members = _members(procs, pids, lambda p: "in the unit's cgroup %s" % path)
    manager = [] if uid is None else ["--user", "-M", "%d@" % uid]
    return _entry(vmid, "systemd" if uid is None else "systemd-user", name, ["systemctl"] + manager + ["stop", name],
                  _by_cgroup(procs, pids, proc_root), members, chain,
                  "its cgroup in the container is %s" % procs.inner[holder], manager_uid=uid)


def find(record, proc_root="/proc", table=None, procs=None):
    """The stop set of a container's holder (record, node view): the innermost grouping of one program above it, as
    read now; a no_set() with its problem; or None for a process in no container. Keys: vmid, kind (systemd,
    systemd-user, supervisord, docker), name, argv (its stop, run inside the container), main ({pid, name,
    session_shell}; pid None with tops when the unit's cgroup has several), members ([{pid, name, why}]), chain (the
    holder and its ancestors in the container, its init last), evidence, manager_uid, problem."""
    vmid = record.get("container")
    if not vmid or vmid in (node.HOST, node.UNATTRIBUTED):
        return None
    procs = procs or Processes(vmid, proc_root, table)
    chain = procs.chain(record["pid"])
    if not chain:
        return no_set(vmid, "pid %d could not be read in container %s" % (record["pid"], vmid))
    depth, init_depth = procs.depth(chain[0]), procs.depth(chain[-1])
    found = _docker(procs, chain, vmid, proc_root)
    if found is not None:
        return found
    if depth is None or init_depth is None:
        return no_set(vmid, "the PID namespaces of pid %d and its container's init could not be read" % record["pid"],
                      chain)
    if depth > init_depth:
        return no_set(vmid, "pid %d runs in a container nested inside container %s (its PID namespace is below the "
                      "container's): its units and programs are that container's, which this release does not stop"
                      % (record["pid"], vmid), chain)
    return _supervisord(procs, chain, vmid, proc_root) or _systemd(procs, chain[0], chain, vmid, proc_root)


def found_for(records, proc_root="/proc", table=None):
    """The distinct stop sets of records (node view), each with the planned pids it covers ("pids"), in a stable
    order; no_set() answers keyed by the holder."""
    out, procs = {}, {}
    for record in records:
        vmid = record.get("container")
        if not vmid or vmid in (node.HOST, node.UNATTRIBUTED):
            continue
        if vmid not in procs:
            procs[vmid] = Processes(vmid, proc_root, table)
        entry = find(record, proc_root, table, procs[vmid])
        if entry is None:
            continue
        key = (entry["vmid"], entry["kind"] or "", entry["name"] or "pid %d" % record["pid"])
        out.setdefault(key, dict(entry, pids=[], chains={}))["pids"].append(record["pid"])
        out[key]["chains"][record["pid"]] = entry["chain"]
    return [out[k] for k in sorted(out)]


# the driver's daemons' own systemd units, whose processes may run as a user of their own
DAEMON_UNITS = ("nvidia-persistenced.service", "nvidia-dcgm.service", "dcgm.service", "nv-hostengine.service",
                "nvidia-fabricmanager.service", "dcgm-exporter.service")


def node_service(record, proc_root="/proc"):
    """The node's own service manager entry of a daemon of the node: a dict kind, name, stop, start (argv run on the
    node), evidence; or None. Only a process of the node's root (its namespaces read and the node's, every uid 0), in
    a systemd system unit (system.slice/NAME.service, never a user's slice) or a program of a root supervisord of the
    node; the manager's tool is the one of a fixed system folder (node.system_tool), never one a process names. An
    unread cgroup or container is unknown: None (issue 41). A process of a system unit may have dropped root
    (nvidia-persistenced --user): a non-root one counts only in a unit of the driver's daemons (DAEMON_UNITS), since
    a user's cron job, at job or mail pipe also runs in a system unit (cron.service), under its own uid. Whether a
    unit found may be stopped for a reset (never a generic launcher's, issue 42) is the decide layer's."""
    cgroup = record.get("cgroup")
    if record.get("container") != node.HOST or node.where_of_cgroup(cgroup) != node.HOST or node.in_user_slice(cgroup):
        return None
    if node.in_own_namespaces(record["pid"], proc_root) is not True:
        return None
    unit = systemd_unit(cgroup)
    if unit is not None:
        root = node.root_owned(record["pid"], proc_root)
        return _systemd_service(unit, cgroup) if root or unit[2] in DAEMON_UNITS else None
    if not node.node_root_process(record["pid"], proc_root):
        return None
    return _supervisord_service(record, proc_root)


def _systemd_service(unit, cgroup):
    uid, dummy, name = unit
    systemctl = node.system_tool("systemctl")
    if uid is not None or not name.endswith(".service") or not _UNIT_RE.match(name) or systemctl is None:
        return None
    if "system.slice" not in cgroup.split("/"):
        return None
    return {"kind": "systemd", "name": name, "stop": [systemctl, "stop", name], "start": [systemctl, "start", name],
            "evidence": "its cgroup is %s" % cgroup}


def _supervisord_service(record, proc_root):
    """record's program under its parent, a supervisord of the node's root (its cgroup no user's), or None."""
    ppid = record.get("ppid")
    parent = procscan.read_stat(ppid, proc_root) if ppid else None
    if parent is None or parent["comm"] != "supervisord" or not node.node_root_process(ppid, proc_root):
        return None
    parent_cgroup = procscan.read_cgroup(ppid, proc_root)
    if node.where_of_cgroup(parent_cgroup) != node.HOST or node.in_user_slice(parent_cgroup):
        return None
    full = supervisord_program(record["pid"], proc_root)
    supervisorctl = node.system_tool("supervisorctl")
    if full is None or supervisorctl is None:
        return None
    conf = supervisord_config(ppid, proc_root)
    ctl = [supervisorctl] + (["-c", conf] if conf else [])
    return {"kind": "supervisord", "name": full, "stop": ctl + ["stop", full], "start": ctl + ["start", full],
            "evidence": "pid %d runs under supervisord (pid %d) as program %s" % (record["pid"], ppid, full)}


def _in_container(vmid, argv, timeout, attach="lxc-attach"):
    """(rc, output) of argv run inside container vmid by its own tools (lxc-attach, clean environment); None when it
    could not run."""
    try:
        return helperproc.run_bounded(node.attach_argv(vmid, argv, attach), timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def unit_dependents(entry, timeout=10.0, attach="lxc-attach"):
    """The live units a stop of entry's systemd unit would stop too (those that Require it, are BoundTo it or PartOf
    it), asked of the container's own manager; targets left out. [] when none; None when they cannot be read."""
    manager = [] if entry.get("manager_uid") is None else ["--user", "-M", "%d@" % entry["manager_uid"]]
    props = [w for p in DEPENDENT_PROPERTIES for w in ("-p", p)]
    shown = _in_container(entry["vmid"], ["systemctl"] + manager + ["show"] + props + ["--", entry["name"]], timeout,
                          attach)
    if shown is None or shown[0] != 0:
        return None
    names = sorted(set(n for line in shown[1].splitlines() if line.partition("=")[0] in DEPENDENT_PROPERTIES
                       for n in line.partition("=")[2].split() if _UNIT_RE.match(n) and not n.endswith(".target")))
    if not names:
        return []
    states = _in_container(entry["vmid"], ["systemctl"] + manager + ["is-active", "--"] + names, timeout, attach)
    if states is None:
        return None
    lines = states[1].split()
    if len(lines) != len(names):
        return None
    return [n for n, state in zip(names, lines) if state in LIVE_STATES]
