# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The rungs past the signals (private helper): unit stops, MPS terminate_client, the container restart, the reset.

Each rung is a small class given the release's Clock (its deadline, and the time kept back for the restores), its
Recorder (the actions, the reset steps, the log) and, where it stops something, its Restores: every stop is paired
with its restore, registered before the stop runs. The rungs ask evidence (_where) and never read /proc themselves.
No AnsibleModule here.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _blockers as blockers
from ansible_collections.gpuops.fleet.plugins.module_utils import _hardstop as hardstop
from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _restart as restart
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils import _verdict as verdict_mod
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where
from ansible_collections.gpuops.fleet.plugins.module_utils._access import read_drm_refcount
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import generic_unit, reset_refusal
from ansible_collections.gpuops.fleet.plugins.module_utils._hardstop import ReleaseTimeout

UNIT_WORDS = units.KIND_WORDS
RESTORE_STEP_S = 20.0    # the bound of one restore step (a daemon started, persistence mode back on); reserved
MIN_ACT_S = 2.0          # the least time a stop needs beside its reserved restore, or it is not started
SETTLE_S = 5.0           # after a container stop that did not end well: how long its state may take to settle
SETTLE_POLL_S = 0.5
NVIDIA_SMI_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def find_nvidia_smi(path_env=None):
    dirs = [d for d in (path_env if path_env is not None else os.environ.get("PATH", "")).split(os.pathsep) if d]
    for folder in dirs + list(NVIDIA_SMI_DIRS):
        candidate = os.path.join(folder, "nvidia-smi")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


class Clock(object):
    """The release's deadline (a time.monotonic() value, or None) and the time reserved for the restores."""

    def __init__(self, deadline=None):
        self.deadline = deadline
        self.reserved_s = 0.0

    @staticmethod
    def now():
        return time.monotonic()

    def left(self):
        if self.deadline is None:
            return None
        return self.deadline - self.now()

    def check(self, during):
        left = self.left()
        if left is not None and left <= 0:
            raise ReleaseTimeout("the overall timeout was reached during %s" % during)

    def until(self, seconds):
        end = self.now() + seconds
        if self.deadline is not None:
            end = min(end, self.deadline)
        return end

    def act_bound(self, bound):
        """bound, cut to the time left before the restores' reserve (1 s at the least)."""
        left = self.left()
        if left is None:
            return bound
        return max(1.0, min(bound, left - self.reserved_s))

    def no_time_for(self, reserve_s, what):
        """A refusal when the time left cannot cover reserve_s (a restore's bound) plus MIN_ACT_S to act; else None."""
        left = self.left()
        if left is None or left >= reserve_s + MIN_ACT_S:
            return None
        return verdict_mod.no_time_words(left, reserve_s, what)


class Recorder(object):
    """What the release did, in order: the actions (signals, stops, restarts, resets) and the reset steps."""

    def __init__(self, log=None, started=None):
        self.log = log or (lambda msg: None)
        self.started = time.monotonic() if started is None else started
        self.actions = []
        self.reset_steps = []

    def signal(self, record, signame, outcome):
        action = {"time": round(time.time(), 3), "elapsed_s": round(time.monotonic() - self.started, 3),
                  "pid": record["pid"], "name": record["name"], "signal": signame, "outcome": outcome}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: %s to pid %d (%s): %s" % (signame, record["pid"], record["name"], outcome))

    def container(self, vmid, what, result):
        action = {"time": round(time.time(), 3), "elapsed_s": round(time.monotonic() - self.started, 3), "pid": 0,
                  "name": "container %s" % vmid, "vmid": vmid, "signal": what, "task": result["task"],
                  "seconds": result["seconds"],
                  "outcome": ("done: %s" % result["text"]) if result["ok"] else ("failed: %s" % result["text"])}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: %s of container %s: %s" % (what, vmid, action["outcome"]))

    def stop(self, entry, outcome, when):
        action = {"time": round(time.time() - (time.monotonic() - when), 3), "elapsed_s": round(when - self.started, 3),
                  "pid": 0, "name": "%s %s" % (UNIT_WORDS.get(entry["kind"], entry["kind"]), entry["name"]),
                  "vmid": entry["vmid"], "signal": "stop", "outcome": outcome}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: stop of %s in container %s: %s" % (action["name"], entry["vmid"], outcome))

    def step(self, step, target, outcome):
        self.reset_steps.append({"step": step, "target": target, "ok": outcome["ok"], "outcome": outcome["text"]})
        self.log("gpuops.fleet.gpu_release: %s %s: %s" % (step, target, outcome["text"]))
        return outcome["ok"]


