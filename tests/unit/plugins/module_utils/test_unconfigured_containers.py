"""Issue 45: a vmid in gpu_release's containers with no config on the node fails before any action, naming it and
the node's containers. The reader (_node.configured_containers) lists pmxcfs as pve-container lays it out
(/etc/pve/nodes/NODE/lxc/VMID.conf, /etc/pve/lxc a link to the local node's folder); the decision
(_decide.unconfigured_containers) is pure; gpu_release's check_scope refuses before NVML is opened."""
import os

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _decide as decide
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.modules import gpu_release

HERE = {"node": "pve1", "here": [101, 102, 103], "error": None, "elsewhere": {201: "pve2"}}


def test_a_typo_is_refused_naming_it_and_the_nodes_containers():
    msg = decide.unconfigured_containers([101, 9999], HERE)
    assert msg == ("containers: 9999 has no config on this node pve1 (no /etc/pve/lxc/9999.conf); this node's "
                   "containers: 101, 102, 103; nothing was signalled")


def test_every_vmid_configured_here_is_no_refusal():
    assert decide.unconfigured_containers([103, 101, 101], HERE) is None


def test_a_container_of_another_node_is_named_with_that_node_and_several_are_named_in_order():
    msg = decide.unconfigured_containers([9999, 201, 102], HERE)
    assert msg.startswith("containers: 201 (its config is on node pve2: release it there), 9999 have no config on "
                          "this node pve1 (no /etc/pve/lxc/VMID.conf);"), msg
    assert "this node's containers: 101, 102, 103;" in msg


def test_a_node_without_containers_and_unreadable_configs_are_refused():
    empty = dict(HERE, here=[], elsewhere={})
    assert "this node's containers: none;" in decide.unconfigured_containers([101], empty)
    unreadable = {"node": None, "here": None, "error": "/etc/pve/lxc: Permission denied", "elsewhere": {}}
    msg = decide.unconfigured_containers([101], unreadable)
    assert msg == ("containers: cannot tell whether 101 has a config on this node: /etc/pve/lxc: Permission denied; "
                   "nothing was signalled")


def _pmxcfs(tmp_path):
    """/etc/pve as pmxcfs shows it on node pve1: nodes/NODE/lxc per node, lxc -> nodes/pve1/lxc."""
    pve = tmp_path / "pve"
    for name, vmids in (("pve1", ("101", "102")), ("pve2", ("201", "101")), ("pve3", ())):
        folder = pve / "nodes" / name / "lxc"
        folder.mkdir(parents=True)
        for vmid in vmids:
            (folder / ("%s.conf" % vmid)).write_text("hostname: ct%s\n" % vmid)
    (pve / "nodes" / "pve1" / "lxc" / "notes.txt").write_text("not a config")
    (pve / "nodes" / "pve1" / "lxc" / "103.conf.tmp.1234").write_text("a write in progress")
    os.symlink("nodes/pve1/lxc", str(pve / "lxc"))
    return pve


def test_the_reader_lists_this_nodes_configs_and_the_other_nodes(tmp_path):
    pve = _pmxcfs(tmp_path)
    got = node.configured_containers(str(pve / "lxc"), str(pve / "nodes"))
    # 101 is here: a stale copy in another node's folder does not make it elsewhere
    assert got == {"node": "pve1", "here": [101, 102], "error": None, "elsewhere": {201: "pve2"}}


def test_the_reader_says_why_it_cannot_list_the_configs(tmp_path):
    got = node.configured_containers(str(tmp_path / "missing"), str(tmp_path / "nodes"))
    assert got["here"] is None and got["node"] is None and "No such file or directory" in got["error"], got


class _Failed(Exception):
    pass


class _Module(object):
    def fail_json(self, **kwargs):
        raise _Failed(kwargs)


def _params(**given):
    params = {"containers": [], "host_processes": False, "gpu_reset": False, "stop_found_units": False,
              "container_restart": False}
    params.update(given)
    return params


@pytest.mark.parametrize("containers", [[9999], [101, 9999]])
def test_gpu_release_refuses_a_typo_on_the_node_before_nvml(tmp_path, monkeypatch, containers):
    """check_scope runs before NVML is opened and before any lock, read or signal (check mode included: it does
    not look at check mode)."""
    pve = _pmxcfs(tmp_path)
    monkeypatch.setattr(node, "PVE_LXC_DIR", str(pve / "lxc"))
    monkeypatch.setattr(node, "PVE_NODES_DIR", str(pve / "nodes"), raising=False)
    monkeypatch.setattr(gpu_release, "view_of", lambda: "node")
    with pytest.raises(_Failed) as failed:
        gpu_release.check_scope(_Module(), _params(containers=containers))
    msg = failed.value.args[0]["msg"]
    assert "9999 has no config on this node pve1 (no /etc/pve/lxc/9999.conf)" in msg and "this node's containers: 101, 102;" in msg, msg
    assert failed.value.args[0]["changed"] is False


def test_gpu_release_takes_a_scope_of_configured_containers(tmp_path, monkeypatch):
    pve = _pmxcfs(tmp_path)
    monkeypatch.setattr(node, "PVE_LXC_DIR", str(pve / "lxc"))
    monkeypatch.setattr(node, "PVE_NODES_DIR", str(pve / "nodes"), raising=False)
    monkeypatch.setattr(gpu_release, "view_of", lambda: "node")
    scope = gpu_release.check_scope(_Module(), _params(containers=[102, 101]))
    assert sorted(scope.containers, key=int) == ["101", "102"], scope.containers
