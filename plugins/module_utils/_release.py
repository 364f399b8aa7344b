# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A release: the GPU locks, the first read, the ladder (_ladder's Releaser), the verdict (private helper).

release() takes the locks (_locks), reads the targets, stops on what refuses the release before any signal, runs the
ladder, reads again and says the verdict (_verdict) with one result. No AnsibleModule here.
"""

from __future__ import annotations

import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _shmclean as shmclean
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from ansible_collections.gpuops.fleet.plugins.module_utils import _verdict as verdicts
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide
from ansible_collections.gpuops.fleet.plugins.module_utils._hardstop import ReleaseTimeout
from ansible_collections.gpuops.fleet.plugins.module_utils._ladder import (
    RUNGS, Releaser,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._locks import (
    LOCK_DIR, ContainerLocks, GpuLocks, LockDirError, LockTimeout,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._rungs import RESTORE_STEP_S, find_nvidia_smi
from ansible_collections.gpuops.fleet.plugins.module_utils._signals import send_guarded
from ansible_collections.gpuops.fleet.plugins.module_utils._verdict import (
    held_by_others_mib, left_changed_words, share_words, targets_free,
)

# what callers (gpu_release, the tests, the other helpers) take from here
__all__ = ["LOCK_DIR", "RESTORE_STEP_S", "RUNGS", "ContainerLocks",
           "GpuLocks", "LockDirError", "LockTimeout", "ReleaseTimeout", "Releaser", "backstop_result", "decide",
           "find_nvidia_smi", "held_by_others_mib", "left_changed_words", "release", "send_guarded",
           "share_words", "targets_free"]


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
    (_params.ReleaseOptions.from_params: every default lives in the module's argument spec).

    progress (a dict) gets "releaser" at once, so that a caller interrupted by a hard stop can still report
    what was signalled (backstop_result).
    """
    opts = options
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
