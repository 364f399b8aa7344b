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


READ_TIMEOUT_S = 3.0
# Reads that take the target's memory-map lock (maps, and cmdline/environ through its memory): a process stuck in
# the kernel can hold that lock, or make readers queue behind it, forever, and no signal ends the read.
MM_LOCK_READ_RE = re.compile(r"/(\d+)/(?:task/\d+/)?(?:maps|cmdline|environ)$")
_HEADER = struct.Struct("<IiI")  # request id, errno (0: read), length of the data that follows

# Runs in the reader process: "ID PATH" per line on stdin, a header and the data (or the errno) on stdout.
READER_SOURCE = r"""
import os, struct, sys
header = struct.Struct("<IiI")
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    request, dummy, path = line.rstrip(b"\n").partition(b" ")
    request = int(request)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        out.write(header.pack(request, 0, len(data)) + data)
    except OSError as exc:
        out.write(header.pack(request, exc.errno or 5, 0))
    out.flush()
"""


class ReadBlocked(OSError):
    """A read of /proc/PID/... did not finish within the bounded wait: the process is `unreadable: blocked`."""

    def __init__(self, path, pid):
        OSError.__init__(self, errno.ETIMEDOUT, "reading %s blocked" % path)
        self.path = path
        self.pid = pid


def _direct_read(path):
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class _HelperFailed(Exception):
    """The reader process died or broke its pipe before answering."""

    def __init__(self, reason):
        Exception.__init__(self, reason)
        self.reason = reason


class BoundedReader(object):
    """Reads files that may block in the kernel in a helper process, waiting at most `timeout` per process.

    The helper holds none of this process's files (not Ansible's pipes, not the GPU locks). When a read
    does not answer in time the helper is SIGKILLed and abandoned (it dies once the read returns), the pid
    is recorded in `blocked` with its state and wchan, and later reads of that pid fail at once.
    """

    def __init__(self, timeout=READ_TIMEOUT_S):
        self.timeout = timeout
        self.blocked = {}        # (proc_root, pid) -> {pid, starttime, path, reason, state, wchan, blocked_threads}
        self._proc = None
        self._lock = threading.Lock()
        self.started = 0
        self.requests = 0       # request ids: an answer names the request it answers

    def _start(self):
        self._proc = helperproc.spawn(READER_SOURCE, python_flags=["-S"])
        self.started += 1

    def _abandon(self):
        proc, self._proc = self._proc, None
        if proc is not None:
            helperproc.abandon(proc)

    def close(self):
        with self._lock:
            self._abandon()

    def _exactly(self, count, end):
        fd = self._proc.stdout.fileno()
        data = b""
        while len(data) < count:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, min(count - len(data), 1 << 20))
            if not chunk:
                raise OSError(errno.EIO, "the /proc reader process exited")
            data += chunk
        return data

    def read(self, path):
        """The file's bytes, read by the helper within `timeout`. A helper that dies or breaks its pipe is
        replaced once; a second failure is an OSError (EIO): the read is never done unbounded here."""
        found = MM_LOCK_READ_RE.search(path)
        key = (path[:found.start()], int(found.group(1))) if found else None
        if key in self.blocked:
            raise ReadBlocked(path, key[1])
        with self._lock:
            for attempt in (1, 2):
                try:
                    data = self._ask(path)
                except _HelperFailed as exc:
                    if attempt == 2:
                        raise OSError(errno.EIO, "the /proc reader process failed twice (%s)" % exc.reason)
                    continue
                if data is not None:
                    return data
                break
        if key is not None:
            self.blocked[key] = blocked_info(key[1], key[0], path, self.timeout)
        raise ReadBlocked(path, key[1] if key else None)

    def _ask(self, path):
        """The helper's answer (bytes), or None when it did not come within timeout; an errno answer is
        raised as OSError. A helper without a whole answer is abandoned, whatever ended the wait."""
        if self._proc is None:
            self._start()
        answered = False
        self.requests = request = (self.requests + 1) & 0xFFFFFFFF
        try:
            self._proc.stdin.write(b"%d " % request + path.encode() + b"\n")
            self._proc.stdin.flush()
            end = time.monotonic() + self.timeout
            while True:
                head = self._exactly(_HEADER.size, end)
                if head is None:
                    return None
                answer_to, code, length = _HEADER.unpack(head)
                data = self._exactly(length, end) if length else b""
                if data is None:
                    return None
                if answer_to == request:
                    break
                # an answer to an earlier request whose caller gave up: never this one's
            answered = True
        except (OSError, ValueError) as exc:
            raise _HelperFailed(str(exc))
        finally:
            # A timeout, or anything raised between the request and its whole answer (a signal
            # handler's exception, say): the answer may still come, so this helper never serves again.
            if not answered:
                self._abandon()
        if code:
            raise OSError(code, os.strerror(code), path)
        return data

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
            out["uid"] = int(value.split()[0])
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


def gpu_minor(path, devices, root="/"):
    """Minor of the GPU behind a /dev/nvidiaN path seen under root, or None for other nodes.

    A character device is identified by st_rdev, anything else (the lab) by its name.
    """
    kind = devices.classify(path)
    if not kind or kind[0] != "gpu":
        return None
    try:
        st = os.stat(os.path.join(root, devices.strip(path).lstrip("/")))
    except OSError:
        return kind[1]
    if stat_mod.S_ISCHR(st.st_mode):
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        return minor if major == NVIDIA_MAJOR and minor < 254 else None
    return kind[1]


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
    """Inode of /proc/PID/ns/KIND, or None."""
    try:
        return os.stat("%s/%d/ns/%s" % (proc_root, pid, kind)).st_ino
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


