# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""From the Proxmox node: what would respawn a container's holder, and its stop in that container (private helper).

A holder's cgroup names its systemd unit inside the container (lxc/VMID/ns/system.slice/NAME.service).
A supervisord program's processes run under supervisord with SUPERVISOR_PROCESS_NAME and
SUPERVISOR_GROUP_NAME in their environment (supervisord sets them). A docker container's processes (docker
inside LXC) are in its cgroup (system.slice/docker-ID.scope with systemd's driver, docker/ID with cgroupfs)
and run under its containerd shim (`containerd-shim-runc-v2 -namespace moby -id ID`). The stop runs inside
the container through its own manager, with lxc-attach: no Perl start-up per call, as pct exec would cost.
No AnsibleModule here.
"""

from __future__ import annotations

import re
import subprocess

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _respawn as respawn

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# names passed to the container's manager (argv, no shell): a unit may carry systemd's \x escapes
_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@\\-]+$")
_PROGRAM_RE = re.compile(r"^[A-Za-z0-9:_.@-]+$")
_DOCKER_CGROUP_RE = re.compile(r"(?:/docker-([0-9a-f]{64})\.scope|/docker/([0-9a-f]{64}))(?:/|$)")
_DOCKER_ID_RE = re.compile(r"^[0-9a-f]{64}$")
SHIM_PREFIX = "containerd-shim"   # comm of containerd-shim-runc-v2 (15 characters kept)


def docker_shim_id(pid, proc_root):
    """The docker container id a containerd shim runs (`-namespace moby -id ID`), or None."""
    try:
        argv = [a.decode("utf-8", "replace") for a in procscan.read_bytes("%s/%d/cmdline" % (proc_root, pid)).split(b"\0")]
    except OSError:
        return None
    options = dict(zip(argv, argv[1:]))
    found = options.get("-id")
    return found if options.get("-namespace") == "moby" and found and _DOCKER_ID_RE.match(found) else None


def _docker(vmid, container_id, evidence):
    return {"vmid": int(vmid), "kind": "docker", "name": container_id[:12], "argv": ["docker", "stop", container_id],
            "evidence": evidence}


def supervisord_config(pid, proc_root):
    """The -c/--configuration of a supervisord process (a path inside its container), or None."""
    try:
        argv = [a.decode("utf-8", "replace") for a in procscan.read_bytes("%s/%d/cmdline" % (proc_root, pid)).split(b"\0")]
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if arg in ("-c", "--configuration") and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--configuration="):
            return arg.split("=", 1)[1]
    return None


def supervisord_program(pid, supervisord_pid, proc_root):
    """(GROUP:NAME, the supervisord's -c or None) of pid, a program supervisord runs (supervisord puts
    SUPERVISOR_PROCESS_NAME and SUPERVISOR_GROUP_NAME in its environment), or None."""
    env = procscan.read_environ(pid, proc_root, ("SUPERVISOR_PROCESS_NAME", "SUPERVISOR_GROUP_NAME"))
    name = env.get("SUPERVISOR_PROCESS_NAME")
    group = env.get("SUPERVISOR_GROUP_NAME") or name
    if not name or not _PROGRAM_RE.match(name) or not _PROGRAM_RE.match(group):
        return None
    return "%s:%s" % (group, name), supervisord_config(supervisord_pid, proc_root)


def find(record, proc_root="/proc"):
    """What would start record's process again inside its container: a dict, or None (not found, or not a
    container process). Keys: vmid, kind (systemd, docker, supervisord), name, argv (run inside the container),
    evidence. A docker container comes before a supervisord that runs inside it."""
    vmid = record.get("container")
    if not vmid or vmid in (node.HOST, node.UNATTRIBUTED):
        return None
    inner = node.inner_cgroup(record.get("cgroup"))
    unit = respawn.service_unit(inner)
    if unit and _UNIT_RE.match(unit):
        return {"vmid": int(vmid), "kind": "systemd", "name": unit, "argv": ["systemctl", "stop", unit],
                "evidence": "its cgroup in the container is %s" % inner}
    docker = _DOCKER_CGROUP_RE.search(inner or "")
    if docker:
        return _docker(vmid, docker.group(1) or docker.group(2), "its cgroup in the container is %s" % inner)
    chain = [record["pid"]] + procscan.ancestors(record["pid"], proc_root)
    parents = [(pid, parent_pid, procscan.read_stat(parent_pid, proc_root)) for pid, parent_pid in zip(chain, chain[1:])]
    for pid, parent_pid, parent in parents:   # a docker container's own supervisord is stopped with its container
        if parent is not None and parent["comm"].startswith(SHIM_PREFIX):
            container_id = docker_shim_id(parent_pid, proc_root)
            if container_id:
                return _docker(vmid, container_id, "pid %d runs under containerd-shim (pid %d on the node) as docker "
                                                   "container %s" % (pid, parent_pid, container_id[:12]))
    for pid, parent_pid, parent in parents:
        if parent is None or parent["comm"] != "supervisord":
            continue
        program = supervisord_program(pid, parent_pid, proc_root)
        if program is None:
            return None
        full, conf = program
        return {"vmid": int(vmid), "kind": "supervisord", "name": full,
                "argv": ["supervisorctl"] + (["-c", conf] if conf else []) + ["stop", full],
                "evidence": "pid %d runs under supervisord (pid %d on the node) as program %s" % (pid, parent_pid, full)}
    return None


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
    a user's cron job, at job or mail pipe also runs in a system unit (cron.service), under its own uid."""
    cgroup = record.get("cgroup")
    if record.get("container") != node.HOST or node.where_of_cgroup(cgroup) != node.HOST or node.in_user_slice(cgroup):
        return None
    if node.in_own_namespaces(record["pid"], proc_root) is not True:
        return None
    unit = respawn.service_unit(cgroup)
    if unit:
        root = node.root_owned(record["pid"], proc_root)
        return _systemd_service(unit, cgroup) if root or unit in DAEMON_UNITS else None
    if not node.node_root_process(record["pid"], proc_root):
        return None
    return _supervisord_service(record, proc_root)


