"""What a lab workload maps: CUDA_VISIBLE_DEVICES over the container's NVML indexes; the driver's allocation view."""

import importlib.util
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[3] / "tests" / "lab"


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workload = load("lab_workload", LAB / "workloads" / "workload.py")
labdriver = load("labdriver_view", LAB / "driver" / "labdriver.py")


@pytest.mark.parametrize("env, shown", [
    (None, [4, 5, 6]),  # every visible GPU, in index order
    ("1,2", [5, 6]),
    ("2,0", [6, 4]),  # CUDA's order is the variable's
    ("1,9,0", [5]),  # CUDA stops at the first invalid entry
    ("", []),
    ("GPU-x", []),
])
def test_cuda_visible_picks_nvml_indexes(monkeypatch, env, shown):
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert workload.cuda_visible([4, 5, 6]) == shown


def test_allocation_view_shows_residue_and_freeing():
    record = {"host_pid": None, "mib": 291, "residue_of": 77, "peers": [[78, 1]]}
    assert labdriver.allocation_view(record) == {"host_pid": None, "mib": 291, "residue_of": 77}
    gone = {"host_pid": 80, "mib": 64, "gone_at": 1.0}
    assert labdriver.allocation_view(gone) == {"host_pid": 80, "mib": 64, "freeing": True}


def test_proc_identity_of_a_missing_pid_is_none():
    assert labdriver.proc_identity(2 ** 22 + 1) is None
