"""Several GPUs in one container (issue 9): pinning by evidence, collateral and jobs.

Lab workloads map the node of every GPU their container sees (GPU_FACTS rows 9-12), so
"maps /dev/nvidiaN" never decides who holds GPU N here. Each case starts fresh workloads
and checks the truth with `labctl gpus` and the host's /proc.
"""
import os
import signal
import time

from _enginelab import EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab

FAST = {"term_timeout": 1, "kill_timeout": 2, "advanced": {"verify_timeout": 3}}

lab = module_lab(lambda: EngineLab("engmg1", ["--nodes", "1", "--containers", "1", "--gpus", "4"]))
clean = clean_engine_lab()


def plan_pids(play):
    return sorted(p["pid"] for p in play["plan"])


def signalled(play):
    return set(a["pid"] for a in play["actions"] if a["signal"] in ("SIGTERM", "SIGKILL") and a["outcome"] == "sent")


def used(lab):
    return dict((minor, gpu["used_mib"]) for minor, gpu in lab.truth().items())


def test_one_holder_per_gpu_target_one_frees_only_it(clean):
    lab = clean
    runs = [lab.run("plain", 101, [i], mib=1024 + 100 * i) for i in range(3)]
    status = lab.direct("ct101", "gpu_info")
    assert not status.failed, status
    by_pid = dict((h["pid"], h) for h in status["holders"])
    for i, run in enumerate(runs):
        holder = by_pid[run["container_holders"][0]]
        assert holder["gpus"] == [i] and holder["maps_gpus"] == [0, 1, 2, 3], holder
        assert holder["evidence"] == ["nvml", "mapping"] and holder["context_gpus"] == [i]
    plan = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[1]), check_mode=True)
    assert not plan.failed, plan
    assert plan_pids(plan) == [runs[1]["container_holders"][0]] and plan["actions"] == []
    assert [host_alive(r["holders"][0]) for r in runs] == [True] * 3
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[1]))
    assert not play.failed, play
    assert signalled(play) == set(runs[1]["container_holders"])
    assert [host_alive(r["holders"][0]) for r in runs] == [True, False, True]
    assert used(lab) == {0: 1024, 1: 0, 2: 1224, 3: 0}


def test_stray_context_side_effect_refusal_and_collateral_stop(clean):
    lab = clean
    stray = lab.run("stray_context", 101, [2], mib=4096)
    pid = stray["container_holders"][0]
    refused = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0]))
    assert refused.failed and refused["actions"] == [] and host_alive(stray["holders"][0]), refused
    assert ("pid %d (" % pid) in refused["msg"] and "GPU 2 (4096 MiB), which is not targeted" in refused["msg"]
    assert "collateral: stop" in refused["msg"]
    assert used(lab)[2] == 4096 and used(lab)[0] == 518
    stopped = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0], collateral="stop"))
    assert not stopped.failed, stopped
    assert used(lab) == {0: 0, 1: 0, 2: 0, 3: 0} and not host_alive(stray["holders"][0])
    assert stopped["collateral"][0]["index"] == 2 and stopped["collateral"][0]["used_mib_after"] == 0

    again = lab.run("stray_context", 101, [2], mib=4096)
    plan = lab.play("ct101", "gpu_release", dict(FAST, gpus=[2]), check_mode=True)
    assert not plan.failed, plan
    assert plan["plan"][0]["side_effect_gpus"] == [{"index": 0, "mib": 518}]
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[2]))
    assert not play.failed, play
    assert not host_alive(again["holders"][0]) and used(lab) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_tensor_parallel_job_is_one_unit(clean):
    lab = clean
    job = lab.run("tp_nccl", 101, [0, 1, 2, 3], mib=2048)
    ranks = [job["roles"]["rank%d" % r] for r in range(4)]
    refused = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0, 1]))
    assert refused.failed and refused["actions"] == [], refused
    container_ranks = [job["container_roles"]["rank%d" % r] for r in range(4)]
    assert "pids %s" % ", ".join(str(p) for p in sorted(container_ranks)) in refused["msg"]
    assert "collateral: stop (stops the whole job)" in refused["msg"]
    assert all(host_alive(p) for p in ranks)
    stopped = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0, 1], collateral="stop"))
    assert not stopped.failed, stopped
    assert signalled(stopped) == set(container_ranks)
    assert not [p for p in ranks if host_alive(p)]
    assert used(lab) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert stopped["jobs"][0]["pids"] == sorted(container_ranks)


