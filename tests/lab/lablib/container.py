"""Start, stop and inspect one lab container (shared by labctl and the node's pct)."""

import os
import select
import signal
import subprocess
import time

from lablib.common import LabError, pid_alive, read_json, write_json

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
    return read_json(config_path(node_dir, vmid))


def is_running(ct):
    return bool(ct and ct.get("running") and pid_alive(ct.get("init_host_pid")))


def _children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def start(node_dir, vmid, timeout=30.0):
    """Start the container's init; returns its record. No-op when already running."""
    return start_many([(node_dir, vmid)], timeout)[0]


def start_many(targets, timeout=30.0):
    """Start several containers at once [(node_dir, vmid), ...]; returns their records."""
    pending = []
    try:
        for node_dir, vmid in targets:
            pending.append(_launch(node_dir, str(vmid)))
        return [_finish(item, timeout) for item in pending]
    finally:
        for item in pending:
            if item.get("read_end") is not None:
                os.close(item["read_end"])


def _launch(node_dir, vmid):
    path = config_path(node_dir, vmid)
    ct = read_json(path)
    if ct is None:
        raise LabError("no container %s in %s" % (vmid, node_dir))
    if is_running(ct):
        return {"ct": ct}
    node = node_config(node_dir)
    if _populated(ct["cgroup_path"]):
        _kill_cgroup(ct, node)
    os.makedirs(ct["cgroup_path"], exist_ok=True)
    read_end, write_end = os.pipe()
    with open(os.path.join(node_dir, "containers", "%s.log" % vmid), "ab") as log:
        launcher = subprocess.Popen([node["python"], "-I", CTINIT, path, "--ready-fd", str(write_end)],
                                    pass_fds=[write_end], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
    os.close(write_end)
    launcher.returncode = 0  # never waited here: it lives on, reparented when we exit
    return {"ct": ct, "path": path, "node_dir": node_dir, "launcher": launcher, "read_end": read_end,
            }


def _finish(item, timeout):
    ct = item["ct"]
    if "launcher" not in item:
        return ct
    read_end, launcher = item["read_end"], item["launcher"]
    ready = select.select([read_end], [], [], timeout)[0]
    line = os.read(read_end, 64) if ready else b""
    os.close(read_end)
    item["read_end"] = None
    if line != b"ready\n":
        try:
            launcher.kill()
        except OSError:
            pass
        raise LabError("container %s did not start (see %s/containers/%s.log)"
                       % (ct["vmid"], item["node_dir"], ct["vmid"]))
    init_pid = None
    for dummy in range(200):
        kids = _children(launcher.pid)
        if kids:
            init_pid = kids[0]
            break
        time.sleep(0.01)
    if init_pid is None:
        raise LabError("container %s: init pid not found" % ct["vmid"])
    ct.update(running=True, init_host_pid=init_pid, launcher_pid=launcher.pid,
              pidns_inode=os.stat("/proc/%d/ns/pid" % init_pid).st_ino)
    write_json(item["path"], ct)
    return ct


def _populated(cgroup_path):
    try:
        with open(os.path.join(cgroup_path, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False


def freezer_groups(node, vmid):
    root = node.get("freezer_root")
    if not root or not os.path.isdir(root):
        return []
    prefix = "stuck-%s-" % vmid
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if d.startswith(prefix)]


def thaw(group):
    try:
        with open(os.path.join(group, "freezer.state"), "w") as f:
            f.write("THAWED")
    except FileNotFoundError:
        pass


def _kill_cgroup(ct, node, timeout=10.0):
    cg = ct["cgroup_path"]
    if os.path.isdir(cg):
        with open(os.path.join(cg, "cgroup.kill"), "w") as f:
            f.write("1")
    groups = freezer_groups(node, ct["vmid"])
    for group in groups:
        thaw(group)
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


def stop(node_dir, vmid, graceful_timeout=0.0):
    """Stop the container: SIGTERM to init when graceful, then kill its whole cgroup."""
    path = config_path(node_dir, vmid)
    ct = read_json(path)
    node = node_config(node_dir)
    if graceful_timeout and is_running(ct):
        try:
            os.kill(ct["init_host_pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + graceful_timeout
        while pid_alive(ct["init_host_pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    _kill_cgroup(ct, node)
    ct.update(running=False, init_host_pid=None, launcher_pid=None, pidns_inode=None)
    write_json(path, ct)
    return ct


def attach_argv(node_dir, vmid, cmd):
    """argv that runs cmd in the container through the lab's lxc-attach."""
    node = node_config(node_dir)
    return [node["python"], "-I", os.path.join(node["lab_dir"], "node", "lxc-attach"),
            "--node-dir", node_dir, "-n", str(vmid), "--"] + list(cmd)
