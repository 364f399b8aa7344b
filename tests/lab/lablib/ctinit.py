"""Init of a lab container (lxc.init.cmd), started by the real lxc-start.

LXC has built the container as Proxmox's config asks (namespaces, cgroup .../lxc/VMID/ns, autodev
/dev with the fake NVIDIA files bound in by lxc.mount.entry, LXCFS over /proc, idmap when
unprivileged). This init adds what the lab needs: tmpfs on /tmp, /run and /dev/shm (and, unprivileged, on
/var/tmp and /root, so no write reaches the host's files; with shared_run_lock the node's /run/lock,
which LXC bound at /run/lock, is bound back above that tmpfs), the driver socket, ld.so.cache,
/usr/local/sbin; then runs supervisord and reaps children until SIGTERM (lxc-stop), which stops
supervisord first. It marks itself ready with READY_FILE.
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
READY_FILE = "/run/lab-ready"

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


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _show_repo_under(mountpoint, repo_fd):
    """Bind the repository back at its own path when a fresh tmpfs on mountpoint hid it."""
    if REPO_ROOT.startswith(mountpoint + "/"):
        os.makedirs(REPO_ROOT, exist_ok=True)
        sysutil.bind("/proc/self/fd/%d" % repo_fd, REPO_ROOT)


def _driver_and_library(state, via_fd):
    """The driver socket at /run/nvidia-lab; STATE/lib at its own path (the lab's ld.so.cache names the stand-in
    library by its STATE path: that one folder only is shown). Returns that folder."""
    os.mkdir("/run/nvidia-lab")
    sysutil.bind(via_fd + "driver", "/run/nvidia-lab")
    lib_dir = os.path.join(state, "lib")
    os.makedirs(lib_dir)
    sysutil.bind(via_fd + "lib", lib_dir, readonly=True)
    return lib_dir


def setup_mounts(cfg):
    state = cfg["state"]
    sysutil.make_rprivate("/")
    sysutil.bind(os.path.join(state, "sbin"), "/usr/local/sbin", readonly=True)
    # Like a driver and supervisor installed in the container: nvidia-smi, supervisorctl in /usr/bin.
    sysutil.mount("gpuops-lab-ct", "/usr/bin", "overlay", sysutil.MS_RDONLY,
                  "lowerdir=%s:/usr/bin" % os.path.join(state, "sbin"))
    sysutil.bind(os.path.join(state, "lib", "ld.so.cache"), "/etc/ld.so.cache", readonly=True)

    # The clone may live under /tmp or /run (CI clones anywhere): keep it visible at its path.
    repo_fd = os.open(REPO_ROOT, os.O_PATH | os.O_DIRECTORY)
    private = ["/tmp", "/run"] + (["/var/tmp", "/root"] if cfg.get("unprivileged") else [])
    state_fd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    # --shared-run-lock: LXC bound the node's /run/lock there (lxc.mount.entry); keep it above the tmpfs
    run_lock_fd = os.open("/run/lock", os.O_PATH | os.O_DIRECTORY) if cfg.get("shared_run_lock") else None
    for path in private:
        sysutil.mount("tmpfs", path, "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV,
                      "mode=1777" if path.endswith("tmp") else "mode=755")
        _show_repo_under(path, repo_fd)
    os.close(repo_fd)
    # The container's own /dev/shm, as its systemd mounts one in a Proxmox container (LXC's autodev /dev has none)
    os.mkdir("/dev/shm", 0o1777)
    sysutil.mount("tmpfs", "/dev/shm", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=1777")
    if run_lock_fd is not None:
        os.mkdir("/run/lock")
        sysutil.bind("/proc/self/fd/%d" % run_lock_fd, "/run/lock")
        os.close(run_lock_fd)
    via_fd = "/proc/self/fd/%d/" % state_fd
    _driver_and_library(state, via_fd)
    if cfg.get("bare_venv"):  # the container's own bare python, at the same path as on the host
        os.makedirs(cfg["bare_venv"])
        sysutil.bind(via_fd + os.path.relpath(cfg["bare_venv"], state), cfg["bare_venv"])
    os.close(state_fd)
    with open("/run/lab-hostname", "w") as f:
        f.write("ct%s\n" % cfg["vmid"])
    sysutil.bind("/run/lab-hostname", "/etc/hostname", readonly=True)
    for d in ("/run/lock", SUPERVISOR_DIR, SUPERVISOR_DIR + "/conf.d", SUPERVISOR_DIR + "/log"):
        os.makedirs(d, exist_ok=True)


def start_supervisord(cfg):
    with open(SUPERVISOR_CONF, "w") as f:
        f.write(SUPERVISORD_CONF)
    log = open(os.path.join(SUPERVISOR_DIR, "supervisord.out"), "ab")
    proc = subprocess.Popen([os.path.join(cfg["supervisor_venv"], "bin", "supervisord"), "-c", SUPERVISOR_CONF],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True)
    log.close()
    return proc.pid


def _prepared(config_path, mounts):
    """The container's record, once mounts(record) and the loopback are made."""
    with open(config_path) as f:
        cfg = json.load(f)
    os.chdir("/")
    mounts(cfg)
    try:
        sysutil.loopback_up()
    except OSError:
        pass
    return cfg


