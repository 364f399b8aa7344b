"""Issue 44: the service rungs against Debian's real systemd, as real Proxmox containers run it.

`labctl up --systemd 101,102`: both containers boot systemd 252 (bookworm) as their init from a root file system of
their own; 101 is privileged, 102 unprivileged (idmap 100000), each sees cgroup v2 alone, rooted at its own
lxc/VMID/ns. 103 boots systemd too and plays a Proxmox node for the modules run inside it (`--systemd-node`: /etc/pve,
no container= in its init's environment): the lab's own nodes have no systemd, so a node daemon that is a systemd
unit is tested there. Each test is the real-systemd twin of a unit-fake world of an earlier issue; the truth is the lab
driver (`labctl gpus`), the host's /proc and what the container's own systemctl answers, never only the module's.
"""
import json
import os
import subprocess
import tempfile
import time

import pytest

from _enginelab import REPO, VENV_BIN, EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab, wait_until

lab = module_lab(lambda: EngineLab("systemd44", ["--nodes", "1", "--containers", "3", "--gpus", "2",
                                                 "--systemd", "101,102", "--unprivileged", "102",
                                                 "--systemd-node", "103"]))
clean = clean_engine_lab()
FAST = {"term_timeout": 1, "kill_timeout": 2, "advanced": {"verify_timeout": 3, "stop_found_units": True}}
PYTHON = os.path.join(REPO, ".lab", "venv", "bin", "python")
WORKLOAD = os.path.join(REPO, "tests", "lab", "workloads", "workload.py")
HOLD = "%s %s plain --minors %%d --mib %%d --foreground" % (PYTHON, WORKLOAD)
PLAYBOOK = os.path.join(REPO, "playbooks", "release_gpus.yml")


