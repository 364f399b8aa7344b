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
    GpuLocks, LockTimeout, Releaser, decide, find_nvidia_smi, send_guarded,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import Protect, compile_regex

from conftest import CTL, UVM, ctx, vis
from fake_nvml import FakeNvml
from release_opts import release, release_opts

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- decisions on recorded states

def recorded(proc, gpus, setup):
    setup(proc)
    engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=proc.root, self_pid=999999)
    engine.start()
    return engine, engine.snapshot([g["index"] for g in engine.gpus])


def pids(records):
    return [r["pid"] for r in records]


def test_decide_signals_holders_of_targets_only(proc):
    def setup(p):
        p.add(10, maps=ctx(0) + vis(1) + [CTL, UVM], fds=["/dev/nvidia0"])
        p.add(11, maps=vis(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia1"])   # bystander on GPU 1, maps GPU 0 too
        p.add(12, comm="nvidia-smi", fds=["/dev/nvidia0", CTL])            # client
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10, "procs": [(10, 10)]},
                                     {"minor": 1, "used_mib": 10, "procs": [(11, 10)]}], setup)
    decision = decide(report, [0], [0, 1])
    assert pids(decision.to_signal) == [10] and decision.skipped == [] and decision.refusals == []


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
    decision = decide(report, [0], [0], match=compile_regex(r"train|keepme", "match"), protect=Protect(["keepme"]))
    assert pids(decision.to_signal) == [23]
    reasons = dict((s["pid"], s["reason"]) for s in decision.skipped)
    assert reasons[1] == "pid 1 is never signalled"
    assert "nvidia-persistenced is on the built-in protect list" == reasons[20]
    assert "dcgm-exporter" in reasons[21]
    assert reasons[22].startswith("does not match `match`")
    assert reasons[24] == "protect entry 'keepme' matches"


def test_decide_unpinned_holder_only_when_every_gpu_is_targeted(proc):
    def setup(p):
        p.add(30, maps=[CTL, UVM], fds=[CTL, UVM])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}, {"minor": 1, "used_mib": 0}], setup)
    decision = decide(report, [0], [0, 1])
    assert decision.to_signal == [] and "not pinned to any GPU" in decision.skipped[0]["reason"]
    decision = decide(report, [0, 1], [0, 1])
    assert pids(decision.to_signal) == [30] and decision.skipped == []


def test_nvml_naming_a_holder_without_a_context_there_is_stale_and_pins_nothing(proc):
    def setup(p):
        p.add(31, maps=[CTL, UVM], fds=[CTL, UVM, "/dev/nvidia0"])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10, "procs": [(31, 10)]}, {"minor": 1}], setup)
    assert report.nvml_stale == [{"gpu": 0, "pid": 31, "used_mib": 10, "why": "pid 31 here has no context on GPU 0"}]
    decision = decide(report, [0], [0, 1])
    assert decision.to_signal == [] and "not pinned to any GPU" in decision.skipped[0]["reason"]
    assert pids(decide(report, [0, 1], [0, 1]).to_signal) == [31]


# ---- several GPUs (GPU_FACTS rows 9-21)

THREE = [{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0}, {"minor": 2, "used_mib": 0}]


def gpus_with(procs, extra=None):
    """Three GPUs; procs: {minor: [(pid, MiB)]}; used is their sum plus extra[minor]."""
    out = []
    for gpu in THREE:
        listed = procs.get(gpu["minor"], [])
        used = sum(m for dummy, m in listed) + (extra or {}).get(gpu["minor"], 0)
        out.append({"minor": gpu["minor"], "used_mib": used, "procs": listed})
    return out


def test_one_gpu_each_target_one_plans_exactly_its_holder(proc):
    def setup(p):
        p.add(40, maps=ctx(0) + vis(1) + vis(2) + [CTL, UVM], fds=["/dev/nvidia0"])
        p.add(41, maps=vis(0) + ctx(1) + vis(2) + [CTL, UVM], fds=["/dev/nvidia1"])
        p.add(42, maps=vis(0) + vis(1) + ctx(2) + [CTL, UVM], fds=["/dev/nvidia2"])
    engine, report = recorded(proc, gpus_with({0: [(40, 2048)], 1: [(41, 2048)], 2: [(42, 2048)]}), setup)
    assert [(h["pid"], h["gpus"], h["maps_gpus"]) for h in report.holders] == [
        (40, [0], [0, 1, 2]), (41, [1], [0, 1, 2]), (42, [2], [0, 1, 2])]
    decision = decide(report, [1], [0, 1, 2])
    assert pids(decision.to_signal) == [41] and decision.skipped == [] and decision.refusals == []


