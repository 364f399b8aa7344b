"""Start a lab node: its own PID and mount namespace, with sshd and the node's LXC set-up.

Outer stage (host namespaces): join the node's cgroup, exec
`unshare --pid --fork --kill-child --mount --mount-proc`.
Inner stage (pid 1 of the node): the host's root file system bound (not recursively) at
/run/gpuops-lab-rootfs for the containers' lxc.rootfs.path; the lab pct overlaid on /usr/sbin; the node's
accounts, root's shell rc files made quiet (quiet_shell_start); tmpfs on /run (STATE bound back at its own path); the lab's LXCFS mount bound on
/var/lib/lxcfs, where LXC's lxcfs mount hook (common.conf.d/00-lxcfs.conf) takes it from, as on
Proxmox; /etc/lxc/lxc.conf naming the node's lxcpath, so `lxc-attach -n VMID` needs no -P.
Proxmox's view of the node (issue 11), in the node's mount namespace only: a read-only overlay on /etc
whose top layer (STATE/nodes/NODE/etc-layer) holds /etc/pve (`lxc` -> the node's lxc/ folder, live;
`ha` -> STATE/pve/ha; `nodes/NAME/lxc`; `local`); the lab ld.so.cache on /etc/ld.so.cache;
/run/nvidia-lab = STATE/driver; /run/lock (root, 1777, as on Debian); a read-only overlay on /dev
whose top layer has empty mountpoints for the fake device files, each then bound from
STATE/nodes/NODE/dev (same inodes as in the containers), with /dev's own submounts (pts, mqueue, ...)
bound back and a tmpfs of its own on /dev/shm (never the host's); the node's bin folder (the fake nvidia-smi) overlaid on /usr/bin.
Then it runs supervisord (program nvidia-persistenced, the lab's stand-in, not started: `supervisorctl start
nvidia-persistenced` on the node; the node's daemons run under supervisord, having no systemd) and sshd -D, and
reaps orphans (LXC monitors, container launchers) until SIGTERM.
"""

import json
import os
import pwd
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lablib import ctinit, sysutil  # noqa: E402

OVERLAY_SOURCE = "gpuops-lab-node"
ROOTFS = "/run/gpuops-lab-rootfs"  # lxc.rootfs.path of every container (in the node's mount namespace)


def outer(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    # The node's init cgroup in every hierarchy: LXC (lxc.cgroup.relative = 0) builds lxc/VMID below it.
    for path in cfg["cgroups"]:
        _makedirs_inheriting(path)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    os.execvp("unshare", ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
                          "--propagation", "private", "--",
                          sys.executable, "-I", os.path.abspath(__file__), "--inner", config_path])


def _inherit(path, name):
    """An empty v1 cpuset admits no task: copy the parent's value."""
    try:
        with open(os.path.join(path, name)) as f:
            if f.read().strip():
                return
        with open(os.path.join(os.path.dirname(path), name)) as f:
            value = f.read().strip()
        with open(os.path.join(path, name), "w") as f:
            f.write(value)
    except FileNotFoundError:
        pass


def _makedirs_inheriting(path):
    if os.path.isdir(path):
        return
    _makedirs_inheriting(os.path.dirname(path))
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    for name in ("cpuset.cpus", "cpuset.mems"):
        _inherit(path, name)


def _join(cgroup):
    def join():
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write("0")
    return join


DEV_NAMES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2")
HOST_DEV = "/run/gpuops-lab-hostdev"  # the host's /dev with its submounts, for a moment (node's /run)
# the node's own /dev/shm (a tmpfs in its mount namespace): what the engine reads and clean_shm may clean from the
# node is never the host's (issue 43)
NODE_SHM_SOURCE = "gpuops-lab-node-devshm"


def fake_devices(gpus):
    return ["nvidia%d" % m for m in range(gpus)] + list(DEV_NAMES)


