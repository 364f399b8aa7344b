"""Parsers and pid translation of the lab driver daemon, on recorded /proc text; its reading of a live holder's locks."""

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib.common import proc_state

DRIVER = Path(__file__).resolve().parents[3] / "tests" / "lab" / "driver" / "labdriver.py"
spec = importlib.util.spec_from_file_location("labdriver", DRIVER)
labdriver = importlib.util.module_from_spec(spec)
spec.loader.exec_module(labdriver)

# /proc/locks recorded on this kind of host: two holders of one inode, a POSIX lock, a waiter.
PROC_LOCKS = """\
1: FLOCK  ADVISORY  READ 20709 fe:00:2147122 0 EOF
2: FLOCK  ADVISORY  READ 20664 fe:00:2147105 0 EOF
3: POSIX  ADVISORY  WRITE 811 00:1a:1234 0 EOF
4: FLOCK  ADVISORY  WRITE 30 103:02:77 0 EOF
4: -> FLOCK  ADVISORY  WRITE 31 103:02:77 0 EOF
5: FLOCK  ADVISORY  READ 20575 fe:00:2147105 0 EOF
"""

STATUS = """\
Name:\tpython3
State:\tS (sleeping)
Tgid:\t729
NSpid:\t729\t2
NStgid:\t729\t2
Threads:\t1
"""

CGROUP_HYBRID = """\
12:freezer:/gpuops-lab-ab12cd34/pve1/101
3:cpu:/
0::/gpuops-lab-ab12cd34/pve1/lxc/101/ns/supervisor
"""


def test_proc_locks_keeps_only_flock_holders():
    held = labdriver.parse_proc_locks(PROC_LOCKS)
    assert held == {
        (20709, 0xFE, 0, 2147122),
        (20664, 0xFE, 0, 2147105),
        (30, 0x103, 2, 77),
        (20575, 0xFE, 0, 2147105),
    }


def test_proc_locks_ignores_garbage():
    assert labdriver.parse_proc_locks("1: FLOCK ADVISORY READ x fe:00:1 0 EOF\n\nnonsense\n") == set()


def test_nspids_outermost_first():
    assert labdriver.parse_nspids(STATUS) == [729, 2]
    assert labdriver.parse_nspids("Name:\tx\n") is None


def test_cgroup_v2_line_in_hybrid_layout():
    assert labdriver.parse_cgroup_v2(CGROUP_HYBRID) == "/gpuops-lab-ab12cd34/pve1/lxc/101/ns/supervisor"
    assert labdriver.parse_cgroup_v2("3:cpu:/\n") is None


@pytest.mark.parametrize("path, expected", [
    ("/gpuops-lab-x/pve1/lxc/101/ns", True),
    ("/gpuops-lab-x/pve1/lxc/101/ns/supervisor", True),
    ("/gpuops-lab-x/pve1/lxc/101/nsx", False),
    ("/gpuops-lab-x/pve1/lxc/1011/ns", False),
    ("/", False),
    (None, False),
])
def test_in_cgroup(path, expected):
    assert labdriver.in_cgroup(path, "/gpuops-lab-x/pve1/lxc/101/ns") is expected


RECORD = {"host_pid": 729, "chain": [(4026532500, 2), (4026531836, 729)]}


def test_modern_pid_in_the_callers_namespace():
    assert labdriver.translate_pid(RECORD, 4026532500, "modern") == 2
    assert labdriver.translate_pid(RECORD, 4026531836, "modern") == 729


def test_modern_pid_hidden_from_another_namespace():
    assert labdriver.translate_pid(RECORD, 4026532999, "modern") is None


def test_legacy_pid_is_the_host_pid_everywhere():
    assert labdriver.translate_pid(RECORD, 4026532500, "legacy") == 729
    assert labdriver.translate_pid(RECORD, 4026532999, "legacy") == 729


def test_uuid_is_stable_and_distinct():
    one = labdriver.gpu_uuid("ab12cd34", "pve1", 0)
    assert one == labdriver.gpu_uuid("ab12cd34", "pve1", 0)
    assert one.startswith("GPU-") and len(one) == 40
    assert len({labdriver.gpu_uuid(rid, node, m) for rid in ("a", "b") for node in ("pve1", "pve2")
                for m in range(8)}) == 32


def test_pci_bus_ids_follow_h200_slots():
    expected = ["00000000:18:00.0", "00000000:5D:00.0", "00000000:DB:00.0"]
    assert [labdriver.pci_bus_id(m) for m in (0, 3, 7)] == expected
    assert len({labdriver.pci_bus_id(m) for m in range(16)}) == 16


def test_gpu_key_round_trip():
    assert labdriver.gpu_key("pve1/3") == ("pve1", 3)


def test_flocks_of_reads_the_holders_own_fdinfo(tmp_path):
    path = tmp_path / "nvidia0"
    path.write_text("")
    st = os.stat(path)
    key = (os.getpid(), os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    with open(path) as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        assert key in labdriver.flocks_of(os.getpid())
        fcntl.flock(handle, fcntl.LOCK_UN)
        assert key not in labdriver.flocks_of(os.getpid())
    assert labdriver.flocks_of(2 ** 22 + 1) == set()


def test_a_holder_missing_from_a_torn_proc_locks_read_keeps_its_memory(tmp_path, monkeypatch):
    """A read of /proc/locks longer than a page can miss a live holder's entry; the holder's fdinfo decides, so
    its memory stays, and goes (free delay 0) once it really lets go."""
    (tmp_path / "driver").mkdir()
    (tmp_path / "lab.json").write_text(json.dumps({"free_delay_s": 0}))
    path = tmp_path / "nvidia0"
    path.write_text("")
    st = os.stat(path)
    real_read_text = labdriver.read_text
    monkeypatch.setattr(labdriver, "read_text", lambda p: "" if p == "/proc/locks" else real_read_text(p))
    driver = labdriver.Driver(str(tmp_path))
    driver.records = [{"node": "pve1", "minor": 0, "dev": [os.major(st.st_dev), os.minor(st.st_dev)],
                       "inode": st.st_ino, "host_pid": os.getpid(), "chain": [], "mib": 512, "vmid": None}]
    with open(path) as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        driver.live_state()
        assert [(r["mib"], "gone_at" in r) for r in driver.records] == [(512, False)]
        fcntl.flock(handle, fcntl.LOCK_UN)
        driver.live_state()
        assert driver.records == []


def test_flocks_of_a_defunct_leader_are_read_through_its_live_thread(tmp_path):
    """GPU_FACTS row 4: the leader exited alone (its fdinfo is empty); a thread still holds the files."""
    path = tmp_path / "nvidia0"
    path.write_text("")
    code = ("import ctypes, fcntl, sys, threading, time\n"
            "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH)\n"
            "threading.Thread(target=time.sleep, args=(60,)).start()\n"
            "print('locked', flush=True); ctypes.CDLL(None).syscall(60, 0)\n")   # SYS_exit: this thread only
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n"
        deadline = time.monotonic() + 30
        while proc_state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_state(proc.pid) == "Z" and os.listdir("/proc/%d/fdinfo" % proc.pid) == []
        st = os.stat(path)
        assert labdriver.flocks_of(proc.pid) == {(proc.pid, os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)}
    finally:
        proc.kill()
        proc.wait()
