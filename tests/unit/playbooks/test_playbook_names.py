"""Issue 45: the read-only playbook is gpuops.fleet.gpu_info (playbooks/gpu_info.yml), no longer named like the
deprecated gpu_status module; playbooks have no routing, so gpu_status.yml stays, one import_playbook of gpu_info.yml,
marked deprecated, until 1.0.0. Both names run from the collection (ansible-playbook FQCN) with the same plays."""
import os
import subprocess
import sys

import yaml

from _templating import REPO

BIN = os.path.dirname(sys.executable)


def list_tasks(book):
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "--list-tasks", book], capture_output=True, text=True,
                          timeout=120, check=False, env=dict(os.environ, ANSIBLE_NOCOLOR="1",
                                                             ANSIBLE_INVENTORY_UNPARSED_WARNING="0",
                                                             ANSIBLE_LOCALHOST_WARNING="0"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if not line.startswith("playbook:")]


def test_gpu_status_playbook_is_one_deprecated_import_of_gpu_info():
    with open(os.path.join(REPO, "playbooks", "gpu_status.yml")) as f:
        text = f.read()
    assert [dict((k, v) for k, v in play.items() if k != "name") for play in yaml.safe_load(text)] == [
        {"ansible.builtin.import_playbook": "gpu_info.yml"}]
    assert "Deprecated" in text and "gpuops.fleet.gpu_info" in text
    new, old = list_tasks("gpuops.fleet.gpu_info"), list_tasks("gpuops.fleet.gpu_status")
    assert new == old and any("Report GPU memory and holders across the fleet" in line for line in new), (new, old)
