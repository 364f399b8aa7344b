"""Issue 43: /dev/shm judged per file system, every access through a container's root bounded.

Worlds of real mounts (tmpfs, bind mounts, a FUSE mount whose daemon never answers) under the test's folder, and
the project's fakes for /proc and NVML. The node's /dev/shm is a tmpfs at NODE_SHM (engine.shm_dir); a container's
is the same path under its init's root (/proc/INIT/root, a link to the container's root folder here).
"""
import ctypes
import os
import threading
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _locks as locks
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from release_opts import release

from fake_nvml import FakeNvml

OLD = time.time() - 3600
MS_BIND, MNT_DETACH = 4096, 2
LIBC = ctypes.CDLL(None, use_errno=True)
INITS = {"101": 500, "102": 600}


@pytest.fixture
def mounts():
    """mount(source, target, fstype, flags, data); every mount made is detached at the end."""
    made = []

    def mount(source, target, fstype=None, flags=0, data=None):
        os.makedirs(target, exist_ok=True)
        if LIBC.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), target)
        made.append(target)
        return target
    yield mount
    for target in reversed(made):
        LIBC.umount2(target.encode(), MNT_DETACH)


@pytest.fixture
def hang(mounts):
    """hang(target): a FUSE mount at target whose daemon never answers: any access there blocks (killably) until
    the end of the test, when the connection is aborted (its /dev/fuse closed) and the mount detached."""
    fds = []

    def make(target):
        fd = os.open("/dev/fuse", os.O_RDWR)
        fds.append(fd)
        return mounts("gpuops-hang", target, "fuse.gpuops-hang", 0, "fd=%d,rootmode=40000,user_id=0,group_id=0" % fd)
    yield make
    for fd in fds:
        os.close(fd)


@pytest.fixture
def reader(monkeypatch):
    fresh = procscan.BoundedReader(timeout=0.5)
    monkeypatch.setattr(procscan, "READER", fresh)
    monkeypatch.setattr(procscan, "READ_TIMEOUT_S", 0.5)
    yield fresh
    fresh.close()


def segment(folder, name, size=8192, mtime=OLD):
    path = os.path.join(folder, name)
    with open(path, "wb") as handle:
        handle.write(b"\0" * size)
    os.utime(path, (mtime, mtime))
    return path


def maps_of(shown, real):
    """maps text of a process that maps the file real, shown at path shown (as its own root names it)."""
    st = os.stat(real)
    return ("7f1000000000-7f1000002000 rw-s 00000000 %02x:%02x %d                       %s\n"
            % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino, shown))


class World(object):
    """The node's /dev/shm (a tmpfs at node_shm) and containers 101 and 102, whose roots are folders (ct101, ct102)
    reached through /proc/INIT/root; each container's /dev/shm is at node_shm's path under its root."""

    def __init__(self, tmp_path, proc, mounts):
        self.tmp, self.proc, self.mount = tmp_path, proc, mounts
        self.node_shm = mounts("gpuops-test", str(tmp_path / "nodeshm"), "tmpfs", 0, "mode=1777,size=16m")
        for vmid, init in INITS.items():
            proc.add(init, comm="init", cgroup="0::/lxc/%s/ns/init.scope\n" % vmid, nspid=[init, 1])
            os.makedirs(self.root(vmid))
            os.symlink(self.root(vmid), os.path.join(proc.root, str(init), "root"))

    def root(self, vmid):
        return str(self.tmp / ("ct%s" % vmid))

    def shm_of(self, vmid):
        """The container's /dev/shm as the node reaches it (under its root folder)."""
        return self.root(vmid) + self.node_shm

    def own_shm(self, vmid):
        return self.mount("gpuops-test", self.shm_of(vmid), "tmpfs", 0, "mode=1777,size=16m")

    def shared_shm(self, vmid):
        """The container's /dev/shm is the node's own, by a bind mount."""
        return self.mount(self.node_shm, self.shm_of(vmid), None, MS_BIND)

    def mnt_ns(self, pid, name):
        """pid's mount namespace is the one called name (a file whose inode stands for it)."""
        shared = os.path.join(self.proc.root, "mntns-%s" % name)
        open(shared, "a").close()
        os.makedirs(os.path.join(self.proc.root, str(pid), "ns"), exist_ok=True)
        os.symlink(shared, os.path.join(self.proc.root, str(pid), "ns", "mnt"))

    def engine(self, monkeypatch):
        confs = dict((vmid, node.parse_pve_conf("hostname: ct%s\n" % vmid)) for vmid in INITS)
        monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: confs)
        monkeypatch.setattr(node, "container_inits", lambda *a, **k: dict(INITS))
        engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 0}])), proc_root=self.proc.root, self_pid=999999)
        engine.view, engine.in_container = "node", False
        engine.start()
        engine.shm_dir = self.node_shm
        return engine

    def release(self, engine, containers, host_processes=False, check_mode=False, timeout=60.0):
        scope = node.Scope(containers, host_processes=host_processes, proc_root=self.proc.root)
        options = dict(lock_timeout=2.0, scope=scope, shm_prefixes=shm.PREFIXES)
        return release(engine, [0], options, check_mode=check_mode, lock_dir=str(self.tmp / "node-lock"),
                       deadline=time.monotonic() + timeout)


