"""gpu_release against the lab, through ansible-playbook and gpuops.fleet.pct (issue 4).

Every assertion about freeing is checked against `labctl gpus` (the fake driver's truth)
and the host's /proc, not only against what the module says.
"""
import json
import os
import shlex
import signal
import subprocess
import time

import pytest

from _enginelab import EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab

FAST = {"term_timeout": 1, "kill_timeout": 2, "advanced": {"verify_timeout": 3}}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOAD = os.path.join(REPO, "tests", "lab", "workloads", "workload.py")
LAB_PYTHON = os.path.join(REPO, ".lab", "venv", "bin", "python")


def wait_until(predicate, timeout=10, interval=0.1):
    """The predicate's first true value within timeout, else its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


lab = module_lab(lambda: EngineLab("engrl1", ["--nodes", "1", "--containers", "2", "--gpus", "8",
                                              "--layout", "102=4,5,6,7"]))


clean = clean_engine_lab()


def signalled_pids(play):
    return set(a["pid"] for a in play["actions"] if a["signal"] in ("SIGTERM", "SIGKILL"))


def test_every_scenario_released_bystanders_untouched(clean):
    lab = clean
    runs = {
        "plain": lab.run("plain", 101, [0]),
        "fork": lab.run("fork_inherit", 101, [1]),
        "defunct": lab.run("defunct_leader", 101, [2]),
        "mmap": lab.run("mmap_only", 101, [3]),
        "tp": lab.run("tp_server", 101, [4, 5]),
        "term": lab.run("term_ignoring", 101, [6]),
        "zombie": lab.run("zombie", 101, [6]),
        "monitor": lab.run("monitor", 101),
        "cpu": lab.run("bystander_cpu", 101),
        "gpu": lab.run("bystander_gpu", 101, [7]),
    }
    os.kill(runs["fork"]["roles"]["parent"], signal.SIGKILL)
    holders = [p for key in ("plain", "fork", "defunct", "mmap", "tp", "term") for p in runs[key]["holders"]
               if p != runs["fork"]["roles"]["parent"]]
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[0, 1, 2, 3, 4, 5, 6]))
    assert not play.failed, play
    truth = lab.truth()
    assert [truth[m]["used_mib"] for m in range(7)] == [0] * 7
    assert truth[7]["used_mib"] == 512                      # bystander_gpu's GPU was not targeted
    assert not [p for p in holders if host_alive(p)]
    for key in ("monitor", "cpu", "gpu"):
        assert host_alive(runs[key]["host_pids"][0]), key

    def ct(key, role):
        return runs[key]["container_roles"][role]
    never = {ct("monitor", "monitor"), ct("cpu", "bystander"), ct("gpu", "bystander"), ct("zombie", "zombie"),
             ct("zombie", "parent"), ct("tp", "parent")}
    assert not never & signalled_pids(play)
    term = ct("term", "holder")
    kinds = [(a["signal"], a["outcome"]) for a in play["actions"] if a["pid"] == term]
    assert kinds == [("SIGTERM", "sent"), ("SIGKILL", "sent")]
    assert play["rung_reached"] == "sigkill" and play["changed"] is True
    assert play["released_mib"] == 512 * 7 and play["remaining"] == []
    assert all(g["free"] for g in play["after"]) and not any(g["free"] for g in play["before"] if g["index"] != 6) \
        and play["elapsed_s"] < 10
    # the second run: the module's own code in the container (the play above took the product path)
    again = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[0, 1, 2, 3, 4, 5, 6]))
    assert not again.failed and again["changed"] is False and again["actions"] == []
    assert again["rung_reached"] == "none"


def test_check_mode_signals_nothing(clean):
    lab = clean
    run = lab.run("plain", 101, [0])
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[0]), check_mode=True)
    assert not play.failed and play["changed"] is True and play["actions"] == []
    assert [(p["pid"], p["signals"]) for p in play["plan"]] == [(run["container_holders"][0], ["SIGTERM", "SIGKILL"])]
    assert host_alive(run["holders"][0]) and lab.used(0) == 512


def test_match_excluding_a_holder_fails_honestly(clean):
    lab = clean
    keep = lab.run("plain", 101, [0])
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[0], match="no-such-job"))
    assert play.failed and host_alive(keep["holders"][0]) and lab.used(0) == 512
    assert play["actions"] == []
    assert play["not_signalled"][0]["pid"] == keep["container_holders"][0]
    assert "does not match `match`" in play["msg"] and play["msg"].startswith("GPU 0 not free after the ladder")


def test_match_selects_among_holders(clean):
    lab = clean
    target = lab.run("plain", 101, [0], extra=["--fake-secret"])
    keep = lab.run("mmap_only", 101, [1])
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[0, 1], match="--api-key"))
    assert play.failed                                   # GPU 1 still held by the excluded holder
    assert not host_alive(target["holders"][0]) and host_alive(keep["holders"][0])
    assert lab.used(0) == 0 and lab.used(1) == 512
    assert signalled_pids(play) == {target["container_holders"][0]}
    # issue 46: the result's per-GPU shape, inside a container: the signalled GPU freed, the excluded one busy
    freed, kept = sorted(play["per_gpu"], key=lambda g: g["index"])
    assert freed["verdict"] == "free" and freed["rung"] in ("sigterm", "sigkill"), freed
    assert freed["signals"][0].startswith("SIGTERM %d (" % target["container_holders"][0]), freed
    assert freed["planned"] == [target["container_holders"][0]] and play["per_container"] == []
    assert kept == dict(kept, verdict="busy", rung="none", signals=[], planned=[]), kept


def test_stuck_holder_is_diagnosed_and_reset_refused(clean):
    lab = clean
    run = lab.run("stuck", 102, [0])                     # minor 4
    # a reset is the node's (issue 11): from the node, scoped to container 102
    play = lab.play("pve1", "gpu_release", {"gpus": [lab.truth()[4]["uuid"]], "containers": [102], "term_timeout": 0.5,
                                            "kill_timeout": 0.5, "advanced": {"verify_timeout": 1.5}, "gpu_reset": True})
    assert play.failed and lab.used(4) == 512 and host_alive(run["holders"][0])
    assert play["rung_reached"] == "reset"
    pid = run["node_holders"][0]
    assert [a["signal"] for a in play["actions"] if a["pid"] == pid] == ["SIGTERM", "SIGKILL"]
    refused = [a for a in play["actions"] if a["signal"] == "reset"]
    assert refused and refused[0]["outcome"].startswith("refused: pid %d" % pid)
    d_state = [line for line in play["diagnosis"] if line.startswith("pid %d (" % pid) and "in D state (wchan " in line]
    assert d_state and "wchan unknown" not in d_state[0]
    held = play["remaining"][0]["holders"][0]
    assert held["pid"] == pid and held["blocked_threads"][0]["wchan"]


def test_leaked_memory_needs_a_reset(clean):
    lab = clean
    lab.run("leaked", 101, [3], mib=1000)
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[3]))
    assert play.failed and lab.used(3) == 1000 and play["actions"] == []
    assert "1000 MiB is used by no process visible here" in play["msg"]
    assert play["remaining"][0]["unattributed_mib"] == 1000
    inside = lab.play("ct101", "gpu_release", dict(FAST, gpus=[3], gpu_reset=True))
    assert inside.failed and "gpu_reset is refused inside a container" in inside["msg"] and lab.used(3) == 1000
    play = lab.play("pve1", "gpu_release", dict(FAST, gpus=[lab.truth()[3]["uuid"]], containers=[101],
                                                gpu_reset=True))
    assert not play.failed, play
    assert lab.used(3) == 0 and play["changed"] is True and play["rung_reached"] == "reset"
    assert [a["outcome"][:4] for a in play["actions"] if a["signal"] == "reset"] == ["done"]


@pytest.mark.timing
def test_respawn_is_detected(clean):
    lab = clean
    run = lab.run("respawn", 102, [1])                   # supervisord program on minor 5
    play = lab.play("ct102", "gpu_release", dict(FAST, gpus=[1]))
    assert play.failed
    sup = run["container_roles"]["supervisord"]
    assert play["msg"].startswith("respawned by pid %d (supervisord): stop the service first" % sup)
    assert play["respawned"]["parent_pid"] == sup and play["respawned"]["chain"][0]["pid"] == sup
    assert "supervisorctl stop" in play["msg"]
    assert run["container_roles"]["holder"] in signalled_pids(play)


@pytest.mark.timing
def test_long_running_sibling_of_the_same_name_is_no_respawn(clean):
    """Issue 10: under LXCFS /proc/uptime is the container's; the respawn check must not use it.

    supervisord runs two programs named python: the released one does not restart, the other (no GPU,
    so not seen before the kill) has run for a while. It is no respawn: the release succeeds."""
    lab = clean
    programs = {"gpuops-sibling": "%s -c 'import time; time.sleep(600)'" % LAB_PYTHON,
                "gpuops-once": "%s %s plain --minors 5 --mib 512 --foreground" % (LAB_PYTHON, WORKLOAD)}
    try:
        for name, command in sorted(programs.items(), reverse=True):  # the sibling first
            conf = "[program:%s]\ncommand=%s\nautostart=true\nautorestart=false\nstartsecs=0\n" % (name, command)
            wrote = lab.exec(102, "sh", "-c", "cat > /run/supervisor/conf.d/%s.conf <<'EOF'\n%sEOF\n"
                             "supervisorctl update" % (name, conf))
            assert wrote.returncode == 0, wrote.stdout
            assert wait_until(lambda: "RUNNING" in lab.exec(102, "supervisorctl", "status", name).stdout, timeout=20)
        assert wait_until(lambda: lab.used(5) == 512, timeout=20)
        sibling = lab.exec(102, "supervisorctl", "pid", "gpuops-sibling").stdout.strip()
        assert sibling.isdigit()
        play = lab.direct("ct102", "gpu_release", dict(FAST, gpus=[1]))
        assert not play.failed, play
        assert lab.used(5) == 0 and not play.get("respawned")
        assert lab.exec(102, "supervisorctl", "pid", "gpuops-sibling").stdout.strip() == sibling
    finally:
        lab.exec(102, "sh", "-c", "rm -f /run/supervisor/conf.d/gpuops-sibling.conf "
                 "/run/supervisor/conf.d/gpuops-once.conf; supervisorctl update")


@pytest.mark.timing
def test_two_releases_of_one_gpu_do_not_both_signal(clean):
    lab = clean
    run = lab.run("term_ignoring", 101, [0])
    args = {"gpus": [0], "term_timeout": 1.5, "kill_timeout": 2, "advanced": {"verify_timeout": 3}}
    first = lab.play("ct101", "gpu_release", args, background=True)
    second = lab.play("ct101", "gpu_release", args, background=True)
    plays = [first(), second()]
    assert not [p for p in plays if p.failed], plays
    assert lab.used(0) == 0 and not host_alive(run["holders"][0])
    acting = [p for p in plays if p["actions"]]
    assert len(acting) == 1 and sorted(p["changed"] for p in plays) == [False, True]
    assert [a["signal"] for a in acting[0]["actions"]] == ["SIGTERM", "SIGKILL"]
    # the other one took the lock only once the first had climbed the ladder: after its last signal
    waiting = [p for p in plays if not p["actions"]][0]
    assert waiting["lock_acquired_at"] >= acting[0]["actions"][-1]["time"], plays
    assert acting[0]["lock_acquired_at"] <= acting[0]["actions"][0]["time"], plays


def test_layout_release_by_uuid(clean):
    lab = clean
    run = lab.run("plain", 102, [2])                     # minor 6
    uuid = lab.truth()[6]["uuid"]
    play = lab.direct("ct102", "gpu_release", dict(FAST, gpus=[uuid]))
    assert not play.failed, play
    assert lab.used(6) == 0 and not host_alive(run["holders"][0])
    assert [(g["index"], g["minor"]) for g in play["after"]] == [(2, 6)]


BAD_INPUT = [
    ({"gpus": [9]}, ["GPU '9' not found; GPUs here: 0 (minor 4"]),
    ({"term_timeout": -1}, ["term_timeout must be 0 or more, got -1"]),
    ({"kill_timeout": "inf"}, ["kill_timeout must be a finite number, got inf"]),
    ({"advanced": {"verify_timeout": "nan"}}, ["advanced.verify_timeout must be a finite number, got nan"]),
    ({"advanced": {"nvml_timeout": "nan"}}, ["advanced.nvml_timeout must be a finite number, got nan"]),
    ({"advanced": {"timeout": "inf"}}, ["advanced.timeout must be a finite number, got inf"]),
    # issue 45: the deprecated top-level spelling is gone: ansible's own error, before the module's code runs
    ({"timeout": 2}, ["Unsupported parameters for (gpuops.fleet.gpu_release) module: timeout"]),
    ({"advanced": {"verify_timeout": 1, "no_such": 1}}, ["advanced", "no_such"]),
    ({"match": "[unclosed"}, ["match: regular expression '[unclosed' does not compile"]),
]


@pytest.fixture(scope="module")
def bad_input_play(lab):
    """Every bad input, one task each in one ansible-playbook run (errors ignored) against one holder: each task's
    result, and the holder's state once all of them ran."""
    run = lab.run("plain", 102, [0])
    try:
        plays = lab.play_tasks("ct102", "gpu_release", [args for args, dummy in BAD_INPUT])
        after = {"alive": host_alive(run["holders"][0]), "used": lab.used(4)}
    finally:
        busy = lab.cleanup()
    assert not busy, busy
    return plays, after


