# -*- coding: utf-8 -*-
# Copyright (c) gpuops.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
name: gpu_report
type: aggregate
short_description: One table per run of what each GPU held before and after a release
description:
  - An aggregate callback that works beside any stdout callback. It reads the results of
    M(gpuops.fleet.gpu_info), M(gpuops.fleet.gpu_release) and the role C(gpuops.fleet.release_gpus),
    whether they ran in a container or on a node, and at the end of the run prints one table with a row per
    node, container and GPU.
  - Each row shows the MiB used before and after, the rung reached (C(none), C(stop) (freed by stopping a
    service, no signal), C(sigterm), C(sigkill), C(wait), C(reset)), what was stopped or signalled, and the verdict.
  - Before is the first reading of the GPU in the run (M(gpuops.fleet.gpu_info), or the C(before) of
    M(gpuops.fleet.gpu_release)); after is the last. A GPU whose service the role stopped before any reading shows
    the MiB left after the stop.
  - "Verdicts: C(freed) (busy before, free after), C(free) (free before and after), C(busy) (still held),
    C(check) (check mode: nothing was done), C(failed) (no reading after the task failed), C(unreachable)."
  - Every host of every play gets a row (since issue 45). A host with no GPU row gets one row of its own
    (C(gpu_uuid) null) with the verdict C(unreachable) (the host, or its node for a task delegated to the node),
    C(failed) (any task failed on it), C(skipped) (every task on it was skipped, or none reached it before the play
    ended), C(ready) (C(gpuops.fleet.predeploy_check) read it ready) or C(no result) (no GPU was read for it); its
    C(reason) says why. Such a row is left out where another host's rows already show its node and container (a
    node's read for its containers) and it neither failed nor was unreachable, and for the implicit localhost.
  - A container whose node was unreachable on the role's node path (and in C(gpu_info.yml) and
    C(predeploy_check.yml)) is C(unreachable), with the reason C(node N unreachable).
  - With the extra variable C(predeploy_report_path) (C(playbooks/predeploy_check.yml)), also writes the pre-deploy
    verdict there as JSON at the end of the run, whatever failed; see the pre-deploy guide.
  - The actions repeat only what the modules and the role return, which the modules already redacted
    (see the C(redact) option of the modules).
  - A M(gpuops.fleet.gpu_release) delegated to a node for several containers (the node path of
    C(playbooks/release_gpus.yml)) adds no row by itself; each container's own part of it does, through the role's
    C(release_gpus_result).
  - Rows are keyed by inventory host. The node is the host variable C(proxmox_node) (set by
    gpuops.fleet.proxmox_gpu), else C(lab_node), else C(ansible_host); the container is C(ansible_pct_vmid), C(pct_vmid),
    C(proxmox_vmid) or C(vmid), and null for a node.
version_added: 0.2.0
author: gpuops (@gpuops)
requirements:
  - Enable it with C(callbacks_enabled = gpuops.fleet.gpu_report) in the C([defaults]) section of
    C(ansible.cfg), or C(ANSIBLE_CALLBACKS_ENABLED=gpuops.fleet.gpu_report).
options:
  report_path:
    description:
      - Also write the rows as JSON to this file on the controller (for maintenance logs).
      - The file holds an object with C(rows), a list of objects with the keys C(host), C(node), C(container),
        C(gpu_uuid), C(gpu_index), C(before_mib), C(after_mib), C(rung), C(verdict), C(reason) (why a row failed,
        was unreachable or skipped, else null) and C(actions) (a list of strings).
      - Not written when empty.
      - Written to a new file of mode 0600 beside it, then renamed over it; a symlink at this path is replaced, never
        followed.
    type: path
    env:
      - name: GPUOPS_REPORT_PATH
    ini:
      - section: callback_gpu_report
        key: report_path
        version_added: 0.2.0
"""

EXAMPLES = r"""
# ansible.cfg
# [defaults]
# callbacks_enabled = gpuops.fleet.gpu_report
# [callback_gpu_report]
# report_path = /var/log/gpuops/window.json