def test_stray_context_is_side_effect_one_way_and_refused_the_other(proc):
    def setup(p):
        p.add(50, maps=ctx(0) + ctx(1) + vis(2) + [CTL, UVM], fds=["/dev/nvidia1"])
    engine, report = recorded(proc, gpus_with({0: [(50, 518)], 1: [(50, 5638)]}), setup)
    assert report.holders[0]["gpus"] == [0, 1] and report.holders[0]["shares_mib"] == {0: 518, 1: 5638}
    releaser = Releaser(engine, [1], release_opts())
    plan = releaser.prepare(report)
    assert releaser.refusals == [] and plan[0]["side_effect_gpus"] == [{"index": 0, "mib": 518}]
    assert "frees GPU 0 (518 MiB) as a side effect" in plan[0]["note"]
    decision = decide(report, [0], [0, 1, 2])
    assert pids(decision.to_signal) == [50] and len(decision.refusals) == 1
    assert decision.refusals[0].startswith("pid 50 (python3) holds GPU 1 (5638 MiB), which is not targeted")
    assert "collateral: stop" in decision.refusals[0] and "target GPU 1 too" in decision.refusals[0]
    assert decide(report, [0], [0, 1, 2], collateral="stop").refusals == []
    assert decide(report, [0], [0, 1, 2], tolerance_mib=6000).refusals == []


def test_two_dead_parents_each_child_pinned_to_its_own_gpu(proc):
    def setup(p):
        p.add(510, comm="child0", maps=ctx(0) + vis(1) + vis(2), fds=["/dev/nvidia0"], pgrp=500)
        p.add(511, comm="child1", maps=vis(0) + ctx(1) + vis(2), fds=["/dev/nvidia1"], pgrp=501)
    engine, report = recorded(proc, gpus_with({0: [(500, 3000)], 1: [(501, 4000)]}), setup)
    assert [(h["pid"], h["gpus"], h["heir_of"]) for h in report.holders] == [(510, [0], [500]), (511, [1], [501])]
    assert pids(decide(report, [1], [0, 1, 2]).to_signal) == [511]


def test_two_children_fitting_one_dead_pid_are_ambiguous_and_spared(proc):
    def setup(p):
        p.add(520, maps=ctx(0) + vis(1), fds=["/dev/nvidia0"])
        p.add(521, maps=ctx(0) + vis(1), fds=["/dev/nvidia0"])
    engine, report = recorded(proc, gpus_with({0: [(500, 3000)]}), setup)
    assert [(h["gpus"], h["ambiguous_gpus"]) for h in report.holders] == [([], [0]), ([], [0])]
    assert report.gpus[0]["ambiguous"] == [520, 521]
    decision = decide(report, [0], [0, 1, 2])
    assert decision.to_signal == [] and [s["reason"].split(":")[0] for s in decision.skipped] == ["ambiguous"] * 2
    assert pids(decide(report, [0, 1], [0, 1, 2]).to_signal) == [520, 521]   # every GPU they map is targeted
    assert any("pid 520 (python3) and pid 521 each map a context on GPU 0" in line for line in report.diagnosis)


def test_legacy_host_pids_are_not_trusted_and_pinning_is_conservative(proc):
    def setup(p):
        p.add(729, comm="bash")
        p.add(60, maps=ctx(0) + vis(1) + vis(2), fds=["/dev/nvidia0"])
        p.add(61, maps=vis(0) + vis(1) + vis(2), fds=["/dev/nvidia1"])
    engine, report = recorded(proc, gpus_with({0: [(729, 2048)]}), setup)
    assert report.as_dict()["nvml_pids_trusted"] is False
    assert [g["nvml_pids_trusted"] for g in report.gpus] == [False, True, True]
    holders = dict((h["pid"], h) for h in report.holders)
    assert holders[60]["gpus"] == [0] and holders[60]["evidence"] == ["mapping", "nvml_stale"]
    assert holders[61]["gpus"] == [] and 729 not in holders
    assert any(line.startswith("NVML names pid 729 on GPU 0, but pid 729 here maps no /dev/nvidia* node")
               for line in report.diagnosis)
    assert pids(decide(report, [0], [0, 1, 2]).to_signal) == [60]


