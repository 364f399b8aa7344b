"""Bounded reads of /proc files that take the target's memory-map lock (issue 12 A1).

A FIFO stands in for a /proc file whose read never returns: opening it waits for a writer
that never comes. The lab test test_faults_nvml.py blocks a real /proc/PID/cmdline.
"""

import errno
import os
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _procread as procread
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

from conftest import CTL, ctx


@pytest.fixture
def reader(monkeypatch):
    fresh = procscan.BoundedReader(timeout=0.5)
    monkeypatch.setattr(procscan, "READER", fresh)
    yield fresh
    fresh.close()


def block(proc, pid, name):
    path = os.path.join(proc.root, str(pid), name)
    os.unlink(path)
    os.mkfifo(path)
    return path


def test_a_blocked_read_is_bounded_and_the_pid_recorded(proc, reader):
    proc.add(300, comm="stuck", state="D", maps=ctx(0), fds=["/dev/nvidia0"],
             tasks={300: {"state": "D", "wchan": "vm_mmap_pgoff"}})
    path = block(proc, 300, "cmdline")
    started = time.monotonic()
    with pytest.raises(procscan.ReadBlocked):
        procscan.read_bytes(path)
    assert 0.5 <= time.monotonic() - started < 10
    info = reader.blocked[(proc.root, 300)]
    assert info["reason"] == "blocked" and info["state"] == "D" and info["path"] == path
    assert info["blocked_threads"][0]["wchan"] == "vm_mmap_pgoff"
    started = time.monotonic()
    with pytest.raises(procscan.ReadBlocked):
        procscan.read_bytes(os.path.join(proc.root, "300", "maps"))   # the same process: no second wait
    assert time.monotonic() - started < 0.5  # less than one timeout: no second wait
    assert reader.blocked_in(proc.root) == [info]


def test_scan_reports_a_blocked_maps_read_and_never_a_client(proc, reader):
    proc.add(400, comm="python3", maps=ctx(0) + [CTL], fds=["/dev/nvidia0", CTL])
    proc.add(401, comm="stuck", state="D", maps=ctx(1), fds=["/dev/nvidia1", CTL])
    proc.add(402, comm="python3", maps=ctx(2), fds=["/dev/nvidia2"])
    block(proc, 401, "maps")
    result = procscan.scan(proc.root, procscan.DeviceNames(), skip_pids=())
    # one batch: what came before the blocked read and what came after it (a new helper) are both read
    assert sorted(result.entries) == [400, 402] and result.entries[402].map_devices == ["/dev/nvidia2"]
    assert result.unreadable == [401]
    assert [(b["pid"], b["state"], b["fd_devices"]) for b in result.blocked] == [(401, "D", ["/dev/nvidia1", CTL])]
    assert procscan.read_bytes(os.path.join(proc.root, "400", "cmdline")) == b"python3\0"  # a new reader


def test_other_proc_files_are_read_directly(proc, reader):
    proc.add(500, comm="python3")
    assert procscan.read_stat(500, proc.root)["comm"] == "python3"
    assert reader.started == 0


class Interrupted(Exception):
    """Stands for an exception a signal handler raises mid-read (gpu_release's hard stop)."""


def test_a_read_interrupted_before_its_answer_never_answers_the_next_read(proc, reader, monkeypatch):
    proc.add(600, comm="python3", maps=ctx(0))
    proc.add(601, comm="python3", maps=ctx(1))
    late = block(proc, 600, "maps")                 # the helper waits in open() until a writer comes
    wait_for_answer = reader._exactly

    def interrupted(lane, count, end):
        raise Interrupted()
    monkeypatch.setattr(reader, "_exactly", interrupted)
    with pytest.raises(Interrupted):
        procscan.read_bytes(late)
    monkeypatch.setattr(reader, "_exactly", wait_for_answer)
    try:                                            # the first request's answer, should its helper still wait
        fifo = os.open(late, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        fifo = None                                 # nobody waits on it: that helper is gone
    if fifo is not None:
        os.write(fifo, b"stale answer\n")
        os.close(fifo)
    answer = procscan.read_bytes(os.path.join(proc.root, "601", "maps"))
    assert b"/dev/nvidia1" in answer and b"stale" not in answer
    assert reader.started == 2 and reader.blocked == {}


def test_an_answer_to_an_earlier_request_is_skipped(proc, reader):
    proc.add(610, comm="python3", maps=ctx(0))
    proc.add(611, comm="python3", maps=ctx(1))
    assert b"/dev/nvidia0" in procscan.read_bytes(os.path.join(proc.root, "610", "maps"))
    stale = os.path.join(proc.root, "610", "maps").encode()
    helper = reader.lanes[0].proc
    helper.stdin.write(b"%d R - %d %s\n" % (reader.requests - 1, procscan.MAPS_CAP, stale))   # answered, never read
    helper.stdin.flush()
    answer = procscan.read_bytes(os.path.join(proc.root, "611", "maps"))
    assert b"/dev/nvidia1" in answer and b"/dev/nvidia0" not in answer and reader.started == 1


def test_a_dead_reader_is_replaced_once_and_never_read_around(proc, reader, monkeypatch):
    proc.add(620, comm="python3", maps=ctx(0))
    path = os.path.join(proc.root, "620", "maps")
    procscan.read_bytes(path)
    reader.lanes[0].proc.kill()
    reader.lanes[0].proc.wait()
    assert b"/dev/nvidia0" in procscan.read_bytes(path) and reader.started == 2
    reader.close()
    monkeypatch.setattr(procread, "READER_SOURCE", "import sys; sys.exit(0)")   # a reader that cannot answer
    with pytest.raises(OSError) as failed:
        procscan.read_bytes(path)
    assert failed.value.errno == errno.EIO and "failed twice" in str(failed.value) and reader.started == 4
    assert reader.blocked == {}


def test_a_batch_keeps_device_lines_and_fd_targets_and_bounds_each_answer(proc, reader):
    proc.add(700, comm="python3", maps=ctx(0), fds=["/dev/nvidia0", CTL, "/usr/lib/libc.so.6"])
    proc.add(701, comm="python3", maps=ctx(1))
    proc.add(702, comm="python3", maps=ctx(2))
    block(proc, 701, "maps")
    paths = [os.path.join(proc.root, str(pid), "maps") for pid in (700, 701, 702)]
    marker = b"/dev/nvidia"
    started = time.monotonic()
    answers = reader.read_many([(procscan.KEEP_LINES, p, marker) for p in paths]
                               + [(procscan.FD_TARGETS, os.path.join(proc.root, "700", "fd"), marker),
                                  (procscan.WHOLE, os.path.join(proc.root, "799", "maps"), None)])
    assert 0.5 <= time.monotonic() - started < 10       # one wait, for the one blocked read
    size, kept = answers[0]
    whole = open(paths[0], "rb").read()
    assert size == len(whole) and kept and all(marker in line for line in kept.split(b"\n"))
    assert kept.count(b"\n") + 1 == sum(1 for line in whole.splitlines() if marker in line)
    assert isinstance(answers[1], procscan.ReadBlocked) and (proc.root, 701) in reader.blocked
    assert b"/dev/nvidia2" in answers[2][1]
    count, targets = answers[3]
    assert count == 4 and sorted(targets.split(b"\0")) == sorted([b"/dev/nvidia0", CTL.encode()])
    assert answers[4].errno == errno.ENOENT
    assert reader.started == 2
