"""Issue 11: gpu_status and gpu_release on a Proxmox node (the lab node pve1, over plain ssh).

Two containers share GPU 0 (minor 0); 101 also sees minor 1; 102 is unprivileged. 103 (issue 17) has
minor 2 to itself and bind-mounts the node's /run/lock (`--shared-run-lock`): its lock files are the
node's. The truth is `labctl gpus` and the host's /proc, never only the module's word.
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest
import yaml

from _enginelab import REPO, VENV_BIN, EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab, wait_until
from lablib.common import state_dir

from ansible_collections.gpuops.fleet.plugins.module_utils._locks import lock_name

lab = module_lab(lambda: EngineLab("node11", ["--nodes", "1", "--containers", "3", "--gpus", "3",
                                              "--layout", "101=0,1", "--layout", "102=0", "--unprivileged", "102",
                                              "--layout", "103=2", "--shared-run-lock", "103"]))
clean = clean_engine_lab()
FAST = {"term_timeout": 1, "kill_timeout": 2, "advanced": {"verify_timeout": 3}}
CLEAN_SHM = dict(FAST["advanced"], clean_shm=True)
INSTALLED = r"Install the wheels with the target's Python, without an index\] \*+\nchanged: \[ct101 -> pve1\b"


def node_gpu(play, minor):
    return [g for g in play["gpus"] if g["minor"] == minor][0]


def signalled(play):
    return sorted(set(a["pid"] for a in play["actions"] if a["outcome"] == "sent"))


def node_pid(run):
    return run["node_holders"][0]


def _identity(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _flocked(path):
    """True while someone holds a flock on the file at path (read from /proc/locks, waiters left out)."""
    try:
        dev, ino = _identity(path)
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
                continue
            major, minor, inode = fields[5].split(":")
            if os.makedev(int(major, 16), int(minor, 16)) == dev and int(inode) == ino:
                return True
    return False


def test_node_status_shows_every_containers_holders_with_vmid_and_container_pid(clean):
    a = clean.run("plain", 101, [0], mib=1000)
    b = clean.run("plain", 102, [0], mib=700)
    play = clean.direct("pve1", "gpu_info", {"cmdline": False})
    assert not play.failed, play
    assert play["view"] == "node" and play["in_container"] is False
    gpu = node_gpu(play, 0)
    holders = dict((h["pid"], h) for h in play["holders"])
    assert sorted(gpu["holders"]) == sorted([node_pid(a), node_pid(b)])
    assert holders[node_pid(a)]["container"] == "101" and holders[node_pid(a)]["container_pid"] == a["container_holders"][0]
    assert holders[node_pid(b)]["container"] == "102" and holders[node_pid(b)]["container_pid"] == b["container_holders"][0]
    assert gpu["by_container"] == {"101": 1000, "102": 700}
    assert sum(gpu["by_container"].values()) == clean.used(0) == gpu["memory"]["used_mib"]
    assert gpu["passed_into"] == [101, 102] and node_gpu(play, 1)["passed_into"] == [101]
    assert any("container 101 pid %d" % a["container_holders"][0] in line for line in play["diagnosis"])


def test_node_release_without_a_scope_fails_before_any_signal(clean):
    a = clean.run("plain", 101, [0])
    play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"]))
    assert play.failed and "signals nothing without a scope" in play["msg"] and "containers: [VMID" in play["msg"]
    assert host_alive(a["holders"][0]) and clean.used(0) == 512


TYPO = ("containers: 9999 has no config on this node pve1 (no /etc/pve/lxc/9999.conf); this node's containers: 101, "
        "102, 103; nothing was signalled")


def test_a_vmid_with_no_config_on_the_node_fails_before_anything_naming_it_and_the_nodes_containers(clean):
    """Issue 45: a typo'd vmid in containers fails before any action, in check mode too, naming it and the node's
    containers (the configs in the node's /etc/pve/lxc). Before, [9999] said "every targeted GPU is already free",
    and [101, 9999] released 101. The first run takes the product path (ansible-playbook, ssh to the node)."""
    a = clean.run("plain", 101, [0])
    for check_mode in (True, False):
        play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101, 9999]), check_mode=check_mode)
        assert not play.get("actions") and not play.get("plan") and host_alive(a["holders"][0]), play
        assert play.failed and play["msg"] == TYPO, play
    typo = clean.play("pve1", "gpu_release", dict(FAST, containers=[9999]))
    assert typo.failed and typo["msg"] == TYPO and typo["changed"] is False, typo
    assert host_alive(a["holders"][0]) and clean.used(0) == 512


def test_the_role_fails_a_container_whose_vmid_has_no_config_on_its_node_and_signals_nothing(clean, tmp_path):
    """Issue 45, the role's node path: ct199 (pct vmid 199, on pve1 by the inventory; pve1 has no 199.conf) and
    ct101 are released by one gpu_release on pve1, which fails before any signal naming 199; both hosts fail, and
    101's holder keeps its memory."""
    a = clean.run("plain", 101, [0], mib=500)
    with open(clean.inventory) as f:
        inventory = yaml.safe_load(f)
    hosts = inventory["all"]["children"]["gpu_containers"]["hosts"]
    hosts["ct199"] = dict((k, 199 if k in ("pct_vmid", "ansible_pct_vmid", "proxmox_vmid") else v)
                          for k, v in hosts["ct101"].items())
    path = tmp_path / "typo.yml"
    path.write_text(yaml.safe_dump(inventory))
    variables = {"release_gpus_advanced": {"install_deps": False, "verify_timeout": 5},
                 "release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5}
    named = "containers: 199 has no config on this node pve1 (no /etc/pve/lxc/199.conf); this node's containers: 101, 102, 103"
    for check in (["--check"], []):     # check mode fails too: nothing is known free
        proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", str(path),
                               os.path.join(REPO, "playbooks", "release_gpus.yml"), "--limit", "ct101,ct199",
                               "-e", json.dumps(variables)] + check, cwd=REPO, env=clean.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True, timeout=600, check=False)
        assert proc.returncode == 2, proc.stdout
        assert "Node path | Release every selected container of the node" in proc.stdout, proc.stdout
        # before issue 45: ct101 was released (changed=1, failed=0) and only ct199 failed, "its state is unknown"
        recap = dict((h, (c, f)) for h, c, f in re.findall(r"^(ct\d+)\s+:.*changed=(\d+).*failed=(\d+)", proc.stdout, re.M))
        assert recap == {"ct101": ("0", "1"), "ct199": ("0", "1")}, proc.stdout
        assert host_alive(a["holders"][0]) and clean.used(0) == 500
        text = " ".join(proc.stdout.split())
        assert named in text, proc.stdout
        assert "no result from node pve1 for ct199 (container 199): its gpu_release failed" in text, proc.stdout
        assert "already free" not in proc.stdout and "GPUs not free" not in proc.stdout, proc.stdout


def test_node_release_scoped_to_one_container_stops_only_its_holder(clean):
    a = clean.run("plain", 101, [0], mib=1000)
    b = clean.run("plain", 102, [0], mib=700)
    check = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101]), check_mode=True)
    assert [p["pid"] for p in check["plan"]] == [node_pid(a)] and host_alive(a["holders"][0])
    assert [s["pid"] for s in check["not_signalled"]] == [node_pid(b)]
    assert "container 102, which is not in `containers`" in check["not_signalled"][0]["reason"]
    # shared_gpu: own by default (issue 22): 101's share is freed, B is never signalled, and the result says so
    play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101]))
    assert not play.failed and signalled(play) == [node_pid(a)], play
    assert not host_alive(a["holders"][0]) and host_alive(b["holders"][0]) and clean.used(0) == 700
    assert "this container's share is free; 700 MiB are held by others" in play["msg"], play["msg"]
    entry = play["per_container"][0]
    assert entry["verdict"] == "free" and entry["note"] == "this container's share is free; 700 MiB are held by others"
    assert entry["gpus"][0]["others_mib"] == 700, entry
    # issue 46: the same per-GPU shape as inside a container, and the container's own rung and signals
    shaped = play["per_gpu"][0]
    assert shaped["verdict"] == "free" and shaped["rung"] in ("sigterm", "sigkill"), shaped
    assert shaped["signals"][0].startswith("SIGTERM %d (" % node_pid(a)) and shaped["planned"] == [node_pid(a)]
    assert entry["rung"] == shaped["rung"] and entry["signals"] == shaped["signals"], (entry, shaped)
    # shared_gpu: all waits for the whole GPU: B keeps it busy, and B is never signalled
    whole = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101], shared_gpu="all"))
    assert whole.failed and whole["actions"] == [] and "not free" in whole["msg"], whole
    assert whole["before"][0]["by_container"] == {"102": 700} and host_alive(b["holders"][0])
    assert whole["per_gpu"][0] == dict(whole["per_gpu"][0], verdict="busy", rung="none", signals=[], planned=[])


