"""Issue 45: the role's variables are checked once, at the play's entry into the role, on every path: each entry
point that a playbook uses (fleet, prepare, node_view) has its entry in meta/argument_specs.yml, and the role's own
includes pass rolespec_validate: false. The plays run for real (ansible-playbook, the collection's playbooks) against
hosts that refuse every connection (port 1 on loopback): a bad variable must fail the entry's validation task, naming
it, with no host unreachable, since nothing may reach a host before the check."""
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from _templating import REPO

BIN = os.path.dirname(sys.executable)
ROLE = os.path.join(REPO, "roles", "release_gpus")
RECAP = re.compile(r"^(\S+)\s*:\s*ok=\d+\s+changed=\d+\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
VALIDATION = "Validating arguments against arg spec"


def inventory(tmp_path):
    """Two containers of node pve1, on the node path by default; every host refuses a connection at once."""
    refuse = {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_user": "root",
              "ansible_ssh_common_args": "-o ConnectTimeout=2 -o StrictHostKeyChecking=no"}
    cts = {"ct%d" % vmid: dict(refuse, ansible_connection="ssh", proxmox_node_host="pve1", pct_vmid=vmid)
           for vmid in (101, 102)}
    inv = {"all": {"children": {"gpu_containers": {"hosts": cts},
                                "proxmox_nodes": {"hosts": {"pve1": dict(refuse, ansible_connection="ssh")}}}}}
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


def checks_run(out):
    """The entry points whose validation task ran (a skipped one, a static import's under its when, is not counted)."""
    ran = []
    for block in out.split("\nTASK [")[1:]:
        match = re.match(r"gpuops\.fleet\.release_gpus : %s '(\w+)'" % VALIDATION, block)
        if match and re.search(r"^(ok|fatal|failed): ", block, re.M):
            ran.append(match.group(1))
    return ran


def play(tmp_path, book, extra):
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps(extra))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_HOST_KEY_CHECKING="0",
               ANSIBLE_RETRY_FILES_ENABLED="0")
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", inventory(tmp_path),
                           os.path.join(REPO, "playbooks", book), "-e", "@" + str(vars_file)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180, check=False)
    return proc.returncode, proc.stdout + proc.stderr


# (playbook, extra vars that pick the entry, the entry that must check)
ENTRIES = [
    ("release_gpus.yml", {}, "fleet"),
    ("predeploy_check.yml", {"predeploy_release": True}, "fleet"),
    ("predeploy_check.yml", {"predeploy_install_deps": True}, "prepare"),
    ("predeploy_check.yml", {}, "node_view"),
    ("gpu_info.yml", {"gpu_status_install_deps": True}, "prepare"),
    ("gpu_info.yml", {}, "node_view"),
]


@pytest.mark.parametrize("book, extra, entry", ENTRIES, ids=["%s-%s" % (b[:-4], e) for b, x, e in ENTRIES])
def test_a_typo_in_release_gpus_advanced_fails_the_entrys_check_naming_it_before_any_host_is_reached(
        tmp_path, book, extra, entry):
    rc, out = play(tmp_path, book, dict(extra, release_gpus_advanced={"verify_timout": 5}))
    assert rc == 2, out
    assert "release_gpus_advanced.verify_timout. Supported parameters include" in out, out
    # one check, the entry's, and it is the one that failed
    assert checks_run(out) == [entry], out
    recap = RECAP.findall(out)
    assert sorted(h for h, unreachable, failed in recap if failed != "0") == ["ct101", "ct102"], out
    assert all(unreachable == "0" for dummy, unreachable, dummy2 in recap), out     # nothing was contacted
    assert "UNREACHABLE" not in out, out


def test_a_term_timeout_that_is_no_number_fails_at_the_check_not_on_the_node(tmp_path):
    """-e release_gpus_term_timeout=ten (a string, as -e key=value gives it) on the default path."""
    rc, out = play(tmp_path, "release_gpus.yml", {"release_gpus_term_timeout": "ten"})
    assert rc == 2, out
    assert re.search(r"argument 'release_gpus_term_timeout' is of type .*str.* unable to convert to float", out), out
    assert "Route each host" not in out and "Node path" not in out and "UNREACHABLE" not in out, out


def test_the_old_proxmox_api_keys_fail_the_check_naming_them(tmp_path):
    """0.1.0's proxmox_api keys (host, user, token_id ...) were removed: they fail the check, naming the key."""
    rc, out = play(tmp_path, "release_gpus.yml",
                   {"release_gpus_advanced": {"proxmox_api": {"host": "pve1.example.org", "user": "root@pam"}}})
    assert rc == 2, out
    assert ("release_gpus_advanced.proxmox_api.host, release_gpus_advanced.proxmox_api.user. Supported parameters include: "
            "api_host") in out, out
    assert "UNREACHABLE" not in out, out


def test_every_entry_point_has_the_same_spec_and_is_spelled_one_way():
    with open(os.path.join(ROLE, "meta", "argument_specs.yml")) as f:
        specs = yaml.safe_load(f)["argument_specs"]
    assert set(specs) == {"main", "fleet", "prepare", "node_view"}
    assert all(specs[name]["options"] == specs["main"]["options"] for name in specs)
    # each tasks_from of the playbooks and the role names an entry, spelled as the spec spells it (no .yml)
    used = set()
    for folder in (os.path.join(REPO, "playbooks"), os.path.join(ROLE, "tasks")):
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name)) as f:
                used.update(re.findall(r"tasks_from: *([^\s\"'{]+)", f.read()))
    assert used and used <= set(specs), used
    # the role's own includes never check again
    for name in ("fleet.yml", "fleet_node.yml"):
        with open(os.path.join(ROLE, "tasks", name)) as f:
            text = f.read()
        assert text.count("include_role:") == text.count("rolespec_validate: false"), name


def test_a_removed_flat_variable_fails_the_fleet_entry_naming_its_advanced_key(tmp_path):
    """0.1.0's flat variables (release_gpus_verify_timeout ...) were removed: the argument check does not see a variable
    its spec does not list, so the fleet entry refuses them by name, before any host is reached."""
    rc, out = play(tmp_path, "release_gpus.yml", {"release_gpus_verify_timeout": 5, "release_gpus_wheel_dir": "/w"})
    assert rc == 2, out
    assert ("release_gpus_verify_timeout, release_gpus_wheel_dir: removed (issue 45); set "
            "release_gpus_advanced.verify_timeout, release_gpus_advanced.wheel_dir instead") in " ".join(out.split()), out
    assert "UNREACHABLE" not in out and "Node path" not in out, out    # each host failed at the include, before any task


def test_a_removed_flat_variable_of_one_host_fails_that_host(tmp_path):
    """A removed variable in one host's own variables (host_vars) fails that host, whichever host comes first in its
    batch (red team: a run_once check saw only the first host's variables)."""
    with open(inventory(tmp_path)) as handle:
        inv = yaml.safe_load(handle)
    inv["all"]["children"]["gpu_containers"]["hosts"]["ct102"]["release_gpus_docker_containers"] = ["vllm"]
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump(inv))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", ANSIBLE_HOST_KEY_CHECKING="0")
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"),
                           os.path.join(REPO, "playbooks", "release_gpus.yml")],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("release_gpus_docker_containers: removed (issue 45); set release_gpus_advanced.docker_containers instead"
            in " ".join(out.split())), out
    failed_at_include = re.search(r"(fatal|failed): \[ct102\].*?removed \(issue 45\)", out, re.S)
    assert failed_at_include and "ct102 -> pve1" not in out, out    # ct102 never reached its node
