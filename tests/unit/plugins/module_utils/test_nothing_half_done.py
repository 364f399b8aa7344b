"""Issue 40: nothing half-done, empty is unknown.

Unit-fake worlds (ProcTree, FakeNvml; stops, starts and resets recorded, not run) of what a review found:
P1 (a scoped container with no GPU rows was "free"), B1 (the hard stop landing while the node's daemons are stopped
or persistence is off left them so), B2 (daemons stopped for a reset that the plan already knew was blocked), C4 (the
hard stop between a container's stop and its start left it stopped), and the container rung on a holder stuck in the
driver.
"""
import signal

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _ladder as ladder
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._release import ReleaseTimeout

from conftest import CTL, UVM, ctx
from fake_nvml import FakeNvml
from release_opts import release, release_opts

OPTS = dict(term_timeout=0.3, kill_timeout=0.3, verify_timeout=0.3)
CT101 = "0::/lxc/101/ns\n"


def conf(minors, deny_write=()):
    """A parsed and resolved container config passing minors in (deny_write: those passed in read-only)."""
    text = "\n".join("dev%d: /dev/nvidia%d%s" % (i, m, ",deny-write" if m in deny_write else "")
                     for i, m in enumerate(minors))
    return node.parse_pve_conf(text + "\n")


def node_engine(proc, gpus, monkeypatch, confs):
    """An Engine that reads proc as a Proxmox node's /proc, with these container configs."""
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: confs)
    engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    return engine


# ---- P1: empty is unknown, never free

def test_a_scoped_container_with_no_gpu_rows_is_unknown_never_free(proc, monkeypatch, tmp_path):
    """Container 101's config passes GPU 0 in read-only (deny-write), so no GPU of it can be described; GPU 0 holds
    4 GiB that nothing visible holds. Its entry was "free" (all([]) of no rows) while the task failed."""
    engine = node_engine(proc, [{"minor": 0, "used_mib": 4096}], monkeypatch, {"101": conf([0], deny_write=[0])})
    failed, msg, result = release(engine, [0], dict(OPTS, scope=node.Scope([101], proc_root=proc.root)),
                                  lock_dir=str(tmp_path))
    entry = result["per_container"][0]
    assert failed and entry["vmid"] == 101 and entry["verdict"] == "unknown", entry
    assert entry["gpus"] == [] and "no GPU of container 101" in entry["reason"], entry
    assert "deny-write" in entry["reason"] and "container 101" in msg, (entry, msg)


def test_a_container_with_no_gpu_rows_is_unknown_when_the_gpu_is_idle_too(proc, monkeypatch, tmp_path):
    engine = node_engine(proc, [{"minor": 0, "used_mib": 0}], monkeypatch, {"101": conf([0], deny_write=[0])})
    failed, msg, result = release(engine, [0], dict(OPTS, scope=node.Scope([101], proc_root=proc.root)),
                                  lock_dir=str(tmp_path))
    assert failed and [e["verdict"] for e in result["per_container"]] == ["unknown"], (msg, result["per_container"])
    assert "every targeted GPU is already free" in msg and "unknown" in msg


# ---- B1, B2: the reset's stops, each paired with its restore

SERVICE = {"pid": 40, "kind": "systemd", "name": "nvidia-persistenced.service",
           "stop": ["systemctl", "stop", "nvidia-persistenced.service"],
           "start": ["systemctl", "start", "nvidia-persistenced.service"]}


class Node(object):
    """run_on_node as the node's service manager and nvidia-smi would answer, recorded; `alarm_on` sends the hard
    stop (the module's own SIGALRM handler) to this process while that step runs; `failing`: steps that fail."""

    def __init__(self, monkeypatch, alarm_on=None, failing=()):
        from ansible_collections.gpuops.fleet.plugins.modules import gpu_release
        self.calls, self.alarm_on, self.failing = [], alarm_on, failing
        self.previous = signal.signal(signal.SIGALRM, gpu_release._backstop)
        monkeypatch.setattr(units, "run_on_node", self.run)

    @staticmethod
    def step(argv):
        return {"stop": "stop", "start": "start", "0": "pm0", "1": "pm1"}.get(argv[-1] if argv[-2] == "-pm" else argv[1])

    def run(self, argv, timeout, done="done"):
        step = self.step(argv)
        self.calls.append((step, timeout))
        if step == self.alarm_on:
            signal.pthread_kill(__import__("threading").main_thread().ident, signal.SIGALRM)
            for dummy in range(1000):     # the handler runs between two bytecodes of this thread
                pass
        return {"ok": step not in self.failing, "text": "failed" if step in self.failing else done}

    def close(self):
        signal.signal(signal.SIGALRM, self.previous)


