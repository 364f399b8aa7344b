"""Issue 41, attack 4 (part): one container's own answers never stop the node's work for the others.

A malformed answer of the device-access probe (the container's python3 prints it) and a symlinked or held
/run/lock/gpuops-fleet in one container each leave that container out with a reason; the others go on.
"""
import fcntl
import json
import os

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _access as access
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._locks import lock_name
from release_opts import release
from ansible_collections.gpuops.fleet.plugins.modules import gpu_info

from fake_nvml import FakeNvml

GOOD = {"shared": [{"path": "/dev/nvidiactl", "error": None}], "gpus": {"0": {"paths": ["/dev/nvidia0"], "errors": []}}}
INITS = {"101": 500, "102": 600}


def answers(monkeypatch, by_vmid):
    """lxc-attach as each container's python3 would answer: {vmid: printed text}."""
    def run_bounded(argv, timeout, env=None):
        return 0, by_vmid[argv[argv.index("-n") + 1]]
    monkeypatch.setattr(access.helperproc, "run_bounded", run_bounded)


@pytest.mark.parametrize("text", ['{"gpus": {"x": {}}}', '{"shared": [], "gpus": {"0": {"paths": "/dev/nvidia0"}}}',
                                  '[1, 2]', '{"shared": [{"path": 1}], "gpus": {}}', '{"shared": [], "gpus": {"7": '
                                  '{"paths": [], "errors": []}}}'])
def test_a_malformed_probe_answer_is_unread_for_that_container_and_the_others_go_on(monkeypatch, text):
    """The node-side gpu_info failed for every container on `{"gpus": {"x": {}}}` from one of them."""
    answers(monkeypatch, {"101": text + "\n", "102": json.dumps(GOOD) + "\n"})
    monkeypatch.setattr(node, "container_inits", lambda *a, **k: INITS)
    gpu = {"index": 0, "minor": 0, "passed_into": [101, 102]}
    found = gpu_info.container_access(type("E", (), {"proc_root": "/proc"})(), None, [gpu])
    assert found[102] == ({"shared": [{"path": "/dev/nvidiactl", "error": None}],
                           "gpus": {0: {"paths": ["/dev/nvidia0"], "errors": []}}}, None)
    assert found[101][0] is None and found[101][1].startswith("a malformed answer"), found[101]
    entries = gpu_info.node_access_entries(gpu, found)
    assert [(e["vmid"], e["reason"].startswith("container 101: device access could not be read")) for e in entries] == [
        (101, True)], entries


def lab_roots(proc, tmp_path):
    """Containers 101 and 102 running (inits 500 and 600), each root a folder with /run/lock."""
    for vmid, init in INITS.items():
        proc.add(init, comm="init", cgroup="0::/lxc/%s/ns\n" % vmid)
        os.makedirs(os.path.join(proc.root, str(init), "root", "run", "lock"))


def node_engine(proc, monkeypatch):
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: {})
    monkeypatch.setattr(node, "container_inits", lambda *a, **k: dict(INITS))
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 0}])), proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    return engine


def test_a_symlinked_lock_dir_in_one_container_skips_it_and_the_others_are_released(proc, tmp_path, monkeypatch):
    """101's /run/lock/gpuops-fleet is a link to a folder of the node: the node-wide release failed for every
    container. Never followed; 101 is skipped with the reason; 102's lock is taken and 102 goes on."""
    lab_roots(proc, tmp_path)
    elsewhere = tmp_path / "node-folder"
    elsewhere.mkdir()
    os.symlink(str(elsewhere), os.path.join(proc.root, "500", "root", "run", "lock", "gpuops-fleet"))
    engine = node_engine(proc, monkeypatch)
    failed, msg, result = release(engine, [0], dict(lock_timeout=0.2, scope=node.Scope([101, 102], proc_root=proc.root)),
                                  lock_dir=str(tmp_path / "node-lock"))
    assert os.listdir(str(elsewhere)) == []
    by_vmid = dict((e["vmid"], e) for e in result["per_container"])
    assert by_vmid[101]["verdict"] == "skipped" and "is not a directory (or is a link)" in by_vmid[101]["reason"], by_vmid
    assert by_vmid[102]["verdict"] != "skipped", by_vmid
    assert os.listdir(os.path.join(proc.root, "600", "root", "run", "lock", "gpuops-fleet"))    # 102's lock file
    assert failed and "left out: container 101: its GPU lock could not be taken" in msg, msg


def test_a_lock_held_in_one_container_skips_it_after_the_wait(proc, tmp_path, monkeypatch):
    lab_roots(proc, tmp_path)
    engine = node_engine(proc, monkeypatch)
    folder = os.path.join(proc.root, "600", "root", "run", "lock", "gpuops-fleet")
    os.makedirs(folder, 0o700)
    os.chmod(folder, 0o700)
    held = os.open(os.path.join(folder, lock_name(engine.gpu(0)["uuid"])), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        failed, msg, result = release(engine, [0], dict(lock_timeout=0.2, scope=node.Scope([101, 102], proc_root=proc.root)),
                                      lock_dir=str(tmp_path / "node-lock"))
    finally:
        os.close(held)
    by_vmid = dict((e["vmid"], e) for e in result["per_container"])
    assert by_vmid[102]["verdict"] == "skipped" and "holds the lock" in by_vmid[102]["reason"], by_vmid
    assert by_vmid[101]["verdict"] != "skipped" and failed, (msg, by_vmid)
