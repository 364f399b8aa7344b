import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils._diagnose import fmt_mib
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml, NvmlFailure

from conftest import CTL, UVM, ctx, vis
from fake_nvml import FakeNvml


def engine_for(proc, gpus, timeout=2.0, **kw):
    fake = gpus if isinstance(gpus, FakeNvml) else FakeNvml(gpus)
    engine = Engine(Nvml(timeout, lib=fake), proc_root=proc.root, self_pid=999999, **kw)
    engine.start()
    return engine, fake


def test_defunct_leader_sentence_and_holder_details(proc):
    g0 = ctx(0) + [CTL, UVM]
    proc.add(533, state="Z", threads=19, argv=["python3", "train.py", "--token", "abc"],
             tasks=dict([(533, {"state": "Z"})] + [(534 + i, {"state": "S", "maps": g0, "fds": g0}) for i in range(18)]))
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 33000, "procs": [(533, 33000)]}])
    report = engine.snapshot([0])
    holder = report.holders[0]
    assert holder["defunct_leader"] and holder["live_threads"] == 18 and holder["via"] == ["task"]
    assert holder["gpus"] == [0] and holder["cmdline"] == "python3 train.py --token ********"
    assert holder["create_time"] == pytest.approx(1764400000 + 10.0)
    assert report.gpus[0]["nvml_processes"][0]["status"] == "holder"
    assert holder["evidence"] == ["nvml", "mapping"] and holder["shares_mib"] == {0: 33000}
    assert ("pid 533 (python3) is a defunct leader with 18 live threads holding GPU 0 (32.2 GiB by NVML); "
            "SIGKILL to 533 frees it; fuser does not see it") in report.diagnosis
    assert not report.all_free


def test_fork_child_of_dead_pid_is_pinned_and_named_heir_by_its_process_group(proc):
    proc.add(585, comm="pt_data_worker", maps=ctx(0) + [CTL], fds=["/dev/nvidia0", CTL, UVM], pgrp=560)
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 32768, "procs": [(560, 32768)]}])
    report = engine.snapshot([0])
    nvml = report.gpus[0]["nvml_processes"][0]
    assert nvml["status"] == "not_visible" and not nvml["matches_holder"]
    assert report.gpus[0]["holders"] == [585] and report.gpus[0]["unattributed_mib"] == 0
    child = report.holders[0]
    assert child["gpus"] == [0] and child["heir_of"] == [560] and child["shares_mib"] == {0: 32768}
    assert child["evidence"] == ["mapping", "dead_pid", "heir"]
    assert ("NVML names pid 560 on GPU 0, which no longer exists; the memory is held by pid 585 (pt_data_worker), "
            "its forked child (its process group is 560), the only holder NVML does not name that maps a context on "
            "GPU 0; SIGKILL to 585 frees it") in report.diagnosis


def test_unrelated_holder_is_pinned_but_never_called_a_forked_child(proc):
    proc.add(585, comm="python3", maps=ctx(0) + [CTL], fds=["/dev/nvidia0"], pgrp=585, session=300)
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 32768, "procs": [(560, 32768)]}])
    report = engine.snapshot([0])
    assert report.holders[0]["gpus"] == [0] and report.holders[0]["heir_of"] == []
    assert "heir" not in report.holders[0]["evidence"]
    assert not [line for line in report.diagnosis if "forked child" in line]


def test_unattributed_memory_says_look_from_the_node(proc):
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 4000}])
    report = engine.snapshot([0])
    assert report.gpus[0]["unattributed_mib"] == 4000
    assert any(line.startswith("GPU 0 (minor 0): 3.9 GiB is used by no process visible here; look from the node")
               for line in report.diagnosis)


def test_free_uses_v2_used_and_threshold(proc):
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 64}, {"minor": 1, "used_mib": 65}], threshold_mib=64)
    report = engine.snapshot([0, 1])
    assert [g["free"] for g in report.gpus] == [True, False]
    assert report.gpus[0]["memory"] == {"total_mib": 143771, "used_mib": 64, "reserved_mib": 615, "v1_used_mib": 679}


