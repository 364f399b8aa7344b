# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Helper processes that may hang in the kernel (private helper, may change any time).

NVML calls and /proc reads that can block for ever run in a child Python that
holds none of this process's files (not Ansible's pipes, not the GPU locks),
so that giving up on it means killing and abandoning it. Commands that may hang
in the driver (nvidia-smi --gpu-reset, pct) run the same way: run_bounded().
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def spawn(source, args=(), python_flags=()):
    """A new session running `python -c source args...`, talking over pipes on its stdin and stdout."""
    argv = [sys.executable or "python3"] + list(python_flags) + ["-c", source] + list(args)
    # run_command waits for its command; this helper talks to a child over pipes and must be able to abandon it
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # pylint: disable=ansible-bad-function
                            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True)


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


MAX_OUTPUT = 1 << 20   # bytes of a command's output kept (a container's python3 or tool may print without end)
KILL_WAIT_S = 2.0   # after SIGKILL, how long a timed-out command is waited for before it is abandoned


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _read_capped(proc, timeout, cap):
    """proc's output until it ends, of which the first cap bytes are kept (a note says the rest was cut: a command
    run in a container may print without end); subprocess.TimeoutExpired past timeout."""
    end = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    kept, size = [], 0
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        if not select.select([fd], [], [], left)[0]:
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        kept.append(data[:max(0, cap - size)])
        size += len(data)
    proc.wait(max(0.0, end - time.monotonic()))
    out = b"".join(kept)
    return out if size <= cap else out + b"\n[output cut: %d bytes, %d kept]" % (size, cap)


def run_bounded(cmd, timeout, env=None, kill_wait=KILL_WAIT_S):
    """(returncode, output text) of cmd, run in a session of its own, stdout and stderr together.

    When it has not ended within timeout, its session is SIGKILLed and it is waited for at most
    kill_wait (one stuck in the kernel dies only when its call returns), then abandoned, and
    subprocess.TimeoutExpired is raised. Whatever else ends the wait (a signal handler's exception)
    does the same before it goes on.
    """
    # run_command has no session of its own to SIGKILL nor a bound on the output kept, and waits for ever on a
    # command stuck in the driver
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # pylint: disable=ansible-bad-function
                            stderr=subprocess.STDOUT, close_fds=True, start_new_session=True, env=env)
    finished = False
    try:
        out = _read_capped(proc, timeout, MAX_OUTPUT)
        finished = True
    except subprocess.TimeoutExpired:
        raise subprocess.TimeoutExpired(cmd, timeout)
    finally:
        if not finished:
            _kill_session(proc)
            try:
                proc.wait(kill_wait)
            except subprocess.TimeoutExpired:
                proc.returncode = -signal.SIGKILL  # abandoned: init reaps it once the call returns
            try:
                proc.stdout.close()
            except (OSError, ValueError):
                pass
    return proc.returncode, out.decode("utf-8", "replace")
