"""The role's guard against facts (issue 41), read from roles/release_gpus/vars/main.yml and the tasks and evaluated in
this process by ansible-core's templating: a fact named like a setting of the role or of the pct connection fails every
setting that picks the node, the container, the credentials or what runs on the node, naming the fact; with
inject_facts_as_vars off nothing is refused; the fleet's route sends such a host alone to the container path; the
node-side release takes only the GPUs the node says are the container's. tests/integration/test_hostile_facts.py runs
the same attacks end to end in the lab."""
import json
import os

import pytest
import yaml
from ansible.errors import AnsibleError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

from _templating import REPO, trust_as_template


ROLE = os.path.join(REPO, "roles", "release_gpus")
GUARDED = ("_release_gpus_node_host", "_release_gpus_vmid", "_release_gpus_proxmox_api", "_release_gpus_reset_blockers",
           "_release_gpus_install_deps", "_release_gpus_deps_pip_extra_args", "_release_gpus_wheel_dir",
           "_release_gpus_supervisorctl", "_release_gpus_api",
           # red team: where the controller writes the report, and whether a busy GPU fails the host
           "_release_gpus_report_dir", "_release_gpus_fail_on_busy")


def load(path):
    with open(os.path.join(ROLE, path)) as handle:
        return yaml.safe_load(handle)


def trusted(value):
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def templar(facts, inject=True, **extra):
    variables = dict(trusted(load("defaults/main.yml")), **trusted(load("vars/main.yml")))
    variables.update(inventory_hostname="ct101", proxmox_node_host="pve1", pct_vmid=101, ansible_check_mode=False,
                     ansible_facts=facts)
    variables["_release_gpus_inject_facts"] = inject
    variables.update(extra)
    return Templar(loader=DataLoader(), variables=variables)


def render(tmpl, name):
    value = tmpl.template(trust_as_template("{{ %s }}" % name))
    return json.loads(value) if isinstance(value, str) and value[:1] in "[{" else value


@pytest.mark.parametrize("fact", ["release_gpus_from", "release_gpus_advanced", "proxmox_node_host", "pct_vmid",
                                  "_release_gpus_vmid", "predeploy_hosts", "release_gpus_container_restart",
                                  "host_key_checking", "control_path"])
def test_a_fact_named_like_a_setting_fails_every_guarded_setting_naming_it(fact):
    tmpl = templar({fact: "evil", "distribution": "Debian"})
    assert render(tmpl, "_release_gpus_fact_collisions") == [fact]
    for name in GUARDED:
        with pytest.raises(AnsibleError, match=r"refused: facts named like settings .*ansible_facts\.%s\b" % fact):
            render(tmpl, name)


def test_ordinary_facts_and_inject_off_refuse_nothing():
    facts = {"distribution": "Debian", "hostname": "ct101", "ssh_host_key_rsa_public": "AAAA", "python": {}}
    assert render(templar(facts), "_release_gpus_node_host") == "pve1"
    assert int(render(templar(facts), "_release_gpus_vmid")) == 101
    off = templar({"release_gpus_from": "node", "pct_vmid": 102}, inject=False)
    assert render(off, "_release_gpus_fact_collisions") == []
    assert render(off, "_release_gpus_node_host") == "pve1"


def test_the_probe_fails_first_when_the_fact_cache_holds_one():
    """The probe is the role's first task: its argument carries the guard."""
    with pytest.raises(AnsibleError, match=r"ansible_facts\.release_gpus_from"):
        render(templar({"release_gpus_from": "node"}), "_release_gpus_stop_spec")
    assert render(templar({}), "_release_gpus_stop_spec")["refuse"] == ""


def route(hosts):
    """fleet.yml's route over hostvars-like dicts, as its run_once set_fact renders it."""
    task = next(t for t in load("tasks/fleet.yml") if t["name"].startswith("Route each host"))
    tmpl = templar({}, _release_gpus_batch=hosts, _release_gpus_per_node=1, _release_gpus_key_var="ansible_host")
    tmpl.available_variables = dict(tmpl.available_variables, **{k: trusted(v) for k, v in task["vars"].items()
                                                                 if k not in ("_release_gpus_batch", "_release_gpus_per_node",
                                                                              "_release_gpus_key_var")})
    return render(tmpl, "_release_gpus_route_json")


def test_the_fleet_route_sends_a_host_with_such_a_fact_alone_to_the_container_path():
    good = {"inventory_hostname": "ct101", "pct_vmid": 101, "proxmox_node_host": "pve1", "ansible_host": "n1",
            "ansible_facts": {}}
    bad = {"inventory_hostname": "ct102", "pct_vmid": 103, "proxmox_node_host": "pve1", "ansible_host": "n1",
           "ansible_facts": {"pct_vmid": 103}}
    got = route([good, bad])
    assert got["ct101"]["node_path"] is True and got["ct101"]["peers"] == ["ct101"]
    assert got["ct102"]["node_path"] is False and got["ct102"]["vmid"] == 0 and got["ct102"]["tasks"] == "main"


def owned_uuids(before, node_gpus, vmid=102):
    """node_release.yml's GPUs for the node-side release: the container's answer among those the node says are its."""
    task = next(t for t in load("tasks/node_release.yml") if t["name"] == "Node | Release from the node")
    tmpl = templar({}, release_gpus_release={"before": before}, _release_gpus_node_owned={"gpus": node_gpus},
                   pct_vmid=vmid)
    tmpl.available_variables = dict(tmpl.available_variables, **trusted(task["vars"]))
    return render(tmpl, "_release_gpus_uuids")


def test_the_node_side_release_takes_only_gpus_the_node_says_are_the_containers():
    node_gpus = [{"uuid": "GPU-a", "passed_into": [102], "by_container": {}},
                 {"uuid": "GPU-b", "passed_into": [103], "by_container": {"103": 512}},
                 {"uuid": "GPU-c", "passed_into": [103], "by_container": {"102": 300}},
                 {"uuid": "GPU-d", "passed_into": None, "by_container": {}}]
    before = [{"uuid": u} for u in ("GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-elsewhere")]
    assert owned_uuids(before, node_gpus) == ["GPU-a", "GPU-c"]
    assert owned_uuids(before, []) == []


def test_the_roles_messages_lose_a_containers_terminal_escapes():
    """Red team: the role's own messages carry container strings (diagnosis, the node's message): escapes go."""
    tmpl = templar({})
    text = tmpl.template(trust_as_template("{{ 'held by \x1b]0;PWNED\x07\x1b[2J' | regex_replace(_release_gpus_ctrl, ' ') }}"))
    assert "\x1b" not in text and "\x07" not in text and "PWNED" in text, repr(text)