def test_layout_minors_4_to_7_seen_as_0_to_3(proc):
    proc.add(70, maps=ctx(6) + vis(4) + vis(5) + vis(7) + [CTL, UVM], fds=["/dev/nvidia6"])
    engine, dummy = engine_for(proc, [{"minor": m, "used_mib": 1000 if m == 6 else 0} for m in (4, 5, 6, 7)])
    report = engine.snapshot([0, 1, 2, 3])
    holder = report.holders[0]
    assert holder["gpus"] == [2] and holder["gpu_minors"] == [4, 5, 6, 7] and holder["maps_gpus"] == [0, 1, 2, 3]
    assert holder["context_gpus"] == [2] and holder["evidence"] == ["mapping", "unaccounted"]
    assert [g["holders"] for g in report.gpus] == [[], [], [70], []]


def test_client_is_listed_apart_and_never_a_holder(proc):
    proc.add(80, comm="nvidia-smi", fds=["/dev/nvidia0", CTL, UVM])
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 0}])
    report = engine.snapshot([0])
    assert report.holders == [] and [c["pid"] for c in report.clients] == [80]
    assert report.gpus[0]["clients"] == [80] and report.gpus[0]["holders"] == []
    assert any("pid 80 (nvidia-smi) only has" in line and "an NVML client" in line for line in report.diagnosis)


def test_holder_of_only_ctl_and_uvm_is_unattributed(proc):
    proc.add(90, maps=[CTL, UVM], fds=[CTL, UVM])
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 500}, {"minor": 1, "used_mib": 0}])
    report = engine.snapshot([0, 1])
    assert report.holders[0]["unattributed"] and report.as_dict()["holders_unattributed"] == [90]
    assert report.holders[0]["gpus"] == [] and report.holders[0]["evidence"] == []
    assert ("pid 90 (python3) maps only /dev/nvidia-uvm, /dev/nvidiactl: it has a context that no evidence pins to a "
            "GPU; it is signalled only when every GPU it maps (every GPU) is targeted") in report.diagnosis


def test_zombie_reported_with_its_parent_as_holding_nothing(proc):
    proc.add(600, comm="python3")
    proc.add(601, comm="python3", state="Z", threads=1, ppid=600)
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 0}])
    report = engine.snapshot([0])
    assert report.zombies == [{"pid": 601, "name": "python3", "ppid": 600, "parent_name": "python3", "holds": []}]
    assert any(line.startswith("pid 601 (python3) is a zombie holding nothing; its parent 600 (python3)")
               for line in report.diagnosis)
    assert report.holders == []


def test_d_state_holder_sentence_names_wchan(proc):
    g0 = ctx(0) + [CTL, UVM]
    proc.add(812, state="D", maps=g0, fds=g0, tasks={812: {"state": "D", "wchan": "hrtimer_nanosleep"}})
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 1024, "procs": [(812, 1024)]}])
    report = engine.snapshot([0])
    assert report.holders[0]["blocked_threads"][0]["wchan"] == "hrtimer_nanosleep"
    assert any(line.startswith("pid 812 (python3) has thread 812 in D state (wchan hrtimer_nanosleep)")
               for line in report.diagnosis)


def test_legacy_host_pid_that_names_a_local_bystander(proc):
    proc.add(729, comm="bash")
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 100, "procs": [(729, 100)]}])
    report = engine.snapshot([0])
    assert report.gpus[0]["nvml_processes"][0]["status"] == "not_holder"
    assert report.holders == []


def test_own_process_tree_is_not_counted(proc):
    g0 = ["/dev/nvidia0", CTL, UVM]
    proc.add(1, comm="init", ppid=0)
    proc.add(100, comm="python3", ppid=1, maps=g0, fds=g0)   # the module itself (say, a CUDA-using python)
    proc.add(101, comm="nvidia-smi", ppid=100, maps=g0, fds=g0)  # its child
    proc.add(102, comm="python3", ppid=1, maps=g0, fds=g0)   # a real holder
    fake = FakeNvml([{"minor": 0, "used_mib": 10}])
    engine = Engine(Nvml(2.0, lib=fake), proc_root=proc.root, self_pid=100)
    engine.start()
    assert [h["pid"] for h in engine.snapshot([0]).holders] == [102]