def _systemd_service(unit, cgroup):
    systemctl = node.system_tool("systemctl")
    if not _UNIT_RE.match(unit) or "system.slice" not in cgroup.split("/") or systemctl is None:
        return None
    return {"kind": "systemd", "name": unit, "stop": [systemctl, "stop", unit], "start": [systemctl, "start", unit],
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
    program = supervisord_program(record["pid"], ppid, proc_root)
    supervisorctl = node.system_tool("supervisorctl")
    if program is None or supervisorctl is None:
        return None
    full, conf = program
    ctl = [supervisorctl] + (["-c", conf] if conf else [])
    return {"kind": "supervisord", "name": full, "stop": ctl + ["stop", full], "start": ctl + ["start", full],
            "evidence": "pid %d runs under supervisord (pid %d) as program %s" % (record["pid"], ppid, full)}


def run_on_node(argv, timeout, done="done"):
    """{"ok", "text"} of a command run from the node (a service manager's, or lxc-attach); never raises for the
    command's own failure; done: the text when it succeeds silently."""
    try:
        rc, out = helperproc.run_bounded(argv, timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "text": "did not end within %ss" % timeout}
    except OSError as exc:
        return {"ok": False, "text": "%s: %s" % (argv[0], exc.strerror or exc)}
    text = " ".join(out.split())[:300]
    if rc != 0:
        return {"ok": False, "text": "exit %d: %s" % (rc, text or "no output")}
    return {"ok": True, "text": text or done}


def found_for(records, proc_root="/proc"):
    """The distinct stops for records, each with the pids it covers, in a stable order."""
    out = {}
    for record in records:
        entry = find(record, proc_root)
        if entry is None:
            continue
        key = (entry["vmid"], entry["kind"], entry["name"])
        out.setdefault(key, dict(entry, pids=[]))["pids"].append(record["pid"])
    return [out[k] for k in sorted(out)]


def attach_argv(vmid, argv, attach="lxc-attach"):
    return [attach, "-n", str(vmid), "--clear-env", "--set-var", "PATH=" + CONTAINER_PATH, "--"] + list(argv)


def stop(entry, timeout, attach="lxc-attach"):
    """Run entry's stop inside its container. {"ok", "text"}; never raises for the command's own failure."""
    return run_on_node(attach_argv(entry["vmid"], entry["argv"], attach), timeout, "stopped")
