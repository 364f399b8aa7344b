"""Issue 42: a unit, a program, a docker container or a container restart stops only what it should.

Unit-fake worlds (ProcTree, FakeNvml; node view; stops and restarts recorded, never run) of what a review found:
U1 (a whole supervisor.service, or a docker container with work on an untargeted GPU, stopped for one program),
U2 (generic launcher units: cron, ssh), U3 (a user's unit stopped by the system manager; a nested container's unit
taken as the outer's), B3 (a node daemon started from rc-local, cron or ssh: that whole unit stopped for a reset),
C1 (a container restarted over small work on an untargeted GPU), C2 (a plan gone stale before the restart), C3 (a
different program taken for a respawn), W1 (a respawn behind a wrapper that exits with its child). Each world
failed on the main this issue started from (e44b862).
"""
import json
import os

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser
from ansible_collections.gpuops.fleet.plugins.module_utils._respawn import RespawnWatch

from conftest import CTL, UVM, ctx, vis
from test_hostile_names import environ, node_namespaces, tool
from test_nothing_half_done import Backend, conf, node_engine
from release_opts import release, release_opts

OPTS = dict(term_timeout=0.3, kill_timeout=0.3, verify_timeout=0.3)
NS = "0::/lxc/101/ns"
SUPERVISOR = NS + "/system.slice/supervisor.service\n"
DOCKER_ID = "9c" + "1" * 60 + "ab"
KILL = 5000


def container(proc):
    """The node's init and container 101's init (pid 100 on the node, 1 inside)."""
    proc.add(1, comm="systemd", ppid=0, cgroup="0::/init.scope\n")
    proc.add(100, comm="systemd", ppid=1, cgroup=NS + "/init.scope\n", nspid=[100, 1])


def held(proc, pid, ppid, cgroup, on, sees=(), **kw):
    """A process of container 101 with a context on GPU on (minor = index) and GPUs sees only visible."""
    maps = ctx(on) + [m for g in sees for m in vis(g)] + [CTL, UVM]
    return proc.add(pid, ppid=ppid, cgroup=cgroup, maps=maps, fds=["/dev/nvidia%d" % on], nspid=kw.pop("nspid", [pid, pid - 100]),
                    **kw)


ATTACH = """#!/usr/bin/env python3
import json, sys
argv = sys.argv[sys.argv.index("--") + 1:]
answers = json.load(open(%r))
if "show" in argv:
    print("RequiredBy=%%s\\nBoundBy=\\nConsistsOf=" %% " ".join(answers.get(argv[-1], [])))
elif "is-active" in argv:
    print("\\n".join("active" for name in argv[argv.index("--") + 1:]))
else:
    sys.exit(1)
"""


