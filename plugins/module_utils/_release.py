# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The release ladder: TERM, KILL, wait, restart, reset, verify (private helper): the Releaser and release().

Signals only processes that /proc shows holding a targeted GPU, each guarded against pid reuse (_signals). The
locks are _locks', the rungs past the signals _rungs', the verdict and its words _verdict's. No AnsibleModule here.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

from ansible_collections.gpuops.fleet.plugins.module_utils import _blockers as blockers
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _respawn as respawn
from ansible_collections.gpuops.fleet.plugins.module_utils import _restart as restart
from ansible_collections.gpuops.fleet.plugins.module_utils import _rungs as rungs
from ansible_collections.gpuops.fleet.plugins.module_utils import _shmclean as shmclean
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils import _verdict as verdicts
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where
from ansible_collections.gpuops.fleet.plugins.module_utils._access import read_drm_refcount
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import (  # noqa: F401 (decide: tests' name)
    decide, generic_unit, plan_entry, stop_set_verdict,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._hardstop import ReleaseTimeout
from ansible_collections.gpuops.fleet.plugins.module_utils._locks import (
    LOCK_DIR, ContainerLocks, GpuLocks, LockDirError, LockTimeout,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._rungs import RESTORE_STEP_S, find_nvidia_smi  # noqa: F401
from ansible_collections.gpuops.fleet.plugins.module_utils._signals import (  # noqa: F401 (the module's, until _params)
    HAS_PSUTIL, PSUTIL_IMPORT_ERROR, _now_ticks, alive, send_guarded,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._verdict import (  # noqa: F401 (callers' names)
    held_by_others_mib, left_changed_words, share_words, targets_free,
)

RUNGS = ("none", "sigterm", "sigkill", "wait", "container_restart", "reset")
POLL_S = 0.075
FULL_READ_EVERY_S = 1.0  # shared_gpu: own polls read NVML alone in between (_scope_still_holds)
GRACE_S = 1.0            # once nothing visible here holds a GPU, how long to wait for its memory
UNIT_WORDS = units.KIND_WORDS
RESPAWN_WINDOW_S = 3.0   # how long to watch the parents of killed holders after the verdict
RESPAWN_STARTING_S = 6.0  # longer while a new child of theirs is still starting (maps nothing yet)
HEIR_ROUNDS = 3          # re-reads after the signals, for holders pinned only once their parent is dead
HEIR_WAIT_S = 0.3        # memory of a reaped holder is back 0.12-0.2 s after SIGKILL (GPU_FACTS row 2)
SNAPSHOT_TRIES = 3       # reads of the GPUs while NVML is not opened again meanwhile (a new helper)
# The release's options when a caller gives a dict without some (until _params.ReleaseOptions is merged: issue 46).
LEGACY_DEFAULTS = dict(
    term_timeout=10.0, kill_timeout=10.0, verify_timeout=30.0, reset_timeout=120.0, gpu_reset=False, lock_timeout=60.0,
    timeout=None, match=None, protect=None, nvidia_smi=None, collateral="refuse",
    collateral_tolerance_mib=pinning.DEFAULT_TOLERANCE_MIB, scope=None, shared_gpu="all", container_restart=False,
    restart_backend=None, container_timeout=60.0, stop_found_units=False, stop_timeout=60.0, stop_concurrency=1,
    reset_blockers="refuse", skipped_containers=None, shm_prefixes=None,
)


def options_of(options):
    """The options object of a release: options itself, or a dict's keys as attributes (LEGACY_DEFAULTS filling
    in the missing ones)."""
    if isinstance(options, dict):
        return SimpleNamespace(**dict(LEGACY_DEFAULTS, **options))
    return options


class Releaser(object):
    """Runs the ladder for the targeted GPU indexes of an Engine. opts: the release's options, as attributes named
    as the keys of the options dict that gpu_release passes to release() (_params.ReleaseOptions)."""

    def __init__(self, engine, targets, opts=None, deadline=None, log=None, check_mode=False, poll_s=POLL_S):
        opts = options_of(opts if opts is not None else {})
        self.engine, self.opts, self.check_mode, self.poll_s = engine, opts, check_mode, poll_s
        self.clock = rungs.Clock(deadline)
        self.recorder = rungs.Recorder(log)
        self.restores = rungs.Restores(self.clock)
        self.log, self.started, self.actions = self.recorder.log, self.recorder.started, self.recorder.actions
        self.reset_steps, self.undo, self.left_changed = self.recorder.reset_steps, self.restores.undo, self.restores.left_changed
        self.restarter = rungs.ContainerRestart(self.clock, self.recorder, self.restores,
                                                getattr(opts, "restart_backend", None), opts.container_timeout)
        self.restarted = self.restarter.restarted
        self.reset_mode = opts.reset_blockers
        self.reset_blockers, self.reset_services, self.reset_persistence = [], [], []  # plan_reset's, on a node
        self.stop_sets, self.found_units, self.unstopped_units = [], [], []  # find_units': decided, stopped, named
        self.scope = opts.scope
        self.own_only = opts.scope is not None and opts.shared_gpu == "own"
        self.targets = list(targets)
        # GPUs are their UUIDs: after an NVML re-init (a reset, a new helper) the indexes are resolved again
        self.target_uuids = [((engine.gpu(i) or {}).get("uuid"), i) for i in self.targets]
        self.missing = []          # targeted UUIDs NVML no longer lists: never free
        engine.deadline = deadline   # reads through a container's root and MPS asks, in each snapshot, end by it
        self.proc_root = engine.proc_root
        self.rung = "none"
        self.signalled, self.protected, self.jobs = {}, {}, {}  # pid -> record; pid -> why left alone (decide)
        self.skipped, self.to_signal, self.plan, self.refusals, self.linked, self.restart_plan = [], [], [], [], [], []
        self.refused_in = []     # per refusal, the set of containers (vmids) it is about; empty: not only containers
        self._ranks, self._known_pids, self.rank_deaths = [], set(), {}
        self.evidence = {"nvml_stale": [], "unknown_gpus": []}
        self.failure = None      # message when the task must fail
        self.respawned = None
        self.watch = None        # respawn.RespawnWatch, from the first signal on
        self.reset_done = False
        self.shm = False         # (prefixes, since) while /dev/shm is to be read by the next snapshot
        self.last_report = None  # the last full read (snapshot), for the cheap polls of shared_gpu: own
        self.last_full_at = None
        self.reads = {"fast": 0, "full": 0}

    # -- helpers
    @property
    def deadline(self):
        return self.clock.deadline

    @deadline.setter
    def deadline(self, value):
        self.clock.deadline = value

    @property
    def reserved_s(self):
        return self.clock.reserved_s

    def now(self):
        return self.clock.now()

    def late_read(self, report):
        """Why nothing may be signalled after the read of report: the overall timeout was reached during it (an MPS
        control daemon that did not answer, say), or None."""
        left = self.clock.left()
        return None if left is None or left > 0 else verdicts.late_words(report)

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
            report = self.engine.snapshot(self.targets, rank_deaths=self.rank_deaths, shm=self.shm)
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
            mine = where.mib_by_container(procs, None, last.holders, self.proc_root, stale, index)
            if sum(mib for place, mib in mine.items() if self.scope.allows(place)) > self.engine.threshold_mib:
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
        self.recorder.signal(record, signame, outcome)

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
        end = self.clock.until(seconds)
        while True:
            if self._respawn_seen():
                return "respawn"
            if self._memory_free():
                return "free"
            if not [r for r in watched if alive(r, self.proc_root)]:
                return "gone"
            if self.now() >= end:
                self.clock.check(during)
                return "timeout"
            time.sleep(self.poll_s)

    # -- the ladder, the respawn watch and the container rung's plan
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
        end, starting_end = self.clock.until(RESPAWN_WINDOW_S), self.clock.until(RESPAWN_STARTING_S)
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
                self._verify_wait(self.opts.verify_timeout, [])

    def _decide(self, report):
        return decide(report, self.targets, [g["index"] for g in self.engine.gpus], self.opts.match, self.opts.protect,
                      self.engine.own_tree_skip(), self.opts.collateral, self.opts.collateral_tolerance_mib, self.scope)

    def prepare(self, report):
        """Decide whom to signal; returns the plan (check mode's answer). self.refusals stops the task."""
        decision = self._decide(report)
        self.to_signal, self.skipped, self.refusals = decision.to_signal, decision.skipped, decision.refusals
        self.protected = decision.protected
        place_of = dict((r["pid"], r.get("container")) for r in list(report.holders) + list(report.clients))
        self.refused_in = [self._containers_of(pids, place_of) for pids in decision.refused_pids]
        self.jobs = decision.jobs
        self._known_pids = set(r["pid"] for r in report.holders) | set(r["pid"] for r in report.clients)
        uuid_of = dict((g["index"], g.get("uuid")) for g in self.engine.gpus)
        self._ranks = [[(m["pid"], m["starttime_ticks"], dict((uuid_of.get(i), mib) for i, mib in m["shares_mib"].items()))
                        for m in job["members"]] for job in report.jobs.values()]
        self.plan = [plan_entry(r, self.targets, decision, self.opts.collateral_tolerance_mib) for r in self.to_signal]
        planned = set(r["pid"] for r in self.to_signal)
        self.linked = [link for link in report.linked if planned & set(link["pids"])]
        for entry in self.plan:
            entry["linked"] = sorted(p for link in self.linked for p in link["pids"]
                                     if entry["pid"] in link["pids"] and p != entry["pid"])
        if self.opts.container_restart and self.scope is not None:
            self.restart_plan = self._restart_plan(report)
        return self.plan

    def _containers_of(self, pids, place_of):
        """The containers of pids (a set of vmids), or an empty set when one of them is in none or cannot be read."""
        out = set()
        for pid in pids:
            vmid = place_of.get(pid) or where.container_of_pid(pid, self.proc_root)
            if vmid in (None, where.HOST, where.UNATTRIBUTED):
                return set()
            out.add(vmid)
        return out

    def _refuse(self, msg, vmid):
        self.refusals.append(msg)
        self.refused_in.append(set([vmid]))

    def leave_out(self, vmids):
        """Narrow the scope: vmids' processes are no longer signalled (their container was refused)."""
        self.scope = where.Scope(self.scope.containers - set(vmids), self.scope.host_processes, self.proc_root)

    def find_units(self, report):
        """The stop sets of the planned holders (node view), each decided on report (units.plan_sets) and printed
        (stop_sets): those decided "stop" are returned to stop with stop_found_units, else only named, should one of
        them respawn its holder. A set refused or not found is never stopped: its holders are signalled alone."""
        if self.scope is None or self.engine.view != "node":
            return []
        skipped = dict((s["pid"], s["reason"]) for s in self.skipped)
        self.stop_sets = units.plan_sets(report, self.to_signal, skipped, self.targets,
                                         [g["index"] for g in self.engine.gpus], self.opts.collateral, self.opts.collateral_tolerance_mib,
                                         self.proc_root)
        for entry in self.plan:
            entry["stop_set"] = next(("%s %s in container %s: %s" % (UNIT_WORDS.get(s["kind"], s["kind"]), s["name"],
                                                                     s["vmid"], s["verdict"]) if s["kind"] else None
                                      for s in self.stop_sets if entry["pid"] in s["pids"]), None)
        allowed = [s for s in self.stop_sets if s["verdict"] == "stop"]
        named = [dict((k, s[k]) for k in ("vmid", "kind", "name", "evidence", "pids")) for s in allowed]
        if not self.opts.stop_found_units:
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

    def _restart_plan(self, report):
        """Per scoped container holding a targeted GPU: every process a restart would stop, and the restart decided
        as a stop set (_restart_verdict); a refusal stops the task before any signal."""
        members = where.processes_by_container(self.proc_root, getattr(report, "scan", None))
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
                     "collateral": verdict["collateral"], "backend": getattr(self.restarter.backend, "name", None),
                     "refusal": restart.refusal(self.restarter.backend, vmid) if self.restarter.backend else None}
            if verdict["verdict"] != "stop":
                self._refuse(verdicts.restart_words(vmid, verdict, len(entry["processes"])), vmid)
            out.append(entry)
        return out

    def _restart_verdict(self, report, vmid, processes):
        """A restart of container vmid decided as a stop set on report: every process of it is a member; container_restart
        is the consent for those that hold no GPU; GPU work that is not targeted is collateral (C1: no tolerance for a
        process whose only GPUs are not targeted)."""
        members = [{"pid": p["pid"], "name": p["name"], "why": "a process of container %s" % vmid} for p in processes]
        return stop_set_verdict({"kind": "container", "members": members}, report, self.targets,
                                [g["index"] for g in self.engine.gpus], self._still_planned(report), self.protected,
                                self.opts.collateral, self.opts.collateral_tolerance_mib)

    def _still_planned(self, report):
        """The planned or signalled holders that report still shows as the same processes (pid and start time): a
        pid reused since the plan is a new process, never given a planned holder's tolerance (R9)."""
        out = []
        for record in list(self.to_signal) + list(self.signalled.values()):
            now = report.holder(record["pid"]) if hasattr(report, "holder") else None
            if now is None or now.get("starttime_ticks") == record.get("starttime_ticks"):
                out.append(record["pid"])
        return out

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
            self.failure = self._restart_refusal(report, why, entry["vmid"]) or self.restarter.restart(report, entry["vmid"])
            if self.failure:
                return

    def _restart_refusal(self, report, why, vmid):
        """Why container vmid is not stopped, decided before anything changes: locked or HA-managed (read again
        right before the stop: a backup may have started since the plan), a holder stuck in the driver, too little
        time left for its stop and its start. None: go on."""
        refusal = restart.refusal(self.restarter.backend, vmid)
        if refusal:
            return "%s; %s" % (why, refusal)
        processes = where.processes_by_container(self.proc_root, getattr(report, "scan", None)).get(str(vmid), [])
        verdict = self._restart_verdict(report, str(vmid), processes)
        if verdict["verdict"] != "stop":
            return "%s; decided again right before the stop: %s" % (why, verdicts.restart_words(vmid, verdict, len(processes)))
        stuck = verdicts.stuck_refusal(report, vmid)
        if stuck:
            return stuck
        return self.clock.no_time_for(self.opts.container_timeout, "stop container %s and start it again" % vmid)

    def _container_holds(self, report, vmid):
        for gpu in report.gpus:
            if gpu["index"] in self.targets and not gpu["free"] and (gpu.get("by_container") or {}).get(vmid, 0) > 0:
                return True
        return any(h.get("container") == vmid and set(self.targets) & set(h["gpus"] + h["ambiguous_gpus"])
                   for h in report.holders)

    def _escalate(self, records, watched):
        """SIGTERM, wait, SIGKILL the survivors, wait; returns the last wait's outcome."""
        self._set_rung("sigterm")
        self._signal(records, signal.SIGTERM, "SIGTERM")
        outcome = self._wait(self.opts.term_timeout, watched, "SIGTERM")
        if outcome == "respawn":
            return outcome
        survivors = [r for r in records if alive(r, self.proc_root)]
        if outcome != "free" and survivors:
            survivors = self._still_holding(survivors)
        if outcome != "free" and survivors:
            self._set_rung("sigkill")
            self._signal(survivors, signal.SIGKILL, "SIGKILL")
            outcome = self._wait(self.opts.kill_timeout, watched, "SIGKILL")
        return outcome

    def _fresh_report(self):
        """A new snapshot, told which ranks of the jobs seen at the start died since (residue evidence)."""
        self._sync_targets()
        index_of = dict((g.get("uuid"), g["index"]) for g in self.engine.gpus if g.get("uuid"))
        deaths = {}
        for members in self._ranks:
            gone = [m for m in members if not where.same_process(m[0], m[1], self.proc_root)]
            survivors = [m[0] for m in members if m not in gone]
            for pid, dummy, shares in gone:
                for uuid, mib in shares.items():
                    if uuid in index_of:     # ranks' shares are kept by UUID: indexes may move on a re-init
                        deaths.setdefault(index_of[uuid], []).append({"pid": pid, "mib": mib, "survivors": survivors})
        self.rank_deaths = deaths
        return self.snapshot()

    def _still_holding(self, survivors):
        """The SIGTERM survivors that still hold a targeted GPU (one that let go is writing a checkpoint)."""
        report = self._fresh_report()
        decision = self._decide(report)
        keep = set(r["pid"] for r in decision.to_signal)
        out = []
        for record in survivors:
            if record["pid"] in keep or record.get("_why") == "job_member":
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
            self.plan.append(plan_entry(record, self.targets, decision, self.opts.collateral_tolerance_mib))
        return fresh

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
        rungs.MpsClients(self.clock, self.recorder).run(report, [r for r in self.to_signal if r.get("mps_role") == "client"])
        outcome = self._signals(watched)
        if outcome == "respawn" or (not self.failure and outcome == "free"):
            self._settled_on(outcome)
            return
        if self.failure:
            return
        # D-state threads, or memory held by something not signalled: wait up to verify_timeout
        if [r for r in watched if alive(r, self.proc_root)]:
            self._set_rung("wait")
        outcome = self._verify_wait(self.opts.verify_timeout, watched)
        if outcome in ("respawn", "free"):
            self._settled_on(outcome)
            return
        self._past_signals()

    def _signals(self, watched):
        """SIGTERM and SIGKILL the plan, then each round of heirs (HEIR_ROUNDS); the last wait's outcome."""
        outcome = "gone"
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
        return outcome

    def _settled_on(self, outcome):
        """A respawn, or "free" followed by the respawn watch: a respawn may still leave the container rung."""
        if outcome == "respawn" or self._watch_after_verdict():
            self._after_respawn()   # after "free": a child started again, the container rung still applies

    def _past_signals(self):
        """The signals left the targeted memory held: the container rung, then the reset."""
        if self.restart_plan:
            self._restart_containers("SIGKILL left the targeted memory held")
            if self.failure:
                return
            if self.restarted and self._verify_wait(self.opts.verify_timeout, []) == "free":
                return
        if self.opts.gpu_reset:
            self._reset()
            self._verify_wait(self.opts.reset_timeout, [])

    def _verify_wait(self, seconds, watched, grace_s=GRACE_S):
        """Poll until free; stop grace_s after no watched process is left."""
        end = self.clock.until(seconds)
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
                self.clock.check("verify")
                return "timeout"
            time.sleep(self.poll_s)

    def plan_reset(self, report):
        """With gpu_reset on a node: what would block a reset of the targets (self.reset_blockers), and the
        refusals that stop the release before anything is signalled."""
        if not self.opts.gpu_reset or self.engine.view != "node":
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

    # -- the rungs past the signals (_rungs)
    def stop_units(self, found):
        """Stop each found unit through its container's own manager, stop_concurrency containers at once."""
        rungs.UnitStops(self.clock, self.recorder, self.opts.stop_timeout, self.opts.stop_concurrency).run(
            found, self.found_units, self.stop_sets)

    def _reset(self):
        """nvidia-smi --gpu-reset for each targeted GPU still used (rungs.GpuReset)."""
        self._set_rung("reset")
        reset = rungs.GpuReset(self.clock, self.recorder, self.restores, self.engine,
                               getattr(self.opts, "nvidia_smi", None) or find_nvidia_smi(),
                               (self.opts.reset_timeout, self.opts.stop_timeout))
        try:
            failure = reset.run(self.snapshot, lambda: self._sync_targets(force=True), self.reset_services,
                                self.reset_persistence)
        finally:
            self.reset_done = self.reset_done or reset.done
        self.failure = self.failure or failure

    # -- every stop paired with its restore (rungs.Restores)
    def _undo(self, kind, what, state, restore):
        self.restores.register(kind, what, state, restore)

    def restore_all(self):
        self.restores.run_all()

    def failure_of_restores(self):
        return self.restores.failure()

    @property
    def changed(self):
        return (bool(self.signalled) or self.reset_done or bool(self.restarted)
                or any(u.get("outcome", "").startswith("done") for u in self.found_units))


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


class _Call(object):
    """One release() call: its releaser, its result so far, the containers left out, its locks."""

    def __init__(self, engine, targets, opts, check_mode, releaser):
        self.engine, self.targets, self.opts, self.check_mode, self.releaser = engine, targets, opts, check_mode, releaser
        self.started, self.started_epoch = time.monotonic(), time.time()
        self.skipped = dict(getattr(opts, "skipped_containers", None) or {})
        self.lock_skipped = {}   # vmid -> why its own lock could not be taken (left out, the task fails naming it)
        self.refused = {}        # vmid -> the refusals that left it out
        self.locks = None
        scope = releaser.scope
        self.result = {
            "changed": False, "actions": releaser.actions, "rung_reached": "none", "plan": [], "lock_wait_s": 0.0,
            "lock_acquired_at": None, "not_signalled": [], "respawned": None, "released_mib": 0, "remaining": [],
            "diagnosis": [], "collateral": [], "jobs": [], "linked": [], "nvml_stale": [], "unknown_gpus": [],
            "restart_plan": [], "per_container": [], "found_units": [], "stop_sets": [], "reset_blockers": [],
            "reset_steps": [], "left_changed": [], "reads": {"fast": 0, "full": 0}, "view": engine.view,
            "scope": None if scope is None else {"containers": sorted(int(c) for c in scope.containers),
                                                 "host_processes": scope.host_processes}}

    def own(self):
        return self.releaser.scope if self.releaser.own_only else None

    def elapsed(self):
        return round(time.monotonic() - self.started, 3)

    def shm(self, on):
        """clean_shm: /dev/shm is read by the first and the last snapshot only (residue older than the start)."""
        prefixes = getattr(self.opts, "shm_prefixes", None)
        self.releaser.shm = (prefixes, self.started_epoch) if on and prefixes else False

    def stopped(self, failed, msg, before, after=None):
        """finish() of a release stopped before the ladder: the diagnosis is before's."""
        self.result["diagnosis"] = list(before.diagnosis)
        return _finish(self, failed, msg, before, after)


def _failures(call, failed, msg):
    """finish()'s additions to the message: restores that failed, containers left out or unknown."""
    releaser, result = call.releaser, call.result
    if releaser.left_changed and "left changed" not in msg:
        failed = True
        msg += "; %s" % releaser.failure_of_restores()
    if call.lock_skipped:
        failed = True
        msg += "; left out: %s" % "; ".join(call.lock_skipped[v] for v in sorted(call.lock_skipped, key=int))
    unknown = [e for e in result["per_container"] if e["verdict"] == "unknown"]
    if unknown:
        failed = True
        msg += "; unknown, not free: %s" % "; ".join(e["reason"] for e in unknown)
    return failed, msg


def _finish(call, failed, msg, before, after):
    releaser, result, own = call.releaser, call.result, call.own()
    result.update(rung_reached=releaser.rung, changed=releaser.changed if not call.check_mode else bool(releaser.plan),
                  before=verdicts.gpu_summary(before, own), restart_plan=releaser.restart_plan,
                  after=verdicts.gpu_summary(after, own) if after is not None else None)
    if after is not None:
        result.update(released_mib=verdicts.released_mib(before, after), remaining=verdicts.remaining_of(after, own),
                      diagnosis=list(after.diagnosis))
    result.update(plan=releaser.plan, jobs=sorted(releaser.jobs.values(), key=lambda j: j["id"]),
                  linked=[{"pids": link["pids"], "why": link["why"]} for link in releaser.linked])
    result.update(releaser.evidence)
    result.update(collateral=collateral_of(call.engine, releaser, before, after is not None),
                  not_signalled=releaser.skipped, respawned=releaser.respawned,
                  per_container=sorted(verdicts.per_container(before, after, releaser, call.refused)
                                       + verdicts.skipped_entries(call.skipped) + verdicts.refused_entries(call.refused),
                                       key=lambda entry: entry["vmid"]))
    failed, msg = _failures(call, failed, msg)
    result.update(found_units=releaser.found_units, stop_sets=[units.shown(s) for s in releaser.stop_sets],
                  reset_blockers=releaser.reset_blockers, reset_steps=releaser.reset_steps,
                  left_changed=releaser.left_changed, reads=dict(releaser.reads))
    result["diagnosis"] += [units.set_words(s) for s in releaser.stop_sets if s["verdict"] != "stop"]
    for skip in releaser.skipped:
        result["diagnosis"].append("pid %d (%s) holds a targeted GPU but was not signalled: %s"
                                   % (skip["pid"], skip["name"], skip["reason"]))
    result["elapsed_s"] = call.elapsed()
    return failed, msg, result


def _with_shm(call, report, failed, msg, res):
    """A free outcome with clean_shm: the residue the report read listed (check mode) or removed, said in msg."""
    prefixes = getattr(call.opts, "shm_prefixes", None)
    if failed or not prefixes:
        return failed, msg, res
    lost = call.locks.lost_words()
    if lost:
        return True, "%s; /dev/shm was not cleaned: %s" % (msg, lost), res
    found, removed, left, skipped = shmclean.clean(call.engine, report, call.releaser.scope, call.started_epoch,
                                                   call.check_mode, prefixes)
    res.update(shm_residue=found, shm_removed=removed, shm_left=left, shm_skipped=skipped)
    msg += shmclean.outcome_words(found, removed, left, skipped, call.check_mode)
    if call.check_mode and found:
        res["changed"] = True
    elif removed or left:
        res["changed"] = res["changed"] or bool(removed)
    res["elapsed_s"] = call.elapsed()
    return any(not e.get("kept") for e in left), msg, res


def _take_locks(call, gpu_keys, deadline):
    """Take the GPU locks (and each scoped container's); (failed, msg, result) when the release cannot go on."""
    releaser, result = call.releaser, call.result
    wait = call.opts.lock_timeout
    if deadline is not None:
        wait = max(0.0, min(wait, deadline - time.monotonic()))
    try:
        call.locks.acquire(gpu_keys, wait)
        if releaser.scope is not None and releaser.scope.containers:
            call.locks = ContainerLocks(call.locks, call.engine.proc_root, releaser.scope, gpu_keys,
                                        wait - call.locks.waited_s, deadline)
    except (LockTimeout, LockDirError) as exc:
        call.locks.release()
        return True, "%s; nothing was signalled" % exc, dict(result, elapsed_s=call.elapsed())
    call.lock_skipped.update(getattr(call.locks, "skipped", {}))
    if call.lock_skipped:
        call.skipped.update(call.lock_skipped)
        releaser.leave_out(set(call.lock_skipped))
        if not (releaser.scope.containers or releaser.scope.host_processes):
            call.locks.release()
            return True, "no container in scope could be locked, nothing was signalled: %s" % "; ".join(
                call.lock_skipped[v] for v in sorted(call.lock_skipped, key=int)), dict(
                result, per_container=verdicts.skipped_entries(call.skipped), elapsed_s=call.elapsed())
    result["lock_wait_s"] = round(call.locks.waited_s, 3)
    result["lock_acquired_at"] = round(time.time(), 3)
    return None


def _before_ladder(call, before):
    """What stops the release on its first read, before anything is signalled: (failed, msg, result), or None."""
    releaser, timeout = call.releaser, getattr(call.opts, "timeout", None)
    late = releaser.late_read(before)
    if late:
        return call.stopped(True, "%s (timeout %ss)" % (late, timeout), before)
    if before.errors:
        return call.stopped(True, verdicts.broken_words(before.errors), before)
    if targets_free(before, call.own()):
        return _with_shm(call, before, *_finish(call, False, verdicts.already_free_words(before, releaser.scope),
                                                before, before))
    reset_refusals = releaser.plan_reset(before)
    if reset_refusals:
        return call.stopped(True, "gpu_reset: a reset would be blocked (reset_blockers: %s), nothing was signalled: %s"
                            % (releaser.reset_mode, " | ".join(reset_refusals)), before)
    releaser.prepare(before)
    _leave_out_refused(releaser, before, call.refused)
    if releaser.refusals:
        return call.stopped(True, " | ".join(releaser.refusals), before)
    return None


def _climb(call, before):
    """Check mode's answer, or the ladder run: (failed, msg, result) when it ends the release, else None."""
    releaser = call.releaser
    found = releaser.find_units(before)
    if call.check_mode:
        return _with_shm(call, before, *call.stopped(bool(call.refused), "check mode: %d processes would be signalled%s%s"
                                                     % (len(releaser.plan), "" if not found else
                                                        ", after %d units stopped" % len(found),
                                                        verdicts.refused_words(call.refused)), before))
    lost = call.locks.lost_words()
    if lost:
        return _finish(call, True, "%s; nothing was signalled" % lost, before, None)
    try:
        fresh = _after_stops(releaser, found, call.refused) if found else before
        if releaser.refusals:
            return _finish(call, True, " | ".join(releaser.refusals), before, releaser.snapshot())
        if fresh is not None:
            releaser.run(fresh)
    except ReleaseTimeout as exc:
        after = releaser.snapshot()
        return _finish(call, True, "%s (timeout %ss)" % (exc, getattr(call.opts, "timeout", None)), before, after)
    return None


def _verdict_of(call, before, after, lost):
    """The release's outcome once the ladder ran: (failed, msg, result)."""
    releaser, refused, own = call.releaser, call.refused, call.own()
    if releaser.failure:
        return _finish(call, True, releaser.failure, before, after)
    if lost:
        return _finish(call, True, "%s, during this release: its outcome is not trusted" % lost, before, after)
    if releaser.missing:
        return _finish(call, True, "GPU %s is not free: NVML no longer lists it after it was opened again (a reset "
                       "that did not bring the GPU back, or a driver restart); find it with nvidia-smi on the node"
                       % ", ".join(releaser.missing), before, after)
    if targets_free(after, own):
        msg = verdicts.freed_words(after, releaser.scope)
        return _with_shm(call, after, *_finish(call, bool(refused), msg + verdicts.refused_words(refused), before, after))
    failed, msg, res = _finish(call, True, "", before, after)
    words = verdicts.busy_words(after, own, releaser.actions, call.engine.threshold_mib, res["diagnosis"])
    return failed, words + verdicts.refused_words(refused) + msg, res   # msg: what finish() adds (unknown containers)


def _locked(call):
    """From the first snapshot to the verdict and the /dev/shm removals, under the GPU locks."""
    releaser = call.releaser
    call.shm(True)
    try:
        before = releaser.snapshot()
        call.shm(False)
        call.result.update(releaser.evidence)
        ended = _before_ladder(call, before) or _climb(call, before)
        if ended:
            return ended
        call.shm(True)
        after = releaser.snapshot()
        lost = call.locks.lost_words()
    finally:
        call.shm(False)
        releaser.restore_all()    # a restore still registered (an error, a hard stop) runs before the locks go
    return _verdict_of(call, before, after, lost)


def release(engine, targets, options, check_mode=False, log=None, lock_dir=LOCK_DIR, deadline=None, progress=None):
    """Run gpu_release on a started Engine. Returns (failed, msg, result). options: the release's options object
    (_params.ReleaseOptions), or a dict of them (converted at once, LEGACY_DEFAULTS filling in).

    progress (a dict) gets "releaser" at once, so that a caller interrupted by a hard stop can still report
    what was signalled (backstop_result).
    """
    opts = options_of(options)
    releaser = Releaser(engine, targets, opts, deadline=deadline, log=log, check_mode=check_mode)
    call = _Call(engine, targets, opts, check_mode, releaser)
    if progress is not None:
        progress["releaser"] = releaser
    if not targets:
        return True, "no GPU targeted, nothing was signalled", dict(call.result, elapsed_s=call.elapsed())
    gpu_keys = [(engine.gpu(i) or {}).get("uuid") or "index-%d" % i for i in targets]
    call.locks = GpuLocks(lock_dir)
    if not check_mode:
        refused = _take_locks(call, gpu_keys, deadline)
        if refused:
            return refused
    try:
        return _locked(call)
    finally:
        call.locks.release()
