"""Check the kernel features and tools the lab needs; a missing one fails by name."""

import os
import shutil
import subprocess

from lablib.common import LabError, cgroup2_mount, freezer_mount


def _check_namespaces():
    for ns in ("pid", "mnt", "uts", "ipc", "net"):
        if not os.path.exists("/proc/self/ns/" + ns):
            return "namespaces: /proc/self/ns/%s missing" % ns
    if not shutil.which("unshare"):
        return "namespaces: unshare(1) not found (util-linux)"
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--net", "--mount-proc",
                           "true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    if proc.returncode:
        return "namespaces: unshare --pid --mount --uts --ipc --net failed: %s" % proc.stderr.decode().strip()
    return None


def _check_cgroup2():
    cg2 = cgroup2_mount()
    if not cg2:
        return "cgroup v2: no cgroup2 mount in /proc/self/mountinfo"
    probe = os.path.join(cg2, "gpuops-lab-preflight-%d" % os.getpid())
    try:
        os.mkdir(probe)
    except OSError as exc:
        return "cgroup v2: cannot create a folder in %s: %s" % (cg2, exc.strerror)
    try:
        if not os.path.exists(os.path.join(probe, "cgroup.kill")):
            return "cgroup v2 cgroup.kill: missing (kernel older than 5.14?)"
    finally:
        os.rmdir(probe)
    return None


def _check_freezer():
    fz = freezer_mount()
    if not fz:
        return "cgroup v1 freezer: no freezer hierarchy mounted (needed by the stuck scenario)"
    if not os.path.exists(os.path.join(fz, "tasks")):
        return "cgroup v1 freezer: %s has no tasks file" % fz
    return None


def _check_overlay():
    with open("/proc/filesystems") as f:
        if "overlay" not in f.read().split():
            subprocess.run(["modprobe", "overlay"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            with open("/proc/filesystems") as f2:
                if "overlay" not in f2.read().split():
                    return "overlayfs: not in /proc/filesystems"
    return None


def _check_tools():
    missing = []
    for tool, package in (("/usr/sbin/sshd", "openssh-server"), ("ssh", "openssh-client"),
                          ("ssh-keygen", "openssh-client"), ("gcc", "gcc"), ("ldconfig", "libc-bin"),
                          ("fuser", "psmisc"), ("lxc-start", "lxc"), ("lxc-attach", "lxc"), ("lxc-info", "lxc"),
                          ("lxc-stop", "lxc"), ("nsenter", "util-linux"), ("lxcfs", "lxcfs")):
        if not (os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool)):
            missing.append("%s: %s not found (apt package %s)" % (tool.rsplit("/", 1)[-1], tool, package))
    return "; ".join(missing) or None


def _check_root():
    return None if os.geteuid() == 0 else "root: the lab needs root (namespaces, mounts, cgroups)"


CHECKS = (_check_root, _check_namespaces, _check_cgroup2, _check_freezer, _check_overlay, _check_tools)


def preflight():
    problems = [p for p in (check() for check in CHECKS) if p]
    if problems:
        raise LabError("preflight failed:\n  " + "\n  ".join(problems))
    return True
