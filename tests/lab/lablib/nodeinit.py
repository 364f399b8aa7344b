"""Start a lab node: sshd in its own mount namespace, with the lab's pct,
lxc-attach and lxc-info overlaid at Proxmox's paths.

Outer stage (host namespaces): join the node's cgroup, exec `unshare --mount`.
Inner stage: overlay /usr/sbin and /usr/bin, tmpfs on /run (sshd's privsep dir
/run/sshd lives there; STATE is bound back at its own path), exec sshd -D.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lablib import sysutil  # noqa: E402

OVERLAY_SOURCE = "gpuops-lab-node"


def outer(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    with open(os.path.join(cfg["cgroup_path"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "--",
                          sys.executable, "-I", os.path.abspath(__file__), "--inner", config_path])


def inner(config_path):
    with open(config_path) as f:
        cfg = json.load(f)
    node_dir = cfg["node_dir"]
    sysutil.make_rprivate("/")
    for sub, target in (("sbin", "/usr/sbin"), ("bin", "/usr/bin")):
        sysutil.mount(OVERLAY_SOURCE, target, "overlay", sysutil.MS_RDONLY,
                      "lowerdir=%s:%s" % (os.path.join(node_dir, sub), target))
    # The node's own accounts: the host's plus the lab's non-root user (and its sudo rule).
    for name in ("passwd", "group", "shadow", "sudoers.d"):
        source = os.path.join(node_dir, "etc", name)
        if os.path.exists(source) and os.path.exists("/etc/" + name):
            sysutil.bind(source, "/etc/" + name, readonly=True)
    state = cfg["state"]
    state_fd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    sysutil.mount(OVERLAY_SOURCE, "/run", "tmpfs", sysutil.MS_NOSUID | sysutil.MS_NODEV, "mode=755")
    os.makedirs(state)
    sysutil.bind("/proc/self/fd/%d" % state_fd, state)
    os.close(state_fd)
    os.mkdir("/run/sshd", 0o755)
    os.chdir("/")
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    os.execve("/usr/sbin/sshd", ["/usr/sbin/sshd", "-D", "-f", os.path.join(node_dir, "sshd_config"),
                                 "-E", os.path.join(node_dir, "sshd.log")], env)


def main(argv):
    if len(argv) == 3 and argv[1] == "--inner":
        return inner(argv[2])
    if len(argv) == 2:
        return outer(argv[1])
    sys.stderr.write("usage: nodeinit.py CONFIG\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