def manager(monkeypatch, tmp_path, dependents=None):
    """lxc-attach as the container's systemd answers `systemctl show -p RequiredBy ...` and `is-active` (dependents:
    {unit: [units that require it]}); the stops themselves are never run here (check mode)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    (tmp_path / "answers.json").write_text(json.dumps(dependents or {}))
    tool(folder, "lxc-attach", ATTACH % str(tmp_path / "answers.json"))
    monkeypatch.setenv("PATH", "%s:%s" % (folder, os.environ.get("PATH", "")))


def check(proc, monkeypatch, tmp_path, gpus, dependents=None, **opts):
    """The node-side release of GPU 0 for container 101 in check mode: (failed, msg, result)."""
    manager(monkeypatch, tmp_path, dependents)
    engine = node_engine(proc, gpus, monkeypatch, {"101": conf(range(len(gpus)))})
    options = dict(OPTS, scope=node.Scope([101], proc_root=proc.root), stop_found_units=True, **opts)
    return release(engine, [0], options, check_mode=True, lock_dir=str(tmp_path))


def by_name(result):
    return [(u["kind"], u["name"]) for u in result["found_units"]]


def the_set(result, name):
    return [s for s in result["stop_sets"] if s["name"] == name][0]


# ---- U1: the whole unit

def supervisor_with_three_programs(proc):
    """supervisord under supervisor.service runs a trainer (GPU 0), an inference server (GPU 1) and redis."""
    container(proc)
    proc.add(110, comm="supervisord", ppid=100, cgroup=SUPERVISOR, nspid=[110, 10],
             argv=["/usr/bin/python3", "/usr/bin/supervisord", "-c", "/etc/supervisor/supervisord.conf"])
    held(proc, 111, 110, SUPERVISOR, 0, sees=[1], argv=["python3", "train.py"])
    held(proc, 112, 110, SUPERVISOR, 1, sees=[0], argv=["python3", "serve.py"])
    proc.add(113, comm="redis-server", ppid=110, cgroup=SUPERVISOR, nspid=[113, 13])
    for pid, name in ((111, "trainer"), (112, "inference"), (113, "redis")):
        environ(proc, pid, SUPERVISOR_PROCESS_NAME=name, SUPERVISOR_GROUP_NAME=name)
    return [{"minor": 0, "used_mib": 20000, "procs": [(111, 20000)]},
            {"minor": 1, "used_mib": 30000, "procs": [(112, 30000)]}]


def test_u1_a_supervisor_service_with_three_programs_stops_only_the_holders_program(proc, monkeypatch, tmp_path):
    gpus = supervisor_with_three_programs(proc)
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus)
    assert not failed, msg
    assert by_name(result) == [("supervisord", "trainer:trainer")], result["found_units"]
    entry = the_set(result, "trainer:trainer")
    assert entry["verdict"] == "stop" and [m["pid"] for m in entry["members"]] == [111], entry
    assert entry["main"]["pid"] == 111 and "supervisorctl -c /etc/supervisor/supervisord.conf stop trainer:trainer" \
        in entry["how_to_stop"]
    assert result["plan"][0]["stop_set"] == "supervisord program trainer:trainer in container 101: stop"


def test_u1_supervisor_service_itself_is_refused_when_the_program_cannot_be_told(proc, monkeypatch, tmp_path):
    """The trainer's environment names no program (say supervisord was started by hand): the set is the unit, whose
    main process is supervisord, a manager of several programs: refused, printed, and the holder signalled alone."""
    gpus = supervisor_with_three_programs(proc)
    environ(proc, 111, PATH="/usr/bin")
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus)
    assert not failed and result["found_units"] == [] and [p["pid"] for p in result["plan"]] == [111], msg
    entry = the_set(result, "supervisor.service")
    assert entry["verdict"] == "refused" and "pid 110 (supervisord), manages several programs" in entry["reason"]
    assert {m["pid"] for m in entry["members"]} == {110, 111, 112, 113}
    words = [d for d in result["diagnosis"] if d.startswith("unit supervisor.service in container 101")]
    assert words and "112 (python3)" in words[0] and "pct exec 101 -- systemctl stop supervisor.service" in words[0]


def docker_with_two_gpus(proc):
    """One docker container: a launcher (no GPU) whose servers use GPU 0 and GPU 1."""
    container(proc)
    scope = NS + "/system.slice/docker-%s.scope\n" % DOCKER_ID
    proc.add(120, comm="containerd-shim", ppid=100, cgroup=NS + "/system.slice/containerd.service\n", nspid=[120, 20],
             argv=["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", DOCKER_ID, "-address", "/run/c"])
    proc.add(121, comm="python3", ppid=120, cgroup=scope, nspid=[121, 21, 1], argv=["python3", "launch.py"])
    held(proc, 122, 121, scope, 0, sees=[1], nspid=[122, 22, 2], argv=["python3", "serve.py", "--gpu", "0"])
    held(proc, 123, 121, scope, 1, sees=[0], nspid=[123, 23, 3], argv=["python3", "serve.py", "--gpu", "1"])
    return [{"minor": 0, "used_mib": 20000, "procs": [(122, 20000)]},
            {"minor": 1, "used_mib": 30000, "procs": [(123, 30000)]}]


def test_u1_a_docker_container_with_work_on_an_untargeted_gpu_is_refused(proc, monkeypatch, tmp_path):
    gpus = docker_with_two_gpus(proc)
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus)
    assert not failed and result["found_units"] == [], result["found_units"]
    entry = the_set(result, DOCKER_ID[:12])
    assert entry["verdict"] == "refused" and [c["pid"] for c in entry["collateral"]] == [123], entry
    assert "pid 123 (python3) may hold GPU 1 (30000 MiB), not targeted" in entry["reason"]
    assert [p["pid"] for p in result["plan"]] == [122]       # the holder is still signalled under the usual rules
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus, collateral="stop")
    assert by_name(result) == [("docker", DOCKER_ID[:12])] and the_set(result, DOCKER_ID[:12])["collateral"], msg


def test_u1_a_service_whose_api_server_started_the_gpu_workers_is_stopped_whole(proc, monkeypatch, tmp_path):
    """vllm.service: its API server (no GPU) started the workers; the set is the holder's own program."""
    container(proc)
    unit = NS + "/system.slice/vllm.service\n"
    proc.add(130, comm="vllm", ppid=100, cgroup=unit, nspid=[130, 30], argv=["vllm", "serve"])
    held(proc, 131, 130, unit, 0, argv=["python3", "-m", "vllm.worker"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(131, 9000)]}])
    entry = the_set(result, "vllm.service")
    assert entry["verdict"] == "stop" and entry["main"]["pid"] == 130 and by_name(result) == [("systemd", "vllm.service")]
    assert [m["pid"] for m in entry["members"]] == [130, 131], entry
    assert entry["dependents"] == []


