"""The lab node's pct against real LXC, over the node's real sshd: Perl-die exit codes, config locks, and
`pct stop` on a container with a frozen task (the `stuck` scenario, a real cgroup v1 freezer, real lxc-stop).

What pve-container does, and where: tests/lab/README.md, "pct". Runs as root; its own lab, torn down.
"""
import json
import os
import subprocess
import time

import pytest

from _enginelab import EngineLab, host_alive
from _labfixture import module_lab

PCT_PM = "/usr/share/perl5/PVE/CLI/pct.pm"
STOP_TIMEOUT = 2  # LAB_PCT_STOP_TIMEOUT for these tests (default 10 s)

lab = module_lab(lambda: EngineLab("labpct", ["--nodes", "1", "--containers", "2", "--gpus", "1"]))


def state(lab):
    return json.loads(lab.labctl("status", parse=False, check=False))  # rc 1 while a container is stopped


def node(lab, command):
    """`command` in a shell on lab node pve1, through its sshd, as the collection reaches a node."""
    st = state(lab)
    argv = ["ssh", "-i", os.path.join(st["state"], "ssh", "id_ed25519"),
            "-o", "UserKnownHostsFile=%s" % os.path.join(st["state"], "ssh", "known_hosts"),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "root@%s" % st["nodes"]["pve1"]["address"], "LAB_PCT_DELAY=0 " + command]
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=60, check=False)


def lxc_state(lab, vmid):
    st = state(lab)
    lxcpath = os.path.join(st["state"], "nodes", "pve1", "lxcpath")
    return subprocess.run(["lxc-info", "-P", lxcpath, "-n", str(vmid), "-s", "-H"], stdout=subprocess.PIPE,
                          universal_newlines=True, check=True).stdout.strip()


def conf_file(lab, vmid):
    return os.path.join(state(lab)["state"], "nodes", "pve1", "lxc", "%s.conf" % vmid)


def proc_state(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            return [ln.split()[1] for ln in f if ln.startswith("State:")][0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("command, rc, message", [
    ("pct exec 109 -- true", 2, "Configuration file 'nodes/pve1/lxc/109.conf' does not exist"),
    ("pct status 109", 2, "Configuration file 'nodes/pve1/lxc/109.conf' does not exist"),
    ("pct stop 109", 25, "CT 109 not running"),
    ("pct start 101", 25, "CT 101 already running"),
    ("pct exec 101", 25, "missing command at %s line 246." % PCT_PM),
    ("pct push 109 /etc/hostname /tmp/x", 25, "can only push files to a running CT"),
    ("pct exec x1 -- true", 255, "400 Parameter verification failed.\nvmid: type check ('integer') failed - got 'x1'\n"
                                 "pct exec <vmid> [<extra-args>] [OPTIONS]"),
])
def test_failures_exit_like_perl_die(lab, command, rc, message):
    res = node(lab, command)
    assert (res.returncode, res.stderr.strip()) == (rc, message)


def test_stopped_container_exits_25(lab):
    res = node(lab, "pct stop 102; echo stop=$?; pct exec 102 -- true; echo exec=$?; pct pull 102 /etc/hostname /tmp/h;"
               " echo pull=$?; pct start 102; echo start=$?; pct exec 102 -- hostname")
    assert res.stdout.splitlines() == ["stop=0", "exec=25", "pull=25", "start=0", "ct102"], res.stderr
    assert res.stderr.splitlines() == ["container '102' not running!",
                                       "can only pull files from a running VM at %s line 664." % PCT_PM]
    lab.wait_supervisord(102)


def test_locked_container(lab):
    """check_lock in vm_start/vm_stop (unless --skiplock) and vm_shutdown (always); pct exec checks no lock."""
    path = conf_file(lab, 101)
    with open(path) as f:
        original = f.read()
    try:
        with open(path, "a") as f:
            f.write("lock: backup\n")
        for command in ("pct stop 101", "pct shutdown 101", "pct stop 101 --skiplock 0"):
            res = node(lab, command)
            assert (res.returncode, res.stderr.strip()) == (255, "CT is locked (backup)"), command
        assert lxc_state(lab, 101) == "RUNNING"
        res = node(lab, "pct exec 101 -- hostname && pct list")
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines()[0] == "ct101"
        assert res.stdout.splitlines()[2].split() == ["101", "running", "backup", "ct101"]
        res = node(lab, "pct stop 101 --skiplock")
        assert res.returncode == 0, res.stderr
        assert lxc_state(lab, 101) == "STOPPED"
        res = node(lab, "pct start 101")
        assert (res.returncode, res.stderr.strip()) == (255, "CT is locked (backup)")
        assert lxc_state(lab, 101) == "STOPPED"
        res = node(lab, "pct start 101 --skiplock 1")
        assert res.returncode == 0, res.stderr
        assert lxc_state(lab, 101) == "RUNNING"
        with open(path, "w") as f:
            f.write(original + "lock: mounted\n")
        res = node(lab, "pct stop 101 && pct start 101")  # the `mounted` lock does not stop them
        assert res.returncode == 0, res.stderr
    finally:
        with open(path, "w") as f:
            f.write(original)
        if lxc_state(lab, 101) != "RUNNING":
            lab.labctl("start", "--node", "pve1", "--vmid", "101", check=False)
    assert lxc_state(lab, 101) == "RUNNING"
    lab.wait_supervisord(101)


def lxc_stops(lab):
    """lxc-stop processes of this lab still running (pct must not leave one behind)."""
    lxcpath = os.path.join(state(lab)["state"], "nodes", "pve1", "lxcpath")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"lxc-stop") and lxcpath.encode() in argv:
            found.append(int(pid))
    return found


def test_stop_with_a_frozen_task_times_out(lab):
    run = lab.run("stuck", 101, [0], mib=512)
    holder = run["holders"][0]
    try:
        assert proc_state(holder) == "D"
        started = time.monotonic()
        res = node(lab, "LAB_PCT_STOP_TIMEOUT=%d pct stop 101" % STOP_TIMEOUT)
        took = time.monotonic() - started
        # vm_stop's die in the task: on stderr, pct exits -1 (255); run_command's warning is task output (stdout)
        assert (res.returncode, res.stderr.strip()) == (255, "container did not stop")
        assert res.stdout.strip() == "command 'lxc-stop -n 101 --kill' failed: got timeout"
        assert STOP_TIMEOUT <= took < STOP_TIMEOUT + 30, took  # bounded, not hung
        assert lxc_stops(lab) == []
        # As LXC leaves it: still RUNNING to lxc-info and pct, the frozen task alive and its GPU memory held.
        assert lxc_state(lab, 101) == "RUNNING"
        assert node(lab, "pct status 101").stdout == "status: running\n"
        assert proc_state(holder) == "D"
        assert lab.used(0) == 512
        # lxc-stop --kill did send its SIGKILL: thawing the task lets it land, and LXC finishes the stop.
        with open(os.path.join(run["freezer"], "freezer.state"), "w") as f:
            f.write("THAWED")
        deadline = time.monotonic() + 30
        while (host_alive(holder) or lxc_state(lab, 101) != "STOPPED") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not host_alive(holder)
        assert lxc_state(lab, 101) == "STOPPED"
    finally:
        lab.labctl("restart", "--node", "pve1", "--vmid", "101")
        lab.started = []
    assert lxc_state(lab, 101) == "RUNNING"
    lab.wait_supervisord(101)
    assert node(lab, "pct stop 101 && pct start 101").returncode == 0  # without a frozen task: stops at once
    lab.wait_supervisord(101)
