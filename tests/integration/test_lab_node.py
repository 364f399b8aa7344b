"""Lab nodes as Proxmox VE nodes with NVIDIA GPUs (issue 11's node-side view), through real sshd.

/etc/pve, /dev/nvidia*, NVML and nvidia-smi on the node; reset refused while anything of the node
has the GPU open; locks and HA; the API's stop of a frozen container; the launcher_respawn workload.
Real processes, real ssh; root only; one small lab of its own, always torn down.
"""

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from _labfixture import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
VENV_PY = os.path.join(REPO, ".lab", "venv", "bin", "python")
WORKLOAD = os.path.join(REPO, "tests", "lab", "workloads", "workload.py")
LAB_ID = "labnode%04x" % (os.getpid() & 0xFFFF)
IN_USE = "is currently in use by another process."

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")


def labctl(*args, check=True, timeout=120):
    proc = subprocess.run([LABCTL] + [str(a) for a in args], env=dict(os.environ, LAB_ID=LAB_ID),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=timeout, check=False)
    if check and proc.returncode:
        raise AssertionError("labctl %s failed (%d): %s%s" % (" ".join(map(str, args)), proc.returncode,
                                                              proc.stdout, proc.stderr))
    return proc


def labjson(*args, **kw):
    return json.loads(labctl(*args, **kw).stdout)


@pytest.fixture(scope="module")
def lab():
    try:
        labctl("up", "--nodes", "2", "--containers", "1", "--gpus", "2")
        yield labjson("status")
    finally:
        labctl("down", check=False)


def ssh(st, command, node="pve1", tty=False, timeout=30):
    state = st["state"]
    argv = ["ssh", "-i", os.path.join(state, "ssh", "id_ed25519"),
            "-o", "UserKnownHostsFile=%s" % os.path.join(state, "ssh", "known_hosts"),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    argv += ["-tt"] if tty else []
    argv += ["root@%s" % st["nodes"][node]["address"], command]
    return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout, check=False)


def gpu(node, minor):
    return next(g for g in labjson("gpus", "--node", node) if g["minor"] == minor)


class Api:
    def __init__(self, st):
        info = labjson("status")["api"]
        self.url = info["url"]
        with open(os.path.join(st["state"], "api", "token")) as f:
            self.auth = "PVEAPIToken=root@pam!lab=%s" % f.read().strip()
        self.ctx = ssl.create_default_context(cafile=info["ca"])

    def call(self, method, path, **params):
        data = urllib.parse.urlencode(params).encode() if method == "POST" else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Authorization": self.auth})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
                return resp.status, resp.reason, json.loads(resp.read())["data"]
        except urllib.error.HTTPError as exc:
            return exc.code, exc.reason, None

    def wait_task(self, node, upid, timeout=30):
        quoted = urllib.parse.quote(upid, safe="")

        def stopped():
            task = self.call("GET", "/nodes/%s/tasks/%s/status" % (node, quoted))[2]
            return task if task["status"] == "stopped" else None
        return wait_until(stopped, timeout=timeout, interval=0.2)


# ---- 1a: /etc/pve

def test_etc_pve_shows_the_live_configs_and_ha(lab):
    state = lab["state"]
    with open(os.path.join(state, "nodes", "pve1", "lxc", "101.conf")) as f:
        conf = f.read()
    res = ssh(lab, "cat /etc/pve/lxc/101.conf; echo ==; ls /etc/pve/lxc; echo ==; "
                   "cat /etc/pve/nodes/pve2/lxc/201.conf; echo ==; cat /etc/pve/ha/resources.cfg; echo ==; "
                   "touch /etc/pve/x 2>&1")
    parts = res.stdout.split("==\n")
    assert parts[0] == conf and parts[1].split() == ["101.conf"], res.stdout + res.stderr
    assert "hostname: ct201" in parts[2] and parts[3] == ""  # no HA resource yet: an empty file
    assert "Read-only file system" in parts[4]  # the node's /etc is an overlay; the host's never changes
    if os.path.exists("/etc/pve/lxc"):  # a host that is a Proxmox node itself keeps its own
        assert not os.path.samefile("/etc/pve/lxc", os.path.join(state, "nodes", "pve1", "lxc"))

    assert labjson("lock", "--vmid", 101, "--lock", "backup")["lock"] == "backup"
    labctl("ha", "--vmid", 201)
    res = ssh(lab, "grep ^lock: /etc/pve/lxc/101.conf; cat /etc/pve/ha/resources.cfg")
    assert res.stdout.startswith("lock: backup\nct: 201\n\tstate started\n"), res.stdout
    labctl("lock", "--vmid", 101, "--clear")
    labctl("ha", "--vmid", 201, "--remove")
    res = ssh(lab, "grep -c ^lock: /etc/pve/lxc/101.conf; wc -c < /etc/pve/ha/resources.cfg")
    assert res.stdout.split() == ["0", "0"], res.stdout


