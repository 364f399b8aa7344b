"""Issue 40, P2 (a false "ready"): a GPU whose container config passes it in unusable (deny-write, or raw cgroup rules
that leave it without rw) is not ready for that container, read from the node with the GPU idle.

Unit-fake world: a recorded /proc with no GPU process (ProcTree), two idle GPUs (FakeNvml), the node's container
configs in a folder. Before issue 40 such a container was left out of the GPU's passed_into, so no device-access
check ran for it and gpu_info said ready: true.
"""
import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _pveconf as pveconf
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.modules import gpu_info

from fake_nvml import FakeNvml

MOUNT = "lxc.mount.entry: /dev/nvidia%d dev/nvidia%d none bind,optional,create=file\n"
CONFS = {
    "101": "hostname: ct101\ndev0: /dev/nvidia0\ndev1: /dev/nvidia1,deny-write\n",
    "102": ("hostname: ct102\nlxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.deny: c 195:1 rwm\n"
            + MOUNT % (0, 0) + MOUNT % (1, 1)),
    "103": "hostname: ct103\nlxc.cgroup2.devices.allow: c 195:* rm\n" + MOUNT % (1, 1),
}


class Module(object):
    """What add_readiness reads of an AnsibleModule: its params."""

    def __init__(self, **params):
        self.params = dict({"device_access": True, "health": False, "need_mib": None, "need_fraction": None}, **params)


def node_read(proc, tmp_path, monkeypatch, **params):
    """gpu_info's read on a Proxmox node whose /etc/pve/lxc holds CONFS: (result, the engine's report)."""
    conf_dir = tmp_path / "lxc"
    conf_dir.mkdir()
    for vmid, text in CONFS.items():
        (conf_dir / ("%s.conf" % vmid)).write_text(text)
    read = node.read_pve_confs
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: read(str(conf_dir)))
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0}])),
                    proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    report = engine.snapshot([0, 1])
    result = report.as_dict()
    gpu_info.add_readiness(Module(**params), engine, report, result)
    return result


def test_a_gpu_passed_in_that_its_container_cannot_open_is_not_ready_naming_container_gpu_and_rule(proc, tmp_path,
                                                                                                   monkeypatch):
    result = node_read(proc, tmp_path, monkeypatch)
    gpu0, gpu1 = result["gpus"]
    assert result["ready"] is False, [(g["index"], g["ready"], g["not_ready"]) for g in result["gpus"]]
    assert gpu0["ready"] is True and gpu0["passed_into"] == [101, 102] and gpu0["passed_unusable"] == []
    assert gpu1["passed_into"] == [] and gpu1["ready"] is False
    assert gpu1["passed_unusable"] == [
        {"vmid": 101, "source": "dev1", "device": "/dev/nvidia1", "rule": "deny-write"},
        {"vmid": 102, "source": "lxc.mount.entry", "device": "/dev/nvidia1", "rule": "lxc.cgroup2.devices.deny: c 195:1 rwm"},
        {"vmid": 103, "source": "lxc.mount.entry", "device": "/dev/nvidia1",
         "rule": "lxc.cgroup2.devices.allow: c 195:* rm (no w)"}]
    entries = [(e["check"], e["vmid"], e["reason"]) for e in gpu1["not_ready"]]
    assert entries == [
        ("device_access", 101, "container 101: GPU 1 (/dev/nvidia1, passed in by dev1) cannot be opened read-write, "
                               "blocked by deny-write"),
        ("device_access", 102, "container 102: GPU 1 (/dev/nvidia1, passed in by lxc.mount.entry) cannot be opened "
                               "read-write, blocked by lxc.cgroup2.devices.deny: c 195:1 rwm"),
        ("device_access", 103, "container 103: GPU 1 (/dev/nvidia1, passed in by lxc.mount.entry) cannot be opened "
                               "read-write, blocked by lxc.cgroup2.devices.allow: c 195:* rm (no w)")]
    remedies = [e["remedy"] for e in gpu1["not_ready"]]
    assert remedies[0] == ("pass it in read-write: remove deny-write from dev1 in /etc/pve/lxc/101.conf, then restart "
                           "the container (pct reboot 101)")
    assert remedies[1] == remedies[2].replace("103", "102") == (
        "allow it read-write in /etc/pve/lxc/102.conf (lxc.cgroup2.devices.allow: c 195:1 rw, after any rule that "
        "denies it), then restart the container (pct reboot 102)")


def test_without_device_access_the_config_is_not_read_as_a_check(proc, tmp_path, monkeypatch):
    result = node_read(proc, tmp_path, monkeypatch, device_access=False)
    assert result["ready"] is True and [e["vmid"] for e in result["gpus"][1]["passed_unusable"]] == [101, 102, 103]


@pytest.mark.parametrize("rules, why", [
    ([], "no lxc.cgroup2.devices.allow rule gives c 195:2 rw"),
    ([["lxc.cgroup2.devices.allow", "c 195:* r"]], "lxc.cgroup2.devices.allow: c 195:* r (no w)"),
    ([["lxc.cgroup2.devices.allow", "a"], ["lxc.cgroup2.devices.deny", "c 195:2 w"]], "lxc.cgroup2.devices.deny: c 195:2 w"),
    ([["lxc.cgroup.devices.allow", "c 195:* rwm"], ["lxc.cgroup.devices.deny", "c 195:* rw"],
      ["lxc.cgroup.devices.allow", "c 195:2 r"]], "lxc.cgroup.devices.deny: c 195:* rw"),
    ([["lxc.cgroup2.devices.allow", "c 195:3 rwm"]], "no lxc.cgroup2.devices.allow rule gives c 195:2 rw"),
], ids=repr)
def test_the_rule_that_blocks_a_bound_device_is_named(rules, why):
    config = {"lxc": rules + [["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"]]}
    (dev,) = pveconf.gpu_passthrough(config)
    assert (dev["usable"], dev["rule"]) == (False, why)


def test_a_usable_device_has_no_blocking_rule():
    config = {"dev0": "/dev/nvidia0,deny-write=0",
              "lxc": [["lxc.cgroup2.devices.allow", "c 195:* rw"], ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind"]]}
    assert [(d["usable"], d["rule"]) for d in pveconf.gpu_passthrough(config)] == [(True, None), (True, None)]
