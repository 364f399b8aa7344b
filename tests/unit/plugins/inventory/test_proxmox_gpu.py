"""Unit tests of gpuops.fleet.proxmox_gpu: config parsing, filters, groups, cache and error texts.

The Proxmox API answers here are recorded ones (shapes from PVE_FACTS.md), served by a small stand-in
for proxmoxer's ProxmoxAPI object; tests/integration/test_inventory_proxmox_gpu.py runs the plugin
against the lab's real HTTPS API.
"""
import pytest

from ansible.errors import AnsibleError, AnsibleParserError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

init_plugin_loader()  # before the import below, so the loader and this module share one copy

from ansible_collections.gpuops.fleet.plugins.inventory import proxmox_gpu  # noqa: E402  pylint: disable=wrong-import-position

RESOURCES = [
    {"id": "lxc/101", "type": "lxc", "node": "pve1", "vmid": 101, "name": "sglang-a", "status": "running",
     "template": 0, "tags": "gpu;sglang"},
    {"id": "lxc/102", "type": "lxc", "node": "pve1", "vmid": 102, "name": "web", "status": "running", "template": 0},
    {"id": "lxc/205", "type": "lxc", "node": "pve2", "vmid": 205, "name": "vllm-b", "status": "stopped",
     "template": 0, "tags": "gpu"},
    {"id": "lxc/206", "type": "lxc", "node": "pve2", "vmid": 206, "name": "sglang-a", "status": "running",
     "template": 0, "tags": "gpu"},
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
    "nodes/pve2/lxc/206/config": {"hostname": "sglang-a", "digest": "z", "lxc": [
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


def run_plugin(tmp_path, monkeypatch, api, conf="", cache=False, name="fleet.proxmox_gpu.yml"):
    path = tmp_path / name
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: https://pve1.example.org:8006\nuser: root@pam\n"
                    "token_id: ci\ntoken_secret: s3cret\n" + conf)
    plugin = inventory_loader.get("gpuops.fleet.proxmox_gpu")
    monkeypatch.setattr(plugin, "_connect", lambda: api)
    inventory = InventoryData()
    plugin.parse(inventory, DataLoader(), str(path), cache=cache)
    if getattr(plugin, "_cache", None) is not None:
        plugin.update_cache_if_changed()  # as ansible's InventoryManager does after parse
    return inventory


def hostvars(inventory, name):
    return inventory.get_host(name).vars


def members(inventory, group):
    return sorted(h.name for h in inventory.groups[group].get_hosts())


def test_gpu_devices_from_dev_keys_and_mount_entries():
    config = {"dev0": "/dev/nvidia10,mode=0666", "dev1": "path=/dev/nvidia2,uid=0", "dev2": "/dev/nvidiactl",
              "dev3": "/dev/nvidia-caps/nvidia-cap1", "devices": "/dev/nvidia7",
              "lxc": [["lxc.mount.entry", "/dev/nvidia3 dev/nvidia3 none bind,optional,create=file"],
                      ["lxc.mount.entry", "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"],
                      ["lxc.mount.entry", "/dev/nvidia2 dev/nvidia2 none bind,optional,create=file"],
                      ["lxc.cgroup2.devices.allow", "c 195:* rwm"]]}
    assert proxmox_gpu.gpu_devices(config) == ["/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia10"]
    assert proxmox_gpu.gpu_devices({"hostname": "x"}) == []


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
    # 205 stopped, 900 a template, 300 a VM: left out. 206 reuses the name sglang-a: ct206.
    assert sorted(inventory.hosts) == ["ct206", "sglang-a", "web"]
    a = hostvars(inventory, "sglang-a")
    assert a["ansible_connection"] == "gpuops.fleet.pct" and a["ansible_host"] == "10.0.0.11"
    assert a["pct_vmid"] == 101 and a["proxmox_node"] == "pve1" and a["proxmox_tags"] == ["gpu", "sglang"]
    assert a["proxmox_gpu_devices"] == ["/dev/nvidia4", "/dev/nvidia5"] and a["proxmox_gpu_minors"] == [4, 5]
    b = hostvars(inventory, "ct206")
    assert b["ansible_host"] == "10.0.0.12" and b["proxmox_gpu_devices"] == ["/dev/nvidia0"]
    assert members(inventory, "gpu_containers") == ["ct206", "sglang-a"]
    assert members(inventory, "proxmox_node_pve1") == ["sglang-a", "web"]
    assert members(inventory, "proxmox_node_pve2") == ["ct206"]
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
    from ansible.template import is_trusted_as_template
    return is_trusted_as_template(value)


def test_node_without_ip_falls_back_to_its_name(tmp_path, monkeypatch):
    status = [{"type": "node", "name": "pve1", "online": 1}]
    inventory = run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/status": status}))
    assert hostvars(inventory, "web")["ansible_host"] == "pve1"


def test_tag_filter_and_constructed_options(tmp_path, monkeypatch):
    conf = ("tags: [sglang, missing]\ncompose:\n  gpu_count: proxmox_gpu_minors | length\n"
            "groups:\n  multi_gpu: proxmox_gpu_minors | length > 1\n"
            "keyed_groups:\n  - key: proxmox_tags\n    prefix: tag\n")
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), conf)
    assert sorted(inventory.hosts) == ["sglang-a"]
    assert hostvars(inventory, "sglang-a")["gpu_count"] == 2
    assert members(inventory, "multi_gpu") == ["sglang-a"]
    assert members(inventory, "tag_gpu") == members(inventory, "tag_sglang") == ["sglang-a"]


def test_strict_turns_a_bad_compose_into_an_error(tmp_path, monkeypatch):
    conf = "strict: true\ncompose:\n  broken: no_such_variable.attr\n"
    with pytest.raises(AnsibleError):
        run_plugin(tmp_path, monkeypatch, recorded(), conf)
    inventory = run_plugin(tmp_path, monkeypatch, recorded(), "compose:\n  broken: no_such_variable.attr\n")
    assert "broken" not in hostvars(inventory, "web")


def test_cache_spares_the_api(tmp_path, monkeypatch):
    conf = "cache: true\ncache_plugin: ansible.builtin.jsonfile\ncache_connection: %s\n" % (tmp_path / "cache")
    first = recorded()
    run_plugin(tmp_path, monkeypatch, first, conf, cache=False)  # refresh: reads the API, fills the cache
    assert first.calls
    second = recorded()
    inventory = run_plugin(tmp_path, monkeypatch, second, conf, cache=True)
    assert second.calls == [] and sorted(inventory.hosts) == ["ct206", "sglang-a", "web"]
    assert hostvars(inventory, "sglang-a")["proxmox_gpu_minors"] == [4, 5]


def test_unauthorized_answer_says_authentication_failed(tmp_path, monkeypatch):
    denied = proxmox_gpu.ResourceException(401, "invalid token value!", "")
    with pytest.raises(AnsibleParserError, match="authentication failed for root@pam"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"cluster/resources": denied}))


def test_other_api_errors_name_the_request(tmp_path, monkeypatch):
    missing = proxmox_gpu.ResourceException(500, "Configuration file 'nodes/pve1/lxc/101.conf' does not exist", "")
    with pytest.raises(AnsibleParserError, match="GET nodes/pve1/lxc/101/config failed.*does not exist"):
        run_plugin(tmp_path, monkeypatch, recorded(**{"nodes/pve1/lxc/101/config": missing}))


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