@pytest.mark.parametrize("args, words", BAD_INPUT)
def test_bad_input_fails_before_any_signal(bad_input_play, args, words):
    plays, after = bad_input_play
    play = plays[[case for case, dummy in BAD_INPUT].index(args)]
    assert play.failed and after == {"alive": True, "used": 512}, (play, after)
    for word in words:
        assert word in play["msg"]
    assert not play.get("actions")


def test_lost_gpu_fails_without_signals(clean):
    lab = clean
    run = lab.run("plain", 101, [7])
    lab.labctl("fault", "--node", "pve1", "--gpu", 7, "--fault", "lost")
    try:
        play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[7]))
    finally:
        lab.labctl("fault", "--node", "pve1", "--gpu", 7, "--fault", "none")
    assert play.failed and host_alive(run["holders"][0]) and not play.get("actions")
    assert "GPU_IS_LOST" in play["msg"] and "nothing was signalled" in play["msg"]


@pytest.mark.timing
def test_overall_timeout_is_enforced_by_the_module(clean):
    lab = clean
    run = lab.run("term_ignoring", 101, [0])
    play = lab.play("ct101", "gpu_release", {"gpus": [0], "term_timeout": 60, "advanced": {"timeout": 2}})
    assert play.failed and "overall timeout was reached during SIGTERM" in play["msg"]
    assert play["elapsed_s"] < 30 and play.seconds < 60  # term_timeout (60 s) never ran out
    assert [a["signal"] for a in play["actions"]] == ["SIGTERM"]
    assert host_alive(run["holders"][0])                  # it ignores SIGTERM; the timeout came first


