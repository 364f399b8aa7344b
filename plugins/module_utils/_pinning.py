# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Which GPUs each holder holds, by evidence (private helper; pure functions on records).

Every CUDA process maps the node of every GPU visible to it (GPU_FACTS rows 9-12),
so a mapping only says "has a context somewhere". NVML's per-GPU lists say where
the memory is. A holder NVML does not name is pinned to GPU N only when NVML shows
orphaned memory on N, the holder maps a context on N, and no other holder fits.
"""

from __future__ import annotations

CONTEXT_MAP_LINES = 3         # row 12: a context maps its GPU's node 3 times on driver 580, a visible GPU twice
DEFAULT_TOLERANCE_MIB = 640   # just above a bare context (612 MiB, row 20)


def nvml_named(gpu_views, trusted):
    """{pid: {gpu index: MiB or None}} for the holders NVML names, when its pids are trusted."""
    named = {}
    if not trusted:
        return named
    for index, view in gpu_views.items():
        for proc in view.get("procs") or ():
            if proc["status"] == "holder":
                named.setdefault(proc["pid"], {})[index] = proc["used_mib"]
    return named


def orphaned_memory(gpu_views, trusted, slack_mib):
    """Per GPU, memory no visible process accounts for: {index: {"dead": [(pid, MiB)], "unaccounted": MiB}}.

    dead: pids NVML names that are dead or not visible here. unaccounted: used
    beyond what NVML lists (or all of used when NVML's pids are not trusted).
    """
    out = {}
    for index, view in gpu_views.items():
        procs, used = view.get("procs"), view.get("used_mib")
        if procs is None or used is None:
            continue
        dead = [(p["pid"], p["used_mib"]) for p in procs if p["status"] == "not_visible"] if trusted else []
        listed = sum(p["used_mib"] or 0 for p in procs) if trusted else 0
        unaccounted = max(0, used - listed)
        if unaccounted <= slack_mib:
            unaccounted = 0
        if dead or unaccounted:
            out[index] = {"dead": dead, "unaccounted": unaccounted}
    return out


def orphan_mib(orphan):
    """MiB of one GPU's orphaned memory; None when NVML gave no size for a dead pid."""
    if any(mib is None for dummy, mib in orphan["dead"]):
        return None
    return sum(mib for dummy, mib in orphan["dead"]) + orphan["unaccounted"]


def pin(holders, gpu_views, trusted, slack_mib=64):
    """Set gpus, evidence, ambiguous_gpus, shares_mib and heir_of on each holder record; return the orphans.

    holders: records with pid, pgrp, session, maps_gpus, context_gpus.
    gpu_views: {index: {"procs": [{pid, used_mib, status}] or None, "used_mib": int or None}}.
    """
    named = nvml_named(gpu_views, trusted)
    orphans = orphaned_memory(gpu_views, trusted, slack_mib)
    unnamed = [h for h in holders if h["pid"] not in named]
    fits = dict((index, [h["pid"] for h in unnamed if index in h["context_gpus"]]) for index in orphans)
    for record in holders:
        record["heir_of"] = []
        record["ambiguous_gpus"] = []
        if record["pid"] in named:
            shares = named[record["pid"]]
            record["gpus"] = sorted(shares)
            record["shares_mib"] = dict(shares)
            record["evidence"] = ["nvml"] + (["mapping"] if set(record["context_gpus"]) & set(shares) else [])
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
        if not trusted and pinned:
            record["evidence"].append("nvml_pids_untrusted")
    return orphans


def residue(orphans, holders, jobs):
    """GPUs whose orphaned memory belongs to the surviving ranks of a job (row 19): {index: job id}.

    Only where no holder is pinned or ambiguous there, and exactly one job has
    every member mapping that GPU (as a peer) without holding it.
    """
    out = {}
    for index in orphans:
        if [h for h in holders if index in h["gpus"] or index in h["ambiguous_gpus"]]:
            continue
        fitting = [job for job in jobs.values()
                   if all(index in m["maps_gpus"] and index not in m["gpus"] for m in job["members"])]
        if len(fitting) == 1:
            out[index] = fitting[0]["id"]
    return out


def relevance(record, targets, all_targeted):
    """Why a holder concerns the targeted GPUs: 'pinned', 'unpinned_all_mapped', 'ambiguous', 'unpinned' or None."""
    if targets & set(record["gpus"]):
        return "pinned"
    if record["gpus"]:
        return None
    mapped = set(record["maps_gpus"])
    if (mapped and mapped <= targets) or (not mapped and all_targeted):
        return "unpinned_all_mapped"
    if targets & set(record["ambiguous_gpus"]):
        return "ambiguous"
    if (targets & set(record["context_gpus"])) or not mapped:
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
