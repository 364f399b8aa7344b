"""Markers of the integration tests, and the repeat of timing-sensitive ones.

Markers: `lab` (needs a lab), `slow` (over a minute alone), `real_lxc` (real LXC containers),
`timing` (depends on timing: respawns, locks, races, timeouts, pid reuse, free delays). GPUOPS_TIMING_REPEAT=N
runs every `timing` test N times (ids end in `[tN]`); `make test` runs them 3 times, `make test-stress` 20.
"""
import os

import pytest

MARKERS = {
    "lab": "brings up a lab (real processes, LXC containers, sshd, the fake driver)",
    "slow": "takes over a minute alone",
    "real_lxc": "runs in real LXC containers",
    "timing": "timing-sensitive: run GPUOPS_TIMING_REPEAT times (make test 3, make test-stress 20)",
}
REPEAT_FIXTURE = "gpuops_timing_round"
# Every integration file by its summed test time in make test, longest first (run_all prints the longest).
LONGEST_FIRST = ("test_node_side.py", "test_playbooks.py", "test_gpu_release.py", "test_systemd_lab.py", "test_connection_pct.py",
                 "test_role_release_gpus.py", "test_role_fleet_node.py", "test_faults_nvml.py",
                 "test_inventory_proxmox_gpu.py", "test_gpu_facts_lab.py", "test_ee.py", "test_gpu_status.py",
                 "test_multi_gpu.py", "test_unprivileged.py", "test_gpu_report.py")
# ansible.cfg beside this file: the controller's poll of its workers every 10 ms instead of 1 ms
os.environ.setdefault("ANSIBLE_CONFIG", os.path.join(os.path.dirname(os.path.abspath(__file__)), "ansible.cfg"))


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", "%s: %s" % (name, text))


def timing_repeat():
    text = os.environ.get("GPUOPS_TIMING_REPEAT", "1")
    if not text.isdigit() or int(text) < 1:
        raise pytest.UsageError("GPUOPS_TIMING_REPEAT must be a positive integer, got %r" % text)
    return int(text)


@pytest.fixture
def gpuops_timing_round(request):
    return request.param


def pytest_generate_tests(metafunc):
    rounds = timing_repeat()
    if rounds > 1 and metafunc.definition.get_closest_marker("timing") is not None:
        metafunc.fixturenames.append(REPEAT_FIXTURE)
        metafunc.parametrize(REPEAT_FIXTURE, range(rounds), indirect=True, ids=lambda n: "t%d" % n)


def pytest_collection_modifyitems(items):
    for item in items:
        if any(name == "clean" or "lab" in name for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.lab)
    # Longest files first (make test's list of the slowest files), then files with a `slow` test: parallel
    # workers, one file at a time each, then end together instead of on one long file started last.
    slow_files = set(item.path.name for item in items if item.get_closest_marker("slow") is not None)

    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST) + (name not in slow_files)
    items.sort(key=rank)