def test_migration_moves_the_conf_between_nodes_views(lab):
    labctl("migrate", "--vmid", 201, "--to", "pve1")
    try:
        assert ssh(lab, "ls /etc/pve/lxc").stdout.split() == ["101.conf", "201.conf"]
        assert ssh(lab, "ls /etc/pve/lxc", node="pve2").stdout.split() == []
    finally:
        labctl("migrate", "--vmid", 201, "--to", "pve2")
    assert ssh(lab, "ls /etc/pve/lxc", node="pve2").stdout.split() == ["201.conf"]


# ---- 1b: /dev

def test_node_dev_has_the_fake_devices_and_still_works(lab):
    state = lab["state"]
    names = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
             "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2"]
    res = ssh(lab, "stat -c '%%d %%i' %s" % " ".join("/dev/" + n for n in names))
    wanted = []
    for name in names:
        st = os.stat(os.path.join(state, "nodes", "pve1", "dev", name))
        wanted.append("%d %d" % (st.st_dev, st.st_ino))
    assert res.stdout.split("\n")[:len(names)] == wanted, res.stdout + res.stderr
    init = lab["nodes"]["pve1"]["containers"]["101"]["init_host_pid"]
    in_ct = os.stat("/proc/%d/root/dev/nvidia1" % init)
    assert "%d %d" % (in_ct.st_dev, in_ct.st_ino) == wanted[1]  # the same inode as in the container
    res = ssh(lab, "echo x > /dev/null && head -c 8 /dev/urandom | wc -c && test -c /dev/ptmx && tty", tty=True)
    assert res.returncode == 0 and res.stdout.split()[0] == "8" and "/dev/pts/" in res.stdout, res.stdout + res.stderr
    for path in ("/dev/nvidiactl", "/dev/nvidia-caps"):  # nothing was made on the host
        assert not os.path.exists(path) or not os.path.samefile(path, os.path.join(state, "nodes", "pve1", path[1:]))


# ---- 1c: NVML and nvidia-smi on the node

NVML_PROBE = ("import json, pynvml; pynvml.nvmlInit(); out = []\n"
              "for i in range(pynvml.nvmlDeviceGetCount()):\n"
              "    h = pynvml.nvmlDeviceGetHandleByIndex(i)\n"
              "    out.append([pynvml.nvmlDeviceGetMinorNumber(h), sorted(p.pid for p in "
              "pynvml.nvmlDeviceGetComputeRunningProcesses(h))])\n"
              "print(json.dumps(out))")


