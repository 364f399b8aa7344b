import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._release import (
    GpuLocks, LockTimeout, decide, find_nvidia_smi, is_supervisor, release, send_guarded,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import Protect, compile_regex

from conftest import CTL, UVM
from fake_nvml import FakeNvml

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- decisions on recorded states

def recorded(proc, gpus, setup):
    setup(proc)
    engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=proc.root, self_pid=999999)
    engine.start()
    return engine, engine.snapshot([g["index"] for g in engine.gpus])


def test_decide_signals_holders_of_targets_only(proc):
    def setup(p):
        p.add(10, maps=["/dev/nvidia0", CTL, UVM], fds=["/dev/nvidia0"])
        p.add(11, maps=["/dev/nvidia1", CTL, UVM], fds=["/dev/nvidia1"])   # bystander on GPU 1
        p.add(12, comm="nvidia-smi", fds=["/dev/nvidia0", CTL])            # client
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}, {"minor": 1, "used_mib": 10}], setup)
    to_signal, skipped = decide(report, [0], [0, 1])
    assert [r["pid"] for r in to_signal] == [10] and skipped == []


def test_decide_protects_builtin_names_pid1_user_entries_and_match(proc):
    g0 = ["/dev/nvidia0", CTL, UVM]

    def setup(p):
        p.add(1, comm="init", ppid=0, maps=g0, fds=g0)
        p.add(20, comm="nvidia-persiste", argv=["/usr/bin/nvidia-persistenced"], maps=g0, fds=g0)
        p.add(21, comm="dcgm-exporter", maps=g0, fds=g0)
        p.add(22, comm="python3", argv=["python3", "serve.py"], maps=g0, fds=g0)
        p.add(23, comm="python3", argv=["python3", "train.py"], maps=g0, fds=g0)
        p.add(24, comm="keepme", maps=g0, fds=g0)
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}], setup)
    to_signal, skipped = decide(report, [0], [0], match=compile_regex(r"train|keepme", "match"),
                                protect=Protect(["keepme"]))
    assert [r["pid"] for r in to_signal] == [23]
    reasons = dict((s["pid"], s["reason"]) for s in skipped)
    assert reasons[1] == "pid 1 is never signalled"
    assert "nvidia-persistenced is on the built-in protect list" == reasons[20]
    assert "dcgm-exporter" in reasons[21]
    assert reasons[22].startswith("does not match `match`")
    assert reasons[24] == "protect entry 'keepme' matches"


def test_decide_unpinned_holder_only_when_every_gpu_is_targeted(proc):
    def setup(p):
        p.add(30, maps=[CTL, UVM], fds=[CTL, UVM])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}, {"minor": 1, "used_mib": 0}], setup)
    to_signal, skipped = decide(report, [0], [0, 1])
    assert to_signal == [] and "cannot be pinned to one GPU" in skipped[0]["reason"]
    to_signal, skipped = decide(report, [0, 1], [0, 1])
    assert [r["pid"] for r in to_signal] == [30] and skipped == []


def test_decide_unpinned_holder_named_by_nvml_on_a_target(proc):
    def setup(p):
        p.add(31, maps=[CTL, UVM], fds=[CTL, UVM, "/dev/nvidia0"])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10, "procs": [(31, 10)]}, {"minor": 1}], setup)
    to_signal, dummy = decide(report, [0], [0, 1])
    assert [r["pid"] for r in to_signal] == [31]


def test_is_supervisor_and_find_nvidia_smi(tmp_path):
    assert is_supervisor(["supervisord"], "")
    assert is_supervisor(["python3"], "/opt/venv/bin/supervisord -c /etc/s.conf")
    assert is_supervisor(["systemd"], "/sbin/init")
    assert not is_supervisor(["bash"], "bash -c train.sh")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert find_nvidia_smi(str(tmp_path)) == str(smi)


# ---- locks

def test_second_lock_waits_then_fails_clearly(tmp_path):
    first, second = GpuLocks(str(tmp_path)), GpuLocks(str(tmp_path))
    first.acquire(["GPU-a", "GPU-b"], 1.0)
    started = time.monotonic()
    with pytest.raises(LockTimeout, match=r"another gpu_release holds the lock on GPU GPU-a .* for more than 0.3s"):
        second.acquire(["GPU-b", "GPU-a"], 0.3)
    assert 0.25 < time.monotonic() - started < 2
    first.release()
    second.acquire(["GPU-a"], 0.5)
    second.release()


# ---- real processes on fake device files, fake NVML that follows them

