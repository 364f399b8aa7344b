"""Start, stop and inspect one lab container (shared by labctl and the node's pct)."""

import os
import subprocess
import time

from lablib.common import LabError, read_json, write_json

PVE_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"  # pct's run_cli_handler sets it before lxc-attach
CTINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ctinit.py")


def node_config(node_dir):
    cfg = read_json(os.path.join(node_dir, "node.json"))
    if cfg is None:
        raise LabError("not a lab node folder: %s" % node_dir)
    return cfg


def config_path(node_dir, vmid):
    return os.path.join(node_dir, "containers", "%s.json" % vmid)


def conf_path(node_dir, vmid):
    return os.path.join(node_dir, "lxc", "%s.conf" % vmid)


def load(node_dir, vmid):
    """The container's record, or None when vmid is not on this node."""
    if not os.path.exists(conf_path(node_dir, vmid)):
        return None
    return _read(node_dir, vmid)


def _read(node_dir, vmid):
    ct = read_json(config_path(node_dir, vmid))
    if ct is not None:
        ct["node_dir"] = node_dir
    return ct


def lxcpath(node_dir):
    """The node's lxcpath (Proxmox: /var/lib/lxc); each container has LXCPATH/VMID/config."""
    return os.path.join(node_dir, "lxcpath")


