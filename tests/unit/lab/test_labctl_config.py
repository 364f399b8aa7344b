"""Files labctl writes: Proxmox container config, sshd_config, inventory YAML; lab shapes."""

import pytest
import yaml

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib import cli as labctl
from lablib import lab as lablab
from lablib.common import LabError


def test_proxmox_conf_lists_only_the_layout_minors():
    conf = lablab.proxmox_conf("102", [4, 5])
    lines = conf.splitlines()
    assert "hostname: ct102" in lines
    devs = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("dev")]
    assert devs[:2] == ["/dev/nvidia4", "/dev/nvidia5"]
    assert "/dev/nvidia0" not in devs and "/dev/nvidiactl" in devs
    keys = [ln.split(":", 1)[0] for ln in lines if not ln.startswith("lxc.")]
    assert len(keys) == len(set(keys)), "Proxmox config keys are unique (raw lxc.* keys repeat)"
    entries = [ln.split(": ", 1)[1].split()[:2] for ln in lines if ln.startswith("lxc.mount.entry: ")]
    assert entries[0] == ["/dev/nvidia4", "dev/nvidia4"] and ["/dev/nvidiactl", "dev/nvidiactl"] in entries
    assert "lxc.cgroup2.devices.allow: c 195:* rwm" in lines and "unprivileged: 0" in lines
    assert "unprivileged: 1" in lablab.proxmox_conf("102", [4], unprivileged=True).splitlines()


def test_shared_run_lock_binds_the_nodes_run_lock_only_where_asked():
    entry = "lxc.mount.entry: /run/lock run/lock none bind,create=dir 0 0"
    assert entry in lablab.proxmox_conf("103", [2], shared_run_lock=True).splitlines()
    assert entry not in lablab.proxmox_conf("103", [2]).splitlines()
    shape = lablab.Lab.shape(None, 1, 3, 3, {}, "modern", [], shared_run_lock=["103"])
    assert shape["nodes"]["pve1"]["containers"]["103"]["shared_run_lock"] is True
    assert "shared_run_lock" not in shape["nodes"]["pve1"]["containers"]["101"]   # other shapes stay as they were
    with pytest.raises(LabError, match="--shared-run-lock name vmids not in the lab: 999"):
        lablab.Lab.shape(None, 1, 3, 3, {}, "modern", [], shared_run_lock=["999"])


def test_lxc_config_as_proxmox_writes_it(tmp_path):
    pve = tmp_path / "202.conf"
    pve.write_text(lablab.proxmox_conf("202", [3], unprivileged=True, dev_dir="/run/lab/dev"))
    ct = {"vmid": "202", "unprivileged": True}
    lines = lablab.lxc_config("rid1", "/run/gpuops-lab/rid1", "pve2", ct, str(pve)).splitlines()
    assert lines[:4] == ["lxc.cgroup.relative = 0", "lxc.cgroup.dir.monitor = lxc.monitor/202",
                         "lxc.cgroup.dir.container = lxc/202", "lxc.cgroup.dir.container.inner = ns"]
    assert "lxc.idmap = u 0 100000 65536" in lines and "lxc.idmap = g 0 100000 65536" in lines
    assert "lxc.include = /usr/share/lxc/config/userns.conf" in lines
    assert "lxc.cgroup2.devices.allow = c 195:3 rw" in lines and "lxc.cgroup2.devices.allow = c 195:* rwm" in lines
    assert "lxc.mount.entry = /run/lab/dev/nvidia3 dev/nvidia3 none bind,optional,create=file" in lines
    assert "lxc.uts.name = ct202" in lines and "lxc.monitor.unshare = 1" in lines
    priv = lablab.lxc_config("rid1", "/run/gpuops-lab/rid1", "pve2", {"vmid": "202"}, str(pve)).splitlines()
    assert not [ln for ln in priv if ln.startswith("lxc.idmap")]


def test_sshd_config_has_the_lab_policy():
    text = lablab.sshd_config("/run/gpuops-lab/x", "/run/gpuops-lab/x/nodes/pve1", "127.5.6.1")
    lines = set(text.splitlines())
    for wanted in ("ListenAddress 127.5.6.1:22", "UsePAM no", "PermitRootLogin prohibit-password",
                   "StrictModes no", "PasswordAuthentication no",
                   "PidFile /run/gpuops-lab/x/nodes/pve1/sshd.pid",
                   "AuthorizedKeysFile /run/gpuops-lab/x/ssh/authorized_keys"):
        assert wanted in lines


def test_to_yaml_round_trips_through_a_yaml_parser():
    inv = {"all": {"children": {"gpu_containers": {"hosts": {
        "ct101": {"pct_vmid": 101, "lab_node": "pve1", "ansible_ssh_common_args": "-o A=b -o 'C=d e'",
                  "odd": "yes: no # not a comment"}}}, "empty": {}}}}
    assert yaml.safe_load(lablab.to_yaml(inv)) == inv


def test_shape_defaults_to_every_gpu_with_index_equal_minor():
    shape = lablab.Lab.shape(None, 2, 2, 4, {}, "modern", [])
    assert sorted(shape["nodes"]) == ["pve1", "pve2"]
    assert shape["nodes"]["pve2"]["containers"]["202"] == {"minors": [0, 1, 2, 3], "bare": False, "unprivileged": False}


def test_shape_layout_and_bare():
    shape = lablab.Lab.shape(None, 1, 2, 8, {"102": [7, 4]}, "legacy", ["101"])
    assert shape["nodes"]["pve1"]["containers"] == {"101": {"minors": list(range(8)), "bare": True, "unprivileged": False},
                                                    "102": {"minors": [7, 4], "bare": False, "unprivileged": False}}
    assert shape["nvml_pids"] == "legacy"