def inner(config_path):
    cfg = _prepared(config_path, setup_mounts)
    os.environ.pop("NOTIFY_SOCKET", None)
    os.environ["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

    def on_term(signum, frame):
        raise Stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGPWR, on_term)  # lxc-stop without -k asks init to halt with SIGPWR
    sup_pid = start_supervisord(cfg)
    deadline = time.monotonic() + 15
    while not os.path.exists(SUPERVISOR_DIR + "/supervisor.sock"):
        if time.monotonic() > deadline:
            sys.stderr.write("ctinit: supervisord did not start\n")
            break
        _reap()
        time.sleep(0.02)
    with open(READY_FILE, "w") as f:
        f.write("ready\n")
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


def systemd_mounts(cfg):
    """What a systemd container gets before its init runs: cgroup v2 alone at /sys/fs/cgroup (Proxmox's view: this
    host's LXC mounted its hybrid tree), a tmpfs /run (systemd keeps a mounted /run) with the driver socket, the
    stand-in library through the container's own ld.so.cache, the lab's nvidia-smi and MPS tool in /usr/local/sbin."""
    state = cfg["state"]
    sysutil.make_rprivate("/")
    if os.path.ismount("/sys/fs/cgroup"):
        sysutil.umount("/sys/fs/cgroup")  # lazy: LXC's tmpfs and each hierarchy below it
    sysutil.mount("cgroup2", "/sys/fs/cgroup", "cgroup2", sysutil.MS_NOSUID | sysutil.MS_NODEV | sysutil.MS_NOEXEC)
    repo_fd = os.open(REPO_ROOT, os.O_PATH | os.O_DIRECTORY)
    state_fd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    sysutil.mount("tmpfs", "/run", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=755")
    _show_repo_under("/run", repo_fd)
    os.close(repo_fd)
    via_fd = "/proc/self/fd/%d/" % state_fd
    lib_dir = _driver_and_library(state, via_fd)
    for tool in ("nvidia-smi", "nvidia-cuda-mps-control"):
        sysutil.touch("/usr/local/sbin/" + tool, 0o755)
        sysutil.bind(via_fd + "sbin/" + tool, "/usr/local/sbin/" + tool, readonly=True)
    os.close(state_fd)
    with open("/etc/ld.so.conf.d/gpuops-lab.conf", "w") as f:
        f.write(lib_dir + "\n")
    subprocess.run(["/sbin/ldconfig", "-X"], check=False)  # the container's own cache, with the stand-in's folder
    with open("/etc/hostname", "w") as f:
        f.write("ct%s\n" % cfg["vmid"])


def systemd(config_path):
    """Init of a systemd container: the lab's mounts, then exec Debian's systemd as pid 1."""
    cfg = _prepared(config_path, systemd_mounts)
    env = dict(os.environ, container="lxc")
    env.pop("NOTIFY_SOCKET", None)
    if cfg.get("systemd_node"):  # plays a Proxmox node for the modules: /etc/pve, and no container= for pid 1
        os.makedirs("/etc/pve/lxc", exist_ok=True)
        env.pop("container", None)
    os.execve("/sbin/init", ["/sbin/init"], env)


def main(argv):
    if len(argv) == 3 and argv[1] == "--inner":
        return inner(argv[2])
    if len(argv) == 3 and argv[1] == "--systemd":
        return systemd(argv[2])
    sys.stderr.write("usage: ctinit.py --inner|--systemd CONFIG\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