@pytest.mark.timing
def test_a_release_inside_the_container_waits_for_the_node_side_lock(clean):
    """Both module runs direct (the play of the same race is the next test's, on a shared /run/lock)."""
    clean.run("term_ignoring", 101, [0])
    # the holder ignores SIGTERM: the node-side release holds the lock for term_timeout, time enough for the
    # in-container run to start (under a second without ansible-playbook)
    finish = clean.direct("pve1", "gpu_release", dict(gpus=["0"], containers=[101], term_timeout=5, kill_timeout=2),
                          background=True)
    init = json.loads(clean.labctl("status", parse=False))["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    lock_file = "/proc/%d/root/run/lock/gpuops-fleet/%s" % (init, lock_name(clean.truth()[0]["uuid"]))
    assert wait_until(lambda: _flocked(lock_file), timeout=60), "the node-side release never took the container's lock"
    inside = clean.direct("ct101", "gpu_release", dict(FAST, gpus=["0"]))
    node_play = finish()
    assert not node_play.failed and signalled(node_play), node_play
    # it asked for the lock before the node-side release's last signal, and took it after
    assert not inside.failed, inside
    assert inside["lock_acquired_at"] - inside["lock_wait_s"] < node_play["actions"][-1]["time"], (inside, node_play)
    assert inside["lock_acquired_at"] >= node_play["actions"][-1]["time"], (inside, node_play)
    assert inside["changed"] is False and clean.used(0) == 0


def test_reset_is_refused_inside_a_container_and_while_a_client_runs_on_the_node(clean):
    inside = clean.direct("ct101", "gpu_release", dict(FAST, gpus=["1"], gpu_reset=True))
    assert inside.failed and "gpu_reset is refused inside a container" in inside["msg"] and "node" in inside["msg"]
    clean.labctl("leak", "--node", "pve1", "--gpu", 1, "--mib", 1000)
    monitor = clean.run("monitor", 101)
    refused = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["1"], containers=[101], gpu_reset=True, advanced={"verify_timeout": 1}))
    assert refused.failed and clean.used(1) == 1000, refused
    # issue 21: the monitor is a reset blocker, named before anything is done (reset_blockers: refuse)
    assert refused["actions"] == [] and refused["msg"].startswith(
        "gpu_reset: a reset would be blocked (reset_blockers: refuse), nothing was signalled: pid %d ("
        % monitor["node_pids"][0]), refused
    assert [(b["kind"], b["action"]) for b in refused["reset_blockers"]] == [("nvml_client", "refused")]
    assert host_alive(monitor["host_pids"][0])   # an NVML client is never signalled
    os.kill(monitor["host_pids"][0], 9)
    done = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["1"], containers=[101], gpu_reset=True, advanced={"verify_timeout": 1}))
    assert not done.failed, done.get("msg")
    assert done["rung_reached"] == "reset" and clean.used(1) == 0, done
    assert [a["outcome"][:4] for a in done["actions"] if a["signal"] == "reset"] == ["done"]


@pytest.mark.timing
@pytest.mark.parametrize("map_delay", [0, 1.5], ids=["maps_at_once", "maps_after_free"])
def test_container_rung_restarts_a_container_whose_launcher_respawns_faster_than_sigkill(clean, map_delay):
    # maps_after_free: the replacement maps only after the GPU read free (a real program needs seconds to start)
    run = clean.run("launcher_respawn", 101, [0], mib=900, extra=["--respawn-map-delay", map_delay])
    other = clean.run("plain", 102, [0], mib=700)
    args = dict(FAST, gpus=["0"], containers=[101], shared_gpu="own", container_restart=True)
    plan = clean.direct("pve1", "gpu_release", args, check_mode=True)   # the plan direct, the release below a play
    assert not plan.failed, plan
    entry = plan["restart_plan"][0]
    names = [p["name"] for p in entry["processes"]]
    assert entry["vmid"] == 101 and entry["gpus"] == [0] and entry["untargeted_gpus"] == []
    assert run["node_pids"][0] in [p["pid"] for p in entry["processes"]] and len(names) >= 3
    assert host_alive(run["roles"]["launcher"]) and clean.used(0) == 1600
    play = clean.play("pve1", "gpu_release", args)
    assert not play.failed and play["rung_reached"] == "container_restart", play
    steps = [(a["signal"], a["outcome"][:4]) for a in play["actions"] if a.get("vmid") == 101]
    assert steps == [("container_stop", "done"), ("container_start", "done")]
    assert not host_alive(run["roles"]["launcher"]) and host_alive(other["holders"][0])
    assert clean.used(0) == 700
    clean.wait_supervisord(101)


def test_container_rung_refuses_a_locked_container_and_an_ha_one(clean):
    run = clean.run("launcher_respawn", 101, [0], mib=900)
    args = dict(FAST, gpus=["0"], containers=[101], container_restart=True)
    try:
        clean.labctl("lock", "--vmid", 101, "--lock", "backup", parse=False)
        play = clean.direct("pve1", "gpu_release", args)
        assert play.failed and "container 101 is locked (backup)" in play["msg"], play
        assert not [a for a in play["actions"] if a["signal"] == "container_stop"]
        clean.labctl("lock", "--vmid", 101, "--clear", parse=False)
        clean.labctl("ha", "--vmid", 101, parse=False)
        play = clean.direct("pve1", "gpu_release", args)
        assert play.failed and "managed by HA (resource ct:101" in play["msg"], play
        assert host_alive(run["roles"]["launcher"])
    finally:
        clean.labctl("lock", "--vmid", 101, "--clear", parse=False, check=False)
        clean.labctl("ha", "--vmid", 101, "--remove", parse=False, check=False)


def test_container_rung_fails_precisely_on_a_thread_stuck_in_the_driver(clean):
    run = clean.run("stuck", 101, [0])
    play = clean.direct("pve1", "gpu_release", dict(gpus=["0"], containers=[101], container_restart=True, term_timeout=0.5,
                                                    kill_timeout=0.5, advanced={"verify_timeout": 1, "container_timeout": 30}))
    assert play.failed and host_alive(run["holders"][0]), play
    assert "container 101 did not stop" in play["msg"] and "in D state (wchan " in play["msg"], play
    assert "wchan unknown" not in play["msg"] and "only a driver reload or a node reboot frees it" in play["msg"]
    assert [a["outcome"][:6] for a in play["actions"] if a["signal"] == "container_stop"] == ["failed"]


def _api_credentials(clean):
    """The lab API's credentials, as an AWX credential gives them: PROXMOX_URL, PROXMOX_USER, ..."""
    from lablib import pveapi
    status = json.loads(clean.labctl("status", parse=False))
    return {"PROXMOX_URL": status["api"]["url"].rsplit("/api2/json", 1)[0], "PROXMOX_USER": pveapi.USER,
            "PROXMOX_TOKEN_ID": pveapi.TOKEN_ID, "PROXMOX_CA_PATH": status["api"]["ca"],
            "PROXMOX_TOKEN_SECRET": pveapi.read_secret(os.path.dirname(status["inventory"]), "token")}