# or, for one run:
# ANSIBLE_CALLBACKS_ENABLED=gpuops.fleet.gpu_report GPUOPS_REPORT_PATH=/tmp/window.json \
#   ansible-playbook -i inventory playbooks/release_gpus.yml
"""

import json
import os
import re

from ansible.module_utils.common.text.converters import to_bytes, to_native
from ansible.plugins.callback import CallbackBase

from ansible_collections.gpuops.fleet.plugins.module_utils._release import RUNGS   # the module's ladder, in its order
from ansible_collections.gpuops.fleet.plugins.plugin_utils._safe_file import replace_file

STATUS_ACTIONS = ("gpuops.fleet.gpu_info", "gpu_info", "gpuops.fleet.gpu_info", "gpu_status")   # the old name redirects
RELEASE_ACTIONS = ("gpuops.fleet.gpu_release", "gpu_release")
NODE_VARS = ("proxmox_node", "lab_node", "ansible_host")
CONTAINER_VARS = ("ansible_pct_vmid", "pct_vmid", "proxmox_vmid", "vmid")
COLUMNS = (("node", "NODE"), ("container", "CT"), ("host", "HOST"), ("gpu_index", "GPU"), ("gpu_uuid", "UUID"),
           ("before_mib", "BEFORE MiB"), ("after_mib", "AFTER MiB"), ("rung", "RUNG"), ("verdict", "VERDICT"),
           ("reason", "REASON"), ("actions", "STOPPED / SIGNALLED"))


# Terminal escapes from a container's strings (process names, messages): OSC (title, hyperlinks), DCS/PM/APC/SOS
# strings, CSI (cursor, erase, colour), in their 7-bit (ESC x) and 8-bit (C1) forms, then any other ESC pair.
_ESCAPES = re.compile(r"(?:\x1b\]|\x9d|\x1b[P^_X]|[\x90\x98\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                      r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?|\x1b[ -/]*[0-~]?")
_LINE_BREAKS = re.compile(r"[\t\n\r\v\f]+")
# what is left of C0, DEL, C1, and the bidirectional overrides that reorder what a terminal shows
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text):
    """A table cell as a terminal should get it: no escape sequence, no control character, one line."""
    return _CONTROLS.sub("", _LINE_BREAKS.sub(" ", _ESCAPES.sub("", text)))


def _mib(value):
    return value if isinstance(value, int) else None


class HostReport:
    """What one inventory host's tasks said about its GPUs, in the order they said it."""

    def __init__(self, host):
        self.host = host
        self.gpus = {}          # uuid (or index) -> row fields
        self.stopped = []       # services stopped by the role
        self.left_changed = []  # what a release stopped and could not restore (its left_changed)
        self.failed = False
        self.unreachable = False
        self.check_mode = False
        # issue 45: every host of the play gets a row, with a verdict and the reason
        self.task_failed = False    # a task failed on it, whatever its action
        self.role_verdict = None    # the role's own verdict (release_gpus_result.verdict) when it read no GPU
        self.ran = 0                # results that were not skipped
        self.skipped = 0
        self.reasons = []           # why: failure and unreachable messages, in order
        self.predeploy = None       # predeploy_check.yml's predeploy_result fact

    def note_reason(self, text):
        """One more reason, unless one already said it (a longer message replaces its own beginning)."""
        text = " ".join(str(text).split())
        if not text or any(known.startswith(text) for known in self.reasons):
            return
        self.reasons = [known for known in self.reasons if not text.startswith(known)] + [text]

    def gpu(self, entry):
        key = entry.get("uuid") or "index %s" % entry.get("index")
        row = self.gpus.setdefault(key, {"gpu_uuid": entry.get("uuid"), "gpu_index": entry.get("index"),
                                         "before_mib": None, "after_mib": None, "after_read": False,
                                         "free": None, "rung": "none", "signals": [], "container": None})
        if entry.get("index") is not None:
            row["gpu_index"] = entry.get("index")
        for key in ("vmid", "container"):   # a node-side result naming each GPU's container
            if entry.get(key) is not None:
                row["container"] = entry[key]
        return row

    def note_left_changed(self, entries):
        """What a release stopped and could not restore: one action line each, and the host's rows fail."""
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, dict):
                line = "LEFT CHANGED: %s %s (%s)" % (entry.get("what"), entry.get("state"), entry.get("why"))
                if line not in self.left_changed:
                    self.left_changed.append(line)

    # ---- module results
    def add_status(self, res):
        for entry in res.get("gpus") or []:
            if res.get("view") == "node" and entry.get("by_container"):
                self._add_node_status(entry)
                continue
            row = self.gpu(entry)
            used = _mib((entry.get("memory") or {}).get("used_mib"))
            if row["before_mib"] is None and not row["after_read"]:
                row["before_mib"] = used
                row["was_free"] = bool(entry.get("free"))
            else:
                row["after_mib"], row["after_read"] = used, True
                row["free"] = entry.get("free")
            if row["free"] is None or not row["after_read"]:
                row["free"] = entry.get("free")

    def _add_node_status(self, entry):
        """A node-side reading: one row per container holding memory on the GPU (its MiB by container)."""
        shares = entry["by_container"]
        seen = set(k for k, row in self.gpus.items() if isinstance(k, tuple) and k[0] == entry.get("uuid"))
        for where in sorted(set(shares) | set(row_key[1] for row_key in seen)):
            key = (entry.get("uuid"), where)
            row = self.gpus.setdefault(key, {"gpu_uuid": entry.get("uuid"), "gpu_index": entry.get("index"),
                                             "before_mib": None, "after_mib": None, "after_read": False,
                                             "free": None, "rung": "none", "signals": [], "container": where})
            mib = _mib(shares.get(where, 0))
            if row["before_mib"] is None:
                row["before_mib"], row["was_free"] = mib, not mib
            else:
                row["after_mib"], row["after_read"] = mib, True
            row["free"] = not mib

    def add_release(self, res):
        self.note_left_changed(res.get("left_changed"))
        before = res.get("before") or []
        after = res.get("after")
        actions = res.get("actions") or []
        plan = res.get("plan") or []
        if "after" in res and after is None and before:
            self.check_mode = True   # check mode: the plan, nothing done
        for entry in before:
            row = self.gpu(entry)
            if row["before_mib"] is None:   # the first reading of the run is the before
                row["before_mib"] = _mib(entry.get("used_mib"))
                row["was_free"] = bool(entry.get("free"))
            row["free"] = entry.get("free")
            pids = {p.get("pid") for p in plan if entry.get("index") in (p.get("gpus") or [])}
            sent = [a for a in actions if a.get("outcome") == "sent" and a.get("pid") in pids]
            resets = [a for a in actions if a.get("signal") == "reset" and a.get("name") == "GPU %s" % entry.get("index")]
            row["signals"] = ["%s %s (%s)" % (a.get("signal"), a.get("pid"), a.get("name")) for a in sent]
            row["signals"] += ["reset GPU %s: %s" % (entry.get("index"), a.get("outcome")) for a in resets]
            signals = {a.get("signal") for a in sent}
            restarted = [a for a in actions if a.get("signal") == "container_stop" and str(a.get("outcome")).startswith("done")]
            row["signals"] += ["restarted container %s" % a.get("vmid") for a in restarted]
            if entry.get("free"):
                row["rung"] = "none"
            elif restarted:
                row["rung"] = "container_restart"
            elif resets:
                row["rung"] = "reset"
            elif "SIGKILL" in signals:
                row["rung"] = "sigkill"
            elif "SIGTERM" in signals:
                row["rung"] = "sigterm"
            else:
                row["rung"] = res.get("rung_reached") or "none"
        for entry in after or []:
            row = self.gpu(entry)
            row["after_mib"], row["after_read"], row["free"] = _mib(entry.get("used_mib")), True, entry.get("free")

    def add_role_result(self, report):
        """The role's release_gpus_result fact: its rows win over what the modules said."""
        self.check_mode = self.check_mode or bool(report.get("check_mode"))
        if report.get("verdict") == "unreachable" or report.get("node_unreachable"):
            self.role_verdict = "unreachable"   # its node was unreachable: nothing was read for it (issue 45)
            self.note_reason(report.get("reason") or "its node is unreachable")
        if report.get("stopped"):
            self.stopped = list(report["stopped"])
        self.note_left_changed(report.get("left_changed"))
        for entry in report.get("gpus") or []:
            row = self.gpu(entry)
            if row["before_mib"] is None:
                row["before_mib"] = _mib(entry.get("before_mib"))
                row["was_free"] = row["before_mib"] == 0 or entry.get("rung") == "none"
            row["after_mib"], row["after_read"] = _mib(entry.get("after_mib")), True
            row["free"] = entry.get("free")
            row["rung"] = entry.get("rung") or row["rung"]
            row["signals"] = list(entry.get("signals") or row["signals"])

    # ---- rows
    def rows(self, node, container):
        out = []
        for row in self.gpus.values():
            before, after = row["before_mib"], row["after_mib"] if row["after_read"] else None
            if self.check_mode:
                verdict = "check"
            elif not row["after_read"] and self.failed:
                verdict = "failed"
            elif row["free"]:
                verdict = "free" if row.get("was_free", True) else "freed"
            else:
                verdict = "busy"
            rung = row["rung"]
            if rung == "none" and verdict == "freed" and self.stopped:
                rung = "stop"   # freed by stopping its service, before any signal
            if after is None and not self.check_mode and not self.failed:
                after = before   # read once, never released: the reading stands for both
            out.append({"host": self.host, "node": node, "container": row["container"] if row["container"] is not None
                        else container, "gpu_uuid": row["gpu_uuid"], "gpu_index": row["gpu_index"],
                        "before_mib": before, "after_mib": after,
                        "rung": rung if rung in RUNGS else str(rung),
                        "verdict": "failed" if self.left_changed else verdict,
                        "reason": "; ".join(self.reasons) or None if self.left_changed or verdict == "failed" else None,
                        "actions": ["stopped " + s for s in self.stopped] + row["signals"] + self.left_changed})
        if not out:
            verdict, reason = self.host_verdict()
            out.append({"host": self.host, "node": node, "container": container, "gpu_uuid": None, "gpu_index": None,
                        "before_mib": None, "after_mib": None, "rung": "none", "verdict": verdict, "reason": reason,
                        "actions": ["stopped " + s for s in self.stopped] + self.left_changed})
        return out

    def host_verdict(self):
        """(verdict, reason) of a host that has no GPU row: unreachable, failed, skipped or no result (issue 45)."""
        reasons = "; ".join(self.reasons)
        if self.unreachable or self.role_verdict == "unreachable" or (self.predeploy or {}).get("verdict") == "unreachable":
            return "unreachable", reasons or "unreachable"
        if self.failed or self.task_failed:
            return "failed", reasons or "a task failed"
        if self.left_changed:
            return "failed", "left changed by the release"
        if (self.predeploy or {}).get("verdict") == "ready":
            return "ready", "predeploy_check.yml: every targeted GPU of it is ready"
        if not self.ran:
            return "skipped", ("every task on it was skipped" if self.skipped else
                               "no task ran on it: the play ended before it got one")
        return "no result", "no GPU was read for it"


