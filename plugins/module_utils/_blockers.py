# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What blocks a GPU reset, and whether the release may go on (private helper, may change any time).

Pure: a report (holders, clients) and readings (persistence and MIG mode per GPU, nvidia_drm's reference count,
each daemon's service) in; the blockers, each with its kind and what will be done about it, and the refusals out.
A reset fails while anything has the GPU open; the driver's daemons hold every GPU of the node.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder

DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter", "nv-fabricmanager")
MODES = ("refuse", "stop_services")


def _gpu_words(gpus):
    return ", ".join("%d (%s)" % (g["index"], g.get("uuid") or "?") for g in gpus)


def plan(report, targets, readings, mode, all_gpus):
    """(blockers, refusals). Each blocker: kind (user_holder, nvml_client, daemon, persistence_mode, nvidia_drm,
    mig_mode), what, gpus (indexes it blocks), action; a refusal is one sentence. user holders are left to the
    ladder (it runs first); with mode refuse every other blocker refuses; with stop_services a daemon under a
    service manager is stopped and started again and persistence mode is turned off and restored, and anything
    else refuses."""
    gpus = [g for g in report.gpus if g["index"] in targets]
    every = [dict(index=g["index"], uuid=g.get("uuid")) for g in all_gpus]
    blockers, refusals = [], []

    def add(kind, what, on, action, refused=None):
        blockers.append({"kind": kind, "what": what, "gpus": sorted(on), "action": action})
        if refused:
            refusals.append("%s: %s" % (what, refused))

    daemon_pids = _daemon_blockers(report, readings, mode, every, add)
    for gpu in gpus:
        index = gpu["index"]
        for record in report.holders:
            if record["pid"] not in daemon_pids and holder.may_hold(record, index):   # the reset guard: the upper bound
                add("user_holder", "pid %d (%s) on GPU %d" % (record["pid"], record["name"], index), [index],
                    "signalled by the ladder before any reset")
        for record in report.clients:
            if record["pid"] not in daemon_pids and holder.has_open(record, gpu.get("minor")):
                add("nvml_client", "pid %d (%s) has GPU %d open (an NVML client, a monitor)" % (record["pid"], record["name"], index),
                    [index], "refused", "not a service and never signalled: stop it yourself")
        if readings.get("persistence", {}).get(index):
            what = "persistence mode on GPU %d" % index
            if mode == "stop_services":
                add("persistence_mode", what, [index], "turned off for the reset (nvidia-smi -pm 0), restored after")
            else:
                add("persistence_mode", what, [index], "refused", "reset_blockers: stop_services turns it off for the "
                    "reset and restores it")
        if readings.get("mig", {}).get(index):
            add("mig_mode", "MIG mode on GPU %d" % index, [index], "refused", "a GPU in MIG mode is reset by its instances "
                "or with MIG disabled: do it by hand")
    if readings.get("drm_refcount"):
        add("nvidia_drm", "nvidia_drm in use (reference count %d)" % readings["drm_refcount"], [g["index"] for g in gpus],
            "refused", "a display stack holds the driver: stop it (and unload nvidia_drm) first")
    return blockers, refusals


def _daemon_blockers(report, readings, mode, every, add):
    """add() a blocker for each of the driver's daemons that has a GPU open (it blocks every GPU of the node);
    the pids of those daemons."""
    daemon_pids = set()
    for record in list(report.holders) + list(report.clients) + list(getattr(report, "protected_holders", [])):
        name = record.get("protected_name")
        if name in DAEMONS and record["pid"] not in daemon_pids:
            daemon_pids.add(record["pid"])
            service = readings.get("services", {}).get(record["pid"])
            what = "pid %d (%s), a daemon that serves every GPU of the node: %s" % (record["pid"], name, _gpu_words(every))
            on = [g["index"] for g in every]
            if service is None:
                add("daemon", what, on, "refused", "not under systemd or supervisord here as a service of the node's root "
                    "(a system unit, or a root supervisord's program, its tool in a system folder), so it cannot be "
                    "stopped and started again through its service manager; stop it yourself")
            elif service.get("refused"):
                add("daemon", what, on, "refused", "%s: stopping it would stop every program that unit runs, and "
                    "starting it again would run them again (B3); stop the daemon yourself" % service["refused"])
            elif mode == "stop_services":
                add("daemon", what, on, "stop %s %s, start it again after the reset" % (service["kind"], service["name"]))
            else:
                add("daemon", what, on, "refused", "stop it for the reset (reset_blockers: stop_services stops %s %s "
                    "and starts it again)" % (service["kind"], service["name"]))
    return daemon_pids
