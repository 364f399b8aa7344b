"""Issue 43, red team: crafted worlds against the per-file-system /dev/shm judge and its act layer.

Each test is a way the issue-43 code can still remove a file a live process uses, or end in a success that hides
residue it did not clean. The worlds are test_shm_per_fs's (real tmpfs and bind mounts under the test's folder, the
project's fakes for /proc and NVML); nothing outside the test's folder is touched.
"""
import os
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _ladder as ladder
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from release_opts import release

from fake_nvml import FakeNvml
# mounts and reader are fixtures, used by name
from test_shm_per_fs import World, maps_of, mounts, names, reader, segment  # noqa: F401 pylint: disable=unused-import

OVERFLOW_UID = 65534   # how an unprivileged container sees a file of the node's root (an unmapped owner)


@pytest.fixture
def world(tmp_path, proc, mounts):  # noqa: F811
    return World(tmp_path, proc, mounts)


def container_engine(world, monkeypatch, shm_dir):
    """gpu_release's engine as it runs inside a container (the role's default path): its /proc shows only the
    container's own processes, its /dev/shm is shm_dir."""
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 0}])), proc_root=world.proc.root,
                    self_pid=999999)
    engine.view, engine.in_container = "container", True
    engine.start()
    engine.shm_dir = shm_dir
    return engine


def test_red1_in_a_container_a_dev_shm_bound_from_the_node_loses_a_node_jobs_live_segment(world, monkeypatch,
                                                                                         reader):  # noqa: F811
    """S1 seen from the other side. Container 101's /dev/shm is the node's own, by a bind mount (the lab's S1
    world), and a node NCCL job maps nccl-live there. The role runs gpu_release inside the container by default,
    now with clean_shm on: from there the node's processes are not in /proc, the folder is the only place, and
    nothing says it is shared. nccl-live (a node-root file: owner unmapped in the container) is removed."""
    ct_shm = world.shared_shm("101")
    live = segment(world.node_shm, "nccl-live")
    os.chown(live, OVERFLOW_UID, OVERFLOW_UID)     # the node root's file, as the container sees its owner
    os.chown(world.node_shm, OVERFLOW_UID, OVERFLOW_UID)   # and the node root's folder
    # the node's trainer (pid 700 on the node) maps it; it is not in the container's /proc
    engine = container_engine(world, monkeypatch, ct_shm)
    failed, msg, result = release(engine, [0], dict(lock_timeout=2.0, shm_prefixes=shm.PREFIXES),
                                  lock_dir=str(world.tmp / "ct-lock"), deadline=time.monotonic() + 30)
    assert names(world.node_shm) == ["nccl-live"], (msg, result.get("shm_removed"))
    assert [e["vmid"] for e in result["shm_skipped"]] == [None] and result["shm_removed"] == [], result
    assert "owned by an owner this container does not map" in result["shm_skipped"][0]["why"], result["shm_skipped"]


def test_red2_an_fd_only_user_in_the_containers_mount_namespace_is_not_counted(world, monkeypatch,
                                                                              reader):  # noqa: F811
    """A node-side process entered 101's mount namespace (nsenter -t INIT -m, a monitor or a CUDA IPC broker) and
    holds /dev/shm/nccl-held open without mapping it (shm_open, ftruncate, the fd passed on). Its fd target reads
    /dev/shm/nccl-held, but its name is counted for the node's own folder (its cgroup's place), never for 101's,
    the folder of its mount namespace: 101's nccl-held is removed under it."""
    world.own_shm("101")
    segment(world.shm_of("101"), "nccl-held")
    world.mnt_ns(500, "101")
    world.proc.add(700, comm="broker", cgroup="0::/system.slice/broker.service\n", fds=["/dev/shm/nccl-held"])
    world.mnt_ns(700, "101")
    engine = world.engine(monkeypatch)
    failed, msg, result = world.release(engine, [101])
    assert names(world.shm_of("101")) == ["nccl-held"], (msg, result.get("shm_removed"))
    assert result["shm_residue"] == [] and result["shm_skipped"] == [], result