def sh(lab_, vmid, script, stdin=None):
    """script run by /bin/sh inside vmid (labctl exec, as pct exec); the test fails when it does."""
    proc = subprocess.run([os.path.join(REPO, "tests", "lab", "labctl"), "exec", "--node", "pve1", "--vmid",
                           str(vmid), "--", "/bin/sh", "-c", script], env=lab_.env, input=stdin,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, "in %s: %s\n%s" % (vmid, script, proc.stdout)
    return proc.stdout.strip()


def state(lab_, vmid, unit, user=None):
    """The unit's ActiveState from the container's own manager (the system's, or user's)."""
    manager = "" if user is None else "--user -M %s@ " % user
    return sh(lab_, vmid, "systemctl %sshow -p ActiveState --value -- %s" % (manager, unit))


def main_pid(lab_, vmid, unit):
    return int(sh(lab_, vmid, "systemctl show -p MainPID --value -- %s" % unit))


def install_unit(lab_, vmid, name, text, start=True):
    sh(lab_, vmid, "cat > /etc/systemd/system/%s && systemctl daemon-reload" % name, stdin=text)
    if start:
        sh(lab_, vmid, "systemctl start %s" % name)


def remove_unit(lab_, vmid, name):
    sh(lab_, vmid, "systemctl stop %s; systemctl reset-failed %s 2>/dev/null; rm -f /etc/systemd/system/%s; "
                   "systemctl daemon-reload" % (name, name, name))


def holders(lab_, minor):
    return lab_.truth()[minor]["holders"]


def stays(predicate, seconds):
    """True when predicate holds at every read for that long (a window to watch, not a wait)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(0.1)
    return predicate()


def stop_set(result, kind, name):
    sets = [s for s in result.get("stop_sets") or [] if s.get("kind") == kind and s.get("name") == name]
    assert len(sets) == 1, "want one %s stop set %s: %s" % (kind, name, result.get("stop_sets"))
    return sets[0]


def test_pid_1_is_systemd_and_the_system_is_running(lab):
    """Acceptance: inside each container PID 1 is systemd and `systemctl is-system-running` answers running or
    degraded; cgroup v2 is the only hierarchy, rooted at the container's own cgroup; nothing of the lab's stand-in
    init runs there."""
    for vmid in (101, 102, 103):
        assert sh(lab, vmid, "cat /proc/1/comm") == "systemd"
        running = subprocess.run([os.path.join(REPO, "tests", "lab", "labctl"), "exec", "--node", "pve1", "--vmid",
                                  str(vmid), "--", "systemctl", "is-system-running", "--wait"], env=lab.env,
                                 stdout=subprocess.PIPE, universal_newlines=True, timeout=60, check=False)
        assert running.stdout.strip() in ("running", "degraded"), running.stdout
        assert sh(lab, vmid, "stat -f -c %T /sys/fs/cgroup") == "cgroup2fs"
        assert sh(lab, vmid, "cat /proc/1/cgroup | grep '^0::'") == "0::/init.scope"
        assert sh(lab, vmid, "systemctl is-active supervisor.service cron.service dbus.service") == \
            "active\nactive\nactive"
        # its root file system is its own: not the host's /etc, nor its /run
        status = json.loads(lab.labctl("status", parse=False))
        init = status["nodes"]["pve1"]["containers"][str(vmid)]["init_host_pid"]
        for folder in ("/etc", "/run"):
            inside, host = os.stat("/proc/%d/root%s" % (init, folder)), os.stat(folder)
            assert (inside.st_dev, inside.st_ino) != (host.st_dev, host.st_ino), folder
    assert sh(lab, 102, "cat /proc/self/uid_map").split() == ["0", "100000", "65536"]
    assert sh(lab, 101, "cat /proc/self/uid_map").split() == ["0", "0", "4294967295"]


@pytest.mark.timing
@pytest.mark.parametrize("vmid", [101, 102], ids=["privileged", "unprivileged"])
def test_w1_restart_always_unit_is_stopped_before_any_signal(clean, vmid):
    """W1 on real systemd: gpuhold.service (Restart=always, RestartSec=100ms) runs the holder behind
    `ExecStart=/bin/sh -c '...; exit $?'` on GPU 0. From the node, with stop_found_units, the release finds the
    unit from the holder's cgroup and stops it with the container's systemctl before any signal: GPU 0 is free,
    the unit inactive, and nothing holds GPU 0 again in the 3 s that follow."""
    unit = "gpuhold-%d.service" % vmid
    install_unit(clean, vmid, unit, "[Service]\nExecStart=/bin/sh -c '%s ; exit $?'\nRestart=always\n"
                                    "RestartSec=100ms\n" % (HOLD % (0, 600)))
    try:
        assert wait_until(lambda: clean.used(0) == 600, timeout=15), clean.truth()[0]
        holder = holders(clean, 0)
        args = dict(FAST, gpus=["0"], containers=[vmid])
        play = clean.direct("pve1", "gpu_release", args)
        assert not play.failed and play["changed"] is True, play
        assert [(u["vmid"], u["kind"], u["name"]) for u in play["found_units"]] == [(vmid, "systemd", unit)], play
        assert (stop_set(play, "systemd", unit)["outcome"] or "").startswith("done"), play["stop_sets"]
        kinds = [a["signal"] for a in play["actions"]]
        assert kinds and kinds[0] == "stop" and "SIGKILL" not in kinds, play["actions"]   # the unit first
        assert wait_until(lambda: clean.used(0) == 0, timeout=5), clean.truth()[0]
        assert state(clean, vmid, unit) == "inactive"
        assert not any(host_alive(p) for p in holder)
        assert stays(lambda: clean.used(0) == 0 and not holders(clean, 0), 3.0), clean.truth()[0]
        assert state(clean, vmid, unit) == "inactive"
    finally:
        remove_unit(clean, vmid, unit)


def test_supervisor_service_keeps_running_and_only_the_gpu0_program_stops(clean):
    """U1 on real systemd: Debian's supervisor.service hosts program A on GPU 0 and program B on GPU 1. Releasing
    GPU 0 from the node stops A through supervisorctl (STOPPED); B keeps its pid; supervisor.service stays active
    with the same main pid (never stopped: the stop set is the program, not the unit)."""
    sup = main_pid(clean, 101, "supervisor.service")
    a = clean.run("respawn", 101, [0], mib=600)
    b = clean.run("respawn", 101, [1], mib=400)
    assert a["container_roles"]["supervisord"] == b["container_roles"]["supervisord"] == sup
    play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[101]))
    assert not play.failed, play
    name = "%s:%s" % (a["supervisor_program"], a["supervisor_program"])
    assert [(u["kind"], u["name"]) for u in play["found_units"]] == [("supervisord", name)], play["found_units"]
    assert wait_until(lambda: clean.used(0) == 0, timeout=5), clean.truth()[0]
    assert clean.used(1) == 400 and host_alive(b["holders"][0]) and not host_alive(a["holders"][0])
    assert "STOPPED" in sh(clean, 101, "supervisorctl status %s || true" % a["supervisor_program"])
    # B goes on: its pid unchanged (supervisord calls a program STARTING for its first second: startsecs=1)

    def b_status():
        return sh(clean, 101, "supervisorctl status %s || true" % b["supervisor_program"])
    assert wait_until(lambda: "RUNNING" in b_status(), timeout=5), b_status()
    assert "pid %d," % b["container_holders"][0] in b_status(), b_status()
    assert state(clean, 101, "supervisor.service") == "active" and main_pid(clean, 101, "supervisor.service") == sup


def test_a_holder_started_by_cron_never_stops_cron_service(clean):
    """B3 on real systemd: cron.service runs a job (an @reboot line, run as cron starts) that holds GPU 0. Its
    stop set is cron.service, a generic launcher: refused, and the holder is signalled alone. GPU 0 is free,
    cron.service is still active with the same main pid."""
    sh(clean, 102, "echo '@reboot root %s' > /etc/cron.d/gpuhold && chmod 644 /etc/cron.d/gpuhold && "
                   "rm -f /run/crond.reboot && systemctl restart cron.service" % (HOLD % (0, 500)))
    try:
        assert wait_until(lambda: clean.used(0) == 500, timeout=15), clean.truth()[0]
        cron = main_pid(clean, 102, "cron.service")
        play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["0"], containers=[102]))
        assert not play.failed, play
        entry = stop_set(play, "systemd", "cron.service")
        assert entry["verdict"] == "refused" and not (entry["outcome"] or "").startswith("done"), entry
        assert play["found_units"] == [], play["found_units"]
        assert wait_until(lambda: clean.used(0) == 0, timeout=5), clean.truth()[0]
        assert state(clean, 102, "cron.service") == "active" and main_pid(clean, 102, "cron.service") == cron
    finally:
        sh(clean, 102, "rm -f /etc/cron.d/gpuhold")


def test_a_user_service_is_stopped_through_its_users_manager_never_the_system_one(clean):
    """A user service on real systemd: user `lab` (uid 1000) with lingering runs `systemd --user`, whose unit
    gpuhold.service (Restart=always) holds GPU 1. From the node, the stop set is that user's unit: stopped through
    that user's manager (`systemctl --user -M 1000@`), or refused with a message; user@1000.service, the system
    manager's unit of that manager, stays active either way."""
    sh(clean, 101, "id lab >/dev/null 2>&1 || useradd -m -u 1000 lab; loginctl enable-linger lab")
    assert wait_until(lambda: "active" == state(clean, 101, "user@1000.service"), timeout=20)
    unit_dir = "/home/lab/.config/systemd/user"
    text = "[Service]\nExecStart=/bin/sh -c '%s ; exit $?'\nRestart=always\nRestartSec=100ms\n" % (HOLD % (1, 300))
    sh(clean, 101, "mkdir -p %s && cat > %s/gpuhold.service && chown -R lab: /home/lab/.config && "
                   "systemctl --user -M lab@ daemon-reload && systemctl --user -M lab@ start gpuhold.service"
                   % (unit_dir, unit_dir), stdin=text)
    manager = main_pid(clean, 101, "user@1000.service")
    try:
        assert wait_until(lambda: clean.used(1) == 300, timeout=15), clean.truth()[1]
        play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["1"], containers=[101]))
        entry = stop_set(play, "systemd-user", "gpuhold.service")
        assert entry["manager_uid"] == 1000, entry
        if entry["verdict"] == "stop":
            assert (entry["outcome"] or "").startswith("done"), entry
            assert not play.failed, play
            assert state(clean, 101, "gpuhold.service", user="lab") == "inactive"
            assert wait_until(lambda: clean.used(1) == 0, timeout=5), clean.truth()[1]
        else:
            assert entry["reason"], entry
        assert state(clean, 101, "user@1000.service") == "active"
        assert main_pid(clean, 101, "user@1000.service") == manager
    finally:
        sh(clean, 101, "systemctl --user -M lab@ stop gpuhold.service; rm -f %s/gpuhold.service; "
                       "loginctl disable-linger lab" % unit_dir)