def test_tcp_linked_holders_are_one_job_refused_unless_collateral_stop(proc):
    a, b = "0100007F:1F90", "0100007F:C350"
    table = [(1001, a, b), (1002, b, a)]

    def setup(p):
        p.add(70, comm="tp_rank0", maps=ctx(0) + vis(1) + vis(2), fds=["/dev/nvidia0", "socket:[1001]"],
              netns="n1", tcp=table)
        p.add(71, comm="tp_rank1", maps=vis(0) + ctx(1) + vis(2), fds=["/dev/nvidia1", "socket:[1002]"],
              netns="n1", tcp=table)
        p.add(72, comm="other", maps=vis(0) + vis(1) + ctx(2), fds=["/dev/nvidia2", "socket:[1002]"],
              netns="n2", tcp=table)   # same inode, another namespace: no link
    engine, report = recorded(proc, gpus_with({0: [(70, 3000)], 1: [(71, 3000)], 2: [(72, 3000)]}), setup)
    assert report.as_dict()["jobs"] == [{"id": 70, "pids": [70, 71], "gpus": [0, 1],
                                         "signature": ["rank siblings: the same argv apart from numbers"]}]
    decision = decide(report, [0], [0, 1, 2])
    assert len(decision.refusals) == 1 and "pids 70, 71" in decision.refusals[0]
    assert "collateral: stop (stops the whole job)" in decision.refusals[0]
    stop = decide(report, [0], [0, 1, 2], collateral="stop")
    assert stop.refusals == [] and pids(stop.to_signal) == [70, 71]
    assert pids(decide(report, [0, 1], [0, 1, 2]).to_signal) == [70, 71]


def test_residue_is_charged_to_a_job_only_when_this_run_saw_its_rank_there_die(proc):
    a, b, c = "0100007F:1F90", "0100007F:C350", "0100007F:C351"
    table = [(1001, a, b), (1002, b, a), (1003, a, c), (1004, c, a)]

    def setup(p):
        p.add(80, comm="tp_rank0", maps=ctx(0) + vis(1) + vis(2), fds=["socket:[1001]", "socket:[1003]"],
              netns="n", tcp=table)
        p.add(82, comm="tp_rank2", maps=vis(0) + vis(1) + ctx(2), fds=["socket:[1002]"], netns="n", tcp=table)
    engine, report = recorded(proc, gpus_with({0: [(80, 3000)], 2: [(82, 3000)]}, extra={1: 291}), setup)
    assert report.gpus[1]["residue"] is None and report.gpus[1]["unattributed_mib"] == 291   # no rank seen leaving
    assert decide(report, [1], [0, 1, 2], collateral="stop").to_signal == []
    # this run saw rank 81 (3000 MiB on GPU 1) of the job of 80 and 82 die
    engine.rank_deaths = {1: [{"pid": 81, "mib": 3000, "survivors": [80, 82]}]}
    report = engine.snapshot([0, 1, 2])
    gpu1 = report.gpus[1]
    assert gpu1["residue"] == {"job": 80, "pids": [80, 82], "mib": 291} and gpu1["holders"] == []
    assert any(line.startswith("GPU 1 (minor 1): 291 MiB are held by the surviving ranks of the job of pid 80")
               for line in report.diagnosis)
    decision = decide(report, [1], [0, 1, 2])
    assert decision.refusals and pids(decide(report, [1], [0, 1, 2], collateral="stop").to_signal) == [80, 82]


def test_find_nvidia_smi(tmp_path):
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
    assert 0.25 < time.monotonic() - started < 10
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

    def holding(self, pid, minor=None):
        """Alive, and (when minor is given) some thread of it maps that GPU's node as a context."""
        stat = procscan.read_stat(pid)
        if stat is None or (stat["state"] == "Z" and stat["num_threads"] <= 1):
            return False
        if minor is None:
            return True
        node = os.path.join(self.devdir, "nvidia%d" % minor)
        for tid in os.listdir("/proc/%d/task" % pid) if os.path.isdir("/proc/%d/task" % pid) else ():
            try:
                with open("/proc/%d/task/%s/maps" % (pid, tid)) as f:
                    if f.read().count(node + "\n") >= 3:
                        return True
            except OSError:
                continue
        return False

    def _follow(self):
        """A modern driver in the caller's namespace: used and the pid list follow the holders."""
        while not self.stop.is_set():
            for gpu in self.fake.gpus:
                held = [p.pid for p, m in self.procs if m == gpu["minor"] and self.holding(p.pid, m)]
                gpu["procs"] = [(pid, 1000) for pid in held]
                gpu["used_mib"] = 1000 * len(held)
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