@pytest.fixture
def world(tmp_path, proc, mounts):
    return World(tmp_path, proc, mounts)


def names(folder):
    return sorted(os.listdir(folder))


def release_in_a_thread(world, engine, containers, timeout):
    """(the release's answer, or None when it has not ended within timeout, and the seconds waited): a release
    that hangs in the kernel stays stuck in its thread until the test's mounts are aborted."""
    done = {}
    worker = threading.Thread(target=lambda: done.update(out=world.release(engine, containers, timeout=timeout)))
    started = time.monotonic()
    worker.start()
    worker.join(timeout)
    return done.get("out"), time.monotonic() - started


def test_s1_a_bind_shared_dev_shm_keeps_the_segment_a_node_process_maps(world, monkeypatch, reader):
    """S1: container 101's /dev/shm is the node's own (a bind mount) and a node NCCL job maps nccl-live there. The
    node-side clean_shm removed it as 101's residue, since a file's users were looked up by container."""
    world.shared_shm("101")
    live = segment(world.node_shm, "nccl-live")
    segment(world.node_shm, "nccl-leak")
    segment(world.node_shm, "PostgreSQL.1")
    world.proc.add(700, comm="python3", cgroup="0::/system.slice/trainer.service\n",
                   raw_maps=maps_of("/dev/shm/nccl-live", live))
    engine = world.engine(monkeypatch)
    # 101 alone in scope: its /dev/shm is one mount with the node's, outside the scope: nothing on it is removed
    failed, msg, result = world.release(engine, [101])
    assert result["shm_removed"] == [] and result["shm_residue"] == [], result
    assert [(e["vmid"], e["why"]) for e in result["shm_skipped"]] == [
        (101, "it is one mount with the node's /dev/shm, outside the scope: nothing on it is removed")]
    assert names(world.node_shm) == ["PostgreSQL.1", "nccl-leak", "nccl-live"]
    assert "/dev/shm not cleaned in container 101" in msg and not failed, msg
    # the node's processes in scope too: the unused residue goes, the mapped segment stays
    leak = {"path": world.node_shm + "/nccl-leak", "bytes": 8192, "owner": "nccl", "vmid": None}
    failed, msg, check = world.release(engine, [101], host_processes=True, check_mode=True)
    assert not failed and check["shm_residue"] == [leak] and check["shm_removed"] == [] and check["shm_skipped"] == []
    assert names(world.node_shm) == ["PostgreSQL.1", "nccl-leak", "nccl-live"]
    failed, msg, done = world.release(engine, [101], host_processes=True)
    assert not failed and done["shm_removed"] == [leak] and done["shm_left"] == [], done
    assert names(world.node_shm) == ["PostgreSQL.1", "nccl-live"] == names(world.shm_of("101"))


