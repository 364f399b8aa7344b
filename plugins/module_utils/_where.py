# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Where a process is, and whether it is still the one seen: the evidence the act layer asks (private helper).

The ladder, the locks, the rungs and the unit stops never read /proc or the Proxmox configs themselves (issue 46):
they ask here. Each function is a thin question over the read layer (_procscan, _node), looked up at call time,
so what the read layer answers (or a test's stand-in for it) is what the act layer sees.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

HOST = node.HOST
UNATTRIBUTED = node.UNATTRIBUTED
Scope = node.Scope


def stat_of(pid, proc_root="/proc"):
    """/proc/PID/stat's fields (starttime, state, num_threads), or None when the pid is gone."""
    return procscan.read_stat(pid, proc_root)


def uptime_text(proc_root):
    """The text of PROC_ROOT/uptime (a recorded /proc tree's clock)."""
    return procscan.read_text("%s/uptime" % proc_root)


def container_of_pid(pid, proc_root="/proc"):
    """The container (vmid) of pid, HOST, UNATTRIBUTED, or None when it cannot be read."""
    return node.container_of_pid(pid, proc_root)


def processes_by_container(proc_root="/proc", table=None):
    """{vmid: [{"pid", "name"}]}: every process of each running container."""
    return node.processes_by_container(proc_root, table)


def mib_by_container(procs, used_mib, holders, proc_root="/proc", stale=(), index=None):
    """The MiB of one GPU's NVML-named pids, by container (node.by_container)."""
    return node.by_container(procs, used_mib, holders, proc_root, stale, index)


def vmid_key(vmid):
    return node.vmid_key(vmid)


def pve_lxc_dir():
    """Where this node's container configs are (read at call time)."""
    return node.PVE_LXC_DIR


def pve_ha_resources():
    return node.PVE_HA_RESOURCES


def container_configs(conf_dir):
    """{vmid: parsed config} of this node's containers (the container rung's lock), or None when unreadable."""
    return node.read_pve_confs(conf_dir)


def ha_resources(path):
    """{vmid: HA resource} of the cluster's HA-managed guests (a container the HA manager would start again)."""
    return node.read_ha_resources(path)


def container_inits(proc_root="/proc"):
    """{vmid: the pid of its init, or None when it does not run}."""
    return node.container_inits(proc_root)


def owner_of(pid, proc_root="/proc"):
    """(uid, gid) of pid as the node sees them."""
    return node.owner_of(pid, proc_root)


def attach_argv(vmid, argv, attach="lxc-attach"):
    """argv run inside container vmid by its own tools (a pure argv builder)."""
    return node.attach_argv(vmid, argv, attach)
