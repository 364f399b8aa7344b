"""Respawn by parentage (issue 17): the watch on a recorded /proc tree, and NVML read before /proc."""
import os

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._respawn import RespawnWatch, respawn_message

from conftest import CTL, UVM, ctx, maps_lines, vis
from fake_nvml import FakeNvml

KILL = 5000   # clock ticks: what started before was there before the kill


def killed(pid, ppid, cgroup="0::/lxc/101/ns\n"):
    return {"pid": pid, "ppid": ppid, "name": "python3", "cgroup": procscan.parse_cgroup(cgroup), "_argv": ["python3"]}


def watch_of(proc, *records, targets=(0,)):
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), targets, KILL, known_pids=[r["pid"] for r in records])
    for record in records:
        watch.add(record)
    return watch


def test_a_child_of_any_parent_started_after_the_kill_that_maps_a_target_is_a_respawn(proc):
    proc.add(1, comm="init", ppid=0)
    proc.add(30, comm="bash", ppid=1)
    proc.add(40, comm="sh", ppid=30, argv=["sh", "-c", "while :; do python3 serve.py; done"])
    watch = watch_of(proc, killed(50, 40))                     # the holder, gone now
    assert watch.poll() is None
    proc.add(51, comm="sleep", ppid=40, starttime=KILL + 2)    # the loop's sleep: no GPU, pending
    assert watch.poll() is None and list(watch.pending) == [51]
    proc.add(52, comm="python3", ppid=40, starttime=KILL + 20, maps=vis(1) + ctx(0) + [CTL, UVM])
    found = watch.poll()
    assert (found["pid"], found["parent_pid"], found["parent_name"]) == (52, 40, "sh")
    assert [p["pid"] for p in found["chain"]] == [40, 30, 1]
    message = respawn_message(found)
    assert message.startswith("respawned by pid 40 (sh): stop the service first (new holder pid 52 (python3)")
    assert "parent chain 40 (sh) < 30 (bash) < 1 (init)" in message and "stop pid 40 (sh)" in message


def test_what_started_before_the_kill_or_maps_no_target_is_no_respawn(proc):
    proc.add(40, comm="torchrun", ppid=1)
    proc.add(41, comm="python3", ppid=40, starttime=KILL - 100, maps=ctx(0))   # a sibling that ran before
    proc.add(42, comm="python3", ppid=40, starttime=KILL + 5, maps=ctx(1))     # a new worker on GPU 1 only
    proc.add(43, comm="python3", ppid=7, starttime=KILL + 5, maps=ctx(0))      # under another parent
    watch = watch_of(proc, killed(50, 40))
    assert watch.poll() is None and list(watch.pending) == [42]
    # NVML names it on a targeted GPU it has no context on: a stale entry by the pinning rule, no respawn (issue 42 C3)
    assert watch.poll(lambda: [42]) is None
    proc.add(44, comm="python3", ppid=40, starttime=KILL + 6, maps=ctx(0))     # a context on GPU 0, NVML silent
    assert watch.poll(lambda: []) is None
    found = watch.poll(lambda: [44])                                           # NVML names it: held by the rule
    assert found["pid"] == 44 and found["parent_name"] == "torchrun"


def test_a_grandchild_through_a_wrapper_started_after_the_kill_is_a_respawn(proc):
    proc.add(40, comm="python3", ppid=1)
    proc.add(60, comm="bash", ppid=40, starttime=KILL + 1)
    proc.add(61, comm="python3", ppid=60, starttime=KILL + 3, maps=ctx(0))
    assert watch_of(proc, killed(50, 40)).poll()["pid"] == 61


def test_an_init_is_watched_only_for_its_service_and_only_that_service(proc):
    proc.add(1, comm="systemd", ppid=0)
    orphan = watch_of(proc, killed(50, 1))
    proc.add(70, comm="python3", ppid=1, starttime=KILL + 5, maps=ctx(0), cgroup="0::/lxc/101/ns/user.slice\n")
    assert orphan.parents == {} and orphan.poll() is None
    service = watch_of(proc, killed(51, 1, "0::/lxc/101/ns/system.slice/vllm.service\n"))
    assert service.poll() is None                            # pid 70 is not in vllm.service
    proc.add(71, comm="python3", ppid=1, starttime=KILL + 9, maps=ctx(0),
             cgroup="0::/lxc/101/ns/system.slice/vllm.service\n")
    found = service.poll()
    assert found["pid"] == 71 and found["unit"] == "vllm.service"
    assert "systemctl stop vllm.service" in respawn_message(found)


