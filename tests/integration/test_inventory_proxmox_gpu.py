"""gpuops.fleet.proxmox_gpu against the lab's Proxmox REST API (real HTTPS, real lab nodes and containers).

Real ansible-inventory and ansible through gpuops.fleet.pct; start, stop and migrate change the live
lab and the inventory follows. Runs as root. One lab of its own (LAB_ID), always torn down.
"""

import contextlib
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
LAB_ID = os.environ.get("INVAPI_LAB_ID") or "invapi%04x" % (os.getpid() & 0xFFFF)

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


def cts(hostvars):
    """The container hosts of a listing's hostvars (node hosts left out), sorted."""
    return sorted(name for name, hv in hostvars.items() if "ansible_pct_vmid" in hv)


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
    assert cts(hv) == ["ct101", "ct102", "ct201", "ct202"]
    assert sorted(listed["gpu_containers"]["hosts"]) == ["ct101", "ct201", "ct202"]
    assert sorted(listed["proxmox_node_pve1"]["hosts"]) == ["ct101", "ct102"]
    assert sorted(listed["proxmox_node_pve2"]["hosts"]) == ["ct201", "ct202"]
    ct = hv["ct201"]
    assert ct["ansible_connection"] == "gpuops.fleet.pct" and ct["ansible_pct_vmid"] == ct["proxmox_vmid"] == 201
    assert "pct_vmid" not in ct   # the connection's deprecated name: not set by the inventory (issue 45)
    assert ct["ansible_host"] == lab["nodes"]["pve2"]["address"] and ct["proxmox_node"] == "pve2"
    assert ct["proxmox_gpu_devices"] == ["/dev/nvidia2", "/dev/nvidia3"] and ct["proxmox_gpu_minors"] == [2, 3]
    assert ct["proxmox_tags"] == "gpu" and ct["proxmox_tags_parsed"] == ["gpu"] and hv["ct102"]["proxmox_gpu_devices"] == []
    assert {"ansible_host", "proxmox_node", "proxmox_name"} <= unsafe_keys(json.loads(subprocess.run(
        [os.path.join(VENV_BIN, "ansible-inventory"), "-i", lab["api_inventory"], "--list"], cwd=REPO,
        env=ansible_env(), stdout=subprocess.PIPE, check=True).stdout), "ct201")


def test_ping_through_the_inventory(lab):
    proc = run_ansible(lab["api_inventory"], "gpu_containers", "-m", "ansible.builtin.ping")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == 3 and '"ping": "pong"' in proc.stdout


def test_nodes_are_ssh_hosts_in_proxmox_nodes(lab, tmp_path):
    listed = inventory(lab["api_inventory"])
    hv = listed["_meta"]["hostvars"]
    assert sorted(listed["proxmox_nodes"]["hosts"]) == ["pve1", "pve2"]
    for node, vmids in (("pve1", [101, 102]), ("pve2", [201, 202])):
        assert hv[node] == dict(hv[node], ansible_connection="ssh", ansible_host=lab["nodes"][node]["address"],
                                proxmox_node=node, proxmox_node_online=True, proxmox_node_vmids=vmids,
                                lab_node=node, ansible_user="root",
                                ansible_python_interpreter=os.path.join(REPO, ".lab", "venv", "bin", "python"))
        assert "ansible_pct_vmid" not in hv[node] and node not in listed["proxmox_node_%s" % node]["hosts"]
    assert {ct: hv[ct]["proxmox_node_host"] for ct in cts(hv)} == {
        "ct101": "pve1", "ct102": "pve1", "ct201": "pve2", "ct202": "pve2"}
    assert "pve1" not in listed["gpu_containers"]["hosts"]
    # off: containers only, as before
    off = inventory(variant(lab, tmp_path, node_hosts=False))
    assert sorted(off["_meta"]["hostvars"]) == ["ct101", "ct102", "ct201", "ct202"] and "proxmox_nodes" not in off
    assert "proxmox_node_host" not in off["_meta"]["hostvars"]["ct101"]


