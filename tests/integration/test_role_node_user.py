"""Issue 45: a node user who is not root. The lab's node user `gpuops` (uid 4242, NOPASSWD sudo) reaches the node by
ssh; the role's tasks delegated to the node (the node path's release, the node's dependency install) run with become
(release_gpus_advanced.node_become, by default on when the node host's ansible_user is not root). The truth is
`labctl gpus`, the host's /proc and the owner of what was installed on the node, never the role's word alone."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from _enginelab import EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab
from _rolelab import PlayResult, make_venv, parse_recap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEELS = os.path.join(REPO, ".cache", "wheels")

lab = module_lab(lambda: EngineLab("nodeuser45", ["--nodes", "1", "--containers", "2", "--gpus", "2",
                                                  "--layout", "101=0", "--layout", "102=1"]))
clean = clean_engine_lab()


def inventory(lab, **node_vars):
    """The lab's inventory with these variables on its node host pve1."""
    with open(lab.inventory) as f:
        inv = yaml.safe_load(f)
    inv["all"]["children"]["pve_nodes"]["hosts"]["pve1"].update(node_vars)
    handle, path = tempfile.mkstemp(dir=lab.workdir, prefix="inventory-", suffix=".yml")
    with os.fdopen(handle, "w") as f:
        yaml.safe_dump(inv, f)
    return path


def release(lab, inv, advanced=None):
    """playbooks/release_gpus.yml, the default path (release_gpus_from auto: the node path for the lab's containers)."""
    variables = {"release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 5,
                 "release_gpus_advanced": dict({"verify_timeout": 10,
                                                # an index that refuses at once: the node's install takes the wheels
                                                "deps_pip_extra_args": ["--isolated", "--index-url", "http://127.0.0.1:9/simple"],
                                                "wheel_dir": WHEELS}, **(advanced or {}))}
    handle, vars_file = tempfile.mkstemp(dir=lab.workdir, prefix="vars-", suffix=".json")
    with os.fdopen(handle, "w") as f:
        json.dump(variables, f)
    proc = subprocess.run([os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "ansible-playbook"), "-i", inv,
                           os.path.join(REPO, "playbooks", "release_gpus.yml"), "-e", "@" + vars_file],
                          cwd=REPO, env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=400, check=False)
    return PlayResult(proc.returncode, proc.stdout, parse_recap(proc.stdout), {})


def deps_report(output):
    """The msg of the dependency install's report task (printed as changed), or None."""
    match = re.search(r"TASK \[[^\]]*Report what was installed, where and from which source\] \*+\n"
                      r"changed: \[\S+ -> pve1[^\]]*\] => (\{.*?\n\})\n", output, re.S)
    return json.loads(match.group(1))["msg"] if match else None


@pytest.fixture
def node_python(lab):
    """A fresh Python for the node without psutil and nvidia-ml-py, owned by root, on a path the node sees."""
    root = os.path.join(REPO, ".lab", "node-user-%s" % lab.lab_id)
    shutil.rmtree(root, ignore_errors=True)
    python = make_venv(root, with_pip=True)
    try:
        yield root, python
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_node_path_as_gpuops_with_become_installs_on_the_node_releases_and_changes_nothing_the_second_time(
        clean, node_python):
    lab = clean
    root, python = node_python
    inv = inventory(lab, ansible_user="gpuops", ansible_python_interpreter=python)
    holder = lab.run("plain", "101", [0], mib=256)
    assert lab.used(0) == 256

    first = release(lab, inv)
    assert first.rc == 0 and first.failed_hosts() == [], first
    assert first.output.count("Validating arguments against arg spec") == 1, first      # one check, at the entry
    assert lab.used(0) == 0 and not host_alive(holder["holders"][0]), first
    assert first.recap["ct101"]["changed"] > 0 and first.recap["ct102"]["changed"] == 0, first
    # the node lacked psutil and nvidia-ml-py: installed there through sudo (root owns them), reported as a change
    report = deps_report(first.output)
    assert report, first
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()     # the node's Python's, not ours
    wheels = dict((name.split("-")[0].lower(), name.split("-")[1]) for name in os.listdir(WHEELS) if name.endswith(".whl"))
    assert report["host"] == "pve1" and report["python"] == python, report
    assert report["packages"] == [{"name": "psutil", "version": wheels["psutil"], "path": site},
                                  {"name": "nvidia-ml-py", "version": wheels["nvidia_ml_py"], "path": site}], report
    assert report["source"].startswith("wheels from the controller (%s)" % WHEELS), report
    assert "installed psutil %s, nvidia-ml-py %s into %s" % (wheels["psutil"], wheels["nvidia_ml_py"], site) in report["summary"]
    assert os.stat(os.path.join(site, "psutil")).st_uid == 0, "installed as gpuops, not through sudo"

    again = release(lab, inv)
    assert again.rc == 0 and again.changed() == 0, again
    assert deps_report(again.output) is None and "Dependencies |" not in again.output, again


def test_without_become_the_non_root_node_user_fails_naming_the_user_and_signals_nothing(clean):
    lab = clean
    inv = inventory(lab, ansible_user="gpuops")
    holder = lab.run("plain", "102", [0], mib=256)    # its index 0 is the node's GPU 1
    play = release(lab, inv, {"node_become": False})
    assert play.rc == 2 and play.failed_hosts() == ["ct101", "ct102"], play
    assert ("The node tasks ran on pve1 as gpuops, not root, without become (release_gpus_advanced.node_become: false): "
            "they need root there; set node_become: true") in play.output, play
    assert lab.used(1) == 256 and host_alive(holder["holders"][0])


def test_become_as_root_needs_no_sudo_on_the_node(clean):
    """A node reached as root, with node_become on and no sudo there (its become_exe does not exist): ansible-core
    skips become when the become user is the remote user, so the release works."""
    lab = clean
    inv = inventory(lab, ansible_user="root", ansible_become_exe="/nonexistent/sudo")
    holder = lab.run("plain", "101", [0], mib=256)
    play = release(lab, inv, {"node_become": True, "install_deps": False})
    assert play.rc == 0 and play.failed_hosts() == [], play
    assert lab.used(0) == 0 and not host_alive(holder["holders"][0]), play
