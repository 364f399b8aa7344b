#!/usr/bin/env python
"""Render docs/fidelity.md from the JSON files of tests/lab/gpu_facts.py.

    fidelity_report.py [--real H200.json|none] [--lab LAB.json|none] [--out docs/fidelity.md]

One table row per GPU_FACTS.md row, columns "real H200" and "lab": PASS/FAIL and the
measured values. A missing file shows as "not run yet". Everything below the line
`<!-- manual -->` in the existing output is kept, so notes added by hand survive a re-render.
"""

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANUAL = "<!-- manual -->"

SITUATION = {
    1: "idle GPU, no process",
    2: "holder SIGKILLed",
    3: "child SIGKILLed, parent never waits (true zombie)",
    4: "leader exited with `SYS_exit`, threads alive (`Zl <defunct>`)",
    5: "holder forks a child, then the parent is SIGKILLed",
    6: "holder closed every /dev/nvidia* fd, keeps its mappings",
    7: "holder in its own PID namespace",
    8: "a process that only called `nvmlInit` (a monitor)",
}

FACT = {
    1: "v1 `used` = floor (615 MiB), v2 `used` 0, `reserved` = floor; nothing maps /dev/nvidia*",
    2: "memory back by the time `waitpid` returns (0.12-0.17 s)",
    3: "memory back at once while the child is `Z`; no fds; not listed",
    4: "memory held, leader listed; leader fd empty, thread fd shows nvidia0; `fuser` blind; SIGKILL frees",
    5: "memory stays; NVML lists the dead parent, never the child; child holds fds + maps; SIGKILL child frees",
    6: "memory held; no fd; maps name nvidia0/ctl/uvm; `fuser` access `m`; SIGKILL frees",
    7: "host sees host pid, same namespace its pid, another namespace nothing while `used` shows it",
    8: "fds of nvidiactl/nvidia0/uvm, no mapping, not listed; `fuser` `F....` against a holder's `F...m`",
}


def load(path):
    if not path or path == "none" or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def ms(value):
    return "%.0f ms" % value if isinstance(value, (int, float)) else "?"


def mib(value):
    return "%.0f MiB" % value if isinstance(value, (int, float)) else "?"


def lag(value):
    return " (freed %.0f ms later)" % value if isinstance(value, (int, float)) and value > 0 else ""


def values(n, m):
    """Short text of the measured values of row n."""
    g = m.get
    if n == 1:
        return "floor %s (v1 used %s, v2 used %s, reserved %s)" % (
            mib(g("floor_mib")), mib(g("v1_used_mib")), mib(g("v2_used_mib")), mib(g("reserved_mib")))
    if n == 2:
        runs = g("runs") or []
        return "; ".join("%g GiB: kill to reaped %s, used at reap %s%s" % (
            r.get("gib", 0), ms(r.get("kill_to_reaped_ms")), mib(r.get("v2_used_at_reap_mib")),
            lag(r.get("release_lag_ms"))) for r in runs)
    if n == 3:
        text = "used %s while `%s`%s, %s fds" % (
            mib(g("v2_used_mib")), g("child_state"), lag(g("v2_used_lag_ms")), g("child_fds"))
        if "kill_to_zombie_ms" in m:
            text += "; kill to Z %s" % ms(g("kill_to_zombie_ms"))
        return text
    if n == 4:
        return "`%s`, %s threads, held %s; leader fd entries %s; thread fd %s; kill to reaped %s" % (
            g("leader_state"), g("threads"), mib(g("v2_used_mib")), g("leader_fd_entries"),
            ", ".join(g("live_thread_fd_devs") or []), ms(g("kill_to_reaped_ms")) + lag(g("v2_used_at_reap_lag_ms")))
    if n == 5:
        kill = g("child_kill") or {}
        return "held %s after the parent died; NVML %s (parent %s, child %s); child fds %s, maps %s; " \
               "child kill to reaped %s" % (
                   mib(g("v2_used_mib")), g("nvml_pids"), g("parent"), g("child"),
                   ", ".join(g("child_fd_devs") or []), ", ".join(g("child_map_devs") or []),
                   ms(kill.get("kill_to_reaped_ms")) + lag(g("v2_used_at_reap_lag_ms")))
    if n == 6:
        return "held %s; %s maps lines (%s); fuser `%s`; kill to reaped %s" % (
            mib(g("v2_used_mib")), g("map_lines"), ", ".join(g("map_devs") or []),
            " ".join(g("fuser_access") or []), ms(g("kill_to_reaped_ms")) + lag(g("v2_used_at_reap_lag_ms")))
    if n == 7:
        return "NSpid %s: host view %s, same namespace %s, other namespace %s with %s used" % (
            g("nspid"), g("host_view"), g("same_ns_view"), g("other_ns_view"), mib(g("other_ns_v2_used_mib")))
    if n == 8:
        return "monitor fds %s, %s maps lines, fuser `%s`; holder fuser `%s`" % (
            ", ".join(g("monitor_fd_devs") or []), g("monitor_map_lines"),
            " ".join(g("monitor_fuser_access") or []), " ".join(g("holder_fuser_access") or []))
    return ""