def test_red3_an_unreadable_node_process_is_ruled_out_of_a_containers_folder(world, monkeypatch,
                                                                           reader):  # noqa: F811
    """S2 from the node. pid 800 is a node process (the node's cgroup, the node's mount namespace) whose maps read
    blocks. A node process reaches any container's /dev/shm through /proc/INIT/root or a bind (S1: users are
    found whatever the path), so it cannot be ruled out of 101's folder; it is, by its cgroup and mount namespace,
    and 101's nccl-inuse is removed."""
    world.own_shm("101")
    live = segment(world.shm_of("101"), "nccl-inuse")
    world.mnt_ns(500, "101")
    world.proc.add(800, comm="python3", state="D", cgroup="0::/system.slice/trainer.service\n",
                   raw_maps=maps_of("/proc/500/root/dev/shm/nccl-inuse", live))
    world.mnt_ns(800, "node")
    maps = os.path.join(world.proc.root, "800", "maps")
    os.unlink(maps)
    os.mkfifo(maps)        # its memory-map lock is held: the read blocks
    engine = world.engine(monkeypatch)
    failed, msg, result = world.release(engine, [101])
    assert names(world.shm_of("101")) == ["nccl-inuse"], (msg, result.get("shm_removed"))
    assert [e["vmid"] for e in result["shm_skipped"]] == [101], result["shm_skipped"]
    assert result["shm_skipped"][0]["why"].startswith("pid 800, a process of the node, could not be read"), result


def test_red4_a_folder_skipped_on_the_second_read_vanishes_from_the_result(world, monkeypatch,
                                                                         reader):  # noqa: F811
    """The users are judged again right before the removals. When the folder is skipped then (its mount stopped
    answering, a process of it could not be read), its residue is neither removed, nor left, nor skipped: the
    result lists it as found and says nothing more, and the release succeeds as if /dev/shm were clean."""
    world.own_shm("101")
    segment(world.shm_of("101"), "nccl-leak")
    engine = world.engine(monkeypatch)
    reads = []
    shm_places = engine.shm_places

    def second_read_hangs():
        places = shm_places()
        reads.append(1)
        if len(reads) == 2:
            places["101"]["why"] = "%s did not answer within 0.5s (a hung mount?)" % places["101"]["label"]
        return places
    engine.shm_places = second_read_hangs
    failed, msg, result = world.release(engine, [101])
    assert len(reads) == 2
    assert [e["path"].rsplit("/", 1)[1] for e in result["shm_residue"]] == ["nccl-leak"]
    assert names(world.shm_of("101")) == ["nccl-leak"]
    accounted = [e["path"] for e in result["shm_left"]] + [e["vmid"] for e in result["shm_skipped"]]
    assert accounted, "residue found and kept, yet neither left nor skipped: %r / %r" % (msg, result)
    assert [e["vmid"] for e in result["shm_skipped"]] == [101], result["shm_skipped"]
    assert result["shm_skipped"][0]["why"].startswith("when read again right before the removals: "), result


def test_red5_a_container_lock_whose_helper_died_is_still_taken_for_held(tmp_path):
    """Deliver 4: a lock taken in a helper must stay held for the whole release. The helper can die (the OOM
    killer, an operator's kill) after it said "locked": its flock goes with it, the container's own release can
    take the GPU, yet HelperLocks still lists the file as held and nothing in the release looks again before it
    signals."""
    import signal as signal_mod
    from ansible_collections.gpuops.fleet.plugins.module_utils._locks import GpuLocks, HelperLocks
    root = tmp_path / "ctroot"
    (root / "run").mkdir(parents=True)
    locks = HelperLocks(str(root), ["run", "lock", "gpuops-fleet"], os.getuid(), os.getgid())
    locks.acquire(["GPU-a"], 1)
    try:
        os.kill(locks.proc.pid, signal_mod.SIGKILL)   # our own test child
        locks.proc.wait(5)
        inside = GpuLocks(str(root / "run" / "lock" / "gpuops-fleet"))
        taken = True
        try:
            inside.acquire(["GPU-a"], 0.2)         # the container's own release gets in
        except Exception:  # pylint: disable=broad-except
            taken = False
        inside.release()
        assert not (taken and locks.locked), "the helper is dead and the lock free, yet still held: %r" % locks.locked
        assert locks.lost() == [str(root / "run" / "lock" / "gpuops-fleet" / "gpuops-fleet-gpu-GPU-a.lock")]
    finally:
        locks.release()