def test_container_rung_through_the_proxmox_api_waits_for_both_tasks(clean):
    """The credentials under community.proxmox's names, from the node's PROXMOX_* environment (the task's)."""
    creds = _api_credentials(clean)
    host = creds["PROXMOX_URL"].split("//")[1].split(":")[0]
    environment = {"PROXMOX_HOST": host, "PROXMOX_PORT": creds["PROXMOX_URL"].rsplit(":", 1)[1],
                   "PROXMOX_USER": creds["PROXMOX_USER"], "PROXMOX_TOKEN_ID": creds["PROXMOX_TOKEN_ID"],
                   "PROXMOX_TOKEN_SECRET": creds["PROXMOX_TOKEN_SECRET"], "PROXMOX_CA_PATH": creds["PROXMOX_CA_PATH"]}
    run = clean.run("launcher_respawn", 101, [0], mib=900)
    play = clean.play("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101], container_restart=True),
                      task_extra={"environment": environment})
    assert not play.failed and play["rung_reached"] == "container_restart", play
    assert play["restart_plan"][0]["backend"] == "api"
    steps = [a for a in play["actions"] if a.get("vmid") == 101]
    assert [(a["signal"], a["outcome"][:4]) for a in steps] == [("container_stop", "done"), ("container_start", "done")]
    assert all(a["task"].startswith("UPID:pve1:") and ":vzst" in a["task"] for a in steps), steps
    assert creds["PROXMOX_TOKEN_SECRET"] not in play.output
    assert not host_alive(run["roles"]["launcher"]) and clean.used(0) == 0
    clean.wait_supervisord(101)
    # a user without a secret fails before anything is signalled, naming what is missing
    run = clean.run("launcher_respawn", 101, [0], mib=900)
    bad = dict(environment)
    del bad["PROXMOX_TOKEN_SECRET"]
    play = clean.play("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101], container_restart=True),
                      task_extra={"environment": bad})
    assert play.failed and "needs api_token_id and api_token_secret" in play["msg"], play
    assert "nothing was signalled" in play["msg"] and host_alive(run["roles"]["launcher"]) and clean.used(0) == 900


def test_an_awx_style_credential_drives_the_inventory_and_the_roles_restart_rung(clean, tmp_path):
    """Issue 22: PROXMOX_URL, PROXMOX_USER, PROXMOX_TOKEN_ID, PROXMOX_TOKEN_SECRET and PROXMOX_CA_PATH in the
    controller's environment and nowhere else (what an AWX credential injects): the inventory reads the API with
    them, and the role passes them to the container rung, which restarts the container through the API."""
    creds = _api_credentials(clean)
    with open(clean.labctl("inventory", "--api", parse=False)) as f:
        conf = yaml.safe_load(f)
    for key in ("url", "user", "token_id", "token_secret", "password", "ca_path"):
        conf.pop(key, None)
    conf["hostname"] = "{{ node }}-{{ vmid }}"
    inventory = tmp_path / "awx.proxmox_gpu.yml"
    inventory.write_text(yaml.safe_dump(conf))
    run = clean.run("launcher_respawn", 101, [0], mib=900)
    report_dir = tempfile.mkdtemp(dir=clean.workdir, prefix="report-")
    variables = {"release_gpus_report_dir": report_dir, "release_gpus_advanced": {"install_deps": False, "verify_timeout": 3},
                 "release_gpus_container_restart": True, "release_gpus_term_timeout": 1,
                 "release_gpus_kill_timeout": 2}
    env = dict(clean.env, **creds)
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", str(inventory),
                           os.path.join(REPO, "playbooks", "release_gpus.yml"), "--limit", "pve1-101",
                           "-e", json.dumps(variables)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout
    assert creds["PROXMOX_TOKEN_SECRET"] not in proc.stdout
    with open(os.path.join(report_dir, "pve1-101.json")) as f:
        result = json.load(f)
    steps = [a for a in result["actions"] if a.get("signal", "").startswith("container_")]
    assert [(a["signal"], a["outcome"][:4]) for a in steps] == [("container_stop", "done"), ("container_start", "done")]
    assert all(a["task"].startswith("UPID:pve1:") for a in steps), steps     # the API's tasks, not pct's
    assert result["all_free"] is True and not host_alive(run["roles"]["launcher"]) and clean.used(0) == 0
    clean.wait_supervisord(101)


# ---- issue 17: a container whose /run/lock is the node's (lxc.mount.entry of /run/lock)

def _shared_lock_paths(clean, minor):
    """(the node's lock file of GPU minor, the container 103's), after checking that 103 shares the node's /run/lock."""
    nodes = json.loads(clean.labctl("status", parse=False))["nodes"]["pve1"]
    node_root = "/proc/%d/root" % nodes["sshd_pid"]   # the node's unshare: in the node's mount namespace
    ct_root = "/proc/%d/root" % nodes["containers"]["103"]["init_host_pid"]
    assert _identity(node_root + "/run/lock") == _identity(ct_root + "/run/lock"), "103 does not share /run/lock"
    name = "run/lock/gpuops-fleet/" + lock_name(clean.truth()[minor]["uuid"])
    return node_root + "/" + name, ct_root + "/" + name


@pytest.mark.timing
def test_node_release_on_a_container_sharing_the_nodes_run_lock_takes_that_lock_once(clean):
    node_file, ct_file = _shared_lock_paths(clean, 2)
    run = clean.run("plain", 103, [0], mib=600)
    play = clean.play("pve1", "gpu_release", dict(FAST, gpus=["2"], containers=[103], advanced={"verify_timeout": 3, "lock_timeout": 10}))
    assert not play.failed, play
    assert play["lock_wait_s"] < 1.0, play
    assert signalled(play) == [node_pid(run)] and not host_alive(run["holders"][0]) and clean.used(2) == 0
    # one file, named by the node's path and by the container's: taken once, released
    assert _identity(node_file) == _identity(ct_file) and not _flocked(node_file)


@pytest.mark.timing
def test_a_release_inside_a_container_sharing_the_nodes_run_lock_waits_for_the_node_side_one(clean):
    dummy, ct_file = _shared_lock_paths(clean, 2)
    run = clean.run("term_ignoring", 103, [0])
    args = dict(gpus=["2"], containers=[103], term_timeout=8, kill_timeout=2, advanced={"lock_timeout": 10})
    finish = clean.play("pve1", "gpu_release", args, background=True)
    assert wait_until(lambda: _flocked(ct_file), timeout=60), "the node-side release never took the lock"
    inside = clean.play("ct103", "gpu_release", dict(FAST, gpus=["0"]))
    node_play = finish()
    assert not node_play.failed and signalled(node_play) == [node_pid(run)], node_play
    assert node_play["lock_wait_s"] < 1.0, node_play
    assert not inside.failed and inside["lock_acquired_at"] >= node_play["actions"][-1]["time"], (inside, node_play)
    assert inside["changed"] is False and clean.used(2) == 0


