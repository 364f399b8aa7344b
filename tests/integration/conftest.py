"""Markers of the integration tests, and the repeat of timing-sensitive ones.

Markers: `lab` (needs a lab), `slow` (over a minute alone), `real_lxc` (real LXC containers),
`timing` (depends on timing: respawns, locks, races, timeouts, pid reuse). GPUOPS_TIMING_REPEAT=N
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
    # Files with a `slow` test first: parallel workers (make test) then end together, not on one long file.
    slow_files = set(item.path for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: item.path not in slow_files)