def test_residue_of_a_rank_that_died_before_the_run_is_unattributed_and_stops_nothing(clean):
    """Issue 18: every CUDA process maps every visible GPU, so a job mapping GPU 1 is no evidence that its
    291 MiB there are its residue; the job's ranks on GPUs 0, 2, 3 are never stopped for GPU 1."""
    lab = clean
    job = lab.run("tp_nccl", 101, [0, 1, 2, 3], mib=2048)
    os.kill(job["roles"]["rank1"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (used(lab)[1] != 291 or host_alive(job["roles"]["rank1"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert used(lab)[1] == 291
    status = lab.play("ct101", "gpu_info", {"gpus": [1]})
    assert not status.failed, status
    survivors = sorted(job["container_roles"]["rank%d" % r] for r in (0, 2, 3))
    assert status["gpus"][0]["residue"] is None and status["gpus"][0]["unattributed_mib"] == 291
    assert any("unattributed: it may be residue of a job that maps this GPU, job of pid %d" % survivors[0] in line
               for line in status["diagnosis"]), status["diagnosis"]
    assert status["jobs"] == [{"id": survivors[0], "pids": survivors, "gpus": [0, 2, 3],
                               "signature": ["rank siblings: the same argv apart from numbers",
                                             "rank siblings: process titles that differ only by a number (tp_rank#)"]}]
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[1], collateral="stop"))
    assert play.failed and play["plan"] == [] and play["actions"] == [], play
    assert all(host_alive(job["roles"]["rank%d" % r]) for r in (0, 2, 3)) and used(lab)[1] == 291


def test_two_dead_parents_each_child_pinned_to_its_own_gpu(clean):
    lab = clean
    run = lab.run("two_parents", 101, [1, 2], mib=1536)
    children = [run["container_roles"]["child0"], run["container_roles"]["child1"]]
    status = lab.direct("ct101", "gpu_info")
    assert not status.failed, status
    pinned = dict((h["pid"], (h["gpus"], h["heir_of"])) for h in status["holders"])
    dead = [run["container_roles"]["parent0"], run["container_roles"]["parent1"]] \
        if "parent0" in run["container_roles"] else [None, None]
    assert pinned[children[0]][0] == [1] and pinned[children[1]][0] == [2], pinned
    if dead[0] is not None:
        assert pinned[children[0]][1] == [dead[0]] and pinned[children[1]][1] == [dead[1]]
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[2]))
    assert not play.failed, play
    assert signalled(play) == {children[1]}
    assert host_alive(run["roles"]["child0"]) and not host_alive(run["roles"]["child1"])
    assert used(lab)[1] == 1536 and used(lab)[2] == 0


def test_forked_child_is_released_after_its_parent(clean):
    lab = clean
    run = lab.run("fork_inherit", 101, [3], mib=1024)
    bystander = lab.run("plain", 101, [0], mib=700)
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[3]))
    assert not play.failed, play
    assert signalled(play) == {run["container_roles"]["parent"], run["container_roles"]["child"]}
    assert not host_alive(run["roles"]["child"]) and host_alive(bystander["holders"][0])
    assert used(lab) == {0: 700, 1: 0, 2: 0, 3: 0}


def test_a_lost_untargeted_gpu_keeps_its_holder_alive_and_the_targets_are_freed(clean):
    """Issue 18: a GPU NVML cannot describe is unknown, never "not this one"."""
    lab = clean
    runs = [lab.run("plain", 101, [i], mib=1024) for i in range(4)]
    lab.labctl("fault", "--node", "pve1", "--gpu", 3, "--fault", "lost")
    try:
        play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0, 1, 2]))
        status = lab.play("ct101", "gpu_info", {"gpus": [0, 1, 2]})   # all GPUs: it fails naming GPU 3
    finally:
        lab.labctl("fault", "--node", "pve1", "--gpu", 3, "--fault", "none")
    assert not play.failed, play
    assert [host_alive(r["holders"][0]) for r in runs] == [False, False, False, True]
    assert signalled(play) == set(r["container_holders"][0] for r in runs[:3])
    assert play["remaining"] == [], play
    assert [(g["index"], g["used_mib"]) for g in play["after"]] == [(0, 0), (1, 0), (2, 0)], play["after"]
    assert play["unknown_gpus"] == [{"minor": 3, "index": None, "held_by": [runs[3]["container_holders"][0]]}]
    assert not status.failed, status
    assert status["unknown_gpus"] == play["unknown_gpus"]
    assert any("cannot be described by NVML" in line for line in status["diagnosis"]), status["diagnosis"]
    assert used(lab)[3] == 1024


def test_a_client_connected_to_a_server_is_linked_and_only_the_client_stops(clean):
    """Issue 18: a client-server link between different programs is never a job, even with collateral: stop."""
    lab = clean
    server = lab.run("tcp_server", 101, [1], mib=2048)
    client = lab.run("tcp_client", 101, [0], mib=1024, extra=["--", "--connect", server["port"]])
    pids = sorted([client["container_holders"][0], server["container_holders"][0]])
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0], collateral="stop"))
    assert not play.failed, play
    assert signalled(play) == set(client["container_holders"])
    assert play["jobs"] == [] and play["linked"] == [
        {"pids": pids, "why": "connected by TCP, not one job: no rank signature"}]
    assert play["plan"][0]["linked"] == [server["container_holders"][0]]
    assert not host_alive(client["holders"][0]) and host_alive(server["holders"][0])
    assert used(lab)[0] == 0 and used(lab)[1] == 2048
