"""One holder type (issue 46): a read-only Holder with its identity as a value, and its predicates."""
import copy
import json
import os
import pickle

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml

from conftest import CTL, UVM, ctx, vis
from fake_nvml import FakeNvml


def record(**kw):
    out = {"pid": 40, "starttime_ticks": 1234, "gpus": [], "ambiguous_gpus": [], "maps_gpus": [], "unknown_mapped": [],
           "fd_gpu_minors": []}
    out.update(kw)
    return out


def test_a_holder_is_read_only_and_its_identity_is_pid_and_start_time():
    one = holder.Holder(record(gpus=[1]))
    assert one.ident == (40, 1234) and one["gpus"] == [1] and isinstance(one, dict)
    for write in (lambda: one.__setitem__("gpus", []), lambda: one.update(gpus=[]), lambda: one.pop("gpus"),
                  lambda: one.setdefault("_why", "pinned"), lambda: one.__delitem__("gpus"), one.clear, one.popitem):
        with pytest.raises(TypeError):
            write()
    assert one["gpus"] == [1] and not hasattr(one, "__dict__")
    # a copy, a pickle and the module's JSON keep it whole
    assert copy.deepcopy(one) == one and copy.deepcopy(one).ident == one.ident
    assert pickle.loads(pickle.dumps(one)).ident == (40, 1234)
    assert json.loads(json.dumps(one)) == json.loads(json.dumps(dict(one)))


def test_may_hold_is_the_upper_bound_and_holds_the_evidence():
    pinned = holder.Holder(record(gpus=[1], maps_gpus=[0, 1]))
    assert [pinned.holds(g) for g in range(3)] == [False, True, False]
    assert [pinned.may_hold(g) for g in range(3)] == [False, True, False]      # pinned: the rest is ruled out
    ambiguous = holder.Holder(record(ambiguous_gpus=[2], maps_gpus=[0, 2]))
    assert [ambiguous.holds(g) for g in range(3)] == [False, False, False]
    assert [ambiguous.may_hold(g) for g in range(3)] == [True, False, True]
    unmapped = holder.Holder(record())          # a context no evidence pins, on no GPU node it maps: any GPU
    assert [unmapped.may_hold(g) for g in range(3)] == [True, True, True] and not unmapped.holds(0)
    lost = holder.Holder(record(unknown_mapped=[7]))   # maps only a GPU NVML cannot describe
    assert [lost.may_hold(g) for g in range(3)] == [False, False, False]
    client = holder.Holder(record(fd_gpu_minors=[3]))
    assert client.has_open(3) and not client.has_open(0)


def test_alive_and_same_process_compare_pid_and_start_time():
    me = procscan.read_stat(os.getpid())
    now = holder.Holder(record(pid=os.getpid(), starttime_ticks=me["starttime"]))
    assert now.alive() and now.same_process() and holder.same_process(now.ident)
    reused = holder.Holder(record(pid=os.getpid(), starttime_ticks=me["starttime"] + 1))
    assert not reused.alive() and not reused.same_process()


def test_a_snapshot_gives_read_only_holders_and_clients(proc):
    proc.add(300, maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0", CTL, UVM])
    proc.add(301, comm="nvidia-smi", fds=["/dev/nvidia0", CTL])
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 4096, "procs": [(300, 4096)]}])),
                    proc_root=proc.root, self_pid=999999)
    engine.start()
    try:
        report = engine.snapshot([0])
    finally:
        engine.nvml.shutdown()
    assert [h["pid"] for h in report.holders] == [300] and [c["pid"] for c in report.clients] == [301]
    assert all(isinstance(r, holder.Holder) for r in report.holders + report.clients)
    assert report.holders[0].holds(0) and report.clients[0].has_open(0) and report.gpus[0]["clients"] == [301]
    with pytest.raises(TypeError):
        report.holders[0]["gpus"] = []


@pytest.mark.parametrize("maps, named", [(ctx(0) + vis(1) + [CTL, UVM], False), ([CTL, UVM], True)])
def test_a_protected_ancestor_is_named_where_it_may_hold_the_target_as_the_reset_guard_asks(proc, maps, named):
    """The diagnosis asks may_hold, as the reset guard: an ancestor pinned to GPU 0 that only sees GPU 1 is not
    named for GPU 1; one with a context no evidence pins, mapping no GPU, may hold GPU 1 and is named."""
    from ansible_collections.gpuops.fleet.plugins.module_utils._decide import reset_blockers
    proc.add(1, comm="init", ppid=0)
    proc.add(50, comm="python3", ppid=1, maps=maps, fds=[CTL])     # runs the module
    proc.add(100, comm="python3", ppid=50)                          # the module itself
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 2048, "procs": [(50, 2048)] if maps[0] != CTL
                                             else []}, {"minor": 1, "used_mib": 0}])), proc_root=proc.root, self_pid=100)
    engine.start()
    try:
        report = engine.snapshot([1])
    finally:
        engine.nvml.shutdown()
    ancestor = report.protected_holders[0]
    assert ancestor.may_hold(1) == named
    assert any(line.startswith("pid 50 (python3) is an ancestor of this module") for line in report.diagnosis) == named
    report.holders = report.protected_holders      # the reset guard asks the same predicate of it
    assert bool(reset_blockers(report, report.gpus[0])) == named
