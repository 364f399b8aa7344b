"""Fleet benchmark (issues 13 and 20). Prints a Markdown fragment on stdout.

24 containers on 3 lab nodes (8 per node, each container its own GPU), each with one holder.
In every round, against the same lab in the same run:

- the whole role on the container path: playbooks/release_gpus.yml with release_gpus_from: container (forks 24,
  release_gpus_node_concurrency 8);
- the node path: the same playbook with release_gpus_from: node (one gpu_release task per node, issue 20);
- the anchor: a playbook with one gpuops.fleet.gpu_release task per container (forks 24);
- the same two on a single container (ct101).

Each run is timed (wall) and the controller's CPU is measured as the ansible-playbook process
tree's user+system seconds (resource.getrusage(RUSAGE_CHILDREN) deltas around the run; the lab's
sshd and pct are not its children). CPU is also given per host and task line, the task lines
being the `TASK [` lines of the default output. Truth after each run: every GPU at 0 MiB in
`labctl gpus`, every holder gone from the host's /proc.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))

from _enginelab import EngineLab, host_alive  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_FLEET_ROUNDS", "3"))
NODES, PER_NODE, MIB = 3, 8, 300
PCT_DELAY = "0.1"
VMIDS = [(n, "%d%02d" % (n, c)) for n in range(1, NODES + 1) for c in range(1, PER_NODE + 1)]
TIMEOUTS = {"term_timeout": 2, "kill_timeout": 5, "verify_timeout": 10}
ANCHOR = """---
- name: One gpu_release task per container
  hosts: gpu_containers
  gather_facts: false
  tasks:
    - name: Release the GPUs
      gpuops.fleet.gpu_release:
        term_timeout: %(term_timeout)s
        kill_timeout: %(kill_timeout)s
        advanced:
          verify_timeout: %(verify_timeout)s
""" % TIMEOUTS


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def playbook(lab, path, limit, extra=(), forks=24):
    cmd = [os.path.join(REPO, ".venv", "bin", "ansible-playbook"), "-i", lab.inventory, path, "--forks", str(forks)]
    cmd += list(extra) + (["--limit", limit] if limit else [])
    cpu, start = children_cpu(), time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=600, check=False)
    wall, cpu = time.monotonic() - start, children_cpu() - cpu
    lines = sum(1 for line in proc.stdout.splitlines() if line.startswith("TASK ["))
    return proc, wall, cpu, lines


def load(lab, vmids):
    holders = []
    for node, vmid in vmids:
        result = lab.run("plain", vmid, [0], mib=MIB, node="pve%d" % node)
        holders += result["holders"]
    return holders


def check(lab, name, proc, holders):
    used = sum(g["used_mib"] for n in range(1, NODES + 1) for g in lab.labctl("gpus", "--node", "pve%d" % n))
    alive = [p for p in holders if host_alive(p)]
    if proc.returncode or used or alive:
        detail = (name, proc.returncode, used, alive, proc.stdout[-4000:])
        sys.stderr.write("%s failed: rc %d, %d MiB left, alive %s\n%s\n" % detail)
        raise SystemExit(1)


def close(lab, nodes):
    """Every node's holders killed, then the lab down."""
    for node in range(1, nodes + 1):
        lab.cleanup(node="pve%d" % node)
    lab.down()


def median(runs, name, field):
    return statistics.median(r[field] for r in runs[name])