def test_release_under_async(clean):
    lab = clean
    run = lab.run("plain", 101, [1])
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[1]), task_extra={"async": 60, "poll": 1})
    assert not play.failed, play
    assert play["changed"] is True and lab.used(1) == 0 and not host_alive(run["holders"][0])


PID_REUSE = r'''
import atexit, os, shutil, signal, sys, tempfile, time
root = tempfile.mkdtemp()
atexit.register(shutil.rmtree, root, True)
os.makedirs(os.path.join(root, "ansible_collections", "gpuops"))
os.symlink(sys.argv[1], os.path.join(root, "ansible_collections", "gpuops", "fleet"))
sys.path.insert(0, root)
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._release import send_guarded
first = os.fork()
if first == 0:
    time.sleep(60)
    os._exit(0)
record = {"pid": first, "name": "sleeper", "starttime_ticks": procscan.read_stat(first)["starttime"],
          "create_time": None}
os.kill(first, signal.SIGKILL)
os.waitpid(first, 0)
time.sleep(0.05)  # a later start time
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(first - 1))
second = os.fork()
if second == 0:
    time.sleep(60)
    os._exit(0)
outcome = send_guarded(record, signal.SIGKILL)
alive = os.waitpid(second, os.WNOHANG) == (0, 0)
print("%d %d %s|%s" % (first, second, alive, outcome))
os.kill(second, signal.SIGKILL)
'''


