# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The release ladder: TERM, KILL, wait, reset, verify (private helper).

Signals only processes that /proc shows holding a targeted GPU, each guarded
against pid reuse. No AnsibleModule here.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import concurrent.futures
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _blockers as blockers
from ansible_collections.gpuops.fleet.plugins.module_utils import _hardstop as hardstop
from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils._locks import (
    LOCK_DIR, ContainerLocks, GpuLocks, LockDirError, LockTimeout,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._hardstop import ReleaseTimeout
from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils._access import read_drm_refcount
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _shmclean as shmclean
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils import _respawn as respawn
from ansible_collections.gpuops.fleet.plugins.module_utils import _restart as restart
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import (
    decide, generic_unit, gpu_list_words, plan_entry, reset_refusal, stop_set_verdict, stuck_in_driver,
)

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps

psutil = None
with deps.declare("psutil", reason="to signal processes, each guarded against pid reuse"):
    import psutil

# The ladder, in order; the one list of rungs (issue 46): the gpu_report callback reads it. "stop" (units stopped, no
# signal) is reported on a container's rows (per_container); rung_reached (_set_rung) starts at the signals.
RUNGS = ("none", "stop", "sigterm", "sigkill", "wait", "container_restart", "reset")
POLL_S = 0.075
FULL_READ_EVERY_S = 1.0  # shared_gpu: own polls read NVML alone in between (_scope_still_holds)
GRACE_S = 1.0            # once nothing visible here holds a GPU, how long to wait for its memory
UNIT_WORDS = units.KIND_WORDS
RESTORE_STEP_S = 20.0    # the bound of one restore step (a daemon started, persistence mode back on); reserved
MIN_ACT_S = 2.0          # the least time a stop needs beside its reserved restore, or it is not started
SETTLE_S = 5.0           # after a container stop that did not end well: how long its state may take to settle
SETTLE_POLL_S = 0.5
RESPAWN_WINDOW_S = 3.0   # how long to watch the parents of killed holders after the verdict
RESPAWN_STARTING_S = 6.0  # longer while a new child of theirs is still starting (maps nothing yet)
HEIR_ROUNDS = 3          # re-reads after the signals, for holders pinned only once their parent is dead
HEIR_WAIT_S = 0.3        # memory of a reaped holder is back 0.12-0.2 s after SIGKILL (GPU_FACTS row 2)
SNAPSHOT_TRIES = 3       # reads of the GPUs while NVML is not opened again meanwhile (a new helper)
NVIDIA_SMI_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def find_nvidia_smi(path_env=None):
    dirs = [d for d in (path_env if path_env is not None else os.environ.get("PATH", "")).split(os.pathsep) if d]
    for folder in dirs + list(NVIDIA_SMI_DIRS):
        candidate = os.path.join(folder, "nvidia-smi")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def alive(record, proc_root="/proc"):
    """Still the same process and still able to hold something (a one-thread zombie holds nothing)."""
    stat = procscan.read_stat(record["pid"], proc_root)
    if stat is None or stat["starttime"] != record["starttime_ticks"]:
        return False
    return not (stat["state"] in ("Z", "X") and stat["num_threads"] <= 1)


def send_guarded(record, sig, proc_root="/proc", use_pidfd=True, recheck=None):
    """Send sig to the process of record unless its pid now names another process; return the outcome.

    A pidfd pins the process; its start time is then checked, so the signal
    cannot reach a reused pid. Without pidfd (Python < 3.9, or use_pidfd=False),
    psutil's create-time check guards it. recheck(record), when given, is asked
    once the process is pinned (a node-side release re-reads the container) and
    a reason it gives stops the signal. Never raises: a refusal is an outcome.
    """
    pid = record["pid"]
    pidfd = None
    pidfd_open = getattr(os, "pidfd_open", None) if use_pidfd else None
    if pidfd_open is not None and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pidfd = None
    try:
        stat = procscan.read_stat(pid, proc_root)
        if stat is None:
            return "gone"
        if stat["starttime"] != record["starttime_ticks"]:
            return "not sent: pid %d was reused by another process" % pid
        refusal = recheck(record) if recheck is not None else None
        if refusal == "gone":
            return "gone"
        if refusal:
            return "not sent: %s" % refusal
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                return "gone"
            return "sent"
        if psutil is not None:
            try:
                proc = psutil.Process(pid)
                if record.get("create_time") is not None and abs(proc.create_time() - record["create_time"]) > 0.05:
                    return "not sent: pid %d was reused by another process" % pid
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                return "gone"
            except psutil.AccessDenied as exc:
                return "error: access denied (%s)" % exc
            except psutil.Error as exc:
                return "error: %s" % exc
            return "sent"
        os.kill(pid, sig)
        return "sent"
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return "gone"
        return "error: %s" % exc
    finally:
        if pidfd is not None:
            os.close(pidfd)


def gpu_summary(report, scope=None):
    """Compact per-GPU state for before/after (on a node with its MiB by container)."""
    out = []
    for gpu in report.gpus:
        mem = gpu.get("memory") or {}
        entry = {"index": gpu["index"], "minor": gpu.get("minor"), "uuid": gpu.get("uuid"),
                 "used_mib": mem.get("used_mib"), "reserved_mib": mem.get("reserved_mib"),
                 "v1_used_mib": mem.get("v1_used_mib"), "free": gpu["free"], "holders": gpu.get("holders", []),
                 "error": gpu.get("error")}
        if "by_container" in gpu:
            entry["by_container"] = gpu["by_container"]
        if scope is not None:
            entry["free_for_scope"] = free_for_scope(report, gpu, scope)
        out.append(entry)
    return out


class Releaser(object):
    """Runs the ladder for the targeted GPU indexes of an Engine."""

    def __init__(self, engine, targets, term_timeout=10.0, kill_timeout=10.0, verify_timeout=30.0, reset_timeout=120.0,
                 gpu_reset=False, lock_timeout=60.0, match=None, protect=None, deadline=None,
                 log=None, check_mode=False, lock_dir=LOCK_DIR, nvidia_smi=None, poll_s=POLL_S,
                 collateral="refuse", collateral_tolerance_mib=pinning.DEFAULT_TOLERANCE_MIB, scope=None, shared_gpu="all",
                 container_restart=False, restart_backend=None, container_timeout=60.0, stop_found_units=False,
                 stop_timeout=60.0, stop_concurrency=1, reset_blockers="refuse"):
        self.engine = engine
        self.reset_mode = reset_blockers
        self.reset_blockers = []  # blockers.plan's, with gpu_reset on a node
        self.reset_services = []  # the daemons' services to stop and start again (stop_services)
        self.reset_persistence = []  # indexes whose persistence mode is turned off for the reset
        self.reset_steps = []     # each stop, persistence change and start, with its outcome
        self.stop_concurrency = stop_concurrency
        self.stop_found_units = stop_found_units
        self.stop_timeout = stop_timeout
        self.stop_sets = []       # units.plan_sets: every stop set of the plan's holders, decided (node view)
        self.found_units = []     # the stop sets to stop, with each stop's outcome
        self.unstopped_units = []  # the same, found but not to stop (stop_found_units off): named on a respawn
        self.scope = scope
        self.own_only = scope is not None and shared_gpu == "own"
        self.container_restart = container_restart
        self.restart_backend = restart_backend
        self.container_timeout = container_timeout
        self.restart_plan = []
        self.restarted = []
        self.collateral = collateral
        self.tolerance_mib = collateral_tolerance_mib
        self.targets = list(targets)
        # GPUs are their UUIDs: after an NVML re-init (a reset, a new helper) the indexes are resolved again
        self.target_uuids = [((engine.gpu(i) or {}).get("uuid"), i) for i in self.targets]
        self.missing = []          # targeted UUIDs NVML no longer lists: never free
        self.term_timeout = term_timeout
        self.kill_timeout = kill_timeout
        self.verify_timeout = verify_timeout
        self.reset_timeout = reset_timeout
        self.gpu_reset = gpu_reset
        self.lock_timeout = lock_timeout
        self.match = match
        self.protect = protect
        self.deadline = deadline
        engine.deadline = deadline   # reads through a container's root and MPS asks, in each snapshot, end by it
        self.log = log or (lambda msg: None)
        self.check_mode = check_mode
        self.lock_dir = lock_dir
        self.nvidia_smi = nvidia_smi
        self.poll_s = poll_s
        self.proc_root = engine.proc_root
        self.actions = []
        self.rung = "none"
        self.started = time.monotonic()
        self.signalled = {}      # pid -> record
        self.skipped = []
        self.to_signal = []
        self.protected = {}      # pid -> why, the targeted GPUs' holders left alone by protect or match (decide)
        self.plan = []
        self.refusals = []
        self.refused_in = []     # per refusal, the set of containers (vmids) it is about; empty: not only containers
        self.jobs = {}
        self._ranks = []
        self.linked = []
        self.evidence = {"nvml_stale": [], "unknown_gpus": []}
        self.failure = None      # message when the task must fail
        self.respawned = None
        self.watch = None        # respawn.RespawnWatch, from the first signal on
        self.reset_done = False
        self.undo = []           # restores of the stops made, newest last: each runs once, whatever happens
        self.left_changed = []   # what a restore could not put back: {kind, what, state, why}
        self.reserved_s = 0.0    # time kept back from the deadline for the registered restores
        self.last_report = None  # the last full read (snapshot), for the cheap polls of shared_gpu: own
        self.last_full_at = None
        self.reads = {"fast": 0, "full": 0}

    # -- helpers
    def now(self):
        return time.monotonic()

    def _left(self):
        if self.deadline is None:
            return None
        return self.deadline - self.now()

    def _check_deadline(self, during):
        left = self._left()
        if left is not None and left <= 0:
            raise ReleaseTimeout("the overall timeout was reached during %s" % during)

    def _until(self, seconds):
        end = self.now() + seconds
        if self.deadline is not None:
            end = min(end, self.deadline)
        return end

    def late_read(self, report):
        """Why nothing may be signalled after the read of report: the overall timeout was reached during it (an MPS
        control daemon that did not answer, say), or None."""
        left = self._left()
        if left is None or left > 0:
            return None
        whys = sorted(set(e["why"] for e in (getattr(report, "mps_servers", None) or {}).values() if e["why"]))
        return "the overall timeout was reached while the GPUs were read%s; nothing was signalled" % (
            "" if not whys else " (MPS: %s)" % "; ".join(whys))

    def _set_rung(self, rung):
        if RUNGS.index(rung) > RUNGS.index(self.rung):
            self.rung = rung

    def _sync_targets(self, force=False):
        """After an NVML re-init, list the GPUs again and find each target by its UUID; a missing one is not free."""
        if not force and not self.engine.stale_listing():
            return
        self.engine.relist()
        by_uuid = dict((g.get("uuid"), g["index"]) for g in self.engine.gpus if g.get("uuid"))
        targets, missing = [], []
        for uuid, index in self.target_uuids:
            if uuid is None:
                targets.append(index)     # never described: it failed before any signal
            elif uuid in by_uuid:
                targets.append(by_uuid[uuid])
            else:
                missing.append(uuid)
        if missing != self.missing:
            self.log("gpuops.fleet.gpu_release: after NVML was opened again, %s no longer listed"
                     % ", ".join(missing))
        self.targets, self.missing = targets, missing

    def snapshot(self):
        """A report of the targets, read by their UUIDs (again while NVML was opened again meanwhile)."""
        for dummy in range(SNAPSHOT_TRIES):
            self._sync_targets()
            report = self.engine.snapshot(self.targets)
            if not self.engine.stale_listing():
                break
        else:
            raise NvmlFailure("NVML was opened again during each of %d reads of the GPUs; their indexes cannot be "
                              "trusted, nothing more was done" % SNAPSHOT_TRIES)
        self.evidence = {"nvml_stale": list(report.nvml_stale), "unknown_gpus": list(report.unknown_gpus)}
        self.last_report, self.last_full_at = report, self.now()
        self.reads["full"] += 1
        return report

    def _scope_still_holds(self):
        """shared_gpu: own, between full reads: True when NVML alone shows the scope still holding a target (its
        named pids' MiB by container, a gone pid charged as the last full read's evidence says, above the
        threshold). Cheap: NVML and one cgroup read per named pid, no /proc walk. False never means free: the
        verdict is always a full read's."""
        last = self.last_report
        if last is None or self.now() - self.last_full_at >= FULL_READ_EVERY_S:
            return False
        self.reads["fast"] += 1
        for index in self.targets:
            try:
                procs = self.engine.nvml.processes(index)
            except Exception:  # pylint: disable=broad-except
                return False   # the full read says why
            stale = set(e["pid"] for e in last.nvml_stale if e["gpu"] == index)
            mine = node.by_container(procs, None, last.holders, self.proc_root, stale, index)
            if sum(mib for where, mib in mine.items() if self.scope.allows(where)) > self.engine.threshold_mib:
                return True
        return False

    def _memory_free(self):
        self._sync_targets()
        if self.missing:
            return False
        if self.own_only:
            if self._scope_still_holds():
                return False
            return targets_free(self.snapshot(), self.scope) and not self.missing
        free = all(self.engine.is_free(self.engine.memory(index)) for index in self.targets)
        return free and not self.engine.stale_listing()

    def _record(self, record, signame, outcome):
        action = {"time": round(time.time(), 3), "elapsed_s": round(self.now() - self.started, 3),
                  "pid": record["pid"], "name": record["name"], "signal": signame, "outcome": outcome}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: %s to pid %d (%s): %s" % (signame, record["pid"], record["name"], outcome))

    def _signal(self, records, sig, signame):
        sent = False
        for record in records:
            outcome = send_guarded(record, sig, self.proc_root, recheck=self.scope.recheck if self.scope else None)
            self._record(record, signame, outcome)
            if outcome == "sent":
                sent = True
                self.signalled[record["pid"]] = record
                if self.watch is not None:
                    self.watch.add(record)
        return sent

    def _wait(self, seconds, watched, during):
        """Poll until the targets are free, the watched processes are gone, or time is up."""
        end = self._until(seconds)
        while True:
            if self._respawn_seen():
                return "respawn"
            if self._memory_free():
                return "free"
            if not [r for r in watched if alive(r, self.proc_root)]:
                return "gone"
            if self.now() >= end:
                self._check_deadline(during)
                return "timeout"
            time.sleep(self.poll_s)

    # -- respawn
    def _nvml_named_on_targets(self):
        named = set()
        for index in self.targets:
            try:
                named.update(p["pid"] for p in self.engine.nvml.processes(index))
            except Exception:  # pylint: disable=broad-except
                continue  # the verdict reads NVML again; the watch goes on with the maps alone
        return named

    def _respawn_seen(self):
        """True once a process started under a killed holder's parent maps (or NVML names it on) a targeted GPU."""
        if self.watch is None:
            return False
        if self.respawned is not None:
            return True
        found = self.watch.poll(self._nvml_named_on_targets)
        if found is None:
            return False
        self.respawned = found
        self.failure = self._respawn_failure(found)
        self.log("gpuops.fleet.gpu_release: %s" % self.failure)
        return True

    def _watch_after_verdict(self):
        """After "free": watch the parents for the respawn window, longer while a new child of theirs is starting."""
        if self.watch is None or not self.watch.live_parents():
            return False
        end, starting_end = self._until(RESPAWN_WINDOW_S), self._until(RESPAWN_STARTING_S)
        while True:
            if self._respawn_seen():
                return True
            now = self.now()
            if now >= starting_end or (now >= end and not self.watch.pending) or not self.watch.live_parents():
                break
            time.sleep(self.poll_s)
        found = self.watch.starting_again()
        if found is None:
            return False
        self.respawned = found
        self.failure = self._respawn_failure(found)
        return True

    def _after_respawn(self):
        """A respawn fails the task; from the node, a planned container restart may still free the GPUs."""
        if self.restart_plan:
            self.watch = None   # a restart ends the parents too
            self._restart_containers(self.failure)   # only while a targeted GPU is still held there (C3)
            if not self.failure:
                self._verify_wait(self.verify_timeout, [])

    # -- the ladder
    def _decide(self, report):
        return decide(report, self.targets, [g["index"] for g in self.engine.gpus], self.match, self.protect,
                      self.engine.own_tree_skip(), self.collateral, self.tolerance_mib, self.scope)

    def prepare(self, report):
        """Decide whom to signal; returns the plan (check mode's answer). self.refusals stops the task."""
        decision = self._decide(report)
        self.to_signal, self.skipped, self.refusals = decision.to_signal, decision.skipped, decision.refusals
        self.protected = decision.protected
        where = dict((r["pid"], r.get("container")) for r in list(report.holders) + list(report.clients))
        self.refused_in = [self._containers_of(pids, where) for pids in decision.refused_pids]
        self.jobs = decision.jobs
        self._known_pids = set(r["pid"] for r in report.holders) | set(r["pid"] for r in report.clients)
        uuid_of = dict((g["index"], g.get("uuid")) for g in self.engine.gpus)
        self._ranks = [[(m["pid"], m["starttime_ticks"], dict((uuid_of.get(i), mib) for i, mib in m["shares_mib"].items()))
                        for m in job["members"]] for job in report.jobs.values()]
        self.plan = [plan_entry(r, self.targets, decision, self.tolerance_mib) for r in self.to_signal]
        planned = set(r["pid"] for r in self.to_signal)
        self.linked = [link for link in report.linked if planned & set(link["pids"])]
        for entry in self.plan:
            entry["linked"] = sorted(p for link in self.linked for p in link["pids"]
                                     if entry["pid"] in link["pids"] and p != entry["pid"])
        if self.container_restart and self.scope is not None:
            self.restart_plan = self._restart_plan(report)
        return self.plan

    def _containers_of(self, pids, where):
        """The containers of pids (a set of vmids), or an empty set when one of them is in none or cannot be read."""
        out = set()
        for pid in pids:
            vmid = where.get(pid) or node.container_of_pid(pid, self.proc_root)
            if vmid in (None, node.HOST, node.UNATTRIBUTED):
                return set()
            out.add(vmid)
        return out

    def _refuse(self, msg, vmid):
        self.refusals.append(msg)
        self.refused_in.append(set([vmid]))

    def leave_out(self, vmids):
        """Narrow the scope: vmids' processes are no longer signalled (their container was refused)."""
        self.scope = node.Scope(self.scope.containers - set(vmids), self.scope.host_processes, self.proc_root)

    # -- what would respawn the plan's holders, stopped in their containers (node side)
    def find_units(self, report):
        """The stop sets of the planned holders (node view), each decided on report (units.plan_sets) and printed
        (stop_sets): those decided "stop" are returned to stop with stop_found_units, else only named, should one of
        them respawn its holder. A set refused or not found is never stopped: its holders are signalled alone."""
        if self.scope is None or self.engine.view != "node":
            return []
        skipped = dict((s["pid"], s["reason"]) for s in self.skipped)
        self.stop_sets = units.plan_sets(report, self.to_signal, skipped, self.targets,
                                         [g["index"] for g in self.engine.gpus], self.collateral, self.tolerance_mib,
                                         self.proc_root)
        for entry in self.plan:
            entry["stop_set"] = next(("%s %s in container %s: %s" % (UNIT_WORDS.get(s["kind"], s["kind"]), s["name"],
                                                                     s["vmid"], s["verdict"]) if s["kind"] else None
                                      for s in self.stop_sets if entry["pid"] in s["pids"]), None)
        allowed = [s for s in self.stop_sets if s["verdict"] == "stop"]
        named = [dict((k, s[k]) for k in ("vmid", "kind", "name", "evidence", "pids")) for s in allowed]
        if not self.stop_found_units:
            self.unstopped_units = named
            for entry in allowed:
                entry["outcome"] = "not run: stop_found_units is off"
            return []
        self.found_units = named
        return allowed

    def _respawn_failure(self, found):
        """The failure of a respawn: what respawned, and the units found from the node that were not stopped."""
        words = respawn.respawn_message(found)
        if self.unstopped_units:
            words += ("; found from the node and not stopped (stop_found_units is off): %s; stop it, list it "
                      "(release_gpus_services, release_gpus_supervisor_programs), or set stop_found_units: true"
                      % ", ".join("%s %s in container %s" % (UNIT_WORDS.get(u["kind"], u["kind"]), u["name"], u["vmid"])
                                  for u in self.unstopped_units))
        return words

    def stop_units(self, found):
        """Stop each found unit through its container's own manager, stop_concurrency containers at once (each
        container's units one after another). Each stop is bounded; the hard stop is held off until every outcome
        is recorded, in the order of found; a stop not tried for lack of time ends the release after that."""
        per_container = {}
        for entry in found:
            per_container.setdefault(entry["vmid"], []).append(entry)
        workers = max(1, min(self.stop_concurrency, len(per_container)))
        with hardstop.held_off():
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                outcomes = [done for batch in pool.map(self._stop_each, list(per_container.values())) for done in batch]
            self._record_stops(outcomes)
        late = [entry for entry, done, dummy in outcomes if done.get("late")]
        if late:
            raise ReleaseTimeout("the overall timeout was reached during the stop of %s %s in container %s"
                                 % (late[0]["kind"], late[0]["name"], late[0]["vmid"]))

    def _stop_each(self, entries):
        """One container's units, one after another: [(entry, outcome, when)]; none is started once time is up."""
        out = []
        for entry in entries:
            left = self._left()
            if left is not None and left <= 0:
                out.append((entry, {"ok": False, "late": True, "text": "not tried: the overall timeout was reached"},
                            self.now()))
                continue
            out.append((entry, units.stop(entry, self._act_bound(self.stop_timeout)), self.now()))
        return out

    def _record_stops(self, outcomes):
        by_key = dict(((u["vmid"], u["kind"], u["name"]), u) for u in self.found_units)
        sets = dict(((u["vmid"], u["kind"], u["name"]), u) for u in self.stop_sets)
        for entry, done, when in sorted(outcomes, key=lambda o: o[2]):
            outcome = ("done: %s" % done["text"]) if done["ok"] else ("failed: %s" % done["text"])
            by_key[(entry["vmid"], entry["kind"], entry["name"])]["outcome"] = outcome
            if (entry["vmid"], entry["kind"], entry["name"]) in sets:
                sets[(entry["vmid"], entry["kind"], entry["name"])]["outcome"] = outcome
            action = {"time": round(time.time() - (self.now() - when), 3), "elapsed_s": round(when - self.started, 3),
                      "pid": 0, "name": "%s %s" % (UNIT_WORDS.get(entry["kind"], entry["kind"]), entry["name"]),
                      "vmid": entry["vmid"], "signal": "stop", "outcome": outcome}
            self.actions.append(action)
            self.log("gpuops.fleet.gpu_release: stop of %s in container %s: %s" % (action["name"], entry["vmid"], outcome))

    # -- the container rung (node side)
    def _restart_plan(self, report):
        """Per scoped container holding a targeted GPU: every process a restart would stop, and the restart decided
        as a stop set (_restart_verdict); a refusal stops the task before any signal."""
        members = node.processes_by_container(self.proc_root, getattr(report, "scan", None))
        out = []
        for vmid in sorted(self.scope.containers, key=int):
            holders = [h for h in report.holders if h.get("container") == vmid]
            gpus = set(g["index"] for g in self.engine.gpus for h in holders if pinning.may_hold(h, g["index"]))
            held_mib = sum((g.get("by_container") or {}).get(vmid, 0) for g in report.gpus)
            if not (gpus & set(self.targets)) and held_mib <= self.engine.threshold_mib:
                continue
            verdict = self._restart_verdict(report, vmid, members.get(vmid, []))
            entry = {"vmid": int(vmid), "gpus": sorted(gpus), "processes": members.get(vmid, []),
                     "untargeted_gpus": sorted(set(i for c in verdict["collateral"] for i in c["gpus"]
                                                   if isinstance(i, int))),
                     "collateral": verdict["collateral"], "backend": getattr(self.restart_backend, "name", None),
                     "refusal": restart.refusal(self.restart_backend, vmid) if self.restart_backend else None}
            if verdict["verdict"] != "stop":
                self._refuse(self._restart_words(vmid, verdict, len(entry["processes"])), vmid)
            out.append(entry)
        return out

    def _restart_verdict(self, report, vmid, processes):
        """A restart of container vmid decided as a stop set on report: every process of it is a member; container_restart
        is the consent for those that hold no GPU; GPU work that is not targeted is collateral (C1: no tolerance for a
        process whose only GPUs are not targeted)."""
        members = [{"pid": p["pid"], "name": p["name"], "why": "a process of container %s" % vmid} for p in processes]
        return stop_set_verdict({"kind": "container", "members": members}, report, self.targets,
                                [g["index"] for g in self.engine.gpus], self._still_planned(report), self.protected,
                                self.collateral, self.tolerance_mib)

    def _still_planned(self, report):
        """The planned or signalled holders that report still shows as the same processes (pid and start time): a
        pid reused since the plan is a new process, never given a planned holder's tolerance (R9)."""
        out = []
        for record in list(self.to_signal) + list(self.signalled.values()):
            now = report.holder(record["pid"]) if hasattr(report, "holder") else None
            if now is None or now.get("starttime_ticks") == record.get("starttime_ticks"):
                out.append(record["pid"])
        return out

    @staticmethod
    def _restart_words(vmid, verdict, count):
        if not verdict["collateral"]:
            return ("container_restart would restart container %s (a restart stops everything in it: %d processes), "
                    "but %s; nothing was signalled" % (vmid, count, verdict["reason"]))
        return ("container_restart would restart container %s, whose processes also hold GPU work that is not targeted "
                "(a restart stops everything in it: %d processes): %s; nothing was signalled. To go on, set "
                "collateral: stop, or target those GPUs too" % (vmid, count, "; ".join(
                    "pid %d (%s) %s" % (c["pid"], c["name"], c["why"]) for c in verdict["collateral"])))

    def _restart_containers(self, why):
        """Stop and start each planned container that still holds a targeted GPU, decided again on the snapshot taken
        right before its stop (C2: GPU work started since the plan refuses it); sets self.failure when one fails. A
        container whose stop has run is always started again (its start is paired with the stop, hard stop held off)."""
        report = self.snapshot()
        busy = [e for e in self.restart_plan if self._container_holds(report, str(e["vmid"]))]
        if not busy:
            return
        self._set_rung("container_restart")
        for entry in busy:
            self.failure = self._restart_refusal(report, why, entry["vmid"]) or self._restart_one(report, entry["vmid"])
            if self.failure:
                return

    def _restart_refusal(self, report, why, vmid):
        """Why container vmid is not stopped, decided before anything changes: locked or HA-managed (read again
        right before the stop: a backup may have started since the plan), a holder stuck in the driver, too little
        time left for its stop and its start. None: go on."""
        refusal = restart.refusal(self.restart_backend, vmid)
        if refusal:
            return "%s; %s" % (why, refusal)
        processes = node.processes_by_container(self.proc_root, getattr(report, "scan", None)).get(str(vmid), [])
        verdict = self._restart_verdict(report, str(vmid), processes)
        if verdict["verdict"] != "stop":
            return "%s; decided again right before the stop: %s" % (why, self._restart_words(vmid, verdict, len(processes)))
        for holder in report.holders:
            thread = stuck_in_driver(holder) if holder.get("container") == str(vmid) else None
            if thread is not None:
                return ("container %s was not restarted: pid %d (%s) has thread %d in D state in the driver (wchan %s) "
                        "holding %s; a container stop cannot end it and can hang; the remedy is a GPU reset "
                        "(gpu_reset: true) or a node reboot" % (vmid, holder["pid"], holder["name"], thread.get("tid", 0),
                                                                thread.get("wchan") or "unknown",
                                                                gpu_list_words(holder["gpus"] or holder["maps_gpus"])))
        return self._no_time_for(self.container_timeout, "stop container %s and start it again" % vmid)

    def _no_time_for(self, reserve_s, what):
        """A refusal when the time left cannot cover reserve_s (a restore's bound) plus MIN_ACT_S to act; else None."""
        left = self._left()
        if left is None or left >= reserve_s + MIN_ACT_S:
            return None
        return ("not enough time left to %s: %.1fs left of the timeout, %gs are reserved for the restore; nothing "
                "was stopped; raise timeout" % (what, max(0.0, left), reserve_s))

    def _restart_one(self, report, vmid):
        """Stop container vmid, then always start it again (one section the hard stop never cuts); returns the
        failure text or None. A container that is not running is neither stopped nor started."""
        if self._running(vmid) is False:
            return ("container %s is not running (stopped since the plan): it was neither stopped nor started; start it "
                    "and release again" % vmid)
        self.reserved_s = self.container_timeout
        stop = {"ok": None}
        with hardstop.held_off():
            self._undo("container", "container %s" % vmid, "stopped", lambda: self._start_container(vmid, stop["ok"]))
            try:
                stopped = self.restart_backend.stop(vmid, self._act_bound(self.container_timeout))
                stop["ok"] = stopped["ok"]
                self._record_container(vmid, "container_stop", stopped)
            finally:
                self.restore_all()
        if stopped["ok"]:
            self.restarted.append(vmid)
            return self.failure_of_restores()
        stuck = [(h, t) for h in report.holders if h.get("container") == str(vmid) for t in h["blocked_threads"]]
        if not stuck:
            return "container %s did not stop: %s" % (vmid, stopped["text"])
        holder, thread = stuck[0]
        return ("container %s did not stop (%s): pid %d (%s) has thread %d in D state (wchan %s) holding %s; it is "
                "stuck in the kernel, and only a driver reload or a node reboot frees it"
                % (vmid, stopped["text"], holder["pid"], holder["name"], thread.get("tid", 0),
                   thread.get("wchan") or "unknown", gpu_list_words(holder["gpus"] or holder["maps_gpus"])))

    def _running(self, vmid):
        """Whether the backend says vmid runs (True, False), or None when it cannot tell."""
        running = getattr(self.restart_backend, "running", None)
        return None if running is None else running(vmid, RESTORE_STEP_S)

    def _start_container(self, vmid, stop_ok):
        """The container rung's restore: start vmid again; (ok, text), ok when it runs. After a stop that did not
        end well (failed, timed out, cut short), the container's state is let settle first (SETTLE_S): a stop still
        under way would stop it after a start that found it running."""
        if stop_ok is not True:
            state = self._settled(vmid)
            if state is True:
                return True, "not started: it is running (its stop did not end it)"
        started = self.restart_backend.start(vmid, self.container_timeout)
        self._record_container(vmid, "container_start", started)
        if started["ok"]:
            return True, started["text"]
        if self._running(vmid) is True:
            return True, "it is running (%s)" % started["text"]
        return False, started["text"]

    def _settled(self, vmid):
        """vmid's running state once two reads SETTLE_POLL_S apart agree (at most SETTLE_S); None: cannot tell."""
        end, last = self.now() + SETTLE_S, self._running(vmid)
        while last is not None and self.now() < end:
            time.sleep(SETTLE_POLL_S)
            now = self._running(vmid)
            if now == last:
                return now
            last = now
        return last

    def _container_holds(self, report, vmid):
        for gpu in report.gpus:
            if gpu["index"] in self.targets and not gpu["free"] and (gpu.get("by_container") or {}).get(vmid, 0) > 0:
                return True
        return any(h.get("container") == vmid and set(self.targets) & set(h["gpus"] + h["ambiguous_gpus"])
                   for h in report.holders)

    def _record_container(self, vmid, what, result):
        action = {"time": round(time.time(), 3), "elapsed_s": round(self.now() - self.started, 3), "pid": 0,
                  "name": "container %s" % vmid, "vmid": vmid, "signal": what, "task": result["task"],
                  "seconds": result["seconds"],
                  "outcome": ("done: %s" % result["text"]) if result["ok"] else ("failed: %s" % result["text"])}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: %s of container %s: %s" % (what, vmid, action["outcome"]))

    def _escalate(self, records, watched):
        """SIGTERM, wait, SIGKILL the survivors, wait; returns the last wait's outcome."""
        self._set_rung("sigterm")
        self._signal(records, signal.SIGTERM, "SIGTERM")
        outcome = self._wait(self.term_timeout, watched, "SIGTERM")
        if outcome == "respawn":
            return outcome
        survivors = [r for r in records if alive(r, self.proc_root)]
        if outcome != "free" and survivors:
            survivors = self._still_holding(survivors)
        if outcome != "free" and survivors:
            self._set_rung("sigkill")
            self._signal(survivors, signal.SIGKILL, "SIGKILL")
            outcome = self._wait(self.kill_timeout, watched, "SIGKILL")
        return outcome

    def _fresh_report(self):
        """A new snapshot, told which ranks of the jobs seen at the start died since (residue evidence)."""
        self._sync_targets()
        index_of = dict((g.get("uuid"), g["index"]) for g in self.engine.gpus if g.get("uuid"))
        deaths = {}
        for members in self._ranks:
            gone = [m for m in members if not procscan.same_process(m[0], m[1], self.proc_root)]
            survivors = [m[0] for m in members if m not in gone]
            for pid, dummy, shares in gone:
                for uuid, mib in shares.items():
                    if uuid in index_of:     # ranks' shares are kept by UUID: indexes may move on a re-init
                        deaths.setdefault(index_of[uuid], []).append({"pid": pid, "mib": mib, "survivors": survivors})
        self.engine.rank_deaths = deaths
        return self.snapshot()

    def _still_holding(self, survivors):
        """The SIGTERM survivors that still hold a targeted GPU (one that let go is writing a checkpoint)."""
        report = self._fresh_report()
        decision = self._decide(report)
        keep = set(r["pid"] for r in decision.to_signal)
        out = []
        for record in survivors:
            if record["pid"] in keep or [e for e in self.plan if e["pid"] == record["pid"] and e["why"] == "job_member"]:
                out.append(record)
            else:
                self._record(record, "SIGKILL", "not sent: it no longer holds a targeted GPU")
        return out

    def _heirs(self):
        """Holders that existed before the signals and are pinned to a targeted GPU only now (a dead parent's heir)."""
        report = self._fresh_report()
        decision = self._decide(report)
        fresh = [r for r in decision.to_signal if r["pid"] in self._known_pids and r["pid"] not in self.signalled]
        if fresh and decision.refusals:
            self.failure = ("after the first signals, new evidence pins more holders, and stopping them is refused: "
                            + " | ".join(decision.refusals))
            return []
        for record in fresh:
            self.plan.append(plan_entry(record, self.targets, decision, self.tolerance_mib))
        return fresh

    def _terminate_mps_clients(self, report, clients):
        """terminate_client SERVER CLIENT for each MPS client about to be signalled, through the control daemon that
        lists it in report's evidence (pids as that daemon sees them), each ask bounded by the time left: its GPU
        work ends safely; the ladder then ends the process (terminate_client frees nothing, row 28)."""
        evidence = getattr(report, "mps_servers", None) or {}
        served = {}   # client pid -> (its server's evidence, the client's pid as its daemon sees it)
        for entry in evidence.values():
            for pid, seen in entry["clients_as"].items():
                served[pid] = (entry, seen)
        for record in clients:
            if record["pid"] not in served:
                self._record(record, "terminate_client", "skipped: no MPS control daemon lists it as a client (%s); "
                             "the ladder alone follows" % ("; ".join(sorted(set(
                                 e["why"] for e in evidence.values() if e["why"]))) or "none asked"))
                continue
            entry, client = served[record["pid"]]
            control, server = entry["control"], entry["server_as"]
            ok, text = mps.ask(control, "terminate_client %d %d" % (server, client), deadline=self.deadline)
            self._record(record, "terminate_client", "%s: server %d, control daemon pid %d%s: %s"
                         % ("done" if ok else "failed", server, control["pid"],
                            "" if control["vmid"] is None else " (in container %s, pids as seen there)" % control["vmid"], text))

    def run(self, report):
        """Climb the ladder from report (the state after the locks were taken).

        From the first signal to the verdict, and for the respawn window after it, the parents of the
        killed holders are watched: a respawn fails the task, naming the parent and its chain.
        """
        self._kill_ticks = _now_ticks(self.proc_root)
        targets = [self.engine.gpu(i) or {} for i in self.targets]
        self.watch = respawn.RespawnWatch(self.proc_root, self.engine.devices, [g.get("minor") for g in targets],
                                          self._kill_ticks, self._known_pids,
                                          getattr(getattr(report, "scan", None), "stats", None))
        watched = list(self.to_signal)
        outcome = "gone"
        self._terminate_mps_clients(report, [r for r in self.to_signal if r.get("mps_role") == "client"])
        if self.to_signal:
            outcome = self._escalate(list(self.to_signal), watched)
        for dummy in range(HEIR_ROUNDS):
            if outcome in ("free", "respawn") or not self.signalled:
                break
            # time for the memory of the dead to come back, then look for heirs
            outcome = self._verify_wait(HEIR_WAIT_S, watched, grace_s=HEIR_WAIT_S)
            if outcome in ("free", "respawn"):
                break
            heirs = self._heirs()
            if not heirs:
                break
            watched.extend(heirs)
            outcome = self._escalate(heirs, watched)
        if outcome == "respawn":
            self._after_respawn()
            return
        if self.failure:
            return
        if outcome == "free":
            if self._watch_after_verdict():
                self._after_respawn()   # a child started again after "free": the container rung still applies
            return
        # D-state threads, or memory held by something not signalled: wait up to verify_timeout
        survivors = [r for r in watched if alive(r, self.proc_root)]
        if survivors:
            self._set_rung("wait")
        outcome = self._verify_wait(self.verify_timeout, watched)
        if outcome == "respawn":
            self._after_respawn()
            return
        if outcome == "free":
            if self._watch_after_verdict():
                self._after_respawn()   # a child started again after "free": the container rung still applies
            return
        if self.restart_plan:
            self._restart_containers("SIGKILL left the targeted memory held")
            if self.failure:
                return
            if self.restarted and self._verify_wait(self.verify_timeout, []) == "free":
                return
        if self.gpu_reset:
            self._reset()
            self._verify_wait(self.reset_timeout, [])

    def _verify_wait(self, seconds, watched, grace_s=GRACE_S):
        """Poll until free; stop grace_s after no watched process is left."""
        end = self._until(seconds)
        gone_since = None
        while True:
            if self._respawn_seen():
                return "respawn"
            if self._memory_free():
                return "free"
            now = self.now()
            if [r for r in watched if alive(r, self.proc_root)]:
                gone_since = None
            elif gone_since is None:
                gone_since = now
            if now >= end or (gone_since is not None and now - gone_since >= grace_s):
                self._check_deadline("verify")
                return "timeout"
            time.sleep(self.poll_s)

    def plan_reset(self, report):
        """With gpu_reset on a node: what would block a reset of the targets (self.reset_blockers), and the
        refusals that stop the release before anything is signalled."""
        if not self.gpu_reset or self.engine.view != "node":
            return []
        readings = {"persistence": {}, "mig": {}, "services": {}, "drm_refcount": read_drm_refcount()}
        for index in self.targets:
            readings["persistence"][index] = self.engine.nvml.mode(index, "nvmlDeviceGetPersistenceMode")
            readings["mig"][index] = self.engine.nvml.mode(index, "nvmlDeviceGetMigMode")
        for record in list(report.holders) + list(report.clients) + list(report.protected_holders):
            if record.get("protected_name") in blockers.DAEMONS:
                service = stopsets.node_service(record, self.proc_root)
                generic = generic_unit(service["name"]) if service and service["kind"] == "systemd" else None
                readings["services"][record["pid"]] = dict(service, refused=generic) if generic else service
        self.reset_blockers, refusals = blockers.plan(report, self.targets, readings, self.reset_mode, self.engine.gpus)
        if self.reset_mode == "stop_services":
            seen = set()
            for pid, service in sorted(readings["services"].items()):
                if service is not None and service["name"] not in seen:
                    seen.add(service["name"])
                    self.reset_services.append(dict(service, pid=pid))
            self.reset_persistence = sorted(i for i, on in readings["persistence"].items() if on)
        return refusals

    def _step(self, step, target, outcome):
        self.reset_steps.append({"step": step, "target": target, "ok": outcome["ok"], "outcome": outcome["text"]})
        self.log("gpuops.fleet.gpu_release: %s %s: %s" % (step, target, outcome["text"]))
        return outcome["ok"]

    def _persistence(self, gpu, mode, smi, bound):
        """nvidia-smi -pm MODE on gpu, bounded; (ok, text), recorded in reset_steps."""
        target = "GPU %d (%s)" % (gpu["index"], gpu.get("uuid") or "?")
        step = "persistence_%s" % ("on" if mode else "off")
        outcome = {"ok": False, "text": "nvidia-smi not found"} if smi is None else units.run_on_node(
            [smi, "-i", gpu.get("pci_bus_id") or str(gpu["index"]), "-pm", str(mode)], bound)
        return self._step(step, target, outcome), outcome["text"]

    def _start_service(self, service):
        """The restore of a stopped daemon: start its service again, bounded; (ok, text)."""
        outcome = units.run_on_node(service["start"], RESTORE_STEP_S)
        return self._step("start", "%s %s" % (service["kind"], service["name"]), outcome), outcome["text"]

    def _reset(self):
        """nvidia-smi --gpu-reset for each targeted GPU still used; refused while anything holds it. With
        reset_blockers: stop_services, the daemons' services are stopped first and persistence mode is turned off,
        each stop paired with its restore, and only for GPUs that nothing else blocks."""
        self._set_rung("reset")
        report = self.snapshot()
        smi = self.nvidia_smi or find_nvidia_smi()
        busy = [g for g in report.gpus if not g["free"] and not g.get("error")]
        if not busy:
            return
        if not (self.reset_services or self.reset_persistence):
            self._reset_each(report, smi, busy)
            return
        resettable = self._resettable(report, busy)
        turn_off = [g for g in resettable if g["index"] in self.reset_persistence]
        reserve = RESTORE_STEP_S * (len(self.reset_services) + len(turn_off))
        refusal = resettable and self._no_time_for(reserve, "stop the node's daemons for the reset")
        for gpu in resettable if refusal else ():
            self._record({"pid": 0, "name": "GPU %d" % gpu["index"]}, "reset", "refused: %s" % refusal)
        if not resettable or refusal:
            return
        self.reserved_s = reserve
        with hardstop.held_off():     # the stops, the reset and the restores: one section the hard stop never cuts
            try:
                self._stop_for_reset(turn_off, smi)
                self._reset_each(self.snapshot(), smi, resettable)
            finally:
                self.restore_all()
        self.failure = self.failure or self.failure_of_restores()

    def _resettable(self, report, busy):
        """The busy GPUs whose reset nothing but the daemons to stop would block (decided before anything is
        stopped: a holder in D state, a monitor, an NVML-only pid refuse it at once)."""
        spared = set(service["pid"] for service in self.reset_services)
        out = []
        for gpu in busy:
            refusal = reset_refusal(report, gpu, spared)
            if refusal:
                self._record({"pid": 0, "name": "GPU %d" % gpu["index"]}, "reset", refusal + "; nothing was stopped for it")
            else:
                out.append(gpu)
        return out

    def _stop_for_reset(self, turn_off, smi):
        """Stop the daemons' services and turn persistence mode off, each restore registered before its stop."""
        for service in self.reset_services:
            self._undo("service", "%s %s" % (service["kind"], service["name"]), "stopped",
                       lambda service=service: self._start_service(service))
            self._step("stop", "%s %s" % (service["kind"], service["name"]),
                       units.run_on_node(service["stop"], self._act_bound(self.stop_timeout)))
            hardstop.check()
        for gpu in turn_off:
            self._undo("persistence", "GPU %d (%s)" % (gpu["index"], gpu.get("uuid") or "?"), "persistence mode off",
                       lambda gpu=gpu: self._persistence(gpu, 1, smi, RESTORE_STEP_S))
            self._persistence(gpu, 0, smi, self._act_bound(RESTORE_STEP_S))
            hardstop.check()

    def _reset_each(self, report, smi, gpus):
        """Reset each of gpus (entries of an earlier read) that report still shows used and nothing blocks."""
        wanted = set(g["index"] for g in gpus)
        for gpu in report.gpus:
            if gpu["index"] not in wanted or gpu["free"] or gpu.get("error"):
                continue
            fake = {"pid": 0, "name": "GPU %d" % gpu["index"]}
            refusal = reset_refusal(report, gpu)
            if refusal:
                self._record(fake, "reset", refusal)
            elif smi is None:
                self._record(fake, "reset", "failed: nvidia-smi not found in PATH or %s" % ", ".join(NVIDIA_SMI_DIRS))
            else:
                self._record(fake, "reset", self._run_reset(gpu, smi))

    def _run_reset(self, gpu, smi):
        """nvidia-smi --gpu-reset of gpu, bounded by reset_timeout and the time left before the restore's reserve."""
        cmd = [smi, "--gpu-reset", "-i", gpu.get("pci_bus_id") or str(gpu["index"])]
        self.engine.nvml.shutdown()  # this module's own NVML session has the device open: it would block the reset
        timeout = self._act_bound(self.reset_timeout)
        try:
            returncode, out = helperproc.run_bounded(cmd, timeout, env=dict(os.environ, LC_ALL="C"))
            text = " ".join(out.split())[:300]
            self.reset_done = self.reset_done or returncode == 0
            outcome = ("done: %s" % (text or "nvidia-smi --gpu-reset succeeded") if returncode == 0 else
                       "failed (rc %d): %s" % (returncode, text))
        except subprocess.TimeoutExpired:
            outcome = ("failed: nvidia-smi --gpu-reset did not return within %gs (killed, abandoned after %gs if stuck)"
                       % (timeout, helperproc.KILL_WAIT_S))
        except OSError as exc:
            outcome = "failed: %s" % exc
        self.engine.start()
        self._sync_targets(force=True)
        return outcome

    # -- every stop paired with its restore
    def _undo(self, kind, what, state, restore):
        """Register the restore of a stop before the stop runs (an interrupted stop is restored too)."""
        self.undo.append({"kind": kind, "what": what, "state": state, "restore": restore})

    def restore_all(self):
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
            self.reserved_s = 0.0

    def failure_of_restores(self):
        """The task's failure when a restore did not complete, naming what is left changed; else None."""
        return left_changed_words(self.left_changed) or None

    def _act_bound(self, bound):
        """bound, cut to the time left before the restores' reserve (1 s at the least)."""
        left = self._left()
        if left is None:
            return bound
        return max(1.0, min(bound, left - self.reserved_s))

    @property
    def changed(self):
        return (bool(self.signalled) or self.reset_done or bool(self.restarted)
                or any(u.get("outcome", "").startswith("done") for u in self.found_units))


ESTIMATE_WHY = "this driver has no v2 memory call; used is v1 used minus reserved_floor_mib"


def free_words(report):
    """How a free reading may be called: "verified free" only from a v2 reading of every targeted GPU."""
    if any((g.get("memory") or {}).get("estimated") for g in report.gpus):
        return "free by estimate (%s), not verified" % ESTIMATE_WHY
    return "verified free"


def _now_ticks(proc_root="/proc"):
    """Now, in the clock ticks since boot that /proc/PID/stat's starttime uses.

    starttime counts CLOCK_BOOTTIME from the node's boot. /proc/uptime is no such clock inside a
    Proxmox container: LXCFS replaces it with the container's uptime. So the live /proc is compared
    with CLOCK_BOOTTIME itself; only a recorded /proc tree (tests) supplies its own uptime file.
    """
    try:
        if proc_root == "/proc" and hasattr(time, "CLOCK_BOOTTIME"):
            seconds = time.clock_gettime(time.CLOCK_BOOTTIME)
        else:
            seconds = float(procscan.read_text("%s/uptime" % proc_root).split()[0])
        return int(seconds * os.sysconf("SC_CLK_TCK")) - 1
    except (OSError, ValueError, IndexError):
        return 0


def scope_holders(report, index, scope):
    """Holders of GPU index that a node-side release's scope covers."""
    return [h for h in report.holders if scope.allows(h.get("container") or "") and pinning.may_hold(h, index)]


def free_for_scope(report, gpu, scope):
    """shared_gpu: own. Free, or held by nothing of the scope (its MiB by container within the threshold)."""
    if gpu["free"]:
        return True
    if gpu.get("error") or scope_holders(report, gpu["index"], scope):
        return False
    return scope_mib(gpu, scope) <= report.engine.threshold_mib


def scope_mib(gpu, scope):
    """The MiB of one GPU that the scope's containers (and the node's processes, with host_processes) hold."""
    return sum(v for k, v in (gpu.get("by_container") or {}).items() if scope.allows(k))


def others_mib(gpu, scope):
    """The MiB of one GPU that nothing of the scope holds: other containers', the node's, unattributed."""
    return max(0, ((gpu.get("memory") or {}).get("used_mib") or 0) - scope_mib(gpu, scope))


def held_by_others_mib(report, scope):
    """others_mib over the targeted GPUs."""
    return sum(others_mib(gpu, scope) for gpu in report.gpus)


def share_words(report, scope):
    """shared_gpu: own, the scope's share free: say so, and how much others hold."""
    return share_note(scope, held_by_others_mib(report, scope))


def share_note(scope, mib):
    whose = ("this container's" if len(scope.containers) == 1 and not scope.host_processes else
             "these containers'" if scope.containers and not scope.host_processes else "the scope's")
    return "%s share is free; %d MiB are held by others" % (whose, mib)


def targets_free(report, scope=None):
    """Every targeted GPU free; with a scope (shared_gpu: own), free of everything the scope holds."""
    if scope is None:
        return report.all_free
    return bool(report.gpus) and all(free_for_scope(report, g, scope) for g in report.gpus)


def _used(report):
    return dict((g["index"], (g.get("memory") or {}).get("used_mib")) for g in report.gpus)


def remaining_of(report, scope=None):
    """What still holds memory on the GPUs that are not free (for the scope, with shared_gpu: own)."""
    out = []
    for gpu in report.gpus:
        if gpu["free"] or (scope is not None and free_for_scope(report, gpu, scope)):
            continue
        holders = []
        for pid in gpu.get("holders", []):
            record = report.holder(pid)
            if record is None:
                continue
            holders.append({"pid": pid, "name": record["name"], "state": record["state"],
                            "blocked_threads": record["blocked_threads"]})
        out.append({"index": gpu["index"], "uuid": gpu.get("uuid"),
                    "used_mib": (gpu.get("memory") or {}).get("used_mib"), "holders": holders,
                    "unattributed_mib": gpu.get("unattributed_mib"), "error": gpu.get("error")})
    return out


def container_rows(before, after, vmid, one, own_only):
    """The GPU rows of container vmid: the targeted GPUs its config passes in usable, or that it holds."""
    later = dict((g.get("uuid"), g) for g in after.gpus) if after is not None else {}
    rows = []
    for gpu in before.gpus:
        mine = (gpu.get("by_container") or {}).get(vmid, 0)
        passed = gpu.get("passed_into")
        if passed is not None and int(vmid) not in passed and not mine and not scope_holders(before, gpu["index"], one):
            continue
        now = later.get(gpu.get("uuid"))
        free = None
        if after is not None:
            free = bool(now) and (free_for_scope(after, now, one) if own_only else now["free"])
        rows.append({"index": gpu["index"], "minor": gpu.get("minor"), "uuid": gpu.get("uuid"), "before_mib": mine,
                     "after_mib": None if now is None else (now.get("by_container") or {}).get(vmid, 0),
                     "others_mib": None if now is None else others_mib(now, one), "free": free})
    return rows


def no_rows_verdict(report, vmid):
    """(verdict, reason) of container vmid with no GPU row. "unknown" (the task fails) when a targeted GPU is passed
    in but unusable (deny-write, cgroup rules), when the vmid has no config on this node, or when the configs
    could not be read; "not passed in" when its config, read, gives it none of the targeted GPUs: evidence that
    nothing of it is on them, so nothing to release there."""
    blocked = []
    for gpu in report.gpus:
        rules = ["%s: %s" % (e.get("source") or "its config", e.get("rule") or "unusable")
                 for e in gpu.get("passed_unusable") or () if node.vmid_key(e.get("vmid")) == vmid]
        if rules:
            blocked.append("GPU %d (minor %s) by %s" % (gpu["index"], gpu.get("minor"), ", ".join(rules)))
    configs = getattr(report, "conf_vmids", None)
    targeted = ", ".join(str(g["index"]) for g in report.gpus) or "none"
    if blocked:
        return "unknown", ("no GPU of container %s could be described: its config passes %s in, which it cannot open "
                           "(%s)" % (vmid, "it" if len(blocked) == 1 else "them", "; ".join(blocked)))
    if configs is None:
        return "unknown", ("no GPU of container %s could be described, and the node's container configs could not be "
                           "read; its state is unknown" % vmid)
    if vmid not in configs:
        return "unknown", ("container %s has no config on this node (%s/%s.conf): a mistyped vmid, or a container on "
                           "another node; its state is unknown" % (vmid, node.PVE_LXC_DIR, vmid))
    return "not passed in", ("its config passes none of the targeted GPUs (%s) in, and it holds none of them: nothing "
                             "of it to release there" % targeted)


def per_container(before, after, releaser, refused=()):
    """On a node with containers in scope: one entry per container, its GPUs (those its config passes in, or
    that it holds) with its MiB before and after, what of it was signalled, whether it changed, its verdict."""
    scope = releaser.scope
    if scope is None or not scope.containers:
        return []
    where = dict((h["pid"], h.get("container")) for h in before.holders)
    out = []
    for vmid in sorted(scope.containers, key=int):
        if vmid in refused:
            continue
        one = node.Scope([vmid], proc_root=scope.proc_root)
        pids = set(pid for pid, ct in where.items() if ct == vmid)
        rows = container_rows(before, after, vmid, one, releaser.own_only)
        signals = [a for a in releaser.actions if a["pid"] in pids or a.get("vmid") == int(vmid)]
        done = [a for a in signals if a["outcome"] == "sent" or (a.get("vmid") and a["outcome"].startswith("done"))]
        planned = [e["pid"] for e in releaser.plan if e["pid"] in pids]
        verdict, reason = no_rows_verdict(before, vmid) if not rows else (None, "")
        if verdict:
            pass                    # empty evidence is unknown, never free (or, by the configs, none of it targeted)
        elif after is None:
            verdict = "planned" if planned else "nothing to do"
        else:
            verdict = "free" if all(r["free"] for r in rows) else "busy"
        kinds = set(a["signal"] for a in done)
        rung = ("container_restart" if "container_stop" in kinds else "sigkill" if "SIGKILL" in kinds
                else "sigterm" if "SIGTERM" in kinds else "stop" if "stop" in kinds else releaser.rung if pids else "none")
        words = ["%s %d (%s)" % (a["signal"], a["pid"], a["name"]) for a in done if a["pid"]]
        for row in rows:
            row["rung"] = rung if row["before_mib"] else "none"
            row["signals"] = words if row["before_mib"] else []
        units_here = [u for u in releaser.found_units if u["vmid"] == int(vmid)]
        others = sum(r["others_mib"] or 0 for r in rows)
        note = ""
        if verdict == "free" and releaser.own_only and others > releaser.engine.threshold_mib:
            note = share_note(one, others)
        out.append({"vmid": int(vmid), "changed": bool(done) if after is not None else bool(planned),
                    "verdict": verdict, "reason": reason, "note": note, "gpus": rows, "planned": planned,
                    "found_units": units_here,
                    "stopped": [u["name"] for u in units_here if u.get("outcome", "").startswith("done")],
                    "actions": [dict((k, a[k]) for k in ("pid", "name", "signal", "outcome", "task") if k in a) for a in signals],
                    "not_signalled": [dict(s) for s in releaser.skipped if s["pid"] in pids]})
    return out


def skipped_entries(skipped):
    """per_container entries of the containers left out before anything (locked): {vmid: reason}."""
    return [{"vmid": int(vmid), "changed": False, "verdict": "skipped", "note": "", "reason": reason, "gpus": [], "planned": [],
             "found_units": [], "stopped": [], "actions": [], "not_signalled": []} for vmid, reason in sorted(skipped.items(), key=lambda kv: int(kv[0]))]


def left_changed_words(entries):
    """What stops left changed that their restores could not put back (left_changed), as one sentence; "" if none."""
    if not entries:
        return ""
    return "left changed, its restore failed: %s" % "; ".join(
        "%s %s (%s)" % (e["what"], e["state"], e["why"]) if e["kind"] != "container" else
        "%s was stopped (freeing its GPUs) but did not start again (%s)" % (e["what"], e["why"]) for e in entries)


def backstop_result(progress):
    """changed, actions, plan, rung, reset steps and what is left changed of an interrupted release (the hard stop,
    an error), from release()'s progress; a restore still registered runs now, so nothing stays half-done."""
    releaser = (progress or {}).get("releaser")
    if releaser is None:
        return {"changed": False, "actions": [], "plan": [], "rung_reached": "none", "left_changed": []}
    releaser.restore_all()
    return {"changed": releaser.changed, "actions": list(releaser.actions), "plan": list(releaser.plan),
            "rung_reached": releaser.rung, "reset_steps": list(releaser.reset_steps),
            "left_changed": list(releaser.left_changed)}


def collateral_of(engine, releaser, before, measure_after):
    """Untargeted GPUs that the plan frees as a side effect, with their used MiB before and (after a run) after."""
    indexes = set(s["index"] for entry in releaser.plan for s in entry["side_effect_gpus"])
    indexes.update(i for job in releaser.jobs.values() for i in job["gpus"] if i not in releaser.targets)
    out = []
    for index in sorted(indexes):
        after = engine.memory(index).get("used_mib") if measure_after else None
        out.append({"index": index, "uuid": (engine.gpu(index) or {}).get("uuid"),
                    "used_mib_before": before.views.get(index, {}).get("used_mib"), "used_mib_after": after})
    return out


def _leave_out_refused(releaser, report, refused):
    """Node side, several containers in scope: the containers that the refusals are about are left out (each
    with its refusals in refused) and the others are decided again, so that one container's refusal never
    stops the others. A refusal about a process in no container, or one that would leave nothing, stops all."""
    while releaser.refusals and releaser.scope is not None and len(releaser.scope.containers) > 1:
        about = set()
        for vmids in releaser.refused_in:
            if not vmids or not vmids <= releaser.scope.containers:
                return
            about |= vmids
        if about >= releaser.scope.containers:
            return
        for msg, vmids in zip(releaser.refusals, releaser.refused_in):
            for vmid in vmids:
                refused.setdefault(vmid, []).append(msg)
        releaser.log("gpuops.fleet.gpu_release: containers %s left out, refused: %s"
                     % (", ".join(sorted(about, key=int)), " | ".join(releaser.refusals)))
        releaser.leave_out(about)
        releaser.prepare(report)


def refused_entries(refused):
    """per_container entries of the containers left out by a refusal: {vmid: [refusals]}."""
    return [dict(entry, verdict="refused") for entry in skipped_entries(
        dict((vmid, " | ".join(msgs)) for vmid, msgs in refused.items()))]


def refused_words(refused):
    if not refused:
        return ""
    return "; refused, nothing of it signalled: %s" % "; ".join(
        "container %s: %s" % (vmid, " | ".join(refused[vmid])) for vmid in sorted(refused, key=int))


def _after_stops(releaser, found, refused):
    """Stops the found units, reads again, decides again on the fresh report: the report to climb the ladder
    from, or None when the stops freed every targeted GPU. The plan keeps its first entries."""
    first = list(releaser.plan)
    releaser.stop_units(found)
    fresh = releaser.snapshot()
    if targets_free(fresh, releaser.scope if releaser.own_only else None):
        return None
    releaser.prepare(fresh)
    _leave_out_refused(releaser, fresh, refused)
    planned = set(e["pid"] for e in first)
    releaser.plan = first + [e for e in releaser.plan if e["pid"] not in planned]
    return fresh


def release(engine, targets, options, check_mode=False, log=None, lock_dir=LOCK_DIR, deadline=None, progress=None):
    """Run gpu_release on a started Engine. Returns (failed, msg, result).

    progress (a dict) gets "releaser" at once, so that a caller interrupted by a hard stop can still report
    what was signalled (backstop_result).
    """
    started = time.monotonic()
    started_epoch = time.time()
    opts = dict(options)
    releaser = Releaser(engine, targets, term_timeout=opts.get("term_timeout", 10.0),
                        kill_timeout=opts.get("kill_timeout", 10.0), verify_timeout=opts.get("verify_timeout", 30.0),
                        reset_timeout=opts.get("reset_timeout", 120.0),
                        gpu_reset=opts.get("gpu_reset", False), lock_timeout=opts.get("lock_timeout", 60.0),
                        match=opts.get("match"), protect=opts.get("protect"), deadline=deadline, log=log,
                        check_mode=check_mode, lock_dir=lock_dir, nvidia_smi=opts.get("nvidia_smi"),
                        collateral=opts.get("collateral", "refuse"),
                        collateral_tolerance_mib=opts.get("collateral_tolerance_mib", pinning.DEFAULT_TOLERANCE_MIB),
                        scope=opts.get("scope"), shared_gpu=opts.get("shared_gpu", "all"),
                        container_restart=opts.get("container_restart", False),
                        restart_backend=opts.get("restart_backend"), container_timeout=opts.get("container_timeout", 60.0),
                        stop_found_units=opts.get("stop_found_units", False), stop_timeout=opts.get("stop_timeout", 60.0),
                        stop_concurrency=opts.get("stop_concurrency", 1),
                        reset_blockers=opts.get("reset_blockers", "refuse"))

    def own():
        return releaser.scope if releaser.own_only else None

    skipped = dict(opts.get("skipped_containers") or {})
    lock_skipped = {}   # vmid -> why its own lock could not be taken (left out, the task fails naming it)
    refused = {}     # vmid -> the refusals that left it out
    if progress is not None:
        progress["releaser"] = releaser
    result = {"changed": False, "actions": releaser.actions, "rung_reached": "none", "plan": [], "lock_wait_s": 0.0,
              "lock_acquired_at": None,
              "not_signalled": [], "respawned": None, "released_mib": 0, "remaining": [], "diagnosis": [],
              "collateral": [], "jobs": [], "linked": [], "nvml_stale": [], "unknown_gpus": [], "restart_plan": [],
              "per_container": [], "found_units": [], "stop_sets": [], "reset_blockers": [], "reset_steps": [], "left_changed": [],
              "reads": {"fast": 0, "full": 0}, "view": engine.view,
              "scope": None if releaser.scope is None else {"containers": sorted(int(c) for c in releaser.scope.containers),
                                                            "host_processes": releaser.scope.host_processes}}

    def finish(failed, msg, before, after):
        result["rung_reached"] = releaser.rung
        result["changed"] = releaser.changed if not check_mode else bool(releaser.plan)
        result["before"] = gpu_summary(before, own())
        result["after"] = gpu_summary(after, own()) if after is not None else None
        result["restart_plan"] = releaser.restart_plan
        if after is not None:
            b, a = _used(before), _used(after)
            result["released_mib"] = max(0, sum((b[i] or 0) - (a.get(i) or 0) for i in b if b[i] is not None))
            result["remaining"] = remaining_of(after, own())
            result["diagnosis"] = list(after.diagnosis)
        result["plan"] = releaser.plan
        result["jobs"] = sorted(releaser.jobs.values(), key=lambda j: j["id"])
        result["linked"] = [{"pids": link["pids"], "why": link["why"]} for link in releaser.linked]
        result.update(releaser.evidence)
        result["collateral"] = collateral_of(engine, releaser, before, after is not None)
        result["not_signalled"] = releaser.skipped
        result["respawned"] = releaser.respawned
        result["per_container"] = sorted(per_container(before, after, releaser, refused) + skipped_entries(skipped)
                                         + refused_entries(refused), key=lambda entry: entry["vmid"])
        if releaser.left_changed and "left changed" not in msg:
            failed = True
            msg += "; %s" % releaser.failure_of_restores()
        if lock_skipped:
            failed = True
            msg += "; left out: %s" % "; ".join(lock_skipped[v] for v in sorted(lock_skipped, key=int))
        unknown = [e for e in result["per_container"] if e["verdict"] == "unknown"]
        if unknown:
            failed = True
            msg += "; unknown, not free: %s" % "; ".join(e["reason"] for e in unknown)
        result["found_units"] = releaser.found_units
        result["stop_sets"] = [units.shown(s) for s in releaser.stop_sets]
        result["diagnosis"] += [units.set_words(s) for s in releaser.stop_sets if s["verdict"] != "stop"]
        result["reset_blockers"] = releaser.reset_blockers
        result["reset_steps"] = releaser.reset_steps
        result["left_changed"] = releaser.left_changed
        result["reads"] = dict(releaser.reads)
        for skip in releaser.skipped:
            result["diagnosis"].append("pid %d (%s) holds a targeted GPU but was not signalled: %s"
                                       % (skip["pid"], skip["name"], skip["reason"]))
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        return failed, msg, result

    def with_shm(report, failed, msg, res):
        """A free outcome with clean_shm: the residue the report read listed (check mode) or removed, said in msg."""
        if failed or not opts.get("shm_prefixes"):
            return failed, msg, res
        lost = locks.lost_words()
        if lost:
            return True, "%s; /dev/shm was not cleaned: %s" % (msg, lost), res
        found, removed, left, skipped = shmclean.clean(engine, report, releaser.scope, started_epoch, check_mode,
                                                       opts["shm_prefixes"])
        res.update(shm_residue=found, shm_removed=removed, shm_left=left, shm_skipped=skipped)
        if skipped:
            msg += "; /dev/shm not cleaned in %s" % "; ".join(
                "%s: %s" % ("this host" if e["vmid"] is None else "container %d" % e["vmid"], e["why"]) for e in skipped)
        if check_mode and found:
            res["changed"] = True
            msg += "; %d shared-memory residue files would be removed" % len(found)
        elif removed or left:
            res["changed"] = res["changed"] or bool(removed)
            msg += "; %d shared-memory residue files removed%s" % (len(removed), "" if not left else ", %d left (%s)" % (
                len(left), "; ".join("%s: %s" % (e["path"], e["why"]) for e in left)))
        res["elapsed_s"] = round(time.monotonic() - started, 3)
        return any(not e.get("kept") for e in left), msg, res

    def read_shm(on):
        """clean_shm: /dev/shm is read by the first and the last snapshot only (residue older than the start)."""
        on = on and bool(opts.get("shm_prefixes"))
        engine.shm_prefixes, engine.shm_since = (opts["shm_prefixes"], started_epoch) if on else (None, None)

    if not targets:
        return True, "no GPU targeted, nothing was signalled", dict(result, elapsed_s=round(time.monotonic() - started, 3))
    gpu_keys = [(engine.gpu(i) or {}).get("uuid") or "index-%d" % i for i in targets]
    locks = GpuLocks(lock_dir)
    if not check_mode:
        wait = opts.get("lock_timeout", 60.0)
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            locks.acquire(gpu_keys, wait)
            if releaser.scope is not None and releaser.scope.containers:
                locks = ContainerLocks(locks, engine.proc_root, releaser.scope, gpu_keys, wait - locks.waited_s, deadline)
        except (LockTimeout, LockDirError) as exc:
            locks.release()
            return True, "%s; nothing was signalled" % exc, dict(result, elapsed_s=round(time.monotonic() - started, 3))
        lock_skipped.update(getattr(locks, "skipped", {}))
        if lock_skipped:
            skipped.update(lock_skipped)
            releaser.leave_out(set(lock_skipped))
            if not (releaser.scope.containers or releaser.scope.host_processes):
                locks.release()
                return True, "no container in scope could be locked, nothing was signalled: %s" % "; ".join(
                    lock_skipped[v] for v in sorted(lock_skipped, key=int)), dict(
                    result, per_container=skipped_entries(skipped), elapsed_s=round(time.monotonic() - started, 3))
        result["lock_wait_s"] = round(locks.waited_s, 3)
        result["lock_acquired_at"] = round(time.time(), 3)

    def locked():
        """From the first snapshot to the verdict and the /dev/shm removals, under the GPU locks."""
        read_shm(True)
        try:
            before = releaser.snapshot()
            read_shm(False)
            result.update(releaser.evidence)
            late = releaser.late_read(before)
            if late:
                result["diagnosis"] = list(before.diagnosis)
                return finish(True, "%s (timeout %ss)" % (late, opts.get("timeout")), before, None)
            broken = before.errors
            if broken:
                msg = "; ".join("GPU %s%s: %s" % (g["index"], " (%s)" % g["uuid"] if g.get("uuid") else "", g["error"])
                                for g in broken)
                result["diagnosis"] = list(before.diagnosis)
                return finish(True, "NVML failed, nothing was signalled: " + msg, before, None)
            if targets_free(before, own()):
                estimate = "" if free_words(before) == "verified free" else " (by estimate: %s)" % ESTIMATE_WHY
                msg = ("every targeted GPU is already free" + estimate if before.all_free else
                       "nothing of %s holds the targeted GPUs (shared_gpu: own): %s"
                       % (releaser.scope.describe(), share_words(before, releaser.scope)))
                return with_shm(before, *finish(False, msg, before, before))
            reset_refusals = releaser.plan_reset(before)
            if reset_refusals:
                result["diagnosis"] = list(before.diagnosis)
                return finish(True, "gpu_reset: a reset would be blocked (reset_blockers: %s), nothing was signalled: %s"
                              % (releaser.reset_mode, " | ".join(reset_refusals)), before, None)
            releaser.prepare(before)
            _leave_out_refused(releaser, before, refused)
            if releaser.refusals:
                result["diagnosis"] = list(before.diagnosis)
                return finish(True, " | ".join(releaser.refusals), before, None)
            found = releaser.find_units(before)
            if check_mode:
                result["diagnosis"] = list(before.diagnosis)
                return with_shm(before, *finish(bool(refused), "check mode: %d processes would be signalled%s%s" % (
                    len(releaser.plan), "" if not found else ", after %d units stopped" % len(found),
                    refused_words(refused)), before, None))
            lost = locks.lost_words()
            if lost:
                return finish(True, "%s; nothing was signalled" % lost, before, None)
            try:
                if found:
                    fresh = _after_stops(releaser, found, refused)
                    if releaser.refusals:
                        after = releaser.snapshot()
                        return finish(True, " | ".join(releaser.refusals), before, after)
                    if fresh is not None:
                        releaser.run(fresh)
                else:
                    releaser.run(before)
            except ReleaseTimeout as exc:
                after = releaser.snapshot()
                return finish(True, "%s (timeout %ss)" % (exc, opts.get("timeout")), before, after)
            read_shm(True)
            after = releaser.snapshot()
            lost = locks.lost_words()
        finally:
            read_shm(False)
            releaser.restore_all()    # a restore still registered (an error, a hard stop) runs before the locks go
        if releaser.failure:
            return finish(True, releaser.failure, before, after)
        if lost:
            return finish(True, "%s, during this release: its outcome is not trusted" % lost, before, after)
        if releaser.missing:
            return finish(True, "GPU %s is not free: NVML no longer lists it after it was opened again (a reset that "
                          "did not bring the GPU back, or a driver restart); find it with nvidia-smi on the node"
                          % ", ".join(releaser.missing), before, after)
        if targets_free(after, own()):
            words = free_words(after)
            msg = (words if after.all_free else "%s of %s (shared_gpu: own): %s"
                   % (words, releaser.scope.describe(), share_words(after, releaser.scope)))
            return with_shm(after, *finish(bool(refused), msg + refused_words(refused), before, after))
        busy = [g for g in after.gpus if not (free_for_scope(after, g, own()) if own() else g["free"])]
        tried = ", ".join("%s to %d: %s" % (a["signal"], a["pid"], a["outcome"]) if a["pid"] else
                          "%s %s: %s" % (a["signal"], a["name"], a["outcome"]) for a in releaser.actions) or "nothing"
        failed, msg, res = finish(True, "", before, after)
        res_msg = ("GPU %s not free after the ladder (used %s MiB, threshold %s MiB); tried: %s; diagnosis: %s%s"
                   % (", ".join(str(g["index"]) for g in busy),
                      ", ".join(str((g.get("memory") or {}).get("used_mib")) for g in busy),
                      engine.threshold_mib, tried, " | ".join(res["diagnosis"]), refused_words(refused)))
        return failed, res_msg + msg, res   # msg: what finish() adds (containers whose state is unknown)

    try:
        return locked()
    finally:
        locks.release()
