# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read /proc files without ever hanging this process (private helper, read layer; issues 12, 41 and 46).

The bounded reader (BoundedReader: its helper processes, their program READER_SOURCE, the caps on what is read),
and the direct reads of a process's stat that never block: its identity (pid and start time), its ancestry, the
states of its threads. _procscan holds the shared reader (_procscan.READER) and the scan; it re-exports these names.
No AnsibleModule here.
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import select
import struct
import threading
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc

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
    data = read_capped(path, cap)
    return data[:cap], len(data) > cap
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
    data = read_capped(path, cap)
    return Truncated(data[:cap]) if len(data) > cap else data


def reader_program():
    """The helper's program: READER_SOURCE with read_capped, the one copy of the capped read, before it."""
    return "import os\n" + inspect.getsource(read_capped) + READER_SOURCE


def read_capped(path, cap):
    """Up to cap + 1 bytes of path (one more than cap says that it was cut); the reader's helper runs this too."""
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
    return b"".join(chunks)


def _direct_text(path):
    """_direct_read of a file that takes no memory-map lock (stat, wchan, stack), decoded."""
    return _direct_read(path).decode("utf-8", "replace")


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
            lane.proc = helperproc.spawn(reader_program(), python_flags=["-S"])
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


def read_stat(pid, proc_root="/proc"):
    """parse_stat of a live pid, or None when it is gone."""
    try:
        return parse_stat(_direct_text("%s/%d/stat" % (proc_root, pid)))
    except (OSError, ValueError, IndexError):
        return None


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
                info["wchan"] = _direct_text("%s/%d/wchan" % (task_dir, tid)).strip() or None
            except OSError:
                pass
            if with_stack:
                try:
                    stack = _direct_text("%s/%d/stack" % (task_dir, tid)).strip()
                    info["stack"] = [line.strip() for line in stack.splitlines() if line.strip()] or None
                except OSError:
                    pass
            blocked.append(info)
    return counts, blocked
