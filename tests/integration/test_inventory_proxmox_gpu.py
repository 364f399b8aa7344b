"""gpuops.fleet.proxmox_gpu against the lab's Proxmox REST API (real HTTPS, real lab nodes and containers).

Real ansible-inventory and ansible through gpuops.fleet.pct; start, stop and migrate change the live
lab and the inventory follows. Runs as root. One lab of its own (LAB_ID), always torn down.
"""

import json
import os
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
VENV_BIN = os.path.join(REPO, ".venv", "bin")
LAB_ID = "invapi%04x" % (os.getpid() & 0xFFFF)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root")


def labctl(*args, check=True):
    proc = subprocess.run([LABCTL] + list(args), env=dict(os.environ, LAB_ID=LAB_ID), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=120, check=False)
    if check and proc.returncode:
        raise AssertionError("labctl %s failed (%d): %s%s" % (" ".join(args), proc.returncode, proc.stdout, proc.stderr))
    return proc


@pytest.fixture(scope="module")
def lab():
    try:
        labctl("up", "--nodes", "2", "--containers", "2", "--gpus", "4", "--layout", "102=", "--layout", "201=2,3")
        st = json.loads(labctl("status").stdout)
        st["api_inventory"] = labctl("inventory", "--api").stdout.strip()
        yield st
    finally:
        labctl("down", check=False)


def ansible_env(**extra):
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_INVENTORY_UNPARSED_FAILED="True",
               ANSIBLE_NOCOLOR="1", ANSIBLE_PYTHON_INTERPRETER="auto_silent")
    env.pop("ANSIBLE_INVENTORY_ENABLED", None)
    env.update(extra)
    return env


def inventory(path, check=True, **env):
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-inventory"), "-i", path, "--list"], cwd=REPO,
                          env=ansible_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120, check=False)
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr
    return plain(json.loads(proc.stdout))


def plain(value):
    """ansible-inventory shows unsafe values as {'__ansible_unsafe': value}; unwrap them."""
    if isinstance(value, dict):
        if set(value) == {"__ansible_unsafe"}:
            return value["__ansible_unsafe"]
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def unsafe_keys(listed, host):
    return {k for k, v in listed["_meta"]["hostvars"][host].items() if isinstance(v, dict) and "__ansible_unsafe" in v}


def variant(lab, tmp_path, name="variant.proxmox_gpu.yml", **changes):
    """A copy of the lab's plugin config with some options changed (None removes one)."""
    with open(lab["api_inventory"]) as f:
        conf = yaml.safe_load(f)
    for key, value in changes.items():
        if value is None:
            conf.pop(key, None)
        else:
            conf[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(conf))
    return str(path)


