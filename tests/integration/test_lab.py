"""The lab itself: containers, fake driver through labctl, lab Proxmox nodes over real sshd.

Real processes, namespaces, cgroups, sshd and supervisord; nothing mocked.
Runs as root. One small lab per module (LAB_ID of its own), always torn down.
"""

import glob
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from _labfixture import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
LAB_ID = "labit%04x" % (os.getpid() & 0xFFFF)
OTHER_LAB_ID = LAB_ID + "b"
MIB = 1536

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root"), pytest.mark.real_lxc]


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
        labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3", "--unprivileged", "102")
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


def driver_gpus(st):
    """The driver's JSON snapshot through its socket: fast enough to watch the free delay."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(os.path.join(st["state"], "driver", "driver.sock"))
        s.sendall(b'{"op": "snapshot", "node": "pve1"}\n')
        return {g["minor"]: g for g in json.loads(s.makefile().read())["gpus"]}


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (OSError, TypeError):
            pass


def ct_map_lines(vmid, pid, minors):
    """grep -c /dev/nvidiaM /proc/PID/maps inside the container, per minor."""
    script = "; ".join("grep -c '/dev/nvidia%d$' /proc/%d/maps" % (m, pid) for m in minors)
    out = labctl("exec", "--node", "pve1", "--vmid", vmid, "--", "sh", "-c", script, check=False).stdout
    return [int(x) for x in out.split()]


def ct_nvml_procs(st, vmid):
    """{index: [pids]} from the real pynvml inside the container."""
    code = ("import json, pynvml as n; n.nvmlInit(); print(json.dumps([[p.pid for p in "
            "n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(i))] "
            "for i in range(n.nvmlDeviceGetCount())]))")
    py = st["nodes"]["pve1"]["containers"][vmid]["python"]
    return dict(enumerate(json.loads(labctl("exec", "--node", "pve1", "--vmid", vmid, "--", py, "-c", code).stdout)))


def tcp_links(pids):
    """Pairs of pids joined by an established TCP connection: socket inodes of /proc/PID/fd matched with
    /proc/PID/net/tcp (the processes' own network namespace)."""
    owner = {}
    for pid in pids:
        for fd in os.listdir("/proc/%d/fd" % pid):
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[int(target[8:-1])] = pid
    ends = {}
    for pid in pids:
        with open("/proc/%d/net/tcp" % pid) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[9]) in owner:
                    ends[(fields[1], fields[2])] = owner[int(fields[9])]
    return {frozenset((pid, ends[(remote, local)])) for (local, remote), pid in ends.items()
            if ends.get((remote, local)) not in (None, pid)}


def test_up_is_idempotent_and_healthy(lab):
    assert lab["healthy"] is True
    again = labjson("status")
    before = {v: c["init_host_pid"] for v, c in lab["nodes"]["pve1"]["containers"].items()}
    labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3", "--unprivileged", "102")
    after = {v: c["init_host_pid"] for v, c in labjson("status")["nodes"]["pve1"]["containers"].items()}
    assert before == after, "a second up must not restart running containers"
    assert again["nodes"]["pve1"]["address"].startswith("127.")