class Restores(object):
    """Every stop paired with its restore: registered before the stop runs, run once, newest first."""

    def __init__(self, clock):
        self.clock = clock
        self.undo = []           # the restores of the stops made, newest last
        self.left_changed = []   # what a restore could not put back: {kind, what, state, why}

    def register(self, kind, what, state, restore):
        """Register the restore of a stop before the stop runs (an interrupted stop is restored too)."""
        self.undo.append({"kind": kind, "what": what, "state": state, "restore": restore})

    def run_all(self):
        """Run every registered restore, newest first, each within its own bound, with the hard stop held off;
        what cannot be restored goes to left_changed. The time reserved for the restores is free again after."""
        with hardstop.held_off():
            while self.undo:
                entry = self.undo.pop()
                try:
                    ok, text = entry["restore"]()
                except Exception as exc:  # pylint: disable=broad-except
                    ok, text = False, "%s: %s" % (type(exc).__name__, exc)
                if not ok:
                    self.left_changed.append({"kind": entry["kind"], "what": entry["what"], "state": entry["state"],
                                              "why": text})
            self.clock.reserved_s = 0.0

    def failure(self):
        """The task's failure when a restore did not complete, naming what is left changed; else None."""
        return verdict_mod.left_changed_words(self.left_changed) or None


class UnitStops(object):
    """Stop found units through each container's own manager, `concurrency` containers at once."""

    def __init__(self, clock, recorder, timeout, concurrency):
        self.clock, self.recorder = clock, recorder
        self.timeout, self.concurrency = timeout, concurrency

    def run(self, found, found_units, stop_sets):
        """Each container's units one after another; each stop is bounded; the hard stop is held off until every
        outcome is recorded, in the order of found; a stop not tried for lack of time ends the release after that."""
        per_container = {}
        for entry in found:
            per_container.setdefault(entry["vmid"], []).append(entry)
        workers = max(1, min(self.concurrency, len(per_container)))
        with hardstop.held_off():
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                outcomes = [done for batch in pool.map(self._each, list(per_container.values())) for done in batch]
            self._record(outcomes, found_units, stop_sets)
        late = [entry for entry, done, dummy in outcomes if done.get("late")]
        if late:
            raise ReleaseTimeout("the overall timeout was reached during the stop of %s %s in container %s"
                                 % (late[0]["kind"], late[0]["name"], late[0]["vmid"]))

    def _each(self, entries):
        """One container's units, one after another: [(entry, outcome, when)]; none is started once time is up."""
        out = []
        for entry in entries:
            left = self.clock.left()
            if left is not None and left <= 0:
                out.append((entry, {"ok": False, "late": True, "text": "not tried: the overall timeout was reached"},
                            self.clock.now()))
                continue
            out.append((entry, units.stop(entry, self.clock.act_bound(self.timeout)), self.clock.now()))
        return out

    def _record(self, outcomes, found_units, stop_sets):
        by_key = dict(((u["vmid"], u["kind"], u["name"]), u) for u in found_units)
        sets = dict(((u["vmid"], u["kind"], u["name"]), u) for u in stop_sets)
        for entry, done, when in sorted(outcomes, key=lambda o: o[2]):
            outcome = ("done: %s" % done["text"]) if done["ok"] else ("failed: %s" % done["text"])
            key = (entry["vmid"], entry["kind"], entry["name"])
            by_key[key]["outcome"] = outcome
            if key in sets:
                sets[key]["outcome"] = outcome
            self.recorder.stop(entry, outcome, when)


def terminate_client(control, server, client, deadline=None):
    """(ok, text) of `terminate_client SERVER CLIENT` asked of control's MPS daemon, bounded by the time left."""
    command = "terminate_client %d %d" % (server, client)
    prepared, why = mps.prepared(control, command, deadline=deadline)
    if prepared is None:
        return False, why
    argv, env, bound = prepared
    state, text = mps.answer(control, command, bound, lambda: helperproc.run_bounded(argv, bound, env=env))
    return state == "ok", text or "no output"


