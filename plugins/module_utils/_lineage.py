# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the respawn watch reads of a process (private helper; evidence layer).

Its stat, its ancestors, its cgroup and where that puts it, whether it is an init (what Restart= starts again),
the service unit it runs in, the pids listed now, and the targeted GPUs it maps a context on. The watch (_respawn,
act) asks here and never reads /proc or the node's cgroups itself (issue 46).
"""

from __future__ import annotations

import os
import re

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where

_USER_MANAGER_RE = re.compile(r"/user@\d+\.service/init\.scope$")


stat_of = where.stat_of   # /proc/PID/stat's fields, or None when it is gone: the one evidence wrapper of read_stat


def ancestors(pid, proc_root="/proc"):
    """pids above pid (parent first) up to the top of its PID namespace."""
    return procscan.ancestors(pid, proc_root)


def cgroup_of(pid, proc_root="/proc"):
    """pid's cgroup path, or None when it cannot be read."""
    return procscan.read_cgroup(pid, proc_root)


def parsed_cgroup(pid, proc_root="/proc"):
    """pid's cgroup as _procscan.parse_cgroup gives it, or None when it cannot be read."""
    try:
        return procscan.parse_cgroup(procscan.read_text("%s/%d/cgroup" % (proc_root, pid)))
    except OSError:
        return None


def where_of_cgroup(cgroup):
    """The container (vmid) or host a cgroup path names, or None when it names neither."""
    return node.where_of_cgroup(cgroup)


def service_unit(cgroup):
    """The systemd service (NAME.service: what Restart= starts again) a cgroup path names, inside its container when
    it is in one (the first component below the slices, stopsets.systemd_unit), or None (a scope is no service)."""
    inner = node.inner_cgroup(cgroup)
    unit = stopsets.systemd_unit(inner if inner is not None else cgroup)
    return unit[2] if unit and unit[2].endswith(".service") else None


def is_init(pid, proc_root="/proc"):
    """pid 1 of its PID namespace (a node's or a container's init), or a user's service manager (systemd --user, in
    user@UID.service/init.scope): what starts units again (Restart=)."""
    if pid == 1:
        return True
    try:
        status = procscan.parse_status(procscan.read_text("%s/%d/status" % (proc_root, pid)))
    except OSError:
        return False
    if (status.get("nspid") or [0])[-1] == 1:
        return True
    cgroup = procscan.read_cgroup(pid, proc_root) or ""
    return status.get("name") == "systemd" and bool(_USER_MANAGER_RE.search(cgroup))


def chain(pid, proc_root="/proc", limit=16):
    """[{pid, name}] from pid up to the top of this PID namespace (at most limit ancestors)."""
    out = []
    for current in [pid] + procscan.ancestors(pid, proc_root)[:limit]:
        stat = procscan.read_stat(current, proc_root)
        out.append({"pid": current, "name": stat["comm"] if stat else None})
    return out


def listed_pids(proc_root="/proc"):
    """The pids /proc lists now."""
    return set(int(name) for name in os.listdir(proc_root) if name.isdigit())


def contexts_on(pid, proc_root, devices, target_minors):
    """The minors of target_minors where pid maps a context's signature (CONTEXT_MAP_LINES lines, row 12): a GPU it
    only sees (2 lines, row 9) is none. None among target_minors stands for a GPU that cannot be described: any
    context counts for it (and no minor is read)."""
    try:
        maps = procscan.read_bytes("%s/%d/maps" % (proc_root, pid))
    except OSError:
        return []
    root = "%s/%d/root" % (proc_root, pid)
    out = set()
    for path, lines in procscan.parse_maps_counts(maps, devices).items():
        kind = devices.classify(path)
        if not kind or kind[0] != "gpu" or lines < pinning.CONTEXT_MAP_LINES:
            continue
        if None in target_minors:
            out.add(None)
            continue
        minor = procscan.gpu_minor(path, devices, root)
        if minor in target_minors:
            out.add(minor)
    return sorted(out, key=lambda m: -1 if m is None else m)