@pytest.mark.timing
def test_a_really_reused_pid_is_never_signalled(clean):
    """ns_last_pid in the container's PID namespace hands a dead process's pid to a new one.

    LXC mounts the container's /proc/sys read-only, as Proxmox does, so the script joins the container's PID
    namespace from the host (nsenter) with a /proc of its own that shows that namespace.
    """
    from _enginelab import REPO
    lab = clean
    init = json.loads(lab.labctl("status", parse=False))["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    python = os.path.join(REPO, ".lab", "venv", "bin", "python")
    script = "mount -t proc proc /proc && exec \"$0\" -c \"$1\" \"$2\""
    proc = subprocess.run(["nsenter", "-t", str(init), "-p", "--", "unshare", "-m", "--propagation", "private",
                           "sh", "-c", script, python, PID_REUSE, REPO],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout
    numbers, outcome = proc.stdout.strip().splitlines()[-1].split("|")
    first, second, alive = numbers.split()
    assert first == second, "the kernel did not hand out the same pid: %s" % proc.stdout
    assert alive == "True" and outcome == "not sent: pid %s was reused by another process" % first


PARENT_LOOP = "import subprocess, sys, time\nwhile True:\n    subprocess.call(sys.argv[2:])\n    time.sleep(0.1)\n"
# how each kind of parent restarts the holder as soon as it dies (a loop, whatever its name)
RESPAWNING_PARENTS = {
    "shell_loop": "setsid sh -c 'while :; do {python} {workload} plain --minors 3 --mib 256 --foreground; sleep 0.1; "
                  "done # {marker}' </dev/null >/dev/null 2>&1 &",
    "python_loop": "setsid {python} /tmp/{marker}.py {marker} {python} {workload} plain --minors 3 --mib 256 "
                   "--foreground </dev/null >/dev/null 2>&1 &",
    "torchrun": "mkdir -p /tmp/{marker} && (echo '#!{python}'; cat /tmp/{marker}.py) > /tmp/{marker}/torchrun && "
                "chmod +x /tmp/{marker}/torchrun && setsid /tmp/{marker}/torchrun {marker} {python} {workload} plain "
                "--minors 3 --mib 256 --foreground </dev/null >/dev/null 2>&1 &",
}


@pytest.mark.timing
@pytest.mark.parametrize("kind", sorted(RESPAWNING_PARENTS))
def test_respawn_by_a_parent_loop_is_detected(clean, kind):
    """A parent restarts the holder as soon as it dies, whatever its name: the task fails naming that parent
    and its chain (never "verified free"), and the new holder is not signalled."""
    lab = clean
    marker = "gpuops-respawn-%s" % kind.replace("_", "-")
    command = RESPAWNING_PARENTS[kind].format(python=LAB_PYTHON, workload=WORKLOAD, marker=marker)
    script = "cat > /tmp/%s.py <<'EOF'\n%sEOF\n%s" % (marker, PARENT_LOOP, command)
    started = lab.exec(101, "sh", "-c", script)
    assert started.returncode == 0, started.stdout
    try:
        assert wait_until(lambda: lab.used(3) == 256, timeout=20), lab.truth()[3]
        found = lab.exec(101, "pgrep", "-o", "-f", marker).stdout.split()
        assert found, "the respawning parent is not running"
        parent = int(found[0])
        comm = lab.exec(101, "cat", "/proc/%d/comm" % parent).stdout.strip()
        assert comm == {"shell_loop": "sh", "torchrun": "torchrun"}.get(kind, comm)
        play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[3]))
        assert play.failed and play["changed"] is True, play
        assert play["msg"].startswith("respawned by pid %d (%s): stop the service first" % (parent, comm)), play["msg"]
        assert "stop pid %d (%s) or what runs it first" % (parent, comm) in play["msg"]
        respawned = play["respawned"]
        assert (respawned["parent_pid"], respawned["parent_name"]) == (parent, comm)
        assert respawned["chain"][0] == {"pid": parent, "name": comm} and respawned["chain"][-1]["pid"] == 1
        assert signalled_pids(play) and respawned["pid"] not in signalled_pids(play)
        # the new holder is what the verdict named: it holds GPU 3 again
        assert wait_until(lambda: lab.used(3) == 256, timeout=20)
    finally:
        lab.exec(101, "pkill", "-9", "-f", marker)
        lab.exec(101, "pkill", "-9", "-f", "workload.py plain --minors 3 ")


