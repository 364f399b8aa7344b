"""gpuops.fleet.proxmox_gpu refuses loose input before any request, and names what it cannot read (issue 45).

A small HTTPS server on 127.0.0.1 stands in for the Proxmox VE API: it answers JSON like PVE, or HTML with status 200
(a login page, a proxy), and records every request. The plugin runs unmocked (proxmoxer, requests, the TLS check).
"""
import os
import subprocess
import sys

import pytest

from ansible.errors import AnsibleParserError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

init_plugin_loader()

from _https_api import https_apis, make_certificate  # noqa: E402  pylint: disable=wrong-import-position,import-error

RESOURCES = [{"id": "lxc/101", "type": "lxc", "node": "pve1", "vmid": 101, "name": "ct101", "status": "running",
              "template": 0, "tags": "gpu", "uptime": 50}]
STATUS = [{"type": "node", "name": "pve1", "ip": "127.0.0.1", "online": 1}]
CONFIG = {"hostname": "ct101", "dev0": "/dev/nvidia0"}
HTML = b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>proxy login</body></html>\n"
BIN = os.path.dirname(sys.executable)


def pve(method, path):
    """(status, headers, data) as PVE answers (the stand-in wraps data in {"data": ...})."""
    if method == "POST" and path.endswith("/access/ticket"):
        data = {"ticket": "PVE:root@pam:T", "CSRFPreventionToken": "c", "username": "root@pam"}
    elif "/cluster/resources" in path:
        data = RESOURCES
    elif "/cluster/status" in path:
        data = STATUS
    else:
        data = CONFIG
    return 200, {}, data


@pytest.fixture(name="api")
def fixture_api(tmp_path):
    with https_apis(tmp_path) as (start, cert):
        def start_pve(answer=pve):
            server = start(answer)
            server.cert = cert
            return server
        yield start_pve


def source(tmp_path, server, extra="", auth="token_id: ci\ntoken_secret: s3cret\n", ca_path=None):
    path = tmp_path / "fleet.proxmox_gpu.yml"
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: %s\nuser: root@pam\nca_path: %s\ntimeout: 5\n%s%s"
                    % (server.url, ca_path or server.cert, auth, extra))
    return str(path)


def parse(path):
    inventory = InventoryData()
    inventory_loader.get("gpuops.fleet.proxmox_gpu").parse(inventory, DataLoader(), path, cache=False)
    return inventory


def refused(path):
    with pytest.raises(AnsibleParserError) as caught:
        parse(path)
    text = str(caught.value).strip()
    assert "\n" not in text and text.startswith("proxmox_gpu: "), text
    return text


# -- real booleans only ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, env", [
    ("validate_certs: maybe\n", {}),                        # in the file
    ("", {"PROXMOX_VALIDATE_CERTS": "maybe"}),              # from the environment
    ("", {"PROXMOX_VALIDATE_CERTS": ""}),                   # set and empty: ansible-core reads false
    ("validate_certs: 'falsy'\n", {}),
])
def test_validate_certs_maybe_is_refused_before_any_request(api, tmp_path, monkeypatch, extra, env):
    server = api()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    text = refused(source(tmp_path, server, extra))
    assert "option validate_certs" in text and "not a boolean" in text, text
    if env:
        assert "environment variable PROXMOX_VALIDATE_CERTS" in text, text
    assert server.seen == []                                 # refused before any request, TLS check or not


@pytest.mark.parametrize("extra, env, option", [
    ("node_hosts: maybe\n", {}, "node_hosts"),
    ("strict: sometimes\n", {}, "strict"),
    ("", {"ANSIBLE_INVENTORY_CACHE": "perhaps"}, "cache"),
    ("", {"ANSIBLE_INVENTORY_USE_EXTRA_VARS": "2"}, "use_extra_vars"),
])
def test_every_other_boolean_option_is_refused_too(api, tmp_path, monkeypatch, extra, env, option):
    server = api()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    text = refused(source(tmp_path, server, extra))
    assert "option %s " % option in text, text
    assert server.seen == []