def test_one_node_task_stops_each_containers_program_and_reports_each_container(clean):
    """Issue 20, slice 1: one gpu_release on the node for three containers. The supervisord program that would
    respawn 101's holder is found from the node and stopped inside 101 (never signalled by us); 102's plain holder
    is signalled; 103 has nothing. One entry per container; check mode plans the stop and changes nothing."""
    program = clean.run("respawn", 101, [0], mib=600)
    plain = clean.run("plain", 102, [0], mib=400)
    program_pid = node_pid(program)
    args = dict(FAST, containers=[101, 102, 103], shared_gpu="own",
                advanced=dict(FAST["advanced"], stop_found_units=True))
    check = clean.play("pve1", "gpu_release", args, check_mode=True)
    assert not check.failed and check["changed"] is True, check
    found = check["found_units"]
    assert [(u["vmid"], u["kind"], u["pids"]) for u in found] == [(101, "supervisord", [program_pid])], found
    assert found[0]["name"].endswith(":" + program["supervisor_program"]) and "outcome" not in found[0]
    per = dict((c["vmid"], c) for c in check["per_container"])
    assert (per[101]["verdict"], per[102]["verdict"], per[103]["verdict"]) == ("planned", "planned", "nothing to do")
    assert (per[101]["planned"], per[102]["planned"], per[103]["planned"]) == ([program_pid], [node_pid(plain)], [])
    assert check["actions"] == [] and host_alive(program["holders"][0]) and clean.used(0) == 1000

    play = clean.play("pve1", "gpu_release", args)
    assert not play.failed and play["changed"] is True, play
    assert play["found_units"][0]["outcome"].startswith("done"), play["found_units"]
    assert [(a["signal"], a["vmid"]) for a in play["actions"] if a["signal"] == "stop"] == [("stop", 101)]
    assert signalled(play) == [node_pid(plain)]       # 101's holder was stopped by its supervisor, not signalled
    assert clean.used(0) == 0 and not host_alive(program["holders"][0]) and not host_alive(plain["holders"][0])
    status = clean.exec(101, "supervisorctl", "status", program["supervisor_program"])
    assert "STOPPED" in status.stdout, status.stdout   # stopped, so it does not come back
    per = dict((c["vmid"], c) for c in play["per_container"])
    assert [(v, per[v]["changed"], per[v]["verdict"]) for v in (101, 102, 103)] == [
        (101, True, "free"), (102, True, "free"), (103, False, "free")]
    gpu0 = [(g["before_mib"], g["after_mib"], g["free"]) for v in (101, 102) for g in per[v]["gpus"] if g["index"] == 0]
    assert gpu0 == [(600, 0, True), (400, 0, True)]
    assert [g["index"] for g in per[103]["gpus"]] == [2]      # only what its config passes in

    again = clean.play("pve1", "gpu_release", args)
    assert not again.failed and again["changed"] is False and again["actions"] == [] and again["found_units"] == []
    assert [c["changed"] for c in again["per_container"]] == [False, False, False]


def _starttime(host_pid):
    with open("/proc/%d/stat" % host_pid) as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _stop_set(result, kind, name):
    """The one entry of result's stop_sets of that kind and name (the test fails on none or several)."""
    sets = [s for s in result.get("stop_sets") or [] if s.get("kind") == kind and s.get("name") == name]
    assert len(sets) == 1, "want one %s stop set %s in stop_sets: %s" % (kind, name, result.get("stop_sets"))
    return sets[0]


def test_one_supervisord_two_programs_on_two_gpus_only_the_targeted_gpus_program_is_stopped(clean):
    """Issue 42, U1's supervisord half: one supervisord in container 101 runs program A on GPU 0 and program B on
    GPU 1. Released from the node for GPU 0 with stop_found_units, A's program is the stop set and is stopped
    (STOPPED, so it does not come back); B keeps its pid and start time. The plan and the result print the stop set:
    supervisord program A, its members (A's holder, never B), verdict stop, then done."""
    a = clean.run("respawn", 101, [0], mib=600)
    b = clean.run("respawn", 101, [1], mib=400)
    assert a["container_roles"]["supervisord"] == b["container_roles"]["supervisord"]    # one supervisord
    b_host, b_ct = b["holders"][0], b["container_holders"][0]
    b_started = _starttime(b_host)
    args = dict(FAST, gpus=["0"], containers=[101], advanced=dict(FAST["advanced"], stop_found_units=True))
    plan = clean.direct("pve1", "gpu_release", args, check_mode=True)
    assert not plan.failed and plan["actions"] == [] and host_alive(a["holders"][0]), plan
    play = clean.direct("pve1", "gpu_release", args)
    assert not play.failed and play["changed"] is True, play
    assert [(u["vmid"], u["kind"], u["pids"]) for u in play["found_units"]] == [
        (101, "supervisord", [node_pid(a)])], play["found_units"]
    assert [(x["signal"], x["vmid"]) for x in play["actions"] if x["signal"] == "stop"] == [("stop", 101)]
    # the truth: A stopped by its supervisor and left STOPPED, B untouched (same pid, same start time), GPU 1 held
    assert wait_until(lambda: clean.used(0) == 0, timeout=5), clean.truth()[0]    # A's memory, after the free delay
    assert clean.used(1) == 400 and not host_alive(a["holders"][0])
    assert host_alive(b_host) and _starttime(b_host) == b_started
    status_a = clean.exec(101, "supervisorctl", "status", a["supervisor_program"]).stdout
    status_b = clean.exec(101, "supervisorctl", "status", b["supervisor_program"]).stdout
    assert "STOPPED" in status_a, status_a
    assert "RUNNING" in status_b and "pid %d," % b_ct in status_b, status_b
    # the stop set (stop_sets), printed by the plan, then with its outcome by the release: A's program, not B
    name = "%s:%s" % (a["supervisor_program"], a["supervisor_program"])
    for result in (plan, play):
        entry = _stop_set(result, "supervisord", name)
        assert (entry["vmid"], entry["verdict"]) == (101, "stop"), entry
        members = [m["pid"] for m in entry["members"]]
        assert node_pid(a) in members and node_pid(b) not in members, entry
        assert all(set(m) >= {"pid", "name", "why"} for m in entry["members"]), entry
    assert not _stop_set(plan, "supervisord", name)["outcome"]
    assert (_stop_set(play, "supervisord", name)["outcome"] or "").startswith("done"), play["stop_sets"]


def test_without_stop_found_units_a_respawn_fails_naming_the_program_found_from_the_node(clean):
    """Issue 40: stop_found_units is off by default (a unit can host more than its program): the supervisord program
    that respawns 101's holder is not stopped; the task fails on the respawn, naming that program and what to do."""
    program = clean.run("respawn", 101, [0], mib=600)
    play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101]))
    assert play.failed and play["found_units"] == [] and "respawned by pid" in play["msg"], play
    named = re.search(r"found from the node and not stopped \(stop_found_units is off\): supervisord program "
                      r"(\S+) in container 101; stop it, list it \(release_gpus_services, release_gpus_supervisor_programs\)",
                      play["msg"])
    assert named and named.group(1).endswith(":" + program["supervisor_program"]), play["msg"]
    status = clean.exec(101, "supervisorctl", "status", program["supervisor_program"])
    assert "STOPPED" not in status.stdout, status.stdout   # never stopped by us
    clean.exec(101, "supervisorctl", "stop", program["supervisor_program"])


def test_auto_releases_inside_then_from_the_node_when_another_containers_memory_is_left(clean):
    """The container path's node fallback (release_gpus_from: auto with a GPU list, which the node path does not
    take): 101's holder is released inside 101; GPU 0 still holds 102's memory, which 101 cannot see, so the role
    reads it again from the node (shared_gpu: own), where nothing of 101 holds it: 101 is done, and 102's holder is
    never signalled."""
    mine = clean.run("plain", 101, [0], mib=500)
    other = clean.run("plain", 102, [0], mib=700)
    report_dir = tempfile.mkdtemp(dir=clean.workdir, prefix="report-")
    variables = {"release_gpus_report_dir": report_dir, "release_gpus_advanced": {"install_deps": False, "verify_timeout": 5},
                 "release_gpus_from": "auto", "release_gpus_gpus": [0], "release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5}
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", clean.inventory,
                           os.path.join(REPO, "playbooks", "release_gpus.yml"), "--limit", "ct101",
                           "-e", json.dumps(variables)], cwd=REPO, env=clean.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout
    assert "Node | Release from the node" in proc.stdout and "Node path |" not in proc.stdout
    with open(os.path.join(report_dir, "ct101.json")) as f:
        result = json.load(f)
    assert result["released_from"] == "node" and result["all_free"] is True and result["changed"] is True
    assert not host_alive(mine["holders"][0]) and host_alive(other["holders"][0]) and clean.used(0) == 700


