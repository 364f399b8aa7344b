"""mountinfo parsing on recorded text, and container-to-host pid translation on this process."""

import os

import pytest

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib import common, scenarios

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
90 27 0:50 / /usr/sbin rw,relatime - overlay gpuops-lab-node ro,lowerdir=/run/x/sbin:/usr/sbin
91 27 0:51 / /mnt/with\\040space rw - tmpfs tmp\\134fs rw
"""


def test_parse_mountinfo():
    rows = common.parse_mountinfo(MOUNTINFO)
    assert [r["fstype"] for r in rows] == ["ext4", "cgroup", "cgroup2", "overlay", "tmpfs"]
    assert rows[1]["options"] == "rw,freezer"
    assert rows[3]["source"] == "gpuops-lab-node"
    assert rows[4]["mount_point"] == "/mnt/with space" and rows[4]["source"] == "tmp\\fs"


def test_minors_for_follows_the_layout():
    ct = {"vmid": "102", "minors": [4, 5, 6, 7]}
    assert scenarios.minors_for(ct, [0, 3]) == [4, 7]
    with pytest.raises(common.LabError, match="indexes 0..3, not 4"):
        scenarios.minors_for(ct, [4])


def test_translate_maps_pids_in_a_pid_namespace():
    me = os.getpid()
    ct = {"pidns_inode": os.stat("/proc/self/ns/pid").st_ino}
    out = scenarios.translate(ct, {"scenario": "x", "pids": [me], "roles": {"leader": me}, "holders": [me]})
    assert out["host_pids"] == [me] and out["roles"] == {"leader": me} and out["holders"] == [me]
    assert out["container_roles"] == {"leader": me}


def test_translate_refuses_unknown_pids():
    ct = {"pidns_inode": os.stat("/proc/self/ns/pid").st_ino}
    with open("/proc/sys/kernel/pid_max") as f:
        missing = int(f.read()) + 1
    with pytest.raises(common.LabError, match="not found"):
        scenarios.translate(ct, {"pids": [missing], "roles": {}, "holders": []})


def test_pid_alive_says_no_for_missing_pid():
    assert common.pid_alive(os.getpid())
    assert not common.pid_alive(None)
