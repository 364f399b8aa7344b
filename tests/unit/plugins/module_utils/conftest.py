"""Fixtures for the engine's unit tests: a recorded /proc tree and a fake pynvml."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_nvml import FakeNvml  # noqa: E402

CTL, UVM = "/dev/nvidiactl", "/dev/nvidia-uvm"


def ctx(minor):
    """Map lines of a CUDA context on /dev/nvidiaMINOR (row 12: the node mapped 3 times)."""
    return ["/dev/nvidia%d" % minor] * 3


def vis(minor):
    """Map lines of a GPU that is only visible to a CUDA process (row 9: the node mapped twice)."""
    return ["/dev/nvidia%d" % minor] * 2


def tcp_line(slot, inode, local, remote):
    """One ESTABLISHED line of /proc/net/tcp as the kernel writes it."""
    return ("%4d: %s %s 01 00000000:00000000 00:00000000 00000000     0        0 %d 1 0000000000000000 20 4 30 10 -1"
            % (slot, local, remote, inode))


def maps_lines(paths):
    """maps text as the kernel writes it, one mapping per device path."""
    lines = ["5581d000-5581e000 r--p 00000000 08:01 1312  /usr/bin/python3.11",
             "7f00a0000000-7f00a0021000 rw-p 00000000 00:00 0 "]
    for i, path in enumerate(paths):
        lines.append("7f10%04x0000-7f10%04x1000 rw-s 00000000 00:05 %d                       %s" % (i, i, 900 + i, path))
    lines.append("7ffd1c2e0000-7ffd1c301000 rw-p 00000000 00:00 0                          [stack]")
    return "\n".join(lines) + "\n"


class ProcTree(object):
    """Writes /proc/PID/{stat,status,maps,cmdline,cgroup,fd/,task/} files as recorded from a real kernel."""

    def __init__(self, root):
        self.root = str(root)
        os.makedirs(self.root, exist_ok=True)
        with open(os.path.join(self.root, "stat"), "w") as f:
            f.write("cpu  1 2 3 4\nbtime 1764400000\nprocesses 10\n")
        with open(os.path.join(self.root, "uptime"), "w") as f:
            f.write("1000.00 1900.00\n")

    def add(self, pid, comm="python3", state="S", ppid=1, threads=1, starttime=1000, maps=(), fds=(),
            argv=None, nspid=None, uid=0, cgroup="0::/lxc/101/ns\n", tasks=None, raw_maps=None, pgrp=None,
            session=None, netns=None, tcp=(), flags=4194560):
        base = os.path.join(self.root, str(pid))
        os.makedirs(os.path.join(base, "fd"))
        self._ids = (pgrp or pid, session or pid)
        if netns is not None:
            os.makedirs(os.path.join(base, "ns"))
            shared = os.path.join(self.root, "netns-%s" % netns)
            open(shared, "a").close()
            os.symlink(shared, os.path.join(base, "ns", "net"))
            os.makedirs(os.path.join(base, "net"))
            with open(os.path.join(base, "net", "tcp"), "w") as f:
                f.write("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")
                for slot, (inode, local, remote) in enumerate(tcp):
                    f.write(tcp_line(slot, inode, local, remote) + "\n")
        self._flags = flags
        self._task_files(base, pid, comm, state, ppid, threads, starttime, maps, fds, raw_maps)
        with open(os.path.join(base, "status"), "w") as f:
            f.write("Name:\t%s\nUmask:\t0022\nState:\t%s (%s)\nTgid:\t%d\nNgid:\t0\nPid:\t%d\nPPid:\t%d\n"
                    "TracerPid:\t0\nUid:\t%d\t%d\t%d\t%d\nGid:\t0\t0\t0\t0\nThreads:\t%d\nNSpid:\t%s\n"
                    % (comm, state, {"S": "sleeping", "Z": "zombie", "D": "disk sleep", "R": "running"}.get(state, "x"),
                       pid, pid, ppid, uid, uid, uid, uid, threads, "\t".join(str(p) for p in (nspid or [pid]))))
        with open(os.path.join(base, "cmdline"), "wb") as f:
            f.write(b"".join(a.encode() + b"\0" for a in (argv if argv is not None else [comm])))
        with open(os.path.join(base, "cgroup"), "w") as f:
            f.write(cgroup)
        os.makedirs(os.path.join(base, "task"))
        for tid, tinfo in (tasks or {pid: {}}).items():
            tbase = os.path.join(base, "task", str(tid))
            os.makedirs(os.path.join(tbase, "fd"))
            self._task_files(tbase, tid, tinfo.get("comm", comm), tinfo.get("state", state), ppid, threads, starttime,
                             tinfo.get("maps", maps if tid == pid else ()), tinfo.get("fds", fds if tid == pid else ()),
                             None)
            if "wchan" in tinfo:
                with open(os.path.join(tbase, "wchan"), "w") as f:
                    f.write(tinfo["wchan"])
            if "stack" in tinfo:
                with open(os.path.join(tbase, "stack"), "w") as f:
                    f.write(tinfo["stack"])
            with open(os.path.join(tbase, "cmdline"), "wb") as f:
                f.write(b"".join(a.encode() + b"\0" for a in (argv if argv is not None else [comm])))
        return pid

    def _task_files(self, base, pid, comm, state, ppid, threads, starttime, maps, fds, raw_maps):
        with open(os.path.join(base, "stat"), "w") as f:
            pgrp, session = getattr(self, "_ids", (pid, pid))
            f.write("%d (%s) %s %d %d %d 0 -1 %d 100 0 0 0 5 3 0 0 20 0 %d 0 %d 1000000 200 "
                    "18446744073709551615 1 1 0 0 0 0 0 16781312 0 0 0 17 1 0 0 0 0 0\n"
                    % (pid, comm, state, ppid, pgrp, session, getattr(self, "_flags", 4194560), threads, starttime))
        with open(os.path.join(base, "maps"), "w") as f:
            f.write(raw_maps if raw_maps is not None else (maps_lines(maps) if maps or state != "Z" else ""))
        for i, target in enumerate(fds):
            os.symlink(target, os.path.join(base, "fd", str(3 + i)))
        os.symlink("/dev/null", os.path.join(base, "fd", "0"))


@pytest.fixture
def proc(tmp_path):
    return ProcTree(tmp_path / "proc")


@pytest.fixture
def fake_gpus():
    """Two GPUs, minors 0 and 1, idle."""
    return FakeNvml([{"minor": 0, "used_mib": 0}, {"minor": 1, "used_mib": 0}])