def test_a_unit_whose_stop_would_stop_another_live_unit_is_refused(proc, monkeypatch, tmp_path):
    """Red team A1: `worker-gpu1.service` has PartOf= or Requires= on model.service; `systemctl stop model.service`
    stops it too, and its processes are no members. The container's manager is asked: refused, naming it."""
    container(proc)
    unit = NS + "/system.slice/model.service\n"
    held(proc, 130, 100, unit, 0, nspid=[130, 30], argv=["python3", "model.py"])
    gpus = [{"minor": 0, "used_mib": 9000, "procs": [(130, 9000)]}]
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus, dependents={"model.service": ["worker-gpu1.service"]})
    entry = the_set(result, "model.service")
    assert entry["verdict"] == "refused" and entry["dependents"] == ["worker-gpu1.service"], entry
    assert "its stop would also stop worker-gpu1.service" in entry["reason"] and result["found_units"] == []


# ---- U2: generic launcher units

@pytest.mark.parametrize("unit, launcher", [("cron.service", "cron"), ("ssh.service", "sshd")])
def test_u2_a_holder_started_by_cron_or_in_an_ssh_session_never_gets_that_unit_stopped(
        proc, monkeypatch, tmp_path, unit, launcher):
    container(proc)
    cgroup = "%s/system.slice/%s\n" % (NS, unit)
    proc.add(140, comm=launcher, ppid=100, cgroup=cgroup, nspid=[140, 40])
    proc.add(141, comm="sh", ppid=140, cgroup=cgroup, nspid=[141, 41])
    held(proc, 142, 141, cgroup, 0, argv=["python3", "job.py"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(142, 9000)]}])
    assert result["found_units"] == [] and [p["pid"] for p in result["plan"]] == [142], result["found_units"]
    entry = the_set(result, unit)
    assert entry["verdict"] == "refused" and "a generic launcher or session unit" in entry["reason"], entry


# ---- U3: the wrong manager

def test_u3_a_user_service_is_stopped_through_that_users_manager(proc, monkeypatch, tmp_path):
    container(proc)
    manager = NS + "/user.slice/user-1000.slice/user@1000.service/init.scope\n"
    app = NS + "/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n"
    proc.add(150, comm="systemd", ppid=100, cgroup=manager, uid=1000, nspid=[150, 50], argv=["/lib/systemd/systemd", "--user"])
    held(proc, 151, 150, app, 0, uid=1000, argv=["python3", "-m", "jupyter", "lab"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(151, 9000)]}])
    assert by_name(result) == [("systemd-user", "jupyter.service")], result["found_units"]
    entry = the_set(result, "jupyter.service")
    assert "systemctl --user -M 1000@ stop jupyter.service" in entry["how_to_stop"], entry


def test_u3_a_nested_containers_holder_has_no_stop_set(proc, monkeypatch, tmp_path):
    """Container 101 runs LXC itself: container 200's unit inside is not 101's."""
    container(proc)
    proc.add(160, comm="lxc-start", ppid=100, cgroup=NS + "/system.slice/lxc@200.service\n", nspid=[160, 60])
    nested = NS + "/lxc/200/ns/system.slice/app.service\n"
    proc.add(161, comm="systemd", ppid=160, cgroup=NS + "/lxc/200/ns/init.scope\n", nspid=[161, 61, 1])
    held(proc, 162, 161, nested, 0, nspid=[162, 62, 2], argv=["python3", "app.py"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(162, 9000)]}])
    assert result["found_units"] == [] and [p["pid"] for p in result["plan"]] == [162], result["found_units"]
    assert [(s["verdict"], s["pids"]) for s in result["stop_sets"]] == [("no set", [162])]
    assert "nested inside container 101" in result["stop_sets"][0]["reason"]


# ---- B3: a node daemon started from a generic unit