def test_up_restarts_a_dead_container_and_exec_passes_exit_status(lab):
    old = labjson("status")["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: labctl("status", check=False).returncode == 1)
    labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3", "--unprivileged", "102")
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


# ---- several GPUs (GPU_FACTS rows 9-21); ct101 sees minors 0-3, ct102 sees 2, 3 ----

def test_gpu0_workload_maps_every_visible_gpu_nvml_names_it_on_gpu0_only(lab):
    res = labjson("run", "plain", "--node", "pve1", "--vmid", "101", "--gpus", "0", "--mib", "900")
    try:
        assert ct_map_lines("101", res["pids"][0], range(4)) == [3, 2, 2, 2]
        assert ct_nvml_procs(lab, "101") == {0: [res["pids"][0]], 1: [], 2: [], 3: []}
        assert [driver_gpus(lab)[m]["used_mib"] for m in range(4)] == [900, 0, 0, 0]
        # ct102 sees minors 2, 3 only: a workload there maps those two and nothing else.
        other = labjson("run", "plain", "--node", "pve1", "--vmid", "102", "--gpus", "1", "--mib", "64")
        kill_all(other["host_pids"])
        assert ct_map_lines("101", res["pids"][0], range(4)) == [3, 2, 2, 2]
    finally:
        kill_all(res["host_pids"])
    assert wait_until(lambda: all(g["used_mib"] == 0 for g in driver_gpus(lab).values()), timeout=30)


def test_cuda_visible_devices_hides_mappings(lab):
    res = labjson("run", "plain", "--node", "pve1", "--vmid", "101", "--gpus", "1", "--mib", "100",
                  "--cuda-visible-devices", "1,2")
    try:
        assert res["cuda_visible_devices"] == "1,2"
        pid = res["pids"][0]
        assert ct_map_lines("101", pid, range(4)) == [0, 3, 2, 0]
        fds = labctl("exec", "--node", "pve1", "--vmid", "101", "--", "sh", "-c",
                     "ls -l /proc/%d/fd | grep -c '/dev/nvidia0$'" % pid, check=False).stdout
        assert int(fds) == 1, "a hidden GPU keeps an fd, no mapping"
        assert ct_nvml_procs(lab, "101")[1] == [pid]
    finally:
        kill_all(res["host_pids"])
    refused = labctl("run", "plain", "--node", "pve1", "--vmid", "101", "--gpus", "0", "--cuda-visible-devices", "1,2",
                     check=False)
    assert refused.returncode == 1 and "--gpus 0 not among --cuda-visible-devices 1,2" in refused.stderr
    assert wait_until(lambda: driver_gpus(lab)[1]["used_mib"] == 0, timeout=30)


def test_stray_context_on_the_containers_first_gpu(lab):
    res = labjson("run", "stray_context", "--node", "pve1", "--vmid", "102", "--gpus", "1", "--mib", "5638")
    try:
        holder = res["roles"]["holder"]
        gpus = driver_gpus(lab)
        assert gpus[3]["allocations"] == [{"host_pid": holder, "mib": 5638}]
        assert gpus[2]["allocations"] == [{"host_pid": holder, "mib": 518}]  # ct102's index 0
        assert ct_map_lines("102", res["pids"][0], (2, 3)) == [3, 3]
    finally:
        kill_all(res["host_pids"])
    assert wait_until(lambda: driver_gpus(lab)[2]["used_mib"] == driver_gpus(lab)[3]["used_mib"] == 0, timeout=30)


def test_tp_nccl_ranks_linked_and_residue_while_peers_live(lab):
    res = labjson("run", "tp_nccl", "--node", "pve1", "--vmid", "101", "--gpus", "0,1,2,3", "--mib", "3000")
    ranks = [res["roles"]["rank%d" % r] for r in range(4)]
    try:
        assert res["holders"] == ranks
        pairs = {frozenset((a, b)) for i, a in enumerate(ranks) for b in ranks[i + 1:]}
        assert tcp_links([res["roles"]["parent"]] + ranks) == pairs
        assert ct_map_lines("101", res["container_roles"]["rank2"], range(4)) == [2, 2, 3, 2]
        assert ct_nvml_procs(lab, "101") == {r: [res["container_roles"]["rank%d" % r]] for r in range(4)}
        os.kill(ranks[1], signal.SIGKILL)
        assert wait_until(lambda: driver_gpus(lab)[1]["used_mib"] == 291, timeout=30)
        listed = labjson("gpus", "--node", "pve1")[1]
        assert listed["nvml_pids"] == [] and listed["allocations"] == [
            {"host_pid": None, "mib": 291, "residue_of": ranks[1]}]
        assert ct_nvml_procs(lab, "101")[1] == []
        time.sleep(0.5)
        assert driver_gpus(lab)[1]["used_mib"] == 291
    finally:
        kill_all(ranks)
    assert wait_until(lambda: all(g["used_mib"] == 0 for g in driver_gpus(lab).values()), timeout=30), driver_gpus(lab)


def test_two_parents_dead_each_named_on_its_gpu(lab):
    res = labjson("run", "two_parents", "--node", "pve1", "--vmid", "101", "--gpus", "1,2", "--mib", "1000")
    children = [res["roles"]["child0"], res["roles"]["child1"]]
    try:
        assert res["holders"] == children and len(res["dead"]) == 2
        assert res["roles"]["parent0"] is None and res["roles"]["parent1"] is None  # dead: no host pid
        gpus = driver_gpus(lab)
        for i, minor in enumerate((1, 2)):
            named = gpus[minor]["nvml_pids"]
            assert len(named) == 1 and proc_field(named[0], "State") is None
            assert os.getpgid(children[i]) == os.getsid(children[i]) == named[0]
        assert gpus[1]["nvml_pids"] != gpus[2]["nvml_pids"]
        assert ct_nvml_procs(lab, "101") == {0: [], 1: [res["dead"][0]], 2: [res["dead"][1]], 3: []}
        assert ct_map_lines("101", res["container_roles"]["child1"], range(4)) == [2, 2, 3, 2]
    finally:
        kill_all(children)
    assert wait_until(lambda: all(g["used_mib"] == 0 for g in driver_gpus(lab).values()), timeout=30)


def test_ipc_consumer_keeps_the_dead_producers_memory(lab):
    res = labjson("run", "ipc_consumer", "--node", "pve1", "--vmid", "102", "--gpus", "0", "--mib", "6144")
    consumer = res["roles"]["consumer"]
    try:
        assert res["roles"]["producer"] is None and res["holders"] == [consumer]
        gpu2 = driver_gpus(lab)[2]
        assert gpu2["nvml_pids"] == [consumer] and gpu2["used_mib"] == 6144 + 518
        time.sleep(0.4)
        assert driver_gpus(lab)[2]["used_mib"] == 6144 + 518
    finally:
        kill_all([consumer])
    assert wait_until(lambda: driver_gpus(lab)[2]["used_mib"] == 0, timeout=30)


@pytest.mark.timing
def test_free_delay_memory_stays_after_reaping(lab):
    """Never freed before the delay (measured from the kill); with a long delay, still held once reaped."""
    for delay in (0.15, 2.0):
        if delay != 0.15:
            labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3", "--unprivileged", "102",
                   "--free-delay", str(delay))
        try:
            res = labjson("run", "plain", "--node", "pve1", "--vmid", "102", "--gpus", "1", "--mib", "256")
            holder = res["host_pids"][0]
            killed = time.monotonic()
            os.kill(holder, signal.SIGKILL)
            assert wait_until(lambda: not os.path.exists("/proc/%d" % holder), timeout=30, interval=0.002)
            if delay > 1:
                after = driver_gpus(lab)[3]
                assert after["used_mib"] == 256 and after["nvml_pids"] == [holder]  # reaped, not yet freed
            assert wait_until(lambda: driver_gpus(lab)[3]["used_mib"] == 0, timeout=delay + 30, interval=0.01)
            assert time.monotonic() - killed >= delay - 0.05
        finally:
            if delay != 0.15:
                labctl("up", "--nodes", "1", "--containers", "2", "--gpus", "4", "--layout", "102=2,3", "--unprivileged", "102")
    with open(os.path.join(lab["state"], "lab.json")) as f:
        assert json.load(f)["free_delay_s"] == 0.15


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
    # The node has its own pid namespace: lxc-info there gives the pid as the node sees it.
    assert lines[-1].split() == ["PID:", str(labjson("status")["nodes"]["pve1"]["containers"]["101"]["init_node_pid"])]
    res = ssh_node(lab, "FOO='a b' pct exec 101 -- printenv FOO PATH")
    assert res.stdout.splitlines() == ["a b", "/sbin:/bin:/usr/sbin:/usr/bin"]
    res = ssh_node(lab, "pct exec 109 -- true")
    assert res.returncode not in (0, 1)  # a Perl die: errno's value (ENOENT) or 255, never the command's
    assert "Configuration file 'nodes/pve1/lxc/109.conf' does not exist" in res.stderr
    res = ssh_node(lab, "pct stop 102 && pct status 102 && pct exec 102 -- true")
    assert res.returncode not in (0, 1) and "status: stopped" in res.stdout
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
    assert wait_until(lambda: gpu("pve1", 2)["used_mib"] == 0, timeout=30)  # the free delay
    assert not os.path.exists(res["freezer"])


