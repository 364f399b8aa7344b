"""Issue 11: the fleet case. 24 containers on 3 lab nodes; the 8 of each node share GPU 0; 21 hold it.

release_gpus.yml with release_gpus_from: auto: inside each container first, then from the node
(scope: that container, its GPU by UUID) where the container's own verify leaves memory that no
process it can see holds. The truth is `labctl gpus` and the host's /proc.
"""
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

pytestmark = pytest.mark.slow   # 24 containers on 3 nodes: about 3 minutes

lab = module_lab(lambda: EngineLab("fleet11", ["--nodes", "3", "--containers", "8", "--gpus", "1"]
                                   + [a for v in VMIDS for a in ("--layout", "%s=0" % v)]))


def playbook(lab, extra):
    report_dir = tempfile.mkdtemp(dir=lab.workdir, prefix="report-")
    variables = {"release_gpus_report_dir": report_dir, "release_gpus_install_deps": False,
                 "release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5, "release_gpus_verify_timeout": 5,
                 "release_gpus_node_concurrency": 8}
    variables.update(extra)
    vars_file = os.path.join(report_dir, "vars.json")
    with open(vars_file, "w") as f:
        json.dump(variables, f)
    cmd = [os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "ansible-playbook"), "-i",
           lab.inventory, os.path.join(REPO, "playbooks", "release_gpus.yml"), "-e", "@" + vars_file, "--forks", "24"]
    proc = subprocess.run(cmd, cwd=REPO, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=900, check=False)
    return PlayResult(proc.returncode, proc.stdout, parse_recap(proc.stdout), {})


def test_fleet_sharing_gpu0_is_freed_with_auto_and_changed_is_exact(lab):
    runs = {}
    for vmid in VMIDS:
        if vmid not in IDLE:
            runs[vmid] = lab.run("plain", vmid, [0], mib=300, node="pve%s" % vmid[0])
    assert all(lab.used(0, node=n) == 7 * 300 for n in ("pve1", "pve2", "pve3"))
    play = playbook(lab, {"release_gpus_from": "auto"})
    assert play.rc == 0 and play.failed_hosts() == [], play
    assert "Node | Release from the node" in play.output  # the fallback ran: memory of other containers was left
    # issue 13: the common path's 12 task lines (the playbook's 2 and the role's 10), plus at most 4 for the fallback
    lines = [line for line in play.output.splitlines() if line.startswith("TASK [")]
    assert len(lines) <= 12 + 4, "\n".join(lines)
    assert all(lab.used(0, node=n) == 0 for n in ("pve1", "pve2", "pve3")), play
    assert not [v for v, r in runs.items() if host_alive(r["holders"][0])]
    changed = sorted(h[2:] for h, r in play.recap.items() if h.startswith("ct") and r["changed"])
    assert changed == sorted(runs), play
    again = playbook(lab, {"release_gpus_from": "auto"})
    assert again.rc == 0 and again.changed() == 0, again
