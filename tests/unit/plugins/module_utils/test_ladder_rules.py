"""Issue 46's red team: the ladder's rules kept as they were before the cut (a test fails on the first merge)."""
from types import SimpleNamespace

from ansible_collections.gpuops.fleet.plugins.module_utils._ladder import Releaser


def container_report(**holder):
    record = dict({"pid": 500, "container": "101", "gpus": [], "ambiguous_gpus": [], "maps_gpus": [0]}, **holder)
    return SimpleNamespace(gpus=[{"index": 0, "free": False, "by_container": {}}], holders=[record])


def test_a_container_whose_process_is_one_that_orphaned_memory_fits_still_holds_the_target():
    """NVML names no pid on GPU 0 (by_container empty); the orphaned memory fits 101's process and another: the
    container rung still counts 101 (the first merge asked holds alone and skipped the planned restart)."""
    me = SimpleNamespace(targets=[0])
    assert Releaser._container_holds(me, container_report(ambiguous_gpus=[0]), "101")
    assert Releaser._container_holds(me, container_report(gpus=[0]), "101")
    assert not Releaser._container_holds(me, container_report(), "101"), "a mapping alone restarts nothing"
    assert not Releaser._container_holds(me, container_report(ambiguous_gpus=[0]), "102")


def test_a_sigterm_survivor_is_kept_for_sigkill_by_the_why_of_the_latest_decision_that_chose_it():
    """First planned as a job member, chosen again after the unit stops as pinned; it let go of the GPU: it is not
    SIGKILLed (the first merge read the first plan's why and killed it)."""
    recorded = []
    me = SimpleNamespace(_fresh_report=lambda: None, _decide=lambda report: SimpleNamespace(to_signal=[]),
                         plan=[{"pid": 42, "why": "job_member"}], why_of={42: "pinned", 43: "job_member"},
                         _record=lambda record, sig, outcome: recorded.append((record["pid"], sig, outcome)))
    kept = Releaser._still_holding(me, [{"pid": 42, "name": "python3"}, {"pid": 43, "name": "python3"}])
    assert [r["pid"] for r in kept] == [43]
    assert recorded == [(42, "SIGKILL", "not sent: it no longer holds a targeted GPU")]
