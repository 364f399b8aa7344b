"""The root file system of a lab container that boots Debian's real systemd (labctl up --systemd VMID).

Built once from Debian's packages with mmdebstrap (bookworm, minbase plus systemd, dbus, cron, supervisor, python3),
cached in REPO/.cache/lab-rootfs/KEY/rootfs like the NVML stand-in, and never written afterwards: each container
boots an overlay of its own (lower: the cached tree; upper: STATE/nodes/NODE/ctroot/VMID), which its node mounts.
An unprivileged container's lower is a copy shifted by the idmap's base (uid and gid + 100000), built once as well.
KEY is a hash of everything that shapes the tree (suite, packages, the lab's files below), so a change rebuilds it.
A lock file keeps parallel labs from building the same tree twice; a tree is moved into place only when complete.

The lab's additions, as files of the tree (an admin's, not the lab's own init):
- /etc/supervisor/supervisord.conf: Debian's supervisor.service runs the lab's config (socket, pid file, includes
  under /run/supervisor, as the lab's other containers have them), with /run/supervisor made by tmpfiles.d;
- lab-ready.service (multi-user.target): touches /run/lab-ready once the boot has reached it, labctl's readiness.
"""

import fcntl
import hashlib
import os
import shutil
import subprocess

from lablib import ctinit
from lablib.common import REPO, LabError

SUITE = "bookworm"
PACKAGES = ("systemd", "systemd-sysv", "dbus", "dbus-user-session", "libpam-systemd", "cron", "supervisor",
            "python3", "procps", "psmisc")
CACHE = os.path.join(REPO, ".cache", "lab-rootfs")
BUILD_TIMEOUT_S = 900

# ctinit's config for Debian's supervisor.service (which passes -n itself), also reading Debian's conf.d
SUPERVISORD_CONF = ("; gpuops lab: Debian's supervisor.service with the lab's socket and includes (lablib/rootfs.py)\n"
                    + ctinit.SUPERVISORD_CONF.replace("nodaemon=true\nuser=root\n", "").replace(
                        "files = /run/supervisor/conf.d/*.conf",
                        "files = /etc/supervisor/conf.d/*.conf /run/supervisor/conf.d/*.conf"))

TMPFILES = """\
d /run/supervisor 0755 root root -
d /run/supervisor/conf.d 0755 root root -
d /run/supervisor/log 0755 root root -
L /run/supervisor/supervisord.conf - - - - /etc/supervisor/supervisord.conf
"""

READY_UNIT = """\
[Unit]
Description=gpuops lab: the boot reached multi-user.target
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/bin/touch /run/lab-ready
RemainAfterExit=yes

[Install]
WantedBy=multi-user.target
"""

FILES = {"etc/supervisor/supervisord.conf": SUPERVISORD_CONF,
         "etc/tmpfiles.d/gpuops-lab-supervisor.conf": TMPFILES,
         "etc/systemd/system/lab-ready.service": READY_UNIT}
LINKS = {"etc/systemd/system/multi-user.target.wants/lab-ready.service": "/etc/systemd/system/lab-ready.service",
         # nothing in a lab container to get a console or a network from
         "etc/systemd/system/console-getty.service": "/dev/null",
         "etc/systemd/system/container-getty@.service": "/dev/null"}


def key():
    text = repr((SUITE, PACKAGES, sorted(FILES.items()), sorted(LINKS.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(shift=0):
    """The cached tree for an idmap base (0: privileged), built when missing."""
    folder = os.path.join(CACHE, key())
    tree = os.path.join(folder, "rootfs" if not shift else "rootfs-%d" % shift)
    if os.path.isfile(tree + ".done"):
        return tree
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(tree + ".done"):
            if shift:
                _shifted(path(0), tree, shift)
            else:
                _build(tree)
            with open(tree + ".done", "w") as f:
                f.write(key() + "\n")
    return tree


def _build(tree):
    if shutil.which("mmdebstrap") is None:
        raise LabError("labctl up --systemd needs mmdebstrap (make system-packages installs it)")
    partial = tree + ".partial"
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    argv = ["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", "--include=" + ",".join(PACKAGES),
            SUITE, partial]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise LabError("mmdebstrap ran past %d s" % BUILD_TIMEOUT_S)
    if proc.returncode:
        raise LabError("mmdebstrap failed (%d): %s" % (proc.returncode, proc.stdout.decode(errors="replace")[-800:]))
    for rel, text in FILES.items():
        full = os.path.join(partial, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    for rel, target in LINKS.items():
        full = os.path.join(partial, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if os.path.lexists(full):
            os.unlink(full)
        os.symlink(target, full)
    os.rename(partial, tree)


def _shifted(source, tree, base):
    """A copy of source with every owner moved up by base (an unprivileged container's root is uid base)."""
    partial = tree + ".partial"
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    subprocess.run(["cp", "-a", source, partial], check=True)  # device nodes as nodes, links as links
    for root, dirs, files in os.walk(partial):
        for name in ([root] if root == partial else []) + [os.path.join(root, n) for n in dirs + files]:
            st = os.lstat(name)
            os.lchown(name, st.st_uid + base, st.st_gid + base)
            if not os.path.islink(name) and st.st_mode & 0o6000:  # chown drops set-id bits: keep them
                os.chmod(name, st.st_mode & 0o7777)
    os.rename(partial, tree)
