# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which GPUs each holder holds, by evidence (private helper; pure functions on records).

Every CUDA process maps the node of every GPU visible to it (GPU_FACTS rows 9-12),
so a mapping only says "has a context somewhere". NVML's per-GPU lists say where
the memory is. A holder NVML does not name is pinned to GPU N only when NVML shows
orphaned memory on N, the holder maps a context on N, and no other holder fits.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder

CONTEXT_MAP_LINES = 3         # row 12: a context maps its GPU's node 3 times on driver 580, a visible GPU twice
DEFAULT_TOLERANCE_MIB = 640   # just above a bare context (612 MiB, row 20)


def check_nvml(holders, gpu_views):
    """Split NVML's entries: ({pid: {index: MiB}} accepted, [stale entries]).

    "P on g" is accepted only when P maps g's node with a context signature (rows 12, 13, 15).
    Any other entry of a pid that lives here is stale (a reused pid, a legacy host pid):
    its memory is orphaned, and P is pinned by its own mappings alone.
    """
    by_pid = dict((h["pid"], h) for h in holders)
    named, stale = {}, []
    for index, view in sorted(gpu_views.items()):
        # a pid listed twice on one GPU (a legacy host pid equal to a local one): the largest entry is taken
        # as its own (collateral is never underestimated), the others are stale; the listing order never matters
        procs = sorted(view.get("procs") or (), key=lambda p: (p["pid"], -1 if p["used_mib"] is None else -p["used_mib"]))
        for proc in procs:
            record = by_pid.get(proc["pid"])
            if (proc["status"] == "holder" and record is not None and index in record["context_gpus"]
                    and index not in named.get(proc["pid"], {})):
                named.setdefault(proc["pid"], {})[index] = proc["used_mib"]
            elif proc["status"] in ("holder", "client", "not_holder"):
                twice = record is not None and index in named.get(proc["pid"], {})
                stale.append({"gpu": index, "pid": proc["pid"], "used_mib": proc["used_mib"],
                              "why": ("pid %d is listed more than once on GPU %d; its largest entry is taken as its "
                                      "own" % (proc["pid"], index)) if twice
                              else stale_why(proc["pid"], index, proc["status"])})
    return named, stale


def stale_why(pid, index, status):
    if status == "holder":
        return "pid %d here has no context on GPU %d" % (pid, index)
    if status == "client":
        return "pid %d here only has device files open (an NVML client), no context" % pid
    return "pid %d here maps no /dev/nvidia* node" % pid


def orphaned_memory(gpu_views, stale, slack_mib):
    """Per GPU, memory no process seen here accounts for: {index: {"dead", "stale", "unaccounted"}}.

    dead: [(pid, MiB)] NVML names that are dead or not visible here. stale: [(pid, MiB)]
    of entries whose pid here holds no context on that GPU. unaccounted: used beyond
    what NVML lists.
    """
    out = {}
    for index, view in gpu_views.items():
        procs, used = view.get("procs"), view.get("used_mib")
        if procs is None or used is None:
            continue
        dead = [(p["pid"], p["used_mib"]) for p in procs if p["status"] == "not_visible"]
        wrong = [(e["pid"], e["used_mib"]) for e in stale if e["gpu"] == index]
        listed = sum(p["used_mib"] or 0 for p in procs)
        unaccounted = max(0, used - listed)
        if unaccounted <= slack_mib:
            unaccounted = 0
        if dead or wrong or unaccounted:
            out[index] = {"dead": dead, "stale": wrong, "unaccounted": unaccounted}
    return out


def orphan_mib(orphan):
    """MiB of one GPU's orphaned memory; None when NVML gave no size for a dead pid."""
    entries = orphan["dead"] + orphan.get("stale", [])
    if any(mib is None for dummy, mib in entries):
        return None
    return sum(mib for dummy, mib in entries) + orphan["unaccounted"]