def test_red6_a_second_control_daemon_in_the_container_hides_a_live_client(tmp_path):
    """M2, a daemon that lies. With no NVML MPS list, a server's clients are what a control daemon lists, and the
    first daemon (lowest pid) that names the server wins. A process of container 101 named nvidia-cuda-mps-control
    (pid 10) answers get_client_list with nothing; the real daemon (pid 20) lists client 41, on an untargeted GPU.
    The server is then judged to serve no one and may be signalled under its live client, on one daemon's word."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
    server = {"pid": 800, "container": "101", "container_pid": 40}
    client = {"pid": 801, "container": "101", "container_pid": 41}
    fake = {"control": {"pid": 10, "vmid": "101"}, "servers": {40: []}, "why": {}, "error": None}
    real = {"control": {"pid": 20, "vmid": "101"}, "servers": {40: [41]}, "why": {}, "error": None}
    evidence = mps._evidence(server, [server, client], [fake, real], str(tmp_path))
    assert evidence["clients"] is None or 801 in evidence["clients"], evidence


def test_red5_a_release_whose_container_lock_helper_dies_signals_nothing(world, monkeypatch, reader):  # noqa: F811
    """The same death during a node-side release: the helper holding 101's lock is killed after the locks were
    taken, before the first signal. Nothing is signalled, and the task fails naming the lost lock."""
    import signal as signal_mod
    from ansible_collections.gpuops.fleet.plugins.module_utils import _locks as locks_mod
    from ansible_collections.gpuops.fleet.plugins.module_utils import _release as release_mod
    from conftest import CTL, ctx
    world.proc.add(700, comm="python3", cgroup="0::/lxc/101/ns/app.scope\n", nspid=[700, 30],
                   maps=ctx(0) + [CTL], fds=["/dev/nvidia0", CTL])
    fake = FakeNvml([{"minor": 0, "used_mib": 4096, "procs": [(700, 4096)]}])
    helpers, sent = [], []
    acquire = locks_mod.HelperLocks.acquire

    def recorded(self, *args, **kwargs):
        helpers.append(self)
        return acquire(self, *args, **kwargs)
    monkeypatch.setattr(locks_mod.HelperLocks, "acquire", recorded)
    monkeypatch.setattr(ladder, "send_guarded", lambda record, sig, *a, **k: sent.append((record["pid"], sig)) or "sent")
    confs = dict((vmid, node.parse_pve_conf("hostname: ct%s\n" % vmid)) for vmid in ("101", "102"))
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: confs)
    monkeypatch.setattr(node, "container_inits", lambda *a, **k: {"101": 500, "102": 600})
    engine = Engine(Nvml(2.0, lib=fake), proc_root=world.proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    snapshot = engine.snapshot

    def kill_then_read(targets, **given):
        for helper in helpers:
            if helper.alive():
                os.kill(helper.proc.pid, signal_mod.SIGKILL)   # our own test child
                helper.proc.wait(5)
        return snapshot(targets, **given)
    engine.snapshot = kill_then_read
    scope = node.Scope([101], proc_root=world.proc.root)
    failed, msg, result = release(engine, [0], dict(lock_timeout=2.0, scope=scope, term_timeout=0.3, kill_timeout=0.3,
                                                    verify_timeout=0.3),
                                  lock_dir=str(world.tmp / "node-lock"), deadline=time.monotonic() + 30)
    assert len(helpers) == 1 and sent == [], (sent, msg)
    assert failed and "the GPU lock of container 101 was lost" in msg and msg.endswith("nothing was signalled"), msg


def test_red1_a_file_of_an_owner_the_container_does_not_map_is_never_its_residue(world, monkeypatch, reader):  # noqa: F811
    """The same node file in a folder of the container's own (owned by its root): the folder is judged, but a file
    of an owner the container does not map (made outside it, by users it cannot see) is never its residue."""
    ct_shm = world.own_shm("101")
    foreign = segment(ct_shm, "nccl-from-outside")
    os.chown(foreign, OVERFLOW_UID, OVERFLOW_UID)
    segment(ct_shm, "nccl-leak")
    engine = container_engine(world, monkeypatch, ct_shm)
    failed, msg, result = release(engine, [0], dict(lock_timeout=2.0, shm_prefixes=shm.PREFIXES),
                                  lock_dir=str(world.tmp / "ct-lock"), deadline=time.monotonic() + 30)
    assert not failed and result["shm_skipped"] == [], (msg, result)
    assert [e["path"].rsplit("/", 1)[1] for e in result["shm_removed"]] == ["nccl-leak"], result
    assert names(ct_shm) == ["nccl-from-outside"]