@pytest.mark.parametrize("unit", ["rc-local.service", "cron.service", "ssh.service"])
def test_b3_a_node_daemon_started_from_a_generic_unit_refuses_the_reset(proc, monkeypatch, tmp_path, unit):
    monkeypatch.setattr(node, "SYSTEM_BIN_DIRS", (str(tmp_path / "usr-bin"),))
    tool(tmp_path / "usr-bin", "systemctl")
    smi = tool(tmp_path / "usr-bin", "nvidia-smi")
    proc.add(1, comm="systemd", ppid=0, cgroup="0::/init.scope\n")
    proc.add(42, comm="nvidia-persiste", ppid=1, uid=0, argv=["/usr/bin/nvidia-persistenced"],
             fds=["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"], cgroup="0::/system.slice/%s\n" % unit)
    node_namespaces(proc, 1, 42)
    engine = node_engine(proc, [{"minor": 0, "used_mib": 4096}, {"minor": 1, "used_mib": 0}], monkeypatch,
                         {"101": conf([0, 1])})
    failed, msg, result = release(engine, [0], dict(OPTS, scope=node.Scope([101], proc_root=proc.root), gpu_reset=True,
                                                    reset_blockers="stop_services", nvidia_smi=smi),
                                  check_mode=True, lock_dir=str(tmp_path))
    daemon = [b for b in result["reset_blockers"] if b["kind"] == "daemon"]
    assert failed and [b["action"] for b in daemon] == ["refused"], (msg, result["reset_blockers"])
    assert "%s is a generic launcher or session unit" % unit in msg, msg


# ---- C1, C2: the container rung

def stuck_on_0_and_small_on_1(proc):
    """Container 101: the GPU 0 holder is stuck; another process's only work, 600 MiB, is on untargeted GPU 1."""
    container(proc)
    held(proc, 170, 100, NS + "\n", 0, sees=[1], argv=["python3", "train.py"])
    held(proc, 171, 100, NS + "\n", 1, sees=[0], argv=["python3", "embed.py"])
    return [{"minor": 0, "used_mib": 20000, "procs": [(170, 20000)]},
            {"minor": 1, "used_mib": 600, "procs": [(171, 600)]}]


def test_c1_a_restart_over_small_work_on_an_untargeted_gpu_is_refused(proc, monkeypatch, tmp_path):
    gpus = stuck_on_0_and_small_on_1(proc)
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus, container_restart=True, restart_backend=Backend())
    assert failed and "container_restart would restart container 101" in msg, msg
    assert "pid 171 (python3) may hold GPU 1 (600 MiB), not targeted" in msg, msg
    assert result["restart_plan"][0]["untargeted_gpus"] == [1]


def test_c2_a_job_started_on_an_untargeted_gpu_since_the_plan_refuses_the_restart(proc, monkeypatch):
    """Decided again on the snapshot right before the stop: the hook (the world changing between the ladder and the
    stop) starts a 30 GiB job on GPU 1 in container 101."""
    container(proc)
    held(proc, 170, 100, NS + "\n", 0, argv=["python3", "train.py"])
    gpus = [{"minor": 0, "used_mib": 20000, "procs": [(170, 20000)]}, {"minor": 1, "used_mib": 0, "procs": []}]
    engine = node_engine(proc, gpus, monkeypatch, {"101": conf([0, 1])})
    backend = Backend()
    releaser = Releaser(engine, [0], release_opts(container_restart=True, restart_backend=backend,
                                                  container_timeout=30.0, scope=node.Scope([101], proc_root=proc.root)))
    releaser.prepare(releaser.snapshot())
    assert releaser.refusals == [] and [e["vmid"] for e in releaser.restart_plan] == [101]
    held(proc, 172, 100, NS + "\n", 1, sees=[0], argv=["python3", "new_job.py"])      # the hook: a new 30 GiB job
    gpus[1].update(used_mib=30000, procs=[(172, 30000)])
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert backend.calls == [] and releaser.restarted == [], backend.calls
    assert "decided again right before the stop" in releaser.failure and "pid 172" in releaser.failure


# ---- C3: a false respawn