def test_s2_a_process_whose_maps_read_blocks_keeps_its_folder_and_only_its_folder(world, monkeypatch, reader):
    """S2: pid 800 in container 101 maps nccl-inuse, and a read of its maps blocks (a thread in D state holds its
    memory-map lock). It was left out of the users, and the segment removed. Now 101's folder is skipped, naming
    it; 102's folder (another mount, another mount namespace) is cleaned."""
    for vmid in ("101", "102"):
        world.own_shm(vmid)
        segment(world.shm_of(vmid), "nccl-inuse" if vmid == "101" else "nccl-old")
    world.mnt_ns(500, "101")
    world.mnt_ns(600, "102")
    world.proc.add(800, comm="python3", state="D", cgroup="0::/lxc/101/ns/app.scope\n", nspid=[800, 40])
    world.mnt_ns(800, "101")
    maps = os.path.join(world.proc.root, "800", "maps")
    os.unlink(maps)
    os.mkfifo(maps)        # a read of it blocks, as one of a process whose memory-map lock is held
    engine = world.engine(monkeypatch)
    failed, msg, result = world.release(engine, [101, 102])
    assert names(world.shm_of("101")) == ["nccl-inuse"]
    assert names(world.shm_of("102")) == []
    assert [e["path"] for e in result["shm_removed"]] == [world.node_shm + "/nccl-old"]
    assert [e["vmid"] for e in result["shm_skipped"]] == [101], result["shm_skipped"]
    assert result["shm_skipped"][0]["why"].startswith("pid 800 could not be read (its maps read blocked)"), result


def test_s2_a_process_not_read_whose_place_cannot_be_read_keeps_every_folder(world, monkeypatch, reader):
    """S2, unknown: neither the blocked process's mount namespace nor its container can be read: it cannot be ruled
    out of any folder, and nothing is removed anywhere."""
    for vmid in ("101", "102"):
        world.own_shm(vmid)
        segment(world.shm_of(vmid), "nccl-old")
    world.proc.add(800, comm="python3", state="D", cgroup="")
    maps = os.path.join(world.proc.root, "800", "maps")
    os.unlink(maps)
    os.mkfifo(maps)
    engine = world.engine(monkeypatch)
    failed, msg, result = world.release(engine, [101, 102])
    assert result["shm_removed"] == [] and names(world.shm_of("101")) == names(world.shm_of("102")) == ["nccl-old"]
    assert [(e["vmid"], "pid 800 could not be read" in e["why"]) for e in result["shm_skipped"]] == [(101, True), (102, True)]


@pytest.mark.parametrize("link", ["absolute", "debian"])
def test_s3_a_container_dev_shm_reached_through_a_link_is_never_followed(world, monkeypatch, reader, link):
    """S3: 101 makes a part of its /dev/shm path an absolute link; through /proc/INIT/root the kernel resolves it
    against the node's root, so the node's own /dev/shm was listed and cleaned as 101's. A Debian-style
    /dev/shm -> run/shm is a link too. Neither is followed: 101 is skipped, with the reason."""
    segment(world.node_shm, "nccl-leak")
    if link == "absolute":       # the first part of the path, as a container's /dev -> /dev
        first = world.node_shm.strip("/").split("/")[0]
        os.symlink("/" + first, os.path.join(world.root("101"), first))
    else:                        # the last part, relative, to a folder of the container's own with residue in it
        shm_path = world.shm_of("101")
        os.makedirs(os.path.dirname(shm_path))
        os.makedirs(os.path.join(os.path.dirname(shm_path), "run-shm"))
        segment(os.path.join(os.path.dirname(shm_path), "run-shm"), "nccl-own")
        os.symlink("run-shm", shm_path)
    engine = world.engine(monkeypatch)
    failed, msg, result = world.release(engine, [101])
    assert names(world.node_shm) == ["nccl-leak"]
    if link == "debian":
        assert names(os.path.join(os.path.dirname(world.shm_of("101")), "run-shm")) == ["nccl-own"]
    assert result["shm_removed"] == [] and [e["vmid"] for e in result["shm_skipped"]] == [101], result
    assert "is a symbolic link or no folder (never followed)" in result["shm_skipped"][0]["why"]


