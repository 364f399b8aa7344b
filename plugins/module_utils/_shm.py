# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Shared-memory residue of GPU stacks in /dev/shm (private helper, may change any time).

Leaked segments of dead processes (NCCL's, SGLang's, torch's, vLLM's) make the next launch crash in a loop.
Residue is an entry of /dev/shm (a segment, or a POSIX semaphore sem.NAME) whose name has a GPU stack's
prefix, that no live process of the same /dev/shm has open or mapped, and that was last changed before the
check started. Anything else in /dev/shm is never residue. No AnsibleModule here.
"""

from __future__ import annotations

import os
import stat as stat_mod

SHM_MARKER = b"/dev/shm/"
SEM_PREFIX = "sem."
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


def list_dir(shm_dir):
    """[{name, bytes, mtime}] of the regular files directly in shm_dir, never following a symlink; None when
    the folder cannot be read."""
    out = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return None
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat_mod.S_ISREG(st.st_mode):
            out.append({"name": entry.name, "bytes": st.st_size, "mtime": st.st_mtime})
    return sorted(out, key=lambda e: e["name"])


def residue(entries, used, started, shm_dir="/dev/shm", prefixes=PREFIXES):
    """[{path, bytes, owner}]: the entries with a GPU stack's prefix that no live process uses (used: names)
    and that were last changed before started (epoch seconds)."""
    out = []
    for entry in entries or ():
        owner = owner_of(entry["name"], prefixes)
        if owner and entry["name"] not in used and entry["mtime"] < started:
            out.append({"path": "%s/%s" % (shm_dir.rstrip("/"), entry["name"]), "bytes": entry["bytes"], "owner": owner})
    return out


def remove(real_dir, entries, since):
    """Remove each residue entry from real_dir (the folder as this process reaches it) when it is still a regular
    file last changed before since; a symlink is never followed (the folder is opened O_NOFOLLOW, each name is
    checked without following). Returns (removed entries, [(entry, why)] left)."""
    removed, left = [], []
    try:
        dir_fd = os.open(real_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return [], [(entry, "cannot open %s: %s" % (real_dir, exc.strerror)) for entry in entries]
    try:
        for entry in entries:
            name = entry["path"].rsplit("/", 1)[-1]
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat_mod.S_ISREG(st.st_mode) or st.st_mtime >= since:
                    left.append((entry, "changed since the release started, or no longer a file"))
                    continue
                os.unlink(name, dir_fd=dir_fd)
                removed.append(entry)
            except OSError as exc:
                left.append((entry, exc.strerror or str(exc)))
    finally:
        os.close(dir_fd)
    return removed, left
