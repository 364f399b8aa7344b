# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Shared-memory residue of GPU stacks in /dev/shm, judged per file system (private helper, may change any time).

Leaked segments of dead processes (NCCL's, SGLang's, torch's, vLLM's) make the next launch crash in a loop.
Residue is an entry of a /dev/shm folder (a segment, or a POSIX semaphore sem.NAME) whose name has a GPU stack's
prefix, that was last changed before the check started, and that no process may use (issue 43):
- a file's users are found by the file itself, (st_dev, st_ino), from every process's maps, on the node and in
  every container, whatever path it was mapped by; an fd names a path only, counted in its process's own folder
  and in every folder on the same mount;
- a process that could not be read (its maps blocked, or were cut) may use any file of the folders it can reach:
  the folder of its container, of its mount namespace, or, when neither can be read, every folder;
- a folder that could not be read safely (a link on the way, a hung mount) is skipped with the reason.
Pure: the folders, users and unreadable processes come read (the engine), the removal is the act layer's.
"""

from __future__ import annotations

import os
import stat as stat_mod

SEM_PREFIX = "sem."
UNKNOWN = "unknown"   # the place of a process whose container cannot be read
# name prefix -> the stack it belongs to
PREFIXES = (("nccl-", "nccl"), ("sgl_", "sglang"), ("torch_", "torch"), ("vllm", "vllm"), ("psm_", "python (vllm, torch)"))


def prefixes_with(extra):
    """The built-in prefixes and extra ones (their stack: 'extra')."""
    return PREFIXES + tuple((p, "extra") for p in extra if p not in dict(PREFIXES))


def owner_of(name, prefixes=PREFIXES):
    """The stack a /dev/shm name belongs to by its prefix (a semaphore's after sem.), or None."""
    base = name[len(SEM_PREFIX):] if name.startswith(SEM_PREFIX) else name
    for prefix, owner in prefixes:
        if base.startswith(prefix):
            return owner
    return None


def used_name(path):
    """The /dev/shm name a maps path or fd target names, or None (deleted or elsewhere)."""
    if not path.startswith("/dev/shm/") or path.endswith(" (deleted)"):
        return None
    name = path[len("/dev/shm/"):]
    return name if name and "/" not in name else None


def folder_parts(path):
    """The names a folder path is walked by, one at a time (never a link)."""
    return [part for part in path.split("/") if part]


def place_order(key):
    """This host's folder (None) first, then the containers' by vmid."""
    return (-1,) if key is None else (int(key),)


def sharing(places):
    """{key: the other keys whose folder is the same mount (st_dev) or seen from the same mount namespace}."""
    out = {}
    for key, place in places.items():
        out[key] = set(other for other, seen in places.items() if other != key and (
            (place["dev"] is not None and seen["dev"] == place["dev"])
            or (place["mnt"] is not None and seen["mnt"] == place["mnt"])))
    return out


def unreadable_why(group, places, unreadable):
    """Why a process that could not be read may use the folders of group (keys of one mount), or None.
    Ruled out only when both its container (its place) and its mount namespace were read, and neither is group's;
    never a node's process seen from the node (`everywhere`: it reaches every container's folder through
    /proc/INIT/root)."""
    mnts = set(places[k]["mnt"] for k in group if places[k]["mnt"] is not None)
    for proc in unreadable:
        if proc.get("everywhere"):
            return ("pid %d, a process of the node, could not be read (%s): it reaches every container's folder, and "
                    "may use any file here" % (proc["pid"], proc.get("reason") or "its maps or fds"))
        if proc["key"] == UNKNOWN or proc["key"] not in places or proc["mnt"] is None:
            return ("pid %d could not be read, and where it is (its container or mount namespace) cannot be read "
                    "either: it may use any file here" % proc["pid"])
        if proc["key"] in group or proc["mnt"] in mnts:
            return "pid %d could not be read (%s) and shares this folder: it may use any file here" % (
                proc["pid"], proc.get("reason") or "its maps or fds")
    return None


def _residue(place, used, names, since, prefixes, seen, foreign):
    out = []
    for entry in place["entries"]:
        owner = owner_of(entry["name"], prefixes)
        identity = (entry["dev"], entry["ino"])
        if foreign and (entry.get("uid") == foreign[0] or entry.get("gid") == foreign[1]):
            continue    # an owner this container does not map: made outside it, by users it cannot see
        if (owner and stat_mod.S_ISREG(entry["mode"]) and identity not in used and identity not in seen
                and entry["name"] not in names and entry["mtime"] < since):
            seen.add(identity)
            out.append({"path": "%s/%s" % (place["path"].rstrip("/"), entry["name"]), "bytes": entry["bytes"],
                        "owner": owner, "name": entry["name"], "dev": entry["dev"], "ino": entry["ino"]})
    return out


def judge(places, used, names, unreadable, since, prefixes=PREFIXES, foreign=None):
    """{key: {"residue": [...], "skipped": why or None}} of each place (key None: this host's /dev/shm, vmid: a
    container's), each {path, dev, mnt, entries (None: not read), why}.

    used: {(st_dev, st_ino)} some process maps; names: {key or UNKNOWN: names its processes' fds or maps name};
    unreadable: [{pid, key, mnt, reason, everywhere}] processes not read. A file on one mount shows in each folder
    of it: it is listed once, under the first (this host's, then by vmid). foreign (inside a container): the
    (uid, gid) an owner it does not map shows as; such a file is never residue (its users are not seen here)."""
    groups = sharing(places)
    out, seen = {}, set()
    for key in sorted(places, key=place_order):
        place = places[key]
        group = groups[key] | set([key])
        why = place["why"] or unreadable_why(group, places, unreadable)
        if why:
            out[key] = {"residue": [], "skipped": why}
            continue
        named = set(names.get(UNKNOWN, ())).union(*(names.get(k, ()) for k in group))
        out[key] = {"residue": _residue(place, used, named, since, prefixes, seen, foreign), "skipped": None}
    return out


def mount_of(path, mountinfo, dev=None):
    """The /proc/self/mountinfo entry of the mount path is on: {mount_point, root, optional, fstype}, or None. Of
    mounts on one point the last (the one on top) counts; with dev (the folder's st_dev), None unless it is that
    mount's device."""
    best = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        point = fields[4].encode().decode("unicode_escape")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and (best is None or len(point) >= len(best["mount_point"])):
            best = {"mount_point": point, "root": fields[3].encode().decode("unicode_escape"), "optional": fields[6:sep],
                    "fstype": fields[sep + 1] if len(fields) > sep + 1 else None, "device": fields[2]}
    if best is not None and dev is not None and best.pop("device") != "%d:%d" % (os.major(dev), os.minor(dev)):
        return None
    if best is not None:
        best.pop("device", None)
    return best


def foreign_why(place, overflow, mount):
    """Inside a container: why its /dev/shm may be a folder made outside it (the node's, or another container's,
    bound in), whose users it cannot see, or None. overflow: (uid, gid) an owner this user namespace does not map
    shows as; mount: mount_of the folder."""
    if place["entries"] is None:
        return None
    if place.get("uid") == overflow[0] or place.get("gid") == overflow[1]:
        return ("it is owned by an owner this container does not map (uid %d): made outside it, a folder of the "
                "node's bound in, whose users this container cannot see: clean it from the node" % overflow[0])
    if mount is None:
        return "its mount cannot be found in /proc/self/mountinfo: whose users it has cannot be told"
    if mount["root"] != "/":
        return ("it is the folder %s of a file system mounted in (a bind): its other users cannot be seen from this "
                "container; clean it from the node" % mount["root"])
    if any(opt.startswith("master:") for opt in mount["optional"]):
        return ("its mount receives mount events from outside this container (%s): bound in from the node, whose "
                "users this container cannot see; clean it from the node" % " ".join(mount["optional"]))
    return None


def shared_outside(places, key, in_scope):
    """Why the folder of key is one mount with a folder out of scope (in_scope: the keys a release may clean), or
    None. Nothing on such a mount is removed: who uses it there is not this release's to judge."""
    others = sorted((k for k in sharing(places)[key] if k not in in_scope), key=place_order)
    if not others:
        return None
    return "it is one mount with %s, outside the scope: nothing on it is removed" % ", ".join(
        "the node's /dev/shm" if k is None else "container %s's /dev/shm" % k for k in others)


def public(entry):
    """A residue entry as gpu_info shows it."""
    return {"path": entry["path"], "bytes": entry["bytes"], "owner": entry["owner"]}


def shown(entry, vmid):
    """A residue entry as gpu_release shows it: with its vmid."""
    return dict(public(entry), vmid=vmid)
