"""Scale benchmark (issue 20): the node path on more nodes, and a projection to 1,000 nodes.
Prints a Markdown fragment on stdout.

NODES lab nodes (6 by default, BENCH_SCALE_NODES) with 8 containers each, each container its own
GPU and one holder. `playbooks/release_gpus.yml` (the node path, `auto`) runs over every container,
then over the containers of one node (`--limit` by the node's group): wall time and the
controller's CPU (the ansible-playbook process tree's user+system seconds). Truth after each run:
every GPU at 0 MiB in `labctl gpus`, every holder gone. From the per-node cost the section projects,
on paper, a maintenance window over 1,000 nodes at forks 50.
"""
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _enginelab import EngineLab  # noqa: E402
import bench_fleet as fleet  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_SCALE_ROUNDS", "2"))
NODES = int(os.environ.get("BENCH_SCALE_NODES", "6"))
PER_NODE = 8
FORKS, PROJECTED_NODES = 50, 1000


def main():
    vmids = [(n, "%d%02d" % (n, c)) for n in range(1, NODES + 1) for c in range(1, PER_NODE + 1)]
    fleet.NODES = NODES
    lab = EngineLab("scalebench", ["--nodes", str(NODES), "--containers", str(PER_NODE), "--gpus", str(PER_NODE)]
                    + [a for n, v in vmids for a in ("--layout", "%s=%d" % (v, int(v[-2:]) - 1))])
    lab.env["LAB_PCT_DELAY"] = fleet.PCT_DELAY
    args = ["-e", "release_gpus_node_concurrency=8"]
    for key, value in sorted(fleet.TIMEOUTS.items()):
        args += ["-e", "release_gpus_%s=%s" % (key, value)]
    playbook = os.path.join(REPO, "playbooks", "release_gpus.yml")
    one_node = [v for v in vmids if v[0] == 1]
    runs = {"all": [], "one": []}
    try:
        for dummy in range(ROUNDS):
            for name, chosen, limit in (("all", vmids, None), ("one", one_node, ",".join("ct%s" % v for n, v in one_node))):
                holders = fleet.load(lab, chosen)
                proc, wall, cpu, lines = fleet.playbook(lab, playbook, limit, args, forks=FORKS)
                fleet.check(lab, "node path, %s" % name, proc, holders)
                runs[name].append((wall, cpu))
                lab.cleanup()
    finally:
        fleet.close(lab, NODES)
    wall_all, cpu_all = fleet.median(runs, "all", 0), fleet.median(runs, "all", 1)
    wall_one, cpu_one = fleet.median(runs, "one", 0), fleet.median(runs, "one", 1)
    cpu_per_node = cpu_all / NODES
    cores = os.cpu_count() or 1
    waves = int(math.ceil(PROJECTED_NODES * PER_NODE / float(FORKS)))
    projected_cpu = PROJECTED_NODES * cpu_per_node
    out = [
        "## Scale: the node path on %d nodes x %d containers (`tests/bench/bench_scale.py`)" % (NODES, PER_NODE),
        "",
        "%d lab nodes with %d containers each (%d containers), each container its own GPU and one `plain` holder of %d MiB; "
        "`playbooks/release_gpus.yml` with the default `release_gpus_from: auto` (the node path), forks %d, lab `pct` "
        "start-up delay %s s, this host's %d cores shared by the controller and the whole lab. %d rounds; truth checked "
        "after every run." % (NODES, PER_NODE, NODES * PER_NODE, fleet.MIB, FORKS, fleet.PCT_DELAY, cores, ROUNDS),
        "",
        "| run | containers | wall s (median) | all runs (s) | controller CPU s (median) | controller CPU s per node |",
        "|---|---|---|---|---|---|",
        "| every node | %d | %.2f | %s | %.2f | %.2f |" % (
            NODES * PER_NODE, wall_all, ", ".join("%.2f" % r[0] for r in runs["all"]), cpu_all, cpu_per_node),
        "| one node (`--limit` its 8 containers) | %d | %.2f | %s | %.2f | %.2f |" % (
            PER_NODE, wall_one, ", ".join("%.2f" % r[0] for r in runs["one"]), cpu_one, cpu_one),
        "",
        "- %d nodes / one node, wall: %.2fx; controller CPU: %.2fx." % (NODES, wall_all / wall_one, cpu_all / cpu_one),
        "- **Projection, on paper, to %d nodes x %d containers at forks %d.** The play's hosts are the containers "
        "(%d), so each task line runs in %d waves of %d. Controller CPU grows with hosts x task lines: %.2f s per node "
        "measured here gives about %.0f CPU-seconds (%.0f min on one core, %.0f min on 8 cores). The node tasks "
        "themselves (one per node, on the nodes) run %d at a time in the node task's waves: %d waves of the "
        "one-node run's %.1f s is at most %.0f min if every node task took as long as a whole one-node play. The "
        "controller is the limit: plan a controller with several cores, or split the window by node group "
        "(`--limit`)." % (
            PROJECTED_NODES, PER_NODE, FORKS, PROJECTED_NODES * PER_NODE, waves, FORKS, cpu_per_node, projected_cpu,
            projected_cpu / 60.0, projected_cpu / 60.0 / 8, FORKS, int(math.ceil(PROJECTED_NODES / float(FORKS))),
            wall_one, math.ceil(PROJECTED_NODES / float(FORKS)) * wall_one / 60.0),
    ]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
