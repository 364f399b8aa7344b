"""The lab itself: containers, fake driver through labctl, lab Proxmox nodes over real sshd.

Real processes, namespaces, cgroups, sshd and supervisord; nothing mocked.
Runs as root. One small lab per module (LAB_ID of its own), always torn down.
"""

import json
import os
import signal
import socket
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
LAB_ID = "labit%04x" % (os.getpid() & 0xFFFF)
OTHER_LAB_ID = LAB_ID + "b"
MIB = 1536

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")


def labctl(*args, lab_id=LAB_ID, check=True, timeout=120):
    env = dict(os.environ, LAB_ID=lab_id)
    proc = subprocess.run([LABCTL] + list(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout, check=False)
    if check and proc.returncode:
        raise AssertionError("labctl %s failed (%d): %s%s" % (" ".join(args), proc.returncode, proc.stdout,
                                                              proc.stderr))
    return proc


def labjson(*args, **kw):
    return json.loads(labctl(*args, **kw).stdout)


def gpu(node, minor, lab_id=LAB_ID):
    return next(g for g in labjson("gpus", "--node", node, lab_id=lab_id) if g["minor"] == minor)


def wait_until(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def proc_field(pid, field):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return line.split(":", 1)[1].strip()
    except FileNotFoundError:
        return None
    return None


def cgroup2_root():
    with open("/proc/self/mountinfo") as f:
        return next(line.split()[4] for line in f if line.split(" - ")[1].startswith("cgroup2 "))


def lab_leftovers(lab_id):
    """Processes, mounts, cgroups and files of one lab still on the host."""
    left = []
    mark = "/gpuops-lab-%s/" % lab_id
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/cgroup" % name) as f:
                    if mark in f.read():
                        left.append("process %s" % name)
                with open("/proc/%s/cmdline" % name, "rb") as f:
                    if ("/run/gpuops-lab/%s/" % lab_id).encode() in f.read():
                        left.append("process %s (cmdline)" % name)
            except (FileNotFoundError, ProcessLookupError):
                pass
    with open("/proc/self/mountinfo") as f:
        left += ["mount %s" % line.split()[4] for line in f if "gpuops-lab" in line and lab_id in line]
    for root in (cgroup2_root(), "/sys/fs/cgroup/freezer", "/sys/fs/cgroup"):
        if os.path.isdir(os.path.join(root, "gpuops-lab-" + lab_id)):
            left.append("cgroup %s/gpuops-lab-%s" % (root, lab_id))
    if os.path.exists("/run/gpuops-lab/" + lab_id):
        left.append("state folder /run/gpuops-lab/%s" % lab_id)
    return left


@pytest.fixture(scope="module")
def lab():
    try:
        labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3")
        st = labjson("status")
        yield st
    finally:
        labctl("down", check=False)
        labctl("down", lab_id=OTHER_LAB_ID, check=False)


def ssh_node(st, command, lab_id=LAB_ID, node="pve1", key=None):
    state = st["state"]
    argv = ["ssh", "-i", key or os.path.join(state, "ssh", "id_ed25519"),
            "-o", "UserKnownHostsFile=%s" % os.path.join(state, "ssh", "known_hosts"),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            "root@%s" % st["nodes"][node]["address"], command]
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=30, check=False)


def test_up_is_idempotent_and_healthy(lab):
    assert lab["healthy"] is True
    again = labjson("status")
    before = {v: c["init_host_pid"] for v, c in lab["nodes"]["pve1"]["containers"].items()}
    labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3")
    after = {v: c["init_host_pid"] for v, c in labjson("status")["nodes"]["pve1"]["containers"].items()}
    assert before == after, "a second up must not restart running containers"
    assert again["nodes"]["pve1"]["address"].startswith("127.")


def test_up_restarts_a_dead_container_and_exec_passes_exit_status(lab):
    old = labjson("status")["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: labctl("status", check=False).returncode == 1)
    labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3")
    st = labjson("status")
    assert st["healthy"] and st["nodes"]["pve1"]["containers"]["101"]["init_host_pid"] != old
    lab["nodes"]["pve1"]["containers"]["101"]["init_host_pid"] = st["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    res = labctl("exec", "--node", "pve1", "--vmid", "101", "--", "sh", "-c", "exit 7", check=False)
    assert res.returncode == 7


def test_container_is_a_real_namespace_set(lab):
    ct = lab["nodes"]["pve1"]["containers"]["102"]
    init = ct["init_host_pid"]
    for ns in ("pid", "mnt", "uts", "ipc", "net"):
        assert os.readlink("/proc/%d/ns/%s" % (init, ns)) != os.readlink("/proc/self/ns/%s" % ns)
    assert proc_field(init, "NSpid").split()[-1] == "1"
    with open("/proc/%d/cgroup" % init) as f:
        assert "0::/gpuops-lab-%s/pve1/lxc/102/ns" % LAB_ID in f.read()
    out = labctl("exec", "--node", "pve1", "--vmid", "102", "--",
                 "sh", "-c", "hostname; ls /dev; ls /run; supervisorctl pid; cat /proc/net/dev | wc -l").stdout
    lines = out.split()
    assert lines[0] == "ct102"
    assert "nvidia2" in lines and "nvidia3" in lines and "nvidia0" not in lines and "nvidia1" not in lines
    assert {"nvidiactl", "nvidia-uvm", "nvidia-caps", "null"} <= set(lines)
    assert "nvidia-lab" in lines and "supervisor" in lines
    assert os.path.isfile("/run/gpuops-lab/%s/nodes/pve1/dev/nvidia2" % LAB_ID)
    assert not os.path.exists("/dev/nvidia2") or os.path.realpath("/dev/nvidia2") != "/dev/nvidia2"


def test_defunct_leader_held_and_invisible_to_fuser(lab):
    res = labjson("run", "defunct_leader", "--node", "pve1", "--vmid", "101", "--gpus", "0", "--mib", str(MIB))
    assert res["scenario"] == "defunct_leader"
    leader = res["host_pids"][0]
    assert proc_field(leader, "State").startswith("Z")
    assert int(proc_field(leader, "Threads")) > 1
    g = gpu("pve1", 0)
    assert g["used_mib"] == MIB
    assert leader in g["nvml_pids"]
    fuser = labctl("exec", "--node", "pve1", "--vmid", "101", "--", "fuser", "-v", "/dev/nvidia0", check=False)
    listed = (fuser.stdout + fuser.stderr).split()
    assert str(res["pids"][0]) not in listed and "python" not in listed, fuser.stderr
    os.kill(leader, signal.SIGKILL)
    assert wait_until(lambda: gpu("pve1", 0)["used_mib"] == 0)


def test_layout_maps_indexes_to_minors(lab):
    res = labjson("run", "plain", "--node", "pve1", "--vmid", "102", "--gpus", "1", "--mib", "700")
    g = gpu("pve1", 3)
    assert g["used_mib"] == 700 and g["visible_in"] == {"101": 3, "102": 1}
    py = lab["nodes"]["pve1"]["containers"]["102"]["python"]
    code = ("import pynvml as n; n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(1);"
            "print(n.nvmlDeviceGetCount(), n.nvmlDeviceGetMinorNumber(h),"
            "[p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)])")
    out = labctl("exec", "--node", "pve1", "--vmid", "102", "--", py, "-c", code).stdout.split(None, 2)
    assert out[:2] == ["2", "3"]
    assert json.loads(out[2]) == [res["pids"][0]], "modern driver: container pid inside the container"
    os.kill(res["host_pids"][0], signal.SIGKILL)
    assert wait_until(lambda: gpu("pve1", 3)["used_mib"] == 0)


def test_inventory(lab):
    path = labctl("inventory").stdout.strip()
    assert path == os.path.join(lab["state"], "inventory.yml")
    listed = json.loads(subprocess.run([os.path.join(REPO, ".venv", "bin", "ansible-inventory"), "-i", path,
                                        "--list"], stdout=subprocess.PIPE, check=True).stdout)
    assert sorted(listed["gpu_containers"]["hosts"]) == ["ct101", "ct102"]
    hv = listed["_meta"]["hostvars"]["ct102"]
    assert hv["pct_vmid"] == 102 and hv["lab_node"] == "pve1"
    assert hv["ansible_connection"] == "gpuops.fleet.pct"
    assert hv["ansible_host"] == hv["pve_node_host"] == lab["nodes"]["pve1"]["address"]
    assert hv["ansible_user"] == "root"
    assert os.path.exists(hv["ansible_ssh_private_key_file"])
    assert "UserKnownHostsFile=%s/ssh/known_hosts" % lab["state"] in hv["ansible_ssh_common_args"]
    assert os.access(hv["ansible_python_interpreter"], os.X_OK)


def test_node_ssh_and_pct(lab):
    assert not os.path.exists("/usr/sbin/pct"), "the host itself must not change"
    res = ssh_node(lab, "pct exec 101 -- hostname && ls -l /usr/sbin/pct /usr/bin/lxc-attach && lxc-info -n 101 -p")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "ct101"
    assert lines[-1].split() == ["PID:", str(lab["nodes"]["pve1"]["containers"]["101"]["init_host_pid"])]
    res = ssh_node(lab, "FOO='a b' pct exec 101 -- printenv FOO PATH")
    assert res.stdout.splitlines() == ["a b", "/sbin:/bin:/usr/sbin:/usr/bin"]
    res = ssh_node(lab, "pct exec 109 -- true")
    assert res.returncode == 255
    assert "Configuration file 'nodes/pve1/lxc/109.conf' does not exist" in res.stderr
    res = ssh_node(lab, "pct stop 102 && pct status 102 && pct exec 102 -- true")
    assert res.returncode == 255 and "status: stopped" in res.stdout
    assert "container '102' not running!" in res.stderr
    res = ssh_node(lab, "pct start 102 && pct exec 102 -- hostname && pct list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "ct102"
    assert "102        running" in res.stdout


@pytest.mark.skipif(not os.path.exists("/usr/bin/sudo"), reason="sudo is not installed (apt package sudo)")
def test_node_user_and_sudo(lab):
    state = lab["state"]
    argv = ["ssh", "-i", os.path.join(state, "ssh", "id_ed25519"),
            "-o", "UserKnownHostsFile=%s" % os.path.join(state, "ssh", "known_hosts"), "-o", "BatchMode=yes",
            "gpuops@%s" % lab["nodes"]["pve1"]["address"],
            "id -un; /usr/sbin/pct list; sudo -n /usr/sbin/pct exec 101 -- id -un"]
    res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                         timeout=30, check=False)
    assert res.stdout.split() == ["gpuops", "root"], res.stderr
    assert "please run as root" in res.stderr
    with open("/etc/passwd") as f:
        assert "gpuops" not in f.read(), "the host's accounts must not change"


def test_node_rejects_other_keys(lab, tmp_path):
    key = str(tmp_path / "k")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    res = ssh_node(lab, "true", key=key)
    assert res.returncode == 255 and "Permission denied" in res.stderr


def test_respawn_comes_back(lab):
    res = labjson("run", "respawn", "--node", "pve1", "--vmid", "101", "--gpus", "1", "--mib", "512")
    first = res["roles"]["program"]
    assert res["roles"]["supervisord"] != first
    assert proc_field(first, "PPid") == str(res["roles"]["supervisord"])
    assert first in gpu("pve1", 1)["nvml_pids"]
    os.kill(first, signal.SIGKILL)

    def new_holder():
        pids = gpu("pve1", 1)["nvml_pids"]
        return pids if pids and first not in pids else None

    assert wait_until(new_holder, timeout=15), "supervisord did not restart the program"
    name = res["supervisor_program"]
    labctl("exec", "--node", "pve1", "--vmid", "101", "--", "supervisorctl", "stop", name)
    assert wait_until(lambda: gpu("pve1", 1)["used_mib"] == 0)


def test_stuck_holder_needs_a_container_restart(lab):
    res = labjson("run", "stuck", "--node", "pve1", "--vmid", "101", "--gpus", "2", "--mib", "256")
    holder = res["holders"][0]
    assert proc_field(holder, "State").startswith("D")
    with open("/proc/%d/wchan" % holder) as f:
        assert f.read().strip() not in ("", "0")
    os.kill(holder, signal.SIGKILL)
    time.sleep(0.3)
    assert proc_field(holder, "State").startswith("D"), "SIGKILL must wait while frozen"
    assert gpu("pve1", 2)["used_mib"] == 256
    reset = labctl("exec", "--node", "pve1", "--vmid", "101", "--", "nvidia-smi", "--gpu-reset", "-i", "2",
                   check=False)
    assert reset.returncode != 0
    labctl("restart", "--node", "pve1", "--vmid", "101")
    assert proc_field(holder, "State") is None
    assert gpu("pve1", 2)["used_mib"] == 0
    assert not os.path.exists(res["freezer"])


def test_leaked_memory_has_no_process(lab):
    res = labjson("run", "leaked", "--node", "pve1", "--vmid", "102", "--gpus", "0", "--mib", "300")
    assert res["holders"] == [] and res["host_pids"] == []
    g = gpu("pve1", 2)
    assert g["used_mib"] == 300 and g["holders"] == [] and g["nvml_pids"] == []


def test_two_labs_side_by_side(lab):
    try:
        labctl("up", "--nodes", "2", "--containers", "1", "--gpus", "1", "--bare", "101", "--nvml-pids", "legacy",
               lab_id=OTHER_LAB_ID)
        other = labjson("status", lab_id=OTHER_LAB_ID)
        # Each node's pct sees its own containers only.
        res = ssh_node(other, "pct exec 201 -- hostname; pct exec 101 -- true", node="pve2")
        assert res.stdout.strip() == "ct201"
        assert "Configuration file 'nodes/pve2/lxc/101.conf' does not exist" in res.stderr
        # Legacy driver: NVML inside the container names host pids.
        held = labjson("run", "plain", "--node", "pve2", "--vmid", "201", "--gpus", "0", "--mib", "64",
                       lab_id=OTHER_LAB_ID)
        code = ("import pynvml as n; n.nvmlInit();"
                "print([p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(0))])")
        py = other["nodes"]["pve2"]["containers"]["201"]["python"]
        out = labctl("exec", "--node", "pve2", "--vmid", "201", "--", py, "-c", code, lab_id=OTHER_LAB_ID).stdout
        assert json.loads(out) == held["host_pids"] != held["pids"]
        # pct shutdown: init stops supervisord and exits; nothing is left in the cgroup.
        res = ssh_node(other, "pct shutdown 201 && pct status 201", node="pve2")
        assert res.stdout.strip() == "status: stopped", res.stderr
        cgroup = other["nodes"]["pve2"]["containers"]["201"]["cgroup"]
        with open(cgroup2_root() + cgroup + "/cgroup.procs") as f:
            assert f.read() == ""
        bare_py = other["nodes"]["pve1"]["containers"]["101"]["python"]
        assert bare_py == other["state"] + "/venvs/101/bin/python", "a bare python of its own, in STATE"
        res = labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-c", "import psutil",
                     lab_id=OTHER_LAB_ID, check=False)
        assert res.returncode == 1 and "No module named 'psutil'" in res.stderr
        wheels = os.path.join(REPO, ".cache", "wheels")
        labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-m", "pip", "install", "-q", "--no-index",
               "--find-links", wheels, "psutil", lab_id=OTHER_LAB_ID)
        labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-c", "import psutil", lab_id=OTHER_LAB_ID)
        assert other["nodes"]["pve1"]["address"] != lab["nodes"]["pve1"]["address"]
        assert other["state"] != lab["state"]
        assert ssh_node(other, "pct exec 101 -- hostname", lab_id=OTHER_LAB_ID).stdout.strip() == "ct101"
        assert ssh_node(lab, "pct exec 101 -- hostname").stdout.strip() == "ct101"
    finally:
        labctl("down", lab_id=OTHER_LAB_ID)
    assert lab_leftovers(OTHER_LAB_ID) == []
    assert labjson("status")["healthy"] is True


def test_down_leaves_nothing(lab):
    labjson("run", "stuck", "--node", "pve1", "--vmid", "102", "--gpus", "0", "--mib", "128")
    labjson("run", "tp_server", "--node", "pve1", "--vmid", "101", "--gpus", "0,1", "--mib", "64")
    address = lab["nodes"]["pve1"]["address"]
    labctl("down")
    assert lab_leftovers(LAB_ID) == []
    with pytest.raises(OSError):
        socket.create_connection((address, 22), timeout=1).close()
    assert labctl("status", check=False).returncode == 3