def test_a_locked_container_is_left_out_and_the_others_are_released(clean):
    mine = clean.run("plain", 101, [0], mib=500)
    locked = clean.run("plain", 102, [0], mib=700)
    try:
        clean.labctl("lock", "--vmid", 102, "--lock", "backup", parse=False)
        play = clean.direct("pve1", "gpu_release", dict(FAST, containers=[101, 102], shared_gpu="own"))
    finally:
        clean.labctl("lock", "--vmid", 102, "--clear", parse=False, check=False)
    assert play.failed and "container 102 is locked (backup)" in play["msg"], play
    per = dict((c["vmid"], c) for c in play["per_container"])
    assert (per[101]["verdict"], per[101]["changed"]) == ("free", True)
    assert per[102]["verdict"] == "skipped" and "locked (backup)" in per[102]["reason"] and per[102]["changed"] is False
    assert signalled(play) == [node_pid(mine)] and play["scope"]["containers"] == [101]
    assert not host_alive(mine["holders"][0]) and host_alive(locked["holders"][0]) and clean.used(0) == 700


def test_a_refused_container_is_left_out_and_the_others_are_released(clean):
    """Issue 20: one container's refusal never stops the others. 101's holder also holds GPU 1, which is not
    targeted: 101 is refused (nothing of it signalled), 102 on GPU 0 is released, and the task fails naming 101."""
    wide = clean.run("plain", 101, [0, 1], mib=800)
    mine = clean.run("plain", 102, [0], mib=400)
    args = dict(FAST, gpus=["0"], containers=[101, 102], shared_gpu="own")
    check = clean.play("pve1", "gpu_release", args, check_mode=True)
    per = dict((c["vmid"], c) for c in check["per_container"])
    assert check.failed and (per[101]["verdict"], per[102]["verdict"]) == ("refused", "planned"), check
    assert check["actions"] == [] and host_alive(wide["holders"][0]) and host_alive(mine["holders"][0])

    play = clean.play("pve1", "gpu_release", args)
    assert play.failed and "refused" in play["msg"] and "container 101" in play["msg"], play
    per = dict((c["vmid"], c) for c in play["per_container"])
    assert (per[101]["verdict"], per[101]["changed"], per[101]["actions"]) == ("refused", False, []), per[101]
    assert "not targeted" in per[101]["reason"], per[101]
    assert (per[102]["verdict"], per[102]["changed"]) == ("free", True), per[102]
    assert signalled(play) == [node_pid(mine)] and play["scope"]["containers"] == [101, 102]
    assert host_alive(wide["holders"][0]) and not host_alive(mine["holders"][0])
    assert clean.used(0) == 800 and clean.used(1) == 800


def test_the_node_path_installs_psutil_and_nvidia_ml_py_on_the_node_as_in_a_container(clean):
    """Issue 20: release_gpus.yml's default (auto) takes the node path for a container whose node is known; the node
    needs psutil and nvidia-ml-py, and the role installs them there the same way (here from the controller's
    wheels into a bare interpreter, named by the node's inventory entry alone), once; the second run changes nothing."""
    from _rolelab import make_venv
    root = os.path.join(REPO, ".lab", "node-deps-%s" % clean.lab_id)
    shutil.rmtree(root, ignore_errors=True)
    python = make_venv(root, with_pip=False)
    workdir = tempfile.mkdtemp(dir=clean.workdir, prefix="node-deps-")
    node_inventory = os.path.join(workdir, "node.yml")
    with open(node_inventory, "w") as f:
        json.dump({"all": {"hosts": {"pve1": {"ansible_python_interpreter": python}}}}, f)
    holder = clean.run("plain", 101, [0], mib=300)
    variables = {"release_gpus_report_dir": workdir,
                 "release_gpus_advanced": {"deps_sources": ["wheels"], "wheel_dir": os.path.join(REPO, ".cache", "wheels"),
                                           "verify_timeout": 5},
                 "release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5}

    def run():
        return subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", clean.inventory, "-i", node_inventory,
                               os.path.join(REPO, "playbooks", "release_gpus.yml"), "--limit", "ct101",
                               "-e", json.dumps(variables)], cwd=REPO, env=clean.env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, universal_newlines=True, timeout=600, check=False)
    try:
        assert subprocess.run([python, "-c", "import psutil"], capture_output=True, check=False).returncode != 0
        first = run()
        assert first.returncode == 0, first.stdout
        assert "Node path | Release every selected container" in first.stdout, first.stdout
        assert re.search(INSTALLED, first.stdout), first.stdout
        imported = subprocess.run([python, "-c", "import psutil, pynvml; print(psutil.__file__)"],
                                  capture_output=True, universal_newlines=True, check=False)
        assert imported.returncode == 0 and imported.stdout.startswith(root), imported
        with open(os.path.join(workdir, "ct101.json")) as f:
            result = json.load(f)
        assert (result["released_from"], result["verdict"], result["changed"]) == ("node", "free", True), result
        assert not host_alive(holder["holders"][0]) and clean.used(0) == 0
        again = run()
        assert again.returncode == 0 and re.search(r"ct101\s*:.*changed=0", again.stdout), again.stdout
        assert not re.search(INSTALLED, again.stdout), "imports checked first: nothing to install"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_polls_from_the_node_read_nvml_alone_between_full_reads(clean):
    """Issue 20: with shared_gpu own, a poll between full reads reads NVML alone (no /proc walk); a full read comes
    at most 1 s apart, and only a full read says free. A holder that ignores SIGTERM keeps the scope holding for
    term_timeout (3 s): most polls of that wait are the cheap ones."""
    stubborn = clean.run("term_ignoring", 101, [0], mib=300)
    play = clean.direct("pve1", "gpu_release", dict(FAST, term_timeout=3, containers=[101], shared_gpu="own"))
    assert not play.failed, play
    assert [a["signal"] for a in play["actions"] if a["outcome"] == "sent"] == ["SIGTERM", "SIGKILL"], play["actions"]
    reads = play["reads"]
    assert reads["fast"] >= 5 and reads["full"] < reads["fast"], reads
    assert clean.used(0) == 0 and not host_alive(stubborn["holders"][0])


SHM_USER = ("import mmap, os, sys, time\n"
            "fd = os.open('/dev/shm/sgl_live', os.O_RDWR | os.O_CREAT, 0o600)\n"
            "os.ftruncate(fd, 4096)\n"
            "m = mmap.mmap(fd, 4096)\n"
            "os.close(fd)\n"
            "time.sleep(300)\n")
SHM_FILES = ("import os, time\n"
             "for name in ('nccl-leak', 'PostgreSQL.1'):\n"
             "    with open('/dev/shm/' + name, 'wb') as f:\n"
             "        f.write(bytes(8192))\n"
             "    os.utime('/dev/shm/' + name, (time.time() - 3600, time.time() - 3600))\n")