@pytest.fixture
def devdir(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_bytes(b"\0" * 4096)
    return str(dev)


class Lab(object):
    """Holders started by this test; a fake NVML whose `used` follows whether they still hold."""

    def __init__(self, devdir):
        self.devdir = devdir
        self.procs = []
        self.fake = FakeNvml([{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0}])
        self.stop = threading.Event()
        # a stand-in for "the module": the holders are not its children
        self.module_proc = subprocess.Popen(["sleep", "60"])
        threading.Thread(target=self._follow, daemon=True).start()

    def start(self, kind, minor=0):
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "holder_proc.py"), kind, self.devdir, str(minor)],
                                stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        self.procs.append((proc, minor))
        # Wait until the fake NVML has seen the new holder (the follower thread is slow under load).
        deadline = time.monotonic() + 5
        gpu = next(g for g in self.fake.gpus if g["minor"] == minor)
        while gpu["used_mib"] < 1000 * sum(1 for p, m in self.procs if m == minor and self.holding(p.pid)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc.pid

    def holding(self, pid):
        stat = procscan.read_stat(pid)
        return stat is not None and not (stat["state"] == "Z" and stat["num_threads"] <= 1)

    def _follow(self):
        while not self.stop.is_set():
            for gpu in self.fake.gpus:
                gpu["used_mib"] = sum(1000 for p, m in self.procs if m == gpu["minor"] and self.holding(p.pid))
            time.sleep(0.01)

    def engine(self):
        engine = Engine(Nvml(2.0, lib=self.fake), dev_dir=self.devdir, self_pid=self.module_proc.pid)
        engine.start()
        return engine

    def close(self):
        self.stop.set()
        for proc, dummy in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.module_proc.kill()
        self.module_proc.wait()


@pytest.fixture
def lab(devdir):
    lab = Lab(devdir)
    yield lab
    lab.close()


OPTS = dict(term_timeout=0.5, kill_timeout=1.0, verify_timeout=1.5)


def test_ladder_term_then_kill_for_term_ignoring(lab, tmp_path):
    pid = lab.start("term_ignoring")
    bystander = lab.start("plain", minor=1)
    lab.fake.gpus[0]["used_mib"] = 1000
    time.sleep(0.05)
    logged = []
    failed, msg, result = release(lab.engine(), [0], OPTS, log=logged.append, lock_dir=str(tmp_path))
    assert not failed, msg
    signals = [(a["pid"], a["signal"], a["outcome"]) for a in result["actions"]]
    assert signals == [(pid, "SIGTERM", "sent"), (pid, "SIGKILL", "sent")]
    assert result["rung_reached"] == "sigkill" and result["changed"] and result["released_mib"] == 1000
    assert len(logged) == 2 and "SIGKILL to pid %d" % pid in logged[1]
    assert lab.holding(bystander)
    failed, msg, again = release(lab.engine(), [0], OPTS, lock_dir=str(tmp_path))
    assert not failed and not again["changed"] and again["actions"] == [] and again["rung_reached"] == "none"


def test_ladder_defunct_leader_and_check_mode(lab, tmp_path):
    pid = lab.start("defunct")
    deadline = time.monotonic() + 5
    while procscan.read_stat(pid)["state"] != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    failed, msg, plan = release(lab.engine(), [0], OPTS, check_mode=True, lock_dir=str(tmp_path))
    assert not failed and plan["changed"] and plan["actions"] == []
    assert [p["pid"] for p in plan["plan"]] == [pid] and lab.holding(pid)
    failed, msg, result = release(lab.engine(), [0], OPTS, lock_dir=str(tmp_path))
    assert not failed, msg
    assert not lab.holding(pid) and result["after"][0]["free"]


def test_ladder_fails_honestly_when_match_excludes_the_holder(lab, tmp_path):
    pid = lab.start("plain")
    options = dict(OPTS, match=compile_regex("no-such-workload", "match"))
    failed, msg, result = release(lab.engine(), [0], options, lock_dir=str(tmp_path))
    assert failed and lab.holding(pid) and result["actions"] == []
    assert result["not_signalled"][0]["pid"] == pid
    assert msg.startswith("GPU 0 not free after the ladder") and "does not match `match`" in msg


def test_send_guarded_refuses_a_reused_pid():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        stat = procscan.read_stat(proc.pid)
        record = {"pid": proc.pid, "name": "sleep", "starttime_ticks": stat["starttime"] + 1, "create_time": None}
        assert send_guarded(record, signal.SIGKILL).startswith("not sent: pid %d was reused" % proc.pid)
        assert proc.poll() is None
        record["starttime_ticks"] = stat["starttime"]
        assert send_guarded(record, signal.SIGKILL) == "sent"
        assert proc.wait(5) == -signal.SIGKILL
        assert send_guarded(record, signal.SIGKILL) == "gone"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_plan_lists_gpus_for_every_holder(proc):
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser

    def setup(p):
        p.add(30, maps=[CTL, UVM], fds=[CTL, UVM])
        p.add(31, maps=["/dev/nvidia1", CTL, UVM], fds=["/dev/nvidia1"])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}, {"minor": 1, "used_mib": 10}], setup)
    plan = Releaser(engine, [0, 1]).prepare(report)
    assert [(p["pid"], p["gpus"], p["unattributed"]) for p in plan] == [(30, [0, 1], True), (31, [1], False)]
