# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Find the processes that hold NVIDIA device nodes by reading /proc (private helper).

No AnsibleModule here: the same code can run in a container or on a node
against host pids. Facts it relies on are in GPU_FACTS.md rows 4, 5, 6 and 8.
"""

from __future__ import annotations

import errno
import os
import re
import select
import stat as stat_mod
import struct
import threading
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc

_GONE = (errno.ENOENT, errno.ESRCH)
DELETED = " (deleted)"
PF_KTHREAD = 0x00200000  # /proc/PID/stat flags: a kernel thread (an empty maps file does not say so)
NVIDIA_MAJOR = 195       # /dev/nvidiaN is 195:N; 254 is nvidia-modeset, 255 nvidiactl
SOCKET_PREFIX = "socket:["
SHM_DIR = "/dev/shm/"
SHM_MARKER = SHM_DIR.encode()


READ_TIMEOUT_S = 3.0
# Bytes read at most per file (issue 41): a process can point its cmdline or environ at gigabytes of memory of its own
# (PR_SET_MM_MAP), and a reader without a cap spends seconds and its memory on each. What is cut is said (Truncated).
ARGS_CAP = 1 << 20           # cmdline, environ
MAPS_CAP = 16 << 20          # maps: 65530 mappings of usual paths fit many times
DEFAULT_CAP = 1 << 20        # stat, status, cgroup, wchan, stack ...
CAPS = {"cmdline": ARGS_CAP, "environ": ARGS_CAP, "maps": MAPS_CAP, "tcp": MAPS_CAP, "tcp6": MAPS_CAP}
# Reads that take the target's memory-map lock (maps, and cmdline/environ through its memory): a process stuck in
# the kernel can hold that lock, or make readers queue behind it, forever, and no signal ends the read.
MM_LOCK_READ_RE = re.compile(r"/(\d+)/(?:task/\d+/)?(?:maps|cmdline|environ)$")
_HEADER = struct.Struct("<IiIII")  # request id, errno (0: read), size (bytes, or fd entries), length of the data, 1: cut
WHOLE, KEEP_LINES, FD_TARGETS, LISTING, ONE_STAT = "R", "M", "F", "S", "T"
BATCH = 128   # processes per batch of a scan: its requests stay well below a pipe's 64 KiB

# Runs in the reader process: "ID OP KEEP CAP PATH" per line on stdin (KEEP: markers joined by NUL, in hex, or -; CAP:
# the bytes read at most), a header and the data (or the errno) per request on stdout, the header saying whether the
# file had more than CAP. R: the file (its first CAP bytes); M: its lines that hold a marker;
# F: the targets of an fd directory's links that start with a marker or socket:[, NUL-separated; S: the folder reached
# from PATH through the names in KEEP, each opened with O_NOFOLLOW (a link on the way is ELOOP or ENOTDIR, never
# followed), as "DEV INO UID GID" and one "MODE DEV INO SIZE MTIME_NS RDEV UID GID NAME" per entry, NUL-separated;
# an F target under /dev/shm/ carries "\x01DEV INO" of the open file (from fdinfo and mountinfo, procfs only); T: the
# mode and device number of the last name in KEEP, the folders before it opened with O_NOFOLLOW, itself not followed,
# as "MODE RDEV". An OP ending
# in "." ends a batch, whose answers are flushed then; a read that has taken over 50 ms has the answers before
# it flushed by a watchdog thread, so a missing answer is always the one being read.
READER_SOURCE = r"""
import os, struct, sys, threading, time
header = struct.Struct("<IiIII")
out = sys.stdout.buffer
reading_since = [0.0]
def watchdog():
    while True:
        time.sleep(0.05)
        since = reading_since[0]
        if since and time.monotonic() - since > 0.05:
            out.flush()