class MpsClients(object):
    """terminate_client for each MPS client about to be signalled: its GPU work ends safely; the ladder then ends
    the process (terminate_client frees nothing, GPU_FACTS row 28)."""

    def __init__(self, clock, recorder):
        self.clock, self.recorder = clock, recorder

    def run(self, report, clients):
        """Through the control daemon that lists each client in report's evidence (pids as that daemon sees them),
        each ask bounded by the time left."""
        evidence = getattr(report, "mps_servers", None) or {}
        served = {}   # client pid -> (its server's evidence, the client's pid as its daemon sees it)
        for entry in evidence.values():
            for pid, seen in entry["clients_as"].items():
                served[pid] = (entry, seen)
        for record in clients:
            if record["pid"] not in served:
                self.recorder.signal(record, "terminate_client", "skipped: no MPS control daemon lists it as a client "
                                     "(%s); the ladder alone follows" % ("; ".join(sorted(set(
                                         e["why"] for e in evidence.values() if e["why"]))) or "none asked"))
                continue
            entry, client = served[record["pid"]]
            control, server = entry["control"], entry["server_as"]
            ok, text = terminate_client(control, server, client, deadline=self.clock.deadline)
            self.recorder.signal(record, "terminate_client", "%s: server %d, control daemon pid %d%s: %s"
                                 % ("done" if ok else "failed", server, control["pid"],
                                    "" if control["vmid"] is None else " (in container %s, pids as seen there)"
                                    % control["vmid"], text))


class ContainerRestart(object):
    """The container rung (node side): stop a container, then always start it again (one section the hard stop
    never cuts). backend: _restart's PctBackend or ApiBackend."""

    def __init__(self, clock, recorder, restores, backend, timeout, proc_root="/proc"):
        self.clock, self.recorder, self.restores = clock, recorder, restores
        self.backend, self.timeout, self.proc_root = backend, timeout, proc_root
        self.restarted = []

    def refusal(self, report, why, vmid, decide_again):
        """Why container vmid is not stopped, decided before anything changes: locked or HA-managed (read again
        right before the stop: a backup may have started since the plan), decided again as a stop set
        (decide_again(report, vmid, processes), the ladder's), a holder stuck in the driver, too little time left
        for its stop and its start. None: go on."""
        refusal = restart.refusal(self.backend, vmid)
        if refusal:
            return "%s; %s" % (why, refusal)
        processes = where.processes_by_container(self.proc_root, getattr(report, "scan", None)).get(str(vmid), [])
        verdict = decide_again(report, str(vmid), processes)
        if verdict["verdict"] != "stop":
            return "%s; decided again right before the stop: %s" % (
                why, verdict_mod.restart_words(vmid, verdict, len(processes)))
        stuck = verdict_mod.stuck_refusal(report, vmid)
        if stuck:
            return stuck
        return self.clock.no_time_for(self.timeout, "stop container %s and start it again" % vmid)

    def restart(self, report, vmid):
        """Stop container vmid, then start it again; returns the failure text or None. A container that is not
        running is neither stopped nor started."""
        if self.running(vmid) is False:
            return ("container %s is not running (stopped since the plan): it was neither stopped nor started; start it "
                    "and release again" % vmid)
        self.clock.reserved_s = self.timeout
        stop = {"ok": None}
        with hardstop.held_off():
            self.restores.register("container", "container %s" % vmid, "stopped", lambda: self.start(vmid, stop["ok"]))
            try:
                stopped = self.backend.stop(vmid, self.clock.act_bound(self.timeout))
                stop["ok"] = stopped["ok"]
                self.recorder.container(vmid, "container_stop", stopped)
            finally:
                self.restores.run_all()
        if stopped["ok"]:
            self.restarted.append(vmid)
            return self.restores.failure()
        return verdict_mod.not_stopped_words(report, vmid, stopped["text"])

    def running(self, vmid):
        """Whether the backend says vmid runs (True, False), or None when it cannot tell."""
        running = getattr(self.backend, "running", None)
        return None if running is None else running(vmid, RESTORE_STEP_S)

    def start(self, vmid, stop_ok):
        """The container rung's restore: start vmid again; (ok, text), ok when it runs. After a stop that did not
        end well (failed, timed out, cut short), the container's state is let settle first (SETTLE_S): a stop still
        under way would stop it after a start that found it running."""
        if stop_ok is not True:
            state = self.settled(vmid)
            if state is True:
                return True, "not started: it is running (its stop did not end it)"
        started = self.backend.start(vmid, self.timeout)
        self.recorder.container(vmid, "container_start", started)
        if started["ok"]:
            return True, started["text"]
        if self.running(vmid) is True:
            return True, "it is running (%s)" % started["text"]
        return False, started["text"]

    def settled(self, vmid):
        """vmid's running state once two reads SETTLE_POLL_S apart agree (at most SETTLE_S); None: cannot tell."""
        end, last = self.clock.now() + SETTLE_S, self.running(vmid)
        while last is not None and self.clock.now() < end:
            time.sleep(SETTLE_POLL_S)
            now = self.running(vmid)
            if now == last:
                return now
            last = now
        return last