def test_ping_the_nodes_through_the_inventory(lab):
    """Plain ssh to each node, the module run by the lab venv's python in the node's own PID namespace."""
    proc = run_ansible(lab["api_inventory"], "proxmox_nodes", "-m", "ansible.builtin.ping")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == 2 and proc.stdout.count('"ping": "pong"') == 2, proc.stdout
    proc = run_ansible(lab["api_inventory"], "pve2", "-m", "ansible.builtin.command", "-a", "readlink /proc/self/ns/pid")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.readlink("/proc/self/ns/pid") not in proc.stdout, proc.stdout  # the node's own PID namespace
    # each container's node host is reachable from the container's vars
    proc = run_ansible(lab["api_inventory"], "ct201", "-m", "ansible.builtin.debug",
                       "-a", "msg=node_host={{ hostvars[proxmox_node_host].ansible_host }}")
    assert proc.returncode == 0 and "node_host=%s" % lab["nodes"]["pve2"]["address"] in proc.stdout, proc.stdout + proc.stderr


def test_ticket_login_tag_filter_and_explicit_enable(lab, tmp_path):
    path = variant(lab, tmp_path, token_id=None, token_secret=None, password=secret(lab, "password"),
                   tags=["gpu"], keyed_groups=[{"key": "proxmox_tags_parsed", "prefix": "tag"}])
    listed = inventory(path, ANSIBLE_INVENTORY_ENABLED="gpuops.fleet.proxmox_gpu")
    assert cts(listed["_meta"]["hostvars"]) == ["ct101", "ct201", "ct202"]
    assert sorted(listed["tag_gpu"]["hosts"]) == ["ct101", "ct201", "ct202"]


def test_file_name_must_match(lab, tmp_path):
    """Declined by verify_file for its name alone: the same content under a good name parses."""
    enabled = {"ANSIBLE_INVENTORY_ENABLED": "gpuops.fleet.proxmox_gpu"}
    good = variant(lab, tmp_path, name="good.proxmox_gpu.yml")
    assert "ct101" in inventory(good, **enabled)["_meta"]["hostvars"]
    path = variant(lab, tmp_path, name="lab.yml")
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-inventory"), "-vvv", "-i", path, "--list"], cwd=REPO,
                          env=ansible_env(**enabled), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120, check=False)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert "proxmox_gpu: skipping %s, its name does not end with proxmox_gpu.yml or proxmox_gpu.yaml" % path in out, out
    assert "declined parsing %s as it did not pass its verify_file() method" % path in out, out
    assert "Unable to parse %s as an inventory source" % path in out, out
    assert "Traceback" not in out and "with gpuops.fleet.proxmox_gpu plugin" not in out, out


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
    assert ct["proxmox_node_host"] == "pve2" and listed["_meta"]["hostvars"]["pve2"]["proxmox_node_vmids"] == [101, 201, 202]
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
    assert ct["proxmox_node_host"] == "pve1"
    proc = run_ansible(lab["api_inventory"], "ct101", "-m", "ansible.builtin.ping")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def one_line(text):
    return " ".join(text.split())


def conf_path(lab, node, vmid):
    return os.path.join(lab["state"], "nodes", node, "lxc", "%s.conf" % vmid)


@contextlib.contextmanager
def edited_conf(lab, node, vmid, lines):
    """Lines appended to a container's config (as pct set or an editor would), restored after."""
    path = conf_path(lab, node, vmid)
    with open(path) as f:
        original = f.read()
    try:
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
        yield
    finally:
        with open(path, "w") as f:
            f.write(original)


@contextlib.contextmanager
def api_file(lab, name, data):
    """A file the lab API reads at each request (faults.json, pools.json), removed after."""
    path = os.path.join(lab["state"], "api", name)
    with open(path, "w") as f:
        json.dump(data, f)
    try:
        yield
    finally:
        os.unlink(path)


def listed_hosts(proc):
    assert proc.returncode == 0, proc.stderr
    return plain(json.loads(proc.stdout))["_meta"]["hostvars"]


def test_one_failing_config_leaves_only_that_container_out(lab):
    """The inventory's partial failure: a 5xx on one container's config (it is migrating) skips it, with a warning."""
    fault = {"path": "^/nodes/pve2/lxc/202/config", "status": 500,
             "message": "Configuration file 'nodes/pve2/lxc/202.conf' does not exist"}
    with api_file(lab, "faults.json", [fault]):
        proc = inventory(lab["api_inventory"], check=False)
    assert cts(listed_hosts(proc)) == ["ct101", "ct102", "ct201"]
    assert "left out CT 202 (ct202) on pve2, its config could not be read" in one_line(proc.stderr), proc.stderr
    assert "202.conf' does not exist" in proc.stderr


