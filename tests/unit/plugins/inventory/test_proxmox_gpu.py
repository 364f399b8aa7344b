"""Unit tests of gpuops.fleet.proxmox_gpu: config parsing, filters, groups, cache and error texts.

The Proxmox API answers here are recorded ones (shapes from PVE_FACTS.md), served by a small stand-in
for proxmoxer's ProxmoxAPI object; tests/integration/test_inventory_proxmox_gpu.py runs the plugin
against the lab's real HTTPS API.
"""
import json
import re

import pytest

from ansible import __version__ as core_version
from ansible.errors import AnsibleError, AnsibleParserError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

init_plugin_loader()  # before the import below, so the loader and this module share one copy

from ansible_collections.gpuops.fleet.plugins.inventory import proxmox_gpu  # noqa: E402  pylint: disable=wrong-import-position

# Where ansible-core's versions differ (make test-matrix runs 2.16 to 2.20, make test 2.21): from 2.19 a composed value keeps its
# native type (2, not '2'), trust is a tag read by is_trusted_as_template (before: the AnsibleUnsafe class), and the
# cache plugin wraps its payload in a one-key envelope.
CORE = tuple(int(part) for part in core_version.split(".")[:2])
NATIVE = CORE >= (2, 19)

RESOURCES = [
    {"id": "lxc/101", "type": "lxc", "node": "pve1", "vmid": 101, "name": "sglang-a", "status": "running",
     "template": 0, "tags": "gpu;sglang", "uptime": 5000, "pool": "ml"},
    {"id": "lxc/102", "type": "lxc", "node": "pve1", "vmid": 102, "name": "web", "status": "running", "template": 0,
     "uptime": 7000},
    {"id": "lxc/205", "type": "lxc", "node": "pve2", "vmid": 205, "name": "vllm-b", "status": "stopped",
     "template": 0, "tags": "gpu"},
    {"id": "lxc/206", "type": "lxc", "node": "pve2", "vmid": 206, "name": "sglang-b", "status": "running",
     "template": 0, "tags": "gpu", "uptime": 300, "pool": "ml"},
    {"id": "lxc/900", "type": "lxc", "node": "pve1", "vmid": 900, "name": "tmpl", "status": "running", "template": 1},
    {"id": "qemu/300", "type": "qemu", "node": "pve1", "vmid": 300, "name": "vm", "status": "running", "template": 0},
]
STATUS = [
    {"type": "cluster", "name": "lab", "quorate": 1},
    {"type": "node", "name": "pve1", "ip": "10.0.0.11", "online": 1},
    {"type": "node", "name": "pve2", "ip": "10.0.0.12", "online": 1},
]
CONFIGS = {
    "nodes/pve1/lxc/101/config": {"hostname": "sglang-a", "dev0": "/dev/nvidia4,mode=0666", "dev1": "path=/dev/nvidia5",
                                  "dev2": "/dev/nvidiactl", "digest": "x"},
    "nodes/pve1/lxc/102/config": {"hostname": "web", "dev0": "/dev/nvidia-uvm", "digest": "y"},
    "nodes/pve2/lxc/206/config": {"hostname": "sglang-b", "digest": "z", "lxc": [
        ["lxc.cgroup2.devices.allow", "c 195:* rwm"],
        ["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file"],
        ["lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"]]},
}