def _read_fd_devices(fd_dir, devices):
    """readlink every entry of an fd directory; return (matching device paths, socket inodes), or None if gone."""
    try:
        dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    found = set()
    sockets = []
    marker = devices.marker.decode()
    readlink = os.readlink
    try:
        for name in os.listdir(dir_fd):
            try:
                target = readlink(name, dir_fd=dir_fd)
            except OSError:
                continue
            if target.startswith(marker):
                if devices.classify(target):
                    found.add(devices.strip(target))
            elif target.startswith(SOCKET_PREFIX):
                sockets.append(target)
    finally:
        os.close(dir_fd)
    return sorted(found), sockets


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


def scan(proc_root="/proc", devices=None, skip_pids=(), workers=None):
    """Scan every process once; return a ScanResult.

    Reads /proc/PID/maps and /proc/PID/fd of each process. For a defunct
    leader (state Z, more than one thread) it reads one live thread's tables
    instead, since threads share them (GPU_FACTS row 4). The reads are system
    calls that release the GIL, so a few threads share the work on big hosts.
    """
    devices = devices or DeviceNames()
    skip = set(skip_pids)
    pids = [int(name) for name in os.listdir(proc_root) if name.isdigit() and int(name) not in skip]
    if workers is None:
        workers = min(4, os.cpu_count() or 1) if len(pids) > 500 else 1
    result = ScanResult()
    if workers <= 1:
        _scan_pids(proc_root, devices, pids, result)
        return result
    parts = [ScanResult() for dummy in range(workers)]
    threads = [threading.Thread(target=_scan_pids, args=(proc_root, devices, pids[i::workers], parts[i]))
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
    result.zombies.sort(key=lambda z: z["pid"])
    result.unreadable.sort()
    result.blocked.sort(key=lambda b: b["pid"])
    return result


def scan_pids(proc_root, devices, pids):
    """scan() of the given pids only."""
    result = ScanResult()
    _scan_pids(proc_root, devices, list(pids), result)
    return result


def _scan_pids(proc_root, devices, pids, result):
    marker = devices.marker
    for pid in pids:
        name = str(pid)
        result.scanned += 1
        base = "%s/%s" % (proc_root, name)
        # identity: the start time read before the tables, and checked again after them
        try:
            stat = parse_stat(read_text(base + "/stat"))
        except (OSError, ValueError, IndexError):
            continue
        try:
            maps = read_bytes(base + "/maps")
        except ReadBlocked:
            _add_blocked(result, proc_root, devices, pid, base + "/fd")
            continue
        except OSError as exc:
            if exc.errno in _GONE:
                continue
            maps = None
        table_base = base
        table_tid = pid
        defunct = False
        if not maps:
            # kernel thread, zombie, defunct leader or unreadable; read again, since the leader may have just exited
            try:
                stat = parse_stat(read_text(base + "/stat"))
            except (OSError, ValueError, IndexError):
                continue
            if stat["state"] == "Z":
                if stat["num_threads"] <= 1:
                    result.zombies.append({"pid": pid, "ppid": stat["ppid"], "comm": stat["comm"]})
                    continue
                tid = live_thread(proc_root, pid)
                if tid is None:
                    continue
                defunct = True
                table_tid = tid
                table_base = "%s/task/%d" % (base, tid)
                try:
                    maps = read_bytes(table_base + "/maps")
                except ReadBlocked:
                    _add_blocked(result, proc_root, devices, pid, table_base + "/fd")
                    continue
                except OSError:
                    maps = None
            elif maps is None:
                result.unreadable.append(pid)
            elif stat["flags"] & PF_KTHREAD:
                continue
            # else a user process without mappings (one exiting, say): its open files still count
        map_counts = parse_maps_counts(maps, devices) if maps and marker in maps else {}
        mapped = sorted(map_counts)
        sockets = []
        try:
            fd_read = _read_fd_devices(table_base + "/fd", devices)
        except OSError:
            fd_read = ([], [])
            if pid not in result.unreadable:
                result.unreadable.append(pid)
        if fd_read is None:
            continue
        fds, sockets = fd_read
        if not mapped and not fds:
            continue
        if not same_process(pid, stat["starttime"], proc_root):
            continue  # gone, or the pid was reused while its tables were read
        entry = ProcEntry(pid, stat)
        entry.fd_devices = fds
        entry.map_devices = mapped
        entry.map_counts = map_counts
        entry.sockets = [int(s[len(SOCKET_PREFIX):-1]) for s in sockets if s.endswith("]")]
        entry.table_tid = table_tid
        entry.defunct_leader = defunct
        if defunct:
            entry.via = ["task"]
        else:
            entry.via = ([u"fd"] if fds else []) + ([u"mmap"] if mapped else [])
        result.entries[pid] = entry


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


def read_stat(pid, proc_root="/proc"):
    """parse_stat of a live pid, or None when it is gone."""
    try:
        return parse_stat(read_text("%s/%d/stat" % (proc_root, pid)))
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