def test_one_config_timing_out_leaves_only_that_container_out(lab, tmp_path):
    with api_file(lab, "faults.json", [{"path": "^/nodes/pve1/lxc/102/config", "delay": 4}]):
        started = time.monotonic()
        proc = inventory(variant(lab, tmp_path, timeout=1), check=False)
        took = time.monotonic() - started
    assert cts(listed_hosts(proc)) == ["ct101", "ct201", "ct202"]
    assert "left out CT 102 (ct102) on pve1" in one_line(proc.stderr), proc.stderr
    assert "did not answer GET nodes/pve1/lxc/102/config within 1 s (option timeout)" in one_line(proc.stderr)
    assert took < 30


def test_api_down_is_named(lab, tmp_path):
    """Nothing listens on pve2's port 8006: the inventory fails and says it could not reach the API."""
    url = "https://%s:8006" % lab["nodes"]["pve2"]["address"]
    proc = inventory(variant(lab, tmp_path, url=url), check=False)
    err = one_line(proc.stderr)
    assert proc.returncode != 0
    assert "proxmox_gpu: cannot reach the Proxmox VE API at %s (GET cluster/resources" % url in err, err
    assert "Connection refused" in err


def test_api_5xx_on_the_guest_list_is_named(lab):
    fault = {"path": "^/cluster/resources", "status": 500, "message": "cfs-lock 'file-user_cfg' error: got lock timeout"}
    with api_file(lab, "faults.json", [fault]):
        proc = inventory(lab["api_inventory"], check=False)
    err = one_line(proc.stderr)
    assert proc.returncode != 0
    assert "proxmox_gpu: GET cluster/resources failed: 500 Internal Server Error: cfs-lock 'file-user_cfg' error" in err, err


def test_api_timeout_is_named(lab, tmp_path):
    with api_file(lab, "faults.json", [{"path": "^/cluster/resources", "delay": 5}]):
        proc = inventory(variant(lab, tmp_path, timeout=1), check=False)
    err = one_line(proc.stderr)
    assert proc.returncode != 0
    assert "did not answer GET cluster/resources within 1 s (option timeout)" in err, err


def test_gpus_are_read_from_the_running_config(lab):
    """current=1 (a pending change is not the running container's), devN options before path=, mount entry source
    and destination told apart, device rules read."""
    pending = ["[pve:pending]", "dev0: /dev/nvidia0", "delete: dev1"]
    with edited_conf(lab, "pve2", "201", pending):
        code, merged = api_call(lab, "GET", "/nodes/pve2/lxc/201/config", headers=token_header(lab))
        assert code == 200 and merged["dev0"] == "/dev/nvidia0" and "dev1" not in merged  # as PVE: pending taken in
        code, current = api_call(lab, "GET", "/nodes/pve2/lxc/201/config?current=1", headers=token_header(lab))
        assert code == 200 and (current["dev0"], current["dev1"]) == ("/dev/nvidia2", "/dev/nvidia3")
        extra = ["dev20: mode=0666,path=/dev/nvidia1",
                 "lxc.mount.entry: /dev/nvidia3 dev/nvidia0 none bind,optional,create=file",
                 "lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file",
                 "lxc.cgroup2.devices.deny: c 195:2 rwm"]
        with edited_conf(lab, "pve1", "102", extra):
            hv = inventory(lab["api_inventory"])["_meta"]["hostvars"]
    assert hv["ct201"]["proxmox_gpu_devices"] == ["/dev/nvidia2", "/dev/nvidia3"]
    assert hv["ct201"]["proxmox_gpu_minors"] == [2, 3]
    ct = hv["ct102"]
    assert ct["proxmox_gpu_minors"] == [1, 3] and ct["proxmox_gpu_devices"] == ["/dev/nvidia1", "/dev/nvidia3"]
    assert ct["proxmox_gpu_container_devices"] == ["/dev/nvidia1", "/dev/nvidia0"]
    assert ct["proxmox_gpu_denied_devices"] == ["/dev/nvidia2"]