W1_LOOP = "gpuops_w1_loop"   # the loop's $0, in its cmdline


def _stat(host_pid):
    """(comm, ppid) of a host pid, from /proc/PID/stat."""
    with open("/proc/%d/stat" % host_pid) as f:
        text = f.read()
    return text[text.index("(") + 1:text.rindex(")")], int(text.rsplit(")", 1)[1].split()[1])


def _cmdline(host_pid):
    with open("/proc/%d/cmdline" % host_pid, "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _container_pid(host_pid):
    with open("/proc/%d/status" % host_pid) as f:
        return [int(p) for p in f.read().split("NSpid:", 1)[1].splitlines()[0].split()][-1]


def _wrapped_holder(lab, minor, loop=None, not_pid=None):
    """(holder, wrapper, loop) host pids while a holder of minor runs behind `sh -c '...; exit $?'` (its parent,
    the wrapper, is `sh`) under the loop `sh` (loop: that one), else None."""
    for holder in lab.truth()[minor]["holders"]:
        try:
            wrapper = _stat(holder)[1]
            wrapper_comm, outer = _stat(wrapper)
            if (holder != not_pid and wrapper_comm == "sh" and "exit $?" in _cmdline(wrapper)
                    and _stat(outer)[0] == "sh" and W1_LOOP in _cmdline(outer) and loop in (None, outer)):
                return holder, wrapper, outer
        except (OSError, ValueError, IndexError):
            continue
    return None


@pytest.mark.timing
def test_a_respawn_behind_a_wrapper_that_exits_with_its_child_fails_the_release(clean):
    """Issue 42, W1, in the container: the holder runs behind `sh -c 'python3 ...; exit $?'` (the `; exit $?` keeps
    that sh its parent: dash execs only the last command of -c), and a loop starts the wrapper again each time it
    exits, as systemd's Restart=always would. The wrapper exits with the killed holder; the loop above it starts a
    new wrapper and a new holder on the same GPU. The release must fail on that respawn, naming the loop, never say
    "verified free" (it did: only the direct parent was watched, and it had exited)."""
    lab = clean
    inner = "python3 %s plain --minors 0 --mib 384 --foreground >/dev/null 2>&1; exit $?" % WORKLOAD
    loop = "while true; do sh -c %s gpuops_w1_wrapper; sleep 0.2; done" % shlex.quote(inner)
    started = lab.exec(101, "sh", "-c", "setsid sh -c %s %s </dev/null >/dev/null 2>&1 &" % (shlex.quote(loop), W1_LOOP))
    assert started.returncode == 0, started.stdout
    found = None
    try:
        found = wait_until(lambda: lab.used(0) == 384 and _wrapped_holder(lab, 0), timeout=30)
        assert found, "no holder behind the wrapper: %s" % lab.truth()[0]
        holder, wrapper, outer = found
        # before the release: the holder's parent is the wrapper sh, alive, whose parent is the loop
        assert _stat(holder)[0] == "python3" and _stat(wrapper)[0] == "sh" and host_alive(wrapper)
        holder_ct, loop_ct = _container_pid(holder), _container_pid(outer)
        play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[0]))
        assert play.failed and play["respawned"] is not None and "respawned" in play["msg"], (
            "msg %r, respawned %r, actions %r, rung_reached %r, elapsed_s %r" % tuple(
                play.get(k) for k in ("msg", "respawned", "actions", "rung_reached", "elapsed_s")))
        respawned = play["respawned"]
        assert (respawned["parent_pid"], respawned["parent_name"]) == (loop_ct, "sh"), respawned
        assert signalled_pids(play) == {holder_ct}, play["actions"]
        assert not host_alive(holder) and not host_alive(wrapper) and host_alive(outer)
        # the truth: a new holder, behind a new wrapper under the same loop, holds GPU 0 again; never signalled
        again = wait_until(lambda: lab.used(0) == 384 and _wrapped_holder(lab, 0, loop=outer, not_pid=holder), timeout=20)
        assert again and respawned["pid"] == _container_pid(again[0]), (respawned, again, lab.truth()[0])
    finally:
        if found:
            os.killpg(found[2], signal.SIGKILL)   # the loop's process group (setsid): the loop, a wrapper, a holder
        else:
            for marker in (W1_LOOP, "gpuops_w1_wrapper", "workload.py plain --minors 0 --mib 384 "):
                lab.exec(101, "pkill", "-9", "-f", marker)


