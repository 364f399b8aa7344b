# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Controller-side files that a local user cannot redirect (private helper, may change any time)."""

from __future__ import annotations

import os
import secrets
import stat

_TRIES = 100


def _create_beside(path, mode):
    """A new file in path's folder: O_CREAT|O_EXCL|O_NOFOLLOW (never an existing file or a symlink), then mode."""
    folder, base = os.path.dirname(path) or ".", os.path.basename(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for dummy in range(_TRIES):
        temp = os.path.join(folder, ".%s.%s.tmp" % (base, secrets.token_hex(8)))
        try:
            fd = os.open(temp, flags, 0o600)
        except FileExistsError:
            continue
        os.fchmod(fd, mode)
        return fd, temp
    raise FileExistsError("no free temporary name beside %s" % path)


def replace_file(path, data, mode=0o600):
    """Write data to a temporary file beside path, then rename it over path.

    A symlink (or anything else) at path is replaced, never followed, and a reader sees the old file or the new one.
    """
    fd, temp = _create_beside(path, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise


def holds(path, mode, data):
    """Whether path is a regular file of this mode and content, read without following a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK)
    except OSError:      # missing, a symlink (ELOOP) or unreadable: not this file
        return False
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or stat.S_IMODE(info.st_mode) != mode or info.st_size != len(data):
            return False
        return handle.read(len(data) + 1) == data
