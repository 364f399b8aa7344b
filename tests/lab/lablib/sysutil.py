"""Thin ctypes wrappers for the few syscalls the lab needs (mount, umount2, setns)."""

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct

# glibc by its soname first: find_library runs ldconfig at every labctl start
try:
    _libc = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _b(text):
    return None if text is None else os.fsencode(text)


def mount(source, target, fstype=None, flags=0, data=None):
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           "mount %s on %s" % (source, target))


def bind(source, target, readonly=False):
    mount(source, target, None, MS_BIND)
    if readonly:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)


def make_rprivate(path="/"):
    mount(None, path, None, MS_REC | MS_PRIVATE)


def umount(target, flags=MNT_DETACH):
    _check(_libc.umount2(_b(target), flags), "umount %s" % target)


def setns(path, nstype=0):
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, nstype), "setns %s" % path)
    finally:
        os.close(fd)


def loopback_up():
    """ip link set lo up, by ioctl."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), siocgifflags, req))[1]
        fcntl.ioctl(s.fileno(), siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def touch(path, mode=0o644):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, mode)
    os.close(fd)