def _role(lab_, vmid, extra, check=False):
    """playbooks/release_gpus.yml on one systemd container (the container path), its JSON report."""
    report_dir = tempfile.mkdtemp(dir=lab_.workdir, prefix="report-")
    variables = dict({"release_gpus_report_dir": report_dir, "release_gpus_term_timeout": 1,
                      "release_gpus_kill_timeout": 2, "release_gpus_advanced": {"verify_timeout": 5},
                      "release_gpus_from": "container"}, **extra)
    vars_file = os.path.join(report_dir, "vars.json")
    with open(vars_file, "w") as f:
        json.dump(variables, f)
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", lab_.inventory, PLAYBOOK, "-e", "@" + vars_file,
           "--limit", "ct%d" % vmid] + (["--check"] if check else [])
    proc = subprocess.run(cmd, cwd=REPO, env=lab_.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300, check=False)
    report = os.path.join(report_dir, "ct%d.json" % vmid)
    with open(report) if os.path.exists(report) else open(os.devnull) as f:
        text = f.read()
    return proc, json.loads(text) if text else {}


def test_role_stops_a_listed_service_with_real_systemctl_and_check_mode_changes_nothing(clean):
    """The role's own stop-service step on real systemd (release_gpus_services: [gpuhold-role.service], 102
    unprivileged): check mode leaves the unit active and its holder alive; the real run stops it with the
    container's systemctl before the ladder, GPU 0 is free and the unit inactive; a second run changes nothing."""
    unit = "gpuhold-role.service"
    install_unit(clean, 102, unit, "[Service]\nExecStart=/bin/sh -c '%s ; exit $?'\nRestart=always\n"
                                   "RestartSec=100ms\n" % (HOLD % (0, 700)))
    try:
        assert wait_until(lambda: clean.used(0) == 700, timeout=15), clean.truth()[0]
        main = main_pid(clean, 102, unit)
        extra = {"release_gpus_services": [unit]}
        checked, report = _role(clean, 102, extra, check=True)
        assert checked.returncode == 0, checked.stdout[-6000:]
        assert state(clean, 102, unit) == "active" and main_pid(clean, 102, unit) == main
        assert clean.used(0) == 700
        done, report = _role(clean, 102, extra)
        assert done.returncode == 0, done.stdout[-6000:]
        assert "systemd unit %s" % unit in " ".join(report.get("stopped") or []), report
        assert state(clean, 102, unit) == "inactive"
        assert wait_until(lambda: clean.used(0) == 0, timeout=5), clean.truth()[0]
        again, report = _role(clean, 102, extra)
        assert again.returncode == 0 and "changed=0" in again.stdout.replace(" ", ""), again.stdout[-6000:]
    finally:
        remove_unit(clean, 102, unit)