def host_place(hostvars, host):
    """(node, container) of an inventory host from its variables."""
    container = next((hostvars[k] for k in CONTAINER_VARS if hostvars.get(k) not in (None, "")), None)
    node = next((hostvars[k] for k in NODE_VARS if hostvars.get(k) not in (None, "")), None)
    if container is None and hostvars.get("proxmox_node") in (None, "") and hostvars.get("lab_node") in (None, ""):
        node = host     # a node itself
    try:
        container = int(container) if container is not None else None
    except (TypeError, ValueError):
        container = str(container)
    return (str(node) if node is not None else None), container


def build_rows(reports, places, implicit=()):
    """All rows, sorted by node, container, host and GPU index. places: host -> (node, container).

    Every host gets a row (issue 45): its GPUs' rows, or one row of its own (gpu_uuid null) with the verdict
    unreachable, failed, skipped or no result and the reason. A host's own row is left out where another host's rows
    already name its node and container (a node's read for its containers), and for implicit hosts (localhost)
    unless one failed or was unreachable. A GPU row without a UUID is left out, as before.
    """
    gpu_rows, host_rows = [], []
    for host, report in reports.items():
        node, container = places.get(host, (host, None))
        for row in report.rows(node, container):
            (gpu_rows if row["gpu_uuid"] else host_rows).append(row)
    covered = set((r["host"], None) for r in gpu_rows) | set((str(r["node"]), str(r["container"])) for r in gpu_rows
                                                             if r["container"] is not None)
    rows = gpu_rows + [r for r in host_rows if r["verdict"] in ("unreachable", "failed") or (
        r["host"] not in implicit and (r["host"], None) not in covered
        and (r["container"] is None or (str(r["node"]), str(r["container"])) not in covered))]
    rows.sort(key=lambda r: (str(r["node"]), str(r["container"]), r["host"],
                             r["gpu_index"] if isinstance(r["gpu_index"], int) else -1, str(r["gpu_uuid"])))
    return rows


