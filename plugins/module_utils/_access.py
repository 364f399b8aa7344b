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
import inspect
import json
import os
import re
import stat as stat_mod
import subprocess

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node

SHARED_NODES = ("nvidiactl", "nvidia-uvm")
DRM_REFCNT = "/sys/module/nvidia_drm/refcnt"
DRM_REFCNT_ENV = "GPUOPS_NVIDIA_DRM_REFCNT"  # another file to read instead (the lab's stand-in)
TEXT_MAX = 4096   # a path or an error text in a container's answer


def _minor_of(path, name):
    """The GPU minor of a device file: 195:N (N < 254) by st_rdev; the lab's regular files by name. (The rule of
    procscan.rdev_gpu_minor, written out: this function also runs alone inside a container, see _probe_source.)"""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat_mod.S_ISCHR(st.st_mode):
        minor = os.minor(st.st_rdev)
        return minor if os.major(st.st_rdev) == 195 and minor < 254 else None
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


def _probe_source():
    """read() and its helpers as a script for a container's python3: minors as argv[1] (JSON), JSON out."""
    parts = ["import errno, json, os, re, stat as stat_mod, sys", "SHARED_NODES = %r" % (SHARED_NODES,)]
    parts += [inspect.getsource(fn) for fn in (_minor_of, _open, read)]
    parts.append("print(json.dumps(read('/dev', json.loads(sys.argv[1]))))")
    return "\n".join(parts)


def read_in_container(vmid, minors, timeout=30.0, attach="lxc-attach"):
    """read() run inside container vmid (its own device cgroup and /dev) through lxc-attach, as pct exec does,
    with its python3. Returns (reading, None) or (None, why)."""
    argv = node.attach_argv(vmid, ["python3", "-c", _probe_source(), json.dumps(sorted(set(minors)))], attach)
    try:
        rc, out = helperproc.run_bounded(argv, timeout)
    except subprocess.TimeoutExpired:
        return None, "lxc-attach to container %s did not end within %ss" % (vmid, timeout)
    except OSError as exc:
        return None, "%s: %s" % (attach, exc.strerror or exc)
    try:
        reading = json.loads(out.strip().splitlines()[-1]) if rc == 0 else None
    except (ValueError, IndexError):
        reading = None
    if reading is None:
        return None, "exit %d: %s" % (rc, " ".join(out.split())[:300] or "no output")
    return checked(reading, minors)


def _text(value):
    return isinstance(value, str) and len(value) <= TEXT_MAX


def _opened(entry, failed):
    """An {path, error} entry as read() writes it (failed: error must be a text, else a text or None)."""
    return (isinstance(entry, dict) and _text(entry.get("path"))
            and (_text(entry.get("error")) or (not failed and entry.get("error") is None)))


def _gpu_entry(gpu):
    return (isinstance(gpu, dict) and isinstance(gpu.get("paths"), list) and all(_text(p) for p in gpu["paths"])
            and isinstance(gpu.get("errors"), list) and all(_opened(e, True) for e in gpu["errors"]))


def checked(reading, minors):
    """(reading, None) when a container's answer is what read() writes for minors (its gpus keyed by int again),
    else (None, why): the answer comes from the container's own python3, and is never trusted to be well formed."""
    if not isinstance(reading, dict) or not isinstance(reading.get("shared"), list) or not isinstance(reading.get("gpus"), dict):
        return None, "a malformed answer: not {\"shared\": [...], \"gpus\": {...}}"
    if not all(_opened(e, False) for e in reading["shared"]):
        return None, "a malformed answer: a shared node entry is not {path, error}"
    keys = sorted(str(m) for m in set(minors))
    if sorted(reading["gpus"]) != keys or not all(_gpu_entry(g) for g in reading["gpus"].values()):
        return None, "a malformed answer: its gpus are not {minor: {paths, errors}} for minors %s" % ", ".join(keys)
    shared = [{"path": e["path"], "error": e["error"]} for e in reading["shared"]]
    gpus = dict((int(k), {"paths": list(g["paths"]), "errors": [{"path": e["path"], "error": e["error"]} for e in g["errors"]]})
                for k, g in reading["gpus"].items())
    return {"shared": shared, "gpus": gpus}, None


def read_drm_refcount():
    """nvidia_drm's module reference count (a display stack holds the driver above 0); 0 when not loaded."""
    path = os.environ.get(DRM_REFCNT_ENV) or DRM_REFCNT
    try:
        with open(path) as handle:
            return int(handle.read().strip() or 0)
    except (OSError, ValueError):
        return 0