DAEMON = os.path.join(REPO, "tests", "lab", "node", "nvidia-persistenced")
PERSISTENCED = "[Service]\nExecStart=%s %s\n" % (PYTHON, DAEMON)
RC_LOCAL = "#!/bin/sh\n%s %s >/dev/null 2>&1 &\nexit 0\n" % (PYTHON, DAEMON)


def _daemons(lab_):
    return sh(lab_, 103, "pgrep -x nvidia-persiste || true").split()


def test_a_node_daemon_unit_is_stopped_and_started_for_a_reset_and_rc_local_never(clean):
    """B3 and issue 21 on real systemd, on the systemd node 103: GPU 1 has 800 MiB leaked (no process), so only a
    reset frees it; nvidia-persistenced.service (the lab's stand-in daemon, every GPU file open) and a second copy
    started from /etc/rc.local (rc-local.service) block it. With reset_blockers: stop_services the release refuses
    before anything, naming rc-local.service (a generic launcher: never stopped); rc-local.service and both daemons
    stay. Once the rc-local copy is gone, the release stops nvidia-persistenced.service with systemctl, resets, and
    starts it again (a new main pid, active); GPU 1 is free."""
    uuid = clean.truth()[1]["uuid"]
    install_unit(clean, 103, "nvidia-persistenced.service", PERSISTENCED)
    sh(clean, 103, "cat > /etc/rc.local && chmod 755 /etc/rc.local && systemctl daemon-reload && "
                   "systemctl start rc-local.service", stdin=RC_LOCAL)
    try:
        assert wait_until(lambda: len(_daemons(clean)) == 2, timeout=15), _daemons(clean)
        daemon = main_pid(clean, 103, "nvidia-persistenced.service")
        clean.run("leaked", 103, [1], mib=800)
        args = dict(FAST, gpus=[uuid], gpu_reset=True, host_processes=True,
                    advanced={"verify_timeout": 3, "reset_blockers": "stop_services"})
        refused = clean.direct("ct103", "gpu_release", args)
        assert refused.failed and refused["actions"] == [] and refused["reset_steps"] == [], refused
        assert "rc-local.service" in refused["msg"] and "nothing was signalled" in refused["msg"], refused["msg"]
        assert clean.used(1) == 800
        assert state(clean, 103, "rc-local.service") == "active" and len(_daemons(clean)) == 2
        assert main_pid(clean, 103, "nvidia-persistenced.service") == daemon
        # rc-local.service has KillMode=process: its stop leaves the daemon; kill what its cgroup holds first
        sh(clean, 103, "systemctl kill rc-local.service && systemctl stop rc-local.service && rm -f /etc/rc.local && "
                       "systemctl daemon-reload")
        assert wait_until(lambda: len(_daemons(clean)) == 1, timeout=10), _daemons(clean)
        done = clean.direct("ct103", "gpu_release", args)
        assert not done.failed and done["rung_reached"] == "reset", done
        assert [(s["step"], s["ok"]) for s in done["reset_steps"]] == [("stop", True), ("start", True)], done
        assert wait_until(lambda: clean.used(1) == 0, timeout=5), clean.truth()[1]
        assert state(clean, 103, "nvidia-persistenced.service") == "active"
        assert main_pid(clean, 103, "nvidia-persistenced.service") != daemon
    finally:
        sh(clean, 103, "systemctl kill rc-local.service; systemctl stop rc-local.service; rm -f /etc/rc.local; "
                       "systemctl daemon-reload")
        remove_unit(clean, 103, "nvidia-persistenced.service")