def test_shm_residue_is_read_in_the_container_and_from_the_node_and_a_used_segment_is_not(clean):
    """Issue 21: an unprivileged container's /dev/shm (its own tmpfs) holds a leaked NCCL segment, a database's
    segment and a segment a live process maps: only the leaked one is residue, inside and from the node; once
    its user is gone, the live one is too."""
    assert clean.exec(102, "python3", "-c", SHM_FILES).returncode == 0
    started = clean.exec(102, "sh", "-c", "setsid python3 -c \"$0\" gpuops_shm_user > /dev/null 2>&1 < /dev/null &", SHM_USER)
    assert started.returncode == 0, started.stdout
    try:
        mapped = wait_until(lambda: "/dev/shm/sgl_live" in clean.exec(
            102, "sh", "-c", "cat /proc/[0-9]*/maps 2>/dev/null").stdout, timeout=20)
        assert mapped
        leak = {"path": "/dev/shm/nccl-leak", "bytes": 8192, "owner": "nccl"}
        inside = clean.direct("ct102", "gpu_info", {"cmdline": False})
        assert not inside.failed and inside["shm_residue"] == [leak], inside
        assert "shm_residue_by_container" not in inside.result
        assert any(line.startswith("/dev/shm holds 1 GPU stack file no live process uses (8 KiB of nccl: "
                                   "/dev/shm/nccl-leak)") for line in inside["diagnosis"]), inside["diagnosis"]
        outside = clean.direct("pve1", "gpu_info", {"cmdline": False})
        assert not outside.failed and outside["shm_residue_by_container"]["102"] == [leak], outside
        assert outside["shm_residue_by_container"]["101"] == []
        assert any(line.startswith("container 102: /dev/shm holds 1 GPU stack file") for line in outside["diagnosis"])
    finally:
        clean.exec(102, "pkill", "-f", "gpuops_shm_user")
    assert wait_until(lambda: "/dev/shm/sgl_live" not in clean.exec(
        102, "sh", "-c", "cat /proc/[0-9]*/maps 2>/dev/null").stdout, timeout=20)
    try:
        after = clean.direct("pve1", "gpu_info", {"cmdline": False})
        assert [e["path"] for e in after["shm_residue_by_container"]["102"]] == ["/dev/shm/nccl-leak", "/dev/shm/sgl_live"]
        quiet = clean.direct("ct102", "gpu_info", {"cmdline": False, "shm_residue": False})
        assert "shm_residue" not in quiet.result
    finally:
        clean.exec(102, "sh", "-c", "rm -f /dev/shm/nccl-leak /dev/shm/PostgreSQL.1 /dev/shm/sgl_live")


def _shm_names(lab, vmid):
    return sorted(lab.exec(vmid, "ls", "/dev/shm").stdout.split())


def test_clean_shm_removes_only_residue_from_the_node_and_inside_and_check_mode_removes_nothing(clean):
    """Issue 21: gpu_release clean_shm on free GPUs removes the leaked NCCL segment of container 102 (scoped from
    the node), never the segment a live process maps nor a database's; then, its user gone, inside the container."""
    assert clean.exec(102, "python3", "-c", SHM_FILES).returncode == 0
    started = clean.exec(102, "sh", "-c", "setsid python3 -c \"$0\" gpuops_shm_user > /dev/null 2>&1 < /dev/null &", SHM_USER)
    assert started.returncode == 0, started.stdout
    try:
        assert wait_until(lambda: "/dev/shm/sgl_live" in clean.exec(
            102, "sh", "-c", "cat /proc/[0-9]*/maps 2>/dev/null").stdout, timeout=20)
        leak = {"path": "/dev/shm/nccl-leak", "bytes": 8192, "owner": "nccl", "vmid": 102}
        check = clean.play("pve1", "gpu_release", dict(FAST, containers=[102], advanced=CLEAN_SHM), check_mode=True)
        assert not check.failed and check["shm_residue"] == [leak] and check["shm_removed"] == [], check
        assert "1 shared-memory residue files would be removed" in check["msg"] and check["changed"]
        assert _shm_names(clean, 102) == ["PostgreSQL.1", "nccl-leak", "sgl_live"]
        done = clean.play("pve1", "gpu_release", dict(FAST, containers=[102], advanced=CLEAN_SHM))
        assert not done.failed and done["changed"] and done["shm_removed"] == [leak] and done["shm_left"] == [], done
        assert "1 shared-memory residue files removed" in done["msg"]
        assert _shm_names(clean, 102) == ["PostgreSQL.1", "sgl_live"]
        again = clean.play("pve1", "gpu_release", dict(FAST, containers=[102], advanced=CLEAN_SHM))
        assert not again.failed and not again["changed"] and again["shm_removed"] == [], again
    finally:
        clean.exec(102, "pkill", "-f", "gpuops_shm_user")
    try:
        assert wait_until(lambda: "/dev/shm/sgl_live" not in clean.exec(
            102, "sh", "-c", "cat /proc/[0-9]*/maps 2>/dev/null").stdout, timeout=20)
        inside = clean.play("ct102", "gpu_release", dict(FAST, advanced=CLEAN_SHM))
        assert not inside.failed and [(e["path"], e["vmid"]) for e in inside["shm_removed"]] == [
            ("/dev/shm/sgl_live", None)], inside
        assert _shm_names(clean, 102) == ["PostgreSQL.1"]
    finally:
        clean.exec(102, "sh", "-c", "rm -f /dev/shm/nccl-leak /dev/shm/PostgreSQL.1 /dev/shm/sgl_live")


# Issue 43, S1 in the lab. The lab node's /dev/shm is a tmpfs of its own (nodeinit; never the host's); the world
# still stacks a tmpfs on it, in the node's mount namespace only, so that undoing it is exact, then binds that tmpfs
# over container 101's own /dev/shm: open_tree(OPEN_TREE_CLONE) on the node, setns into the container's mount
# namespace, move_mount (a plain bind cannot take its source from another mount namespace). `unbind` undoes it,
# top mount first, and only mounts whose source is NODE_SHM_SOURCE: never the container's own tmpfs nor the host's.
NODE_SHM_SOURCE = "gpuops-lab-node-shm"
SHARE_NODE_SHM = r"""
import ctypes, os, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long
SOURCE, NAMES = sys.argv[3], sys.argv[4:]
MS_NOSUID, MS_NODEV, CLONE_NEWNS, AT_FDCWD, MNT_DETACH = 2, 4, 0x20000, -100, 2
OPEN_TREE, MOVE_MOUNT, OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = 428, 429, 1, 4


def check(rc, what):
    if rc < 0:
        err = ctypes.get_errno()
        sys.exit("%s: %s" % (what, os.strerror(err)))
    return rc


def tops(pid):
    # how many mounts of ours are stacked at the top of /dev/shm in pid's mount namespace (read from the node)
    with open("/proc/%s/mountinfo" % pid) as f:
        sources = [line.split(" - ")[1].split()[1] for line in f if line.split()[4] == "/dev/shm"]
    count = 0
    while count < len(sources) and sources[-1 - count] == SOURCE:
        count += 1
    return count


ct = int(sys.argv[2])
node_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
ct_ns = os.open("/proc/%d/ns/mnt" % ct, os.O_RDONLY | os.O_CLOEXEC)
if sys.argv[1] == "bind":
    if not tops("self"):
        check(libc.mount(SOURCE.encode(), b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777"), "mount tmpfs")
    tree = check(libc.syscall(ctypes.c_long(OPEN_TREE), ctypes.c_long(AT_FDCWD), ctypes.c_char_p(b"/dev/shm"),
                              ctypes.c_long(OPEN_TREE_CLONE | os.O_CLOEXEC)), "open_tree /dev/shm")
    if not tops(ct):
        check(libc.setns(ct_ns, CLONE_NEWNS), "setns into the container")
        check(libc.syscall(ctypes.c_long(MOVE_MOUNT), ctypes.c_long(tree), ctypes.c_char_p(b""),
                           ctypes.c_long(AT_FDCWD), ctypes.c_char_p(b"/dev/shm"),
                           ctypes.c_long(MOVE_MOUNT_F_EMPTY_PATH)), "move_mount onto the container's /dev/shm")
else:
    stacked = tops(ct)
    if stacked:
        check(libc.setns(ct_ns, CLONE_NEWNS), "setns into the container")
        for _ in range(stacked):
            check(libc.umount2(b"/dev/shm", MNT_DETACH), "umount the container's /dev/shm")
        check(libc.setns(node_ns, CLONE_NEWNS), "setns back into the node")
    if tops("self"):
        for name in NAMES:
            if os.path.lexists("/dev/shm/" + name):
                os.unlink("/dev/shm/" + name)
    for _ in range(tops("self")):
        check(libc.umount2(b"/dev/shm", MNT_DETACH), "umount the node's /dev/shm")
"""
NODE_SHM_USER = ("import mmap, os, time\n"
                 "fd = os.open('/dev/shm/nccl-live', os.O_RDWR | os.O_CREAT, 0o600)\n"
                 "os.ftruncate(fd, 4096)\n"
                 "os.utime(fd, (time.time() - 3600, time.time() - 3600))\n"
                 "m = mmap.mmap(fd, 4096)\n"
                 "os.close(fd)\n"
                 "time.sleep(300)\n")
