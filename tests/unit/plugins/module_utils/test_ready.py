"""Issue 21: the readiness verdict (pure), NVML's health readings and device access."""
import os

from ansible_collections.gpuops.fleet.plugins.module_utils import _access as access
from ansible_collections.gpuops.fleet.plugins.module_utils import _ready as ready
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml

from fake_nvml import FakeNvml

MEM = {"total_mib": 143771, "reserved_mib": 615, "used_mib": 0}


def gpu(used=0, free=True, **extra):
    return dict({"index": 0, "minor": 0, "free": free, "holders": [], "memory": dict(MEM, used_mib=used)}, **extra)


def test_a_free_idle_gpu_is_ready_and_nothing_asked_means_no_capacity_check():
    assert ready.gpu_verdict(gpu(), 64) == (True, [])


def test_need_mib_above_free_memory_is_not_ready_with_both_numbers():
    ok, not_ready = ready.gpu_verdict(gpu(used=40000, free=False, holders=[7]), 64, need_mib=120000)
    assert not ok
    assert [e["check"] for e in not_ready] == ["free", "capacity"]
    short = not_ready[1]
    assert (short["need_mib"], short["free_mib"]) == (120000, 143771 - 615 - 40000)
    assert "103,156 MiB free, 120,000 MiB needed" in short["reason"]
    assert "holders 7" in not_ready[0]["reason"]


def test_need_fraction_is_taken_of_cuda_total_plus_the_new_context():
    # an engine asking for 0.9 of an idle H200: 0.9 x 143,156 = 128,841, plus the 526 MiB context
    need, how = ready.need_of(MEM, need_fraction=0.9)
    assert need == 128841 + ready.CUDA_CONTEXT_MIB
    assert "0.9 of 143,156 MiB" in how
    assert ready.capacity(dict(MEM, used_mib=13700), need_fraction=0.9) is None
    # 14,000 MiB left behind: NVML says 129,156 free, above 0.9 of the GPU, but not with the engine's own context
    short = ready.capacity(dict(MEM, used_mib=14000), need_fraction=0.9)
    assert short["free_mib"] == 129156 and short["need_mib"] == 129367


def test_not_supported_is_not_applicable_and_a_pending_remap_asks_for_a_reset():
    readings = Nvml(lib=FakeNvml([{"minor": 0, "health": {"row_remap_pending"}}]))
    readings.init()
    summary, failed = ready.health(readings.health(0))
    states = dict((e["check"], e["state"]) for e in summary)
    assert states == {"retired_pages": "not_applicable", "row_remap": "not_ready", "ecc_mode": "ok",
                      "recovery_action": "ok"}
    assert [(f["check"], f["call"]) for f in failed] == [("row_remap", "nvmlDeviceGetRemappedRows")]
    assert failed[0]["remedy"] == ready.RESET


def test_pending_pages_ecc_change_and_recovery_action_each_give_their_remedy():
    nvml = Nvml(lib=FakeNvml([{"minor": 0, "health": {"retired_pages_pending", "ecc_pending", "node_reboot_required"}}]))
    nvml.init()
    summary, failed = ready.health(nvml.health(0))
    by_check = dict((f["check"], f) for f in failed)
    assert sorted(by_check) == ["ecc_mode", "recovery_action", "retired_pages"]
    assert by_check["retired_pages"]["remedy"] == ready.RESET
    assert "from on to off" in by_check["ecc_mode"]["reason"]
    assert by_check["recovery_action"]["remedy"] == ready.REBOOT
    ok, not_ready = ready.gpu_verdict(gpu(), 64, failed)
    assert not ok and len(not_ready) == 3


def test_an_unreadable_call_is_not_ready_and_a_lost_gpu_says_reboot():
    summary, failed = ready.health([{"check": "row_remap", "call": "nvmlDeviceGetRemappedRows", "value": None,
                                     "code": 999, "error": "Unknown Error"}])
    assert summary[0]["state"] == "unreadable" and failed[0]["check"] == "row_remap"
    ok, not_ready = ready.gpu_verdict({"index": 1, "error": "GPU is lost", "error_kind": "lost"}, 64)
    assert not ok and not_ready[0]["check"] == "nvml" and not_ready[0]["remedy"].startswith(ready.REBOOT)


def test_device_access_finds_gpus_by_device_number_and_names_what_does_not_open(tmp_path):
    dev = tmp_path
    for name in ("nvidia0", "nvidiactl"):
        (dev / name).write_bytes(b"")
    os.symlink(str(dev / "gone"), str(dev / "nvidia-uvm"))  # dangling: does not open
    reading = access.read(str(dev), [0, 1])
    assert reading["gpus"][0] == {"paths": [str(dev / "nvidia0")], "errors": []}
    assert reading["gpus"][1] == {"paths": [], "errors": []}
    entries = ready.access(reading, 0)
    assert [e["check"] for e in entries] == ["device_access"]
    assert "nvidia-uvm does not open" in entries[0]["reason"] and "ENOENT" in entries[0]["reason"]
    missing = ready.access(reading, 1)
    assert "no device file of GPU minor 1" in missing[-1]["reason"]
    assert "devN: /dev/nvidia1" in missing[-1]["remedy"]
    assert "revoked" in ready._access_remedy("Operation not permitted (EPERM)", "/dev/nvidia0")