def test_nvml_on_the_node_sees_every_gpu_with_node_pids(lab):
    run = labjson("run", "plain", "--node", "pve2", "--vmid", 201, "--gpus", 1, "--mib", 300)
    try:
        res = ssh(lab, "env | grep -c NVIDIA_LAB; %s -c '%s'" % (VENV_PY, NVML_PROBE), node="pve2")
        lines = res.stdout.split("\n")
        assert lines[0] == "0", res.stdout + res.stderr  # no environment variable tells it the node
        assert json.loads(lines[1]) == [[0, []], [1, run["node_holders"]]], res.stdout + res.stderr
        assert run["node_holders"] != run["holders"]  # the node's pid namespace, not the machine's
        res = ssh(lab, "command -v nvidia-smi; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader",
                  node="pve2")
        assert res.stdout.split("\n")[:2] == ["/usr/bin/nvidia-smi", "%d, 300 MiB" % run["node_holders"][0]], res.stdout
        # pve1 sees its own GPUs: nothing of pve2's holder
        assert json.loads(ssh(lab, "%s -c '%s'" % (VENV_PY, NVML_PROBE)).stdout) == [[0, []], [1, []]]
    finally:
        os.kill(run["holders"][0], signal.SIGKILL)
    assert wait_until(lambda: gpu("pve2", 1)["used_mib"] == 0, timeout=30)


# ---- 1d: inventory

def test_inventory_has_proxmox_nodes(lab):
    with open(labctl("inventory").stdout.strip()) as f:
        inv = yaml.safe_load(f)["all"]["children"]
    assert sorted(inv["proxmox_nodes"]["hosts"]) == sorted(inv["pve_nodes"]["hosts"]) == ["pve1", "pve2"]
    for node in ("pve1", "pve2"):
        assert inv["pve_nodes"]["hosts"][node]["ansible_python_interpreter"] == VENV_PY
    assert inv["gpu_containers"]["hosts"]["ct101"]["proxmox_node_host"] == "pve1"
    assert inv["gpu_containers"]["hosts"]["ct201"]["proxmox_node_host"] == "pve2"
    res = ssh(lab, "%s -c 'import psutil, pynvml; print(\"ok\")'" % VENV_PY)
    assert res.stdout.strip() == "ok", res.stderr


# ---- 2: reset

def test_reset_from_the_node_refused_while_anything_has_the_gpu_open(lab):
    labctl("leak", "--node", "pve1", "--gpu", 0, "--mib", 700)
    # an NVML-only client on the node (a monitor) blocks it
    res = ssh(lab, "setsid %s %s monitor --foreground </dev/null >/dev/null 2>&1 & echo $!; sleep 0.7; "
                   "nvidia-smi --gpu-reset -i 0; echo rc=$?" % (VENV_PY, WORKLOAD))
    monitor = int(res.stdout.split()[0])
    assert IN_USE in res.stdout and "rc=255" in res.stdout, res.stdout + res.stderr
    assert ssh(lab, "kill %d" % monitor).returncode == 0
    # a holder in a container, mapping GPU 0 only as visible (its context is on GPU 1), blocks it too
    run = labjson("run", "plain", "--node", "pve1", "--vmid", 101, "--gpus", 1, "--mib", 100)
    try:
        res = ssh(lab, "nvidia-smi --gpu-reset -i 0; echo rc=$?")
        assert IN_USE in res.stdout and "rc=255" in res.stdout, res.stdout
    finally:
        os.kill(run["holders"][0], signal.SIGKILL)
    assert wait_until(lambda: gpu("pve1", 1)["used_mib"] == 0, timeout=30)
    assert gpu("pve1", 0)["leaked_mib"] == 700
    res = ssh(lab, "nvidia-smi --gpu-reset -i 0; echo rc=$?")  # only leaked memory left: allowed, cleared
    assert "was successfully reset." in res.stdout and "rc=0" in res.stdout, res.stdout
    assert gpu("pve1", 0)["used_mib"] == 0


# ---- 3: locks and HA through the API

