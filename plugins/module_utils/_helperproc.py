# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Helper processes that may hang in the kernel (private helper, may change any time).

NVML calls and /proc reads that can block for ever run in a child Python that
holds none of this process's files (not Ansible's pipes, not the GPU locks),
so that giving up on it means killing and abandoning it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def spawn(source, args=(), python_flags=()):
    """A new session running `python -c source args...`, talking over pipes on its stdin and stdout."""
    argv = [sys.executable or "python3"] + list(python_flags) + ["-c", source] + list(args)
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)


def abandon(proc):
    """SIGKILL proc and close its pipes without waiting long: one stuck in the kernel exits when its call returns."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except (OSError, ValueError):
            pass
    try:
        proc.wait(0.2)
    except subprocess.TimeoutExpired:
        proc.returncode = -signal.SIGKILL  # init reaps it once the call returns