def test_a_container_init_seen_from_the_node_is_an_init_too(proc):
    proc.add(4000, comm="init", ppid=1, nspid=[4000, 1])
    watch = watch_of(proc, killed(50, 4000))
    proc.add(4001, comm="python3", ppid=4000, starttime=KILL + 5, maps=ctx(0))
    assert watch.parents == {} and watch.poll() is None


def test_a_gpu_that_cannot_be_described_counts_as_targeted(proc):
    proc.add(40, comm="sh", ppid=1)
    proc.add(42, comm="python3", ppid=40, starttime=KILL + 5, maps=ctx(3))
    assert watch_of(proc, killed(50, 40), targets=(0,)).poll() is None
    assert watch_of(proc, killed(50, 40), targets=(0, None)).poll()["pid"] == 42


def test_a_parent_that_is_gone_or_was_killed_too_is_not_watched(proc):
    proc.add(40, comm="sh", ppid=1)
    watch = watch_of(proc, killed(50, 40), killed(40, 1))      # the parent was a holder and got signalled too
    proc.add(42, comm="python3", ppid=40, starttime=KILL + 5, maps=ctx(0))
    assert watch.parents == {} and watch.poll() is None
    assert watch_of(proc, killed(50, 99)).parents == {}        # parent 99 does not exist


def test_nvml_is_read_before_proc_and_a_contradiction_is_read_again(proc):
    """A process that maps between the two reads is not a contradiction of NVML; one read again is trusted."""
    proc.add(10, comm="python3", maps=[], fds=[])               # starting: no context mapped yet
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 256, "procs": [(10, 256)]}])),
                    proc_root=proc.root, self_pid=999999)
    engine.start()
    order = []
    scan, nvml_processes = engine.scan, engine.nvml.processes

    def scan_then_map(*args):
        order.append("proc")
        result = scan(*args)
        with open(os.path.join(proc.root, "10", "maps"), "w") as handle:
            handle.write(maps_lines(ctx(0) + [CTL, UVM]))        # it maps right after the whole-/proc read
        return result

    def listed(index):
        order.append("nvml")
        return nvml_processes(index)
    engine.scan, engine.nvml.processes = scan_then_map, listed
    report = engine.snapshot([0])
    assert order == ["nvml", "proc"]
    assert report.nvml_stale == [] and [h["pid"] for h in report.holders] == [10]
    assert report.gpus[0]["holders"] == [10]


def test_a_pid_that_still_contradicts_nvml_after_the_second_read_is_distrusted(proc):
    proc.add(10, comm="python3", maps=[], fds=[])
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 256, "procs": [(10, 256)]}])),
                    proc_root=proc.root, self_pid=999999)
    engine.start()
    report = engine.snapshot([0])
    assert [e["pid"] for e in report.nvml_stale] == [10] and report.holders == []


def test_the_same_program_still_starting_under_the_same_parent_is_a_respawn_at_the_windows_end(proc):
    """A real CUDA program takes seconds before it maps: at the window's end, a new child named like the killed
    holder under the same parent is a respawn; a new child of another name (the loop's sleep) is not."""
    proc.add(40, comm="sh", ppid=1)
    watch = watch_of(proc, killed(50, 40))
    proc.add(51, comm="sleep", ppid=40, starttime=KILL + 2)
    assert watch.poll() is None and watch.starting_again() is None
    proc.add(52, comm="python3", ppid=40, starttime=KILL + 20)          # importing torch: nothing mapped yet
    assert watch.poll() is None and sorted(watch.pending) == [51, 52]
    found = watch.starting_again()
    assert (found["pid"], found["parent_pid"]) == (52, 40) and "still starting" in found["evidence"]
    assert "still starting (no GPU mapped yet)" in respawn_message(found)


def test_an_init_is_never_watched_for_a_scope(proc):
    """A holder whose parent is the container's systemd and whose cgroup is init.scope (or a session's scope) has no
    service that Restart= would start again: the init is not watched (issue 42: a scope is no service)."""
    proc.add(1, comm="systemd", ppid=0)
    for cgroup in ("0::/lxc/101/ns/init.scope\n", "0::/lxc/101/ns/user.slice/user-0.slice/session-4.scope\n"):
        assert watch_of(proc, killed(50, 1, cgroup)).parents == {}, cgroup