@pytest.fixture
def smi(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\necho GPU reset\n")
    path.chmod(0o755)
    return str(path)


def leaked(proc, monkeypatch, extra=None):
    """A node whose GPU 0 holds 4 GiB that no process holds (a reset's case), GPU 1 idle."""
    if extra:
        extra(proc)
    return node_engine(proc, [{"minor": 0, "used_mib": 4096, "procs": []}, {"minor": 1, "used_mib": 0}],
                       monkeypatch, {"101": conf([0, 1])})


def resetting(engine, smi, deadline=None):
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser
    releaser = Releaser(engine, [0], release_opts(gpu_reset=True, reset_blockers="stop_services", nvidia_smi=smi,
                                                  scope=node.Scope([101], proc_root=engine.proc_root)), deadline=deadline)
    releaser.reset_services, releaser.reset_persistence = [dict(SERVICE)], [0]
    return releaser


def steps(releaser):
    return [(s["step"], s["ok"]) for s in releaser.reset_steps]


RESTORED = [("persistence_on", True), ("start", True)]


@pytest.mark.parametrize("alarm_on, done", [("stop", [("stop", True), ("start", True)]),
                                            ("pm0", [("stop", True), ("persistence_off", True)] + RESTORED)])
def test_the_hard_stop_during_the_stops_still_restores_them(proc, monkeypatch, smi, alarm_on, done):
    """B1: the module's hard stop lands while the daemon stops, or while persistence goes off: that step, bounded,
    ends; nothing more is changed; what was changed is restored; then the hard stop ends the release."""
    releaser, fake = resetting(leaked(proc, monkeypatch), smi), Node(monkeypatch, alarm_on=alarm_on)
    try:
        with pytest.raises(ReleaseTimeout, match="landed while a stop was made: restored first"):
            releaser._reset()
    finally:
        fake.close()
    assert steps(releaser) == done and releaser.left_changed == [] and releaser.undo == []
    assert [a["signal"] for a in releaser.actions] == []      # the reset itself never ran


def test_the_hard_stop_during_the_restore_is_held_off_until_it_ends(proc, monkeypatch, smi):
    """B1: the hard stop lands while persistence mode is being restored: the daemon is still started again, then
    the hard stop ends the run."""
    releaser, fake = resetting(leaked(proc, monkeypatch), smi), Node(monkeypatch, alarm_on="pm1")
    try:
        with pytest.raises(ReleaseTimeout, match="held off until a restore had ended"):
            releaser._reset()
    finally:
        fake.close()
    assert steps(releaser) == [("stop", True), ("persistence_off", True)] + RESTORED
    assert [a["outcome"][:4] for a in releaser.actions] == ["done"] and releaser.left_changed == []


def test_a_restore_that_fails_is_left_changed_and_fails_the_task(proc, monkeypatch, smi):
    releaser, fake = resetting(leaked(proc, monkeypatch), smi), Node(monkeypatch, failing=("start",))
    try:
        releaser._reset()
    finally:
        fake.close()
    assert releaser.left_changed == [{"kind": "service", "what": "systemd nvidia-persistenced.service",
                                      "state": "stopped", "why": "failed"}]
    assert "left changed, its restore failed: systemd nvidia-persistenced.service stopped" in releaser.failure


def test_the_restores_time_is_reserved_before_any_stop(proc, monkeypatch, smi):
    """2 restore steps of 20 s each are kept back: with 30 s left nothing is stopped; with 60 s left the stop and
    the reset are bounded by what is left before the reserve, and each restore by its own bound."""
    import time
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import RESTORE_STEP_S
    releaser, fake = resetting(leaked(proc, monkeypatch), smi, deadline=time.monotonic() + 30), Node(monkeypatch)
    try:
        releaser._reset()
        assert fake.calls == [] and releaser.reset_steps == []
        assert releaser.actions[0]["outcome"].startswith("refused: not enough time left to stop the node's daemons")
        releaser = resetting(leaked(proc, monkeypatch), smi, deadline=time.monotonic() + 60)
        releaser._reset()
    finally:
        fake.close()
    bounds = dict(fake.calls)
    assert bounds["stop"] <= 60 - 2 * RESTORE_STEP_S and bounds["pm0"] <= 60 - 2 * RESTORE_STEP_S
    assert bounds["pm1"] == RESTORE_STEP_S and bounds["start"] == RESTORE_STEP_S


def test_a_reset_the_plan_knows_is_blocked_stops_nothing(proc, monkeypatch, smi):
    """B2: GPU 0's holder is in D state in the driver: the reset is refused before the daemon is stopped or
    persistence turned off (it used to stop both, then refuse)."""
    def stuck(p):
        p.add(50, comm="python3", state="D", maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0"], cgroup="0::/user.slice\n",
              tasks={50: {"state": "D", "wchan": "uvm_va_space_destroy"}})
    engine = node_engine(proc, [{"minor": 0, "used_mib": 4096, "procs": [(50, 4096)]}, {"minor": 1, "used_mib": 0}],
                         monkeypatch, {"101": conf([0, 1])})
    stuck(proc)
    releaser, fake = resetting(engine, smi), Node(monkeypatch)
    try:
        releaser._reset()
    finally:
        fake.close()
    assert fake.calls == [] and releaser.reset_steps == []
    outcome = [a["outcome"] for a in releaser.actions if a["signal"] == "reset"]
    assert len(outcome) == 1 and "pid 50 (python3, D state in uvm_va_space_destroy)" in outcome[0], outcome
    assert outcome[0].endswith("nothing was stopped for it")


def test_backstop_runs_a_restore_still_registered(proc, monkeypatch):
    """The hard stop can land between a restore's registration and the try that runs it: the module's backstop
    (backstop_result) runs it, and names what could not be put back."""
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser, backstop_result
    releaser = Releaser(leaked(proc, monkeypatch), [0], release_opts())
    ran = []
    releaser._undo("service", "systemd a.service", "stopped", lambda: ran.append("a") or (True, "done"))
    releaser._undo("container", "container 101", "stopped", lambda: ran.append("101") or (False, "exit 1: no"))
    kept = backstop_result({"releaser": releaser})
    assert ran == ["101", "a"] and kept["left_changed"] == [
        {"kind": "container", "what": "container 101", "state": "stopped", "why": "exit 1: no"}]
    assert backstop_result({"releaser": releaser})["left_changed"] == kept["left_changed"] and ran == ["101", "a"]


# ---- C4 and the driver: the container rung

class Backend(object):
    """A restart backend that records what it is asked; alarm: send the hard stop while the stop runs."""
    name = "cli"

    def __init__(self, alarm=False, start_ok=True, stop=None, states=None):
        from ansible_collections.gpuops.fleet.plugins.modules import gpu_release
        self.calls, self.alarm, self.start_ok, self.stop_result = [], alarm, start_ok, stop
        self.handler = gpu_release._backstop
        if states is not None:      # what `pct status` answers, one a call (the last one from then on)
            self.states = list(states)
            self.running = self._running

    def _running(self, vmid, timeout):
        self.calls.append(("status", vmid, self.states[0]))
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def lock_of(self, vmid):
        return None

    def ha_state(self, vmid):
        return None

    def stop(self, vmid, timeout):
        self.calls.append(("stop", vmid, timeout))
        if self.alarm:
            self.handler(signal.SIGALRM, None)
        return self.stop_result or {"task": "pct stop %s" % vmid, "ok": True, "seconds": 0.1, "text": ""}

    def start(self, vmid, timeout):
        self.calls.append(("start", vmid, timeout))
        return {"task": "pct start %s" % vmid, "ok": self.start_ok, "seconds": 0.1,
                "text": "" if self.start_ok else "exit 255: startup for container '101' failed"}


def held_in_101(proc, monkeypatch, thread=None):
    """Container 101's holder of GPU 0 (in D state in `thread`'s wchan when given)."""
    state = "D" if thread else "S"
    proc.add(60, comm="python3", state=state, maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0"], cgroup=CT101,
             nspid=[60, 7], tasks={60: dict(state=state, **({"wchan": thread} if thread else {}))})
    return node_engine(proc, [{"minor": 0, "used_mib": 4096, "procs": [(60, 4096)]}], monkeypatch,
                       {"101": conf([0])})


def restarting(engine, backend, deadline=None):
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser
    releaser = Releaser(engine, [0], release_opts(container_restart=True, restart_backend=backend,
                                                  container_timeout=30.0,
                                                  scope=node.Scope([101], proc_root=engine.proc_root)), deadline=deadline)
    releaser.restart_plan = [{"vmid": 101, "refusal": None}]
    return releaser


def test_the_hard_stop_between_a_containers_stop_and_its_start_still_starts_it(proc, monkeypatch):
    """C4: the hard stop lands while container 101 stops: it is started again before the release ends."""
    backend = Backend(alarm=True)
    releaser = restarting(held_in_101(proc, monkeypatch), backend)
    with pytest.raises(ReleaseTimeout):
        releaser._restart_containers("SIGKILL left the targeted memory held")
    assert [c[:2] for c in backend.calls] == [("stop", 101), ("start", 101)] and releaser.left_changed == []


def test_a_container_that_does_not_start_again_is_left_changed(proc, monkeypatch):
    backend = Backend(start_ok=False)
    releaser = restarting(held_in_101(proc, monkeypatch), backend)
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert [e["what"] for e in releaser.left_changed] == ["container 101"]
    assert "container 101 was stopped (freeing its GPUs) but did not start again" in releaser.failure


def test_a_containers_stop_and_start_keep_within_the_time_left(proc, monkeypatch):
    """The stop is bounded by what is left before its start's reserve (container_timeout), the start by its own
    bound; with less left than that reserve, nothing is stopped."""
    import time
    backend, engine = Backend(), held_in_101(proc, monkeypatch)
    restarting(engine, backend, deadline=time.monotonic() + 40)._restart_containers("x")
    (dummy, dummy2, stop_bound), (dummy3, dummy4, start_bound) = backend.calls
    assert stop_bound <= 10 and start_bound == 30
    backend = Backend()
    releaser = restarting(engine, backend, deadline=time.monotonic() + 20)
    releaser._restart_containers("x")
    assert backend.calls == [] and "not enough time left to stop container 101" in releaser.failure


def test_a_holder_stuck_in_the_driver_refuses_the_container_rung(proc, monkeypatch):
    """A targeted holder in D state in the driver: a container stop cannot end it and can hang; refused before the
    stop, naming the remedy."""
    backend = Backend()
    releaser = restarting(held_in_101(proc, monkeypatch, thread="nvidia_dev_ioctl"), backend)
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert backend.calls == [] and releaser.restarted == []
    assert "D state in the driver (wchan nvidia_dev_ioctl)" in releaser.failure
    assert "GPU reset (gpu_reset: true) or a node reboot" in releaser.failure


# ---- the hard stop at every line of the container rung: never a stop left unrestored (red team of issue 40)

RUNG_CODE = ("_restart_containers", "_restart_one", "_restart_refusal", "_no_time_for", "_start_container", "_settled",
             "_running", "restore_all", "held_off", "check", "_undo", "failure_of_restores", "_record_container")


class StoppedAt(object):
    """A tracer that sends the module's hard stop (SIGALRM, its real handler) at the k-th line run in RUNG_CODE."""

    def __init__(self, k):
        self.k, self.seen = k, 0

    def __call__(self, frame, event, arg):
        return self.line if frame.f_code.co_name in RUNG_CODE else None

    def line(self, frame, event, arg):
        if event == "line":
            self.seen += 1
            if self.seen == self.k:
                signal.raise_signal(signal.SIGALRM)
        return self.line


def rung_run(proc, monkeypatch, tmp_path, k):
    """release() of container 101's holder up the container rung (no real signal), the hard stop at line k."""
    import sys
    from ansible_collections.gpuops.fleet.plugins.module_utils import _release
    from ansible_collections.gpuops.fleet.plugins.modules import gpu_release
    monkeypatch.setattr(ladder, "send_guarded", lambda *a, **k: "not sent: a unit test")
    backend = Backend()
    options = dict(term_timeout=0.0, kill_timeout=0.0, verify_timeout=0.0, container_restart=True,
                   restart_backend=backend, container_timeout=30.0, scope=node.Scope([101], proc_root=proc.root))
    tracer, previous = StoppedAt(k), signal.signal(signal.SIGALRM, gpu_release._backstop)
    sys.settrace(tracer)
    try:
        outcome = release(ENGINES[0], [0], options,
                          lock_dir=str(tmp_path / ("locks%d" % k)), progress={})
    except ReleaseTimeout:
        outcome = None
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGALRM, previous)
    return backend.calls, tracer.seen, outcome