@pytest.mark.parametrize("extra, env", [
    ("validate_certs: yes\n", {}),                  # YAML's boolean
    ("validate_certs: 'on'\n", {}),                 # a string, Ansible's spelling
    ("", {"PROXMOX_VALIDATE_CERTS": "True"}),
    ("", {"PROXMOX_VALIDATE_CERTS": "1"}),
    ("node_hosts: 'no'\n", {"PROXMOX_VALIDATE_CERTS": "yes"}),
])
def test_ansibles_boolean_spellings_are_accepted(api, tmp_path, monkeypatch, extra, env):
    server = api()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    inventory = parse(source(tmp_path, server, extra))
    assert "ct101" in inventory.hosts and server.seen
    assert ("pve1" in inventory.hosts) is ("node_hosts: 'no'" not in extra)


def test_an_accepted_false_turns_the_check_off_and_true_keeps_it(api, tmp_path, monkeypatch):
    server = api()
    untrusted = tmp_path / "other-ca.pem"
    make_certificate(str(untrusted), str(tmp_path / "other-key.pem"), "127.0.0.1")
    monkeypatch.setenv("PROXMOX_VALIDATE_CERTS", "off")
    assert "ct101" in parse(source(tmp_path, server, ca_path=str(untrusted))).hosts
    monkeypatch.setenv("PROXMOX_VALIDATE_CERTS", "on")
    assert "TLS certificate" in refused(source(tmp_path, server, ca_path=str(untrusted)))


def test_a_loose_boolean_in_ansible_cfg_fails_ansible_inventory_with_one_line(api, tmp_path):
    server = api()
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[inventory]\ncache = maybe\n")
    env = dict(os.environ, ANSIBLE_CONFIG=str(cfg), ANSIBLE_INVENTORY_UNPARSED_FAILED="true", ANSIBLE_NOCOLOR="1")
    env.pop("ANSIBLE_INVENTORY_CACHE", None)
    proc = subprocess.run([os.path.join(BIN, "ansible-inventory"), "-i", source(tmp_path, server), "--list"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=120, check=False)
    assert proc.returncode != 0, proc.stdout
    line = "proxmox_gpu: option cache is 'maybe' (config file %s), not a boolean" % cfg
    assert "".join(line.split()) in "".join(proc.stderr.split()), proc.stderr   # as wrapped by any core's display
    assert server.seen == []


# -- what the API answers ----------------------------------------------------------------------------------------


def html_on(where):
    def answer(method, path):
        if where in path:
            return 200, {}, HTML
        return pve(method, path)
    return answer


@pytest.mark.parametrize("where, auth, request_text", [
    ("/cluster/resources", "token_id: ci\ntoken_secret: s3cret\n", "GET cluster/resources"),
    ("/access/ticket", "password: pw\n", "POST access/ticket"),
    ("/cluster/status", "token_id: ci\ntoken_secret: s3cret\n", "GET cluster/status"),
    ("/lxc/101/config", "token_id: ci\ntoken_secret: s3cret\n", "GET nodes/pve1/lxc/101/config"),
])
def test_an_html_answer_is_named_in_one_line(api, tmp_path, where, auth, request_text):
    server = api(html_on(where))
    text = refused(source(tmp_path, server, auth=auth))
    assert "answered %s with something that is not JSON" % request_text in text, text
    assert "<!DOCTYPE html> <html><head><title>Sign in" in text and server.url in text, text
    assert "attribute" not in text and "Traceback" not in text, text


@pytest.mark.parametrize("body, words", [
    (b'{"errors": null}', "JSON that has no data"),
    (b'{"data": {"not": "a list"}}', "with a JSON dict where PVE gives a list"),
])
def test_json_that_is_not_pves_is_named_in_one_line(api, tmp_path, body, words):
    def answer(method, path):
        return (200, {}, body) if "/cluster/resources" in path else pve(method, path)
    server = api(answer)
    text = refused(source(tmp_path, server))
    assert words in text and "GET cluster/resources" in text, text


def test_a_missing_ca_path_is_named_before_any_request(api, tmp_path):
    server = api()
    missing = tmp_path / "no-such" / "pve-root-ca.pem"
    text = refused(source(tmp_path, server, ca_path=str(missing)))
    assert text.startswith("proxmox_gpu: ca_path %s does not exist" % missing), text
    assert "Could not find a suitable TLS CA certificate bundle" not in text
    assert server.seen == []


def test_a_ca_path_is_not_checked_when_validate_certs_is_off(api, tmp_path):
    server = api()
    missing = tmp_path / "no-such.pem"
    assert "ct101" in parse(source(tmp_path, server, "validate_certs: false\n", ca_path=str(missing))).hosts