def test_leaked_memory_has_no_process(lab):
    res = labjson("run", "leaked", "--node", "pve1", "--vmid", "102", "--gpus", "0", "--mib", "300")
    assert res["holders"] == [] and res["host_pids"] == []
    g = gpu("pve1", 2)
    assert g["used_mib"] == 300 and g["holders"] == [] and g["nvml_pids"] == []


def test_real_lxc_containers_lxcfs_and_node_pid_namespaces(lab):
    """Issue 10: lxc-start under a per-lab lxcpath, an LXC monitor per container, one unprivileged,
    LXCFS's /proc/uptime inside, and a node that sees only its own processes."""
    lxcpath = os.path.join(lab["state"], "nodes", "pve1", "lxcpath")
    rows = subprocess.run(["lxc-ls", "-P", lxcpath, "--fancy", "-F", "NAME,STATE,UNPRIVILEGED"],
                          stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout.split("\n")[1:]
    assert sorted(r.split() for r in rows if r.strip()) == [["101", "RUNNING", "false"], ["102", "RUNNING", "true"]]
    monitors = subprocess.run(["ps", "-eo", "args"], stdout=subprocess.PIPE, universal_newlines=True,
                              check=True).stdout
    assert sorted(ln.split()[-1] for ln in monitors.splitlines()
                  if ln.startswith("[lxc monitor] %s " % lxcpath)) == ["101", "102"]
    with open(os.path.join(lxcpath, "102", "config")) as f:
        config = f.read().splitlines()
    assert "lxc.idmap = u 0 100000 65536" in config and "lxc.cgroup.dir.container = lxc/102" in config
    init = labjson("status")["nodes"]["pve1"]["containers"]["102"]["init_host_pid"]
    assert os.stat("/proc/%d" % init).st_uid == 100000  # container root is uid 100000 on the node
    with open("/proc/uptime") as f:
        host_uptime = float(f.read().split()[0])
    inside = float(labctl("exec", "--node", "pve1", "--vmid", "102", "--", "cat", "/proc/uptime").stdout.split()[0])
    with open("/proc/%d/stat" % init) as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    assert inside < host_uptime - started + 5 and inside < host_uptime - 1
    mounts = labctl("exec", "--node", "pve1", "--vmid", "101", "--", "cat", "/proc/self/mountinfo").stdout
    assert [ln for ln in mounts.splitlines() if " /proc/uptime " in ln and "lxcfs" in ln]
    # The node's pid namespace: its own processes only (sshd, LXC monitors, containers), not the host's.
    ps = ssh_node(lab, "ps -eo pid=,args=").stdout
    assert "labctl" not in ps and "labdriver" not in ps and "[lxc monitor]" in ps
    assert ps.split()[0] == "1"


def test_unprivileged_container_writes_no_host_file(lab):
    script = ("touch /tmp/u /var/tmp/u /run/u /root/u && echo ok; touch /etc/gpuops-u /usr/gpuops-u 2>&1 | wc -l")
    out = labctl("exec", "--node", "pve1", "--vmid", "102", "--", "sh", "-c", script).stdout.split()
    assert out == ["ok", "2"]
    for path in ("/var/tmp/u", "/root/u", "/etc/gpuops-u", "/usr/gpuops-u"):
        assert not os.path.exists(path)


def test_two_labs_side_by_side(lab):
    try:
        labctl("up", "--nodes", "2", "--containers", "1", "--gpus", "1", "--bare", "101", "--unprivileged", "101",
               "--nvml-pids", "legacy",
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
        assert json.loads(out) == held["node_pids"] != held["pids"]
        # pct shutdown: init stops supervisord and exits; nothing is left in the cgroup.
        res = ssh_node(other, "pct shutdown 201 && pct status 201", node="pve2")
        assert res.stdout.strip() == "status: stopped", res.stderr
        cgroup = other["nodes"]["pve2"]["containers"]["201"]["cgroup"]
        assert not os.path.exists(cgroup2_root() + cgroup), "LXC removes the container's cgroup when it stops"
        bare_py = other["nodes"]["pve1"]["containers"]["101"]["python"]
        assert bare_py == other["state"] + "/venvs/101/bin/python", "a bare python of its own, in STATE"
        res = labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-c", "import psutil",
                     lab_id=OTHER_LAB_ID, check=False)
        assert res.returncode == 1 and "No module named 'psutil'" in res.stderr
        wheels = os.path.join(REPO, ".cache", "wheels")
        labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-m", "pip", "install", "-q", "--no-index",
               "--find-links", wheels, "psutil", lab_id=OTHER_LAB_ID)
        labctl("exec", "--node", "pve1", "--vmid", "101", "--", bare_py, "-c", "import psutil", lab_id=OTHER_LAB_ID)
        # Unprivileged: the install went to the container's own venv (uid 100000), nothing of the host changed.
        site = subprocess.run(["find", other["state"] + "/venvs/101", "-name", "psutil", "-uid", "100000"],
                              stdout=subprocess.PIPE, universal_newlines=True, check=True).stdout
        # .lab/venv-bare is the system python3's (lablib.lab.system_python), whatever the controller's Python
        assert site.strip() and not glob.glob(os.path.join(REPO, ".lab", "venv-bare", "lib", "python3.*", "site-packages",
                                                           "psutil"))
        bare_version = subprocess.run([bare_py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], check=True,
                                      stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()
        assert glob.glob(os.path.join(REPO, ".lab", "venv-bare", "lib", "python" + bare_version, "site-packages")), bare_version
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