def reset_plan(engine, report, targets, mode):
    """What would block a reset of targets on a node: {"blockers" (blockers.plan's), "refusals" (they stop the
    release before anything is signalled), "services" (the daemons' services to stop and start again, with
    reset_blockers: stop_services), "persistence" (the indexes whose persistence mode is turned off for it)}."""
    readings = {"persistence": {}, "mig": {}, "services": {}, "drm_refcount": read_drm_refcount()}
    for index in targets:
        readings["persistence"][index] = engine.nvml.mode(index, "nvmlDeviceGetPersistenceMode")
        readings["mig"][index] = engine.nvml.mode(index, "nvmlDeviceGetMigMode")
    for record in list(report.holders) + list(report.clients) + list(report.protected_holders):
        if record.get("protected_name") in blockers.DAEMONS:
            service = stopsets.node_service(record, engine.proc_root)
            generic = generic_unit(service["name"]) if service and service["kind"] == "systemd" else None
            readings["services"][record["pid"]] = dict(service, refused=generic) if generic else service
    found, refusals = blockers.plan(report, targets, readings, mode, engine.gpus)
    plan = {"blockers": found, "refusals": refusals, "services": [], "persistence": []}
    if mode == "stop_services":
        seen = set()
        for pid, service in sorted(readings["services"].items()):
            if service is not None and service["name"] not in seen:
                seen.add(service["name"])
                plan["services"].append(dict(service, pid=pid))
        plan["persistence"] = sorted(i for i, on in readings["persistence"].items() if on)
    return plan