def test_send_guarded_rereads_node_side_membership_before_the_signal():
    """Issue 11: a process whose container changed since the plan is not signalled (scope read again)."""
    from ansible_collections.gpuops.fleet.plugins.module_utils._node import Scope
    proc = subprocess.Popen(["sleep", "30"])
    try:
        stat = procscan.read_stat(proc.pid)
        record = {"pid": proc.pid, "name": "sleep", "starttime_ticks": stat["starttime"], "create_time": None,
                  "container": "101"}
        outcome = send_guarded(record, signal.SIGKILL, recheck=Scope([101]).recheck)
        assert outcome.startswith("not sent: pid %d moved to" % proc.pid) and "out of scope" in outcome
        assert proc.poll() is None
        record["container"] = "host"
        assert send_guarded(record, signal.SIGKILL, recheck=Scope([], host_processes=True).recheck) == "sent"
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


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

    def setup(p):
        p.add(30, maps=[CTL, UVM], fds=[CTL, UVM])
        p.add(31, maps=vis(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia1"])
    engine, report = recorded(proc, [{"minor": 0, "used_mib": 10}, {"minor": 1, "used_mib": 10, "procs": [(31, 10)]}],
                              setup)
    plan = Releaser(engine, [0, 1], release_opts()).prepare(report)
    assert [(p["pid"], p["gpus"], p["unattributed"], p["why"]) for p in plan] == [
        (30, [0, 1], True, "unpinned_all_mapped"), (31, [1], False, "pinned")]


def test_job_with_a_member_left_out_by_match_is_refused_whole(proc):
    a, b = "0100007F:1F90", "0100007F:C350"
    table = [(1001, a, b), (1002, b, a)]

    def setup(p):
        p.add(90, comm="tp_rank0", argv=["python3", "serve.py"], maps=ctx(0) + vis(1), fds=["socket:[1001]"],
              netns="n", tcp=table)
        p.add(91, comm="tp_rank1", argv=["python3", "other.py"], maps=vis(0) + ctx(1), fds=["socket:[1002]"],
              netns="n", tcp=table)
    engine, report = recorded(proc, gpus_with({0: [(90, 3000)], 1: [(91, 3000)]}), setup)
    decision = decide(report, [0, 1], [0, 1, 2], match=compile_regex("serve", "match"))
    assert len(decision.refusals) == 1
    assert decision.refusals[0].startswith("pid 90 (tp_rank0) belongs to the job of pid 90 (pids 90, 91")
    assert "pid 91 (tp_rank1) of that job may not be signalled (does not match `match`" in decision.refusals[0]


def test_a_sigterm_survivor_that_let_go_of_its_gpu_is_not_killed(lab, tmp_path):
    pid = lab.start("let_go_on_term")          # frees its context on SIGTERM, then writes a checkpoint
    stubborn = lab.start("term_ignoring")       # keeps GPU 0 busy past term_timeout
    failed, msg, result = release(lab.engine(), [0], dict(OPTS, term_timeout=0.3), lock_dir=str(tmp_path))
    assert not failed, msg
    assert lab.holding(pid) and not lab.holding(pid, 0) and not lab.holding(stubborn)
    assert [(a["signal"], a["outcome"]) for a in result["actions"] if a["pid"] == pid] == [
        ("SIGTERM", "sent"), ("SIGKILL", "not sent: it no longer holds a targeted GPU")]
    assert [a["signal"] for a in result["actions"] if a["pid"] == stubborn] == ["SIGTERM", "SIGKILL"]


def test_reset_has_its_own_timeout_not_verify_timeout(lab, tmp_path):
    flag = tmp_path / "reset-done"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nsleep 1.5\ntouch %s\necho GPU reset\n" % flag)
    smi.chmod(0o755)
    lab.stop.set()   # no follower: this GPU's memory leaked, no process holds it
    time.sleep(0.05)
    gpu = lab.fake.gpus[0]
    gpu.update(used_mib=4096, procs=[])

    def clear_after_reset():
        while not flag.exists():
            time.sleep(0.01)
        gpu["used_mib"] = 0
    threading.Thread(target=clear_after_reset, daemon=True).start()
    options = dict(OPTS, verify_timeout=0.3, gpu_reset=True, reset_timeout=5.0, nvidia_smi=str(smi))
    failed, msg, result = release(lab.engine(), [0], options, lock_dir=str(tmp_path / "locks"))
    assert not failed, msg
    assert [(a["signal"], a["outcome"].split(":")[0]) for a in result["actions"]] == [("reset", "done")]
    assert result["rung_reached"] == "reset" and result["after"][0]["free"]


def test_lock_dir_is_made_0700_and_a_hostile_one_is_refused(tmp_path):
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import LockDirError
    good = tmp_path / "run" / "gpuops-fleet"
    locks = GpuLocks(str(good))
    locks.acquire(["GPU-a"], 1.0)
    locks.release()
    assert oct(os.stat(str(good)).st_mode & 0o777) == "0o700"
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(LockDirError, match="it is a symbolic link"):
        GpuLocks(str(link)).acquire(["GPU-a"], 1.0)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(str(loose), 0o755)
    with pytest.raises(LockDirError, match="its mode is 0755, it must be 0700"):
        GpuLocks(str(loose)).acquire(["GPU-a"], 1.0)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(str(other), 4242, 4242)
    with pytest.raises(LockDirError, match="belongs to uid 4242"):
        GpuLocks(str(other)).acquire(["GPU-a"], 1.0)
    target = tmp_path / "victim"
    target.write_text("keep")
    os.symlink(str(target), os.path.join(str(good), "gpuops-fleet-gpu-GPU-b.lock"))
    with pytest.raises(LockDirError, match="lock file .* is a symbolic link"):
        GpuLocks(str(good)).acquire(["GPU-b"], 1.0)
    assert target.read_text() == "keep"


def test_a_hard_stop_keeps_what_was_signalled(lab, tmp_path):
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import ReleaseTimeout, backstop_result
    pid = lab.start("term_ignoring")
    progress = {}

    def inside_release(frame):
        while frame is not None:
            if frame.f_code.co_name == "release" and frame.f_code.co_filename.endswith("_release.py"):
                return True
            frame = frame.f_back
        return False

    def hard_stop(signum, frame):
        # Only while the collection's own code runs inside release(), as the module's alarm would find it: a tick
        # in pytest's handling of the first exception, or in the standard library's traceback code or a
        # finalizer, must not raise there (both failed fresh-clone CI runs under load).
        if os.sep.join(("plugins", "module_utils", "")) in frame.f_code.co_filename and inside_release(frame):
            raise ReleaseTimeout("the overall timeout was reached (hard stop)")
    previous = signal.signal(signal.SIGALRM, hard_stop)
    # fires mid-wait after SIGTERM, then every 2 ms, so that it also escapes release()'s own clean-up
    signal.setitimer(signal.ITIMER_REAL, 0.6, 0.002)
    try:
        with pytest.raises(ReleaseTimeout):
            release(lab.engine(), [0], dict(OPTS, term_timeout=30), lock_dir=str(tmp_path), progress=progress)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    kept = backstop_result(progress)
    assert kept["changed"] is True and kept["rung_reached"] == "sigterm"
    assert [(a["pid"], a["signal"], a["outcome"]) for a in kept["actions"]] == [(pid, "SIGTERM", "sent")]


DENIED = r'''
import os, sys, json
sys.path[:0] = sys.argv[3].split(os.pathsep)
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._release import send_guarded
pid = int(sys.argv[1])
record = {"pid": pid, "name": "sleep", "starttime_ticks": procscan.read_stat(pid)["starttime"],
          "create_time": float(sys.argv[2])}
os.setgid(4242)
os.setuid(4242)
print(json.dumps([send_guarded(record, 9, use_pidfd=False), send_guarded(record, 9)]))
'''


def test_access_denied_without_pidfd_is_an_outcome_not_a_crash():
    import json
    import psutil
    target = subprocess.Popen(["sleep", "30"])
    try:
        created = psutil.Process(target.pid).create_time()
        out = subprocess.run([sys.executable, "-c", DENIED, str(target.pid), repr(created), os.pathsep.join(sys.path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, check=False)
        assert out.returncode == 0, out.stderr
        fallback, pidfd = json.loads(out.stdout)
        assert fallback.startswith("error: access denied") and pidfd.startswith("error: ")
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


# ---- issue 17: one lock per file (a container whose /run/lock is the node's)

def _fake_container_init(proc, pid, vmid, root):
    """A container's init in a recorded /proc: NSpid (pid, 1), cgroup lxc/VMID/ns, root -> the container's root."""
    folder = proc / str(pid)
    folder.mkdir()
    (folder / "status").write_text("Name:\tinit\nNSpid:\t%d\t1\n" % pid)
    (folder / "cgroup").write_text("0::/lxc/%s/ns/init.scope\n" % vmid)
    os.symlink(str(root), str(folder / "root"))  # as /proc/PID/root: a link to the process's root


def test_a_container_lock_file_that_is_the_nodes_own_is_taken_once(tmp_path):
    from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
    from ansible_collections.gpuops.fleet.plugins.module_utils._locks import ContainerLocks
    shared_root = tmp_path / "shared"          # /run/lock of the node, also that of containers 103 and 104
    (shared_root / "run").mkdir(parents=True)
    node_dir = shared_root / "run" / "lock" / "gpuops-fleet"
    own_root = tmp_path / "ct105"              # 105 has a /run/lock of its own
    (own_root / "run").mkdir(parents=True)
    own_dir = own_root / "run" / "lock" / "gpuops-fleet"
    proc = tmp_path / "proc"
    proc.mkdir()
    _fake_container_init(proc, 4242, 103, shared_root)
    _fake_container_init(proc, 4343, 104, shared_root)
    _fake_container_init(proc, 4444, 105, own_root)
    keys = ["GPU-b", "GPU-a"]
    node_locks = GpuLocks(str(node_dir))
    node_locks.acquire(keys, 2.0)
    locks = ContainerLocks(node_locks, str(proc), node.Scope([103, 104, 105]), keys, 2.0)
    try:
        by_root = dict((taken.lock_dir, taken) for taken in locks.all[1:])
        for pid in (4242, 4343):     # the same files by another path: closed, never flocked a second time
            aliased = by_root["%s/%d/root/run/lock/gpuops-fleet" % (proc, pid)]
            assert aliased.locked == [] and len(aliased.aliases) == 2
            assert sorted(held for dummy, held in aliased.aliases) == sorted(node_locks.path(k) for k in keys)
        assert len(by_root["%s/4444/root/run/lock/gpuops-fleet" % proc].locked) == 2
        for folder in (node_dir, own_dir):   # each file is held against any other taker
            with pytest.raises(LockTimeout):
                GpuLocks(str(folder)).acquire(["GPU-a"], 0.2)
            with pytest.raises(LockTimeout):
                GpuLocks(str(folder)).acquire(["GPU-b"], 0.2)
    finally:
        locks.release()
    assert node_locks.held == {}
    for folder in (node_dir, own_dir):
        after = GpuLocks(str(folder))
        after.acquire(keys, 0.2)
        after.release()


def test_two_keys_naming_one_lock_file_do_not_wait_on_each_other(tmp_path):
    locks = GpuLocks(str(tmp_path / "locks"))
    locks.acquire(["GPU-a/b", "GPU-a_b"], 1.0)   # one file name after sanitising
    try:
        assert len(locks.fds) == 1 and locks.waited_s < 0.5
        with pytest.raises(LockTimeout):
            GpuLocks(str(tmp_path / "locks")).acquire(["GPU-a_b"], 0.2)
    finally:
        locks.release()


def test_a_v1_estimate_is_free_by_estimate_never_verified_free(lab, tmp_path):
    from fake_nvml import NVMLError
    v2 = lab.fake.nvmlDeviceGetMemoryInfo

    def v1_only(handle, version=None):   # a driver without the v2 memory call
        if version:
            raise NVMLError(13)
        return v2(handle)
    lab.fake.nvmlDeviceGetMemoryInfo = v1_only
    pid = lab.start("plain")

    def engine():
        made = Engine(Nvml(2.0, lib=lab.fake, reserved_floor_mib=615), dev_dir=lab.devdir, self_pid=lab.module_proc.pid)
        made.start()
        return made
    failed, msg, result = release(engine(), [0], OPTS, lock_dir=str(tmp_path))
    assert not failed and not lab.holding(pid) and result["changed"], msg
    assert msg.startswith("free by estimate (this driver has no v2 memory call") and "verified free" not in msg
    failed, msg, again = release(engine(), [0], OPTS, lock_dir=str(tmp_path))
    assert not failed and not again["changed"] and msg.startswith("every targeted GPU is already free (by estimate")


class StubBackend(object):
    """A restart backend that records what it is asked; `lock` is the container's lock now."""
    name = "cli"

    def __init__(self):
        self.lock, self.calls = None, []

    def lock_of(self, vmid):
        return self.lock

    def ha_state(self, vmid):
        return None

    def stop(self, vmid, timeout):
        self.calls.append(("stop", vmid))
        return {"task": "pct stop %s" % vmid, "ok": True, "seconds": 0.1, "text": ""}

    def start(self, vmid, timeout):
        self.calls.append(("start", vmid))
        return {"task": "pct start %s" % vmid, "ok": True, "seconds": 0.1, "text": ""}


class HeldByContainer(object):
    """An engine whose snapshot shows container 101 holding GPU 0."""
    proc_root = "/proc"
    gpus = [{"index": 0}]

    def gpu(self, index):
        return {"index": index, "uuid": "GPU-00000000-0000-0000-0000-000000000000"}

    def stale_listing(self):
        return False

    def snapshot(self, targets, **given):
        class Report(object):
            gpus = [{"index": 0, "free": False, "by_container": {"101": 1000}}]
            holders, nvml_stale, unknown_gpus = [], [], []
        return Report()


def test_the_container_rung_reads_the_lock_again_right_before_the_restart():
    backend = StubBackend()
    releaser = Releaser(HeldByContainer(), [0], release_opts(container_restart=True, restart_backend=backend))
    releaser.restart_plan = [{"vmid": 101, "refusal": None}]     # planned while the container was unlocked
    backend.lock = "backup"                                      # a backup started since
    releaser._restart_containers("respawned by pid 7 (sh)")
    assert backend.calls == [] and releaser.restarted == []
    assert releaser.failure.startswith("respawned by pid 7 (sh); container 101 is locked (backup)")
    backend.lock = None
    releaser._restart_containers("respawned by pid 7 (sh)")
    assert backend.calls == [("stop", 101), ("start", 101)] and releaser.failure is None


def test_a_container_restart_counts_an_unpinned_holders_other_gpus_as_collateral():
    """A planned holder's untargeted shares count over the tolerance; any other process's GPUs by may_hold, with no
    tolerance (issue 42 C1: a process whose only work is small on an untargeted GPU is still collateral)."""
    from types import SimpleNamespace
    from ansible_collections.gpuops.fleet.plugins.module_utils._decide import set_collateral
    base = {"maps_gpus": [], "unknown_gpus": [], "context_gpus": []}
    pinned = dict(base, pid=10, gpus=[0, 2], shares_mib={0: 9000, 2: 5000}, ambiguous_gpus=[], maps_gpus=[0, 2])
    unpinned = dict(base, pid=11, gpus=[], shares_mib={}, ambiguous_gpus=[], maps_gpus=[0, 1, 3], context_gpus=[0, 1, 3])
    small = dict(base, pid=12, gpus=[1], shares_mib={1: 600}, ambiguous_gpus=[], maps_gpus=[0, 1], context_gpus=[1])
    report = SimpleNamespace(holders=[pinned, unpinned, small], unreadable=[])
    members = [{"pid": p, "name": "p%d" % p} for p in (10, 11, 12, 13)]

    def lost(targets, planned):
        return [(c["pid"], c["gpus"]) for c in set_collateral(members, report, targets, range(4), planned, 640)]
    assert lost({0}, {10}) == [(10, [2]), (11, [1, 3]), (12, [1])]
    assert lost({0, 2}, {10}) == [(11, [1, 3]), (12, [1])]       # 600 MiB on untargeted GPU 1: no tolerance
    assert lost({0, 1, 2, 3}, {10}) == []
    pinned["shares_mib"][2] = 600                              # a planned holder's bare context stays tolerated
    assert lost({0, 1, 3}, {10, 11, 12}) == []


def test_a_rank_that_dies_during_the_run_charges_its_residue_to_the_survivors(proc):
    """The releaser tells the engine which ranks of the jobs it saw at the start are gone (issue 18 residue)."""
    import shutil
    a, b = "0100007F:1F90", "0100007F:C350"
    table = [(1001, a, b), (1002, b, a)]

    def setup(p):
        p.add(80, comm="tp_rank0", maps=ctx(0) + vis(1), fds=["socket:[1001]"], netns="n", tcp=table)
        p.add(81, comm="tp_rank1", maps=vis(0) + ctx(1), fds=["socket:[1002]"], netns="n", tcp=table)
    gpus = [{"minor": 0, "used_mib": 3000, "procs": [(80, 3000)]}, {"minor": 1, "used_mib": 3000, "procs": [(81, 3000)]}]
    engine, report = recorded(proc, gpus, setup)
    releaser = Releaser(engine, [1], release_opts())
    releaser.prepare(report)
    assert releaser.refusals        # part of a job: refused before any signal
    shutil.rmtree(os.path.join(proc.root, "81"))     # rank 1 dies; its peer keeps 291 MiB on GPU 1 (row 19)
    gpus[1].update(used_mib=291, procs=[])
    fresh = releaser._fresh_report()
    assert engine.rank_deaths == {1: [{"pid": 81, "mib": 3000, "survivors": [80]}]}
    assert fresh.gpus[0]["residue"] is None        # a one-rank "job" is no job any more: nothing to charge
    proc.add(82, comm="tp_rank2", maps=vis(0) + vis(1), fds=["socket:[1002]"], netns="n", tcp=table)
    fresh = releaser._fresh_report()
    assert fresh.gpus[0]["residue"] == {"job": 80, "pids": [80, 82], "mib": 291}


def idle_pair(proc, used0):
    """Two GPUs over an empty fake /proc (no follower: nothing changes them but the test)."""
    fake = FakeNvml([{"minor": 0, "used_mib": used0}, {"minor": 1, "used_mib": 0}])
    engine = Engine(Nvml(2.0, lib=fake), proc_root=proc.root, self_pid=999999)
    engine.start()
    return fake, engine


def test_a_reset_gpu_that_does_not_come_back_is_not_free_though_its_index_now_names_a_free_one(proc, tmp_path):
    """Issue 18: targets are UUIDs; after the reset's NVML re-init, index 0 is the other (idle) GPU."""
    fake, engine = idle_pair(proc, 4096)       # GPU 0's memory leaked: no process holds it
    flag, gone = tmp_path / "reset-done", tmp_path / "gpu-gone"
    smi = tmp_path / "nvidia-smi"
    # the reset returns once the GPU is gone, as a real one that falls off the bus during its reset
    smi.write_text("#!/bin/sh\ntouch %s\nwhile [ ! -e %s ]; do sleep 0.01; done\necho GPU reset\n" % (flag, gone))
    smi.chmod(0o755)
    lost_uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def gone_after_reset():
        while not flag.exists():
            time.sleep(0.01)
        del fake.gpus[0]      # NVML now counts one GPU, the idle one, as index 0
        gone.touch()
    threading.Thread(target=gone_after_reset, daemon=True).start()
    options = dict(OPTS, verify_timeout=0.3, gpu_reset=True, reset_timeout=5.0, nvidia_smi=str(smi))
    failed, msg, result = release(engine, [0], options, lock_dir=str(tmp_path / "locks"))
    assert [(a["signal"], a["outcome"].split(":")[0]) for a in result["actions"]] == [("reset", "done")]
    assert failed and lost_uuid in msg and "not free" in msg, msg
    assert "verified free" not in msg


def test_a_target_found_again_at_another_index_is_read_there(proc):
    fake, engine = idle_pair(proc, 0)
    releaser = Releaser(engine, [1], release_opts())
    fake.gpus.reverse()                      # after a re-init, NVML lists the targeted GPU first
    fake.gpus[0]["used_mib"] = 2048
    engine.nvml.init()
    assert not releaser._memory_free() and releaser.targets == [0] and releaser.missing == []
    fake.gpus[0]["used_mib"] = 0
    assert releaser._memory_free()