def main():
    lab = EngineLab("fleetbench", ["--nodes", str(NODES), "--containers", str(PER_NODE), "--gpus", str(PER_NODE)]
                    + [a for n, v in VMIDS for a in ("--layout", "%s=%d" % (v, int(v[-2:]) - 1))])
    lab.env["LAB_PCT_DELAY"] = PCT_DELAY
    anchor = os.path.join(lab.workdir, "anchor.yml")
    with open(anchor, "w") as handle:
        handle.write(ANCHOR)
    role_args = ["-e", "release_gpus_node_concurrency=8"]
    role_args += ["-e", "release_gpus_term_timeout=%(term_timeout)s release_gpus_kill_timeout=%(kill_timeout)s" % TIMEOUTS,
                  "-e", json.dumps({"release_gpus_advanced": {"verify_timeout": TIMEOUTS["verify_timeout"]}})]
    node_args = role_args + ["-e", "release_gpus_from=node"]
    role_args = role_args + ["-e", "release_gpus_from=container"]     # the per-container path
    variants = [("role, fleet", os.path.join(REPO, "playbooks", "release_gpus.yml"), None, role_args, 24),
                ("node path, fleet", os.path.join(REPO, "playbooks", "release_gpus.yml"), None, node_args, 24),
                ("gpu_release, fleet", anchor, None, [], 24),
                ("role, one container", os.path.join(REPO, "playbooks", "release_gpus.yml"), "ct101", role_args, 1),
                ("gpu_release, one container", anchor, "ct101", [], 1)]
    runs = {name: [] for name, *_rest in variants}
    try:
        for _round in range(ROUNDS):
            for name, path, limit, extra, hosts in variants:
                holders = load(lab, VMIDS if hosts > 1 else VMIDS[:1])
                proc, wall, cpu, lines = playbook(lab, path, limit, extra)
                check(lab, name, proc, holders)
                runs[name].append((wall, cpu, lines, hosts))
                lab.cleanup()
    finally:
        close(lab, NODES)

    def med(name, field):
        return median(runs, name, field)

    rows = []
    for name, *_rest in variants:
        hosts = runs[name][0][3]
        lines = med(name, 2)
        rows.append("| %s | %d | %.2f | %s | %.2f | %.1f | %.3f |" % (
            name, hosts, med(name, 0), ", ".join("%.2f" % r[0] for r in runs[name]), med(name, 1), lines,
            med(name, 1) / (hosts * lines)))
    fleet = med("role, fleet", 0) / med("gpu_release, fleet", 0)
    single = med("role, one container", 0) / med("gpu_release, one container", 0)
    growth = med("role, fleet", 0) / med("role, one container", 0)
    node_path = med("node path, fleet", 0) / med("gpu_release, one container", 0)
    out = [
        "## Fleet: the role and the node path against gpu_release tasks (`tests/bench/bench_fleet.py`)",
        "",
        "%d containers on %d lab nodes (%d per node, each container its own GPU), each with one `plain` holder of %d MiB; "
        "lab `pct` start-up delay %s s. The whole role is `playbooks/release_gpus.yml` with `release_gpus_from: container` (forks 24, "
        "`release_gpus_node_concurrency` 8, dependencies present, no service to stop); the node path is the same playbook "
        "with `release_gpus_from: node` (one `gpu_release` task per node for its 8 containers); the anchor is a playbook with one "
        "`gpuops.fleet.gpu_release` task per container (forks 24), same timeouts. %d rounds; each round runs every variant "
        "once, in this order, on freshly started holders. Controller CPU: the ansible-playbook process tree's user+system "
        "seconds (`getrusage(RUSAGE_CHILDREN)` deltas). Task lines: `TASK [` lines in the default output, per host "
        "(the role's include lines and skipped tasks included). Truth checked after every run: all GPUs at 0 MiB in "
        "`labctl gpus`, every holder gone." % (len(VMIDS), NODES, PER_NODE, MIB, PCT_DELAY, ROUNDS),
        "",
        "| run | hosts | wall s (median) | all runs (s) | controller CPU s (median) | task lines per host | CPU s per host and task line |",
        "|---|---|---|---|---|---|---|",
    ] + rows + [
        "",
        "- Whole role / one `gpu_release` task, 24 containers: **%.2fx** (goal at most 1.5x, issue 13: %s; was 4.6x)." % (
            fleet, "met" if fleet <= 1.5 else "not met"),
        "- Node path on 24 containers / one `gpu_release` task on one container: **%.2fx** (goal at most 1.5x, issue 20: %s)."
        % (node_path, "met" if node_path <= 1.5 else "not met"),
        "- Node path / whole role (container path), 24 containers: %.2fx." % (med("node path, fleet", 0) / med("role, fleet", 0)),
        "- Whole role / one `gpu_release` task, one container: %.2fx (was 2.9x)." % single,
        "- The role on 24 containers / on one container: %.2fx (reported, not gated; was 9.3x). On 2 cores the lab's own "
        "work (24 holders, 3 sshd, the `pct` stand-ins) runs on the same cores as the controller and sets a floor here; "
        "the anchor's own fleet / one-container ratio is %.2fx." % (
            growth, med("gpu_release, fleet", 0) / med("gpu_release, one container", 0)),
    ]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
