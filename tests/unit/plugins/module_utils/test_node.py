"""The node-side helpers: containers from cgroups, configs, HA, by_container, scope, container locks."""
import fcntl
import os
import stat

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._locks import (
    GpuLocks, HelperLocks, LockDirError, LockTimeout, lock_name,
)

CONF = """arch: amd64
hostname: ct101
dev0: /dev/nvidia4,gid=44
dev1: path=/dev/nvidia5
dev2: /dev/nvidiactl
lock: backup
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidia3 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file

[snap1]
dev0: /dev/nvidia7
lock: snapshot
"""


@pytest.mark.parametrize("path, vmid", [
    ("/lxc/101/ns/system.slice/sglang.service", "101"),
    ("/gpuops-lab-ab12/pve1/lxc/204/ns", "204"),
    ("/lxc/101/ns/docker/abc/lxc/7/ns/x", "101"),   # nesting after the first lxc/VMID/ns
    ("/lxc.monitor/101", None),
    ("/lxc/101", None),                              # the container's outer cgroup holds no process of it
    ("/system.slice/sshd.service", None),
    ("", None),
])
def test_container_is_the_first_lxc_vmid_ns_of_the_cgroup_path(path, vmid):
    assert node.container_of_cgroup(path) == vmid


def test_pid_in_container_is_the_level_below_the_node():
    assert node.pid_in_container([4388, 77]) == 77
    assert node.pid_in_container([4388, 77, 3]) == 77       # Docker inside LXC: the LXC-level pid
    assert node.pid_in_container([4388]) is None


def test_config_main_section_gives_minors_and_lock_not_the_snapshots():
    conf = node.parse_pve_conf(CONF)
    assert conf["minors"] == [3, 4, 5]
    assert conf["keys"]["lock"] == "backup" and conf["keys"]["hostname"] == "ct101"


def test_passed_into_reads_every_config_of_the_node(tmp_path):
    (tmp_path / "101.conf").write_text(CONF)
    (tmp_path / "102.conf").write_text("dev0: /dev/nvidia4\n")
    (tmp_path / "notes.txt").write_text("dev0: /dev/nvidia4\n")
    confs = node.read_pve_confs(str(tmp_path))
    assert node.passed_into(confs, 4) == [101, 102]
    assert node.passed_into(confs, 3) == [101]
    assert node.passed_into(confs, 6) == []
    assert node.passed_into(node.read_pve_confs(str(tmp_path / "missing")), 4) is None


def test_ha_resources_name_containers_with_their_state(tmp_path):
    path = tmp_path / "resources.cfg"
    path.write_text("ct: 101\n\tgroup gpu\n\tstate started\n\nvm: 300\n\tstate started\n\nct: 102\n\tstate disabled\n")
    assert node.read_ha_resources(str(path)) == {"101": "started", "102": "disabled"}
    assert node.read_ha_resources(str(tmp_path / "none.cfg")) == {}


def test_by_container_adds_up_to_used_and_charges_a_dead_parent_to_its_heir():
    holders = [{"pid": 10, "container": "101", "heir_of": []},
               {"pid": 20, "container": "102", "heir_of": [99999999]}]
    procs = [{"pid": 10, "used_mib": 1000}, {"pid": 99999999, "used_mib": 500}]
    out = node.by_container(procs, 1800, holders)
    assert out == {"101": 1000, "102": 500, "unattributed": 300}
    assert sum(out.values()) == 1800


def test_by_container_charges_a_dead_pid_to_the_one_container_pinned_by_its_memory():
    """A fork child of a dead parent that led neither its group nor its session: the child was pinned to GPU 4
    by the dead pid's memory (the evidence its plan prints), so its container is charged, not `unattributed`."""
    child = {"pid": 10, "container": "103", "heir_of": [], "shares_mib": {4: 3072}, "evidence": ["mapping", "dead_pid"]}
    other = {"pid": 20, "container": "101", "heir_of": [], "shares_mib": {0: 100}, "evidence": ["nvml", "mapping"]}
    procs = [{"pid": 99999998, "used_mib": 3072}]
    assert node.by_container(procs, 3072, [child, other], index=4) == {"103": 3072}
    assert node.by_container(procs, 3072, [child, other], index=0) == {"unattributed": 3072}
    assert node.by_container(procs, 3072, [child], stale={99999998}, index=4) == {"unattributed": 3072}
    twin = dict(child, pid=11, container="102")     # two containers pinned by it: no guess
    assert node.by_container(procs, 3072, [child, twin], index=4) == {"unattributed": 3072}