class RecordedApi:
    """Answers proxmoxer-style calls api(path).get(**params) from recorded data; counts the calls."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, path):
        api = self

        class Endpoint:
            @staticmethod
            def get(**params):
                api.calls.append((path, params))
                answer = api.answers[path]
                if isinstance(answer, Exception):
                    raise answer
                return answer
        return Endpoint()


def recorded(**overrides):
    answers = {"cluster/resources": RESOURCES, "cluster/status": STATUS}
    answers.update(CONFIGS)
    answers.update(overrides)
    return RecordedApi(answers)


def run_plugin(tmp_path, monkeypatch, api, conf="", cache=False, name="fleet.proxmox_gpu.yml", warnings=None):
    path = tmp_path / name
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: https://pve1.example.org:8006\nuser: root@pam\n"
                    "token_id: ci\ntoken_secret: s3cret\n" + conf)
    plugin = inventory_loader.get("gpuops.fleet.proxmox_gpu")
    monkeypatch.setattr(plugin, "_connect", lambda: api)
    if warnings is not None:
        monkeypatch.setattr(plugin.display, "warning", lambda msg, *a, **kw: warnings.append(msg))
    inventory = InventoryData()
    plugin.parse(inventory, DataLoader(), str(path), cache=cache)
    if getattr(plugin, "_cache", None) is not None:
        plugin.update_cache_if_changed()  # as ansible's InventoryManager does after parse
    return inventory


def hostvars(inventory, name):
    return inventory.get_host(name).vars


def members(inventory, group):
    return sorted(h.name for h in inventory.groups[group].get_hosts())


def containers(inventory):
    """The container hosts (node hosts left out)."""
    return sorted(name for name, host in inventory.hosts.items() if "ansible_pct_vmid" in host.vars)


def test_gpu_devices_from_dev_keys_and_mount_entries():
    config = {"dev0": "/dev/nvidia10,mode=0666", "dev1": "path=/dev/nvidia2,uid=0", "dev2": "/dev/nvidiactl",
              "dev3": "/dev/nvidia-caps/nvidia-cap1", "devices": "/dev/nvidia7",
              "lxc": [["lxc.mount.entry", "/dev/nvidia3 dev/nvidia3 none bind,optional,create=file"],
                      ["lxc.mount.entry", "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"],
                      ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"],
                      ["lxc.cgroup2.devices.allow", "c 195:* rwm"]]}
    assert proxmox_gpu.gpu_devices(config) == ["/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia10"]
    assert proxmox_gpu.gpu_devices({"hostname": "x"}) == []


def test_dev_keys_with_options_before_path():
    config = {"dev0": "mode=0666,path=/dev/nvidia3", "dev1": "uid=0,gid=44,path=/dev/nvidia1",
              "dev2": "path=/dev/nvidia5,deny-write"}
    assert proxmox_gpu.gpu_devices(config) == ["/dev/nvidia1", "/dev/nvidia3"]
    assert [d["usable"] for d in proxmox_gpu.gpu_passthrough(config)] == [True, True, False]


def test_mount_entry_source_is_the_node_gpu_destination_its_container_path():
    config = {"lxc": [["lxc.cgroup2.devices.allow", "c 195:* rwm"],
                      ["lxc.mount.entry", "/dev/nvidia3 dev/nvidia0 none bind,optional,create=file"]]}
    assert proxmox_gpu.gpu_devices(config) == ["/dev/nvidia3"]
    (dev,) = proxmox_gpu.gpu_passthrough(config)
    assert (dev["minor"], dev["device"], dev["path"], dev["source"]) == (3, "/dev/nvidia3", "/dev/nvidia0", "lxc.mount.entry")


@pytest.mark.parametrize("rules, usable", [
    ([], []),
    ([["lxc.cgroup2.devices.allow", "c 195:* rwm"]], [2, 3]),
    ([["lxc.cgroup2.devices.allow", "c 195:3 rw"]], [3]),
    ([["lxc.cgroup.devices.allow", "c 195:2 rwm"]], [2]),
    ([["lxc.cgroup2.devices.allow", "c 195:* r"]], []),
    ([["lxc.cgroup2.devices.allow", "a"]], [2, 3]),
    ([["lxc.cgroup2.devices.allow", "c 195:* rwm"], ["lxc.cgroup2.devices.deny", "c 195:2 w"]], [3]),
    ([["lxc.cgroup2.devices.allow", "c 226:* rwm"], ["lxc.cgroup2.devices.allow", "b 195:* rwm"]], []),
])
def test_mount_entries_need_a_device_rule(rules, usable):
    config = {"lxc": rules + [["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"],
                              ["lxc.mount.entry", "/dev/nvidia3 dev/nvidia3 none bind,optional,create=file"]]}
    assert proxmox_gpu.gpu_devices(config) == ["/dev/nvidia%d" % m for m in usable]
    denied = [d["device"] for d in proxmox_gpu.gpu_passthrough(config) if not d["usable"]]
    assert denied == ["/dev/nvidia%d" % m for m in (2, 3) if m not in usable]


def test_split_tags_accepts_proxmox_separators():
    assert proxmox_gpu.split_tags("gpu;sglang") == ["gpu", "sglang"]
    assert proxmox_gpu.split_tags("a,b c") == ["a", "b", "c"]
    assert proxmox_gpu.split_tags(None) == []


@pytest.mark.parametrize("url, endpoint", [
    ("https://pve1.example.org:8006", ("pve1.example.org", 8006)),
    ("https://pve1.example.org:8006/api2/json", ("pve1.example.org", 8006)),
    ("https://10.0.0.11", ("10.0.0.11", 8006)),
    ("pve1:9443", ("pve1", 9443)),
])
def test_api_endpoint(url, endpoint):
    assert proxmox_gpu.api_endpoint(url) == endpoint


def test_api_endpoint_refuses_plain_http():
    with pytest.raises(AnsibleParserError, match="must be https"):
        proxmox_gpu.api_endpoint("http://pve1:8006")


@pytest.mark.parametrize("name, accepted", [("lab.proxmox_gpu.yml", True), ("proxmox_gpu.yaml", True),
                                            ("lab.yml", False), ("proxmox_gpu.yml.bak", False)])
def test_verify_file_wants_its_suffix(tmp_path, name, accepted):
    path = tmp_path / name
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\n")
    assert inventory_loader.get("gpuops.fleet.proxmox_gpu").verify_file(str(path)) is accepted


def test_running_lxc_containers_with_node_address_and_gpus(tmp_path, monkeypatch):
    inventory = run_plugin(tmp_path, monkeypatch, recorded())
    # 205 stopped, 900 a template, 300 a VM: left out.
    assert containers(inventory) == ["sglang-a", "sglang-b", "web"]
    a = hostvars(inventory, "sglang-a")
    assert a["ansible_connection"] == "gpuops.fleet.pct" and a["ansible_host"] == "10.0.0.11"
    assert a["ansible_pct_vmid"] == a["proxmox_vmid"] == 101 and "pct_vmid" not in a and a["proxmox_node"] == "pve1"
    assert a["proxmox_tags"] == "gpu;sglang" and a["proxmox_tags_parsed"] == ["gpu", "sglang"]
    assert a["proxmox_gpu_devices"] == ["/dev/nvidia4", "/dev/nvidia5"] and a["proxmox_gpu_minors"] == [4, 5]
    b = hostvars(inventory, "sglang-b")
    assert b["ansible_host"] == "10.0.0.12" and b["proxmox_gpu_devices"] == ["/dev/nvidia0"]
    assert members(inventory, "gpu_containers") == ["sglang-a", "sglang-b"]
    assert members(inventory, "proxmox_node_pve1") == ["sglang-a", "web"]
    assert members(inventory, "proxmox_node_pve2") == ["sglang-b"]
    # Only the selected containers' configs are read.
    assert sorted(p for p, dummy in recorded_calls(tmp_path, monkeypatch) if p.endswith("/config")) == [
        "nodes/pve1/lxc/101/config", "nodes/pve1/lxc/102/config", "nodes/pve2/lxc/206/config"]


def recorded_calls(tmp_path, monkeypatch, conf=""):
    api = recorded()
    run_plugin(tmp_path, monkeypatch, api, conf)
    return api.calls


def test_values_from_the_api_are_unsafe(tmp_path, monkeypatch):
    evil = [dict(RESOURCES[0], name="{{ lookup('pipe', 'id') }}")]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": evil}))
    name = hostvars(inventory, "{{ lookup('pipe', 'id') }}")["proxmox_name"]
    assert name == "{{ lookup('pipe', 'id') }}"
    assert not _trusted(name) and not _trusted(hostvars(inventory, "{{ lookup('pipe', 'id') }}")["proxmox_node"])


def _trusted(value):
    if CORE >= (2, 19):
        from ansible.template import is_trusted_as_template
        return is_trusted_as_template(value)
    from ansible.utils.unsafe_proxy import AnsibleUnsafe
    return not isinstance(value, AnsibleUnsafe)


def test_node_without_ip_falls_back_to_its_name(tmp_path, monkeypatch):
    status = [{"type": "node", "name": "pve1", "online": 1}]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}))
    assert hostvars(inventory, "web")["ansible_host"] == "pve1"


def test_tag_filter_and_constructed_options(tmp_path, monkeypatch):
    conf = ("tags: [sglang, missing]\ncompose:\n  gpu_count: proxmox_gpu_minors | length\n"
            "groups:\n  multi_gpu: proxmox_gpu_minors | length > 1\n"
            "keyed_groups:\n  - key: proxmox_tags_parsed\n    prefix: tag\n")
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), conf)
    assert containers(inventory) == ["sglang-a"]
    assert hostvars(inventory, "sglang-a")["gpu_count"] == (2 if NATIVE else "2")
    assert members(inventory, "multi_gpu") == ["sglang-a"]
    assert members(inventory, "tag_gpu") == members(inventory, "tag_sglang") == ["sglang-a"]


def test_strict_turns_a_bad_compose_into_an_error(tmp_path, monkeypatch):
    conf = "strict: true\ncompose:\n  broken: no_such_variable.attr\n"
    with pytest.raises(AnsibleError):
        run_plugin(tmp_path, monkeypatch, recorded(), conf)
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "compose:\n  broken: no_such_variable.attr\n")
    assert "broken" not in hostvars(inventory, "web")


CACHE_CONF = "cache: true\ncache_plugin: ansible.builtin.jsonfile\ncache_connection: %s\n"


def config_calls(api):
    return sorted(p for p, dummy in api.calls if p.endswith("/config"))


def test_cache_spares_config_reads_only(tmp_path, monkeypatch):
    conf = CACHE_CONF % (tmp_path / "cache")
    first = recorded()
    run_plugin(tmp_path, monkeypatch, first, conf, cache=False)  # refresh: reads the API, fills the cache
    assert len(config_calls(first)) == 3
    second = recorded()
    inventory = run_plugin(tmp_path, monkeypatch, second, conf, cache=True)
    # The guest list and the node addresses are read again; the configs are not.
    assert [p for p, dummy in second.calls] == ["cluster/resources", "cluster/status"]
    assert containers(inventory) == ["sglang-a", "sglang-b", "web"]
    assert hostvars(inventory, "sglang-a")["proxmox_gpu_minors"] == [4, 5]


def test_cache_never_sends_a_task_to_a_stale_node_or_a_reused_vmid(tmp_path, monkeypatch):
    conf = CACHE_CONF % (tmp_path / "cache")
    run_plugin(tmp_path, monkeypatch, recorded(), conf, cache=False)
    # 101 migrated to pve2 (restart mode: new start), 102 destroyed and its vmid reused by a new container,
    # and pve1's address changed.
    moved = [dict(RESOURCES[0], node="pve2", uptime=4), dict(RESOURCES[1], name="web2", uptime=60)] + RESOURCES[2:]
    status = [STATUS[0], dict(STATUS[1], ip="10.0.0.21"), STATUS[2]]
    answers = {"cluster/resources": moved, "cluster/status": status,
               "nodes/pve2/lxc/101/config": CONFIGS["nodes/pve1/lxc/101/config"],
               "nodes/pve1/lxc/102/config": {"hostname": "web2", "dev0": "/dev/nvidia6"}}
    api = recorded(**answers)
    inventory = run_plugin(tmp_path, monkeypatch, api, conf, cache=True)
    assert config_calls(api) == ["nodes/pve1/lxc/102/config", "nodes/pve2/lxc/101/config"]
    a = hostvars(inventory, "sglang-a")
    assert a["proxmox_node"] == "pve2" and a["ansible_host"] == "10.0.0.12" and a["proxmox_gpu_minors"] == [4, 5]
    assert hostvars(inventory, "web2")["proxmox_gpu_minors"] == [6] and "web" not in inventory.hosts
    assert hostvars(inventory, "web2")["ansible_host"] == "10.0.0.21"
    # Same vmid, node and name, but started again since: a config changed at that restart is read.
    api = recorded(**{"cluster/resources": [dict(moved[0], uptime=2)] + moved[1:], "cluster/status": status,
                      "nodes/pve2/lxc/101/config": {"hostname": "sglang-a", "dev0": "/dev/nvidia7"},
                      "nodes/pve1/lxc/102/config": answers["nodes/pve1/lxc/102/config"]})
    monkeypatch.setattr(proxmox_gpu.time, "time", lambda: TIME_NOW + 600)
    inventory = run_plugin(tmp_path, monkeypatch, api, conf, cache=True)
    assert "nodes/pve2/lxc/101/config" in config_calls(api)
    assert hostvars(inventory, "sglang-a")["proxmox_gpu_minors"] == [7]


TIME_NOW = __import__("time").time()


@pytest.mark.skipif(CORE < (2, 19), reason="the cache file's envelope is ansible-core 2.19's")
def test_a_cache_of_the_old_format_is_ignored(tmp_path, monkeypatch):
    conf = CACHE_CONF % (tmp_path / "cache")
    run_plugin(tmp_path, monkeypatch, recorded(), conf, cache=False)
    (cache_file,) = (tmp_path / "cache").iterdir()
    envelope = json.loads(cache_file.read_text())
    (payload_key,) = envelope
    old = [{"vmid": 101, "node": "pve9", "address": "10.9.9.9"}]  # what 4f76d56 cached: whole host records
    cache_file.write_text(json.dumps({payload_key: json.dumps(old)}))
    api = recorded()
    inventory = run_plugin(tmp_path, monkeypatch, api, conf, cache=True)
    assert len(config_calls(api)) == 3 and hostvars(inventory, "sglang-a")["proxmox_node"] == "pve1"


def test_unauthorized_answer_says_authentication_failed(tmp_path, monkeypatch):
    denied = proxmox_gpu.ResourceException(401, "invalid token value!", "")
    with pytest.raises(AnsibleParserError, match="authentication failed for root@pam"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": denied}))


def test_a_failed_guest_list_names_the_request(tmp_path, monkeypatch):
    broken = proxmox_gpu.ResourceException(500, "Internal Server Error", "cfs-lock timeout")
    with pytest.raises(AnsibleParserError, match="GET cluster/resources failed: 500 Internal Server Error"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": broken}))


def test_one_unreadable_config_is_left_out_with_a_warning(tmp_path, monkeypatch):
    missing = proxmox_gpu.ResourceException(500, "Internal Server Error",
                                            "Configuration file 'nodes/pve1/lxc/101.conf' does not exist")
    slow = proxmox_gpu.requests.exceptions.ReadTimeout("Read timed out. (read timeout=10)")
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"nodes/pve1/lxc/101/config": missing,
                                                              "nodes/pve2/lxc/206/config": slow}), warnings=warnings)
    assert containers(inventory) == ["web"]
    assert len(warnings) == 2, warnings
    assert "left out CT 101 (sglang-a) on pve1" in warnings[0] and "101.conf' does not exist" in warnings[0]
    assert "left out CT 206 (sglang-b) on pve2" in warnings[1]
    assert "did not answer GET nodes/pve2/lxc/206/config within 10 s" in warnings[1]


def test_an_unauthorized_config_read_still_fails(tmp_path, monkeypatch):
    denied = proxmox_gpu.ResourceException(401, "Unauthorized", "invalid PVE ticket")
    with pytest.raises(AnsibleParserError, match="authentication failed for root@pam"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"nodes/pve1/lxc/102/config": denied}))


def test_config_is_read_with_current(tmp_path, monkeypatch):
    api = recorded()
    run_plugin(tmp_path, monkeypatch, api)
    assert {tuple(sorted(params.items())) for p, params in api.calls if p.endswith("/config")} == {(("current", 1),)}


@pytest.mark.parametrize("fault, text", [
    (proxmox_gpu.requests.exceptions.ConnectionError("[Errno 111] Connection refused"),
     "cannot reach the Proxmox VE API at https://pve1.example.org:8006 (GET cluster/resources"),
    (proxmox_gpu.requests.exceptions.ReadTimeout("Read timed out."),
     "did not answer GET cluster/resources within 10 s"),
])
def test_api_down_or_slow_is_named(tmp_path, monkeypatch, fault, text):
    with pytest.raises(AnsibleParserError, match=re.escape(text)):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": fault}))


def test_no_guest_listed_warns_about_vm_audit(tmp_path, monkeypatch):
    warnings = []
    nodes_only = [{"id": "node/pve1", "type": "node", "node": "pve1", "status": "online"}]
    api = recorded(**{"cluster/resources": nodes_only})
    inventory = run_plugin(tmp_path, monkeypatch, api, warnings=warnings)
    assert not containers(inventory) and len(warnings) == 1
    assert "lists no guests at all to root@pam!ci" in warnings[0] and "VM.Audit" in warnings[0]
    # The nodes are still hosts: /cluster/status needs Sys.Audit, not VM.Audit.
    assert [p for p, dummy in api.calls] == ["cluster/resources", "cluster/status"]
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2"]
    api = recorded(**{"cluster/resources": nodes_only})
    inventory = run_plugin(tmp_path, monkeypatch, api, "node_hosts: false\n")
    assert not inventory.hosts and [p for p, dummy in api.calls] == ["cluster/resources"]


def test_nothing_selected_warns_with_counts(tmp_path, monkeypatch):
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "nodes: [pve9]\n", warnings=warnings)
    assert not containers(inventory) and len(warnings) == 1
    assert "no container selected" in warnings[0] and "6 guests listed, 4 LXC containers (3 running)" in warnings[0]


def test_filters_by_status_node_pool_and_name(tmp_path, monkeypatch):
    configs = {"nodes/pve2/lxc/205/config": {"hostname": "vllm-b", "dev0": "/dev/nvidia1"}}
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**configs), "statuses: [running, stopped]\n")
    assert containers(inventory) == ["sglang-a", "sglang-b", "vllm-b", "web"]
    assert hostvars(inventory, "vllm-b")["proxmox_status"] == "stopped"
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**configs), "statuses: [stopped]\n")
    assert containers(inventory) == ["vllm-b"]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "nodes: [pve2]\n")
    assert containers(inventory) == ["sglang-b"] and hostvars(inventory, "sglang-b")["ansible_pct_vmid"] == 206
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "pools: [ml]\n")
    assert containers(inventory) == ["sglang-a", "sglang-b"] and hostvars(inventory, "sglang-b")["proxmox_pool"] == "ml"
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "names: ['w*', 'nothing']\n")
    assert containers(inventory) == ["web"]
    api = recorded()
    run_plugin(tmp_path, monkeypatch, api, "names: ['w*']\n")
    assert config_calls(api) == ["nodes/pve1/lxc/102/config"]  # filters apply before any config read


def test_hostname_template(tmp_path, monkeypatch):
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "hostname: '{{ node }}-{{ vmid }}'\n")
    assert containers(inventory) == ["pve1-101", "pve1-102", "pve2-206"]
    assert hostvars(inventory, "pve2-206")["proxmox_name"] == "sglang-b"
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "hostname: \"{{ name | regex_replace('-b$', '') }}\"\n",
                           warnings=warnings)
    assert containers(inventory) == ["sglang", "sglang-a", "web"] and not warnings
    # an empty name falls back to ct<vmid>, with a warning; a taken one fails (test_two_containers_of_one_name_fail_naming_both)
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "hostname: \"{{ '' if vmid == 206 else name }}\"\n",
                           warnings=warnings)
    assert containers(inventory) == ["ct206", "sglang-a", "web"]
    assert warnings == ["proxmox_gpu: hostname template gave CT 206 an empty name; named it ct206"], warnings


def test_hostname_template_does_not_run_api_values(tmp_path, monkeypatch):
    evil = [dict(RESOURCES[0], name="{{ lookup('pipe', 'id') }}")]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": evil}),
                           "hostname: 'x-{{ name }}'\n")
    assert containers(inventory) == ["x-{{ lookup('pipe', 'id') }}"]


def test_credentials_are_required(tmp_path):
    path = tmp_path / "x.proxmox_gpu.yml"
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: https://pve1:8006\nuser: root@pam\n")
    plugin = inventory_loader.get("gpuops.fleet.proxmox_gpu")
    with pytest.raises(AnsibleParserError, match="give password, or token_id and token_secret"):
        plugin.parse(InventoryData(), DataLoader(), str(path), cache=False)


def test_missing_proxmoxer_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(proxmox_gpu, "HAS_PROXMOXER", False)
    monkeypatch.setattr(proxmox_gpu, "PROXMOXER_IMPORT_ERROR", ImportError("No module named 'proxmoxer'"))
    path = tmp_path / "x.proxmox_gpu.yml"
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: https://pve1:8006\nuser: root@pam\npassword: pw\n")
    plugin = inventory_loader.get("gpuops.fleet.proxmox_gpu")
    with pytest.raises(AnsibleError, match="needs the proxmoxer and requests"):
        plugin.parse(InventoryData(), DataLoader(), str(path), cache=False)


# -- node hosts (proxmox_nodes) --------------------------------------------------------------------


def test_nodes_are_ssh_hosts_and_containers_name_their_node_host(tmp_path, monkeypatch):
    inventory = run_plugin(tmp_path, monkeypatch, recorded())
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2"]
    pve1 = hostvars(inventory, "pve1")
    assert pve1 == dict(pve1, ansible_connection="ssh", ansible_host="10.0.0.11", proxmox_node="pve1",
                        proxmox_node_online=True, proxmox_node_vmids=[101, 102])
    assert "ansible_pct_vmid" not in pve1 and "proxmox_vmid" not in pve1 and "proxmox_node_host" not in pve1
    assert hostvars(inventory, "pve2")["proxmox_node_vmids"] == [206]  # 205 is stopped, not listed
    assert hostvars(inventory, "sglang-a")["proxmox_node_host"] == "pve1"
    assert hostvars(inventory, "sglang-b")["proxmox_node_host"] == "pve2"
    # Node hosts are in none of the container groups: those are reached through pct exec.
    assert members(inventory, "proxmox_node_pve1") == ["sglang-a", "web"]
    assert members(inventory, "gpu_containers") == ["sglang-a", "sglang-b"]
    assert not _trusted(pve1["ansible_host"]) and not _trusted(pve1["proxmox_node"])


def test_node_hosts_can_be_turned_off(tmp_path, monkeypatch):
    api = recorded()
    inventory = run_plugin(tmp_path, monkeypatch, api, "node_hosts: false\n")
    assert sorted(inventory.hosts) == ["sglang-a", "sglang-b", "web"] and "proxmox_nodes" not in inventory.groups
    assert "proxmox_node_host" not in hostvars(inventory, "web")
    assert hostvars(inventory, "web")["ansible_host"] == "10.0.0.11"


def test_node_host_without_ip_or_status_entry_is_reached_by_name(tmp_path, monkeypatch):
    status = [{"type": "node", "name": "pve1", "online": 1}]  # pve2 missing from /cluster/status
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}))
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2"]
    assert hostvars(inventory, "pve1")["ansible_host"] == "pve1"
    assert hostvars(inventory, "pve2")["ansible_host"] == "pve2"
    assert hostvars(inventory, "sglang-b")["proxmox_node_host"] == "pve2"


def test_nodes_without_listed_containers_are_hosts_too_and_the_nodes_option_applies(tmp_path, monkeypatch):
    status = STATUS + [{"type": "node", "name": "pve3", "ip": "10.0.0.13", "online": 1}]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}), "tags: [sglang]\n")
    assert containers(inventory) == ["sglang-a"]
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2", "pve3"]
    assert hostvars(inventory, "pve3")["proxmox_node_vmids"] == []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}), "nodes: [pve2, pve3]\n")
    assert members(inventory, "proxmox_nodes") == ["pve2", "pve3"] and containers(inventory) == ["sglang-b"]
    assert hostvars(inventory, "sglang-b")["proxmox_node_host"] == "pve2"


def test_offline_nodes_are_left_out_with_a_warning(tmp_path, monkeypatch):
    status = STATUS + [{"type": "node", "name": "pve3", "ip": "10.0.0.13", "online": 0},
                       {"type": "node", "name": "pve4", "ip": "10.0.0.14", "online": 0}]
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}), warnings=warnings)
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2"]
    assert warnings == ["proxmox_gpu: left out of proxmox_nodes the nodes pve3, pve4, offline in /cluster/status "
                        "at https://pve1.example.org:8006"]
    # A node that a listed container still names is kept, marked offline, so proxmox_node_host names a host.
    status = [STATUS[0], STATUS[1], dict(STATUS[2], online=0)]
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}), warnings=warnings)
    assert members(inventory, "proxmox_nodes") == ["pve1", "pve2"] and not warnings
    assert hostvars(inventory, "pve2")["proxmox_node_online"] is False
    assert hostvars(inventory, "sglang-b")["proxmox_node_host"] == "pve2"


def test_node_hostname_template_and_node_compose(tmp_path, monkeypatch):
    conf = ("node_hostname: 'pve-{{ name }}-{{ nodeid }}'\n"
            "node_compose:\n  ansible_user: \"'root'\"\n  node_ct_count: proxmox_node_vmids | length\n"
            "  reach: ansible_host ~ ':22'\n"
            "compose:\n  gpu_count: proxmox_gpu_minors | length\n"
            "groups:\n  multi_gpu: proxmox_gpu_minors | length > 1\nstrict: true\n")
    status = [STATUS[0], dict(STATUS[1], nodeid=1), dict(STATUS[2], nodeid=2)]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}), conf)
    assert members(inventory, "proxmox_nodes") == ["pve-pve1-1", "pve-pve2-2"]
    node = hostvars(inventory, "pve-pve1-1")
    assert (node["ansible_user"], node["node_ct_count"], node["reach"]) == ("root", 2 if NATIVE else "2", "10.0.0.11:22")
    assert node["proxmox_node"] == "pve1" and "gpu_count" not in node  # compose and groups are for containers
    assert members(inventory, "multi_gpu") == ["sglang-a"]
    assert hostvars(inventory, "sglang-a")["proxmox_node_host"] == "pve-pve1-1"
    assert "ansible_user" not in hostvars(inventory, "sglang-a")  # node_compose is for nodes
    # compose sees proxmox_node_host
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "compose:\n  via: \"'ssh://' ~ proxmox_node_host\"\n")
    assert hostvars(inventory, "web")["via"] == "ssh://pve1"


def test_node_compose_strict(tmp_path, monkeypatch):
    conf = "strict: true\nnode_compose:\n  broken: no_such_variable.attr\n"
    with pytest.raises(AnsibleError):
        run_plugin(tmp_path, monkeypatch, recorded(), conf)
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "node_compose:\n  broken: no_such_variable.attr\n")
    assert "broken" not in hostvars(inventory, "pve1")


def test_node_host_name_taken_or_empty_falls_back(tmp_path, monkeypatch):
    # (a container named like a node fails: test_a_container_named_like_a_node_fails_naming_both)
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "node_hostname: 'pve'\n", warnings=warnings)
    assert members(inventory, "proxmox_nodes") == ["node_pve2", "pve"]
    assert hostvars(inventory, "sglang-b")["proxmox_node_host"] == "node_pve2"
    assert len(warnings) == 1 and "'pve' of node pve2 is already taken; named it node_pve2" in warnings[0]
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "node_hostname: '{{ missing_field }}'\n", warnings=warnings)
    assert members(inventory, "proxmox_nodes") == ["node_pve1", "node_pve2"]
    assert len(warnings) == 2 and "node_hostname template failed for node pve1, named it node_pve1" in warnings[0]
    with pytest.raises(AnsibleParserError, match="node_hostname template failed for node pve1"):
        run_plugin(tmp_path, monkeypatch, recorded(), "node_hostname: '{{ missing_field }}'\nstrict: true\n")


def test_node_hostname_template_does_not_run_api_values(tmp_path, monkeypatch):
    evil = "{{ lookup('pipe', 'id') }}"
    resources = [dict(RESOURCES[0], node=evil)]
    status = [{"type": "node", "name": evil, "ip": "10.0.0.11", "online": 1}]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": resources, "cluster/status": status,
                                                              "nodes/%s/lxc/101/config" % evil: CONFIGS["nodes/pve1/lxc/101/config"]}),
                           "node_hostname: 'n-{{ name }}'\n")
    assert members(inventory, "proxmox_nodes") == ["n-" + evil]
    assert hostvars(inventory, "sglang-a")["proxmox_node_host"] == "n-" + evil


def test_cache_moves_proxmox_node_host_with_a_migrated_container(tmp_path, monkeypatch):
    conf = CACHE_CONF % (tmp_path / "cache")
    run_plugin(tmp_path, monkeypatch, recorded(), conf, cache=False)
    moved = [dict(RESOURCES[0], node="pve2", uptime=4)] + RESOURCES[1:]
    api = recorded(**{"cluster/resources": moved,
                      "nodes/pve2/lxc/101/config": CONFIGS["nodes/pve1/lxc/101/config"]})
    inventory = run_plugin(tmp_path, monkeypatch, api, conf, cache=True)
    a = hostvars(inventory, "sglang-a")
    assert a["proxmox_node"] == "pve2" and a["proxmox_node_host"] == "pve2" and a["ansible_host"] == "10.0.0.12"
    assert hostvars(inventory, "pve1")["proxmox_node_vmids"] == [102]
    assert hostvars(inventory, "pve2")["proxmox_node_vmids"] == [101, 206]


@pytest.mark.parametrize("item, online", [({"online": 1}, True), ({"online": 0}, False), ({}, True),
                                          ({"online": "0"}, False), ({"online": True}, True)])
def test_node_online(item, online):
    assert proxmox_gpu.node_online(item) is online


def test_unreadable_nodes_without_containers_leave_only_the_node_hosts_out(tmp_path, monkeypatch):
    """A token without any privilege: no guest listed, /cluster/status refused (Sys.Audit)."""
    denied = proxmox_gpu.ResourceException(403, "Forbidden", "Permission check failed (/, Sys.Audit)")
    warnings = []
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": [], "cluster/status": denied}),
                           warnings=warnings)
    assert not inventory.hosts and len(warnings) == 2
    assert "lists no guests at all" in warnings[0]
    assert "no node hosts (proxmox_nodes), the nodes could not be read: proxmox_gpu: GET cluster/status failed: 403" in warnings[1]
    # With containers listed, the node addresses are needed: the inventory fails, as before.
    with pytest.raises(AnsibleParserError, match="GET cluster/status failed: 403"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": denied}))


def test_the_node_and_the_inventory_read_one_config_alike():
    """Issue 18: one parser (module_utils/_pveconf) for /etc/pve/lxc/VMID.conf on the node and the API's config."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
    text = ("hostname: ct101\n"
            "dev0: /dev/nvidia4,deny-write=1\n"          # read-only: no CUDA context can use it
            "dev1: /dev/nvidia5,deny-write=0\n"
            "lxc.cgroup2.devices.allow: c 195:1 rwm\n"
            "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file\n"
            "lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file\n"   # no cgroup rule allows it
            "\n[snap]\ndev2: /dev/nvidia7\n")
    api = {"hostname": "ct101", "dev0": "/dev/nvidia4,deny-write=1", "dev1": "/dev/nvidia5,deny-write=0",
           "lxc": [["lxc.cgroup2.devices.allow", "c 195:1 rwm"],
                   ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind,optional,create=file"],
                   ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"]]}
    usable = [int(path[len("/dev/nvidia"):]) for path in proxmox_gpu.gpu_devices(api)]
    assert usable == [1, 5] and node.parse_pve_conf(text)["minors"] == usable


# -- host names that clash (issue 41, attack 7) ----------------------------------------------------------------------


def test_two_containers_of_one_name_fail_naming_both(tmp_path, monkeypatch):
    same = recorded(**{"cluster/resources": RESOURCES[:3] + [dict(RESOURCES[3], name="sglang-a")] + RESOURCES[4:]})
    with pytest.raises(AnsibleParserError) as raised:
        run_plugin(tmp_path, monkeypatch, same)
    text = str(raised.value)
    assert "\n" not in text.strip() and text.startswith("proxmox_gpu: "), text
    assert "CT 101 on pve1 and CT 206 on pve2 both get the host name 'sglang-a'" in text, text
    # the same name from a hostname template fails alike
    with pytest.raises(AnsibleParserError, match="CT 101 on pve1 and CT 206 on pve2 both get the host name 'sglang'"):
        run_plugin(tmp_path, monkeypatch, recorded(), "hostname: \"{{ name | regex_replace('-[ab]$', '') }}\"\n")


def test_a_container_named_like_another_containers_fallback_fails(tmp_path, monkeypatch):
    resources = [dict(RESOURCES[1], name="ct206"), dict(RESOURCES[3], name="")]
    with pytest.raises(AnsibleParserError, match="CT 102 on pve1 and CT 206 on pve2 both get the host name 'ct206'"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": resources,
                                                      "nodes/pve2/lxc/206/config": {"digest": "z"}}))


def test_a_container_named_like_a_node_fails_naming_both(tmp_path, monkeypatch):
    resources = [dict(RESOURCES[0], name="pve2"), RESOURCES[1]]
    with pytest.raises(AnsibleParserError) as raised:
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": resources}))
    text = str(raised.value)
    assert "\n" not in text.strip(), text
    assert "CT 101 on pve1 gets the host name 'pve2', the host name of node pve2" in text, text
    # without node hosts nothing clashes
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": resources}), "node_hosts: false\n")
    assert containers(inventory) == ["pve2", "web"]


def test_a_refused_redirect_on_a_config_read_fails_the_inventory_not_only_that_container(tmp_path, monkeypatch):
    refused = proxmox_gpu.RedirectRefused("proxmox_gpu: the Proxmox VE API at https://pve1.example.org:8006 answered GET "
                                          "/x with a redirect to https://elsewhere/, another host; refused")
    with pytest.raises(proxmox_gpu.RedirectRefused, match="redirect to https://elsewhere/"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"nodes/pve1/lxc/102/config": refused}))
    with pytest.raises(proxmox_gpu.RedirectRefused):   # nor only the node hosts, when nothing is selected
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": refused}), "names: [none]\n")