SHARED_SHM_NAMES = ("nccl-live", "nccl-leak", "PostgreSQL.1")


def _shared_shm_world(lab, action=None, vmid=101):
    """bind: the node's own /dev/shm bound over container vmid's; unbind: the node process killed (by its match), the
    files removed, both mounts undone; None: neither. Returns the identities the tests assert on: (st_dev, st_ino) of
    the host's /dev/shm and of the node's and the container's (through their inits' roots)."""
    status = json.loads(lab.labctl("status", parse=False))["nodes"]["pve1"]["containers"][str(vmid)]
    with open(os.path.join(state_dir(lab.lab_id), "labctl.json")) as f:
        node_init = json.load(f)["nodes"]["pve1"]["init_pid"]
    world = {"rc": 0, "output": "", "node_init": node_init}
    if action == "unbind":
        lab.labctl("node-exec", "--node", "pve1", "--", "pkill", "-f", "gpuops_node_shm_user", parse=False, check=False)
    if action:
        done = subprocess.run([os.path.join(REPO, "tests", "lab", "labctl"), "node-exec", "--node", "pve1", "--", "python3",
                               "-c", SHARE_NODE_SHM, action, str(status["init_node_pid"]), NODE_SHM_SOURCE]
                              + list(SHARED_SHM_NAMES), env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=60, check=False)
        world.update(rc=done.returncode, output=done.stdout)
    world.update(host=_identity("/dev/shm"), node=_identity("/proc/%d/root/dev/shm" % node_init),
                 container=_identity("/proc/%d/root/dev/shm" % status["init_host_pid"]))
    return world


def _node_shm_user():
    """The host pid of the live process that maps /dev/shm/nccl-live (matched by gpuops_node_shm_user), else None."""
    for entry in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                if b"gpuops_node_shm_user" not in f.read() or not host_alive(int(entry)):
                    continue
            with open("/proc/%s/maps" % entry) as f:
                if "/dev/shm/nccl-live" in f.read():
                    return int(entry)
        except (OSError, ValueError):
            continue
    return None


def _node_shm_names(world):
    return sorted(os.listdir("/proc/%d/root/dev/shm" % world["node_init"]))


def _start_shared_shm_world(lab):
    """The world of both S1 tests: the bind, a live node process mapping nccl-live (mtime an hour ago), an old unused
    nccl-leak and a database's PostgreSQL.1 written from inside the container; the user waited for (mapped)."""
    world = _shared_shm_world(lab, "bind")
    world["files"], world["user"] = None, None
    if world["rc"] == 0 and world["node"] != world["host"]:   # never a file in the host's /dev/shm
        lab.labctl("node-exec", "--node", "pve1", "--", "sh", "-c",
                   "setsid python3 -c \"$0\" gpuops_node_shm_user > /dev/null 2>&1 < /dev/null &", NODE_SHM_USER, parse=False)
        world["files"] = lab.exec(101, "python3", "-c", SHM_FILES).returncode
        world["user"] = wait_until(_node_shm_user, timeout=20)
    return world


def _shared_shm_facts(lab, before, world):
    """What the tests assert of the world (SHARED_SHM_WORLD), read from the host and the container."""
    user = world["user"]
    with open("/proc/%d/cgroup" % user if user else "/dev/null") as f:
        cgroup = f.read()
    return {"bound": (world["rc"], world["output"]), "node_was_its_own": before["node"] != before["host"],
            "node_own": world["node"] != world["host"], "container_was_its_own": before["container"] != before["node"],
            "container_is_node": world["container"] == world["node"], "files_written": world["files"],
            "user_mapped": bool(user), "user_in_no_container": bool(user) and "/lxc/" not in cgroup,
            "user_on_the_node": bool(user) and os.stat("/proc/%d/ns/mnt" % user).st_ino == os.stat(
                "/proc/%d/ns/mnt" % world["node_init"]).st_ino,
            "live_mtime_old": os.stat("/proc/%d/root/dev/shm/nccl-live" % world["node_init"]).st_mtime < time.time() - 3000
            if user else None,
            "names_node": _node_shm_names(world), "names_container": _shm_names(lab, 101)}


SHARED_SHM_WORLD = {"bound": (0, ""), "node_was_its_own": True, "node_own": True, "container_was_its_own": True,
                    "container_is_node": True, "files_written": 0, "user_mapped": True, "user_in_no_container": True,
                    "user_on_the_node": True, "live_mtime_old": True,
                    "names_node": ["PostgreSQL.1", "nccl-leak", "nccl-live"],
                    "names_container": ["PostgreSQL.1", "nccl-leak", "nccl-live"]}


def test_bind_shared_dev_shm_out_of_scope_is_skipped_by_a_node_side_clean_shm(clean):
    """Issue 43, S1 in the lab: container 101's /dev/shm is the node's own (a bind mount), where a live node process
    maps nccl-live (mtime an hour ago), beside an unused old nccl-leak and PostgreSQL.1. gpu_release from the node
    with clean_shm scoped to containers [101] only (no host processes): the folder is shared with the node, outside
    the scope, so nothing in it is listed or removed, check mode or not, and shm_skipped names it."""
    before = _shared_shm_world(clean)
    try:
        world = _start_shared_shm_world(clean)
        assert _shared_shm_facts(clean, before, world) == SHARED_SHM_WORLD, world
        args = dict(FAST, containers=[101], advanced=CLEAN_SHM)
        for check_mode in (True, False):
            play = clean.direct("pve1", "gpu_release", args, check_mode=check_mode)
            assert not play.failed and play["shm_residue"] == play["shm_removed"] == play["shm_left"] == [], play
            assert [(s["vmid"], s["path"]) for s in play["shm_skipped"]] == [(101, "/dev/shm")], play
            assert "node's /dev/shm" in play["shm_skipped"][0]["why"] and "outside the scope" in play["shm_skipped"][0]["why"], play
            assert _node_shm_names(world) == ["PostgreSQL.1", "nccl-leak", "nccl-live"]
            assert _node_shm_user() == world["user"]
    finally:
        after = _shared_shm_world(clean, "unbind")
    assert after["rc"] == 0, after["output"]
    assert after["node"] == before["node"] and after["container"] == before["container"], (before, after)
    assert wait_until(lambda: _node_shm_user() is None, timeout=10)


def test_bind_shared_dev_shm_in_scope_keeps_the_node_process_live_segment(clean):
    """Issue 43, S1 in the lab: the same world; with containers [101] and host_processes the shared folder is in the
    scope: check mode lists only the unused nccl-leak (once, as the node's or as 101's: one file on one mount) and
    removes nothing; the real run removes only it; the segment the live node process maps (found by its
    (st_dev, st_ino) in that process's maps, not by container) and the database's stay, the process lives on; a
    second run changes nothing."""
    before = _shared_shm_world(clean)
    try:
        world = _start_shared_shm_world(clean)
        assert _shared_shm_facts(clean, before, world) == SHARED_SHM_WORLD, world
        args = dict(FAST, containers=[101], host_processes=True, advanced=CLEAN_SHM)
        leak = [("/dev/shm/nccl-leak", 8192, "nccl", True)]
        check = clean.direct("pve1", "gpu_release", args, check_mode=True)
        assert not check.failed and [(e["path"], e["bytes"], e["owner"], e["vmid"] in (None, 101))
                                     for e in check["shm_residue"]] == leak, check
        assert check["shm_removed"] == check["shm_left"] == check["shm_skipped"] == [], check
        assert "1 shared-memory residue files would be removed" in check["msg"], check
        assert _node_shm_names(world) == ["PostgreSQL.1", "nccl-leak", "nccl-live"]
        done = clean.play("pve1", "gpu_release", args)
        assert not done.failed and done["changed"], done
        assert [(e["path"], e["bytes"], e["owner"], e["vmid"] in (None, 101)) for e in done["shm_residue"]] == leak, done
        assert [(e["path"], e["bytes"], e["owner"], e["vmid"] in (None, 101)) for e in done["shm_removed"]] == leak, done
        assert done["shm_left"] == done["shm_skipped"] == [], done
        assert _node_shm_names(world) == _shm_names(clean, 101) == ["PostgreSQL.1", "nccl-live"]
        assert _node_shm_user() == world["user"] and host_alive(world["user"])
        again = clean.direct("pve1", "gpu_release", args)
        assert not again.failed and not again["changed"], again
        assert again["shm_residue"] == again["shm_removed"] == again["shm_left"] == again["shm_skipped"] == [], again
        assert _node_shm_names(world) == ["PostgreSQL.1", "nccl-live"] and _node_shm_user() == world["user"]
    finally:
        after = _shared_shm_world(clean, "unbind")
    assert after["rc"] == 0, after["output"]
    assert after["node"] == before["node"] and after["container"] == before["container"], (before, after)
    assert wait_until(lambda: _node_shm_user() is None, timeout=10)


