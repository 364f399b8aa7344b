# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The diagnosis of a Report (private helper; evidence layer): plain sentences, one per finding, each naming the
pid and the remedy. Reads only the Report (gpu_info's and gpu_release's evidence), never /proc or NVML."""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node


def fmt_bytes(count):
    if count >= 1024 * 1024:
        return fmt_mib(count // (1024 * 1024))
    return "%d KiB" % -(-count // 1024)


def fmt_mib(mib):
    if mib is None:
        return "an unknown amount"
    if mib >= 1024:
        return "%.1f GiB" % (mib / 1024.0)
    return "%d MiB" % mib


def _pname(record):
    where = record.get("container")
    if where and where != node.HOST and record.get("container_pid") is not None:
        return "pid %d (%s, container %s pid %s)" % (record["pid"], record["name"], where, record.get("container_pid"))
    return "pid %d (%s)" % (record["pid"], record["name"])


def _devices_text(paths):
    return ", ".join(paths) if paths else "no device"


def _gpu_list(indexes):
    return ("GPU " if len(indexes) == 1 else "GPUs ") + ", ".join(str(i) for i in indexes)


def _held_text(record):
    """'GPU 1 (4.4 GiB by NVML)' for what a holder is pinned to."""
    parts = []
    for index in record["gpus"]:
        mib = record["shares_mib"].get(index)
        parts.append("GPU %d (%s%s)" % (index, fmt_mib(mib), " by NVML" if "nvml" in record["evidence"] else ""))
    return ", ".join(parts)


def _holder_lines(report, record):
    """What holds what, for a holder of a targeted GPU."""
    pid = record["pid"]
    held = _held_text(record)
    if record["blocked_threads"]:
        out = []
        for thread in record["blocked_threads"]:
            stack = "; kernel stack: %s" % " <- ".join(thread["stack"][:6]) if thread.get("stack") else ""
            out.append("%s has thread %d in D state (wchan %s) holding %s: it is stuck in the kernel and SIGKILL "
                       "takes effect only when that call returns; a GPU reset is refused while it holds the GPU; "
                       "restarting its container (or the node) frees it%s"
                       % (_pname(record), thread["tid"], thread.get("wchan") or "unknown", held or "a context", stack))
        return out
    if record["defunct_leader"]:
        return ["%s is a defunct leader with %d live threads holding %s; SIGKILL to %d frees it; fuser does not see it"
                % (_pname(record), record["live_threads"] or 0, held, pid)]
    if "nvml" not in record["evidence"]:
        lines = []
        for index in record["gpus"]:
            orphan = report.orphans.get(index, {"dead": [], "stale": [], "unaccounted": 0})
            dead = ", ".join("pid %d" % p for p, dummy in orphan["dead"] + orphan.get("stale", []))
            gone = "not visible here" if report.engine.in_container else "which no longer exists"
            if dead:
                where = "NVML names %s on GPU %d, %s" % (dead, index, gone)
            else:
                where = "GPU %d has %s that no process NVML lists accounts for" % (index, fmt_mib(orphan["unaccounted"]))
            heir = [p for p in record["heir_of"] if p in [d for d, dummy in orphan["dead"]]]
            kin = (", its forked child (its %s is %d)" % ("process group" if heir[0] == record["pgrp"] else "session",
                                                          heir[0])) if heir else ""
            lines.append("%s; the memory is held by %s%s, the only holder NVML does not name that maps a context on "
                         "GPU %d; SIGKILL to %d frees it" % (where, _pname(record), kin, index, pid))
        return lines
    if "fd" not in record["via"]:
        return ["%s has no /dev/nvidia* file open but maps %s (fuser shows it only with access m); it holds %s; "
                "SIGKILL to %d frees it" % (_pname(record), _devices_text(record["mapped_devices"]), held, pid)]
    return ["%s holds %s; SIGTERM, then SIGKILL to %d frees it" % (_pname(record), held, pid)]


def _mps_lines(report):
    """MPS: the servers and the clients, and which memory is charged to whom (GPU_FACTS row 26)."""
    def shares(record):
        return ", ".join("GPU %d %s" % (i, fmt_mib(mib)) for i, mib in sorted(record["shares_mib"].items())) or \
            "no memory pinned"
    servers = [r for r in list(report.holders) + list(report.clients) if r.get("mps_role") == "server"]
    clients = [r for r in report.holders if r.get("mps_role") == "client"]
    if not servers and not clients:
        return []
    return ["MPS: server %s; clients %s. Each client's memory is its own (NVML names it with its MiB) and the server "
            "holds a share of its own; a client is stopped by terminate_client through the MPS control daemon, then "
            "SIGTERM and SIGKILL; the server only with all of its clients; the control daemon never"
            % (", ".join("pid %d (%s)" % (r["pid"], shares(r)) for r in servers) or "none seen",
               ", ".join("pid %d (%s)" % (r["pid"], shares(r)) for r in clients) or "none")] + [
        _mps_server_line(report, r["pid"]) for r in servers]


def _mps_server_line(report, pid):
    """Who an MPS server serves, as its control daemon lists them, or why that is not known."""
    entry = report.mps_servers.get(pid) or {"clients": None, "why": "its control daemons were not asked", "unseen": []}
    unread = report.mps_nvml_unread
    nvml = ("NVML lists no MPS client on GPU %s (%s)" % (", ".join(str(i) for i in sorted(unread)), "; ".join(
        sorted(set(str(w) for w in unread.values())))) if unread else "NVML's MPS client list names every MPS client")
    if entry["unseen"]:
        unseen = ", ".join(str(p) for p in entry["unseen"])
        return ("MPS server pid %d: control daemon pid %d lists clients %s (pids as it sees them) that are not seen here: "
                "it is never signalled while they may live" % (pid, entry["control"]["pid"], unseen))
    if entry["clients"] is not None:
        return "MPS server pid %d serves %s, as control daemon pid %d lists them" % (
            pid, ", ".join("pid %d" % p for p in entry["clients"]) or "no client", entry["control"]["pid"])
    if unread:
        return ("MPS server pid %d: its clients cannot be known (%s; %s): it is never signalled; end its clients' "
                "work, then stop MPS through its control daemon (quit) by hand" % (pid, entry["why"], nvml))
    return ("MPS server pid %d: its control daemon could not tell its clients (%s); %s, and those are its clients here, "
            "signalled without terminate_client" % (pid, entry["why"], nvml))


def diagnose(report):
    """Plain sentences, one per finding, each naming the pid and the remedy."""
    targets = set(report.targets)
    lines = _gpu_error_lines(report) + _stale_lines(report) + _unknown_lines(report) + _mps_lines(report)
    for link in report.linked:
        lines.append("pids %s are connected by TCP but are not one job (%s): each is signalled only for its own "
                     "targeted GPUs" % (", ".join(str(p) for p in link["pids"]), link["why"].split(": ", 1)[-1]))
    for record in report.holders:
        lines.extend(_holder_section(report, record, targets))
    for record in report.protected_holders:
        # the upper bound (may_hold), as the reset guard's: the GPU is not free while it may hold it
        if [t for t in targets if holder.may_hold(record, t)]:
            lines.append("%s is an ancestor of this module and holds %s: it is never signalled, and the GPU is not "
                         "free while it runs" % (_pname(record), _held_text(record) or "a context"))
    for gpu in report.gpus:
        if not gpu.get("error") and not gpu["free"]:
            lines.extend(_not_free_lines(report, gpu))
    for zombie in [z for z in report.zombies if z["ppid"] > 1][:5]:
        lines.append("pid %d (%s) is a zombie holding nothing; its parent %s has not reaped it; it holds no GPU "
                     "memory, and killing or fixing the parent only removes the process-table entry"
                     % (zombie["pid"], zombie["name"],
                        "%d (%s)" % (zombie["ppid"], zombie["parent_name"]) if zombie["parent_name"] else str(zombie["ppid"])))
    targeted_minors = set(g["minor"] for g in report.gpus if g.get("minor") is not None)
    for record in report.clients:
        # a client is named for a targeted GPU it has open (has_open), or when it has none open that is known
        if [m for m in targeted_minors if holder.has_open(record, m)] or not record["fd_gpu_minors"]:
            lines.append("%s only has %s open and maps none: an NVML client (a monitor or exporter), not a "
                         "holder; it holds no GPU memory and is never signalled"
                         % (_pname(record), _devices_text(record["fd_devices"])))
    return lines + _unreadable_lines(report) + _shm_lines(report)


def _gpu_error_lines(report):
    """A GPU whose calls fail, and a GPU whose memory is estimated."""
    lines = []
    for gpu in report.gpus:
        if gpu.get("error"):
            lines.append("GPU %s%s: %s; its memory state is unknown, so it is not reported free"
                         % (gpu["index"], " (%s)" % gpu["uuid"] if gpu.get("uuid") else "", gpu["error"]))
    for gpu in report.gpus:
        if (gpu.get("memory") or {}).get("estimated"):
            lines.append("GPU %s: memory estimated, not measured: this driver has no v2 memory call, so used is v1 used "
                         "minus reserved_floor_mib (%s MiB)" % (gpu["index"], gpu["memory"]["reserved_mib"]))
    return lines


def _stale_lines(report):
    return ["NVML names pid %d on GPU %d, but %s: the driver reports host pids (legacy) or the pid was "
            "reused; this entry is stale, its %s count as memory no process here is named for, and pid %d "
            "is pinned by its own mappings alone"
            % (entry["pid"], entry["gpu"], entry["why"], fmt_mib(entry["used_mib"]), entry["pid"])
            for entry in report.nvml_stale]


def _unknown_lines(report):
    lines = []
    for unknown in report.unknown_gpus:
        held = unknown["held_by"]
        lines.append("the GPU of minor %d%s cannot be described by NVML (lost, or its calls fail)%s: it is never "
                     "reported free, and a process with a context on it is never signalled for it (with a targeted "
                     "GPU pinned too, only with collateral: stop)"
                     % (unknown["minor"], "" if unknown["index"] is None else " (GPU %d)" % unknown["index"],
                        "; %s map a context on it" % ", ".join("pid %d" % p for p in held) if held else ""))
    return lines


def _holder_section(report, record, targets):
    """What a holder holds of the targets (holds: the evidence), or why one pinned nowhere is not signalled."""
    pinned = [t for t in sorted(targets) if holder.holds(record, t)]
    if pinned:
        lines = _holder_lines(report, record)
        others = [i for i in record["gpus"] if i not in targets]
        if others:
            lines.append("%s also holds %s, which %s not selected: stopping it stops its work there too"
                         % (_pname(record), ", ".join("GPU %d (%s)" % (i, fmt_mib(record["shares_mib"].get(i)))
                                                      for i in others), "is" if len(others) == 1 else "are"))
        return lines
    # pinned nowhere: named when its evidence touches a target (ambiguous there, a context there) or when it maps
    # no GPU at all, the cases decide leaves alone as ambiguous or unpinned (a merely visible GPU is no reason)
    if record["gpus"] or not (targets & set(record["ambiguous_gpus"] + record["context_gpus"]) or not record["maps_gpus"]):
        return []
    if record["ambiguous_gpus"]:
        rivals = sorted(set(p for i in record["ambiguous_gpus"] for p in
                            [h["pid"] for h in report.holders if i in h["ambiguous_gpus"]]) - set([record["pid"]]))
        why = ("%s and %s each map a context on %s, where NVML shows memory no visible process it names "
               "accounts for: the evidence fits both, so neither is pinned"
               % (_pname(record), ", ".join("pid %d" % p for p in rivals), _gpu_list(record["ambiguous_gpus"])))
    elif record["maps_gpus"]:
        why = ("%s maps a context on %s but NVML does not name it and shows no memory there that no visible "
               "process accounts for: it is not pinned to any GPU" % (_pname(record), _gpu_list(record["context_gpus"])))
    else:
        why = "%s maps only %s: it has a context that no evidence pins to a GPU" % (
            _pname(record), _devices_text(record["mapped_devices"]))
    return ["%s; it is signalled only when every GPU it maps (%s) is targeted"
            % (why, ", ".join(str(i) for i in record["maps_gpus"]) or "every GPU")]


def _not_free_lines(report, gpu):
    """Why a targeted GPU that no holder here explains is not free: a job's residue, dead pids, unaccounted memory."""
    label = "GPU %d (minor %s)" % (gpu["index"], gpu["minor"])
    index = gpu["index"]
    orphan = report.orphans.get(index)
    if gpu["residue"]:
        residue = gpu["residue"]
        return ["%s: %s are held by the surviving ranks of the job of pid %d (pids %s): a rank of that job "
                "on this GPU died during this run and its peers keep part of its memory here, which NVML "
                "charges to no one; the GPU is free only when the whole job stops (collateral: stop, or "
                "target %s)"
                % (label, fmt_mib(residue["mib"]), residue["job"], ", ".join(str(p) for p in residue["pids"]),
                   _gpu_list(report.job_gpus(residue["job"])))]
    if not orphan or gpu["holders"] or gpu["ambiguous"] or gpu.get("protected_holders"):
        return []
    in_container = report.engine.in_container
    lines = ["NVML names pid %d on %s with %s, %s; no process visible here maps a context on it%s"
             % (dead_pid, label, fmt_mib(mib),
                "which no longer exists, or lives outside this container's PID namespace"
                if in_container else "which no longer exists", "; look from the node" if in_container else "")
             for dead_pid, mib in orphan["dead"]]
    if orphan["unaccounted"]:
        # a job that maps this GPU with no member pinned there (holds) may own it: named, never acted on
        peers = sorted(job["id"] for job in report.jobs.values()
                       if all(index in m["maps_gpus"] and not holder.holds(m, index) for m in job["members"]))
        lines.append("%s: %s is used by no process visible here%s; look from the node; if nothing holds it "
                     "there either, only a GPU reset frees it (gpu_release with gpu_reset: true)"
                     % (label, fmt_mib(orphan["unaccounted"]),
                        " (unattributed: it may be residue of a job that maps this GPU, %s, but no rank of it was "
                        "seen here; nothing is stopped for it)" % ", ".join("job of pid %d" % j for j in peers)
                        if peers else ""))
    return lines