def test_filters_stopped_containers_and_hostname_template(lab, tmp_path):
    headers = token_header(lab)
    code, upid = api_call(lab, "POST", "/nodes/pve2/lxc/202/status/stop", {}, headers=headers)
    assert code == 200 and wait_task(lab, "pve2", upid)["exitstatus"] == "OK"
    try:
        path = variant(lab, tmp_path, statuses=["running", "stopped"], nodes=["pve2"], hostname="{{ node }}-{{ vmid }}")
        hv = inventory(path)["_meta"]["hostvars"]
        assert cts(hv) == ["pve2-201", "pve2-202"]
        assert hv["pve2-202"]["proxmox_status"] == "stopped" and hv["pve2-202"]["proxmox_gpu_minors"] == [0, 1, 2, 3]
        assert hv["pve2-201"]["proxmox_status"] == "running" and hv["pve2-201"]["ansible_pct_vmid"] == 201
        assert cts(inventory(variant(lab, tmp_path, names=["ct1*"]))["_meta"]["hostvars"]) == ["ct101", "ct102"]
        with api_file(lab, "pools.json", {"ml": [101, 201, 202], "web": [102]}):
            hv = inventory(variant(lab, tmp_path, pools=["ml"], statuses=["stopped"]))["_meta"]["hostvars"]
            assert cts(hv) == ["ct202"] and hv["ct202"]["proxmox_pool"] == "ml"
            hv = inventory(variant(lab, tmp_path, pools=["ml"], names=["ct?01"]))["_meta"]["hostvars"]
            assert cts(hv) == ["ct101", "ct201"]
    finally:
        code, upid = api_call(lab, "POST", "/nodes/pve2/lxc/202/status/start", {}, headers=headers)
        assert code == 200 and wait_task(lab, "pve2", upid)["exitstatus"] == "OK"


def test_token_without_vm_audit_warns(lab, tmp_path):
    path = variant(lab, tmp_path, token_id="noaudit", token_secret=secret(lab, "token-noaudit"))
    proc = inventory(path, check=False)
    assert listed_hosts(proc) == {}
    err = one_line(proc.stderr)
    assert "lists no guests at all to root@pam!noaudit" in err and "lacks VM.Audit" in err, err
    # nor the nodes (/cluster/status needs Sys.Audit): a warning, not a failed inventory
    assert "no node hosts (proxmox_nodes), the nodes could not be read" in err and "Sys.Audit" in err, err


def config_reads(lab):
    with open(os.path.join(lab["state"], "api", "api.log")) as f:
        return [line.split('"GET /api2/json/', 1)[1].split()[0] for line in f if '"GET /api2/json/nodes/' in line
                and "/config" in line]


def test_cache_follows_a_migrated_container(lab, tmp_path):
    path = variant(lab, tmp_path, cache=True, cache_plugin="ansible.builtin.jsonfile",
                   cache_connection=str(tmp_path / "cache"), cache_timeout=3600)
    assert inventory(path)["_meta"]["hostvars"]["ct101"]["proxmox_node"] == "pve1"  # fills the cache
    before = len(config_reads(lab))
    labctl("migrate", "--vmid", "101", "--to", "pve2")
    try:
        hv = inventory(path)["_meta"]["hostvars"]
        assert hv["ct101"]["proxmox_node"] == "pve2" and hv["ct101"]["ansible_host"] == lab["nodes"]["pve2"]["address"]
        assert hv["ct101"]["proxmox_node_host"] == "pve2" and hv["pve1"]["proxmox_node_vmids"] == [102]
        assert hv["ct201"]["proxmox_gpu_minors"] == [2, 3]
        # Only the moved container's config was read again; the others came from the cache.
        assert config_reads(lab)[before:] == ["nodes/pve2/lxc/101/config?current=1"]
        proc = run_ansible(path, "ct101", "-m", "ansible.builtin.command", "-a", "hostname")
        assert proc.returncode == 0 and "ct101" in proc.stdout, proc.stdout + proc.stderr
    finally:
        labctl("migrate", "--vmid", "101", "--to", "pve1")


def test_an_offline_node_is_left_out_with_a_warning(lab):
    """The lab API reports a node online while its sshd lives; the sshd is the node's first process, so killing it
    takes the node down with its containers (as a crashed node). Runs last: the lab is not usable after."""
    sshd = lab["nodes"]["pve2"]["sshd_pid"]
    os.kill(sshd, 9)
    for dummy in range(100):
        if not alive(sshd):
            break
        time.sleep(0.05)
    proc = inventory(lab["api_inventory"], check=False)
    hv = listed_hosts(proc)
    assert "left out of proxmox_nodes the node pve2, offline in /cluster/status" in one_line(proc.stderr), proc.stderr
    assert cts(hv) == ["ct101", "ct102"] and plain(json.loads(proc.stdout))["proxmox_nodes"]["hosts"] == ["pve1"]
    assert hv["pve1"]["proxmox_node_online"] is True
    ping = run_ansible(lab["api_inventory"], "proxmox_nodes", "-m", "ansible.builtin.ping")
    assert ping.returncode == 0 and ping.stdout.count("SUCCESS") == 1, ping.stdout + ping.stderr


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
