# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether this host or container can open its GPUs' device files (private helper, may change any time).

A container whose device-cgroup access was revoked (a `systemctl daemon-reload` on the node, with some
container set-ups) still lists its device files, and opening one fails with EPERM; NVML then says
"Unknown Error". Which GPU a file is comes from its st_rdev (195:N), never its name; the lab's stand-ins
are regular files, known by name.
"""

from __future__ import annotations

import errno
import os
import re
import stat as stat_mod

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

SHARED_NODES = ("nvidiactl", "nvidia-uvm")


def _minor_of(path, name):
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat_mod.S_ISCHR(st.st_mode):
        return procscan.rdev_gpu_minor(st)
    match = re.match(r"^nvidia(\d+)$", name)
    return int(match.group(1)) if match and stat_mod.S_ISREG(st.st_mode) else None


def _open(path):
    """None when path opens for reading and writing, as CUDA opens it, else (errno name, text)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        return (errno.errorcode.get(exc.errno, str(exc.errno)), exc.strerror or str(exc))
    os.close(fd)
    return None


def read(dev_dir, minors):
    """{"shared": [{path, error}], "gpus": {minor: {"paths": [...], "errors": [{path, error}]}}}: the shared
    nodes (nvidiactl, nvidia-uvm) and, for each GPU minor asked, the files of dev_dir that are that GPU, each
    opened once (error None when it opened)."""
    try:
        names = sorted(os.listdir(dev_dir))
    except OSError:
        names = []
    by_minor = {}
    for name in names:
        if name.startswith("nvidia"):
            minor = _minor_of(os.path.join(dev_dir, name), name)
            if minor is not None:
                by_minor.setdefault(minor, []).append(name)
    out = {"shared": [], "gpus": {}}
    for name in SHARED_NODES:
        path = os.path.join(dev_dir, name)
        error = _open(path) if os.path.lexists(path) else ("ENOENT", "no such file")
        out["shared"].append({"path": path, "error": None if error is None else "%s (%s)" % (error[1], error[0])})
    for minor in sorted(set(minors)):
        paths = [os.path.join(dev_dir, n) for n in by_minor.get(minor, [])]
        errors = []
        for path in paths:
            error = _open(path)
            if error is not None:
                errors.append({"path": path, "error": "%s (%s)" % (error[1], error[0])})
        out["gpus"][minor] = {"paths": paths, "errors": errors}
    return out
