# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Find the processes that hold NVIDIA device nodes by reading /proc (private helper).

No AnsibleModule here: the same code can run in a container or on a node
against host pids. Facts it relies on are in GPU_FACTS.md rows 4, 5, 6 and 8.
The bounded reader and the stat reads live in _procread (issue 46); READER, the one reader every caller shares,
is here, and so are _procread's names that callers know as _procscan's.
"""

from __future__ import annotations

import errno
import os
import re
import stat as stat_mod
import threading

from ansible_collections.gpuops.fleet.plugins.module_utils._procread import (  # noqa: F401 pylint: disable=unused-import
    FD_TARGETS, KEEP_LINES, LISTING, MAPS_CAP, MM_LOCK_READ_RE, ONE_STAT, READ_TIMEOUT_S, WHOLE, BoundedReader, ReadBlocked, Truncated,
    _direct_read, ancestors, blocked_info, cap_for, is_descendant, is_truncated, parse_stat, read_stat, same_process,
    thread_details)

_GONE = (errno.ENOENT, errno.ESRCH)
DELETED = " (deleted)"
PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread (an empty maps file does not say so)
NVIDIA_MAJOR = 195       # /dev/nvidiaN is 195:N; 254 is nvidia-modeset, 255 nvidiactl
SOCKET_PREFIX = "socket:["
SHM_DIR = "/dev/shm/"
SHM_MARKER = SHM_DIR.encode()
BATCH = 128   # processes per batch of a scan: its requests stay well below a pipe's 64 KiB

READER = BoundedReader()   # the one bounded reader of this process (tests put their own here)


def list_folder(root, parts, timeout=None):
    """The folder reached from root through parts, read by READER (bounded: a hung mount never hangs this process),
    each part opened with O_NOFOLLOW: {"dev", "ino", "entries": [{name, mode, dev, ino, bytes, mtime, rdev}]}.
    OSError when it cannot be read (ELOOP or ENOTDIR: a part is a link or no folder, never followed); ReadBlocked
    when it did not answer within timeout (default: the reader's). root itself is followed (/proc/PID/root)."""
    answer = READER.read_many([(LISTING, root, tuple(p.encode() for p in parts) or None)], timeout=timeout)[0]
    if isinstance(answer, OSError):
        raise answer  # pylint: disable=raising-bad-type
    rows = answer[1].split(b"\0")
    dev, ino, uid, gid = (int(v) for v in rows[0].split())
    entries = []
    for row in rows[1:]:
        mode, edev, eino, size, mtime_ns, rdev, euid, egid, name = row.split(b" ", 8)
        entries.append({"name": os.fsdecode(name), "mode": int(mode), "dev": int(edev), "ino": int(eino),
                        "bytes": int(size), "mtime": int(mtime_ns) / 1e9, "rdev": int(rdev), "uid": int(euid),
                        "gid": int(egid)})
    return {"dev": dev, "ino": ino, "uid": uid, "gid": gid, "entries": sorted(entries, key=lambda e: e["name"])}


def read_bytes(path):
    """Read a whole (proc) file; raise OSError like open() does.

    Files that take the target's memory-map lock are read by READER, at most READ_TIMEOUT_S per process;
    ReadBlocked (an OSError) when that wait ran out.
    """
    if MM_LOCK_READ_RE.search(path):
        return READER.read(path)
    return _direct_read(path)


def read_text(path):
    return read_bytes(path).decode("utf-8", "replace")


def read_environ(pid, proc_root="/proc", keys=None):
    """{name: value} of a process's environment (only keys, when given); {} when it cannot be read."""
    try:
        raw = read_bytes("%s/%d/environ" % (proc_root, pid))
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        name = key.decode("utf-8", "replace")
        if sep and (keys is None or name in keys):
            out[name] = value.decode("utf-8", "replace")
    return out


class DeviceNames(object):
    """Recognises NVIDIA device paths under dev_dir (default /dev) by name.

    Which GPU a /dev/nvidiaN node is comes from gpu_minor(): its st_rdev when it
    is a character device (Proxmox may bind /dev/nvidia3 at /dev/nvidia0), its
    name only when it is not (the lab's regular files).
    """

    def __init__(self, dev_dir="/dev"):
        self.dev_dir = dev_dir.rstrip("/") or "/"
        prefix = re.escape(self.dev_dir.rstrip("/") + "/")
        self._re = re.compile(prefix + r"(?:nvidia(\d+)|(nvidiactl)|(nvidia-uvm(?:-tools)?)|(nvidia-caps/[^/\s]+)|(nvidia-modeset))$")
        self.marker = (self.dev_dir.rstrip("/") + "/nvidia").encode()

    def classify(self, path):
        """Return ('gpu', minor), ('ctl', None), ('uvm', None), ('caps', None), ('modeset', None) or None."""
        if path.endswith(DELETED):
            path = path[: -len(DELETED)]
        m = self._re.match(path)
        if not m:
            return None
        if m.group(1) is not None:
            return ("gpu", int(m.group(1)))
        if m.group(2):
            return ("ctl", None)
        if m.group(3):
            return ("uvm", None)
        if m.group(4):
            return ("caps", None)
        return ("modeset", None)

    def strip(self, path):
        return path[: -len(DELETED)] if path.endswith(DELETED) else path


def parse_status(text):
    """Parse /proc/PID/status into the fields used here."""
    out = {}
    for line in text.splitlines():
        key, dummy, value = line.partition(":")
        value = value.strip()
        if key == "Name":
            out["name"] = value
        elif key == "State":
            out["state"] = value.split(" ", 1)[0]
            out["state_text"] = value
        elif key in ("PPid", "Tgid", "Pid", "Threads"):
            out[key.lower()] = int(value)
        elif key == "Uid":
            out["uids"] = [int(v) for v in value.split()]
            out["uid"] = out["uids"][0]
        elif key == "NSpid":
            out["nspid"] = [int(v) for v in value.split()]
    return out


def parse_maps_counts(data, devices):
    """{device path: number of mapping lines} from /proc/PID/maps text (bytes or str), ' (deleted)' stripped."""
    if isinstance(data, bytes):
        if devices.marker not in data:
            return {}
        data = data.decode("utf-8", "replace")
    counts = {}
    for line in data.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            path = parts[5]
            if devices.classify(path):
                path = devices.strip(path)
                counts[path] = counts.get(path, 0) + 1
    return counts


def parse_maps_devices(data, devices):
    """Device paths named in /proc/PID/maps text (bytes or str), sorted, without ' (deleted)'."""
    return sorted(parse_maps_counts(data, devices))


def gpu_minor(path, devices, root="/", folders=None, timeout=None):
    """Minor of the GPU behind a /dev/nvidiaN path seen under root, or None for other nodes.

    A character device is identified by st_rdev, anything else (the lab) by its name. The device is read under
    root by READER (bounded; each folder on the way opened with O_NOFOLLOW, the device itself not followed: a link
    there is known by its name only). One that does not answer in time (a hung mount) is None: unknown, never
    guessed from its name. folders caches the answers by (root, path).
    """
    kind = devices.classify(path)
    if not kind or kind[0] != "gpu":
        return None
    key = (root, devices.strip(path))
    if folders is not None and key in folders:
        return folders[key]
    parts = tuple(p.encode() for p in devices.strip(path).split("/") if p)
    answer = READER.read_many([(ONE_STAT, root, parts)], timeout=timeout)[0]
    if isinstance(answer, ReadBlocked):
        minor = None
    elif isinstance(answer, OSError):
        minor = kind[1]
    else:
        mode, rdev = (int(v) for v in answer[1].split())
        minor = rdev_minor(rdev) if stat_mod.S_ISCHR(mode) else kind[1]
    if folders is not None:
        folders[key] = minor
    return minor


def rdev_gpu_minor(st):
    """N of a character device's st_rdev 195:N when it is a GPU (N < 254), else None."""
    return rdev_minor(st.st_rdev)


def rdev_minor(rdev):
    """N of a device number 195:N when it is a GPU (N < 254), else None."""
    if os.major(rdev) == NVIDIA_MAJOR and os.minor(rdev) < 254:
        return os.minor(rdev)
    return None


def parse_tcp_table(text):
    """Established TCP sockets of /proc/PID/net/tcp or tcp6 text: [(inode, local, remote)]."""
    out = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != "01":  # 01: ESTABLISHED
            continue
        try:
            inode = int(fields[9])
        except ValueError:
            continue
        if inode:
            out.append((inode, fields[1], fields[2]))
    return out


def namespace_inode(pid, kind, proc_root="/proc"):
    """Inode of /proc/PID/ns/KIND (pid may be "self"), or None. It answers while a read of the process's maps
    blocks (no memory-map lock is taken)."""
    try:
        return os.stat("%s/%s/ns/%s" % (proc_root, pid, kind)).st_ino
    except OSError:
        return None


def parse_cgroup(text):
    """The cgroup v2 path (`0::/path`), else the first hierarchy's path."""
    first = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            return parts[2]
        if first is None:
            first = parts[2]
    return first


class ProcEntry(object):
    """One process that has a device node open or mapped."""

    __slots__ = ("pid", "comm", "state", "ppid", "num_threads", "starttime", "pgrp", "session",
                 "fd_devices", "map_devices", "map_counts", "sockets", "via", "table_tid", "defunct_leader")

    def __init__(self, pid, stat):
        self.pid = pid
        self.comm = stat.get("comm") if stat else None
        self.state = stat.get("state") if stat else None
        self.ppid = stat.get("ppid") if stat else None
        self.num_threads = stat.get("num_threads") if stat else None
        self.starttime = stat.get("starttime") if stat else None
        self.pgrp = stat.get("pgrp") if stat else None
        self.session = stat.get("session") if stat else None
        self.fd_devices = []
        self.map_devices = []
        self.map_counts = {}     # device path -> mapping lines (3 for a context on this driver, row 12)
        self.sockets = []        # socket inodes among its fds
        self.via = []
        self.table_tid = pid
        self.defunct_leader = False

    @property
    def is_holder(self):
        """A process that maps a device node has a context (GPU_FACTS row 8)."""
        return bool(self.map_devices)


class ScanResult(object):
    def __init__(self):
        self.entries = {}        # pid -> ProcEntry (holders and clients)
        self.zombies = []        # dicts: pid, ppid, comm (one-thread zombies)
        self.unreadable = []     # pids whose tables could not be read
        self.blocked = []        # blocked_info() of those whose maps read did not finish in time, with fd_devices
        self.scanned = 0
        # the walk, shared by what else reads every process in the same snapshot (attribution, restart plan)
        self.stats = {}          # pid -> parse_stat() of every process read
        self.cgroups = {}        # pid -> cgroup path (None: unreadable), when the scan was asked for them
        self.shm_paths = {}      # pid -> /dev/shm paths it has open or mapped, when the scan was asked for them
        self.shm_files = {}      # pid -> {(st_dev, st_ino)} of the shared-memory files its maps name (see scan)


def _fd_devices(names, devices):
    """(device paths, socket link targets) among fd link targets."""
    found = set()
    sockets = []
    for target in names:
        if target.startswith(SOCKET_PREFIX):
            sockets.append(target)
        elif devices.classify(target):
            found.add(devices.strip(target))
    return sorted(found), sockets


def _read_fd_devices(fd_dir, devices):
    """readlink every entry of an fd directory; return (matching device paths, socket inodes), or None if gone."""
    try:
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    targets = []
    marker = devices.marker.decode()
    readlink = os.readlink
    try:
        for name in os.listdir(dir_fd):
            try:
                target = readlink(name, dir_fd=dir_fd)
            except OSError:
                continue
            if target.startswith(marker) or target.startswith(SOCKET_PREFIX):
                targets.append(target)
    finally:
        os.close(dir_fd)
    return _fd_devices(targets, devices)


def live_thread(proc_root, pid):
    """A thread id of pid that is not a zombie, or None."""
    try:
        tids = os.listdir("%s/%d/task" % (proc_root, pid))
    except OSError:
        return None
    for name in sorted(tids, key=int):
        tid = int(name)
        if tid == pid:
            continue
        try:
            stat = parse_stat(read_text("%s/%d/task/%d/stat" % (proc_root, pid, tid)))
        except (OSError, ValueError, IndexError):
            continue
        if stat["state"] not in ("Z", "X"):
            return tid
    return None


def scan(proc_root="/proc", devices=None, skip_pids=(), workers=None, cgroups=False, shm=False):
    """Scan every process once; return a ScanResult.

    Reads /proc/PID/maps (its device lines only) and /proc/PID/fd of each process through READER, in
    batches, with the bounded wait. For a defunct leader (state Z, more than one thread) it reads one
    live thread's tables instead, since threads share them (GPU_FACTS row 4). On big hosts a few
    threads, each with its own reader process, share the work. Every process's stat (and with
    cgroups, its cgroup path) is kept in the result for the rest of the snapshot. With shm (True, or the st_dev
    numbers of the /dev/shm folders read), the files each process has open or mapped there are kept too: the paths
    (shm_paths) and, from its maps, (st_dev, st_ino) of each file on /dev/shm or on one of those devices, whatever
    the path it was mapped by (shm_files).
    """
    devices = devices or DeviceNames()
    skip = set(skip_pids)
    pids = [int(name) for name in os.listdir(proc_root) if name.isdigit() and int(name) not in skip]
    if workers is None:
        workers = min(len(READER.lanes), os.cpu_count() or 1) if len(pids) > 500 else 1
    result = ScanResult()
    if workers <= 1:
        _scan_pids(proc_root, devices, pids, result, 0, cgroups, shm)
        return result
    parts = [ScanResult() for dummy in range(workers)]
    threads = [threading.Thread(target=_scan_pids, args=(proc_root, devices, pids[i::workers], parts[i], i, cgroups, shm))
               for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for part in parts:
        result.entries.update(part.entries)
        result.zombies.extend(part.zombies)
        result.unreadable.extend(part.unreadable)
        result.blocked.extend(part.blocked)
        result.scanned += part.scanned
        result.stats.update(part.stats)
        result.cgroups.update(part.cgroups)
        result.shm_paths.update(part.shm_paths)
        result.shm_files.update(part.shm_files)
    result.zombies.sort(key=lambda z: z["pid"])
    result.unreadable.sort()
    result.blocked.sort(key=lambda b: b["pid"])
    return result


def scan_pids(proc_root, devices, pids):
    """scan() of the given pids only."""
    result = ScanResult()
    _scan_pids(proc_root, devices, list(pids), result)
    return result


def _scan_pids(proc_root, devices, pids, result, lane=0, cgroups=False, shm=False):
    """Each batch: the stats read here (identity, kernel threads left out), then the maps and fd tables
    through one reader lane, then each process decided (and its start time checked again)."""
    devs = frozenset() if shm is None or isinstance(shm, bool) else frozenset(shm)
    marker = (devices.marker, SHM_MARKER) + shm_markers(devs) if shm not in (None, False) else devices.marker
    for first in range(0, len(pids), BATCH):
        batch = []
        for pid in pids[first:first + BATCH]:
            result.scanned += 1
            stat = read_stat(pid, proc_root)
            if stat is None:
                continue
            result.stats[pid] = stat
            if cgroups:
                result.cgroups[pid] = read_cgroup(pid, proc_root)
            if not stat["flags"] & PF_KTHREAD:
                batch.append((pid, stat))
        requests = []
        for pid, dummy in batch:
            base = "%s/%d" % (proc_root, pid)
            requests += [(KEEP_LINES, base + "/maps", marker), (FD_TARGETS, base + "/fd", marker)]
        answers = READER.read_many(requests, lane)
        for n, (pid, stat) in enumerate(batch):
            _take(proc_root, devices, pid, stat, answers[2 * n], answers[2 * n + 1], result, devs)


def _fd_read(answer, devices, shm_paths, shm_files=None):
    """(device paths, socket targets) from an fd answer, adding /dev/shm targets to shm_paths (and the open files'
    (st_dev, st_ino) to shm_files); None when the process is gone; () when unreadable."""
    if isinstance(answer, OSError):
        return None if answer.errno in _GONE else ()
    targets = []
    for raw in answer[1].split(b"\0") if answer[1] else ():
        target, dummy, identity = os.fsdecode(raw).partition("\x01")
        targets.append(target)
        if target.startswith(SHM_DIR):
            shm_paths.add(target)
            if identity and shm_files is not None:
                dev, ino = identity.split()
                shm_files.add((int(dev), int(ino)))
    return _fd_devices(targets, devices)


def _take(proc_root, devices, pid, stat, maps_answer, fd_answer, result, shm_devs=frozenset()):
    """Add pid to result from its maps and fd answers: (size, kept data) or the OSError."""
    tables = _maps_of(proc_root, devices, pid, stat, maps_answer, result)
    if tables is None:
        return
    size, maps = tables
    table_tid, defunct = pid, False
    if not size:
        # a zombie, a defunct leader, one exiting, or unreadable; read again, since the leader may have just exited
        stat = read_stat(pid, proc_root)
        if stat is None:
            return
        if stat["state"] == "Z":
            leader = _defunct_leader_tables(proc_root, devices, pid, stat, result)
            if leader is None:
                return
            table_tid, maps, fd_answer = leader
            defunct = True
        elif maps is None:
            result.unreadable.append(pid)
        # else a user process without mappings (one exiting, say): its open files still count
    fd_read = _fd_and_shm(pid, maps, fd_answer, devices, result, shm_devs)
    if fd_read is None:
        return
    fds, sockets = fd_read
    map_counts = parse_maps_counts(maps, devices) if maps else {}
    if not map_counts and not fds:
        return
    if not same_process(pid, stat["starttime"], proc_root):
        return  # gone, or the pid was reused while its tables were read
    entry = ProcEntry(pid, stat)
    entry.fd_devices = fds
    entry.map_devices = sorted(map_counts)
    entry.map_counts = map_counts
    entry.sockets = [int(s[len(SOCKET_PREFIX):-1]) for s in sockets if s.endswith("]")]
    entry.table_tid = table_tid
    entry.defunct_leader = defunct
    entry.via = ["task"] if defunct else ([u"fd"] if fds else []) + ([u"mmap"] if entry.map_devices else [])
    result.entries[pid] = entry


def _maps_of(proc_root, devices, pid, stat, maps_answer, result):
    """(size, kept maps lines or None when unreadable) of a maps answer; None when pid is done with: gone, blocked or
    truncated (the last two added to result)."""
    if isinstance(maps_answer, ReadBlocked):
        _add_blocked(result, proc_root, devices, pid, "%s/%d/fd" % (proc_root, pid))
        return None
    if isinstance(maps_answer, OSError):
        return None if maps_answer.errno in _GONE else (0, None)
    if is_truncated(maps_answer[1]):
        _add_truncated(result, pid, stat, "%s/%d/maps" % (proc_root, pid))
        return None
    return maps_answer


def _defunct_leader_tables(proc_root, devices, pid, stat, result):
    """(tid, maps, fd answer) of a live thread of the zombie pid, whose tables its threads share (GPU_FACTS row 4);
    None when there is none to read (a one-thread zombie is added to result's zombies), or when it blocked or was
    truncated (added to result)."""
    if stat["num_threads"] <= 1:
        result.zombies.append({"pid": pid, "ppid": stat["ppid"], "comm": stat["comm"]})
        return None
    tid = live_thread(proc_root, pid)
    if tid is None:
        return None
    table_base = "%s/%d/task/%d" % (proc_root, pid, tid)
    try:
        maps = READER.read(table_base + "/maps")
    except ReadBlocked:
        _add_blocked(result, proc_root, devices, pid, table_base + "/fd")
        return None
    except OSError:
        maps = None
    if is_truncated(maps):
        _add_truncated(result, pid, stat, table_base + "/maps")
        return None
    return tid, maps, READER.read_many([(FD_TARGETS, table_base + "/fd", devices.marker)])[0]


def _fd_and_shm(pid, maps, fd_answer, devices, result, shm_devs):
    """(device paths, socket targets) of pid's fd answer, ([], []) when unreadable (pid added to result's unreadable);
    None when pid is gone. The /dev/shm files it has open or mapped go to result's shm_paths and shm_files."""
    shm_paths, shm_files = _shm_maps(maps, shm_devs)
    fd_read = _fd_read(fd_answer, devices, shm_paths, shm_files)
    if fd_read is None:
        return None
    if shm_paths:
        result.shm_paths[pid] = shm_paths
    if shm_files:
        result.shm_files[pid] = shm_files
    if not fd_read:
        fd_read = ([], [])
        if pid not in result.unreadable:
            result.unreadable.append(pid)
    return fd_read


def shm_markers(devs):
    """The maps-line markers of files on the devices devs (st_dev numbers): the kernel writes a mapping's device
    as " MAJOR:MINOR " in hex, two digits at least."""
    return tuple(b" %02x:%02x " % (os.major(dev), os.minor(dev)) for dev in sorted(devs or ()))


def _maps_dev(field):
    """st_dev of a maps line's MAJOR:MINOR field (hex), or None."""
    major, sep, minor = field.partition(":")
    try:
        return os.makedev(int(major, 16), int(minor, 16)) if sep else None
    except ValueError:
        return None


def _shm_maps(maps, devs):
    """(paths under /dev/shm, {(st_dev, st_ino)} of each file mapped there or on one of devs) from kept maps lines."""
    paths, files = set(), set()
    if not maps or (SHM_MARKER not in maps and not devs):
        return paths, files
    for line in maps.decode("utf-8", "replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or parts[4] == "0":
            continue
        dev = _maps_dev(parts[3])
        on_shm = len(parts) == 6 and parts[5].startswith(SHM_DIR)
        if on_shm:
            paths.add(parts[5])
        if dev is not None and parts[4].isdigit() and (on_shm or dev in devs):
            files.add((dev, int(parts[4])))
    return paths, files


def _add_blocked(result, proc_root, devices, pid, fd_dir):
    """A process whose maps could not be read in time: unreadable, blocked, with the device nodes it has open."""
    info = dict(READER.blocked.get((proc_root.rstrip("/"), pid)) or blocked_info(pid, proc_root, fd_dir, READER.timeout))
    try:
        fd_read = _read_fd_devices(fd_dir, devices)
    except OSError:
        fd_read = None
    info["fd_devices"] = fd_read[0] if fd_read else None
    result.blocked.append(info)
    result.unreadable.append(pid)


def _add_truncated(result, pid, stat, path):
    """A process whose maps had more than its cap: unreadable, truncated; what was cut may map any GPU, so it may hold
    every one (never "holds nothing") and is never signalled on a part of its maps."""
    result.blocked.append({"pid": pid, "name": stat["comm"], "starttime": stat["starttime"], "reason": "truncated",
                           "path": path, "cap_bytes": cap_for(path), "waited_s": None, "state": stat["state"],
                           "wchan": None, "thread_states": {}, "blocked_threads": [], "fd_devices": None})
    result.unreadable.append(pid)


def read_cgroup(pid, proc_root="/proc"):
    """parse_cgroup of a live pid, or None when it cannot be read (or had more than its cap: unknown)."""
    try:
        raw = _direct_read("%s/%d/cgroup" % (proc_root, pid))
    except OSError:
        return None
    return None if is_truncated(raw) else parse_cgroup(raw.decode("utf-8", "replace"))