def api_call(lab, method, path, data=None, headers=None):
    """(HTTP status, data) from the lab API, trusting its certificate through the CA file."""
    ctx = ssl.create_default_context(cafile=lab["api"]["ca"])
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    req = urllib.request.Request(lab["api"]["url"] + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            return resp.status, json.loads(resp.read())["data"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.reason


def secret(lab, name):
    with open(os.path.join(lab["state"], "api", name)) as f:
        return f.read().strip()


def token_header(lab):
    return {"Authorization": "PVEAPIToken=root@pam!lab=%s" % secret(lab, "token")}


def wait_task(lab, node, upid):
    for dummy in range(300):
        code, task = api_call(lab, "GET", "/nodes/%s/tasks/%s/status" % (node, urllib.parse.quote(upid, safe="")),
                              headers=token_header(lab))
        assert code == 200, task
        if task["status"] == "stopped":
            return task
        time.sleep(0.05)
    raise AssertionError("task %s still running" % upid)


def run_ansible(path, pattern, *args):
    return subprocess.run([os.path.join(VENV_BIN, "ansible"), "-i", path, pattern] + list(args), cwd=REPO,
                          env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=180, check=False)


def test_status_names_the_api_and_the_inventory_file(lab):
    assert lab["api"]["alive"]
    assert lab["api"]["url"] == "https://%s:8006/api2/json" % lab["nodes"]["pve1"]["address"]
    assert lab["api_inventory"] == os.path.join(lab["state"], "lab.proxmox_gpu.yml")
    with open(lab["api_inventory"]) as f:
        conf = yaml.safe_load(f)
    assert conf["plugin"] == "gpuops.fleet.proxmox_gpu" and conf["ca_path"] == lab["api"]["ca"]


def test_api_auth_like_pve(lab):
    assert api_call(lab, "GET", "/cluster/status") == (401, "No ticket")
    wrong_token = {"Authorization": "PVEAPIToken=root@pam!lab=wrong"}
    assert api_call(lab, "GET", "/cluster/status", headers=wrong_token) == (401, "invalid token value!")
    assert api_call(lab, "POST", "/access/ticket", {"username": "root@pam", "password": "wrong"})[0] == 401
    code, login = api_call(lab, "POST", "/access/ticket", {"username": "root@pam", "password": secret(lab, "password")})
    assert code == 200 and login["username"] == "root@pam" and login["CSRFPreventionToken"]
    cookie = {"Cookie": "PVEAuthCookie=" + urllib.parse.quote(login["ticket"])}
    code, status = api_call(lab, "GET", "/cluster/status", headers=cookie)
    assert code == 200
    nodes = {n["name"]: n for n in status if n["type"] == "node"}
    assert {n: (v["ip"], v["online"]) for n, v in nodes.items()} == {
        "pve1": (lab["nodes"]["pve1"]["address"], 1), "pve2": (lab["nodes"]["pve2"]["address"], 1)}
    # Writes with a ticket need the CSRF token, as in PVE.
    assert api_call(lab, "POST", "/nodes/pve1/lxc/101/status/start", {}, headers=cookie) == (
        401, "Permission denied - invalid csrf token")


def test_api_reads_the_live_lab(lab):
    code, resources = api_call(lab, "GET", "/cluster/resources?type=vm", headers=token_header(lab))
    assert code == 200
    by_vmid = {r["vmid"]: r for r in resources}
    assert sorted(by_vmid) == [101, 102, 201, 202]
    assert by_vmid[201] == dict(by_vmid[201], id="lxc/201", type="lxc", node="pve2", name="ct201",
                                status="running", template=0, tags="gpu")
    assert "tags" not in by_vmid[102]  # no GPU in its layout, no gpu tag
    code, config = api_call(lab, "GET", "/nodes/pve2/lxc/201/config", headers=token_header(lab))
    assert code == 200 and config["hostname"] == "ct201"
    assert config["dev0"] == "/dev/nvidia2" and config["dev1"] == "/dev/nvidia3"
    assert ["lxc.cgroup2.devices.allow", "c 195:* rwm"] in config["lxc"] and len(config["digest"]) == 40
    code, current = api_call(lab, "GET", "/nodes/pve2/lxc/201/status/current", headers=token_header(lab))
    assert code == 200 and current["status"] == "running"
    assert current["pid"] == lab["nodes"]["pve2"]["containers"]["201"]["init_host_pid"]
    code, reason = api_call(lab, "GET", "/nodes/pve1/lxc/201/config", headers=token_header(lab))
    assert (code, reason) == (500, "Configuration file 'nodes/pve1/lxc/201.conf' does not exist")


def test_inventory_lists_running_containers_on_their_nodes(lab):
    listed = inventory(lab["api_inventory"])
    hv = listed["_meta"]["hostvars"]
    assert sorted(hv) == ["ct101", "ct102", "ct201", "ct202"]
    assert sorted(listed["gpu_containers"]["hosts"]) == ["ct101", "ct201", "ct202"]
    assert sorted(listed["proxmox_node_pve1"]["hosts"]) == ["ct101", "ct102"]
    assert sorted(listed["proxmox_node_pve2"]["hosts"]) == ["ct201", "ct202"]
    ct = hv["ct201"]
    assert ct["ansible_connection"] == "gpuops.fleet.pct" and ct["pct_vmid"] == 201
    assert ct["ansible_host"] == lab["nodes"]["pve2"]["address"] and ct["proxmox_node"] == "pve2"
    assert ct["proxmox_gpu_devices"] == ["/dev/nvidia2", "/dev/nvidia3"] and ct["proxmox_gpu_minors"] == [2, 3]
    assert ct["proxmox_tags"] == ["gpu"] and hv["ct102"]["proxmox_gpu_devices"] == []
    assert {"ansible_host", "proxmox_node", "proxmox_name"} <= unsafe_keys(json.loads(subprocess.run(
        [os.path.join(VENV_BIN, "ansible-inventory"), "-i", lab["api_inventory"], "--list"], cwd=REPO,
        env=ansible_env(), stdout=subprocess.PIPE, check=True).stdout), "ct201")


def test_ping_through_the_inventory(lab):
    proc = run_ansible(lab["api_inventory"], "gpu_containers", "-m", "ansible.builtin.ping")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == 3 and '"ping": "pong"' in proc.stdout


def test_ticket_login_tag_filter_and_explicit_enable(lab, tmp_path):
    path = variant(lab, tmp_path, token_id=None, token_secret=None, password=secret(lab, "password"),
                   tags=["gpu"], keyed_groups=[{"key": "proxmox_tags", "prefix": "tag"}])
    listed = inventory(path, ANSIBLE_INVENTORY_ENABLED="gpuops.fleet.proxmox_gpu")
    assert sorted(listed["_meta"]["hostvars"]) == ["ct101", "ct201", "ct202"]
    assert sorted(listed["tag_gpu"]["hosts"]) == ["ct101", "ct201", "ct202"]


def test_file_name_must_match(lab, tmp_path):
    path = variant(lab, tmp_path, name="lab.yml")
    proc = inventory(path, check=False, ANSIBLE_INVENTORY_ENABLED="gpuops.fleet.proxmox_gpu")
    assert proc.returncode != 0 and "proxmox_gpu" not in proc.stdout


def test_bad_password_is_a_clear_error(lab, tmp_path):
    path = variant(lab, tmp_path, token_id=None, token_secret=None, password="not-the-password")
    proc = inventory(path, check=False)
    assert proc.returncode != 0
    assert "authentication failed for root@pam" in proc.stderr, proc.stderr


def test_bad_token_is_a_clear_error(lab, tmp_path):
    proc = inventory(variant(lab, tmp_path, token_secret="0" * 32), check=False)
    assert proc.returncode != 0 and "authentication failed for root@pam" in proc.stderr, proc.stderr


def test_untrusted_certificate_is_refused(lab, tmp_path):
    proc = inventory(variant(lab, tmp_path, ca_path=None), check=False)
    assert proc.returncode != 0 and "TLS certificate" in proc.stderr and "not trusted" in proc.stderr, proc.stderr
    listed = inventory(variant(lab, tmp_path, ca_path=None, validate_certs=False))
    assert "ct101" in listed["_meta"]["hostvars"]


def test_stopped_container_is_left_out(lab):
    headers = token_header(lab)
    code, upid = api_call(lab, "POST", "/nodes/pve2/lxc/202/status/stop", {}, headers=headers)
    assert code == 200 and upid.startswith("UPID:pve2:") and ":vzstop:202:" in upid
    try:
        assert wait_task(lab, "pve2", upid)["exitstatus"] == "OK"
        assert api_call(lab, "GET", "/nodes/pve2/lxc/202/status/current", headers=headers)[1]["status"] == "stopped"
        assert labctl("exec", "--node", "pve2", "--vmid", "202", "--", "true", check=False).returncode != 0
        listed = inventory(lab["api_inventory"])
        assert "ct202" not in listed["_meta"]["hostvars"]
        assert sorted(listed["proxmox_node_pve2"]["hosts"]) == ["ct201"]
        code, reason = api_call(lab, "POST", "/nodes/pve2/lxc/202/status/stop", {}, headers=headers)
        assert (code, reason) == (500, "CT 202 not running")
    finally:
        code, upid = api_call(lab, "POST", "/nodes/pve2/lxc/202/status/start", {}, headers=headers)
        assert code == 200 and wait_task(lab, "pve2", upid)["exitstatus"] == "OK"
    assert "ct202" in inventory(lab["api_inventory"])["_meta"]["hostvars"]
    assert labctl("exec", "--node", "pve2", "--vmid", "202", "--", "true").returncode == 0


def test_migrated_container_is_found_on_its_new_node(lab, tmp_path):
    """labctl migrate moves the config (and the running container) to pve2, like pct migrate --restart."""
    old = inventory(lab["api_inventory"])["_meta"]["hostvars"]["ct101"]
    assert old["proxmox_node"] == "pve1"
    moved = json.loads(labctl("migrate", "--vmid", "101", "--to", "pve2").stdout)
    assert moved["from"] == "pve1" and moved["to"] == "pve2" and moved["running"]
    listed = inventory(lab["api_inventory"])
    ct = listed["_meta"]["hostvars"]["ct101"]
    assert ct["proxmox_node"] == "pve2" and ct["ansible_host"] == lab["nodes"]["pve2"]["address"]
    assert "ct101" in listed["proxmox_node_pve2"]["hosts"]
    assert "ct101" not in listed.get("proxmox_node_pve1", {}).get("hosts", [])
    proc = run_ansible(lab["api_inventory"], "ct101", "-m", "ansible.builtin.command", "-a", "hostname")
    assert proc.returncode == 0 and "ct101" in proc.stdout, proc.stdout + proc.stderr
    # The old address is what a static inventory would still hold: pct there no longer knows the vmid.
    stale = run_ansible(lab["api_inventory"], "ct101", "-m", "ansible.builtin.ping",
                        "-e", "ansible_host=%s" % lab["nodes"]["pve1"]["address"])
    assert stale.returncode != 0 and "is not on node pve1" in stale.stdout + stale.stderr
    # Back through the API (POST .../migrate, restart mode, as PVE wants for a running container).
    headers = token_header(lab)
    assert api_call(lab, "POST", "/nodes/pve2/lxc/101/migrate", {"target": "pve1"}, headers=headers) == (
        500, "CT is running - use online migration or restart mode")
    code, upid = api_call(lab, "POST", "/nodes/pve2/lxc/101/migrate", {"target": "pve1", "restart": "1"}, headers=headers)
    assert code == 200 and ":vzmigrate:101:" in upid
    assert wait_task(lab, "pve2", upid)["exitstatus"] == "OK"
    ct = inventory(lab["api_inventory"])["_meta"]["hostvars"]["ct101"]
    assert ct["proxmox_node"] == "pve1" and ct["ansible_host"] == lab["nodes"]["pve1"]["address"]
    proc = run_ansible(lab["api_inventory"], "ct101", "-m", "ansible.builtin.ping")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_down_stops_the_api(lab):
    api_pid = lab["api"]["pid"]
    assert os.path.exists("/proc/%d" % api_pid)
    labctl("down")
    address = lab["nodes"]["pve1"]["address"]
    with pytest.raises(OSError):
        socket.create_connection((address, 8006), timeout=2).close()
    assert not alive(api_pid) and not os.path.exists(lab["state"])


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