def test_api_lock_and_ha(lab):
    api = Api(lab)
    labctl("lock", "--vmid", 101, "--lock", "backup")
    try:
        assert api.call("GET", "/nodes/pve1/lxc/101/config")[2]["lock"] == "backup"
        assert api.call("GET", "/nodes/pve1/lxc/101/status/current")[2]["lock"] == "backup"
        assert api.call("POST", "/nodes/pve1/lxc/101/status/stop")[:2] == (500, "CT is locked (backup)")
        labctl("lock", "--vmid", 101, "--lock", "snapshot")
        assert api.call("POST", "/nodes/pve1/lxc/101/status/shutdown")[:2] == (500, "CT is locked (snapshot)")
        code, dummy, upid = api.call("POST", "/nodes/pve1/lxc/101/status/stop", skiplock=1)
        assert code == 200 and api.wait_task("pve1", upid)["exitstatus"] == "OK"
        assert api.call("POST", "/nodes/pve1/lxc/101/status/start")[:2] == (500, "CT is locked (snapshot)")
    finally:
        labctl("lock", "--vmid", 101, "--clear")
    code, dummy, upid = api.call("POST", "/nodes/pve1/lxc/101/status/start")
    assert code == 200 and api.wait_task("pve1", upid)["exitstatus"] == "OK"
    assert "lock" not in api.call("GET", "/nodes/pve1/lxc/101/config")[2]

    assert api.call("GET", "/cluster/ha/resources")[2] == []
    labctl("ha", "--vmid", 101)
    try:
        resources = api.call("GET", "/cluster/ha/resources")[2]
        assert [(r["sid"], r["type"], r["state"]) for r in resources] == [("ct:101", "ct", "started")]
        assert api.call("GET", "/cluster/ha/resources/ct:101")[2]["sid"] == "ct:101"
        assert api.call("GET", "/nodes/pve1/lxc/101/status/current")[2]["ha"]["managed"] == 1
    finally:
        labctl("ha", "--vmid", 101, "--remove")
    assert api.call("GET", "/cluster/ha/resources")[2] == []


# ---- 4: the API's stop of a frozen container times out

def test_api_stop_of_a_stuck_container_fails_in_bounded_time(lab):
    api = Api(lab)
    labjson("run", "stuck", "--node", "pve2", "--vmid", 201, "--gpus", 0, "--mib", 200)
    try:
        code, dummy, upid = api.call("POST", "/nodes/pve2/lxc/201/status/stop", timeout=1)
        assert code == 200
        task = api.wait_task("pve2", upid, timeout=30)
        assert task, "the stop task did not end within 30 s"
        assert task["exitstatus"] != "OK" and "got timeout" in task["exitstatus"], task
        assert "container did not stop" in task["exitstatus"]
        assert gpu("pve2", 0)["used_mib"] == 200  # nothing was thawed behind Proxmox's back
    finally:
        labctl("restart", "--node", "pve2", "--vmid", 201)
    assert wait_until(lambda: gpu("pve2", 0)["used_mib"] == 0, timeout=30)


# ---- 5: launcher_respawn

def comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return None


def workers_of(launcher):
    try:
        with open("/proc/%d/task/%d/children" % (launcher, launcher)) as f:
            return [int(p) for p in f.read().split() if comm(int(p)) == "gpu_worker"]
    except OSError:
        return []


def test_launcher_respawns_its_holder_faster_than_sigkill(lab):
    run = labjson("run", "launcher_respawn", "--node", "pve1", "--vmid", 101, "--gpus", 0, "--mib", 400)
    launcher, holder = run["roles"]["launcher"], run["roles"]["holder"]
    assert run["holders"] == [holder] and run["host_pids"][0] == launcher
    assert comm(launcher) == "gpu_launcher" and comm(holder) == "gpu_worker"
    assert not [fd for fd in os.listdir("/proc/%d/fd" % launcher)
                if "nvidia" in os.readlink("/proc/%d/fd/%s" % (launcher, fd))]
    try:
        old = holder
        for dummy in range(5):
            os.kill(old, signal.SIGKILL)
            new = wait_until(lambda: [p for p in workers_of(launcher) if p != old], timeout=30, interval=0.002)
            assert new, "no new worker after killing %d" % old
            old = new[0]
        assert wait_until(lambda: old in gpu("pve1", 0)["holders"], timeout=30)
        os.kill(launcher, signal.SIGTERM)  # ignored
        time.sleep(0.2)
        assert comm(launcher) == "gpu_launcher" and gpu("pve1", 0)["used_mib"] >= 400
    finally:
        os.kill(launcher, signal.SIGKILL)  # its worker dies with it
    assert wait_until(lambda: gpu("pve1", 0)["used_mib"] == 0, timeout=30)
