"""Invariants of the decision step over generated worlds (issue 18, part 4).

A world is the truth: processes with contexts (MiB) on GPUs, forks of dead parents, processes
outside this PID namespace, legacy host pids, reused pids, a lost GPU, TP jobs and client-server
links. From it the evidence is derived as the readers would see it (map lines, NVML's per-GPU
lists with the pids NVML reports, statuses against the local process table), then the engine's
pure steps run (pinning, jobs, residue, decide) for every target set. The oracle is the truth,
never the engine's own evidence. `make test` runs 2,000 worlds; `make test-deep` 100,000
(GPUOPS_WORLDS).
"""

import copy
import itertools
import os
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils._blockers import plan as reset_plan
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import (
    decide, plan_entry, reset_blockers, set_collateral, stop_set_verdict,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._jobs import group_jobs, signatures
from ansible_collections.gpuops.fleet.plugins.module_utils._report import gpu_entry
from ansible_collections.gpuops.fleet.plugins.module_utils._respawn import held_targets
from release_opts import release_opts

WORLDS = int(os.environ.get("GPUOPS_WORLDS", "2000"))
# two_lines: a driver whose contexts map 2 lines, as a merely visible GPU does on driver 580
KINDS = ("plain", "plain", "fork_child", "hidden", "legacy", "two_lines")


def make_world(seed):
    """One world from a seed (hypothesis draws the seed: thousands of worlds fit in seconds, and a failure prints
    its world and its seed)."""
    rng = random.Random(seed)
    gpus = rng.randint(1, 4)
    lost = set([rng.randrange(gpus)]) if gpus > 1 and rng.random() < 0.3 else set()
    count = rng.randint(1, 6)
    # a small pid space, so that dead parents, legacy host pids and local pids collide
    pool = rng.sample(range(2, 31), 3 * count + 3)
    procs = []
    for n in range(count):
        contexts = dict((g, rng.choice((518, 612, 2048, 30000)))
                        for g in rng.sample(range(gpus), rng.randint(1, gpus)))
        visible = set(contexts) | set(g for g in range(gpus) if rng.random() < 0.5)
        kind = rng.choice(KINDS)
        # a dead parent's pid or a legacy host pid: often one nobody here has, sometimes a live one (reused)
        other = rng.choice(pool[:count]) if rng.random() < 0.4 else None
        procs.append({"pid": pool[n], "kind": kind, "contexts": contexts, "visible": visible,
                      "reported": {"plain": pool[n], "two_lines": pool[n], "fork_child": other or pool[count + n],
                                   "legacy": other or pool[2 * count + n], "hidden": None}[kind],
                      "argv": ("python3", "app_%s.py" % "abcdefgh"[n])})
    local = [p for p in procs if p["kind"] != "hidden"]
    # a TP job: two or three local holders, rank siblings linked pairwise; a client and its server: one link
    shuffled = rng.sample(local, len(local))
    size = rng.randint(0, min(3, len(shuffled)))
    job = shuffled[:size] if size >= 2 else []
    for rank, proc in enumerate(job):
        proc["argv"] = ("python3", "-m", "sglang.launch_server", "--tp-rank", str(rank))
    links = set((min(a["pid"], b["pid"]), max(a["pid"], b["pid"])) for a, b in itertools.combinations(job, 2))
    rest = shuffled[len(job):]
    if len(rest) >= 2 and rng.random() < 0.5:
        links.add((min(rest[0]["pid"], rest[1]["pid"]), max(rest[0]["pid"], rest[1]["pid"])))
    # processes that hold no GPU: a CPU-only one (it may reuse a dead parent's pid) and an NVML client
    used = set(p["pid"] for p in local)
    spare = [p for p in pool if p not in used]
    others = {}
    for role in ("cpu", "client"):
        if spare and rng.random() < 0.5:
            others[rng.choice(spare)] = role
    return {"gpus": gpus, "lost": lost, "procs": procs, "job": set(p["pid"] for p in job), "links": links,
            "others": others, "seed": seed}


SEEDS = st.integers(0, 2 ** 32 - 1)


def evidence(world, order=None, others=None):
    """The records and NVML views the readers would produce (order: a random.Random to shuffle the listings)."""
    known = [g for g in range(world["gpus"]) if g not in world["lost"]]
    others = world["others"] if others is None else others
    local = [p for p in world["procs"] if p["kind"] != "hidden"]
    records = []
    for proc in local:
        argv = list(proc["argv"])
        records.append({
            "pid": proc["pid"], "ppid": 1, "pgrp": proc["reported"] if proc["kind"] == "fork_child" else proc["pid"],
            "session": proc["pid"], "name": "python3", "names": ["python3"], "_argv": argv, "protected_name": None,
            "maps_gpus": sorted(g for g in proc["visible"] if g in known),
            "context_gpus": sorted(g for g in proc["contexts"] if g in known and proc["kind"] != "two_lines"),
            "unknown_gpus": sorted(g for g in proc["contexts"] if g in world["lost"] and proc["kind"] != "two_lines"),
            "unknown_mapped": sorted(g for g in proc["visible"] if g in world["lost"]),
            "defunct_leader": False, "live_threads": None, "job": None})
    holder_pids = set(r["pid"] for r in records)

    def status(pid):
        if pid in holder_pids:
            return "holder"
        if pid in others:
            return "client" if others[pid] == "client" else "not_holder"
        return "not_visible"
    views = {}
    for g in range(world["gpus"]):
        if g in world["lost"]:
            views[g] = {"procs": None, "used_mib": None}
            continue
        listed, used = [], 0
        for proc in world["procs"]:
            mib = proc["contexts"].get(g)
            if mib is None:
                continue
            used += mib
            if proc["reported"] is not None:
                listed.append({"pid": proc["reported"], "used_mib": mib, "status": status(proc["reported"])})
        if order is not None:
            order.shuffle(listed)
        views[g] = {"procs": listed, "used_mib": used}
    if order is not None:
        order.shuffle(records)
    return records, views


class Evidence(object):
    """What decide reads of a Report."""

    def __init__(self, holders, jobs, residue, unknown_gpus):
        self.holders, self.jobs, self.residue, self.unknown_gpus = holders, jobs, residue, unknown_gpus

    def job_gpus(self, job_id):
        gpus = set(g for m in self.jobs[job_id]["members"] for g in m["gpus"])
        gpus.update(i for i, owner in self.residue.items() if owner == job_id)
        return sorted(gpus)


def engine_steps(world, order=None, others=None):
    holders, views = evidence(world, order, others)
    orphans, dummy = pinning.pin(holders, views, slack_mib=64)
    for record in holders:
        record["unattributed"] = not record["gpus"] and not record["unknown_gpus"]
    signs = dict((r["pid"], signatures(r, "/nonexistent")) for r in holders)
    pairs = set(pair for pair in world["links"] if pair[0] in signs and pair[1] in signs)
    jobs, dummy = group_jobs(holders, pairs, signs)
    residue = pinning.residue(orphans, holders, jobs, {})
    unknown = [{"minor": g, "index": None, "held_by": sorted(r["pid"] for r in holders if g in r["unknown_gpus"])}
               for g in sorted(world["lost"])]
    return Evidence(sorted(holders, key=lambda r: r["pid"]), jobs, residue, unknown)


def target_sets(world):
    known = [g for g in range(world["gpus"]) if g not in world["lost"]]
    for size in range(1, len(known) + 1):
        for targets in itertools.combinations(known, size):
            yield set(targets)


def summary(decision):
    return (sorted((r["pid"], why) for r, why in decision.chosen), sorted(s["pid"] for s in decision.skipped),
            sorted(decision.refusals))


@settings(max_examples=WORLDS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS)
def test_no_plan_signals_a_process_that_truly_holds_no_targeted_gpu(seed):
    world = make_world(seed)
    truth = dict((p["pid"], set(p["contexts"])) for p in world["procs"] if p["kind"] != "hidden")
    all_indexes = list(range(world["gpus"]))
    report = engine_steps(world)
    for targets in target_sets(world):
        for collateral in ("refuse", "stop"):
            decision = decide(report, targets, [g for g in all_indexes if g not in world["lost"]], collateral=collateral)
            for record, why in decision.chosen:
                holds = truth[record["pid"]] & targets
                if collateral == "refuse":       # invariants 1 and 2
                    assert holds, (record["pid"], why, sorted(targets), world)
                elif not holds:                  # only as a member of a true job that holds a target
                    assert why == "job_member" and record["pid"] in world["job"], (record, world)
                    assert any(truth[m] & targets for m in world["job"]), world
            # each refusal names the processes it is about (a node-side release leaves their containers out), and
            # one of them is among the holders the refusal concerns
            assert len(decision.refused_pids) == len(decision.refusals), decision.refusals
            listed = set(r["pid"] for r in report.holders)
            for msg, pids in zip(decision.refusals, decision.refused_pids):
                assert pids and set(pids) <= listed | set(world["job"]), (msg, pids)
                assert any("pid %d " % p in msg for p in pids), (msg, pids)
            # a process linked to a planned one but not in its job (a client's server) is never stopped for it
            for a, b in world["links"]:
                for x, y in ((a, b), (b, a)):
                    if x not in world["job"] and y in [r["pid"] for r in decision.to_signal]:
                        assert x not in [r["pid"] for r in decision.to_signal] or truth[x] & targets, world


@settings(max_examples=WORLDS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS)
def test_the_plan_is_the_same_in_any_order_and_when_an_unrelated_process_starts_or_exits(seed):
    """Invariant 3: distrust is per process; a listing order or a bystander elsewhere changes no one's fate."""
    world = make_world(seed)
    newcomer = random.Random(seed + 1).randint(2, 30)
    known = [g for g in range(world["gpus"]) if g not in world["lost"]]
    local = set(p["pid"] for p in world["procs"] if p["kind"] != "hidden")
    starts = dict(world["others"])
    if newcomer not in local:
        starts.setdefault(newcomer, "cpu")     # it may take a dead parent's or a legacy host pid
    exits = dict((pid, role) for pid, role in world["others"].items() if role != "cpu")
    base = engine_steps(world)
    variants = [engine_steps(world, order=random.Random(world["seed"])), engine_steps(world, others=starts),
                engine_steps(world, others=exits)]
    for targets in target_sets(world):
        for collateral in ("refuse", "stop"):
            want = summary(decide(base, targets, known, collateral=collateral))
            for variant in variants:
                assert summary(decide(variant, targets, known, collateral=collateral)) == want, world


# ---- invariant 4, in the act layer: "free" only from a reading of every targeted UUID, where it is now

PROC_ROOT = None


def proc_root():
    """An empty /proc (the releaser's verify step reads NVML only); made once for every example."""
    global PROC_ROOT
    if PROC_ROOT is None:
        import atexit
        import shutil
        import tempfile
        PROC_ROOT = tempfile.mkdtemp(prefix="gpuops-worlds-proc-")
        atexit.register(shutil.rmtree, PROC_ROOT, True)   # nothing left in /tmp
        with open(os.path.join(PROC_ROOT, "stat"), "w") as handle:
            handle.write("cpu  1 2 3 4\nbtime 1764400000\n")
        with open(os.path.join(PROC_ROOT, "uptime"), "w") as handle:
            handle.write("1000.00 1900.00\n")
    return PROC_ROOT


@settings(max_examples=max(200, WORLDS // 4), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(SEEDS)
def test_free_is_only_read_from_every_targeted_uuid_after_any_reinit(seed):
    """NVML is opened again (a reset, a new helper) and lists the GPUs in another order, or without one:
    the verify step reads each target by UUID, and a target that is gone is never free."""
    from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
    from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
    from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser
    from fake_nvml import FakeNvml

    rng = random.Random(seed)
    gpus = [{"minor": m, "used_mib": rng.choice((0, 0, 4096))} for m in range(rng.randint(1, 4))]
    fake = FakeNvml(gpus)
    engine = Engine(Nvml(2.0, lib=fake), proc_root=proc_root(), self_pid=999999)
    engine.start()
    targets = sorted(rng.sample(range(len(gpus)), rng.randint(1, len(gpus))))
    wanted = [fake.nvmlDeviceGetUUID(i) for i in targets]
    releaser = Releaser(engine, targets, release_opts())
    try:
        for dummy in range(rng.randint(1, 6)):
            step = rng.random()
            if step < 0.3:
                rng.shuffle(fake.gpus)
                engine.nvml.init()
            elif step < 0.45 and len(fake.gpus) > 1:
                del fake.gpus[rng.randrange(len(fake.gpus))]
                engine.nvml.init()
            else:
                rng.choice(fake.gpus)["used_mib"] = rng.choice((0, 64, 65, 4096))
            now = dict(("GPU-%08d-0000-0000-0000-000000000000" % g["minor"], g["used_mib"]) for g in fake.gpus)
            truly_free = all(uuid in now and now[uuid] <= engine.threshold_mib for uuid in wanted)
            assert releaser._memory_free() == truly_free, (seed, wanted, now)
    finally:
        engine.nvml.shutdown()      # its worker thread ends: thousands of examples leave none behind


# ---- one holder type, two predicates (issue 46): every rule asks may_hold or holds, and they agree

class _StatusEngine(object):
    """What the report's GPU entry reads of an Engine: GPUs whose minor is their index, none free."""
    in_container = False

    @staticmethod
    def gpu(index):
        return {"index": index, "minor": index}

    @staticmethod
    def is_free(dummy):
        return False


def frozen_steps(world):
    """The engine's steps as a snapshot runs them: pin, jobs, then every record a read-only Holder (as
    _gpu_engine's _frozen), then residue; returns (report, views, orphans)."""
    records, views = evidence(world)
    orphans, dummy = pinning.pin(records, views, slack_mib=64)
    for record in records:
        record["unattributed"] = not record["gpus"] and not record["unknown_gpus"]
        record.update(fd_gpu_minors=[], starttime_ticks=100 + record["pid"], mps_role=None)
    signs = dict((r["pid"], signatures(r, "/nonexistent")) for r in records)
    pairs = set(pair for pair in world["links"] if pair[0] in signs and pair[1] in signs)
    jobs, dummy = group_jobs(records, pairs, signs)
    holders = dict((h["pid"], h) for h in holder.freeze(records))
    for job in jobs.values():
        job["members"] = [holders[m["pid"]] for m in job["members"]]
    holders = sorted(holders.values(), key=lambda h: h["pid"])
    residue = pinning.residue(orphans, holders, jobs, {})
    unknown = [{"minor": g, "index": None, "held_by": sorted(r["pid"] for r in holders if g in r["unknown_gpus"])}
               for g in sorted(world["lost"])]
    report = Evidence(holders, jobs, residue, unknown)
    report.clients, report.unreadable = [], []
    report.gpus = [{"index": g, "minor": g} for g in range(world["gpus"]) if g not in world["lost"]]
    return report, views, orphans


def _status_holders(report, views, orphans, index):
    """gpu_info's entry of GPU index (the real _report.gpu_entry): the pids it names as holding it."""
    view = {"error": None, "error_kind": None, "procs": views[index]["procs"],
            "memory": {"total_mib": 81920, "used_mib": views[index]["used_mib"], "reserved_mib": 0,
                       "v1_used_mib": views[index]["used_mib"]}}
    entry = gpu_entry(_StatusEngine(), index, view, report.holders, report.clients, orphans, report.jobs,
                      report.residue, True)
    return set(entry["holders"])


@settings(max_examples=WORLDS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS)
def test_status_release_the_restart_rung_the_reset_guard_and_the_respawn_watch_agree(seed):
    """Per (pid, GPU): status, decide and the respawn watch answer holds; the reset guard (decide's and the reset's
    blockers plan), the restart rung's collateral and decide's unpinned choice answer may_hold. Each is the real code path, compared with the
    Holder's own predicate."""
    world = make_world(seed)
    report, views, orphans = frozen_steps(world)
    known = [g for g in range(world["gpus"]) if g not in world["lost"]]
    assert all(isinstance(h, holder.Holder) for h in report.holders)
    restart = stop_set_verdict({"kind": "container", "members": [
        {"pid": h["pid"], "name": h["name"], "why": "a process of the container"} for h in report.holders]},
        report, set(), known, [], {}, "stop")
    restart_may = set((c["pid"], g) for c in restart["collateral"] for g in c["gpus"] if isinstance(g, int))
    for g in known:
        holds = set(h["pid"] for h in report.holders if h.holds(g))
        may = set(h["pid"] for h in report.holders if h.may_hold(g))
        assert holds <= may, (g, world)
        # status (gpu_info) names as holders those that hold it
        assert _status_holders(report, views, orphans, g) == holds, (g, world)
        # release: what decide signals as pinned holds a target; what it signals unpinned may hold only targets
        decision = decide(report, {g}, known)
        assert set(h["pid"] for h, why in decision.chosen if why == "pinned") == holds, (g, world)
        for h, why in decision.chosen:
            if why == "unpinned_all_mapped":
                assert [t for t in known if h.may_hold(t)] == [g], (h["pid"], g, world)
        # the reset guard (the ladder's refusal, and the reset's blockers plan) and the restart rung's collateral:
        # the upper bound
        assert set(b["pid"] for b in reset_blockers(report, {"index": g, "minor": g, "blocked": ()})) == may, world
        blockers, dummy = reset_plan(report, [g], {}, "refuse", [{"index": i} for i in known])
        assert set(int(b["what"].split()[1]) for b in blockers if b["kind"] == "user_holder") == may, (g, world)
        assert set(p for p, i in restart_may if i == g) == may, (g, world)
        # the respawn watch (its contexts on the target, NVML's names there): holds, wherever NVML names the
        # process; it reads no orphaned memory, so it never sees more than holds
        named = set(p["pid"] for p in views[g]["procs"])
        for h in report.holders:
            watched = bool(held_targets(h["pid"], [i for i in h["context_gpus"] if i == g], named))
            assert watched == (h.holds(g) and h["pid"] in named) and (not watched or h.holds(g)), (h["pid"], g, world)


@settings(max_examples=max(200, WORLDS // 4), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS)
def test_the_decision_step_leaves_its_inputs_unchanged(seed):
    """decide, the stop-set verdicts, the reset guard, relevance and residue never write into the evidence, the
    targets or the options: a deep copy taken before each call equals them after."""
    world = make_world(seed)
    report = engine_steps(world)
    report.clients, report.unreadable = [], []
    known = [g for g in range(world["gpus"]) if g not in world["lost"]]
    members = [{"pid": h["pid"], "name": h["name"], "why": "x", "uid": 0} for h in report.holders]
    orphans = pinning.orphaned_memory(evidence(world)[1], [], 64)
    for targets in target_sets(world):
        for collateral in ("refuse", "stop"):
            options = {"match": None, "protect": None, "protect_pids": [1], "collateral": collateral,
                       "tolerance_mib": 640}
            before = copy.deepcopy((vars(report), targets, known, options, members))
            decision = decide(report, targets, known, **options)
            for record, dummy in decision.chosen:
                plan_entry(record, targets, decision, 640)
            stop_set_verdict({"kind": "container", "members": members}, report, targets, known,
                             [h["pid"] for h in decision.to_signal], {}, collateral)
            set_collateral(members, report, targets, known, [], 640)
            for g in known:
                reset_blockers(report, {"index": g, "minor": g, "blocked": ()})
            for record in report.holders:
                pinning.relevance(record, targets, set(known) <= targets)
            pinning.residue(orphans, report.holders, report.jobs, {})
            assert copy.deepcopy((vars(report), targets, known, options, members)) == before, world