class GpuReset(object):
    """nvidia-smi --gpu-reset for each targeted GPU still used; refused while anything holds it. With
    reset_blockers: stop_services, the daemons' services are stopped first and persistence mode is turned off,
    each stop paired with its restore, and only for GPUs that nothing else blocks."""

    def __init__(self, clock, recorder, restores, engine, smi, timeouts):
        self.clock, self.recorder, self.restores = clock, recorder, restores
        self.engine, self.smi = engine, smi
        self.reset_timeout, self.stop_timeout = timeouts
        self.done = False

    def run(self, snapshot, resync, services, persistence):
        """snapshot(): a fresh read of the targets; resync(): find them again after NVML was opened again. Returns
        the failure of a restore, or None."""
        self.resync = resync
        report = snapshot()
        busy = [g for g in report.gpus if not g["free"] and not g.get("error")]
        if not busy:
            return None
        if not (services or persistence):
            self.each(report, busy)
            return None
        resettable = self.resettable(report, busy, services)
        turn_off = [g for g in resettable if g["index"] in persistence]
        reserve = RESTORE_STEP_S * (len(services) + len(turn_off))
        refusal = resettable and self.clock.no_time_for(reserve, "stop the node's daemons for the reset")
        for gpu in resettable if refusal else ():
            self.recorder.signal({"pid": 0, "name": "GPU %d" % gpu["index"]}, "reset", "refused: %s" % refusal)
        if not resettable or refusal:
            return None
        self.clock.reserved_s = reserve
        with hardstop.held_off():     # the stops, the reset and the restores: one section the hard stop never cuts
            try:
                self.stop_first(services, turn_off)
                self.each(snapshot(), resettable)
            finally:
                self.restores.run_all()
        return self.restores.failure()

    def resettable(self, report, busy, services):
        """The busy GPUs whose reset nothing but the daemons to stop would block (decided before anything is
        stopped: a holder in D state, a monitor, an NVML-only pid refuse it at once)."""
        spared = set(service["pid"] for service in services)
        out = []
        for gpu in busy:
            refusal = reset_refusal(report, gpu, spared)
            if refusal:
                self.recorder.signal({"pid": 0, "name": "GPU %d" % gpu["index"]}, "reset",
                                     refusal + "; nothing was stopped for it")
            else:
                out.append(gpu)
        return out

    def persistence(self, gpu, mode, bound):
        """nvidia-smi -pm MODE on gpu, bounded; (ok, text), recorded in reset_steps."""
        target = "GPU %d (%s)" % (gpu["index"], gpu.get("uuid") or "?")
        step = "persistence_%s" % ("on" if mode else "off")
        outcome = {"ok": False, "text": "nvidia-smi not found"} if self.smi is None else units.run_on_node(
            [self.smi, "-i", gpu.get("pci_bus_id") or str(gpu["index"]), "-pm", str(mode)], bound)
        return self.recorder.step(step, target, outcome), outcome["text"]

    def start_service(self, service):
        """The restore of a stopped daemon: start its service again, bounded; (ok, text)."""
        outcome = units.run_on_node(service["start"], RESTORE_STEP_S)
        return self.recorder.step("start", "%s %s" % (service["kind"], service["name"]), outcome), outcome["text"]

    def stop_first(self, services, turn_off):
        """Stop the daemons' services and turn persistence mode off, each restore registered before its stop."""
        for service in services:
            self.restores.register("service", "%s %s" % (service["kind"], service["name"]), "stopped",
                                   lambda service=service: self.start_service(service))
            self.recorder.step("stop", "%s %s" % (service["kind"], service["name"]),
                               units.run_on_node(service["stop"], self.clock.act_bound(self.stop_timeout)))
            hardstop.check()
        for gpu in turn_off:
            self.restores.register("persistence", "GPU %d (%s)" % (gpu["index"], gpu.get("uuid") or "?"),
                                   "persistence mode off", lambda gpu=gpu: self.persistence(gpu, 1, RESTORE_STEP_S))
            self.persistence(gpu, 0, self.clock.act_bound(RESTORE_STEP_S))
            hardstop.check()

    def each(self, report, gpus):
        """Reset each of gpus (entries of an earlier read) that report still shows used and nothing blocks."""
        wanted = set(g["index"] for g in gpus)
        for gpu in report.gpus:
            if gpu["index"] not in wanted or gpu["free"] or gpu.get("error"):
                continue
            fake = {"pid": 0, "name": "GPU %d" % gpu["index"]}
            refusal = reset_refusal(report, gpu)
            if refusal:
                self.recorder.signal(fake, "reset", refusal)
            elif self.smi is None:
                self.recorder.signal(fake, "reset", "failed: nvidia-smi not found in PATH or %s" % ", ".join(NVIDIA_SMI_DIRS))
            else:
                self.recorder.signal(fake, "reset", self.one(gpu))

    def one(self, gpu):
        """nvidia-smi --gpu-reset of gpu, bounded by reset_timeout and the time left before the restore's reserve."""
        cmd = [self.smi, "--gpu-reset", "-i", gpu.get("pci_bus_id") or str(gpu["index"])]
        self.engine.nvml.shutdown()  # this module's own NVML session has the device open: it would block the reset
        timeout = self.clock.act_bound(self.reset_timeout)
        try:
            returncode, out = helperproc.run_bounded(cmd, timeout, env=dict(os.environ, LC_ALL="C"))
            text = " ".join(out.split())[:300]
            self.done = self.done or returncode == 0
            outcome = ("done: %s" % (text or "nvidia-smi --gpu-reset succeeded") if returncode == 0 else
                       "failed (rc %d): %s" % (returncode, text))
        except subprocess.TimeoutExpired:
            outcome = ("failed: nvidia-smi --gpu-reset did not return within %gs (killed, abandoned after %gs if stuck)"
                       % (timeout, helperproc.KILL_WAIT_S))
        except OSError as exc:
            outcome = "failed: %s" % exc
        self.engine.start()
        self.resync()
        return outcome