def _message(res):
    """A failed or unreachable result's message, on one line."""
    text = res.get("msg") or res.get("reason") or res.get("stderr") or res.get("module_stderr") or ""
    return " ".join(to_native(text).split())


def exit_code(broke, unreachable, failed):
    """The status ansible-playbook exits with, as ansible-core's strategy and PlaybookExecutor decide it from the last
    play that ran: 2 when it broke off (max_fail_percentage), else 4 when a host of the run was unreachable, else 2 when
    a host of that play failed, else 0."""
    if broke:
        return 2
    if unreachable:
        return 4
    return 2 if failed else 0


def predeploy_verdict(reports, places, code, summary, checked_hosts, implicit=()):
    """playbooks/predeploy_check.yml's verdict for a pipeline (issue 45), from what its tasks and the run said.

    verdict: ready (exit 0, every container checked ready), not_ready (exit 2: a container at fault, fewer containers
    than expected), unreachable (exit 4: a container or its node unreachable), not_checked (nothing checked: the first
    play failed, or a --limit left no container, which exits 0). The exit code is the one ansible-playbook returns.
    """
    containers = []
    for host in sorted(h for h in reports if h in checked_hosts and h not in implicit):
        report = reports[host]
        node, container = places.get(host, (host, None))
        mine = report.predeploy or {}
        if report.unreachable or report.role_verdict == "unreachable":
            verdict, reasons = "unreachable", list(report.reasons) or ["unreachable"]
        elif mine.get("verdict"):
            verdict, reasons = str(mine["verdict"]), [str(r) for r in mine.get("reasons") or []]
        elif report.task_failed:
            verdict, reasons = "failed", list(report.reasons)
        else:
            verdict, reasons = "not_checked", [report.host_verdict()[1]]
        remedies = [str(r) for r in mine.get("remedies") or []]
        if verdict == "unreachable" and not remedies:
            remedies = ["make it and its node reachable from the controller (SSH), then run the check again"]
        containers.append({"host": host, "node": node, "container": container, "verdict": verdict, "reasons": reasons,
                           "remedies": remedies})
    summary = summary or {}
    reasons = [str(line) for line in summary.get("lines") or []]
    for host in sorted(implicit):   # the first play's localhost: why there was nothing to check
        reasons.extend(reports[host].reasons if host in reports else [])
    checked = [c for c in containers if c["verdict"] in ("ready", "not_ready")]
    if code == 4:
        verdict = "unreachable"
    elif code == 0:
        verdict = "ready" if summary.get("verdict") == "ready" and checked else "not_checked"
    elif summary.get("verdict") in ("not_ready", "not_checked"):
        verdict = summary["verdict"]
    else:
        verdict = "not_ready" if checked else "not_checked"
    if verdict == "not_checked" and not reasons:
        reasons = ["no container was checked"]
    return {"verdict": verdict, "exit_code": code, "ready": verdict == "ready" and code == 0,
            "checked": len(checked), "expected": summary.get("expected"), "reasons": reasons, "containers": containers}