def test_two_containers_sharing_a_gpu_release_only_their_own(clean):
    """ct101 index 4 and ct102 index 0 are both minor 4: each sees only its own holder."""
    lab = clean
    mine = lab.run("plain", 101, [4], mib=512)
    theirs = lab.run("plain", 102, [0], mib=768)
    play = lab.play("ct101", "gpu_release", dict(FAST, gpus=[4]))
    assert play.failed, play
    assert signalled_pids(play) == set(mine["container_holders"])
    assert not host_alive(mine["holders"][0]) and host_alive(theirs["holders"][0])
    assert lab.used(4) == 768
    assert "768 MiB is used by no process visible here; look from the node" in play["msg"]


SUPERVISORCTL = [os.path.join(REPO, ".venv", "bin", "supervisorctl"), "-c", "/run/supervisor/supervisord.conf"]


def node_persistenced(lab, action):
    return lab.labctl("node-exec", "--node", "pve1", "--", *(SUPERVISORCTL + [action, "nvidia-persistenced"]), parse=False)


def test_reset_blockers_are_named_and_stop_services_clears_the_daemon_and_persistence(clean):
    """Issue 21: leaked memory on GPU 3 (minor 3) needs a reset; the node's nvidia-persistenced (under supervisord)
    holds every GPU, a monitor in ct101 holds GPU 3 open, persistence mode is on. The default refuses before
    anything, naming all three; stop_services refuses on the monitor alone (not a service); without the monitor it
    stops the daemon, turns persistence off, resets, and restores both, each step recorded."""
    lab = clean
    uuid = lab.truth()[3]["uuid"]
    lab.run("leaked", 101, [3], mib=1000)
    monitor = lab.run("monitor", 101)
    node_persistenced(lab, "start")
    lab.labctl("fault", "--node", "pve1", "--gpu", "3", "--persistence", "on")
    try:
        args = dict(FAST, gpus=[uuid], containers=[101], gpu_reset=True)
        stop_services = dict(args, advanced=dict(FAST["advanced"], reset_blockers="stop_services"))
        refused = lab.direct("pve1", "gpu_release", args)
        assert refused.failed and refused["actions"] == [] and lab.used(3) == 1000, refused
        assert refused["msg"].startswith("gpu_reset: a reset would be blocked (reset_blockers: refuse), nothing was signalled")
        kinds = sorted(set(b["kind"] for b in refused["reset_blockers"] if b["action"] == "refused"))
        assert kinds == ["daemon", "nvml_client", "persistence_mode"], refused["reset_blockers"]
        daemon = [b for b in refused["reset_blockers"] if b["kind"] == "daemon"][0]
        assert "(nvidia-persistenced), a daemon that serves every GPU of the node" in daemon["what"]
        assert daemon["gpus"] == list(range(8))
        monitor_pid = monitor["roles"]["monitor"]
        node_pid = dict(zip(monitor["host_pids"], monitor["node_pids"]))[monitor_pid]   # the module reads the node
        assert "pid %d (" % node_pid in refused["msg"] and "nvidia-persistenced" in refused["msg"], refused["msg"]
        services = lab.direct("pve1", "gpu_release", stop_services)
        assert services.failed and services["actions"] == [] and services["reset_steps"] == [], services
        assert "not a service and never signalled" in services["msg"] and "nvidia-persistenced" not in services["msg"]
        stop = [b for b in services["reset_blockers"] if b["kind"] == "daemon"][0]
        assert stop["action"].startswith("stop supervisord nvidia-persistenced:nvidia-persistenced")
        os.kill(monitor_pid, signal.SIGKILL)
        assert wait_until(lambda: not host_alive(monitor_pid))
        done = lab.direct("pve1", "gpu_release", stop_services)
        assert not done.failed, done
        assert lab.used(3) == 0 and done["rung_reached"] == "reset"
        assert [(s["step"], s["ok"]) for s in done["reset_steps"]] == [
            ("stop", True), ("persistence_off", True), ("persistence_on", True), ("start", True)], done["reset_steps"]
        assert [a["outcome"][:4] for a in done["actions"] if a["signal"] == "reset"] == ["done"]
        gpu3 = [g for g in lab.labctl("gpus", "--node", "pve1") if g["minor"] == 3][0]
        assert gpu3["persistence_mode"] == 1
        assert "RUNNING" in node_persistenced(lab, "status")
    finally:
        node_persistenced(lab, "stop")
        lab.labctl("fault", "--node", "pve1", "--gpu", "3", "--persistence", "off")