ENGINES = []


def test_the_hard_stop_at_any_line_of_the_container_rung_never_leaves_it_stopped(proc, monkeypatch, tmp_path):
    """Every window, one run each: wherever the hard stop lands, a container that was stopped is started again
    before the release ends (or it says, in left_changed and its message, that it was not)."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _hardstop as hardstop
    engine = held_in_101(proc, monkeypatch)
    ENGINES[:] = [engine]
    calls, total, dummy = rung_run(proc, monkeypatch, tmp_path, 0)      # no hard stop: how many lines run
    assert [c[:2] for c in calls] == [("stop", 101), ("start", 101)] and total > 20
    for k in range(1, total + 1):
        calls, dummy, outcome = rung_run(proc, monkeypatch, tmp_path, k)
        kinds = [c[0] for c in calls]
        assert kinds in ([], ["stop", "start"]), (k, calls, outcome)
        assert hardstop._STATE.held == 0 and hardstop._STATE.pending is False, k


def test_a_container_found_stopped_is_neither_stopped_nor_started(proc, monkeypatch):
    """Red team F3: 101 was stopped by someone else since the plan: the restore must not start what it never
    stopped."""
    backend = Backend(states=[False])
    releaser = restarting(held_in_101(proc, monkeypatch), backend)
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert [c[0] for c in backend.calls] == ["status"] and "container 101 is not running" in releaser.failure


def test_a_stop_that_timed_out_is_let_settle_before_the_start(proc, monkeypatch):
    """Red team F2: `pct stop` did not return in time and its stop goes on: the container, still running at the
    restore, stops a moment later; the restore waits for its state to settle, then starts it."""
    stop = {"task": "pct stop 101", "ok": False, "seconds": 28.0, "text": "did not return within 28s"}
    backend = Backend(stop=stop, states=[True, True, False, False])
    releaser = restarting(held_in_101(proc, monkeypatch), backend)
    releaser._restart_containers("SIGKILL left the targeted memory held")
    assert [c[0] for c in backend.calls] == ["status", "stop", "status", "status", "status", "start"], backend.calls
    assert releaser.left_changed == [] and releaser.failure == "container 101 did not stop: did not return within 28s"


def test_found_units_stopped_before_the_deadline_are_recorded(proc, monkeypatch):
    """Red team F4: the first unit's stop uses up the time left: it is recorded (done, changed), the second is not
    tried, and the release then ends on the timeout."""
    import time
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser

    def slow_stop(entry, timeout):
        releaser.deadline = time.monotonic() - 0.01     # this stop took the time that was left (no sleep: no race)
        return {"ok": True, "text": "stopped"}
    monkeypatch.setattr(units, "stop", slow_stop)
    releaser = Releaser(held_in_101(proc, monkeypatch), [0], release_opts(stop_found_units=True,
                                                                          scope=node.Scope([101], proc_root=proc.root)), deadline=time.monotonic() + 60)
    found = [{"vmid": 101, "kind": "systemd", "name": n, "pids": [60]} for n in ("a.service", "b.service")]
    releaser.found_units = [dict(u) for u in found]
    with pytest.raises(ReleaseTimeout, match="during the stop of systemd b.service in container 101"):
        releaser.stop_units(found)
    assert [(a["name"], a["outcome"]) for a in releaser.actions] == [
        ("unit a.service", "done: stopped"), ("unit b.service", "failed: not tried: the overall timeout was reached")]
    assert releaser.changed is True


def test_a_container_not_given_the_targeted_gpu_is_not_passed_in_and_a_vmid_with_no_config_unknown(
        proc, monkeypatch, tmp_path):
    """Red team F5: gpus [0] for containers 101 and 102, 102's config passes only GPU 1 in: that is evidence that
    nothing of 102 is on GPU 0 (verdict "not passed in", no failure); a vmid with no config stays unknown."""
    engine = node_engine(proc, [{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0}], monkeypatch,
                         {"101": conf([0]), "102": conf([1])})
    failed, msg, result = release(engine, [0], dict(OPTS, scope=node.Scope([101, 102], proc_root=proc.root)),
                                  lock_dir=str(tmp_path))
    assert not failed and [(e["vmid"], e["verdict"]) for e in result["per_container"]] == [
        (101, "free"), (102, "not passed in")], msg
    assert result["per_container"][1]["reason"].startswith("its config passes none of the targeted GPUs (0) in")
    failed, msg, result = release(engine, [0], dict(OPTS, scope=node.Scope([101, 199], proc_root=proc.root)),
                                  lock_dir=str(tmp_path))
    assert failed and [(e["vmid"], e["verdict"]) for e in result["per_container"]] == [(101, "free"), (199, "unknown")]
    assert "container 199 has no config on this node" in msg