def test_lost_gpu_is_a_named_failure_not_free(proc):
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0, "fault": "lost"}])
    report = engine.snapshot([0, 1])
    lost = report.gpus[1]
    assert not lost["free"] and "NVML_ERROR_GPU_IS_LOST" in lost["error"]
    assert not report.all_free and report.errors == [lost]
    assert any(line.startswith("GPU 1: ") and "GPU_IS_LOST" in line for line in report.diagnosis)


def test_hang_times_out_per_gpu_and_other_gpus_answer(proc):
    fake = FakeNvml([{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0, "fault": "hang"}])
    started = time.monotonic()
    engine, dummy = engine_for(proc, fake, timeout=0.3)
    report = engine.snapshot([0, 1])
    fake.release()
    assert time.monotonic() - started < 20  # the hang lasts until released
    assert report.gpus[0]["free"] and not report.gpus[1]["free"]
    assert "did not return within 0.3s (NVML hang)" in report.gpus[1]["error"]


def test_driver_not_loaded_at_init():
    fake = FakeNvml([], init_error=9)
    with pytest.raises(NvmlFailure) as err:
        Nvml(1.0, lib=fake).init()
    assert err.value.kind == "not_loaded" and "NVML_ERROR_DRIVER_NOT_LOADED" in err.value.message


def test_two_hangs_wedge_nvml():
    fake = FakeNvml([{"minor": 0, "fault": "hang"}, {"minor": 1, "fault": "hang"}, {"minor": 2}])
    nvml = Nvml(0.2, lib=fake)
    nvml.init()
    gpus = nvml.list_gpus()
    fake.release()
    assert [g.get("error_kind") for g in gpus] == ["hang", "hang", "hang"]
    assert "NVML is hung" in gpus[2]["error"]


def test_fmt_mib():
    assert fmt_mib(4000) == "3.9 GiB" and fmt_mib(12) == "12 MiB"