def test_mps_clients_of_a_targeted_gpu_get_terminate_client_then_the_ladder(clean):
    """Issue 21: an MPS control daemon in ct101 with its server (66 MiB on GPU 0) and a client on GPU 0 and one on
    GPU 1 (rows 26-28). Releasing GPU 1: its client gets terminate_client through the daemon, then SIGTERM; GPU 1
    reads free; the server and GPU 0's client stay, the server left out because a client of it stays; the control
    daemon is never signalled."""
    lab = clean
    run = lab.run("mps", 101, [0, 1], mib=700)
    roles, ct = run["roles"], run["container_roles"]
    assert lab.used(0) == 700 + 66 and lab.used(1) == 700
    status = lab.direct("ct101", "gpu_info", {"gpus": [0, 1], "cmdline": False})
    by_pid = dict((h["pid"], h) for h in status["holders"])
    assert by_pid[ct["server"]]["mps_role"] == "server" and by_pid[ct["client1"]]["mps_client_on"] == [1]
    assert [line for line in status["diagnosis"] if line.startswith("MPS: server pid %d (GPU 0 66 MiB)" % ct["server"])]
    play = lab.direct("ct101", "gpu_release", dict(FAST, gpus=[1]))
    assert not play.failed, play
    assert lab.used(1) == 0 and lab.used(0) == 766
    steps = [(a["signal"], a["pid"]) for a in play["actions"]]
    assert steps[:2] == [("terminate_client", ct["client1"]), ("SIGTERM", ct["client1"])], play["actions"]
    assert play["actions"][0]["outcome"] == "done: server %d, control daemon pid %d: 0" % (ct["server"], ct["control"])
    assert [e["signals"] for e in play["plan"]] == [["terminate_client", "SIGTERM", "SIGKILL"]]
    assert all(host_alive(roles[r]) for r in ("control", "server", "client0")) and not host_alive(roles["client1"])
    log = lab.exec(101, "cat", run["mps_pipe"] + "/control.log").stdout.split("\n")
    assert "Cmd:terminate_client %d %d" % (ct["server"], ct["client1"]) in log and "Cmd:quit" not in log