@pytest.mark.parametrize("layouts,bare,message", [
    ({"101": [8]}, [], "names minors \\[8\\]"),
    ({"109": [0]}, [], "109"),
    ({}, ["301"], "301"),
])
def test_shape_rejects_what_the_lab_does_not_have(layouts, bare, message):
    with pytest.raises(LabError, match=message):
        lablab.Lab.shape(None, 1, 2, 8, layouts, "modern", bare)


def test_cli_layout_and_gpus_parsing():
    args, extra = labctl.parser().parse_known_args(
        ["up", "--layout", "101=4,5,6,7", "--layout", "102=0", "--bare", "102"])
    assert dict(args.layout) == {"101": [4, 5, 6, 7], "102": [0]} and args.bare == ["102"]
    args, extra = labctl.parser().parse_known_args(
        ["run", "tp_server", "--node", "pve1", "--vmid", "101", "--gpus", "0,1", "--threads", "3"])
    assert args.gpus == [0, 1] and extra == ["--threads", "3"]


@pytest.mark.parametrize("argv", [["up", "--layout", "101"], ["up", "--layout", "x=1"],
                                  ["up", "--layout", "101=a"], ["run", "plain", "--node", "p", "--vmid", "1",
                                                                "--gpus", "0,x"]])
def test_cli_rejects_malformed_values(argv):
    with pytest.raises(SystemExit):
        labctl.parser().parse_args(argv)


def test_systemd_containers_boot_their_own_root_with_systemd_and_other_shapes_stay():
    """Issue 44: --systemd (and --systemd-node) mark only the named containers; --bare with it is refused; the CLI
    takes VMID lists, repeatable."""
    shape = lablab.Lab.shape(None, 1, 3, 2, {}, "modern", [], unprivileged=["102"], systemd=["101", "102", "103"],
                             systemd_node=["103"])
    cts = shape["nodes"]["pve1"]["containers"]
    assert cts["101"]["systemd"] is True and "systemd_node" not in cts["101"] and cts["103"]["systemd_node"] is True
    assert "systemd" not in lablab.Lab.shape(None, 1, 1, 2, {}, "modern", [])["nodes"]["pve1"]["containers"]["101"]
    with pytest.raises(LabError, match="--bare and --systemd both name 101"):
        lablab.Lab.shape(None, 1, 1, 2, {}, "modern", ["101"], systemd=["101"])
    with pytest.raises(LabError, match="--systemd/--shared-run-lock name vmids not in the lab: 999"):
        lablab.Lab.shape(None, 1, 1, 2, {}, "modern", [], systemd=["999"])
    args = labctl.parser().parse_args(["up", "--systemd", "101,102", "--systemd", "201", "--systemd-node", "103"])
    assert args.systemd == [["101", "102"], ["201"]] and args.systemd_node == [["103"]]
    with pytest.raises(SystemExit):
        labctl.parser().parse_args(["up", "--systemd", "10x"])


def test_lxc_config_of_a_systemd_container_names_its_overlay_root_and_the_systemd_init(tmp_path):
    pve = tmp_path / "101.conf"
    pve.write_text(lablab.proxmox_conf("101", [0]))
    ct = {"vmid": "101", "systemd": True}
    lines = lablab.lxc_config("rid1", "/run/gpuops-lab/rid1", "pve1", ct, str(pve)).splitlines()
    assert "lxc.rootfs.path = /run/gpuops-lab-ct/101" in lines
    init = [ln for ln in lines if ln.startswith("lxc.init.cmd = ")]
    assert len(init) == 1 and init[0].startswith("lxc.init.cmd = /usr/bin/python3 -I ")
    assert " --systemd /run/gpuops-lab/rid1/nodes/pve1/containers/101.json" in init[0]
    plain = lablab.lxc_config("rid1", "/run/gpuops-lab/rid1", "pve1", {"vmid": "101"}, str(pve)).splitlines()
    plain_init = [ln for ln in plain if ln.startswith("lxc.init.cmd")][0]
    assert "lxc.rootfs.path = /run/gpuops-lab-rootfs" in plain and " --inner " in plain_init


def test_the_shifted_root_moves_every_owner_up_once(tmp_path):
    """An unprivileged systemd container's tree: every file, folder and link owned base higher, exactly once (a
    folder is both a walk's root and its parent's entry: shifted twice, the container's /run was uid 200000 to it)."""
    import os
    from lablib import rootfs
    src = tmp_path / "src"
    (src / "run" / "deep").mkdir(parents=True)
    (src / "run" / "deep" / "file").write_text("x")
    os.symlink("deep/file", str(src / "run" / "link"))
    os.lchown(str(src / "run" / "deep" / "file"), 1000, 1000)
    tool = src / "setuid"
    tool.write_text("#!/bin/sh\n")
    os.chmod(str(tool), 0o4755)
    rootfs._shifted(str(src), str(tmp_path / "dst"), 100000)   # pylint: disable=protected-access
    dst = tmp_path / "dst"
    owners = {str(p.relative_to(dst)): os.lstat(str(p)).st_uid for p in [dst] + list(dst.rglob("*"))}
    assert owners == {".": 100000, "run": 100000, "run/deep": 100000, "run/deep/file": 101000, "run/link": 100000,
                      "setuid": 100000}
    assert os.lstat(str(dst / "setuid")).st_mode & 0o7777 == 0o4755
