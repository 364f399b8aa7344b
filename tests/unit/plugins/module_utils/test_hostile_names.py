"""Issue 41, attacks 2 and 5: what a container or a node user names is never run by the node's root.

Unit-fake worlds (ProcTree): an MPS control lookalike whose namespaces cannot be read, a user's supervisord and
systemd user unit named like the node's daemons, a process whose cgroup cannot be read.
"""
import os

from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml

from conftest import CTL, ctx
from fake_nvml import FakeNvml

USER_SESSION = "0::/user.slice/user-1000.slice/session-3.scope\n"


def node_namespaces(proc, *pids):
    """pids (and the reader, "self") in one pid and one mount namespace: the node's."""
    for pid in ("self",) + pids:
        folder = os.path.join(proc.root, str(pid), "ns")
        os.makedirs(folder, exist_ok=True)
        for kind in ("pid", "mnt"):
            target = os.path.join(proc.root, "node-ns-" + kind)
            open(target, "a").close()
            os.symlink(target, os.path.join(folder, kind))


def tool(folder, name, text="#!/bin/sh\necho 0\n"):
    os.makedirs(str(folder), exist_ok=True)
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def environ(proc, pid, **env):
    with open(os.path.join(proc.root, str(pid), "environ"), "wb") as f:
        f.write(b"".join(("%s=%s" % kv).encode() + b"\0" for kv in sorted(env.items())))


# ---- attack 2: an MPS control lookalike

