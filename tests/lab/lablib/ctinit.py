"""Init of a lab container.

Outer stage (host namespaces): join the container's cgroup, then exec
`unshare --pid --fork --mount --uts --ipc --net --mount-proc` on the inner stage.
Inner stage (pid 1 of the container): private mounts (/dev, /run, /tmp, fake device
files, driver socket, ld.so.cache, /usr/local/sbin), hostname, lo, supervisord;
then reap children until SIGTERM, which stops supervisord first.
"""

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lablib import sysutil  # noqa: E402

SUPERVISOR_DIR = "/run/supervisor"
SUPERVISOR_CONF = SUPERVISOR_DIR + "/supervisord.conf"
HOST_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
NVIDIA_COMMON = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
NVIDIA_CAPS = ("nvidia-cap1", "nvidia-cap2")

SUPERVISORD_CONF = """\
[unix_http_server]
file=/run/supervisor/supervisor.sock
chmod=0700

[supervisord]
nodaemon=true
user=root
logfile=/run/supervisor/supervisord.log
pidfile=/run/supervisor/supervisord.pid
childlogdir=/run/supervisor/log

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix:///run/supervisor/supervisor.sock

[include]
files = /run/supervisor/conf.d/*.conf
"""


class Stop(Exception):
    pass


def outer(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    with open(os.path.join(cfg["cgroup_path"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    os.execvp("unshare", ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--uts", "--ipc",
                          "--net", "--mount-proc", "--propagation", "private", "--",
                          sys.executable, "-I", os.path.abspath(__file__), "--inner", config_path]
              + sys.argv[2:])


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _show_repo_under(mountpoint, repo_fd):
    """Bind the repository back at its own path when a fresh tmpfs on mountpoint hid it."""
    if REPO_ROOT.startswith(mountpoint + "/"):
        os.makedirs(REPO_ROOT, exist_ok=True)
        sysutil.bind("/proc/self/fd/%d" % repo_fd, REPO_ROOT)


def setup_mounts(cfg):
    sysutil.make_rprivate("/")
    # A container started from a node's namespace drops the node's overlays first.
    for row in reversed(_mounts()):
        if row[1] == "gpuops-lab-node":
            try:
                sysutil.umount(row[0])
            except OSError:
                pass
    state = cfg["state"]
    node_dir = os.path.join(state, "nodes", cfg["node"])
    sysutil.bind(os.path.join(state, "sbin"), "/usr/local/sbin", readonly=True)
    # Like a driver and supervisor installed in the container: nvidia-smi, supervisorctl in /usr/bin.
    sysutil.mount("gpuops-lab-ct", "/usr/bin", "overlay", sysutil.MS_RDONLY,
                  "lowerdir=%s:/usr/bin" % os.path.join(state, "sbin"))
    sysutil.bind(os.path.join(state, "lib", "ld.so.cache"), "/etc/ld.so.cache", readonly=True)
    hostname_file = os.path.join(node_dir, "containers", "%s.hostname" % cfg["vmid"])
    with open(hostname_file, "w") as f:
        f.write("ct%s\n" % cfg["vmid"])
    sysutil.bind(hostname_file, "/etc/hostname", readonly=True)

    host_dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY)
    sysutil.mount("tmpfs", "/dev", "tmpfs", sysutil.MS_NOSUID, "mode=755,size=4m")
    for name in HOST_DEVICES:
        sysutil.touch("/dev/" + name)
        sysutil.bind("/proc/self/fd/%d/%s" % (host_dev, name), "/dev/" + name)
    os.close(host_dev)
    os.mkdir("/dev/pts")
    sysutil.mount("devpts", "/dev/pts", "devpts", sysutil.MS_NOSUID, "newinstance,ptmxmode=0666,mode=620")
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.mkdir("/dev/shm")
    sysutil.mount("tmpfs", "/dev/shm", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=1777")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink("/proc/self/fd/%d" % i, "/dev/" + name)
    os.symlink("/proc/self/fd", "/dev/fd")
    dev_src = os.path.join(node_dir, "dev")
    for name in ["nvidia%d" % m for m in cfg["minors"]] + list(NVIDIA_COMMON):
        sysutil.touch("/dev/" + name, 0o666)
        sysutil.bind(os.path.join(dev_src, name), "/dev/" + name)
    os.mkdir("/dev/nvidia-caps")
    for name in NVIDIA_CAPS:
        sysutil.touch("/dev/nvidia-caps/" + name, 0o444)
        sysutil.bind(os.path.join(dev_src, "nvidia-caps", name), "/dev/nvidia-caps/" + name)

    # The clone may live under /tmp or /run (CI clones anywhere): keep it visible at its path.
    repo_fd = os.open(REPO_ROOT, os.O_PATH | os.O_DIRECTORY)
    sysutil.mount("tmpfs", "/tmp", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=1777")
    _show_repo_under("/tmp", repo_fd)

    state_fd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    sysutil.mount("tmpfs", "/run", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=755")
    _show_repo_under("/run", repo_fd)
    os.close(repo_fd)
    via_fd = "/proc/self/fd/%d/" % state_fd
    os.mkdir("/run/nvidia-lab")
    sysutil.bind(via_fd + "driver", "/run/nvidia-lab")
    # The lab ld.so.cache names the library by its STATE path: show that one folder only.
    lib_dir = os.path.join(state, "lib")
    os.makedirs(lib_dir)
    sysutil.bind(via_fd + "lib", lib_dir, readonly=True)
    if cfg.get("bare_venv"):  # the container's own bare python, at the same path as on the host
        os.makedirs(cfg["bare_venv"])
        sysutil.bind(via_fd + os.path.relpath(cfg["bare_venv"], state), cfg["bare_venv"])
    os.close(state_fd)
    for d in ("/run/lock", SUPERVISOR_DIR, SUPERVISOR_DIR + "/conf.d", SUPERVISOR_DIR + "/log"):
        os.makedirs(d, exist_ok=True)


def _mounts():
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            rows.append((left.split()[4], right.split()[1]))
    return rows


def start_supervisord(cfg):
    with open(SUPERVISOR_CONF, "w") as f:
        f.write(SUPERVISORD_CONF)
    log = open(os.path.join(SUPERVISOR_DIR, "supervisord.out"), "ab")
    proc = subprocess.Popen([os.path.join(cfg["supervisor_venv"], "bin", "supervisord"), "-c", SUPERVISOR_CONF],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True)
    log.close()
    return proc.pid


def inner(config_path, ready_fd):
    with open(config_path) as f:
        cfg = json.load(f)
    os.chdir("/")
    setup_mounts(cfg)
    import socket
    socket.sethostname("ct%s" % cfg["vmid"])
    sysutil.loopback_up()
    os.environ.pop("NOTIFY_SOCKET", None)
    os.environ["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    def on_term(signum, frame):
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    sup_pid = start_supervisord(cfg)
    deadline = time.monotonic() + 15
    while not os.path.exists(SUPERVISOR_DIR + "/supervisor.sock"):
        if time.monotonic() > deadline:
            sys.stderr.write("ctinit: supervisord did not start\n")
            break
        _reap()
        time.sleep(0.02)
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    try:
        while True:
            try:
                pid = os.waitpid(-1, 0)[0]
            except ChildProcessError:
                signal.pause()
                continue
            if pid == sup_pid:
                sys.stderr.write("ctinit: supervisord exited, restarting it\n")
                time.sleep(0.5)
                sup_pid = start_supervisord(cfg)
    except Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop(sup_pid)
    return 0


def _reap():
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            return
        if pid == 0:
            return


def _stop(sup_pid):
    try:
        os.kill(sup_pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pid = os.waitpid(sup_pid, os.WNOHANG)[0]
        except ChildProcessError:
            return
        if pid:
            return
        time.sleep(0.05)


def main(argv):
    if len(argv) >= 3 and argv[1] == "--inner":
        ready_fd = int(argv[4]) if len(argv) >= 5 and argv[3] == "--ready-fd" else None
        return inner(argv[2], ready_fd)
    if len(argv) >= 2:
        return outer(argv[1])
    sys.stderr.write("usage: ctinit.py CONFIG [--ready-fd N]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
