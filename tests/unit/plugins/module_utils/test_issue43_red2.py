"""Issue 43, second red team: what the da76bf1 fixes left open.

Worlds: the project's fakes for /proc, and real mounts. A world that needs a mount at /dev/shm itself is made in a
forked child that has its own mount namespace (unshare, every mount private, a tmpfs over /dev/shm there): the real
/dev/shm is never touched, and every mount goes with the child.
"""
import ctypes
import json
import os
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._procscan import DeviceNames

from conftest import CTL, UVM

LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x20000, 16384, 1 << 18
DEVS = DeviceNames("/dev")
GPU0 = ["/dev/nvidia0", CTL, UVM]


def _mount(source, target, fstype, flags, data):
    if LIBC.mount(source, target, fstype, flags, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def in_private_dev_shm(body):
    """body() run in a forked child whose mount namespace is its own: /dev/shm there is a fresh tmpfs, and
    /dev/shm/hung a FUSE mount whose daemon never answers. body's answer (JSON) comes back; the child's mounts
    end with it (its /dev/fuse closed aborts the connection)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns into pytest
        code = 1
        try:
            os.close(rd)
            if LIBC.unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            _mount(None, b"/", None, MS_REC | MS_PRIVATE, None)
            _mount(b"gpuops-red2", b"/dev/shm", b"tmpfs", 0, b"mode=1777,size=1m")
            os.mkdir("/dev/shm/hung")
            fuse = os.open("/dev/fuse", os.O_RDWR)
            _mount(b"gpuops-hang", b"/dev/shm/hung", b"fuse.gpuops-hang", 0,
                   ("fd=%d,rootmode=40000,user_id=0,group_id=0" % fuse).encode())
            try:
                answer = body()
            finally:
                os.close(fuse)
            os.write(wr, json.dumps(answer).encode())
            code = 0
        except BaseException as exc:  # pylint: disable=broad-except
            os.write(wr, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(wr)
    chunks = []
    while True:
        chunk = os.read(rd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(rd)
    os.waitpid(pid, 0)
    answer = json.loads(b"".join(chunks).decode())
    assert "error" not in answer, answer
    return answer


def test_red2_1_a_shm_scan_loses_a_gpu_holders_fds_to_a_hung_mount_under_dev_shm(proc):
    """The F op now stats each /dev/shm/ fd target (follows the fd link into its file system). A process with an
    fd on a FUSE mount at /dev/shm/hung (a container can make one in its own namespace) whose daemon hangs blocks
    that stat: before da76bf1 the F op (readlink only) never blocked. In a scan with shm (gpu_info shm_residue,
    gpu_release clean_shm) each such holder costs a whole read timeout, every scan (an fd read is never remembered
    as blocked), and its fd table is lost: its /dev/nvidia fds vanish and it is only 'unreadable'."""
    for pid in range(10, 18):
        proc.add(pid, maps=GPU0, fds=GPU0 + ["/dev/shm/hung/seg"])

    def body():
        procscan.READER = procscan.BoundedReader(timeout=0.5)
        try:
            out = {}
            for shm in (False, True):
                started = time.monotonic()
                result = procscan.scan(proc.root, DEVS, shm=shm)
                out[str(shm)] = {"s": time.monotonic() - started, "unreadable": result.unreadable,
                                 "fds": result.entries[10].fd_devices if 10 in result.entries else None}
            return out
        finally:
            procscan.READER.close()

    out = in_private_dev_shm(body)
    plain, with_shm = out["False"], out["True"]
    assert plain["fds"] == sorted(GPU0) and plain["unreadable"] == [] and plain["s"] < 0.5, plain
    assert with_shm["fds"] == sorted(GPU0) and with_shm["unreadable"] == [], with_shm
    assert with_shm["s"] < 0.5, with_shm


def test_red2_2_a_hung_mount_in_a_containers_dev_makes_its_gpu_known_by_name_not_by_device(tmp_path, monkeypatch):
    """Proxmox may bind the node's /dev/nvidia3 at a container's /dev/nvidia0: a holder's GPU is the device's
    minor (st_rdev), read by listing the container's /dev (the S op stats every entry). One mount point in that
    /dev whose file system hangs (a FUSE mount the container made) blocks the whole listing, and gpu_minor then
    falls back silently to the name: the holder of GPU 3 is taken for GPU 0's (a release of GPU 0 signals it, one
    of GPU 3 misses it). A /dev that cannot be read must leave the minor unknown, never guessed from a name."""
    import stat as stat_mod
    fresh = procscan.BoundedReader(timeout=0.5)
    monkeypatch.setattr(procscan, "READER", fresh)
    dev = tmp_path / "ct101" / "dev"
    os.makedirs(str(dev / "hung"))
    os.mknod(str(dev / "nvidia0"), stat_mod.S_IFCHR | 0o600, os.makedev(195, 3))
    root = str(tmp_path / "ct101")
    try:
        assert procscan.gpu_minor("/dev/nvidia0", DEVS, root, {}, 0.5) == 3
        fuse = os.open("/dev/fuse", os.O_RDWR)
        try:
            _mount(b"gpuops-hang", str(dev / "hung").encode(), b"fuse.gpuops-hang", 0,
                   ("fd=%d,rootmode=40000,user_id=0,group_id=0" % fuse).encode())
            try:
                minor = procscan.gpu_minor("/dev/nvidia0", DEVS, root, {}, 0.5)
            finally:
                LIBC.umount2(str(dev / "hung").encode(), 2)
        finally:
            os.close(fuse)
    finally:
        fresh.close()
    assert minor in (3, None), "GPU minor by name (%r) when the container's /dev could not be read" % minor


# /proc/self/mountinfo of an unprivileged Debian 12 container on Proxmox VE (systemd as init: / made rshared, a
# tmpfs mounted on /dev/shm by systemd); its rootfs is the node's ZFS subvolume, a slave of the node's mount
MOUNTINFO_SYSTEMD_CT = (
    "1211 1210 0:112 / / rw,relatime shared:600 master:1 - zfs rpool/data/subvol-101-disk-0 rw,xattr,posixacl\n"
    "1212 1211 0:114 / /dev rw,relatime shared:601 - tmpfs none rw,size=492k,mode=755,uid=100000,gid=100000\n"
    "1220 1212 0:5 /nvidia0 /dev/nvidia0 rw,nosuid shared:610 master:2 - devtmpfs udev rw,size=10k,mode=755\n"
    "1230 1212 0:120 / /dev/shm rw,nosuid,nodev shared:620 - tmpfs tmpfs rw,uid=100000,gid=100000,inode64\n"
    "1231 1212 0:121 / /dev/shm\\040x rw shared:621 - tmpfs tmpfs rw\n")


def test_red2_3_a_file_of_the_containers_own_nobody_makes_its_whole_dev_shm_skipped():
    """Proxmox maps a container's uids 0-65535, nobody (65534) and nogroup among them: inside the container a file
    of its own nobody shows the same uid as a file of an owner it does not map (the overflow uid, 65534). One such
    file anywhere in /dev/shm (a service running as nobody, any name) makes foreign_why skip the whole folder, so an
    NCCL segment left by a dead job is never cleaned, on an ordinary container (own tmpfs, root /, no master:)."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
    mount = shm.mount_of("/dev/shm", MOUNTINFO_SYSTEMD_CT)
    assert mount == {"mount_point": "/dev/shm", "root": "/", "optional": ["shared:620"], "fstype": "tmpfs"}
    place = {"uid": 0, "gid": 0, "entries": [
        {"name": "nccl-shm-dead", "uid": 0, "gid": 0},
        {"name": "svc-cache", "uid": 65534, "gid": 65534}]}     # the container's own nobody:nogroup
    assert shm.foreign_why(dict(place, entries=place["entries"][:1]), (65534, 65534), mount) is None
    assert shm.foreign_why(place, (65534, 65534), mount) is None


def test_an_fd_only_user_is_found_by_its_open_files_identity_from_procfs_alone():
    """The fix of the first: an fd's open file is identified by fdinfo's mnt_id and ino and mountinfo's device of
    that mount (procfs only, the file's own file system never asked): the identity os.fstat gives."""
    def body():
        procscan.READER = procscan.BoundedReader(timeout=0.5)
        held = os.open("/dev/shm/nccl-held", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            started = time.monotonic()
            answer = procscan.READER.read_many([(procscan.FD_TARGETS, "/proc/%d/fd" % os.getpid(),
                                                 (procscan.SHM_MARKER,))])[0]
            paths, files = set(), set()
            procscan._fd_read(answer, DEVS, paths, files)   # pylint: disable=protected-access
            st = os.fstat(held)
            return {"s": time.monotonic() - started, "paths": sorted(paths), "files": sorted(files),
                    "fstat": [st.st_dev, st.st_ino]}
        finally:
            os.close(held)
            procscan.READER.close()

    out = in_private_dev_shm(body)
    assert out["paths"] == ["/dev/shm/nccl-held"] and out["files"] == [out["fstat"]], out
    assert out["s"] < 0.5, out
