# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The per-GPU locks of a release: this host's, and each scoped container's through a helper (private helper).

A release takes one flock file per targeted GPU (by UUID) in /run/lock/gpuops-fleet, so that two releases of one
GPU never run at once. From a node it also takes each scoped container's own (the files a release inside that
container takes), through /proc/INIT/root/run/lock/gpuops-fleet. That path is the container's (issue 43): a mount
there (FUSE, NFS) can hang any access for ever, and a link there must never send the node's root elsewhere. So a
helper process (HELPER_SOURCE) walks it one component at a time with O_NOFOLLOW, makes what is missing for the
container's root, opens the lock files and flocks them. The helper lives as long as the release and holds the
locks: this process never holds those descriptors, and its stdin closing (the release ending, or dying) ends
the helper and its locks. A helper that does not answer in time is SIGKILLed and abandoned (one stuck in the
kernel dies when its call returns): its container is left out, named with the path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import select
import stat as stat_mod
import subprocess
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where

OPEN_TIMEOUT_S = 5.0    # the helper's start, walk and opens (a hung mount shows here)
ANSWER_MARGIN_S = 1.0   # past the lock wait, for the helper's answer
EXIT_WAIT_S = 2.0       # for the helper to end (and its locks to go) once told


class LockTimeout(Exception):
    pass


LOCK_DIR = "/run/lock/gpuops-fleet"


class LockDirError(Exception):
    """The lock directory cannot be trusted (wrong owner or mode, a symlink, not a directory)."""


def secure_lock_dir(path):
    """Create path root-owned 0700 if missing; raise LockDirError if it is not exactly that (never follows a link)."""
    parent = os.path.dirname(path.rstrip("/")) or "/"
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o755)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat_mod.S_ISLNK(st.st_mode) or not stat_mod.S_ISDIR(st.st_mode):
        raise LockDirError("refusing the lock directory %s: it is %s, not a directory; remove it"
                           % (path, "a symbolic link" if stat_mod.S_ISLNK(st.st_mode) else "not a directory"))
    if st.st_uid != os.geteuid():
        raise LockDirError("refusing the lock directory %s: it belongs to uid %d, not to uid %d that runs this module"
                           % (path, st.st_uid, os.geteuid()))
    if st.st_mode & 0o077:
        raise LockDirError("refusing the lock directory %s: its mode is %04o, it must be 0700"
                           % (path, stat_mod.S_IMODE(st.st_mode)))


def lock_name(key):
    return "gpuops-fleet-gpu-%s.lock" % re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))


