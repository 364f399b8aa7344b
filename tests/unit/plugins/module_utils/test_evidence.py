"""Issue 18's reproductions: no kill list rests on an assumption (the engine over a fake /proc and a stub NVML).

Each test ran on the commit before the change and failed there (see the issue's closing note).
"""

from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide

from conftest import CTL, UVM, ctx, vis
from fake_nvml import FakeNvml


def snapshot(proc, gpus):
    engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=proc.root, self_pid=999999)
    engine.start()
    return engine.snapshot([g["index"] for g in engine.gpus if g.get("error") is None])


def signalled(decision):
    return [r["pid"] for r in decision.to_signal]


def test_the_holder_of_a_lost_untargeted_gpu_is_not_signalled(proc):
    for gpu in range(4):
        proc.add(10 + gpu, maps=sum((ctx(m) if m == gpu else vis(m) for m in range(4)), []) + [CTL, UVM],
                 fds=["/dev/nvidia%d" % gpu])
    report = snapshot(proc, [{"minor": m, "used_mib": 4096, "procs": [(10 + m, 4096)],
                              "fault": "lost" if m == 3 else None} for m in range(4)])
    decision = decide(report, [0, 1, 2], [0, 1, 2, 3])
    assert signalled(decision) == [10, 11, 12] and decision.refusals == []
    assert report.as_dict()["unknown_gpus"] == [{"minor": 3, "index": None, "held_by": [13]}]


def test_a_holder_with_contexts_on_a_target_and_on_a_lost_gpu_is_collateral_of_unknown_size(proc):
    proc.add(20, maps=ctx(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia0"])
    report = snapshot(proc, [{"minor": 0, "used_mib": 4096, "procs": [(20, 4096)]},
                             {"minor": 1, "used_mib": 4096, "fault": "lost"}])
    refused = decide(report, [0], [0, 1])
    assert len(refused.refusals) == 1 and "an unknown amount" in refused.refusals[0]
    assert signalled(decide(report, [0], [0, 1], collateral="stop")) == [20]


def test_nvml_naming_a_reused_pid_does_not_pin_it_and_the_fork_child_is_signalled(proc):
    # NVML still names the dead parent 560 on GPU 0; pid 560 now belongs to a process with a bare context on GPU 1
    proc.add(560, comm="other", maps=vis(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia1"])
    proc.add(585, comm="pt_data_worker", maps=ctx(0) + vis(1) + [CTL, UVM], fds=["/dev/nvidia0"], pgrp=500)
    report = snapshot(proc, [{"minor": 0, "used_mib": 32768, "procs": [(560, 32768)]},
                             {"minor": 1, "used_mib": 612, "procs": [(560, 612)]}])
    holders = dict((h["pid"], h) for h in report.holders)
    assert holders[560]["gpus"] == [1] and holders[585]["gpus"] == [0]
    assert signalled(decide(report, [0], [0, 1])) == [585]
    assert report.as_dict()["nvml_stale"] == [{"gpu": 0, "pid": 560, "used_mib": 32768,
                                               "why": "pid 560 here has no context on GPU 0"}]


def test_a_legacy_host_pid_equal_to_a_container_pid_does_not_pin_that_process(proc):
    proc.add(60, comm="serve", maps=ctx(0) + vis(1) + [CTL, UVM], fds=["/dev/nvidia0"])
    proc.add(61, comm="trainer", maps=vis(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia1"])
    # host pid 61 (someone else's) holds 30 GiB on GPU 0; container pid 61 holds GPU 1 and is named there too
    report = snapshot(proc, [{"minor": 0, "used_mib": 30720, "procs": [(61, 30720)]},
                             {"minor": 1, "used_mib": 2048, "procs": [(61, 2048)]}])
    holders = dict((h["pid"], h) for h in report.holders)
    assert holders[61]["gpus"] == [1] and holders[60]["gpus"] == [0]
    assert signalled(decide(report, [0], [0, 1])) == [60]
    assert signalled(decide(report, [1], [0, 1])) == [61]


def test_a_bystander_that_starts_does_not_change_how_others_are_pinned(proc):
    proc.add(70, maps=ctx(0) + vis(1) + [CTL, UVM], fds=["/dev/nvidia0"])
    gpus = [{"minor": 0, "used_mib": 4096, "procs": [(70, 4096)]}, {"minor": 1, "used_mib": 0}]
    before = dict((h["pid"], (h["gpus"], h["evidence"])) for h in snapshot(proc, gpus).holders)
    proc.add(71, comm="bash")                      # a host pid NVML names on GPU 1 happens to be 71 here
    gpus[1] = {"minor": 1, "used_mib": 1024, "procs": [(71, 1024)]}
    after = dict((h["pid"], (h["gpus"], h["evidence"])) for h in snapshot(proc, gpus).holders)
    assert after == before


def test_residue_no_rank_was_seen_leaving_is_unattributed_and_stops_nothing(proc):
    a, b = "0100007F:1F90", "0100007F:C350"
    table = [(1001, a, b), (1002, b, a)]
    for pid, minor, inode in ((80, 4, 1001), (81, 5, 1002)):
        proc.add(pid, comm="tp_rank%d" % (minor - 4), argv=["python3", "-m", "sglang.launch_server", "--tp", "2"],
                 maps=sum((ctx(m) if m == minor else vis(m) for m in range(6)), []) + [CTL, UVM],
                 fds=["/dev/nvidia%d" % minor, "socket:[%d]" % inode], netns="n", tcp=table)
    gpus = [{"minor": m, "used_mib": {1: 20480, 4: 30000, 5: 30000}.get(m, 0),
             "procs": {4: [(80, 30000)], 5: [(81, 30000)]}.get(m, [])} for m in range(6)]
    report = snapshot(proc, gpus)
    assert report.gpus[1]["residue"] is None and report.gpus[1]["unattributed_mib"] == 20480
    assert signalled(decide(report, [1], list(range(6)), collateral="stop")) == []
    assert [line for line in report.diagnosis if line.startswith("GPU 1 (minor 1): 20.0 GiB")]


def test_a_client_connected_to_a_server_is_linked_not_a_job(proc):
    a, b = "0100007F:1F90", "0100007F:C350"
    table = [(1001, a, b), (1002, b, a)]
    proc.add(90, comm="python3", argv=["python3", "train.py"], maps=ctx(0) + vis(1) + [CTL, UVM],
             fds=["/dev/nvidia0", "socket:[1001]"], netns="n", tcp=table)
    proc.add(91, comm="python3", argv=["python3", "-m", "vllm.entrypoints.openai.api_server"],
             maps=vis(0) + ctx(1) + [CTL, UVM], fds=["/dev/nvidia1", "socket:[1002]"], netns="n", tcp=table)
    report = snapshot(proc, [{"minor": 0, "used_mib": 4096, "procs": [(90, 4096)]},
                             {"minor": 1, "used_mib": 8192, "procs": [(91, 8192)]}])
    assert report.as_dict()["jobs"] == []
    decision = decide(report, [0], [0, 1], collateral="stop")
    assert signalled(decision) == [90] and decision.refusals == []
    assert report.as_dict()["linked"] == [{"pids": [90, 91], "why": "connected by TCP, not one job: no rank signature"}]
