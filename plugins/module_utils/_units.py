# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""From the Proxmox node: the stop of a stop set inside its container, and a node service's stop and start (private
helper, act layer).

Which stop set runs a holder, and its members, are read by _stopsets (evidence); whether it may be stopped is
decided by _decide.stop_set_verdict. The stop runs inside the container through its own manager, with lxc-attach:
no Perl start-up per call, as pct exec would cost. No AnsibleModule here.
"""

from __future__ import annotations

import shlex
import subprocess

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import generic_unit, stop_set_verdict


def run_on_node(argv, timeout, done="done"):
    """{"ok", "text"} of a command run from the node (a service manager's, or lxc-attach); never raises for the
    command's own failure; done: the text when it succeeds silently."""
    try:
        rc, out = helperproc.run_bounded(argv, timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "text": "did not end within %ss" % timeout}
    except OSError as exc:
        return {"ok": False, "text": "%s: %s" % (argv[0], exc.strerror or exc)}
    text = " ".join(out.split())[:300]
    if rc != 0:
        return {"ok": False, "text": "exit %d: %s" % (rc, text or "no output")}
    return {"ok": True, "text": text or done}


def stop(entry, timeout, attach="lxc-attach"):
    """Run entry's stop inside its container. {"ok", "text"}; never raises for the command's own failure."""
    return run_on_node(where.attach_argv(entry["vmid"], entry["argv"], attach), timeout, "stopped")


KIND_WORDS = {"systemd": "unit", "systemd-user": "user unit", "supervisord": "supervisord program",
              "docker": "docker container", "container": "container restart"}
MEMBERS_SHOWN = 12


def plan_sets(report, planned, skipped, targets, all_gpu_indexes, collateral, tolerance_mib, proc_root="/proc"):
    """The stop sets of the planned holders (node view), each decided by _decide.stop_set_verdict on report (its
    members read now): [entry], entry as stopsets.find's plus pids (the planned holders it runs), chains, verdict,
    reason, collateral, how_to_stop and outcome (None until its stop ran)."""
    out = []
    for entry in stopsets.found_for(planned, proc_root, getattr(report, "scan", None)):
        if entry["kind"] in ("systemd", "systemd-user") and not generic_unit(entry["name"]):
            entry["dependents"] = stopsets.unit_dependents(entry)   # a generic unit is refused without asking
        verdict = stop_set_verdict(entry, report, targets, all_gpu_indexes, [r["pid"] for r in planned], skipped,
                                   collateral, tolerance_mib)
        out.append(dict(entry, how_to_stop=how_to_stop(entry), outcome=None, **verdict))
    return out


def how_to_stop(entry):
    """What to run by hand inside the container to stop entry's set (a sentence)."""
    if entry["argv"]:
        return "`pct exec %d -- %s`" % (entry["vmid"], " ".join(shlex.quote(a) for a in entry["argv"]))
    return "stop what runs pid %s by hand" % ", ".join(str(p) for p in entry["pids"])


def shown(entry):
    """A stop set as the result prints it: no argv, no chains (its dependents, when read, stay)."""
    return dict((k, v) for k, v in entry.items() if k not in ("argv", "chains", "chain"))


def set_words(entry):
    """One line of diagnosis on a stop set that is not stopped: the set, its other members, and what to do."""
    holders = ", ".join(str(p) for p in entry["pids"])
    if entry["verdict"] == "no set":
        return "pid %s in container %s: no stop set (%s); only the holder is signalled" % (
            holders, entry["vmid"], entry["reason"])
    others = [m for m in entry["members"] if m["pid"] not in entry["pids"]]
    listed = ", ".join("%d (%s)" % (m["pid"], m["name"]) for m in others[:MEMBERS_SHOWN])
    more = "" if len(others) <= MEMBERS_SHOWN else " and %d more" % (len(others) - MEMBERS_SHOWN)
    return ("%s %s in container %s runs pid %s (other members: %s%s): not stopped, %s; the holder is signalled alone; "
            "to stop the set by hand: %s" % (KIND_WORDS.get(entry["kind"], entry["kind"]), entry["name"], entry["vmid"],
                                             holders, listed or "none", more, entry["reason"], entry["how_to_stop"]))