def _symlink(target, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.islink(path):
        os.unlink(path)
    os.symlink(target, path)


def make_etc_layer(cfg):
    """STATE/nodes/NODE/etc-layer/pve: /etc/pve as Proxmox lays it out, by symlinks into STATE (live)."""
    layer = os.path.join(cfg["node_dir"], "etc-layer")
    pve = os.path.join(layer, "pve")
    state = cfg["state"]
    os.makedirs(pve, exist_ok=True)
    for name in cfg.get("nodes") or [cfg["node"]]:
        _symlink(os.path.join(state, "nodes", name, "lxc"), os.path.join(pve, "nodes", name, "lxc"))
    _symlink("nodes/%s/lxc" % cfg["node"], os.path.join(pve, "lxc"))
    _symlink("nodes/%s" % cfg["node"], os.path.join(pve, "local"))
    _symlink(os.path.join(state, "pve", "ha"), os.path.join(pve, "ha"))
    # root's subordinate ids as a Proxmox node has them: LXC maps an unprivileged container through newuidmap
    # whenever that tool is installed (uidmap), and newuidmap refuses a range /etc/subuid does not grant
    for name in ("subuid", "subgid"):
        with open(os.path.join(layer, name), "w") as f:
            f.write("root:100000:65536\n")
    return layer


def make_dev_layer(cfg):
    """STATE/nodes/NODE/dev-layer: empty files where the fake device files get bound."""
    layer = os.path.join(cfg["node_dir"], "dev-layer")
    for name in fake_devices(cfg["gpus"]):
        path = os.path.join(layer, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            with open(path, "w"):
                pass
    return layer


def _submounts(root):
    """Mount points strictly below root, outermost first, from mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for row in f:
            point = row.split()[4]
            if point.startswith(root + "/") and point not in found:
                found.append(point)
    return sorted(found, key=lambda p: p.count("/"))


def setup_dev(cfg):
    """/dev of the node: the host's (read-only overlay) plus the node's fake device files, bound."""
    layer = make_dev_layer(cfg)
    subs = _submounts("/dev")
    os.mkdir(HOST_DEV)
    sysutil.mount("/dev", HOST_DEV, None, sysutil.MS_BIND | sysutil.MS_REC)
    sysutil.mount(OVERLAY_SOURCE, "/dev", "overlay", sysutil.MS_RDONLY | sysutil.MS_NOSUID,
                  "lowerdir=%s:/dev" % layer)
    for point in subs:  # pts, mqueue, hugepages: bound back where they were
        if point != "/dev/shm" and os.path.isdir(point):
            sysutil.mount(HOST_DEV + point[len("/dev"):], point, None, sysutil.MS_BIND | sysutil.MS_REC)
    if os.path.isdir("/dev/shm"):   # never the host's: a tmpfs of the node's own
        sysutil.mount(NODE_SHM_SOURCE, "/dev/shm", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=1777")
    sysutil.umount(HOST_DEV)
    os.rmdir(HOST_DEV)
    dev_dir = os.path.join(cfg["node_dir"], "dev")
    for name in fake_devices(cfg["gpus"]):
        sysutil.bind(os.path.join(dev_dir, name), "/dev/" + name)


def quiet_shell_start(node_dir):
    """The node's root starts its shell as on a Proxmox node (Debian's rc files do nothing for a command), not
    with the host's own rc files: bash reads ~/.bashrc for every ssh command, and a pyenv init there cost
    0.13 CPU-s a command (measured), in every task of every play. Containers keep the host's view."""
    quiet = os.path.join(node_dir, "etc", "root-shell-rc")
    os.makedirs(os.path.dirname(quiet), exist_ok=True)
    with open(quiet, "w") as f:
        f.write("# gpuops lab node: root's shell start-up does nothing for a command, as on a Proxmox node\n")
    home = pwd.getpwnam("root").pw_dir
    for name in (".bashrc", ".bash_profile", ".bash_login", ".profile"):
        if os.path.isfile(os.path.join(home, name)):
            sysutil.bind(quiet, os.path.join(home, name), readonly=True)


def setup_mounts(cfg):
    node_dir, state = cfg["node_dir"], cfg["state"]
    sysutil.make_rprivate("/")
    sysutil.mount(OVERLAY_SOURCE, "/usr/sbin", "overlay", sysutil.MS_RDONLY,
                  "lowerdir=%s:/usr/sbin" % os.path.join(node_dir, "sbin"))
    proxmox = "gpus" in cfg  # a nodeinit.json of an older labctl has no Proxmox view
    if proxmox:
        sysutil.mount(OVERLAY_SOURCE, "/usr/bin", "overlay", sysutil.MS_RDONLY,
                      "lowerdir=%s:/usr/bin" % os.path.join(node_dir, "bin"))
        sysutil.mount(OVERLAY_SOURCE, "/etc", "overlay", sysutil.MS_RDONLY, "lowerdir=%s:/etc" % make_etc_layer(cfg))
        sysutil.bind(os.path.join(state, "lib", "ld.so.cache"), "/etc/ld.so.cache", readonly=True)
    # The node's own accounts: the host's plus the lab's non-root user (and its sudo rule).
    for name in ("passwd", "group", "shadow", "sudoers.d"):
        source = os.path.join(node_dir, "etc", name)
        if os.path.exists(source) and os.path.exists("/etc/" + name):
            sysutil.bind(source, "/etc/" + name, readonly=True)
    quiet_shell_start(node_dir)
    if os.path.isdir("/var/lib/lxcfs"):
        sysutil.bind(os.path.join(state, "lxcfs"), "/var/lib/lxcfs")
    os.makedirs("/etc/lxc", exist_ok=True)
    sysutil.bind(os.path.join(node_dir, "etc", "lxc"), "/etc/lxc", readonly=True)
    state_fd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    sysutil.mount(OVERLAY_SOURCE, "/run", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=755")
    os.makedirs(state)
    sysutil.bind("/proc/self/fd/%d" % state_fd, state)
    os.close(state_fd)
    os.mkdir(ROOTFS)  # on the node's own /run: nothing under STATE, so STATE binds into containers cleanly
    sysutil.mount("/", ROOTFS, None, sysutil.MS_BIND)  # not recursive: the root file system only
    os.mkdir("/run/sshd", 0o755)
    os.mkdir("/run/lock")  # as on Debian: root 1777; a --shared-run-lock container binds it (lxc.mount.entry)
    os.chmod("/run/lock", 0o1777)
    if proxmox:
        os.mkdir("/run/nvidia-lab", 0o755)  # the driver socket at its default path
        sysutil.bind(os.path.join(state, "driver"), "/run/nvidia-lab")
        setup_dev(cfg)
    mount_ct_roots(cfg.get("ct_roots") or [])


def mount_ct_roots(roots):
    """Each systemd container's root file system: an overlay of the cached Debian tree (read-only) and the
    container's own upper folder, on the node's /run (labctl up --systemd; lab.Lab._systemd_root)."""
    for root in roots:
        os.makedirs(root["target"], exist_ok=True)
        sysutil.mount("gpuops-lab-ct%s" % root["vmid"], root["target"], "overlay", 0,
                      "lowerdir=%s,upperdir=%s,workdir=%s" % (root["lower"], root["upper"], root["work"]))


# The containers' supervisord.conf (ctinit's), with the stand-in daemon's program.
NODE_SUPERVISORD_CONF = ctinit.SUPERVISORD_CONF.replace("%", "%%") + """
[program:nvidia-persistenced]
command=/bin/bash -c 'exec -a nvidia-persistenced %(python)s %(lab_dir)s/node/nvidia-persistenced'
autostart=false
autorestart=false
stopsignal=TERM
stopwaitsecs=5
"""


def start_supervisord(cfg, env):
    """The node's supervisord, its conf at /run/supervisor/supervisord.conf (the node's /run; supervisorctl -c)."""
    for d in ("/run/supervisor", "/run/supervisor/log", "/run/supervisor/conf.d"):
        os.makedirs(d, exist_ok=True)
    conf = "/run/supervisor/supervisord.conf"
    with open(conf, "w") as f:
        f.write(NODE_SUPERVISORD_CONF % {"python": os.path.join(cfg["supervisor_venv"], "bin", "python"),
                                         "lab_dir": cfg["lab_dir"]})
    log = open("/run/supervisor/supervisord.out", "ab")
    subprocess.Popen([os.path.join(cfg["supervisor_venv"], "bin", "supervisord"), "-c", conf], env=env,
                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                     preexec_fn=_join(cfg["cgroup_path"]))
    log.close()


def inner(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    setup_mounts(cfg)
    os.chdir("/")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    node_dir = cfg["node_dir"]
    if cfg.get("supervisor_venv"):
        start_supervisord(cfg, env)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", os.path.join(node_dir, "sshd_config"),
                             "-E", os.path.join(node_dir, "sshd.log")], env=env, stdin=subprocess.DEVNULL,
                            preexec_fn=_join(cfg["cgroup_path"]))

    def on_term(signum, frame):
        try:
            sshd.terminate()
        except OSError:
            pass
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:  # pid 1 of the node: reap everything; leave when sshd is gone
        try:
            pid = os.waitpid(-1, 0)[0]
        except ChildProcessError:
            signal.pause()
            continue
        if pid == sshd.pid:
            return 1


def main(argv):
    if len(argv) == 3 and argv[1] == "--inner":
        return inner(argv[2])
    if len(argv) == 2:
        return outer(argv[1])
    sys.stderr.write("usage: nodeinit.py CONFIG\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