def cell(doc, n):
    if doc is None:
        return "not run yet"
    row = next((r for r in doc.get("rows", []) if r.get("row") == n), None)
    if row is None:
        return "not run"
    text = ("PASS: " if row["status"] == "PASS" else "**FAIL**: ") + values(n, row.get("measured") or {})
    failed = [c["name"] for c in row.get("checks", []) if not c["ok"]]
    if failed:
        text += " (failed: %s)" % "; ".join(failed)
    if row.get("error"):
        text += " (error: %s)" % row["error"].strip().splitlines()[-1][:200]
    return text.replace("|", "\\|").replace("\n", " ")


def source(doc, label, path):
    if doc is None:
        return "- **%s**: not run yet." % label
    s = doc.get("settings", {})
    size = ("%s GiB per holder, row 2 %s GiB" % (s.get("gib"), ", ".join("%g" % x for x in s.get("row2_gib", [])))
            if doc.get("backend") == "cuda" else "%s MiB per holder" % s.get("mib"))
    rows = doc.get("rows", [])
    return ("- **%s**: %s, driver %s, %s on %s (Linux %s, Python %s); backend `%s`%s; %s; "
            "%d/%d rows PASS in %s s. Source: `%s`." % (
                label, doc.get("gpu_name"), doc.get("driver_version"), doc.get("date"), doc.get("host"),
                doc.get("kernel"), doc.get("python"), doc.get("backend"),
                " (allocator `%s`: a REHEARSAL on the fake driver, not a real GPU)" % s.get("allocator")
                if s.get("allocator") not in (None, "torch") else "",
                size, sum(r["status"] == "PASS" for r in rows), len(rows), doc.get("seconds"), path))


def render(real, lab, real_path, lab_path, manual):
    lines = [
        "# Fidelity: the lab against the real GPU",
        "",
        "Each row of `GPU_FACTS.md` (measured on a real H200) is run as a scenario by",
        "`tests/lab/gpu_facts.py`, once on the real GPU (`--backend cuda`: PyTorch holders, pynvml,",
        "`tests/bench/device/run_on_h200.sh`) and once in the lab (`--backend lab`: lab containers,",
        "fake driver, NVML stand-in; `make gpu-facts`). A row passes when every outcome of the table",
        "holds; the cells give what was measured. Re-render with",
        "`tests/lab/fidelity_report.py --real REAL.json --lab LAB.json`.",
        "",
        source(real, "real H200", real_path),
        source(lab, "lab", lab_path),
        "",
        "| # | situation | GPU_FACTS.md says | real H200 | lab |",
        "|---|---|---|---|---|",
    ]
    for n in range(1, 9):
        lines.append("| %d | %s | %s | %s | %s |" % (n, SITUATION[n], FACT[n], cell(real, n), cell(lab, n)))
    lines += ["", "Row 2 timings differ by design: the lab frees within a few ms, the real driver in about",
              "0.15 s; both have freed by the time the holder is reaped, which is the fact the modules use.",
              "", MANUAL, manual.rstrip("\n") if manual else "", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", default=os.path.join(REPO, "docs", "facts", "h200.json"))
    p.add_argument("--lab", default=os.path.join(REPO, "docs", "facts", "lab.json"))
    p.add_argument("--out", default=os.path.join(REPO, "docs", "fidelity.md"))
    args = p.parse_args(argv)
    manual = ""
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = f.read()
        if MANUAL in old:
            manual = old.split(MANUAL, 1)[1].lstrip("\n")
    text = render(load(args.real), load(args.lab), display(args.real), display(args.lab), manual)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(args.out)
    return 0


def display(path):
    if not path or path == "none":
        return "-"
    full = os.path.abspath(path)
    return os.path.relpath(full, REPO) if full.startswith(REPO + os.sep) else path


if __name__ == "__main__":
    sys.exit(main())
