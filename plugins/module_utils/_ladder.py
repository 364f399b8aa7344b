# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The ladder of a release: the Releaser (private helper). TERM, KILL, wait, the container restart, the reset.

It decides whom to signal (_decide), signals each guarded against pid reuse (_signals), waits and reads again,
watches for a respawn, and climbs to the rungs past the signals (_rungs); it asks evidence (_where, the Engine)
where a process is and whether it is alive. release() (_release) runs it under the GPU locks. No AnsibleModule here.
"""

from __future__ import annotations

import signal
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _respawn as respawn
from ansible_collections.gpuops.fleet.plugins.module_utils import _restart as restart
from ansible_collections.gpuops.fleet.plugins.module_utils import _rungs as rungs
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils import _verdict as verdicts
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide, plan_entry, stop_set_verdict
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._rungs import find_nvidia_smi
from ansible_collections.gpuops.fleet.plugins.module_utils._holder import alive
from ansible_collections.gpuops.fleet.plugins.module_utils._signals import _now_ticks, send_guarded
from ansible_collections.gpuops.fleet.plugins.module_utils._verdict import targets_free

# The ladder, in order; the one list of rungs (issue 46): the gpu_report callback reads it. "stop" (units stopped, no
# signal) is reported on a container's rows (per_container); rung_reached (_set_rung) starts at the signals.
RUNGS = ("none", "stop", "sigterm", "sigkill", "wait", "container_restart", "reset")
POLL_S = 0.075
FULL_READ_EVERY_S = 1.0  # shared_gpu: own polls read NVML alone in between (_scope_still_holds)
GRACE_S = 1.0            # once nothing visible here holds a GPU, how long to wait for its memory
UNIT_WORDS = units.KIND_WORDS
RESPAWN_WINDOW_S = 3.0   # how long to watch the parents of killed holders after the verdict
RESPAWN_STARTING_S = 6.0  # longer while a new child of theirs is still starting (maps nothing yet)
HEIR_ROUNDS = 3          # re-reads after the signals, for holders pinned only once their parent is dead
HEIR_WAIT_S = 0.3        # memory of a reaped holder is back 0.12-0.2 s after SIGKILL (GPU_FACTS row 2)
SNAPSHOT_TRIES = 3       # reads of the GPUs while NVML is not opened again meanwhile (a new helper)


class Releaser(object):
    """Runs the ladder for the targeted GPU indexes of an Engine. opts: the release's options, as attributes named
    as the keys of the options dict that gpu_release passes to release() (_params.ReleaseOptions)."""

    def __init__(self, engine, targets, opts, deadline=None, log=None, check_mode=False, poll_s=POLL_S):
        self.engine, self.opts, self.check_mode, self.poll_s = engine, opts, check_mode, poll_s
        self.clock = rungs.Clock(deadline)
        self.recorder = rungs.Recorder(log)
        self.restores = rungs.Restores(self.clock)
        self.log, self.started, self.actions = self.recorder.log, self.recorder.started, self.recorder.actions
        self.reset_steps, self.undo, self.left_changed = self.recorder.reset_steps, self.restores.undo, self.restores.left_changed
        self.restarter = rungs.ContainerRestart(self.clock, self.recorder, self.restores,
                                                getattr(opts, "restart_backend", None), opts.container_timeout,
                                                engine.proc_root)
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
        self.why_of = {}         # pid -> why the latest decision that chose it chose it (decide's pairs)
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
        self.why_of.update((r["pid"], why) for r, why in decision.chosen)   # the latest decision's why wins
        self.protected = decision.protected
        place_of = dict((r["pid"], r.get("container")) for r in list(report.holders) + list(report.clients))
        self.refused_in = [self._containers_of(pids, place_of) for pids in decision.refused_pids]
        self.jobs = decision.jobs
        self._known_pids = set(r["pid"] for r in report.holders) | set(r["pid"] for r in report.clients)
        uuid_of = dict((g["index"], g.get("uuid")) for g in self.engine.gpus)
        self._ranks = [[holder.ident_of(m) + (dict((uuid_of.get(i), mib) for i, mib in m["shares_mib"].items()),)
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
            gpus = set(g["index"] for g in self.engine.gpus for h in holders if holder.may_hold(h, g["index"]))
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
            if now is None or holder.ident_of(now) == holder.ident_of(record):
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
        """Why container vmid is not stopped, decided right before its stop (rungs.ContainerRestart.refusal)."""
        return self.restarter.refusal(report, why, vmid, self._restart_verdict)

    def _container_holds(self, report, vmid):
        for gpu in report.gpus:
            if gpu["index"] in self.targets and not gpu["free"] and (gpu.get("by_container") or {}).get(vmid, 0) > 0:
                return True
        # a trigger to act needs evidence: a holder of the container holds a target, or is one of the processes that
        # a target's orphaned memory fits (ambiguous: memory seen, owner not told apart), beside its memory above;
        # a mapping alone (may_hold's unpinned arm) never restarts a container
        return any(h.get("container") == vmid and [t for t in self.targets if holder.holds(h, t) or t in h["ambiguous_gpus"]]
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
            gone = [m for m in members if not holder.same_process(m[:2], self.proc_root)]
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
            # a job member stays planned with its job (the why of the decision that chose it; decide writes no evidence)
            if record["pid"] in keep or self.why_of.get(record["pid"]) == "job_member":
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
            self.why_of[record["pid"]] = decision.why_of(record["pid"])
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
        refusals that stop the release before anything is signalled (rungs.reset_plan)."""
        if not self.opts.gpu_reset or self.engine.view != "node":
            return []
        plan = rungs.reset_plan(self.engine, report, self.targets, self.reset_mode)
        self.reset_blockers, self.reset_services, self.reset_persistence = plan["blockers"], plan["services"], plan["persistence"]
        return plan["refusals"]

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