def test_device_access_is_read_inside_each_container_from_the_node(clean):
    """Issue 21: from the node, device access is read in each running container a GPU is passed into (its own /dev,
    through lxc-attach): ct101's /dev/nvidia1 covered by a read-only file fails GPU 1 for container 101 only; GPU 0
    (in 101 and the unprivileged 102) and GPU 2 (in 103) open everywhere."""
    made = clean.exec(101, "sh", "-ec", "mkdir -p /run/rofs && mount -t tmpfs -o size=1m tmpfs /run/rofs && "
                      "touch /run/rofs/nvidia1 && mount -o remount,ro /run/rofs && mount --bind /run/rofs/nvidia1 /dev/nvidia1")
    assert made.returncode == 0, made.stdout
    try:
        play = clean.direct("pve1", "gpu_info", {"cmdline": False})
    finally:
        undone = clean.exec(101, "sh", "-ec", "umount /dev/nvidia1 && umount /run/rofs")
    assert undone.returncode == 0, undone.stdout
    assert play["view"] == "node" and not play.failed, play
    access = dict((g["minor"], [e for e in g["not_ready"] if e["check"] == "device_access"]) for g in play["gpus"])
    assert access[0] == [] and access[2] == [], access
    assert [(e["vmid"], e["reason"]) for e in access[1]] == [
        (101, "container 101: /dev/nvidia1 does not open: Read-only file system (EROFS)")], access
    assert play["ready"] is False


DENIED = ("container 101: GPU 1 (/dev/nvidia1, passed in by dev1) cannot be opened read-write, blocked by deny-write")
DENIED_REMEDY = ("pass it in read-write: remove deny-write from dev1 in /etc/pve/lxc/101.conf, then restart the "
                 "container (pct reboot 101)")


def _deny_write(lab, vmid, minor):
    """Add deny-write to the devN line that passes /dev/nvidiaMINOR into the container, in the node's
    /etc/pve/lxc/VMID.conf (as pct set would; the running container keeps its binding). Returns undo()."""
    path = os.path.join(state_dir(lab.lab_id), "nodes", "pve1", "lxc", "%s.conf" % vmid)
    with open(path) as f:
        original = f.read()
    text, count = re.subn(r"^(dev\d+: /dev/nvidia%d)$" % minor, r"\1,deny-write", original, flags=re.M)
    assert count == 1, original

    def write(content):
        with open(path + ".tmp", "w") as f:
            f.write(content)
        os.replace(path + ".tmp", path)     # the folder is what the node's /etc/pve/lxc shows: a rename keeps it live
    write(text)
    return lambda: write(original)


def test_a_gpu_passed_in_deny_write_is_not_ready_for_its_container_from_the_node(clean):
    """Issue 40 (P2): ct101's config passes GPU 1 in with deny-write (the container cannot open it) and GPU 1 is idle:
    from the node, GPU 1 is not ready with a device_access entry of container 101 naming the rule, and so is the
    whole read. It was ready: 101 was left out of passed_into, so nothing was checked for it."""
    undo = _deny_write(clean, 101, 1)
    try:
        play = clean.direct("pve1", "gpu_info", {"cmdline": False})
    finally:
        undo()
    assert play["view"] == "node" and not play.failed, play
    gpu1 = node_gpu(play, 1)
    assert gpu1["passed_into"] == [] and gpu1["passed_unusable"] == [
        {"vmid": 101, "source": "dev1", "device": "/dev/nvidia1", "rule": "deny-write"}], gpu1
    assert gpu1["free"] and gpu1["ready"] is False and [(e["check"], e["vmid"], e["reason"], e["remedy"])
                                                        for e in gpu1["not_ready"]] == [
        ("device_access", 101, DENIED, DENIED_REMEDY)], gpu1["not_ready"]
    assert node_gpu(play, 0)["ready"] and node_gpu(play, 2)["ready"] and play["ready"] is False


def test_predeploy_check_fails_naming_a_gpu_its_container_cannot_open(clean):
    """Issue 40 (P2): the same deny-write, through predeploy_check.yml from the node (release_gpus_from auto, the
    default): ct101 gets GPU 1 (its config passes it in, unusable), which fails the check with one FAULT line naming
    the container, the GPU and the rule; exit 2. It said OK: ct101 was given GPU 0 alone."""
    undo = _deny_write(clean, 101, 1)
    try:
        proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", clean.inventory,
                               os.path.join(REPO, "playbooks", "predeploy_check.yml"), "-e", "predeploy_hosts=ct101"],
                              cwd=REPO, env=clean.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=300, check=False)
    finally:
        undo()
    lines = re.findall(r'^ *"(PREDEPLOY [^"]*)', proc.stdout, re.M)
    assert proc.returncode == 2 and len(lines) == 2, proc.stdout
    assert lines[0] == "PREDEPLOY FAIL: GPUs at fault: 1", lines
    assert re.match(r"PREDEPLOY FAULT ct101: GPU 1 \(GPU-[^)]+\): not ready, device_access: %s; remedy: %s$"
                    % (re.escape(DENIED), re.escape(DENIED_REMEDY)), lines[1]), lines


def _nspid(host_pid):
    """NSpid of a host pid: (host, node, container) for a container's process."""
    with open("/proc/%d/status" % host_pid) as f:
        return [int(p) for p in re.search(r"^NSpid:\s*(.*)$", f.read(), re.M).group(1).split()]


def test_mps_client_in_a_container_gets_terminate_client_from_the_node(clean):
    """Issue 40 (M1): an MPS control daemon in ct101, its server on GPU 0 and clients on GPUs 0 and 1. Released from
    the node (containers: [101], GPU 1), GPU 1's client is found through the daemon in its container, with the
    container's pids, and gets terminate_client before SIGTERM; the server, the daemon and GPU 0's client live."""
    run = clean.run("mps", 101, [0, 1], mib=700)
    roles, ct = run["roles"], run["container_roles"]
    on_node = dict((role, _nspid(pid)[1]) for role, pid in roles.items())    # the node's pids (its own namespace)
    play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["1"], containers=[101]))
    assert not play.failed, play
    assert clean.used(1) == 0 and clean.used(0) == 766
    steps = [(a["signal"], a["pid"]) for a in play["actions"]]
    assert steps[:2] == [("terminate_client", on_node["client1"]), ("SIGTERM", on_node["client1"])], play["actions"]
    assert play["actions"][0]["outcome"] == ("done: server %d, control daemon pid %d (in container 101, pids as seen "
                                             "there): 0" % (ct["server"], on_node["control"])), play["actions"]
    assert all(host_alive(roles[r]) for r in ("control", "server", "client0")) and not host_alive(roles["client1"])
    log = clean.exec(101, "cat", run["mps_pipe"] + "/control.log").stdout.split("\n")
    assert "Cmd:terminate_client %d %d" % (ct["server"], ct["client1"]) in log and "Cmd:quit" not in log