def test_h2_a_dev_shm_on_a_mount_that_never_answers_ends_in_time_and_removes_nothing(world, monkeypatch, reader, hang):
    """H2: 101's /dev/shm is a FUSE mount whose daemon never answers. It was listed in the module's own process:
    the release hung past its timeout. Now it ends within it, names the folder, and removes nothing."""
    world.own_shm("102")
    segment(world.shm_of("102"), "nccl-old")
    hang(world.shm_of("101"))
    engine = world.engine(monkeypatch)
    out, took = release_in_a_thread(world, engine, [101, 102], 20.0)
    assert out is not None, "the release did not end within its 20 s timeout"
    assert took < 20.0
    failed, msg, result = out
    assert [e["vmid"] for e in result["shm_skipped"]] == [101], result
    seen_from_node = "%s/500/root%s" % (world.proc.root, world.node_shm)
    assert result["shm_skipped"][0]["why"].startswith(seen_from_node), result["shm_skipped"]
    assert "did not answer within" in result["shm_skipped"][0]["why"]
    assert [e["vmid"] for e in result["shm_removed"]] == [102] and names(world.shm_of("102")) == []


def test_h2_a_lock_folder_on_a_mount_that_never_answers_leaves_the_container_out_in_time(world, monkeypatch, reader, hang):
    """H2: 101's /run/lock is a FUSE mount whose daemon never answers. Its lock was taken in the module's own
    process: the release hung past its timeout with the node's GPU locks held. Now the helper that takes it is
    given up on: 101 is left out, named with the path, and 102 is released."""
    monkeypatch.setattr(locks, "OPEN_TIMEOUT_S", 1.0)
    os.makedirs(os.path.join(world.root("101"), "run"))
    hang(os.path.join(world.root("101"), "run", "lock"))
    engine = world.engine(monkeypatch)
    out, took = release_in_a_thread(world, engine, [101, 102], 20.0)
    assert out is not None, "the release did not end within its 20 s timeout"
    assert took < 20.0
    failed, msg, result = out
    by_vmid = dict((e["vmid"], e) for e in result["per_container"])
    assert by_vmid[101]["verdict"] == "skipped" and by_vmid[102]["verdict"] != "skipped", by_vmid
    assert "%s/500/root/run/lock/gpuops-fleet did not answer within 1s (a hung mount?)" % world.proc.root in \
        by_vmid[101]["reason"], by_vmid[101]
    assert failed and "left out: container 101" in msg, msg
    taken = os.path.join(world.root("102"), "run", "lock", "gpuops-fleet")
    assert os.listdir(taken)    # 102's lock file was made and taken


def test_users_are_read_again_right_before_the_removals(world, monkeypatch, reader):
    """A segment judged residue that a process maps by the time the removals start (a restarted server attaching to
    it) is kept, and said so (shm_left, kept, which fails nothing): the folders and every process's users are read
    and judged again first. One with no user is removed."""
    world.own_shm("101")
    attached = segment(world.shm_of("101"), "nccl-attached")
    segment(world.shm_of("101"), "nccl-leak")
    engine = world.engine(monkeypatch)
    reads = []
    shm_places = engine.shm_places

    def places_then_attach():
        reads.append(len(reads))
        if len(reads) == 2:      # after the judgement, before the removals: a process of 101 maps it now
            world.proc.add(900, comm="python3", cgroup="0::/lxc/101/ns/app.scope\n", nspid=[900, 50],
                           raw_maps=maps_of("/dev/shm/nccl-attached", attached))
        return shm_places()
    engine.shm_places = places_then_attach
    failed, msg, result = world.release(engine, [101])
    assert len(reads) == 2
    assert sorted(e["path"].rsplit("/", 1)[1] for e in result["shm_residue"]) == ["nccl-attached", "nccl-leak"]
    assert [e["path"].rsplit("/", 1)[1] for e in result["shm_removed"]] == ["nccl-leak"]
    assert [(e["path"].rsplit("/", 1)[1], e["kept"]) for e in result["shm_left"]] == [("nccl-attached", True)], result
    assert not failed, (msg, result)
    assert names(world.shm_of("101")) == ["nccl-attached"]
