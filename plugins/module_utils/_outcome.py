# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""One result shape for gpu_release, per GPU and per container (private helper; glue layer).

Built from what _release.release() returns (before, after, plan, actions, per_container), on both paths: inside a
container and from the node. It adds keys and removes none, so the role and the gpu_report callback keep reading
the result as they do:
- per_gpu: one entry per targeted GPU: index, uuid, rung (the strongest step taken for it), signals (what was
  sent or done for it, as words), verdict, planned (the pids planned for it);
- each per_container entry (node side) gains rung and signals, the same words for the container as a whole.
Pure: reads the result dict, writes only the new keys.
"""

from __future__ import annotations

# weakest first; "stop" is a unit stop of advanced.stop_found_units, "wait" holders stuck in D state
RUNG_ORDER = ("none", "stop", "sigterm", "sigkill", "wait", "container_restart", "reset")
_RUNG_OF_SIGNAL = {"stop": "stop", "SIGTERM": "sigterm", "SIGKILL": "sigkill", "container_stop": "container_restart",
                   "reset": "reset"}


def done(action):
    """True for a step that was taken: a signal sent, a stop, restart or reset done."""
    outcome = action.get("outcome") or ""
    return outcome == "sent" or outcome.startswith("done")


def words(action):
    """One step as the role reports it: SIGTERM 4388 (python3), container_stop container 101, reset GPU 1."""
    if action.get("pid"):
        return "%s %d (%s)" % (action["signal"], action["pid"], action["name"])
    return "%s %s" % (action["signal"], action["name"])


def strongest(rungs):
    """The highest of rungs in RUNG_ORDER ("none" when empty)."""
    return max(list(rungs) + ["none"], key=RUNG_ORDER.index)


def _concerns(action, gpu, pids):
    """Whether a step was taken for this GPU: a signal to a pid planned for it, its own reset, or a container stop
    (or unit stop) in a container that held it."""
    if action.get("pid"):
        return action["pid"] in pids
    if action.get("signal") == "reset":
        return action.get("name") == "GPU %d" % gpu["index"]
    vmid = action.get("vmid")
    return vmid is not None and ((gpu.get("by_container") or {}).get(str(vmid)) or 0) > 0


def gpu_verdict(gpu, later, planned, check_mode):
    """free or busy once verified; planned or nothing to do in check mode; not released when the task stopped
    before the ladder (a refusal, a lock, NVML: msg says why)."""
    if later is not None:
        return "free" if later.get("free_for_scope", later.get("free")) else "busy"
    if check_mode:
        return "planned" if planned else "nothing to do"
    return "not released"


def gpu_entries(result, check_mode):
    """per_gpu: each targeted GPU of RV(before), with the steps taken for it and its verdict."""
    later = dict((g.get("uuid") or g["index"], g) for g in result.get("after") or [])
    plan = result.get("plan") or []
    taken = [a for a in result.get("actions") or [] if done(a)]
    out = []
    for gpu in result.get("before") or []:
        planned = sorted(set(e["pid"] for e in plan if gpu["index"] in (e.get("gpus") or [])))
        mine = [a for a in taken if _concerns(a, gpu, planned)]
        rung = strongest(_RUNG_OF_SIGNAL[a["signal"]] for a in mine if a["signal"] in _RUNG_OF_SIGNAL)
        if rung == "none" and planned and result.get("rung_reached") == "wait":
            rung = "wait"
        out.append({"index": gpu["index"], "uuid": gpu.get("uuid"), "rung": rung, "signals": [words(a) for a in mine],
                    "verdict": gpu_verdict(gpu, later.get(gpu.get("uuid") or gpu["index"]), planned, check_mode),
                    "planned": planned})
    return out


def add_shape(result, check_mode):
    """Add per_gpu to result, and rung and signals to each of its per_container entries; returns result."""
    result["per_gpu"] = gpu_entries(result, check_mode)
    for entry in result.get("per_container") or []:
        entry.setdefault("rung", strongest(row.get("rung") or "none" for row in entry.get("gpus") or []))
        entry.setdefault("signals", [words(a) for a in entry.get("actions") or [] if done(a)])
    return result