class GpuLocks(object):
    """Per-GPU flock files under lock_dir (this host's own), taken in a fixed order (by UUID).

    `held` ({(st_dev, st_ino): path}, shared by every lock set of one release) names the files this
    release has locked already. A lock file that is one of them (a container whose /run/lock is the
    node's, two containers sharing one lock directory) is taken once: its second fd is closed, never
    flocked, since flock on a second open file description of one file conflicts even in one process.
    """

    def __init__(self, lock_dir=LOCK_DIR, held=None):
        self.lock_dir = lock_dir
        self.fds = []
        self.waited_s = 0.0
        self.held = held if held is not None else {}
        self.taken = []     # identities this object flocked (and put into held)
        self.aliases = []   # (path, path of the file already held) skipped as the same file

    def path(self, key):
        return os.path.join(self.lock_dir, lock_name(key))

    def _open(self, key):
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            return os.open(self.path(key), flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise LockDirError("refusing the lock file %s: it is a symbolic link" % self.path(key))
            raise

    def acquire(self, keys, timeout, clock=time.monotonic):
        secure_lock_dir(self.lock_dir)
        start = clock()
        end = start + timeout
        for key in sorted(set(keys)):
            fd = self._open(key)
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                self.release()
                raise
            identity = (st.st_dev, st.st_ino)
            if identity in self.held:  # this very file is locked by this release already (fstat of the open fd)
                os.close(fd)
                self.aliases.append((self.path(key), self.held[identity]))
                continue
            self.fds.append(fd)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if clock() >= end:
                    self.release()
                    raise LockTimeout("another gpu_release holds the lock on GPU %s (%s) for more than %gs"
                                      % (key, self.path(key), timeout))
                time.sleep(0.05)
            self.held[identity] = self.path(key)
            self.taken.append(identity)
        self.waited_s = clock() - start

    def lost_words(self):
        """None always: this process holds its own locks' descriptors (ContainerLocks.lost_words)."""
        return None

    def release(self):
        for identity in self.taken:
            self.held.pop(identity, None)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.taken = [], []


# Runs in the helper: argv[1] is the job (JSON: root, parts, uid, gid, names, held, wait_s). It says, one JSON line
# each: {"opened": n} once the lock files are open, then {"locked": [[name, dev, ino]], "aliases": [...]} or
# {"busy": name} or {"refused": why} or {"error": why}; then it holds the locks until its stdin closes.
HELPER_SOURCE = r"""
import ctypes, errno, fcntl, json, os, stat, sys, time
job = json.loads(sys.argv[1])
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
class Refused(Exception):
    pass
def as_owner(call):
    # a filesystem of the container's user namespace (its /run tmpfs) refuses to create a file for an owner it
    # cannot map (the node's root): EOVERFLOW; then create it as the container's root (this thread's fs ids)
    try:
        return call()
    except OSError as exc:
        if exc.errno != errno.EOVERFLOW:
            raise
    libc = ctypes.CDLL(None, use_errno=True)
    old_gid, old_uid = libc.setfsgid(job["gid"]), libc.setfsuid(job["uid"])
    try:
        return call()
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)
def walk():
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(job["root"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for i, part in enumerate(job["parts"]):
        last = i == len(job["parts"]) - 1
        try:
            as_owner(lambda: os.mkdir(part, 0o700 if last else 0o755, dir_fd=fd))
            os.chown(part, job["uid"], job["gid"], dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            pass
        try:
            child = os.open(part, flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Refused("%s is not a directory (or is a link)" % part)
            raise
        os.close(fd)
        fd = child
    st = os.fstat(fd)
    if st.st_uid != job["uid"] or stat.S_IMODE(st.st_mode) & 0o077:
        raise Refused("owner uid %d mode %04o, expected uid %d mode 0700" % (st.st_uid, stat.S_IMODE(st.st_mode), job["uid"]))
    return fd
def open_all(dir_fd):
    held = set(tuple(i) for i in job["held"])
    files, aliases = [], []
    for name in job["names"]:
        try:
            fd = as_owner(lambda: os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused("the lock file %s is a symbolic link" % name)
            raise
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in held:
            os.close(fd)
            aliases.append([name, st.st_dev, st.st_ino])
            continue
        os.fchown(fd, job["uid"], job["gid"])
        held.add((st.st_dev, st.st_ino))
        files.append((name, fd, st))
    return files, aliases
def lock_all(files):
    end = time.monotonic() + job["wait_s"]
    for name, fd, st in files:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= end:
                return name
            time.sleep(0.05)
    return None
try:
    files, aliases = open_all(walk())
    say(opened=len(files))
    busy = lock_all(files)
    if busy:
        say(busy=busy)
        sys.exit(0)
    say(locked=[[name, st.st_dev, st.st_ino] for name, fd, st in files], aliases=aliases)
except Refused as exc:
    say(refused=str(exc))
    sys.exit(0)
except OSError as exc:
    say(error="%s%s" % (exc.strerror or exc, " (%s)" % exc.filename if exc.filename else ""))
    sys.exit(0)
sys.stdin.buffer.read()
"""


class HelperLocks(object):
    """The GPU locks in a folder under another root (a container's, through /proc/INIT/root), taken and held by a
    helper process (HELPER_SOURCE) for as long as this object is not released. Never held by this process."""

    def __init__(self, root, parts, uid, gid, held=None):
        self.root, self.parts, self.uid, self.gid = root, list(parts), uid, gid
        self.lock_dir = root.rstrip("/") + "/" + "/".join(self.parts)
        self.held = held if held is not None else {}
        self.taken = []     # identities the helper flocked (and put into held)
        self._locked = []   # the lock files it holds, by path
        self.aliases = []   # (path, path of the file already held) skipped as the same file
        self.proc = None

    @property
    def locked(self):
        """The lock files the helper holds now, by path: none once it has ended (its locks went with it)."""
        return list(self._locked) if self.alive() else []

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def lost(self):
        """The lock files taken that the helper no longer holds (it ended: killed, out of memory)."""
        return [] if self.alive() else list(self._locked)

    def path(self, key):
        return os.path.join(self.lock_dir, lock_name(key))

    def acquire(self, keys, timeout, open_timeout=OPEN_TIMEOUT_S):
        """Take the locks of keys, waiting at most timeout for another holder, and open_timeout for the helper's
        walk and opens; LockTimeout, LockDirError (a link, an owner), or OSError, naming the folder."""
        names = dict((lock_name(k), k) for k in keys)
        job = {"root": self.root, "parts": self.parts, "uid": self.uid, "gid": self.gid, "names": sorted(names),
               "held": [list(i) for i in self.held], "wait_s": max(0.0, timeout)}
        self.proc = helperproc.spawn(HELPER_SOURCE, [json.dumps(job)], python_flags=["-S"])
        try:
            self._expect("opened", open_timeout, "did not answer within %gs (a hung mount?)" % open_timeout)
            answer = self._expect("locked", timeout + ANSWER_MARGIN_S, "did not answer within the lock wait")
        except BaseException:
            self.release()
            raise
        if "busy" in answer:
            self.release()
            raise LockTimeout("another gpu_release holds the lock on GPU %s (%s) for more than %gs"
                              % (names[answer["busy"]], self.path(names[answer["busy"]]), timeout))
        for name, dev, ino in answer["locked"]:
            self.held[(dev, ino)] = os.path.join(self.lock_dir, name)
            self.taken.append((dev, ino))
            self._locked.append(os.path.join(self.lock_dir, name))
        self.aliases += [(os.path.join(self.lock_dir, name), self.held.get((dev, ino))) for name, dev, ino in answer["aliases"]]

    def _expect(self, what, timeout, late):
        """The helper's next answer; its refusal or error raised, and an answer late past timeout an OSError."""
        line = self._line(timeout)
        if line is None:
            raise OSError(errno.ETIMEDOUT, "%s %s" % (self.lock_dir, late))
        answer = json.loads(line)
        if "refused" in answer:
            raise LockDirError("refusing the lock directory %s: %s" % (self.lock_dir, answer["refused"]))
        if "error" in answer:
            raise OSError(errno.EIO, "%s: %s" % (self.lock_dir, answer["error"]))
        if what not in answer and "busy" not in answer:
            raise OSError(errno.EIO, "%s: the lock helper answered %r" % (self.lock_dir, line[:200]))
        return answer

    def _line(self, timeout):
        """One line of the helper's stdout within timeout, or None (late, or it ended without one)."""
        end, data = time.monotonic() + timeout, b""
        fd = self.proc.stdout.fileno()
        while not data.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1)
            if not chunk:
                return None
            data += chunk
        return data.decode("utf-8", "replace")

    def release(self):
        """End the helper (its stdin closed), so its locks go; waited for, then abandoned."""
        for identity in self.taken:
            self.held.pop(identity, None)
        self.taken, self._locked = [], []
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(EXIT_WAIT_S)
            proc.stdout.close()
        except (OSError, ValueError, subprocess.TimeoutExpired):
            helperproc.abandon(proc)


