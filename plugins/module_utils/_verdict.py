# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The verdict of a release, and the words of its refusals (private helper): pure, on the reports already read.

Free or not (for the scope with shared_gpu: own), what is left, each container's row and verdict, and the sentences
a refusal or a failure says. Nothing here reads /proc or NVML, signals or stops anything, or changes its inputs.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import gpu_list_words, stuck_in_driver


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


ESTIMATE_WHY = "this driver has no v2 memory call; used is v1 used minus reserved_floor_mib"


def free_words(report):
    """How a free reading may be called: "verified free" only from a v2 reading of every targeted GPU."""
    if any((g.get("memory") or {}).get("estimated") for g in report.gpus):
        return "free by estimate (%s), not verified" % ESTIMATE_WHY
    return "verified free"


def scope_holders(report, index, scope):
    """Holders of GPU index that a node-side release's scope covers."""
    return [h for h in report.holders if scope.allows(h.get("container") or "") and holder.may_hold(h, index)]  # the upper bound


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


def used_of(report):
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


def refused_entries(refused):
    """per_container entries of the containers left out by a refusal: {vmid: [refusals]}."""
    return [dict(entry, verdict="refused") for entry in skipped_entries(
        dict((vmid, " | ".join(msgs)) for vmid, msgs in refused.items()))]


def refused_words(refused):
    if not refused:
        return ""
    return "; refused, nothing of it signalled: %s" % "; ".join(
        "container %s: %s" % (vmid, " | ".join(refused[vmid])) for vmid in sorted(refused, key=int))


def restart_words(vmid, verdict, count):
    """The refusal of a container restart decided as a stop set (verdict: stop_set_verdict's)."""
    if not verdict["collateral"]:
        return ("container_restart would restart container %s (a restart stops everything in it: %d processes), "
                "but %s; nothing was signalled" % (vmid, count, verdict["reason"]))
    return ("container_restart would restart container %s, whose processes also hold GPU work that is not targeted "
            "(a restart stops everything in it: %d processes): %s; nothing was signalled. To go on, set "
            "collateral: stop, or target those GPUs too" % (vmid, count, "; ".join(
                "pid %d (%s) %s" % (c["pid"], c["name"], c["why"]) for c in verdict["collateral"])))


def late_words(report):
    """Why nothing may be signalled after the read of report, once the overall timeout was reached during it."""
    whys = sorted(set(e["why"] for e in (getattr(report, "mps_servers", None) or {}).values() if e["why"]))
    return "the overall timeout was reached while the GPUs were read%s; nothing was signalled" % (
        "" if not whys else " (MPS: %s)" % "; ".join(whys))


def thread_words(holder, thread):
    """pid P (NAME) has thread T in D state ... (wchan W) ... holding GPUS: the parts of a stuck holder's sentence."""
    return (holder["pid"], holder["name"], thread.get("tid", 0), thread.get("wchan") or "unknown",
            gpu_list_words(holder["gpus"] or holder["maps_gpus"]))


def stuck_refusal(report, vmid):
    """The refusal of a restart of container vmid while a holder of it is stuck in the driver, or None."""
    for holder in report.holders:
        thread = stuck_in_driver(holder) if holder.get("container") == str(vmid) else None
        if thread is not None:
            return ("container %s was not restarted: pid %d (%s) has thread %d in D state in the driver (wchan %s) "
                    "holding %s; a container stop cannot end it and can hang; the remedy is a GPU reset "
                    "(gpu_reset: true) or a node reboot" % ((vmid,) + thread_words(holder, thread)))
    return None


def not_stopped_words(report, vmid, text):
    """Why container vmid did not stop: its backend's text, and a holder of it stuck in the kernel if there is one."""
    stuck = [(h, t) for h in report.holders if h.get("container") == str(vmid) for t in h["blocked_threads"]]
    if not stuck:
        return "container %s did not stop: %s" % (vmid, text)
    holder, thread = stuck[0]
    return ("container %s did not stop (%s): pid %d (%s) has thread %d in D state (wchan %s) holding %s; it is "
            "stuck in the kernel, and only a driver reload or a node reboot frees it"
            % ((vmid, text) + thread_words(holder, thread)))


def no_time_words(left, reserve_s, what):
    """The refusal of a stop when left seconds cannot cover reserve_s (a restore's bound) and the time to act."""
    return ("not enough time left to %s: %.1fs left of the timeout, %gs are reserved for the restore; nothing "
            "was stopped; raise timeout" % (what, max(0.0, left), reserve_s))


def already_free_words(report, scope):
    """The message of a release that found every targeted GPU free (for the scope, with shared_gpu: own)."""
    estimate = "" if free_words(report) == "verified free" else " (by estimate: %s)" % ESTIMATE_WHY
    return ("every targeted GPU is already free" + estimate if report.all_free else
            "nothing of %s holds the targeted GPUs (shared_gpu: own): %s" % (scope.describe(), share_words(report, scope)))


def freed_words(report, scope):
    """The message of a release that freed the targeted GPUs."""
    words = free_words(report)
    return (words if report.all_free else "%s of %s (shared_gpu: own): %s"
            % (words, scope.describe(), share_words(report, scope)))


def busy_words(after, own, actions, threshold_mib, diagnosis):
    """The message of a release that left a targeted GPU held."""
    busy = [g for g in after.gpus if not (free_for_scope(after, g, own) if own else g["free"])]
    tried = ", ".join("%s to %d: %s" % (a["signal"], a["pid"], a["outcome"]) if a["pid"] else
                      "%s %s: %s" % (a["signal"], a["name"], a["outcome"]) for a in actions) or "nothing"
    return ("GPU %s not free after the ladder (used %s MiB, threshold %s MiB); tried: %s; diagnosis: %s"
            % (", ".join(str(g["index"]) for g in busy),
               ", ".join(str((g.get("memory") or {}).get("used_mib")) for g in busy),
               threshold_mib, tried, " | ".join(diagnosis)))


def broken_words(broken):
    """NVML failed on these GPUs: the message."""
    return "NVML failed, nothing was signalled: " + "; ".join(
        "GPU %s%s: %s" % (g["index"], " (%s)" % g["uuid"] if g.get("uuid") else "", g["error"]) for g in broken)


def released_mib(before, after):
    """The MiB that the targeted GPUs' used memory went down by."""
    b, a = used_of(before), used_of(after)
    return max(0, sum((b[i] or 0) - (a.get(i) or 0) for i in b if b[i] is not None))