def _chardev(path, minor, major=195):
    os.mknod(str(path), stat.S_IFCHR | 0o600, os.makedev(major, minor))


def test_a_passed_device_is_the_gpu_its_device_number_says_not_its_name(tmp_path):
    """Proxmox lets /dev/nvidia3 be bound in as dev/nvidia0: the node's device is read by st_rdev."""
    dev = tmp_path / "dev"
    dev.mkdir()
    _chardev(dev / "nvidia0", 3)        # named 0, is minor 3
    _chardev(dev / "nvidia1", 1)
    _chardev(dev / "nvidiactl", 255)
    parsed = node.parse_pve_conf("dev0: /dev/nvidia0\ndev1: /dev/nvidia1\ndev2: /dev/nvidiactl\n"
                                 "dev3: /dev/nvidia5\n")    # nvidia5 is not there: its name is all there is
    resolved = node.resolve_devices(parsed, dev_root=str(tmp_path))
    assert resolved["minors"] == [1, 3, 5]
    assert [(d["minor"], d.get("name_minor")) for d in resolved["devices"]] == [(3, 0), (1, None), (5, None)]
    assert node.device_minor(str(dev / "nvidiactl"), 7) is None          # a device, but not a GPU


def test_a_containers_dev_is_read_by_device_number_and_checked_against_its_config(tmp_path):
    real, lab = tmp_path / "real", tmp_path / "lab"
    real.mkdir()
    lab.mkdir()
    _chardev(real / "nvidia0", 3)
    _chardev(real / "nvidia-uvm", 0, major=508)
    _chardev(real / "nvidiactl", 255)
    (real / "null").write_text("")
    (lab / "nvidia0").write_text("")     # the lab's stand-in: not a device, nothing to check
    _chardev(real / "nvidia3", 3)

    def read(folder):
        return node.dev_minors(procscan.list_folder("/", [p for p in str(folder).split("/") if p])["entries"])
    assert read(real) == {3: ["nvidia0", "nvidia3"]}
    assert read(lab) is None
    with pytest.raises(OSError):
        read(tmp_path / "none")
    confs = {"101": {"minors": [3]}, "102": {"minors": [2]}, "103": {"minors": [4]}}
    seen = {"101": {3: ["nvidia0", "nvidia3"]}, "102": {0: ["nvidia0"]}, "103": None}
    held, lines = node.check_devices(confs, seen)
    assert held == {"101": [3], "102": [0]}
    assert lines == [
        "container 101: nvidia0 is minor 3 by its device number: names are not GPUs, its GPUs are read by number",
        "container 102: its /dev holds GPU minor 0 (nvidia0), which its config does not pass in; it is counted as "
        "that container's",
        "container 102: its config passes in GPU minor 2, but its /dev holds no such device (a bind that failed, or "
        "a config changed since it started: restart it to apply)"]


def test_scope_allows_its_containers_and_host_processes_only_when_asked():
    scope = node.Scope([101], host_processes=False)
    assert scope.reason({"container": "101"}) is None
    assert "container 102" in scope.reason({"container": "102"})
    assert "host_processes is false" in scope.reason({"container": "host"})
    assert node.Scope([], host_processes=True).reason({"container": "host"}) is None


def test_scope_recheck_reads_the_cgroup_again():
    me = os.getpid()
    where = node.container_of_pid(me)
    scope = node.Scope([101])
    assert "out of scope" in scope.recheck({"pid": me, "container": "101"})
    assert node.Scope([], host_processes=True).recheck({"pid": me, "container": where}) is None


def test_rooted_lock_dir_is_made_for_the_roots_owner_and_excludes_a_second_taker(tmp_path):
    root = tmp_path / "ctroot"
    (root / "run").mkdir(parents=True)
    uid, gid = os.getuid(), os.getgid()
    first = HelperLocks(str(root), ["run", "lock", "gpuops-fleet"], uid, gid)
    first.acquire(["GPU-a"], 1)
    made = root / "run" / "lock" / "gpuops-fleet"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert (made / "gpuops-fleet-gpu-GPU-a.lock").exists() and first.locked == [str(made / "gpuops-fleet-gpu-GPU-a.lock")]
    # the container's own release takes the same file by its own path
    inside = GpuLocks(str(made))
    with pytest.raises(LockTimeout):
        inside.acquire(["GPU-a"], 0.2)
    first.release()
    inside.acquire(["GPU-a"], 0.2)
    inside.release()