def test_c3_another_program_that_only_sees_the_target_is_no_respawn_and_no_restart(proc, monkeypatch):
    """After SIGTERM the same supervisord starts another program, on GPU 1, which only sees GPU 0 (2 map lines)."""
    container(proc)
    proc.add(110, comm="supervisord", ppid=100, cgroup=SUPERVISOR, nspid=[110, 10])
    trainer = {"pid": 111, "ppid": 110, "name": "python3", "cgroup": SUPERVISOR.split("::", 1)[1].strip(),
               "_argv": ["python3", "train.py"]}
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[110, 111])
    watch.add(trainer)
    held(proc, 114, 110, SUPERVISOR, 1, sees=[0], starttime=KILL + 10, comm="python3", argv=["python3", "serve.py"])
    environ(proc, 114, SUPERVISOR_PROCESS_NAME="inference")
    assert watch.poll(lambda: [114]) is None and watch.starting_again() is None
    # a respawn flagged anyway (or by an older rule): no restart while GPU 0 is free
    gpus = [{"minor": 0, "used_mib": 0, "procs": []}, {"minor": 1, "used_mib": 30000, "procs": [(114, 30000)]}]
    backend = Backend()
    releaser = Releaser(node_engine(proc, gpus, monkeypatch, {"101": conf([0, 1])}), [0], release_opts(container_restart=True,
                                                                                                       restart_backend=backend,
                                                                                                       scope=node.Scope([101], proc_root=proc.root)))
    releaser.restart_plan = [{"vmid": 101, "refusal": None}]
    releaser.respawned = {"pid": 114, "parent_pid": 110}
    releaser.failure = "respawned by pid 110 (supervisord)"
    releaser._after_respawn()
    assert backend.calls == [] and releaser.restarted == [], backend.calls


# ---- W1: a respawn behind a wrapper that exits with its child

def test_w1_a_respawn_behind_a_wrapper_that_exits_with_its_child_is_seen(proc):
    """`while :; do sh -c 'python3 serve.py; exit $?'; done`: the wrapper sh exits with the killed holder; the loop
    above it starts a new wrapper and a new holder."""
    container(proc)
    proc.add(190, comm="sh", ppid=100, cgroup=NS + "\n", argv=["sh", "-c", "while :; do sh -c ...; done"])
    proc.add(191, comm="sh", ppid=190, cgroup=NS + "\n", argv=["sh", "-c", "python3 serve.py; exit $?"])
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[190, 191, 192])
    watch.add({"pid": 192, "ppid": 191, "name": "python3", "cgroup": "/lxc/101/ns", "_argv": ["python3", "serve.py"]})
    import shutil
    shutil.rmtree(os.path.join(proc.root, "191"))                    # the wrapper exits with its child
    assert watch.live_parents() and watch.poll() is None
    proc.add(193, comm="sh", ppid=190, cgroup=NS + "\n", starttime=KILL + 5, argv=["sh", "-c", "python3 serve.py"])
    held(proc, 194, 193, NS + "\n", 0, starttime=KILL + 9, comm="python3", argv=["python3", "serve.py"])
    found = watch.poll(lambda: [194])
    assert found is not None and (found["pid"], found["parent_pid"]) == (194, 190), found


def test_w1_a_wrapper_gone_before_the_watch_reads_it_is_walked_past_by_the_snapshot(proc):
    """The lab's W1 (1 run in 6): the wrapper exits a few ms after its child, before the watch reads the ancestors.
    The snapshot taken before the signal still has it: the walk goes on past it to the loop."""
    container(proc)
    proc.add(190, comm="sh", ppid=100, cgroup=NS + "\n", argv=["sh", "-c", "while :; do sh -c ...; done"])
    proc.add(191, comm="sh", ppid=190, cgroup=NS + "\n", argv=["sh", "-c", "python3 serve.py; exit $?"])
    snapshot = dict((pid, procscan.read_stat(pid, proc.root)) for pid in (100, 190, 191))
    import shutil
    shutil.rmtree(os.path.join(proc.root, "191"))                    # gone before add() reads it
    holder = {"pid": 192, "ppid": 191, "name": "python3", "cgroup": "/lxc/101/ns", "_argv": ["python3", "serve.py"]}
    blind = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[190, 191, 192])
    blind.add(holder)
    assert blind.parents == {}                                       # read live only: nothing to watch
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[190, 191, 192], stats=snapshot)
    watch.add(holder)
    assert sorted(watch.parents) == [190], watch.parents
    proc.add(193, comm="sh", ppid=190, cgroup=NS + "\n", starttime=KILL + 5, argv=["sh", "-c", "python3 serve.py"])
    held(proc, 194, 193, NS + "\n", 0, starttime=KILL + 9, comm="python3", argv=["python3", "serve.py"])
    assert watch.poll(lambda: [194])["parent_pid"] == 190
