"""The lab's Proxmox API (lablib/pveapi.py) over a lab state folder on disk: config parsing, auth, HTTPS answers.

The state folder here holds stopped containers only (no processes); tests/integration/test_inventory_proxmox_gpu.py
runs the API inside a real lab.
"""

import json
import os
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib import lab as lablab
from lablib import pveapi
from lablib.common import write_json

ADDRESS = "127.0.0.1"


def test_parse_conf_splits_keys_and_raw_lxc_lines_and_stops_at_snapshots():
    text = ("hostname: ct101\ndev0: /dev/nvidia4,mode=0666\n# a comment\n"
            "lxc.cgroup2.devices.allow: c 195:* rwm\n"
            "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
            "\n[before-upgrade]\nhostname: old\n")
    keys, raw = pveapi.parse_conf(text)
    assert keys == {"hostname": "ct101", "dev0": "/dev/nvidia4,mode=0666"}
    assert raw == [["lxc.cgroup2.devices.allow", "c 195:* rwm"],
                   ["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]]


def test_lab_conf_has_gpu_tag_only_with_gpus_and_a_raw_lxc_line():
    keys, raw = pveapi.parse_conf(lablab.proxmox_conf("101", [2, 3]))
    assert keys["tags"] == "gpu" and raw[0] == ["lxc.cgroup2.devices.allow", "c 195:* rwm"]
    assert ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"] in raw
    assert "tags" not in pveapi.parse_conf(lablab.proxmox_conf("102", []))[0]


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """A two-node lab state folder with stopped containers, credentials and a certificate."""
    root = str(tmp_path_factory.mktemp("state"))
    nodes = {}
    for k, (node, cts) in enumerate((("pve1", {"101": [0, 1], "102": []}), ("pve2", {"201": [1]})), 1):
        ndir = os.path.join(root, "nodes", node)
        os.makedirs(os.path.join(ndir, "lxc"))
        os.makedirs(os.path.join(ndir, "containers"))
        write_json(os.path.join(ndir, "node.json"), {"node": node})
        for vmid, minors in cts.items():
            with open(os.path.join(ndir, "lxc", vmid + ".conf"), "w") as f:
                f.write(lablab.proxmox_conf(vmid, minors))
            write_json(os.path.join(ndir, "containers", vmid + ".json"),
                       {"vmid": vmid, "node": node, "running": False, "init_host_pid": None, "minors": minors})
        nodes[node] = {"number": k, "address": "127.0.0.%d" % k, "sshd_pid": None, "gpus": 2,
                       "containers": {v: {"minors": m} for v, m in cts.items()}}
    write_json(os.path.join(root, "labctl.json"), {"rid": "unit01", "nodes": nodes})
    pveapi.make_credentials(root, ADDRESS)
    return root


@pytest.fixture(scope="module")
def api(state):
    server = pveapi.make_server(state, ADDRESS, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": "https://%s:%d/api2/json" % (ADDRESS, server.server_address[1]), "state": state}
    finally:
        server.shutdown()
        server.server_close()


def call(api, method, path, data=None, headers=None):
    ctx = ssl.create_default_context(cafile=os.path.join(api["state"], "api", "cert.pem"))
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    req = urllib.request.Request(api["url"] + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.loads(resp.read())["data"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.reason


def token(api):
    return {"Authorization": "PVEAPIToken=root@pam!lab=" + pveapi.read_secret(api["state"], "token")}


def test_certificate_names_the_address_and_credentials_are_private(state):
    with open(os.path.join(state, "api", "api.json")) as f:
        info = json.load(f)
    assert info["url"] == "https://127.0.0.1:8006/api2/json" and info["ca"].endswith("cert.pem")
    for name in ("key.pem", "password", "token"):
        assert os.stat(os.path.join(state, "api", name)).st_mode & 0o077 == 0


def test_auth_rules(api):
    assert call(api, "GET", "/cluster/status") == (401, "No ticket")
    bad = {"Authorization": "PVEAPIToken=root@pam!other=" + pveapi.read_secret(api["state"], "token")}
    assert call(api, "GET", "/cluster/status", headers=bad) == (401, "invalid token value!")
    assert call(api, "POST", "/access/ticket", {"username": "admin@pve", "password": "x"}) == (401, "authentication failure")
    code, login = call(api, "POST", "/access/ticket",
                       {"username": "root@pam", "password": pveapi.read_secret(api["state"], "password")})
    assert code == 200 and login["ticket"].startswith("PVE:root@pam:")
    cookie = {"Cookie": "PVEAuthCookie=" + urllib.parse.quote(login["ticket"])}
    assert call(api, "GET", "/version", headers=cookie)[0] == 200
    assert call(api, "GET", "/version", headers={"Cookie": "PVEAuthCookie=PVE:root@pam:forged"}) == (401, "invalid PVE ticket")
    # A write with a ticket and no CSRF token is refused before anything runs.
    assert call(api, "POST", "/nodes/pve1/lxc/101/status/start", {}, headers=cookie) == (
        401, "Permission denied - invalid csrf token")


def test_resources_status_and_config(api):
    code, resources = call(api, "GET", "/cluster/resources?type=vm", headers=token(api))
    assert code == 200
    assert [(r["id"], r["node"], r["status"], r.get("tags")) for r in resources] == [
        ("lxc/101", "pve1", "stopped", "gpu"), ("lxc/102", "pve1", "stopped", None), ("lxc/201", "pve2", "stopped", "gpu")]
    assert all(r["type"] == "lxc" and r["template"] == 0 and r["name"] == "ct%d" % r["vmid"] for r in resources)
    nodes = [n for n in call(api, "GET", "/cluster/status", headers=token(api))[1] if n["type"] == "node"]
    assert [(n["name"], n["ip"], n["online"]) for n in nodes] == [("pve1", "127.0.0.1", 0), ("pve2", "127.0.0.2", 0)]
    code, config = call(api, "GET", "/nodes/pve2/lxc/201/config", headers=token(api))
    assert code == 200 and config["dev0"] == "/dev/nvidia1" and config["hostname"] == "ct201"
    assert config["lxc"][0] == ["lxc.cgroup2.devices.allow", "c 195:* rwm"]
    code, current = call(api, "GET", "/nodes/pve2/lxc/201/status/current", headers=token(api))
    assert code == 200 and current["status"] == "stopped" and "pid" not in current


def test_errors_like_pve(api):
    assert call(api, "GET", "/nodes/pve1/lxc/201/config", headers=token(api)) == (
        500, "Configuration file 'nodes/pve1/lxc/201.conf' does not exist")
    assert call(api, "POST", "/nodes/pve1/lxc/101/status/stop", {}, headers=token(api)) == (500, "CT 101 not running")
    assert call(api, "GET", "/nodes/pve1/qemu", headers=token(api))[0] == 501
    assert call(api, "GET", "/nodes/pve1/tasks/UPID:pve1:nope/status", headers=token(api)) == (500, "no such task")
