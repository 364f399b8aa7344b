"""Issue 21: what blocks a GPU reset, and what each reset_blockers mode does about it (pure)."""
from ansible_collections.gpuops.fleet.plugins.module_utils import _blockers as blockers


class Report(object):
    def __init__(self, holders=(), clients=(), protected=()):
        self.gpus = [{"index": 0, "minor": 0, "uuid": "GPU-a"}, {"index": 1, "minor": 1, "uuid": "GPU-b"}]
        self.holders, self.clients, self.protected_holders = list(holders), list(clients), list(protected)


ALL = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
DAEMON = {"pid": 40, "name": "nvidia-persiste", "protected_name": "nvidia-persistenced", "fd_gpu_minors": [0, 1]}
MONITOR = {"pid": 41, "name": "nvitop", "protected_name": None, "fd_gpu_minors": [1]}
HOLDER = {"pid": 42, "name": "python3", "protected_name": None, "gpus": [1], "unknown_gpus": [], "maps_gpus": [1],
          "context_gpus": [1], "fd_gpu_minors": [1], "unattributed": False, "ambiguous_gpus": []}
SUPERVISED = {"kind": "supervisord", "name": "p:p", "stop": ["supervisorctl", "stop", "p:p"], "start": []}


def kinds(found, action=None):
    return sorted(b["kind"] for b in found if action is None or b["action"] == action)


def test_nothing_blocks_an_idle_node():
    assert blockers.plan(Report(), [1], {}, "refuse", ALL) == ([], [])


def test_refuse_names_every_blocker_but_leaves_user_holders_to_the_ladder():
    readings = {"persistence": {1: 1}, "mig": {1: 1}, "drm_refcount": 2, "services": {40: SUPERVISED}}
    found, refusals = blockers.plan(Report([HOLDER], [DAEMON, MONITOR]), [1], readings, "refuse", ALL)
    assert kinds(found) == ["daemon", "mig_mode", "nvidia_drm", "nvml_client", "persistence_mode", "user_holder"]
    assert kinds(found, "refused") == ["daemon", "mig_mode", "nvidia_drm", "nvml_client", "persistence_mode"]
    assert len(refusals) == 5 and not [r for r in refusals if "pid 42" in r]
    daemon = [b for b in found if b["kind"] == "daemon"][0]
    assert daemon["gpus"] == [0, 1] and "serves every GPU of the node: 0 (GPU-a), 1 (GPU-b)" in daemon["what"]


def test_stop_services_clears_a_supervised_daemon_and_persistence_but_never_a_monitor():
    readings = {"persistence": {1: 1}, "services": {40: SUPERVISED}}
    found, refusals = blockers.plan(Report([], [DAEMON, MONITOR]), [1], readings, "stop_services", ALL)
    assert kinds(found, "refused") == ["nvml_client"]
    assert refusals == ["pid 41 (nvitop) has GPU 1 open (an NVML client, a monitor): not a service and never signalled: "
                        "stop it yourself"]
    daemon = [b for b in found if b["kind"] == "daemon"][0]
    assert daemon["action"] == "stop supervisord p:p, start it again after the reset"
    assert [b["action"] for b in found if b["kind"] == "persistence_mode"] == [
        "turned off for the reset (nvidia-smi -pm 0), restored after"]


def test_a_daemon_without_a_service_manager_is_refused_in_either_mode():
    for mode in blockers.MODES:
        found, refusals = blockers.plan(Report([], [DAEMON]), [0], {"services": {40: None}}, mode, ALL)
        assert kinds(found, "refused") == ["daemon"] and "not under systemd or supervisord" in refusals[0]


def test_a_monitor_on_another_gpu_does_not_block():
    found, refusals = blockers.plan(Report([], [MONITOR]), [0], {}, "refuse", ALL)
    assert found == [] and refusals == []
