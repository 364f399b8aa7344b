# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a process goes by (private helper; read layer): its names (comm, argv[0], exe), its user, whether a name
is on the built-in protect list, and its MPS role."""

from __future__ import annotations

import os
import pwd

# Never signalled, whatever holds what (names as in comm, argv[0] or exe).
PROTECTED_NAMES = ("nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "dcgm-exporter",
                   "nvidia-cuda-mps-control", "sshd", "lxc-attach", "pct")
MPS_SERVER = "nvidia-cuda-mps-server"
MPS_CONTROL = "nvidia-cuda-mps-control"


def user_name(uid):
    """The user name of uid (its number when it has none here), or None."""
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def names_of(pid, comm, argv, proc_root):
    """The names a process goes by: comm, argv[0]'s base name and exe's (read here), sorted."""
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
