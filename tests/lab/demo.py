"""`make demo`: free stuck GPU memory across a lab fleet with one playbook, and prove it.

1. Brings up the lab: 2 Proxmox-like nodes, 3 LXC-like containers each, 2 GPUs per container.
2. Leaves GPU memory stuck the ways GPU_FACTS.md describes: a tensor-parallel server, a defunct
   thread-group leader (fuser cannot see it), a forked child that kept its killed parent's
   memory, a supervisord program that respawns, a process that ignores SIGTERM; plus an NVML
   monitor that holds no memory and must survive.
3. Runs `ansible-playbook playbooks/release_gpus.yml`: the listed program stopped inside its container through
   the gpuops.fleet.pct connection, then one gpu_release task per node for all of its containers (the node path).
4. Prints a before/after table per container and GPU, from the fake driver's truth.
5. Runs the playbook again: zero changed tasks.
6. Checks that `labctl gpus` shows every GPU free and the monitor alive; tears the lab down.

Exits 0 only when all of that is verified. Environment: LAB_ID (default "demo-" and six hex digits of the clone's path),
DEMO_KEEP_LOGS=1 keeps the playbook logs (always printed on failure).
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from lablib.common import LabError, clone_lab_id, proc_state, wait_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
VENV_BIN = os.path.dirname(os.path.abspath(sys.executable))
PLAYBOOK = os.path.join(REPO, "playbooks", "release_gpus.yml")
LAB_ID = os.environ.get("LAB_ID") or clone_lab_id("demo")
# Each container sees 2 of its node's 8 GPUs, as NVML indexes 0 and 1.
LAYOUT = {"101": [0, 1], "102": [2, 3], "103": [4, 5], "201": [0, 1], "202": [2, 3], "203": [4, 5]}
# The container GPUs each workload uses (the monitor reads them all, holding none).
WORKLOAD_GPUS = {"101": [0, 1], "102": [0], "103": [0], "201": [0], "202": [0, 1], "203": [1]}
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)")


class DemoError(Exception):
    pass


def say(text=""):
    print(text, flush=True)


def step(text):
    say("\n== %s" % text)


def labctl(*args, parse=True):
    env = dict(os.environ, LAB_ID=LAB_ID)
    proc = subprocess.run([LABCTL] + list(args), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=300, check=False)
    if proc.returncode:
        raise DemoError("labctl %s failed: %s" % (" ".join(args), (proc.stderr or proc.stdout).strip()))
    out = proc.stdout.strip()
    return json.loads(out.splitlines()[-1]) if parse else out


def run_workload(scenario, node, vmid, gpus=(), mib=None, extra=()):
    args = ["run", scenario, "--node", node, "--vmid", vmid]
    if gpus:
        args += ["--gpus", ",".join(str(g) for g in gpus)]
    if mib:
        args += ["--mib", str(mib)]
    if extra:
        args += ["--"] + list(extra)
    return labctl(*args)


def wait_until(predicate, timeout, what):
    try:
        wait_for(predicate, timeout, interval=0.05, what=what)
    except LabError as exc:
        raise DemoError(str(exc)) from None


def used_by_container(gpus):
    """{(vmid, index): (used_mib, node, minor)} from `labctl gpus`."""
    table = {}
    for gpu in gpus:
        for vmid, index in (gpu.get("visible_in") or {}).items():
            table[(str(vmid), int(index))] = (gpu["used_mib"], gpu["node"], gpu["minor"])
    return table


def run_playbook(inventory, extra_vars, log_path, check=False):
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", inventory, PLAYBOOK, "-e", "@" + extra_vars]
    if check:
        cmd.append("--check")
    # The gpuops.fleet.gpu_report callback writes a JSON report beside the log; the first run's table is shown.
    report_json = os.path.splitext(log_path)[0] + ".gpu_report.json"
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", LAB_ID=LAB_ID,
               ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report", GPUOPS_REPORT_PATH=report_json)
    say("$ " + " ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd))
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600, check=False)
    elapsed = time.monotonic() - started
    with open(log_path) as log:
        text = log.read()
    recap = {}
    for line in text.splitlines():
        match = RECAP.match(line)
        if match:
            recap[match.group(1)] = {"ok": int(match.group(2)), "changed": int(match.group(3)),
                                     "unreachable": int(match.group(4)), "failed": int(match.group(5))}
    say("  exit %d in %.1f s; PLAY RECAP:" % (proc.returncode, elapsed))
    for host in sorted(recap):
        r = recap[host]
        say("    %-6s ok=%-3d changed=%-2d unreachable=%d failed=%d"
            % (host, r["ok"], r["changed"], r["unreachable"], r["failed"]))
    if not getattr(run_playbook, "report_shown", False) and "GPU REPORT" in text:
        run_playbook.report_shown = True
        say("  gpuops.fleet.gpu_report (JSON: %s):" % report_json)
        for line in text.split("GPU REPORT", 1)[1].splitlines()[1:]:
            if not line.strip() or line.startswith("GPU report written"):
                break
            say("    " + line)
    return proc.returncode, recap


def main():
    keep_logs = os.environ.get("DEMO_KEEP_LOGS") == "1"
    work = tempfile.mkdtemp(prefix="gpuops-demo-")
    report_dir = os.path.join(work, "report")
    os.makedirs(report_dir)
    failures = []
    logs = []
    say("gpuops.fleet demo: free stuck GPU memory across a Proxmox-like fleet, then prove it")
    say("(lab run id %s; fake NVIDIA driver, real processes, real sshd, real supervisord, real ansible-playbook)"
        % LAB_ID)
    try:
        step("1. Bring up the lab: 2 nodes (pve1, pve2), 3 containers each, 8 GPUs per node")
        labctl("down", parse=False)
        layout_args = []
        for vmid, minors in sorted(LAYOUT.items()):
            layout_args += ["--layout", "%s=%s" % (vmid, ",".join(str(m) for m in minors))]
        status = labctl("up", "--nodes", "2", "--containers", "3", "--unprivileged", "203", *layout_args)
        for node, info in sorted(status["nodes"].items()):
            say("  %s at %s (sshd pid %s): containers %s" % (
                node, info["address"], info["sshd_pid"],
                ", ".join("%s->minors %s" % (v, c["minors"]) for v, c in sorted(info["containers"].items()))))
        inventory = labctl("inventory", parse=False)
        say("  inventory: %s (connection gpuops.fleet.pct)" % inventory)

        step("2. Leave GPU memory stuck")
        workloads = {}
        tp = run_workload("tp_nccl", "pve1", "101", [0, 1], 2048)
        workloads["101"] = ("tp_nccl", "a launcher and two ranks linked by TCP, like SGLang tp=2; each maps both GPUs", tp)
        dl = run_workload("defunct_leader", "pve1", "102", [0], 4096)
        workloads["102"] = ("defunct_leader", "leader exited, its threads hold the GPU; fuser cannot see it", dl)
        fk = run_workload("fork_inherit", "pve1", "103", [0], 3072)
        parent, child = fk["roles"]["parent"], fk["roles"]["child"]
        os.kill(parent, signal.SIGKILL)  # the parent dies; its dataloader child keeps the memory
        wait_until(lambda: proc_state(parent) in (None, "Z"), 10, "fork_inherit parent %d to die" % parent)
        fk["holders"] = [child]
        workloads["103"] = ("fork_inherit", "parent %d SIGKILLed; child %d kept the memory" % (parent, child), fk)
        rs = run_workload("respawn", "pve2", "201", [0], 1024)
        program = rs["supervisor_program"]
        workloads["201"] = ("respawn", "supervisord program %s with autorestart" % program, rs)
        mon = run_workload("monitor", "pve2", "202")
        monitor_pid = mon["roles"]["monitor"]
        workloads["202"] = ("monitor", "NVML-only client (like nvitop); holds no memory, must survive", mon)
        ti = run_workload("term_ignoring", "pve2", "203", [1], 1536)
        workloads["203"] = ("term_ignoring", "ignores SIGTERM; needs SIGKILL", ti)
        for vmid, (name, what, result) in sorted(workloads.items()):
            say("  ct%s %-15s %s (host pids %s)" % (vmid, name, what, result.get("holders") or result["host_pids"]))

        before_gpus = labctl("gpus")
        before = used_by_container(before_gpus)
        busy = sum(1 for g in before_gpus if g["used_mib"] > 0)
        say("  labctl gpus: %d GPUs hold %d MiB in all" % (busy, sum(g["used_mib"] for g in before_gpus)))
        if busy < 6:
            raise DemoError("expected 6 busy GPUs before the release, found %d" % busy)

        step("3. Release with one playbook run (role gpuops.fleet.release_gpus)")
        extra_vars = os.path.join(work, "vars.json")
        with open(extra_vars, "w") as f:
            json.dump({"release_gpus_supervisor_programs": [program],
                       "release_gpus_term_timeout": 3,
                       "release_gpus_report_dir": report_dir}, f)
        say("  vars: supervisord program %s stopped first; SIGTERM timeout 3 s; one gpu_release task per node "
            "(the node path) for its containers" % program)
        log1 = os.path.join(work, "run1.log")
        logs.append(log1)
        rc, recap1 = run_playbook(inventory, extra_vars, log1)
        if rc != 0:
            failures.append("first run exited %d" % rc)
        if len(recap1) != 6 or any(r["failed"] or r["unreachable"] for r in recap1.values()):
            failures.append("first run: not every container ok: %s" % recap1)

        after_gpus = labctl("gpus")
        after = used_by_container(after_gpus)
        step("4. Before and after, per container and GPU (fake driver's truth; rung from the role)")
        header = ("host", "node", "GPU", "workload", "before MiB", "after MiB", "rung", "how")
        say("  %-6s %-5s %-4s %-15s %10s %10s  %-9s %s" % header)
        for vmid in sorted(LAYOUT):
            report_path = os.path.join(report_dir, "ct%s.json" % vmid)
            report = {}
            if os.path.exists(report_path):
                with open(report_path) as f:
                    report = json.load(f)
            rows = {row.get("minor"): row for row in report.get("gpus", [])}
            for index in range(len(LAYOUT[vmid])):
                used_before, node, minor = before[(vmid, index)]
                used_after = after[(vmid, index)][0]
                row = rows.get(minor, {})
                # the report names the memory it found on each workload's GPU (201's program is stopped first)
                if vmid not in ("201", "202") and index in WORKLOAD_GPUS[vmid] and row.get("before_mib") != used_before:
                    failures.append("ct%s GPU %d: the report says %s MiB before, the driver %d"
                                    % (vmid, index, row.get("before_mib"), used_before))
                rung = row.get("rung") or "?"
                how = ""
                if used_before and not (row.get("before_mib") or 0):
                    rung, how = "stop", "; ".join(report.get("stopped", [])) or "freed before the kill step"
                elif rung in ("sigterm", "sigkill"):
                    how = ", ".join(row.get("signals", []))
                elif vmid == "202":
                    how = "NVML client, left alone"
                elif not used_before:
                    how = "nothing to do"
                say("  ct%-4s %-5s %-4s %-15s %10d %10d  %-9s %s" % (
                    vmid, node, "%d/%d" % (index, minor), workloads[vmid][0] if index in WORKLOAD_GPUS[vmid] else "-",
                    used_before, used_after, rung, how))
        say("  (GPU: index in the container / minor on the node; MiB beyond the 615 MiB reserved floor;"
            " pids as the node sees them: one task per node did the work)")

        step("5. Run it again: nothing left to do, so nothing may change")
        log2 = os.path.join(work, "run2.log")
        logs.append(log2)
        rc2, recap2 = run_playbook(inventory, extra_vars, log2)
        changed = sum(r["changed"] for r in recap2.values())
        if rc2 != 0 or len(recap2) != 6 or changed:
            failures.append("second run: exit %d, %d changed tasks: %s" % (rc2, changed, recap2))
        else:
            say("  changed=0 on all 6 containers")

        step("6. Verify with the lab's own truth")
        final = labctl("gpus")
        still = ["%s minor %d: %d MiB" % (g["node"], g["minor"], g["used_mib"]) for g in final if g["used_mib"] > 0]
        if still:
            failures.append("GPUs still used: %s" % ", ".join(still))
        else:
            say("  labctl gpus: all %d GPUs on both nodes at 0 MiB beyond the floor" % len(final))
        state = proc_state(monitor_pid)
        if state in (None, "Z", "X"):
            failures.append("the monitor %d did not survive (state %s)" % (monitor_pid, state))
        else:
            say("  monitor pid %d alive (state %s): NVML clients are never signalled" % (monitor_pid, state))
        sup = subprocess.run([LABCTL, "exec", "--node", "pve2", "--vmid", "201", "--",
                              "/usr/local/sbin/supervisorctl", "status", program],
                             env=dict(os.environ, LAB_ID=LAB_ID), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, universal_newlines=True, timeout=60, check=False)
        if "STOPPED" not in sup.stdout:
            failures.append("supervisord program %s is not STOPPED: %s" % (program, sup.stdout.strip()))
        else:
            say("  supervisord program %s: STOPPED, so it cannot respawn" % program)
        leftovers = [pid for vmid, built in workloads.items() if vmid != "202"
                     for pid in built[2].get("holders", []) if proc_state(pid) not in (None, "Z", "X")]
        if leftovers:
            failures.append("holders still alive: %s" % leftovers)
        else:
            say("  every holder that labctl built is gone")
    except (DemoError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as exc:
        failures.append("%s: %s" % (type(exc).__name__, exc))
    finally:
        step("7. Tear the lab down")
        try:
            labctl("down", parse=False)
            say("  lab %s is down" % LAB_ID)
        except DemoError as exc:
            failures.append(str(exc))
    if failures and logs:
        for path in logs:
            if os.path.exists(path):
                say("\n---- %s (last 60 lines)" % path)
                with open(path) as f:
                    say("".join(f.readlines()[-60:]))
    if keep_logs or failures:
        say("\nlogs kept in %s" % work)
    else:
        subprocess.run(["rm", "-rf", work], check=False)
    if failures:
        say("\nDEMO FAILED:\n  " + "\n  ".join(failures))
        return 1
    say("\nDEMO PASSED: 6 containers on 2 nodes released and verified free; second run changed nothing.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