def test_a_container_lock_is_really_held_by_its_helper_until_released(tmp_path):
    """Issue 43: the helper that took a container's lock holds it for the whole release (this process never
    holds the descriptor): another open file description of the file cannot flock it until release()."""
    root = tmp_path / "ctroot"
    (root / "run").mkdir(parents=True)
    locks = HelperLocks(str(root), ["run", "lock", "gpuops-fleet"], os.getuid(), os.getgid())
    locks.acquire(["GPU-a", "GPU-b"], 1)
    helper = locks.proc.pid
    paths = [str(root / "run" / "lock" / "gpuops-fleet" / lock_name(k)) for k in ("GPU-a", "GPU-b")]
    assert sorted(locks.locked) == paths
    own = os.listdir("/proc/self/fd")
    assert not any(os.path.realpath("/proc/self/fd/" + fd) in paths for fd in own if os.path.exists("/proc/self/fd/" + fd))
    assert sorted(os.readlink("/proc/%d/fd/%s" % (helper, fd)) for fd in os.listdir("/proc/%d/fd" % helper)
                  if os.readlink("/proc/%d/fd/%s" % (helper, fd)) in paths) == paths
    for path in paths:
        fd = os.open(path, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    locks.release()
    assert not os.path.exists("/proc/%d/fd" % helper) or not os.listdir("/proc/%d/fd" % helper)
    for path in paths:
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_rooted_lock_dir_never_follows_a_planted_link(tmp_path):
    root = tmp_path / "ctroot"
    (root / "run").mkdir(parents=True)
    elsewhere = tmp_path / "node-etc"
    elsewhere.mkdir()
    os.symlink(str(elsewhere), str(root / "run" / "lock"))
    locks = HelperLocks(str(root), ["run", "lock", "gpuops-fleet"], os.getuid(), os.getgid())
    with pytest.raises(LockDirError, match="is not a directory"):
        locks.acquire(["GPU-a"], 0.2)
    assert os.listdir(str(elsewhere)) == []


def test_rooted_lock_file_already_held_keeps_its_owner(tmp_path):
    folder = tmp_path / "locks"
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    os.chown(str(folder), 4242, 4242)
    held = folder / lock_name("GPU-held")
    held.write_text("")
    st = held.stat()
    locks = HelperLocks(str(tmp_path), ["locks"], 4242, 4242, held={(st.st_dev, st.st_ino): str(held)})
    locks.acquire(["GPU-held", "GPU-new"], 1)
    try:
        assert locks.aliases == [(str(held), str(held))] and locks.locked == [str(folder / lock_name("GPU-new"))]
        assert held.stat().st_uid == st.st_uid and (folder / lock_name("GPU-new")).stat().st_uid == 4242
    finally:
        locks.release()


def test_inits_and_members_from_the_snapshots_scan_are_those_of_a_walk(proc):
    """The restart plan and container attribution use the scan's walk: the same answers, fewer reads."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
    proc.add(900, comm="lxc-start", cgroup="0::/lxc.monitor/101\n")
    proc.add(901, comm="init", ppid=900, nspid=[901, 1], cgroup="0::/lxc/101/ns/init.scope\n")
    proc.add(902, comm="sglang", ppid=901, nspid=[902, 40], cgroup="0::/lxc/101/ns/system.slice/sglang.service\n")
    proc.add(910, comm="lxc-start", cgroup="0::/lxc.monitor/102\n")
    proc.add(911, comm="init", ppid=910, nspid=[911, 1], cgroup="0::/lxc/102/ns\n")
    proc.add(920, comm="sshd", nspid=[920], cgroup="0::/system.slice/ssh.service\n")
    table = procscan.scan(proc.root, procscan.DeviceNames(), cgroups=True)
    assert sorted(table.stats) == [900, 901, 902, 910, 911, 920]
    assert node.container_inits(proc.root, table) == node.container_inits(proc.root) == {"101": 901, "102": 911}
    walked = node.processes_by_container(proc.root)
    assert node.processes_by_container(proc.root, table) == walked
    assert [p["container_pid"] for p in walked["101"]] == [1, 40]
    os.unlink(os.path.join(proc.root, "902", "cgroup"))     # read once, by the scan: not again
    assert node.container_of_pid(902, proc.root, table) == "101" and node.container_of_pid(902, proc.root) is None
