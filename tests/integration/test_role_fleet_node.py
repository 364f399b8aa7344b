"""Issues 11 and 20: the fleet case. 24 containers on 3 lab nodes; the 8 of each node share GPU 0; 21 hold it.

release_gpus.yml with release_gpus_from auto (the default) or node takes the node path (issue 20): one gpu_release task on each
node for all of its selected containers, which stops each supervisord program that would respawn a holder
(found from the node) and walks the ladder; each container takes its own part of the result. The truth is
`labctl gpus` and the host's /proc."""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from _enginelab import EngineLab, host_alive
from _labfixture import module_lab
from _rolelab import PlayResult, parse_recap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VMIDS = [str(n * 100 + c) for n in (1, 2, 3) for c in range(1, 9)]
IDLE = {"108", "208", "308"}    # one container per node has no holder
PROGRAMS = ("101", "201", "301")  # a supervisord program that respawns its holder

pytestmark = pytest.mark.slow   # 24 containers on 3 nodes

lab = module_lab(lambda: EngineLab("fleet11", ["--nodes", "3", "--containers", "8", "--gpus", "1"]
                                   + [a for v in VMIDS for a in ("--layout", "%s=0" % v)]))


def playbook(lab, extra, check=False, reports=True, limit=None):
    """release_gpus.yml over the fleet (limit: a --limit pattern); reports=False: no release_gpus_report_dir (a JSON
    file per container that the check and second plays' assertions do not read)."""
    report_dir = tempfile.mkdtemp(dir=lab.workdir, prefix="report-")
    variables = {"release_gpus_report_dir": report_dir if reports else "",
                 # stop_found_units: on by default again since issue 42 (stop sets decided), asked for here all the same
                 "release_gpus_advanced": {"install_deps": False, "verify_timeout": 5, "stop_found_units": True},
                 "release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5, "release_gpus_node_concurrency": 8}
    variables.update(extra)
    vars_file = os.path.join(report_dir, "vars.json")
    with open(vars_file, "w") as f:
        json.dump(variables, f)
    cmd = [os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "ansible-playbook"), "-i",
           lab.inventory, os.path.join(REPO, "playbooks", "release_gpus.yml"), "-e", "@" + vars_file, "--forks", "24"]
    cmd += (["--check"] if check else []) + (["--limit", limit] if limit else [])
    env = dict(lab.env, ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report",
               GPUOPS_REPORT_PATH=os.path.join(report_dir, "rows.json"))
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=900, check=False)
    result = PlayResult(proc.returncode, proc.stdout, parse_recap(proc.stdout), {})
    result.report_dir = report_dir
    return result


def test_fleet_sharing_gpu0_is_freed_by_one_task_per_node_and_changed_is_exact(lab):
    """The node path (issue 20): one gpu_release per node frees its 8 containers. A supervisord program that
    respawns its holder runs in one container of each node: found from the node and stopped first."""
    runs = {}
    for vmid in VMIDS:
        if vmid not in IDLE:
            runs[vmid] = lab.run("respawn" if vmid in PROGRAMS else "plain", vmid, [0], mib=300, node="pve%s" % vmid[0])
    assert all(lab.used(0, node=n) == 7 * 300 for n in ("pve1", "pve2", "pve3"))
    # check mode on one node's 8 containers (--limit by pattern): release_gpus_from auto, the default, takes the node path
    check = playbook(lab, {}, check=True, reports=False, limit="ct1*")
    assert check.rc == 0 and all(lab.used(0, node=n) == 7 * 300 for n in ("pve1", "pve2", "pve3")), check
    assert all(host_alive(r["holders"][0]) for r in runs.values())
    assert sorted(h for h in check.recap if h.startswith("ct")) == ["ct%s" % v for v in VMIDS if v.startswith("1")], check
    assert sorted(h[2:] for h, r in check.recap.items() if h.startswith("ct") and r["changed"]) == sorted(
        v for v in runs if v.startswith("1")), check

    play = playbook(lab, {})
    assert play.rc == 0 and play.failed_hosts() == [], play
    node_tasks = [line for line in play.output.splitlines() if line.startswith("TASK [") and "Node path | Release every" in line]
    assert len(node_tasks) == 1, play       # one task, run on each node for all of its containers
    assert "gpuops.fleet.release_gpus : Release | Run gpu_release" not in play.output   # no per-container release
    lines = [line for line in play.output.splitlines() if line.startswith("TASK [")]
    assert len(lines) <= 12 + 4, "\n".join(lines)
    assert all(lab.used(0, node=n) == 0 for n in ("pve1", "pve2", "pve3")), play
    assert not [v for v, r in runs.items() if host_alive(r["holders"][0])]
    for vmid in PROGRAMS:   # stopped by its supervisor, so it never came back
        status = lab.exec(vmid, "supervisorctl", "status", runs[vmid]["supervisor_program"], node="pve%s" % vmid[0])
        assert "STOPPED" in status.stdout, status.stdout
    changed = sorted(h[2:] for h, r in play.recap.items() if h.startswith("ct") and r["changed"])
    assert changed == sorted(runs), play
    reports = dict((v, json.load(open(os.path.join(play.report_dir, "ct%s.json" % v)))) for v in VMIDS)
    assert all(r["released_from"] == "node" and r["verdict"] == "free" for r in reports.values()), reports
    assert [g["before_mib"] for g in reports["102"]["gpus"]] == [300] and reports["108"]["changed"] is False
    assert [u["kind"] for u in reports["101"]["found_units"]] == ["supervisord"]
    with open(os.path.join(play.report_dir, "rows.json")) as f:
        rows = json.load(f)["rows"]     # gpu_report: one row per container and GPU, from the nodes' three tasks
    assert sorted((str(r["container"]), r["before_mib"], r["after_mib"], r["verdict"]) for r in rows) == sorted(
        (v, 0 if v in IDLE else 300, 0, "free" if v in IDLE else "freed") for v in VMIDS), rows
    assert all(r["rung"] == ("stop" if str(r["container"]) in PROGRAMS else "none" if str(r["container"]) in IDLE
                             else "sigterm") for r in rows), rows
    # the same path, named, on another node's 8 containers: a second run changes nothing
    again = playbook(lab, {"release_gpus_from": "node"}, reports=False, limit="ct2*")
    assert again.rc == 0 and again.changed() == 0 and len([h for h in again.recap if h.startswith("ct")]) == 8, again