def render_table(rows):
    """Plain text table, one line per row (actions joined by '; '); every cell printable()."""
    def cell(row, key):
        value = row.get(key)
        if key == "actions":
            return printable("; ".join(str(v) for v in value)) if value else "-"
        return "-" if value is None else printable(str(value))
    header = [column[1] for column in COLUMNS]
    body = [[cell(row, column[0]) for column in COLUMNS] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
    lines = ["  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in [header] + body]
    return lines


def ingest(report, action, res, delegated=False):
    """Feed one task result (or loop item) into a HostReport.

    A gpu_release delegated to a node for several containers (the role's node path, RV per_container) ran on
    behalf of all of them: each container reports its own part through its release_gpus_result, so the
    delegated result itself adds no row to the host that happened to run it.
    """
    if res.get("results") and isinstance(res["results"], list):
        for item in res["results"]:
            if isinstance(item, dict):
                ingest(report, action, item, delegated)
        return
    if action in STATUS_ACTIONS and res.get("gpus"):
        report.add_status(res)
    elif action in RELEASE_ACTIONS and (res.get("before") or res.get("after")) and not (delegated and res.get("per_container")):
        report.add_release(res)
    elif action in RELEASE_ACTIONS:
        report.note_left_changed(res.get("left_changed"))   # a hard stop's result: no readings, perhaps a restore left
    facts = res.get("ansible_facts") or {}
    if isinstance(facts.get("release_gpus_release"), dict):
        report.add_release(facts["release_gpus_release"])
    if isinstance(facts.get("release_gpus_stop_done"), list):
        report.stopped = [str(s) for s in facts["release_gpus_stop_done"]]
    if isinstance(facts.get("release_gpus_result"), dict):
        report.add_role_result(facts["release_gpus_result"])


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "gpuops.fleet.gpu_report"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reports = {}
        self._places = {}
        self._play = None
        self._implicit = set()
        self._extra_vars = {}
        self._predeploy_summary = None
        self._checked_hosts = set()
        # what decides ansible-playbook's exit status (exit_code)
        self._unreachable = set()
        self._play_failed = set()
        self._play_broke = False

    def _report(self, result):
        return self._host_report(result._host)

    def _host_report(self, host):
        name = host.get_name()
        if name not in self._places:
            self._places[name] = host_place(self._hostvars(host), name)
        if getattr(host, "implicit", False):
            self._implicit.add(name)
        return self._reports.setdefault(name, HostReport(name))

    def _hostvars(self, host):
        """The variables that place a host (node, container): the inventory's own first; the play's only where no
        fact could have set them (a container's facts never file its row under another node or vmid, issue 41)."""
        merged = {}
        for group in sorted(host.get_groups(), key=lambda g: g.depth):
            merged.update(group.get_vars())
        merged.update(host.get_vars())
        try:
            manager = self._play.get_variable_manager() if self._play else None
            every = manager.get_vars(play=self._play, host=host, include_hostvars=False) if manager else {}
        except Exception:  # pylint: disable=broad-except  # the inventory's own variables suffice
            every = {}
        facts = every.get("ansible_facts") or {}
        for key, value in every.items():
            bare = key[len("ansible_"):] if key.startswith("ansible_") else key
            if key not in merged and key not in facts and bare not in facts:
                merged[key] = value
        return merged

    def _ingest(self, result, failed=False):
        res = result._result if isinstance(result._result, dict) else {}
        action = result._task.action if result._task else ""
        report = self._report(result)
        report.ran += 1
        if failed:  # any task's failure: the host's own row says failed, and why (issue 45)
            report.task_failed = True
            report.note_reason(_message(res))
        relevant = action in STATUS_ACTIONS + RELEASE_ACTIONS or "ansible_facts" in res or "results" in res
        if not relevant:
            return
        if failed and action in STATUS_ACTIONS + RELEASE_ACTIONS and not res.get("after"):
            report.failed = True
        ingest(report, action, res, delegated=bool(getattr(result._task, "delegate_to", None)))
        facts = res.get("ansible_facts") or {}
        if isinstance(facts.get("predeploy_result"), dict):
            report.predeploy = facts["predeploy_result"]
        if isinstance(facts.get("predeploy_summary"), dict):
            self._predeploy_summary = facts["predeploy_summary"]

    def v2_playbook_on_play_start(self, play):
        self._play = play
        self._play_failed, self._play_broke = set(), False
        try:   # every host of the play gets a row, even one that no task reached (issue 45)
            manager = play.get_variable_manager()
            self._extra_vars = dict(manager.extra_vars)
            # every batch of a serial play (restrictions), within --limit
            hosts = manager._inventory.get_hosts(play.hosts, ignore_restrictions=True)   # pylint: disable=protected-access
        except Exception:  # pylint: disable=broad-except  # the hosts that report a result still get their rows
            hosts = []
        patterns = [play.hosts] if isinstance(play.hosts, str) else list(play.hosts or [])
        for host in hosts:
            self._host_report(host)
            if patterns != ["localhost"]:   # predeploy_check.yml's first play checks the inventory, no container
                self._checked_hosts.add(host.get_name())

    def v2_runner_on_ok(self, result):
        self._ingest(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._ingest(result, failed=not ignore_errors)
        if not ignore_errors:
            self._play_failed.add(result._host.get_name())

    def v2_playbook_on_no_hosts_remaining(self):
        self._play_broke = True   # the linear strategy says so only when it breaks the play off

    def v2_runner_on_skipped(self, result):
        self._report(result).skipped += 1

    def v2_runner_on_unreachable(self, result):
        report = self._report(result)
        report.unreachable = True
        if not getattr(result._task, "ignore_unreachable", False):
            self._unreachable.add(result._host.get_name())
        res = result._result if isinstance(result._result, dict) else {}
        delegate = getattr(result._task, "delegate_to", None) if result._task else None
        if delegate and delegate != result._host.get_name():   # a task delegated to its node (the node path)
            report.note_reason("node %s unreachable: %s" % (delegate, _message(res)))
        else:
            report.note_reason("unreachable: %s" % _message(res))

    def v2_playbook_on_stats(self, stats):
        # a failure that a block rescued counts under rescued, not failures: it fails neither the host nor the run
        failures = getattr(stats, "failures", None) or {}
        for name, report in self._reports.items():
            if report.task_failed and not failures.get(name):
                report.task_failed = False
        failed = set(name for name in self._play_failed if failures.get(name))
        rows = build_rows(self._reports, self._places, self._implicit)
        path = self.get_option("report_path")
        predeploy_path = self._extra_vars.get("predeploy_report_path")
        if predeploy_path:
            verdict = predeploy_verdict(self._reports, self._places, exit_code(self._play_broke, self._unreachable, failed),
                                        self._predeploy_summary, self._checked_hosts, self._implicit)
            self._write(os.path.expanduser(str(predeploy_path)), verdict, "pre-deploy verdict")
        if not rows and not path:
            return
        self._display.banner("GPU REPORT")
        for line in render_table(rows) if rows else ["no GPU results in this run"]:
            self._display.display(line)
        if path:
            self._write(os.path.expanduser(path), {"rows": rows}, "GPU report")

    def _write(self, path, content, what):
        """content as JSON (control characters escaped by json): a new file of mode 0600 renamed over path."""
        data = to_bytes(json.dumps(content, indent=2, sort_keys=True) + "\n")
        try:
            if os.path.dirname(path):
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            replace_file(path, data, 0o600)
        except OSError as exc:
            self._display.warning("gpu_report: the %s was not written to %s: %s" % (what, path, to_native(exc)))
            return
        self._display.display("%s written to %s" % (what[0].upper() + what[1:], path))