def test_a_control_lookalike_whose_namespaces_cannot_be_read_is_asked_in_its_container_by_name(proc, tmp_path):
    """Its /proc/PID/exe and ns cannot be read (ENAMETOOLONG, say) and its argv[0] names a script the node has: it
    was taken for the node's own and that script was run by root on the node. Unknown is never the node's: its
    cgroup puts it in container 101, asked there by the tool's name; one whose cgroup names no container is skipped."""
    script = tool(tmp_path / "evil", "nvidia-cuda-mps-control")
    proc.add(300, comm="nvidia-cuda-mps", argv=[script, "-d"], cgroup="0::/lxc/101/ns\n")
    proc.add(301, comm="nvidia-cuda-mps", argv=[script, "-d"], cgroup="0::/system.slice/evil.service\n")
    environ(proc, 300, CUDA_MPS_PIPE_DIRECTORY="/tmp/pipe")
    controls = mps.find_controls(proc.root, node_view=True)
    assert controls == [{"pid": 300, "binary": "nvidia-cuda-mps-control", "env": {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/pipe"},
                         "vmid": "101"}], controls


def test_a_control_daemon_of_the_node_is_roots_and_asked_with_the_tool_of_a_system_folder(proc, tmp_path, monkeypatch):
    """In the node's namespaces: a user's lookalike is skipped; root's is asked with the tool of a fixed system
    folder, never the one its argv[0] names."""
    script = tool(tmp_path / "evil", "nvidia-cuda-mps-control")
    system = tool(tmp_path / "usr-bin", "nvidia-cuda-mps-control")
    monkeypatch.setattr(mps, "BIN_DIRS", (str(tmp_path / "usr-bin"),))
    proc.add(302, comm="nvidia-cuda-mps", argv=[script, "-d"], uid=1000, cgroup=USER_SESSION)
    proc.add(303, comm="nvidia-cuda-mps", argv=[script, "-d"], uid=0, cgroup="0::/system.slice/nvidia-mps.service\n")
    node_namespaces(proc, 302, 303)
    controls = mps.find_controls(proc.root, node_view=True)
    assert [(c["pid"], c["vmid"], c["binary"]) for c in controls] == [(303, None, system)], controls


def test_a_containers_daemon_is_asked_inside_it_with_its_own_tool_by_name(monkeypatch):
    calls = []
    monkeypatch.setattr(mps.helperproc, "run_bounded", lambda argv, timeout, env=None: calls.append(argv) or (0, "0"))
    control = {"pid": 300, "binary": "nvidia-cuda-mps-control", "env": {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/p"}, "vmid": "101"}
    assert mps.ask(control, "get_server_list") == (True, "0")
    argv = calls[0]
    assert argv[:3] == ["lxc-attach", "-n", "101"] and "--clear-env" in argv
    shell = ["sh", "-c", 'printf "%s\\n" "$1" | exec "$0"', "nvidia-cuda-mps-control", "get_server_list"]
    assert argv[argv.index("--") + 1:] == shell


# ---- attack 5: names chosen by unprivileged users

def test_a_users_supervisord_program_named_like_a_node_daemon_is_no_node_service(proc, tmp_path):
    """A local user runs `nvidia-persistenced` under a supervisord of its own, with a supervisorctl beside it: root
    ran that supervisorctl for a reset (stop_services). A node service's processes are root's: none here."""
    home = tmp_path / "home" / "bin"
    supervisord = tool(home, "supervisord")
    tool(home, "supervisorctl")
    proc.add(39, comm="supervisord", uid=1000, argv=["/usr/bin/python3", supervisord], cgroup=USER_SESSION)
    proc.add(40, comm="nvidia-persiste", ppid=39, uid=1000, cgroup=USER_SESSION)
    environ(proc, 40, SUPERVISOR_PROCESS_NAME="nvidia-persistenced", SUPERVISOR_GROUP_NAME="nvidia-persistenced")
    node_namespaces(proc, 39, 40)
    record = {"pid": 40, "ppid": 39, "container": node.HOST, "cgroup": USER_SESSION[3:].strip()}
    assert stopsets.node_service(record, proc.root) is None


def test_a_user_unit_named_like_a_node_service_is_no_node_service(proc):
    """A user's systemd unit pveproxy.service (user.slice/user@1000.service/...): root ran systemctl stop
    pveproxy.service. Node services come from system units only."""
    cgroup = "/user.slice/user-1000.slice/user@1000.service/app.slice/pveproxy.service"
    proc.add(41, comm="nvidia-persiste", uid=0, cgroup="0::%s\n" % cgroup)
    node_namespaces(proc, 41)
    assert stopsets.node_service({"pid": 41, "ppid": 1, "container": node.HOST, "cgroup": cgroup}, proc.root) is None


def test_a_root_system_service_of_the_node_is_stopped_with_the_managers_tool_of_a_system_folder(proc, tmp_path, monkeypatch):
    monkeypatch.setattr(node, "SYSTEM_BIN_DIRS", (str(tmp_path / "usr-bin"),))
    systemctl = tool(tmp_path / "usr-bin", "systemctl")
    supervisorctl = tool(tmp_path / "usr-bin", "supervisorctl")
    cgroup = "/system.slice/nvidia-persistenced.service"
    proc.add(42, comm="nvidia-persiste", uid=0, cgroup="0::%s\n" % cgroup)
    proc.add(43, comm="supervisord", uid=0, argv=["/usr/bin/python3", "/usr/bin/supervisord", "-c", "/etc/s.conf"],
             cgroup="0::/supervisor\n")
    proc.add(44, comm="nvidia-persiste", ppid=43, uid=0, cgroup="0::/supervisor\n")
    environ(proc, 44, SUPERVISOR_PROCESS_NAME="nvidia-persistenced")
    node_namespaces(proc, 42, 43, 44)
    unit = stopsets.node_service({"pid": 42, "ppid": 1, "container": node.HOST, "cgroup": cgroup}, proc.root)
    assert unit["stop"] == [systemctl, "stop", "nvidia-persistenced.service"], unit
    program = stopsets.node_service({"pid": 44, "ppid": 43, "container": node.HOST, "cgroup": "/supervisor"},
                                    proc.root)
    assert program["stop"] == [supervisorctl, "-c", "/etc/s.conf", "stop", "nvidia-persistenced:nvidia-persistenced"]


def test_a_system_units_daemon_that_dropped_root_is_still_its_service_and_a_users_supervisord_never(
        proc, tmp_path, monkeypatch):
    """Debian's nvidia-persistenced runs as its own user in a system unit: only the system manager puts a process in
    system.slice, so the unit is a node service whatever the uid; a non-root supervisord's program never is."""
    monkeypatch.setattr(node, "SYSTEM_BIN_DIRS", (str(tmp_path / "usr-bin"),))
    systemctl = tool(tmp_path / "usr-bin", "systemctl")
    tool(tmp_path / "usr-bin", "supervisorctl")
    cgroup = "/system.slice/nvidia-persistenced.service"
    proc.add(45, comm="nvidia-persiste", uid=112, cgroup="0::%s\n" % cgroup)
    proc.add(46, comm="supervisord", uid=1000, argv=["/usr/bin/python3", "/usr/bin/supervisord"], cgroup="0::/supervisor\n")
    proc.add(47, comm="nvidia-persiste", ppid=46, uid=1000, cgroup="0::/supervisor\n")
    environ(proc, 47, SUPERVISOR_PROCESS_NAME="nvidia-persistenced")
    # red team: a user's cron job (or a mail pipe) runs in a system unit under the user's uid, named as it likes
    jobs = ((48, "/system.slice/cron.service"), (49, "/system.slice/system-postfix.slice/postfix@-.service"))
    for pid, job in jobs:
        proc.add(pid, comm="nvidia-persiste", uid=1000, cgroup="0::%s\n" % job)
    node_namespaces(proc, 45, 46, 47, 48, 49)
    unit = stopsets.node_service({"pid": 45, "ppid": 1, "container": node.HOST, "cgroup": cgroup}, proc.root)
    assert unit["stop"] == [systemctl, "stop", "nvidia-persistenced.service"], unit
    assert stopsets.node_service({"pid": 47, "ppid": 46, "container": node.HOST, "cgroup": "/supervisor"}, proc.root) is None
    for pid, job in jobs:
        assert stopsets.node_service({"pid": pid, "ppid": 1, "container": node.HOST, "cgroup": job}, proc.root) is None, job


def test_a_process_whose_cgroup_cannot_be_read_is_unknown_never_the_nodes(proc, monkeypatch):
    """Its cgroup file unreadable: it was a process of the node (host), signalled with host_processes and a node
    daemon for the reset. It is unknown: out of every scope, no node service."""
    proc.add(50, comm="nvidia-persiste", maps=ctx(0) + [CTL], fds=["/dev/nvidia0"], uid=0)
    os.unlink(os.path.join(proc.root, "50", "cgroup"))
    node_namespaces(proc, 50)
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: {})
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 600}])), proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    record = [h for h in engine.snapshot([0]).holders if h["pid"] == 50][0]
    assert record["container"] is None, record["container"]
    assert node.Scope([101], host_processes=True, proc_root=proc.root).reason(record) == "its container cannot be read"
    assert stopsets.node_service(record, proc.root) is None
    assert node.container_of_pid(50, proc.root) is None


def test_a_user_slice_before_lxc_names_no_container():
    assert node.where_of_cgroup("/user.slice/user-1000.slice/user@1000.service/lxc/101/ns") is None
    assert node.where_of_cgroup("/lxc/101/ns/user.slice/x.service") == "101"
    assert node.where_of_cgroup("/gpuops-lab-ab/pve1/lxc/101/ns") == "101"
    assert node.where_of_cgroup("/system.slice/pvedaemon.service") == node.HOST
    assert node.where_of_cgroup(None) is None and node.where_of_cgroup("") is None