threading.Thread(target=watchdog, daemon=True).start()
def whole(path, cap):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(65536, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
        return data[:cap], len(data) > cap
    finally:
        os.close(fd)
def fd_identity(path, name, mounts):
    # b"\x01DEV INO" of an open file from procfs alone (fdinfo's mnt_id and ino, mountinfo's device of that mount):
    # never a stat through the fd link, which would ask the file's own file system (a hung FUSE mount blocks it)
    base = path.rstrip(b"/")[:-2]
    try:
        with open(base + b"fdinfo/" + name, "rb") as f:
            info = dict(l.split(b":", 1) for l in f.read().split(b"\n") if b":" in l)
        if not mounts:
            with open(base + b"mountinfo", "rb") as f:
                mounts.update((l.split(b" ")[0], l.split(b" ")[2]) for l in f.read().split(b"\n") if l.count(b" ") > 2)
        major, minor = mounts[info[b"mnt_id"].strip()].split(b":")
        return b"\x01%d %d" % (os.makedev(int(major), int(minor)), int(info[b"ino"].strip()))
    except (OSError, KeyError, ValueError):
        return b""
def fd_targets(path, keep):
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = os.listdir(path)
        kept, mounts = [], {}
        readlink = os.readlink
        for name in names:
            try:
                target = readlink(name, dir_fd=dir_fd)
            except OSError:
                continue
            if target.startswith(keep) or target.startswith(b"socket:["):
                if target.startswith(b"/dev/shm/"):
                    target += fd_identity(path, name, mounts)
                kept.append(target)
        return len(names), b"\0".join(kept)
    finally:
        os.close(dir_fd)
def walk(path, parts):
    # the folder reached from path through parts, each opened with O_NOFOLLOW (path itself is followed)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts or ():
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd
def listing(path, parts):
    fd = walk(path, parts)
    try:
        st = os.fstat(fd)
        names = os.listdir(fd)
        rows = [b"%d %d %d %d" % (st.st_dev, st.st_ino, st.st_uid, st.st_gid)]
        for name in names:
            try:
                e = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            rows.append(b"%d %d %d %d %d %d %d %d " % (e.st_mode, e.st_dev, e.st_ino, e.st_size, e.st_mtime_ns, e.st_rdev,
                                                     e.st_uid, e.st_gid) + os.fsencode(name))
        return len(names), b"\0".join(rows)
    finally:
        os.close(fd)
def one_stat(path, parts):
    fd = walk(path, parts[:-1])
    try:
        e = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        return 1, b"%d %d" % (e.st_mode, e.st_rdev)
    finally:
        os.close(fd)
keeps = {b"-": None}
for line in sys.stdin.buffer:
    request, op, keep, cap, path = line[:-1].split(b" ", 4)
    if keep not in keeps:
        keeps[keep] = tuple(bytes.fromhex(keep.decode()).split(b"\0"))
    keep = keeps[keep]
    reading_since[0] = time.monotonic()
    cut = 0
    try:
        if op[:1] == b"F":
            size, data = fd_targets(path, keep)
        elif op[:1] == b"S":
            size, data = listing(path, keep)
        elif op[:1] == b"T":
            size, data = one_stat(path, keep)
        else:
            data, cut = whole(path, int(cap))
            size = len(data)
            if op[:1] == b"M":
                if any(k in data for k in keep):
                    data = b"\n".join(l for l in data.split(b"\n") if any(k in l for k in keep))
                else:
                    data = b""
        code = 0
    except OSError as exc:
        code, size, data = exc.errno or 5, 0, b""
    reading_since[0] = 0.0
    out.write(header.pack(int(request), code, size, len(data), int(cut)))
    out.write(data)
    if op.endswith(b"."):
        out.flush()
"""


def _keep_arg(keep):
    """A request's KEEP: the hex of its markers (bytes, or a tuple of bytes) joined by NUL, or - for none."""
    if not keep:
        return b"-"
    return (b"\0".join(keep) if isinstance(keep, tuple) else keep).hex().encode()


class Truncated(bytes):
    """The first bytes of a file that had more than its cap (cap_for): what was cut is unknown, never empty."""
    truncated = True


def is_truncated(data):
    return bool(getattr(data, "truncated", False))


def cap_for(path):
    """The bytes read at most from a /proc file (by its name: cmdline, environ, maps ...)."""
    return CAPS.get(path.rstrip("/").rsplit("/", 1)[-1], DEFAULT_CAP)


class ReadBlocked(OSError):
    """A read of /proc/PID/... did not finish within the bounded wait: the process is `unreadable: blocked`."""

    def __init__(self, path, pid):
        OSError.__init__(self, errno.ETIMEDOUT, "reading %s blocked" % path)
        self.path = path
        self.pid = pid


def _direct_read(path):
    """The file's first cap_for(path) bytes (Truncated when it had more)."""
    cap = cap_for(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks, size = [], 0
        while size <= cap:
            chunk = os.read(fd, min(65536, cap + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return Truncated(data[:cap]) if len(data) > cap else data


class _HelperFailed(Exception):
    """The reader process died or broke its pipe before answering."""

    def __init__(self, reason):
        Exception.__init__(self, reason)
        self.reason = reason


class _Lane(object):
    """One reader process, used by one caller at a time."""

    def __init__(self):
        self.proc = None
        self.lock = threading.Lock()
        self.buffer = b""   # answers read ahead, from pos on
        self.pos = 0


class BoundedReader(object):
    """Reads files that may block in the kernel in helper processes, waiting at most `timeout` per file.

    A helper holds none of this process's files (not Ansible's pipes, not the GPU locks). Requests go in
    batches; each answer must come within `timeout` of the one before. When one does not, its helper is
    SIGKILLed and abandoned (it dies once the read returns), the pid is recorded in `blocked` with its
    state and wchan, later reads of that pid fail at once, and the rest of the batch goes to a new helper.
    `lanes` helpers serve that many callers at once (a scan's threads); lane 0 serves single reads.
    """

    def __init__(self, timeout=READ_TIMEOUT_S, lanes=4):
        self.timeout = timeout
        self.blocked = {}        # (proc_root, pid) -> {pid, starttime, path, reason, state, wchan, blocked_threads}
        self.lanes = [_Lane() for dummy in range(max(1, lanes))]
        self.started = 0
        self.requests = 0       # request ids: an answer names the request it answers
        self._ids = threading.Lock()

    def _abandon(self, lane):
        proc, lane.proc = lane.proc, None
        lane.buffer, lane.pos = b"", 0
        if proc is not None:
            helperproc.abandon(proc)

    def close(self):
        for lane in self.lanes:
            with lane.lock:
                self._abandon(lane)

    @staticmethod
    def _mm_key(path):
        found = MM_LOCK_READ_RE.search(path)
        return (path[:found.start()], int(found.group(1))) if found else None

    def read(self, path):
        """The file's bytes, read by a helper within `timeout`; ReadBlocked when that wait ran out, OSError
        (EIO) when two helpers in a row failed before answering: the read is never done unbounded here."""
        answer = self.read_many([(WHOLE, path, None)])[0]
        if isinstance(answer, OSError):
            raise answer  # pylint: disable=raising-bad-type
        return answer[1]

    def read_many(self, requests, lane=0, timeout=None):
        """[(size, data) or the OSError] for each (op, path, keep) request, in order, through one lane; each answer
        waited for at most timeout (default: the reader's)."""
        out = [None] * len(requests)
        todo = []
        for index, (dummy, path, dummy2) in enumerate(requests):
            key = self._mm_key(path)
            if key in self.blocked:
                out[index] = ReadBlocked(path, key[1])
            else:
                todo.append(index)
        lane = self.lanes[lane % len(self.lanes)]
        with lane.lock:
            failed_in_a_row = 0
            while todo:
                try:
                    answered, blocked = self._ask(lane, [requests[i] for i in todo], timeout or self.timeout)
                    failure = None
                except _HelperFailed as exc:
                    answered, blocked, failure = exc.answered, False, exc
                for index, answer in zip(todo, answered):
                    out[index] = answer
                failed_in_a_row = 0 if answered else failed_in_a_row + (failure is not None)
                todo = todo[len(answered):]
                if failure is not None and failed_in_a_row >= 2:
                    for index in todo:
                        out[index] = OSError(errno.EIO, "the /proc reader process failed twice (%s)" % failure.reason)
                    break
                if blocked:
                    path = requests[todo[0]][1]
                    key = self._mm_key(path)
                    if key is not None:
                        self.blocked[key] = blocked_info(key[1], key[0], path, timeout or self.timeout)
                    out[todo[0]] = ReadBlocked(path, key[1] if key else None)
                    todo = todo[1:]
        return out

    def _exactly(self, lane, count, end):
        """count bytes of the lane's answers (read ahead in big chunks), or None when end passes first."""
        while len(lane.buffer) - lane.pos < count:
            left = end - time.monotonic()
            fd = lane.proc.stdout.fileno()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, max(count, 1 << 16))
            if not chunk:
                raise OSError(errno.EIO, "the /proc reader process exited")
            lane.buffer = lane.buffer[lane.pos:] + chunk
            lane.pos = 0
        data = lane.buffer[lane.pos:lane.pos + count]
        lane.pos += count
        return data

    def _ask(self, lane, requests, timeout):
        """(answers of the first requests, in order, True when the next one did not come within timeout).
        An errno answer is an OSError in the list. A helper without every answer is abandoned, whatever
        ended the wait; _HelperFailed (with .answered) when it died or broke its pipe."""
        if lane.proc is None:
            lane.proc = helperproc.spawn(READER_SOURCE, python_flags=["-S"])
            with self._ids:
                self.started += 1
        with self._ids:
            first = self.requests + 1
            self.requests += len(requests)
        ids = [(first + n) & 0xFFFFFFFF for n in range(len(requests))]
        answered = []
        try:
            lane.proc.stdin.write(b"".join(
                b"%d %s%s %s %d %s\n" % (ids[n], op.encode(), b"." if n == len(requests) - 1 else b"",
                                         _keep_arg(keep), cap_for(path), path.encode())
                for n, (op, path, keep) in enumerate(requests)))
            lane.proc.stdin.flush()
            end = time.monotonic() + timeout
            while len(answered) < len(requests):
                head = self._exactly(lane, _HEADER.size, end)
                if head is None:
                    return answered, True
                answer_to, code, size, length, cut = _HEADER.unpack(head)
                data = self._exactly(lane, length, end) if length else b""
                if data is None:
                    return answered, True
                if answer_to != ids[len(answered)]:
                    continue  # an answer to an earlier request whose caller gave up: never this one's
                path = requests[len(answered)][1]
                answered.append(OSError(code, os.strerror(code), path) if code else (size, Truncated(data) if cut else data))
                end = time.monotonic() + timeout
        except (OSError, ValueError) as exc:
            failed = _HelperFailed(str(exc))
            failed.answered = answered
            raise failed
        finally:
            # A timeout, or anything raised between a request and its whole answer (a signal handler's
            # exception, say): an answer may still come, so this helper never serves again.
            if len(answered) < len(requests):
                self._abandon(lane)
        return answered, False

    def blocked_in(self, proc_root):
        """Blocked processes under proc_root that still exist (same start time), by pid."""
        out = []
        for (root, pid), info in sorted(self.blocked.items()):
            if root == proc_root.rstrip("/"):
                stat = read_stat(pid, proc_root)
                if stat is not None and stat["starttime"] == info["starttime"]:
                    out.append(info)
        return out


READER = BoundedReader()


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


def blocked_info(pid, proc_root, path, timeout):
    """What a process whose read blocked is doing: its state, wchan and D-state threads (these reads never block)."""
    stat = read_stat(pid, proc_root)
    wchan = None
    try:
        wchan = _direct_read("%s/%d/wchan" % (proc_root, pid)).decode("utf-8", "replace").strip() or None
    except OSError:
        pass
    counts, blocked = thread_details(pid, proc_root)
    return {"pid": pid, "name": stat["comm"] if stat else None, "starttime": stat["starttime"] if stat else None,
            "reason": "blocked", "path": path, "waited_s": timeout, "state": stat["state"] if stat else None,
            "wchan": wchan, "thread_states": counts, "blocked_threads": blocked}


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


def parse_stat(text):
    """Parse /proc/PID/stat (the comm may hold spaces and parentheses)."""
    head, dummy, tail = text.rpartition(")")
    pid_part, dummy, comm = head.partition(" (")
    fields = tail.split()
    # fields[0] is field 3 (state); starttime is field 22, num_threads field 20
    return {
        "pid": int(pid_part),
        "comm": comm,
        "state": fields[0],
        "ppid": int(fields[1]),
        "pgrp": int(fields[2]),
        "session": int(fields[3]),
        "tty_nr": int(fields[4]),     # 0: no controlling terminal
        "flags": int(fields[6]),
        "num_threads": int(fields[17]),
        "starttime": int(fields[19]),
    }


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
    if isinstance(maps_answer, ReadBlocked):
        _add_blocked(result, proc_root, devices, pid, "%s/%d/fd" % (proc_root, pid))
        return
    if isinstance(maps_answer, OSError):
        if maps_answer.errno in _GONE:
            return
        size, maps = 0, None
    else:
        size, maps = maps_answer
    if is_truncated(maps):
        _add_truncated(result, pid, stat, "%s/%d/maps" % (proc_root, pid))
        return
    table_tid = pid
    defunct = False
    if not size:
        # a zombie, a defunct leader, one exiting, or unreadable; read again, since the leader may have just exited
        stat = read_stat(pid, proc_root)
        if stat is None:
            return
        if stat["state"] == "Z":
            if stat["num_threads"] <= 1:
                result.zombies.append({"pid": pid, "ppid": stat["ppid"], "comm": stat["comm"]})
                return
            tid = live_thread(proc_root, pid)
            if tid is None:
                return
            defunct, table_tid = True, tid
            table_base = "%s/%d/task/%d" % (proc_root, pid, tid)
            try:
                maps = READER.read(table_base + "/maps")
            except ReadBlocked:
                _add_blocked(result, proc_root, devices, pid, table_base + "/fd")
                return
            except OSError:
                maps = None
            if is_truncated(maps):
                _add_truncated(result, pid, stat, table_base + "/maps")
                return
            fd_answer = READER.read_many([(FD_TARGETS, table_base + "/fd", devices.marker)])[0]
        elif maps is None:
            result.unreadable.append(pid)
        # else a user process without mappings (one exiting, say): its open files still count
    shm_paths, shm_files = _shm_maps(maps, shm_devs)
    fd_read = _fd_read(fd_answer, devices, shm_paths, shm_files)
    if fd_read is None:
        return
    if shm_paths:
        result.shm_paths[pid] = shm_paths
    if shm_files:
        result.shm_files[pid] = shm_files
    if not fd_read:
        fd_read = ([], [])
        if pid not in result.unreadable:
            result.unreadable.append(pid)
    fds, sockets = fd_read
    map_counts = parse_maps_counts(maps, devices) if maps else {}
    mapped = sorted(map_counts)
    if not mapped and not fds:
        return
    if not same_process(pid, stat["starttime"], proc_root):
        return  # gone, or the pid was reused while its tables were read
    entry = ProcEntry(pid, stat)
    entry.fd_devices = fds
    entry.map_devices = mapped
    entry.map_counts = map_counts
    entry.sockets = [int(s[len(SOCKET_PREFIX):-1]) for s in sockets if s.endswith("]")]
    entry.table_tid = table_tid
    entry.defunct_leader = defunct
    entry.via = ["task"] if defunct else ([u"fd"] if fds else []) + ([u"mmap"] if mapped else [])
    result.entries[pid] = entry


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


def read_stat(pid, proc_root="/proc"):
    """parse_stat of a live pid, or None when it is gone."""
    try:
        return parse_stat(read_text("%s/%d/stat" % (proc_root, pid)))
    except (OSError, ValueError, IndexError):
        return None


def read_cgroup(pid, proc_root="/proc"):
    """parse_cgroup of a live pid, or None when it cannot be read (or had more than its cap: unknown)."""
    try:
        raw = _direct_read("%s/%d/cgroup" % (proc_root, pid))
    except OSError:
        return None
    return None if is_truncated(raw) else parse_cgroup(raw.decode("utf-8", "replace"))


def same_process(pid, starttime, proc_root="/proc"):
    """True while pid still names the process that started at starttime (clock ticks)."""
    stat = read_stat(pid, proc_root)
    return stat is not None and stat["starttime"] == starttime


def ancestors(pid, proc_root="/proc"):
    """pids above pid (parent first) up to the namespace's top."""
    out = []
    seen = set()
    current = pid
    while True:
        stat = read_stat(current, proc_root)
        if stat is None:
            break
        parent = stat["ppid"]
        if parent <= 0 or parent in seen:
            break
        out.append(parent)
        seen.add(parent)
        current = parent
    return out


def is_descendant(pid, root, proc_root="/proc", cache=None):
    """True when root is an ancestor of pid."""
    cache = {} if cache is None else cache
    chain = []
    current = pid
    found = False
    for dummy in range(4096):
        if current in cache:
            found = cache[current]
            break
        stat = read_stat(current, proc_root)
        if stat is None or stat["ppid"] <= 0:
            break
        chain.append(current)
        if stat["ppid"] == root:
            found = True
            break
        current = stat["ppid"]
    for item in chain:
        cache[item] = found
    return found


def thread_details(pid, proc_root="/proc", with_stack=True):
    """States of the threads of pid: counts per state, and D-state threads with wchan and stack."""
    counts = {}
    blocked = []
    task_dir = "%s/%d/task" % (proc_root, pid)
    try:
        tids = sorted((int(t) for t in os.listdir(task_dir)))
    except OSError:
        return counts, blocked
    for tid in tids:
        stat = read_stat(tid, task_dir)
        if stat is None:
            continue
        state = stat["state"]
        counts[state] = counts.get(state, 0) + 1
        if state == "D":
            info = {"tid": tid, "comm": stat["comm"], "wchan": None, "stack": None}
            try:
                info["wchan"] = read_text("%s/%d/wchan" % (task_dir, tid)).strip() or None
            except OSError:
                pass
            if with_stack:
                try:
                    stack = read_text("%s/%d/stack" % (task_dir, tid)).strip()
                    info["stack"] = [line.strip() for line in stack.splitlines() if line.strip()] or None
                except OSError:
                    pass
            blocked.append(info)
    return counts, blocked
