"""Commands that may hang in the driver (nvidia-smi --gpu-reset, pct): run_bounded never waits unbounded."""
import signal
import subprocess
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid, timeout=5.0):
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


def session_with_a_child(tmp_path):
    """sh that starts a sleep in the background (the child holds the output pipe too) and writes its pid."""
    record = tmp_path / "child.pid"
    return ["sh", "-c", "sleep 30 & echo $! > %s; echo started; wait" % record], record


def test_output_and_status_come_back_together():
    assert helperproc.run_bounded(["sh", "-c", "echo out; echo err >&2; exit 3"], 10) == (3, "out\nerr\n")


def test_a_timeout_kills_the_whole_session_and_returns_in_time(tmp_path):
    cmd, record = session_with_a_child(tmp_path)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        helperproc.run_bounded(cmd, 2.0, kill_wait=1.0)
    assert time.monotonic() - started < 8
    assert wait_gone(int(record.read_text())), "the command's child outlived the timeout"


class Interrupted(Exception):
    """Stands for the hard-stop alarm's exception."""


def test_an_exception_during_the_wait_kills_the_session_first(tmp_path):
    cmd, record = session_with_a_child(tmp_path)

    def hard_stop(signum, frame):
        raise Interrupted()
    previous = signal.signal(signal.SIGALRM, hard_stop)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(Interrupted):
            helperproc.run_bounded(cmd, 30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert wait_gone(int(record.read_text())), "the command's child outlived the interrupted wait"


def test_a_command_that_prints_without_end_keeps_at_most_the_cap():
    """Issue 41: a container's python3 answers the node's probe with 64 MiB: the node keeps 1 MiB and says so."""
    import sys
    rc, out = helperproc.run_bounded([sys.executable, "-c", "import os; os.write(1, b'x' * (64 << 20))"], 30)
    assert rc == 0 and out.startswith("x" * 1000) and len(out) < helperproc.MAX_OUTPUT + 100
    assert out.endswith("[output cut: %d bytes, %d kept]" % (64 << 20, helperproc.MAX_OUTPUT)), out[-80:]
    rc, out = helperproc.run_bounded([sys.executable, "-c", "print('short')"], 30)
    assert (rc, out) == (0, "short\n")