def pin(holders, gpu_views, slack_mib=64):
    """Set gpus, evidence, ambiguous_gpus, shares_mib and heir_of on each holder record; return (orphans, stale).

    holders: records with pid, pgrp, session, maps_gpus, context_gpus.
    gpu_views: {index: {"procs": [{pid, used_mib, status}] or None, "used_mib": int or None}}.
    Each NVML entry is checked against its own pid's mappings: distrust is per entry, so a
    process that starts or exits never changes how the others are pinned.
    """
    named, stale = check_nvml(holders, gpu_views)
    orphans = orphaned_memory(gpu_views, stale, slack_mib)
    unnamed = [h for h in holders if h["pid"] not in named]
    fits = dict((index, [h["pid"] for h in unnamed if index in h["context_gpus"]]) for index in orphans)
    for record in holders:
        record["heir_of"] = []
        record["ambiguous_gpus"] = []
        if record["pid"] in named:
            shares = named[record["pid"]]
            record["gpus"] = sorted(shares)
            record["shares_mib"] = dict(shares)
            record["evidence"] = ["nvml", "mapping"]
            continue
        pinned, ambiguous, evidence, shares = [], [], [], {}
        for index in record["context_gpus"]:
            if index not in orphans:
                continue
            if len(fits[index]) != 1:
                ambiguous.append(index)
                continue
            pinned.append(index)
            orphan = orphans[index]
            shares[index] = orphan_mib(orphan)
            if orphan["dead"]:
                evidence.append("dead_pid")
            if orphan["stale"]:
                evidence.append("nvml_stale")
            if orphan["unaccounted"]:
                evidence.append("unaccounted")
            for dead_pid, dummy in orphan["dead"]:
                if dead_pid in (record.get("pgrp"), record.get("session")) and dead_pid not in record["heir_of"]:
                    record["heir_of"].append(dead_pid)
        record["gpus"] = pinned
        record["shares_mib"] = shares
        record["ambiguous_gpus"] = ambiguous
        if pinned:
            record["evidence"] = ["mapping"] + sorted(set(evidence)) + (["heir"] if record["heir_of"] else [])
        else:
            record["evidence"] = []
    return orphans, stale


def residue(orphans, holders, jobs, rank_deaths=None):
    """GPUs whose orphaned memory belongs to the surviving ranks of a job (row 19): {index: job id}.

    Every CUDA process maps every visible GPU (row 9), so mapping a GPU says nothing of residue.
    Residue on GPU g is charged to a job only when this run saw a rank of that job pinned to g
    die (rank_deaths: {index: [{"pid", "mib", "survivors"}]}), its size fits that rank's share,
    no holder is pinned or ambiguous there, and exactly one job holds those survivors.
    Anything else stays unattributed: named in the diagnosis, never a reason to stop anything.
    """
    out = {}
    for index, deaths in (rank_deaths or {}).items():
        orphan = orphans.get(index)
        # evidence, not the upper bound: a holder pinned there (holds) or one the orphaned memory there fits among
        # others (ambiguous) may own it; an unpinned holder that only maps it never does (every rank maps every GPU)
        if orphan is None or [h for h in holders if holder.holds(h, index) or index in h["ambiguous_gpus"]]:
            continue
        size = orphan_mib(orphan)
        fitting = set()
        for death in deaths:
            if size is not None and death.get("mib") is not None and size > death["mib"]:
                continue
            fitting.update(job["id"] for job in jobs.values() if set(job["pids"]) & set(death["survivors"]))
        if len(fitting) == 1:
            out[index] = fitting.pop()
    return out


def relevance(record, targets, all_targeted):
    """Why a holder concerns the targeted GPUs: 'pinned', 'unpinned_all_mapped', 'ambiguous', 'unpinned' or None.

    A holder that maps a GPU NVML cannot describe (unknown_gpus, unknown_mapped) may hold that GPU, which
    is never targeted: it is never "all mapped".
    """
    # a trigger to act asks the evidence (holds): pinned to a targeted GPU
    if [t for t in targets if holder.holds(record, t)]:
        return "pinned"
    if record["gpus"]:
        return None
    # pinned nowhere: the upper bound (may_hold) is every GPU it maps (every GPU when it maps none); it is signalled
    # only when that whole bound is targeted, and named (ambiguous, unpinned) otherwise
    mapped = set(record["maps_gpus"])
    # a GPU NVML cannot describe is never targeted: a holder that maps one (a context there, or 2 map
    # lines, which on another driver may be a context too) is never "all mapped"
    unknown = record.get("unknown_gpus") or record.get("unknown_mapped")
    if not unknown and ((mapped and mapped <= targets) or (not mapped and all_targeted)):
        return "unpinned_all_mapped"
    if targets & set(record["ambiguous_gpus"]):
        return "ambiguous"
    if (targets & set(record["context_gpus"])) or (not mapped and not unknown):
        return "unpinned"
    return None


def untargeted_shares(record, targets, tolerance_mib):
    """(over, under): [(index, MiB or None)] of the holder's pinned GPUs that are not targeted, by tolerance."""
    over, under = [], []
    for index in record["gpus"]:
        if index in targets:
            continue
        mib = record["shares_mib"].get(index)
        (under if mib is not None and mib <= tolerance_mib else over).append((index, mib))
    return over, under