def test_an_ancestor_holding_a_gpu_is_protected_counted_and_never_signalled(proc):
    from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide
    proc.add(1, comm="init", ppid=0)
    proc.add(50, comm="python3", ppid=1, maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0"])   # runs the module
    proc.add(100, comm="python3", ppid=50)                                                  # the module itself
    fake = FakeNvml([{"minor": 0, "used_mib": 2048, "procs": [(50, 2048)]}])
    engine = Engine(Nvml(2.0, lib=fake), proc_root=proc.root, self_pid=100)
    engine.start()
    report = engine.snapshot([0])
    assert report.holders == [] and [h["pid"] for h in report.protected_holders] == [50]
    assert report.gpus[0]["protected_holders"] == [50] and not report.gpus[0]["free"] and not report.all_free
    assert report.as_dict()["protected_holders"][0]["gpus"] == [0]
    assert decide(report, [0], [0]).to_signal == []
    assert ("pid 50 (python3) is an ancestor of this module and holds GPU 0 (2.0 GiB by NVML): it is never "
            "signalled, and the GPU is not free while it runs") in report.diagnosis


def test_no_gpu_is_never_all_free(proc):
    from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import no_gpu_message
    engine, dummy = engine_for(proc, [])
    report = engine.snapshot([])
    assert report.all_free is False
    assert no_gpu_message(engine, []).startswith("NVML sees no GPU here (driver 580.159.04-fake, nvmlDeviceGetCount "
                                                 "returned 0)")
    engine, dummy = engine_for(proc, [{"minor": 0, "used_mib": 0}])
    assert no_gpu_message(engine, []).startswith("no GPU selected; NVML sees 0 (minor 0, GPU-")
    assert no_gpu_message(engine, [0]) is None


def test_mps_clients_are_named_where_nvml_lists_them(proc):
    class MpsNvml(FakeNvml):
        def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
            return [type("P", (), {"pid": pid, "usedGpuMemory": mib * 1024 * 1024})()
                    for pid, mib in self.gpus[handle].get("mps", [])]
    proc.add(300, comm="nvidia-cuda-mps", maps=ctx(0) + vis(1), fds=["/dev/nvidia0"])
    proc.add(301, comm="python3", maps=vis(0) + ctx(1), fds=["/dev/nvidia1"])
    fake = MpsNvml([{"minor": 0, "used_mib": 100, "procs": [(300, 100)]},
                    {"minor": 1, "used_mib": 2048, "mps": [(301, 2048)]}])
    engine, dummy = engine_for(proc, fake)
    report = engine.snapshot([0, 1])
    holders = dict((h["pid"], h) for h in report.holders)
    assert holders[301]["gpus"] == [1] and holders[301]["evidence"] == ["nvml", "mapping"]
    assert holders[300]["gpus"] == [0] and report.gpus[1]["unattributed_mib"] == 0


def _mps_world(proc):
    """GPU_FACTS row 26: a server (comm nvidia-cuda-mps, as the control daemon's) with its share on GPU 0, client 301
    on GPU 0 and client 302 on GPU 1, both in NVML's compute list with their MiB and in its MPS list."""
    class MpsNvml(FakeNvml):
        def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
            return [type("P", (), {"pid": pid, "usedGpuMemory": mib * 1024 * 1024})()
                    for pid, mib in self.gpus[handle].get("mps", [])]
    proc.add(300, comm="nvidia-cuda-mps", argv=["nvidia-cuda-mps-server"], maps=ctx(0) + vis(1), fds=["/dev/nvidia0"],
             cgroup="0::/system.slice\n")
    proc.add(301, comm="python3", maps=ctx(0) + vis(1), fds=["/dev/nvidia0"], cgroup="0::/system.slice\n")
    proc.add(302, comm="python3", maps=vis(0) + ctx(1), fds=["/dev/nvidia1"], cgroup="0::/system.slice\n")
    fake = MpsNvml([{"minor": 0, "used_mib": 4162, "procs": [(300, 66), (301, 4096)], "mps": [(301, 4096)]},
                    {"minor": 1, "used_mib": 6144, "procs": [(302, 6144)], "mps": [(302, 6144)]}])
    engine, dummy = engine_for(proc, fake)
    return engine


def test_mps_server_is_signalled_only_with_all_of_its_clients_and_clients_get_terminate_client_first(proc):
    from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide, plan_entry
    engine = _mps_world(proc)
    report = engine.snapshot([0, 1])
    roles = dict((r["pid"], r["mps_role"]) for r in report.holders)
    assert roles == {300: "server", 301: "client", 302: "client"}
    assert [r["protected_name"] for r in report.holders if r["pid"] == 300] == [None]   # not the control daemon
    mps_line = [line for line in report.diagnosis if line.startswith("MPS: ")]
    assert mps_line and "server pid 300 (GPU 0 66 MiB)" in mps_line[0] and "pid 302 (GPU 1 6.0 GiB)" in mps_line[0]
    one = decide(report, [0], [0, 1])
    assert [r["pid"] for r in one.to_signal] == [301]
    assert [s["reason"] for s in one.skipped if s["pid"] == 300] == [
        "the MPS server, signalled only with all of its clients: pid 302 (GPU 1) stays; stopping the server under a "
        "live client leaves that client's work undefined (collateral, whatever the server's own share there)"]
    entry = plan_entry(one.to_signal[0], [0], one, 64)
    assert entry["signals"] == ["terminate_client", "SIGTERM", "SIGKILL"] and entry["note"].startswith("an MPS client")
    both = decide(report, [0, 1], [0, 1])
    assert [r["pid"] for r in both.to_signal] == [300, 301, 302]


def test_the_mps_control_daemon_is_protected_by_its_full_name():
    from ansible_collections.gpuops.fleet.plugins.module_utils._procnames import mps_role, protected_name
    control = ["nvidia-cuda-mps", "nvidia-cuda-mps-control"]
    server = ["nvidia-cuda-mps", "nvidia-cuda-mps-server"]
    assert protected_name(control) == "nvidia-cuda-mps-control" and mps_role(control) == "control"
    assert protected_name(server) is None and mps_role(server) == "server"
    assert protected_name(["nvidia-persiste"]) == "nvidia-persistenced"   # comm alone still matches