def lxc_info(node_dir, vmid):
    """(state, init pid as this process's pid namespace sees it) from the real lxc-info."""
    proc = subprocess.run(["lxc-info", "-P", lxcpath(node_dir), "-n", str(vmid), "-s", "-p", "-H"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          universal_newlines=True, check=False)
    state, pid = "STOPPED", None
    for line in proc.stdout.splitlines():
        key, dummy, value = line.partition(":")
        if key == "State":
            state = value.strip()
        elif key == "PID" and value.strip().isdigit():
            pid = int(value.strip())
    return state, pid


def is_running(ct):
    if not ct:
        return False
    return lxc_info(ct["node_dir"], ct["vmid"])[0] == "RUNNING"


def init_pid(ct):
    """(pid of the container's init as its node sees it (lxc-info), the same on the host), or (None, None)."""
    state, node_pid = lxc_info(ct["node_dir"], ct["vmid"])
    if state != "RUNNING" or not node_pid:
        return None, None
    if os.stat("/proc/self/ns/pid").st_ino == node_config(ct["node_dir"]).get("pidns"):
        return node_pid, node_pid
    # LXC answers in the monitor's (the node's) pid namespace: find that pid in the container's cgroup (or below it:
    # a systemd container's init moves itself to init.scope)
    for pid in cgroup_members(ct["cgroup_path"]):
        nspids = _nspids(pid)
        if len(nspids) >= 2 and nspids[1] == node_pid:
            return node_pid, pid
    return node_pid, None


def cgroup_members(path):
    """The pids of a cgroup and of every cgroup below it."""
    members = []
    for folder, dummy, dummy in os.walk(path):
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                members += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            continue
    return members


def _nspids(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def node_argv(node, argv):
    """argv run inside the node's pid and mount namespaces (as is, when we are in them already)."""
    try:
        here = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        here = None
    if node.get("pidns") and here == node["pidns"]:
        return list(argv)
    return ["nsenter", "-t", str(node["init_pid"]), "--pid", "--mount", "--"] + list(argv)


def start(node_dir, vmid, timeout=30.0):
    """Start the container with lxc-start; returns its record. No-op when already running."""
    return start_many([(node_dir, vmid)], timeout)[0]


def start_many(targets, timeout=30.0):
    """Start several containers at once [(node_dir, vmid), ...]; returns their records."""
    launched = []
    for node_dir, vmid in targets:
        vmid = str(vmid)
        ct = _read(node_dir, vmid)
        if ct is None:
            raise LabError("no container %s in %s" % (vmid, node_dir))
        if is_running(ct):
            launched.append((ct, None))
            continue
        node = node_config(node_dir)
        if _populated(ct["cgroup_path"]):
            _kill_cgroup(ct, node)
        argv = node_argv(node, ["lxc-start", "-P", lxcpath(node_dir), "-n", vmid, "-d",
                                "-o", os.path.join(node_dir, "containers", "%s.log" % vmid), "-l", "WARN"])
        launched.append((ct, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT)))
    return [_finish(ct, proc, timeout) for ct, proc in launched]


def _finish(ct, proc, timeout):
    if proc is None:
        return ct
    out = proc.communicate(timeout=timeout)[0].decode(errors="replace").strip()
    log = os.path.join(ct["node_dir"], "containers", "%s.log" % ct["vmid"])
    if proc.returncode:
        try:
            with open(log) as f:
                out = "\n".join([ln for ln in f.read().splitlines() if " ERROR " in ln][:4]) or out
        except OSError:
            pass
        raise LabError("lxc-start %s failed (%d): %s" % (ct["vmid"], proc.returncode, out))
    deadline = time.monotonic() + timeout
    while True:
        node_pid, pid = init_pid(ct)
        if pid and os.path.exists("/proc/%d/root/run/lab-ready" % pid):
            break
        if time.monotonic() > deadline:
            raise LabError("container %s did not start (init %s; see %s)" % (ct["vmid"], pid, log))
        time.sleep(0.02)
    ct.update(running=True, init_host_pid=pid, init_node_pid=node_pid, pidns_inode=os.stat("/proc/%d/ns/pid" % pid).st_ino)
    write_json(config_path(ct["node_dir"], ct["vmid"]), {k: v for k, v in ct.items() if k != "node_dir"})
    return ct


def _populated(cgroup_path):
    try:
        with open(os.path.join(cgroup_path, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False


def freezer_dir(ct):
    """The container's own cgroup in the v1 freezer hierarchy (the `stuck` groups live below it)."""
    return ct.get("freezer_path")


def freezer_groups(ct):
    root = freezer_dir(ct)
    if not root or not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith("stuck-")]


def thaw(group):
    try:
        with open(os.path.join(group, "freezer.state"), "w") as f:
            f.write("THAWED")
    except FileNotFoundError:
        pass


def _kill_cgroup(ct, node, timeout=10.0):
    cg = ct["cgroup_path"]
    groups = freezer_groups(ct)
    for group in groups:
        thaw(group)
    if os.path.isdir(cg):
        with open(os.path.join(cg, "cgroup.kill"), "w") as f:
            f.write("1")
    deadline = time.monotonic() + timeout
    while _populated(cg):
        if time.monotonic() > deadline:
            raise LabError("container %s: processes left in %s" % (ct["vmid"], cg))
        time.sleep(0.02)
    for group in groups:
        try:
            os.rmdir(group)
        except OSError:
            pass


class StopTimeout(LabError):
    """lxc-stop did not see the container stop (a frozen task keeps it up)."""


def lxc_stop(node_dir, vmid, kill=True, timeout=None):
    """The real lxc-stop; raises StopTimeout when it runs past timeout."""
    argv = ["lxc-stop", "-P", lxcpath(node_dir), "-n", str(vmid)]
    argv += ["--kill"] if kill else ["--timeout", str(int(timeout or 10))]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout + 5 if timeout else None, check=False)
    except subprocess.TimeoutExpired:
        raise StopTimeout("command '%s' failed: got timeout" % " ".join(argv))
    return proc.returncode, proc.stdout.decode(errors="replace").strip()


def stop(node_dir, vmid, graceful_timeout=0.0, thaw_first=True, timeout=30.0):
    """Stop the container: lxc-stop (clean halt first when graceful), then --kill.

    thaw_first (labctl restart, down) thaws its `stuck` freezers so SIGKILL lands; pct stop
    does not, and a frozen task makes lxc-stop time out as on Proxmox."""
    path = config_path(node_dir, vmid)
    ct = _read(node_dir, vmid)
    if thaw_first:
        for group in freezer_groups(ct):
            thaw(group)
    if graceful_timeout and is_running(ct):
        lxc_stop(node_dir, vmid, kill=False, timeout=graceful_timeout)
    if is_running(ct):
        lxc_stop(node_dir, vmid, kill=True, timeout=timeout)
    if thaw_first:
        _kill_cgroup(ct, node_config(node_dir))
    ct.update(running=False, init_host_pid=None, init_node_pid=None, pidns_inode=None)
    write_json(path, {k: v for k, v in ct.items() if k != "node_dir"})
    return ct


def attach_argv(node_dir, vmid, cmd, keep_env=True):
    """argv that runs cmd in the container through the real lxc-attach (as pct exec does)."""
    return ["lxc-attach", "-P", lxcpath(node_dir), "-n", str(vmid), "--keep-env" if keep_env else "--clear-env",
            "--"] + list(cmd)