def _unreadable_lines(report):
    lines = []
    for info in report.unreadable:
        if info.get("reason") == "truncated":
            lines.append(truncated_line(info, report.gpus))
            continue
        what = ("its memory maps, so whether it holds a GPU is unknown; GPUs it may hold (%s) are never taken "
                "for free on its account" % (", ".join(str(g["index"]) for g in report.gpus if info["pid"] in
                                                       g.get("blocked", ())) or "none targeted")
                if info["may_hold"] else "its command line")
        lines.append("pid %d (%s) is unreadable: blocked: reading %s did not finish within %gs (state %s, wchan %s): "
                     "a thread of it is stuck in the kernel holding its memory-map lock, or others queue behind one "
                     "that does; not read: %s" % (info["pid"], info["name"], info["path"], info["waited_s"],
                                                  info["state"], info["wchan"] or "unknown", what))
    if report.scan.unreadable:
        lines.append("%d processes could not be read (%s); a holder among them would not be shown"
                     % (len(report.scan.unreadable), ", ".join(str(p) for p in report.scan.unreadable[:10])))
    return lines


def _shm_lines(report):
    lines = []
    places = [(None, report.shm_residue)] + sorted((report.shm_residue_by_container or {}).items(), key=lambda i: int(i[0]))
    for vmid, found in places:
        if found:
            lines.append(shm_line(vmid, found))
    for skipped in report.shm_skipped or ():
        where = "container %d: " % skipped["vmid"] if skipped["vmid"] else ""
        lines.append("%s/dev/shm was not judged: %s" % (where, skipped["why"]))
    return lines


def truncated_line(info, gpus):
    """One sentence on a process whose maps had more than the read cap."""
    may = ", ".join(str(g["index"]) for g in gpus if info["pid"] in g.get("blocked", ())) or "none targeted"
    return ("pid %d (%s) is unreadable: truncated: %s has more than %d bytes (a process can make it so), read no further: "
            "whether it holds a GPU is unknown; GPUs it may hold (%s) are never taken for free on its account, and it "
            "is never signalled on a part of its maps" % (info["pid"], info["name"], info["path"], info["cap_bytes"], may))


def shm_line(vmid, found):
    """One sentence on the shared-memory residue of one /dev/shm."""
    stacks = sorted(set(e["owner"] for e in found))
    paths = [e["path"] for e in found]
    return ("%s/dev/shm holds %d GPU stack file%s no live process uses (%s of %s: %s%s): leaked by dead processes, "
            "they can make the next launch fail; remove them before it" % (
                "container %s: " % vmid if vmid else "", len(found), "" if len(found) == 1 else "s",
                fmt_bytes(sum(e["bytes"] for e in found)), ", ".join(stacks),
                ", ".join(paths[:5]), ", ..." if len(paths) > 5 else ""))