class ContainerLocks(object):
    """The node's GPU locks, then each scoped container's own (HelperLocks through its init's root), so that a
    node-side release never races one running inside that container. A container's lock file that is a file
    already held (the node's, or another scoped container's) is taken once (`held`). Each container's lock stands
    alone (issue 41): one that cannot be taken (a link or a wrong owner planted there, held past the wait, a hung
    mount, an error) leaves that container out (`skipped`, {vmid: why}); the others go on."""

    def __init__(self, node_locks, proc_root, scope, keys, timeout, deadline=None):
        self.deadline = deadline
        self.all = [node_locks]
        self.by_vmid = {}
        self.skipped = {}
        self.waited_s = node_locks.waited_s
        inits = where.container_inits(proc_root)
        try:
            for vmid in sorted(scope.containers, key=int):
                if inits.get(vmid) is not None:   # not running: nothing in it can release
                    self._take(vmid, inits[vmid], proc_root, node_locks.held, keys,
                               max(0.0, timeout - (self.waited_s - node_locks.waited_s)))
        except BaseException:
            self.release()
            raise

    def _take(self, vmid, init, proc_root, held, keys, timeout):
        started = time.monotonic()
        locks = None
        try:
            uid, gid = where.owner_of(init, proc_root)
            locks = HelperLocks("%s/%d/root" % (proc_root, init), LOCK_DIR.strip("/").split("/"), uid, gid, held)
            opening = OPEN_TIMEOUT_S if self.deadline is None else max(0.0, min(OPEN_TIMEOUT_S, self.deadline - started))
            locks.acquire(keys, timeout, opening)
            self.all.append(locks)
            self.by_vmid[vmid] = locks
        except (LockTimeout, LockDirError, OSError) as exc:
            if locks is not None:
                locks.release()
            self.skipped[vmid] = ("container %s: its GPU lock could not be taken (%s); nothing of it was signalled or "
                                  "stopped" % (vmid, exc))
        self.waited_s += time.monotonic() - started

    def lost(self):
        """{vmid: the lock files of its container that are no longer held} (a lock helper that ended)."""
        out = {}
        for vmid, locks in self.by_vmid.items():
            if locks.lost():
                out[vmid] = locks.lost()
        return out

    def lost_words(self):
        """A sentence naming the containers whose locks are lost, or None."""
        lost = self.lost()
        if not lost:
            return None
        return "; ".join("the GPU lock of container %s was lost (its lock helper ended: %s): a release inside it may "
                         "run at the same time" % (vmid, ", ".join(lost[vmid])) for vmid in sorted(lost, key=int))

    def release(self):
        for locks in self.all:
            locks.release()
