"""playbooks/gpu_info.yml (gpu_status.yml before 0.2.0), predeploy_check.yml and release_gpus.yml (throttle, serial,
max_fail_percentage) against the lab, through gpuops.fleet.pct. Truth from `labctl gpus` and /proc."""
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from _labfixture import clean_role_lab, module_lab
from _rolelab import REPO, RoleLab, alive, parse_recap, wait_until, wave_includes

LAB_ID = os.environ.get("PLAYBOOK_TEST_LAB_ID", "playtest")


lab = module_lab(lambda: RoleLab(LAB_ID))
clean = clean_role_lab()


def test_gpu_status_reports_the_fleet_and_changes_nothing(clean):
    lab = clean
    holder = lab.run("plain", 101, [1], 384)
    monitor = lab.run("monitor", 201)
    result = lab.playbook("gpu_info.yml", limit="ct101,ct201")     # a container of each node; the others add time
    assert result.rc == 0, result
    assert sorted(result.recap) == ["ct101", "ct201"] and result.changed() == 0, result
    pid_in_ct = holder["container_holders"][0]
    assert re.search(r"ct101\s+GPU 1 .*used\s+384 MiB\s+BUSY holders %d\b" % pid_in_ct, result.output), result
    # the whole clients list: the monitor, and never the module's own NVML client
    assert re.search(r"ct201\s+GPU 0 .*used\s+0 MiB\s+free holders -\s+clients %d\""
                     % monitor["container_roles"]["monitor"], result.output), result
    assert alive(holder["holders"][0]) and alive(monitor["host_pids"][0])
    assert lab.gpus()[("101", 1)] == 384


def test_gpu_status_reads_each_node_once_for_its_containers(clean):
    """Issue 20: with release_gpus_from auto (the default), gpu_info.yml reads each node once; each container
    still has its lines: the GPUs its config passes in, numbered as on the node, holders with their container."""
    lab = clean
    holder = lab.run("plain", 101, [1], 384)
    result = lab.playbook("gpu_info.yml", {"release_gpus_from": "auto"})
    assert result.rc == 0 and len(result.recap) == 6 and result.changed() == 0, result
    reads = result.output.split("Node view | Read each node's GPUs once")[1].split("TASK [")[0]
    assert sorted(re.findall(r"^ok: \[ct\d+ -> (pve\d)", reads, re.M)) == ["pve1", "pve2"], result
    assert re.search(r"ct101\s+GPU 1 .*used\s+384 MiB\s+BUSY holders %d \(container 101\)" % holder["node_holders"][0],
                     result.output), result     # the node's pid: the lab's nodes have pid namespaces of their own
    for host, gpus in (("ct101", (0, 1)), ("ct102", (2, 3)), ("ct203", (4, 5))):   # node indexes, two each
        assert sorted(int(i) for i in re.findall(r'"%s\s+GPU (\d+) ' % host, result.output)) == list(gpus), result
    assert alive(holder["holders"][0]) and lab.gpus()[("101", 1)] == 384


def predeploy_lines(output):
    """The PREDEPLOY lines, as the README's deploy script greps them."""
    return re.findall(r'^ *"(PREDEPLOY [^"]*)', output, re.M)


def uuid_of(lab, vmid, index):
    return next(g["uuid"] for g in lab.labctl("gpus") if (g.get("visible_in") or {}).get(str(vmid)) == index)


def test_predeploy_check_fails_naming_the_busy_container_and_gpu(clean):
    lab = clean
    holder = lab.run("plain", 102, [0], 512)
    result = lab.playbook("predeploy_check.yml", {"predeploy_hosts": "ct101,ct102"})   # a clean one, the busy one
    assert result.rc == 2, result   # the documented exit status for a GPU at fault
    assert result.failed_hosts() == ["ct102"], result
    assert predeploy_lines(result.output) == [
        "PREDEPLOY FAIL: GPUs at fault: 1",
        "PREDEPLOY FAULT ct102: GPU 0 (%s): 512 MiB used, holders %d"
        % (uuid_of(lab, 102, 0), holder["container_holders"][0])], result
    assert alive(holder["holders"][0]), "predeploy_check must not release unless asked"
    assert lab.gpus()[("102", 0)] == 512


def test_predeploy_check_reads_each_node_once_and_still_counts_containers(clean):
    """Issue 20: with release_gpus_from auto (the default), each node is read once for its containers; the verdict
    is still per container (its GPUs by device number from its config), and the count is in containers."""
    lab = clean
    holder = lab.run("plain", 102, [0], 512)
    result = lab.playbook("predeploy_check.yml", {"release_gpus_from": "auto", "predeploy_expect_hosts": 6})
    assert result.rc == 2 and result.failed_hosts() == ["ct102"], (predeploy_lines(result.output), result)
    node_reads = re.findall(r"^ok: \[(ct\d+) -> (pve\d)", result.output.split("Node view | Read each node's GPUs once")[1].split("TASK [")[0],
                            re.M)
    assert sorted(node for dummy, node in node_reads) == ["pve1", "pve2"], result     # one read per node
    assert predeploy_lines(result.output) == [
        "PREDEPLOY FAIL: GPUs at fault: 1",
        "PREDEPLOY FAULT ct102: GPU 2 (%s): 512 MiB used, holders %d (container 102)"
        % (uuid_of(lab, 102, 0), holder["node_holders"][0])], result
    assert alive(holder["holders"][0]), "predeploy_check must not release unless asked"
    os.kill(holder["holders"][0], 9)
    wait_until(lambda: lab.gpus()[("102", 0)] == 0, 30, "GPU 0 of ct102 to be freed")
    # the same container passes once its holder is gone (all six pass from the nodes in the deploy script's test)
    wait = lab.playbook("predeploy_check.yml", {"release_gpus_from": "auto", "predeploy_hosts": "ct102",
                                                "predeploy_expect_hosts": 1})
    assert wait.rc == 0 and predeploy_lines(wait.output) == [
        "PREDEPLOY OK: every targeted GPU is free on 1 containers"], wait


def test_predeploy_check_passes_on_free_gpus(clean):
    # as many containers as expected (a string, as -e key=value gives it): a container of each node
    result = clean.playbook("predeploy_check.yml", {"predeploy_hosts": "ct101,ct201", "predeploy_expect_hosts": "2"})
    assert result.rc == 0, result
    # the containers, and localhost for the first play (what the check has to check)
    assert result.failed_hosts() == [] and sorted(result.recap) == ["ct101", "ct201", "localhost"], result
    assert predeploy_lines(result.output) == ["PREDEPLOY OK: every targeted GPU is free on 2 containers"], result


def test_predeploy_check_threshold_and_gpu_selection(clean):
    lab = clean
    lab.run("plain", 101, [1], 100)
    # GPU 1 is not targeted: free
    result = lab.playbook("predeploy_check.yml", {"release_gpus_gpus": [0]}, limit="ct101")
    assert result.rc == 0 and predeploy_lines(result.output) == [
        "PREDEPLOY OK: every targeted GPU is free on 1 containers"], result
    # 100 MiB is under a 128 MiB threshold, over the default 64
    result = lab.playbook("predeploy_check.yml", {"release_gpus_threshold_mib": 128}, limit="ct101")
    assert result.rc == 0, result
    result = lab.playbook("predeploy_check.yml", limit="ct101")
    assert result.rc == 2 and predeploy_lines(result.output)[0] == "PREDEPLOY FAIL: GPUs at fault: 1", result


def test_predeploy_check_exits_4_when_a_container_is_unreachable(clean):
    lab = clean
    result = lab.playbook("predeploy_check.yml", {"ansible_host": "127.0.0.1", "ansible_port": 9},
                          limit="ct203")
    assert result.rc == 4, result
    assert predeploy_lines(result.output) == [], result


def readme_deploy_script():
    """The deploy script of the pre-deploy guide, as written there (an RST code block between two comments)."""
    with open(os.path.join(REPO, "docs", "docsite", "rst", "guide_predeploy.rst")) as handle:
        text = handle.read()
    block = text.split(".. predeploy-deploy-script", 1)[1].split(".. /predeploy-deploy-script", 1)[0]
    return textwrap.dedent(block.split(".. code:: sh\n", 1)[1]).strip() + "\n"


@pytest.mark.parametrize("busy", [False, True], ids=["free", "busy"])
def test_predeploy_readme_deploy_script_deploys_only_on_free_gpus(clean, busy):
    lab = clean
    if busy:
        lab.run("plain", 201, [1], 512)
    script = os.path.join(lab.workdir, "deploy.sh")
    with open(script, "w") as handle:
        handle.write(readme_deploy_script())
    env = dict(lab.env, INVENTORY=lab.inventory, DEPLOY="echo DEPLOYED",
               PATH=os.path.dirname(sys.executable) + os.pathsep + lab.env.get("PATH", ""))
    proc = subprocess.run(["sh", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300, check=False)
    lines = proc.stdout.splitlines()
    if busy:
        assert proc.returncode == 1 and "not deploying: GPUs busy, or nothing (or too little) checked" in proc.stderr, proc
        assert lines[0] == "PREDEPLOY FAIL: GPUs at fault: 1" and lines[1].startswith(
            "PREDEPLOY FAULT ct201: GPU 1 (%s): 512 MiB used" % uuid_of(lab, 201, 1)), proc
        assert "DEPLOYED" not in lines, proc
    else:
        assert proc.returncode == 0, proc
        assert lines == ["PREDEPLOY OK: every targeted GPU is free on 6 containers", "DEPLOYED"], proc


# ---- predeploy_check.yml never passes when it checked nothing, or too little (issue 17) ---------------------

# What the playbook's header, the README and its deploy script tell a user to set. "bare" is a user who did not.
TOLD = {"ANSIBLE_INVENTORY_UNPARSED_FAILED": "true", "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "true"}
CHECK_PLAY = "PLAY [Check that the GPUs are free before a deploy]"
Run = collections.namedtuple("Run", "rc output")


def predeploy(inventories, told, extra_vars=(), limit=None, env=None):
    """A real ansible-playbook run of predeploy_check.yml, with or without what users are told to set."""
    env = dict(env or os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    for name in TOLD:
        env.pop(name, None)
    if told:
        env.update(TOLD)
    cmd = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook")]
    for inventory in inventories:
        cmd += ["-i", str(inventory)]
    cmd.append(os.path.join(REPO, "playbooks", "predeploy_check.yml"))
    for extra in extra_vars:   # "key=value" (strings, as a shell script passes them) or JSON
        cmd += ["-e", extra]
    if limit:
        cmd += ["--limit", limit]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300, check=False)
    return Run(proc.returncode, proc.stdout)


def one_line(text):
    return " ".join(text.split())


def static_inventory(tmp_path, groups=None, name="static.yml"):
    """A tiny inventory whose hosts nothing may contact: any connection is refused (port 9), so a run
    that reached them would exit 4, never 2."""
    groups = groups or {"gpu_containers": ["ct101", "ct102"], "other": ["x1"]}
    unreachable = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 9}
    inv = {"all": {"children": {group: {"hosts": {h: dict(unreachable) for h in hosts}}
                                for group, hosts in groups.items()}}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(inv))
    return str(path)


@pytest.mark.parametrize("told", [False, True], ids=["bare", "told"])
def test_predeploy_check_fails_when_predeploy_hosts_matches_no_host(tmp_path, told):
    inv = static_inventory(tmp_path)
    # a typo in the group
    run = predeploy([inv], told, ["predeploy_hosts=gpu_containerz"])
    assert run.rc == 2, run.output
    assert predeploy_lines(run.output) == [
        "PREDEPLOY FAIL: predeploy_hosts 'gpu_containerz' matches no host: none of the inventory's 3 hosts is in it"
        " (groups: gpu_containers, other)"], run.output
    assert CHECK_PLAY not in run.output and "UNREACHABLE" not in run.output, run.output
    if told:    # the variables change how ansible-core treats a source that fails to parse; these all parse
        return
    # an inventory without the default group
    run = predeploy([static_inventory(tmp_path, {"workers": ["w1"]}, "workers.yml")], told)
    assert run.rc == 2, run.output
    assert predeploy_lines(run.output) == [
        "PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: none of the inventory's 1 hosts is in it"
        " (groups: workers)"], run.output
    # a limit that names localhost runs the first play, which counts within the limit
    run = predeploy([inv], told, limit="x1,localhost")
    assert run.rc == 2 and CHECK_PLAY not in run.output, run.output
    assert predeploy_lines(run.output) == [
        "PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: none of its 2 hosts (ct101, ct102)"
        " is in --limit 'x1,localhost'"], run.output


@pytest.mark.parametrize("told", [False, True], ids=["bare", "told"])
def test_predeploy_check_fails_on_an_inventory_path_that_does_not_exist(tmp_path, told):
    missing = str(tmp_path / "pve.proxmox_gpu.yml")
    good = static_inventory(tmp_path)
    for inventories in ([missing], [good, missing]):
        run = predeploy(inventories, told)
        assert CHECK_PLAY not in run.output and "UNREACHABLE" not in run.output, run.output
        if told:   # ansible-core stops before any play
            assert run.rc == 1, run.output
            assert "[ERROR]: Completely failed to parse inventory source %s" % missing in run.output, run.output
            assert predeploy_lines(run.output) == [], run.output
            continue
        assert run.rc == 2, run.output
        lines = predeploy_lines(run.output)
        assert lines[0] == "PREDEPLOY FAIL: inventory source %s does not exist" % missing, run.output
        if len(inventories) == 1:
            assert lines[1:] == [
                "PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: the inventory has none (sources: %s;"
                " a source that failed to parse, or a Proxmox API token without VM.Audit, lists none: see the warnings"
                " above)" % missing], run.output
        else:   # the good source alone would have checked ct101 and ct102
            assert lines[1:] == [
                "PREDEPLOY FAIL: inventory sources %s, %s: with more than one source, or a directory, one that fails"
                " to parse is only a warning unless ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED=true; set it"
                % (good, missing)], run.output


def test_predeploy_check_refuses_a_bad_predeploy_expect_hosts(tmp_path):
    """End to end, a string (-e key=value, as a deploy script passes it) and a typed value (-e JSON); every other
    bad value: tests/unit/playbooks/test_predeploy_expressions.py, on the playbook's own expression."""
    inv = static_inventory(tmp_path)
    for extra, shown in (("predeploy_expect_hosts=abc", "abc"), ('{"predeploy_expect_hosts": true}', "True")):
        run = predeploy([inv], True, [extra])
        assert run.rc == 2, (extra, run.output)
        assert ("predeploy_expect_hosts must be a positive integer (the number of containers the check must read at"
                " least), got '%s'" % shown) in one_line(run.output), (extra, run.output)
        # it fails before anything is read: no host is contacted (that would be UNREACHABLE, exit 4)
        assert "TASK [Read the GPUs]" not in run.output and "UNREACHABLE" not in run.output, (extra, run.output)


def api_inventory_variant(lab, tmp_path, name, secret=None, **changes):
    """A copy of the lab's gpuops.fleet.proxmox_gpu inventory with some options changed; secret: the token
    secret read from that file of the lab API's state (STATE/api/SECRET)."""
    api_inventory = lab.labctl("inventory", "--api", parse=False)
    with open(api_inventory) as handle:
        conf = yaml.safe_load(handle)
    conf.update(changes)
    if secret:
        with open(os.path.join(os.path.dirname(api_inventory), "api", secret)) as handle:
            conf["token_secret"] = handle.read().strip()
    path = tmp_path / name
    path.write_text(yaml.safe_dump(conf))
    return str(path)


@pytest.mark.parametrize("told", [False, True], ids=["bare", "told"])
def test_predeploy_check_fails_when_the_proxmox_api_call_fails(lab, tmp_path, told):
    """The lab's Proxmox API refuses a wrong token: alone, and beside a static inventory of the same containers."""
    bad = api_inventory_variant(lab, tmp_path, "bad.proxmox_gpu.yml", token_secret="0" * 32)
    refused = "proxmox_gpu: authentication failed for root@pam"
    alone = ("PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: the inventory has none (sources: %s;"
             " a source that failed to parse, or a Proxmox API token without VM.Audit, lists none: see the warnings"
             " above)" % bad)
    # one failing source among several: the static one alone would check (and pass) 6 free containers
    several = ("PREDEPLOY FAIL: inventory sources %s, %s: with more than one source, or a directory, one that fails"
               " to parse is only a warning unless ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED=true; set it"
               % (lab.inventory, bad))
    for sources, line in (([bad], alone), ([lab.inventory, bad], several)):
        run = predeploy(sources, told, env=lab.env)
        assert run.rc == (1 if told else 2), run.output
        assert refused in one_line(run.output) and CHECK_PLAY not in run.output, run.output
        if told:
            assert "[ERROR]: Completely failed to parse inventory source %s" % bad in run.output, run.output
        else:
            assert predeploy_lines(run.output) == [line], run.output


def test_predeploy_check_fails_on_a_token_without_vm_audit(lab, tmp_path):
    """The API answers, lists no guest: ansible-core parsed it, so only the check itself can refuse."""
    conf = api_inventory_variant(lab, tmp_path, "noaudit.proxmox_gpu.yml", secret="token-noaudit", token_id="noaudit")
    run = predeploy([conf], True, env=lab.env)
    assert run.rc == 2, run.output
    assert "lacks VM.Audit" in one_line(run.output) and CHECK_PLAY not in run.output, run.output
    assert predeploy_lines(run.output) == [
        "PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: the inventory has none (sources: %s;"
        " a source that failed to parse, or a Proxmox API token without VM.Audit, lists none: see the warnings"
        " above)" % conf], run.output


@contextlib.contextmanager
def api_fault(lab, faults):
    """STATE/api/faults.json, which the lab API reads at each request; removed after."""
    path = os.path.join(os.path.dirname(lab.labctl("inventory", "--api", parse=False)), "api", "faults.json")
    with open(path, "w") as handle:
        json.dump(faults, handle)
    try:
        yield
    finally:
        os.unlink(path)


def test_predeploy_check_fails_when_fewer_containers_than_expected(clean):
    lab = clean
    # as many as expected: test_predeploy_check_passes_on_free_gpus
    # under a limit (the first play does not run): still counted
    result = lab.playbook("predeploy_check.yml", {"predeploy_expect_hosts": 2}, limit="ct101")
    assert result.rc == 2, result
    assert predeploy_lines(result.output) == ["PREDEPLOY FAIL: expected 2 containers, checked 1"], result
    assert ("expected 2 containers (predeploy_expect_hosts), checked 1 of predeploy_hosts 'gpu_containers': ct101"
            in one_line(result.output)), result
    # with GPUs at fault too: both lines (on two containers: a clean one and a busy one)
    lab.run("plain", 202, [1], 256)
    result = lab.playbook("predeploy_check.yml", {"predeploy_expect_hosts": 3, "predeploy_hosts": "ct201,ct202"})
    assert result.rc == 2, result
    lines = predeploy_lines(result.output)
    assert lines[:2] == ["PREDEPLOY FAIL: GPUs at fault: 1", "PREDEPLOY FAIL: expected 3 containers, checked 2"], result
    assert lines[2].startswith("PREDEPLOY FAULT ct202: GPU 1 ") and len(lines) == 3, result
    assert ("expected 3 containers (predeploy_expect_hosts), checked 2 of predeploy_hosts 'ct201,ct202': ct201, ct202"
            in one_line(result.output)), result


def test_predeploy_check_counts_what_the_proxmox_inventory_left_out(clean):
    """The API fails one container's config: the inventory leaves it out with a warning, and ansible-core
    (told or not) goes on; only predeploy_expect_hosts sees the shortfall."""
    lab = clean
    fault = {"path": "^/nodes/pve2/lxc/202/config", "status": 500,
             "message": "Configuration file 'nodes/pve2/lxc/202.conf' does not exist"}
    static, lab.inventory = lab.inventory, lab.labctl("inventory", "--api", parse=False)
    try:
        with api_fault(lab, [fault]):
            unguarded = lab.playbook("predeploy_check.yml")
            guarded = lab.playbook("predeploy_check.yml", {"predeploy_expect_hosts": 6})
    finally:
        lab.inventory = static
    assert unguarded.rc == 0 and sorted(unguarded.recap) == ["ct101", "ct102", "ct103", "ct201", "ct203", "localhost"], \
        unguarded
    assert "left out CT 202 (ct202) on pve2" in one_line(unguarded.output), unguarded
    assert guarded.rc == 2, guarded
    assert predeploy_lines(guarded.output) == ["PREDEPLOY FAIL: expected 6 containers, checked 5"], guarded


@pytest.mark.parametrize("case", ["missing", "no-group"])
def test_predeploy_readme_deploy_script_never_deploys_when_nothing_is_checked(tmp_path, case):
    """The README's script as written, run by a user who set nothing: it sets what it must itself."""
    script = tmp_path / "deploy.sh"
    script.write_text(readme_deploy_script())
    inventory = (str(tmp_path / "missing.yml") if case == "missing"
                 else static_inventory(tmp_path, {"workers": ["w1"]}))
    env = dict(os.environ, INVENTORY=inventory, DEPLOY="echo DEPLOYED", ANSIBLE_NOCOLOR="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for name in TOLD:
        env.pop(name, None)
    proc = subprocess.run(["sh", str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 1 and "DEPLOYED" not in proc.stdout.splitlines(), proc
    if case == "missing":
        assert proc.stdout == "", proc
        assert "[ERROR]: Completely failed to parse inventory source %s" % inventory in proc.stderr, proc
        assert "not deploying: the check itself failed (exit 1)" in proc.stderr, proc
    else:
        assert proc.stdout.splitlines() == [
            "PREDEPLOY FAIL: predeploy_hosts 'gpu_containers' matches no host: none of the inventory's 1 hosts is"
            " in it (groups: workers)"], proc
        assert "not deploying: GPUs busy, or nothing (or too little) checked" in proc.stderr, proc


@pytest.mark.parametrize("route", ["container", "auto"])
def test_predeploy_check_can_release_first(clean, route):
    """predeploy_release takes the route release_gpus.yml takes: from the node where the node is known (auto)."""
    lab = clean
    holder = lab.run_fork_inherit_orphan(103, 0, 256)
    result = lab.playbook("predeploy_check.yml", {"predeploy_release": True, "release_gpus_from": route}, limit="ct103")
    assert result.rc == 0, result
    assert ("Node path | Release every selected container" in result.output) == (route == "auto"), result.output
    assert not alive(holder["holders"][0])
    assert lab.gpus()[("103", 0)] == 0


def test_release_is_throttled_per_node_but_parallel_across_nodes(clean):
    lab = clean
    holders = {vmid: lab.run("plain", vmid, [0], 128) for vmid in ("101", "102", "201", "202")}   # two per node
    result = lab.playbook("release_gpus.yml", {"release_gpus_node_concurrency": 1}, limit="ct101,ct102,ct201,ct202")
    assert result.rc == 0, result
    waves = wave_includes(result.output)
    assert sorted(waves) == [0, 1], waves
    for wave, hosts in waves.items():
        assert len(hosts) == 2 and {h[2] for h in hosts} == {"1", "2"}, "one container per node per wave: %s" % waves
    assert all(used == 0 for used in lab.gpus().values())
    assert not any(alive(h["holders"][0]) for h in holders.values())
    # Truth in time: on one node the signals follow each other wave by wave; across nodes they overlap.
    first_signal = {host[2:]: min(a["time"] for a in rep["actions"]) for host, rep in result.reports.items()}
    for node in ("1", "2"):
        times = sorted(t for vmid, t in first_signal.items() if vmid.startswith(node))
        assert all(b - a > 1.0 for a, b in zip(times, times[1:])), times
    assert abs(first_signal["101"] - first_signal["201"]) < 1.0, first_signal


def test_serial_batches_stop_at_max_fail_percentage(clean):
    lab = clean
    # ct102 fails: its supervisord program respawns and the role is not told to stop it.
    lab.run("respawn", 102, [1], 128)
    later = lab.run("plain", 201, [0], 128)
    variables = {"release_gpus_serial": 3, "release_gpus_max_fail_percentage": 0, "release_gpus_node_concurrency": 3}
    result = lab.playbook("release_gpus.yml", variables)
    assert result.rc != 0, result
    assert result.failed_hosts() == ["ct102"], result
    assert sorted(result.recap) == ["ct101", "ct102", "ct103"], "the second batch must not start: %s" % result
    assert alive(later["holders"][0]) and lab.gpus()[("201", 0)] == 128


# ---- gpu_info.yml's node view (hosts in proxmox_nodes) ------------------------------------------

# A node-side gpu_status result as the module returns it on a Proxmox node (view "node"), trimmed to what
# the table reads: GPU 1 shared by containers 101 and 202, a process of the node itself, memory no process
# accounts for; GPU 0 free.
RECORDED_NODE = {
    "view": "node", "changed": False, "diagnosis": ["pid 1103 (python) holds GPU 1 (384 MiB by NVML)"],
    "gpus": [
        {"index": 0, "uuid": "GPU-366a3da0-58e2-5c86-ab59-07ebef1e490e", "memory": {"used_mib": 0},
         "by_container": {}, "holders": [], "clients": [1106], "passed_into": [101]},
        {"index": 1, "uuid": "GPU-859373da-0688-53f1-b5fb-d1b93f103fb2", "memory": {"used_mib": 1088},
         "by_container": {"202": 512, "101": 384, "unattributed": 64, "host": 128}, "holders": [3001, 1103, 2001],
         "clients": [], "passed_into": [101, 202]},
    ],
    "holders": [
        {"pid": 1103, "container": "101", "container_pid": 26, "name": "python", "gpus": [1]},
        {"pid": 2001, "container": "202", "container_pid": 7, "name": "sglang::tp0", "gpus": [1]},
        {"pid": 3001, "container": "host", "container_pid": None, "name": "vllm-omni", "gpus": [1]},
    ],
    "clients": [{"pid": 1106, "container": "101", "container_pid": 29, "name": "nvitop"}],
}


def node_tables(output):
    """{host: [table lines]} from the 'Print the node's table' task of the default stdout callback."""
    task = output.split("TASK [Print the node's table]", 1)[1].split("TASK [", 1)[0]
    return {host: json.loads(body)["msg"] for host, body in re.findall(r"^ok: \[([^\]]+)\] => (\{.*?^\})", task, re.M | re.S)}


def test_gpu_status_node_table_from_a_recorded_result(tmp_path):
    """No lab, no module: the node view renders recorded results (gpu_status_recorded) on local hosts."""
    inv = tmp_path / "nodes.yml"
    inv.write_text("all:\n  children:\n    gpu_containers:\n      hosts: {ct101: {ansible_connection: local}}\n"
                   "    proxmox_nodes:\n      hosts:\n        pve1: {ansible_connection: local}\n"
                   "        pve2: {ansible_connection: local}\n")
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps({"gpu_status_recorded": {
        "pve1": RECORDED_NODE, "pve2": {"failed": True, "msg": "NVML failed: Driver Not Loaded"}}}))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(inv),
                           os.path.join(REPO, "playbooks", "gpu_info.yml"), "-e", "gpu_status_hosts=proxmox_nodes",
                           "-e", "@%s" % recorded], cwd=REPO, env=dict(os.environ, ANSIBLE_NOCOLOR="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=120,
                          check=False)
    out = proc.stdout
    assert proc.returncode == 2, out  # pve2 could not be read: that node fails
    # the container play leaves node hosts alone; ct101 is not in proxmox_nodes
    assert re.search(r"PLAY \[Report GPU memory and holders across the fleet\] \**\nskipping: no hosts matched", out), out
    assert "ct101" not in out.split("PLAY RECAP", 1)[1]
    tables = node_tables(out)
    assert tables["pve1"] == [
        "pve1: 2 GPUs, 1088 MiB used",
        "GPU  UUID          CONTAINER         MiB  HOLDERS (node pid/pid in container name)",
        "0    GPU-366a3da0  -                   0  -",
        "1    GPU-859373da  101               384  1103/26 python",
        "                   202               512  2001/7 sglang::tp0",
        "                   host              128  3001/- vllm-omni",
        "                   unattributed       64  -",
    ]
    assert tables["pve2"] == ["pve2: ERROR NVML failed: Driver Not Loaded"]
    assert "gpu_status failed on pve2: NVML failed: Driver Not Loaded" in out
    assert re.search(r"^pve1 +: ok=\d+ +changed=0 +unreachable=0 +failed=0", out, re.M), out


def test_gpu_status_node_view_in_the_lab(clean):
    """The node view through the gpuops.fleet.proxmox_gpu inventory (node hosts over plain ssh)."""
    lab = clean
    ct101 = lab.run("plain", 101, [1], 384)      # pve1 minor 1
    ct102 = lab.run("plain", 102, [0], 256)      # pve1 minor 2
    api_inventory = lab.labctl("inventory", "--api", parse=False)
    static, lab.inventory = lab.inventory, api_inventory
    try:
        result = lab.playbook("gpu_info.yml", extra_vars={"gpu_status_hosts": "proxmox_nodes"})
    finally:
        lab.inventory = static
    assert result.rc == 0, result
    assert sorted(result.recap) == ["pve1", "pve2"] and result.changed() == 0, result
    table = node_tables(result.output)["pve1"]
    assert table[0] == "pve1: 8 GPUs, 640 MiB used", table
    rows = {line.split()[0]: line for line in table[2:] if line[:1] != " "}
    assert re.match(r"1 +GPU-\S{8} +101 +384  %d/%d python" % (ct101["node_holders"][0], ct101["container_holders"][0]),
                    rows["1"]), table
    assert re.match(r"2 +GPU-\S{8} +102 +256  %d/%d python" % (ct102["node_holders"][0], ct102["container_holders"][0]),
                    rows["2"]), table
    assert re.match(r"0 +GPU-\S{8} +- +0  -$", rows["0"]), table
    assert lab.gpus()[("101", 1)] == 384 and alive(ct101["holders"][0]) and alive(ct102["holders"][0])


SHM_LEAK = ("import os, time\n"
            "with open('/dev/shm/sgl_shm_leak', 'wb') as f:\n"
            "    f.write(bytes(4096))\n"
            "os.utime('/dev/shm/sgl_shm_leak', (time.time() - 600, time.time() - 600))\n")


@pytest.mark.parametrize("route", ["container", "auto"])
def test_predeploy_check_fails_on_shared_memory_residue_read_inside_or_from_the_node(clean, route):
    """Issue 21: a leaked SGLang segment in ct202's /dev/shm fails the check on free GPUs, read in the container or
    from its node; predeploy_shm_residue=false leaves it out (one route: the playbook drops the residue either read
    returns); with predeploy_release and clean_shm the role removes it and the check passes. Checked on ct201 (clean)
    and ct202, the release on ct202 alone: the other containers add time, not cases."""
    lab = clean
    hosts = {"release_gpus_from": route, "predeploy_hosts": "ct201,ct202"}
    assert lab.exec(202, "python3", "-c", SHM_LEAK).returncode == 0
    try:
        result = lab.playbook("predeploy_check.yml", hosts)
        assert result.rc == 2 and result.failed_hosts() == ["ct202"], (predeploy_lines(result.output), result)
        assert predeploy_lines(result.output) == [
            "PREDEPLOY FAIL: containers with shared-memory residue: 1",
            "PREDEPLOY FAULT ct202: shared-memory residue: 1 file(s) of sglang that no live process uses, left by dead "
            "processes: /dev/shm/sgl_shm_leak; remove them before the deploy"], result
        if route == "container":    # the playbook drops the residue it was given, whichever route read it
            quiet = lab.playbook("predeploy_check.yml", dict(hosts, predeploy_shm_residue=False))
            assert quiet.rc == 0, quiet
        # the release first (predeploy_release) with clean_shm (off by default since issue 40): it removes the leak
        released = lab.playbook("predeploy_check.yml", dict(hosts, predeploy_release=True, predeploy_hosts="ct202",
                                                            release_gpus_advanced={"clean_shm": True}))
        assert released.rc == 0, predeploy_lines(released.output)
        assert lab.exec(202, "test", "-e", "/dev/shm/sgl_shm_leak").returncode == 1
    finally:
        lab.exec(202, "rm", "-f", "/dev/shm/sgl_shm_leak")


@pytest.mark.parametrize("route", ["container", "auto"])
def test_predeploy_check_fails_on_a_gpu_that_needs_a_reset_or_lacks_the_memory_asked(clean, route):
    """Issue 21: pending retired pages on ct201's GPU 1 (pve2 minor 1) fail the check with the reset remedy, read in
    the container or from its node; predeploy_need_mib above a GPU's memory fails every GPU with the numbers."""
    lab = clean
    lab.labctl("fault", "--node", "pve2", "--gpu", "1", "--health", "retired_pages_pending")
    try:
        result = lab.playbook("predeploy_check.yml", {"release_gpus_from": route, "predeploy_hosts": "ct201,ct202"})
    finally:
        lab.labctl("fault", "--node", "pve2", "--gpu", "1", "--health", "none")
    lines = predeploy_lines(result.output)
    assert result.rc == 2 and result.failed_hosts() == ["ct201"], (lines, result)
    assert lines[0] == "PREDEPLOY FAIL: GPUs at fault: 1", lines
    assert re.match(r"PREDEPLOY FAULT ct201: GPU 1 \(GPU-\S+\): not ready, retired_pages: retired pages are pending "
                    r"\(nvmlDeviceGetRetiredPagesPendingStatus: 1\).*; remedy: reset the GPU from the node", lines[1]), lines
    assert len(lines) == 2, lines
    short = lab.playbook("predeploy_check.yml", {"release_gpus_from": route, "predeploy_hosts": "ct202",
                                                 "predeploy_need_mib": 200000})
    lines = predeploy_lines(short.output)
    assert short.rc == 2 and lines[0] == "PREDEPLOY FAIL: GPUs at fault: 2", lines
    assert all(re.search(r"not ready, capacity: [\d,]+ MiB free, 200,000 MiB needed \(need_mib 200,000 MiB\); remedy: ",
                         line) for line in lines[1:]), lines
    fits = lab.playbook("predeploy_check.yml", {"release_gpus_from": route, "predeploy_hosts": "ct202",
                                                "predeploy_need_fraction": 0.9})
    assert fits.rc == 0, predeploy_lines(fits.output)


# ---- issue 45: every host in the report; a node that is unreachable; the pre-deploy verdict for pipelines -----

def node_down_inventory(lab, nodes=("pve1",)):
    """The lab's inventory with NODES unreachable (ssh to a port where nothing listens); their containers stay
    reachable (the pct connection reaches them through the node's sshd, which still listens on port 22)."""
    with open(lab.inventory) as handle:
        inv = yaml.safe_load(handle)
    for node in nodes:
        inv["all"]["children"]["pve_nodes"]["hosts"][node]["ansible_port"] = 9
    path = os.path.join(lab.workdir, "nodes-down-%s.yml" % "-".join(nodes))
    with open(path, "w") as handle:
        yaml.safe_dump(inv, handle)
    return path


def play_with_report(lab, book, inventory, extra_vars, tmp_name, limit=None, check=False):
    """ansible-playbook BOOK with the gpu_report callback on: (rc, stdout and stderr, rows of its JSON, the path of
    predeploy_report_path's file)."""
    rows_path = os.path.join(lab.workdir, tmp_name + "-rows.json")
    verdict_path = os.path.join(lab.workdir, tmp_name + "-predeploy.json")
    for path in (rows_path, verdict_path):
        if os.path.exists(path):
            os.unlink(path)
    variables = dict(extra_vars)
    if book == "predeploy_check.yml":
        variables["predeploy_report_path"] = verdict_path
    cmd = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", inventory,
           os.path.join(REPO, "playbooks", book), "-e", json.dumps(variables)]
    cmd += (["--limit", limit] if limit else []) + (["--check"] if check else [])
    env = dict(lab.env, ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report", GPUOPS_REPORT_PATH=rows_path)
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300, check=False)
    with open(rows_path) as handle:
        rows = json.load(handle)["rows"]
    return proc.returncode, proc.stdout, rows, verdict_path


@pytest.mark.parametrize("check", [True, False], ids=["check", "release"])
def test_containers_of_an_unreachable_node_fail_naming_it_and_each_has_a_report_row(clean, check):
    """Issue 45 (failed on 443c3b6): on the node path, with pve1 unreachable, ct101 runs the node task (unreachable)
    and ct102 failed with "GPUs not free ... no result" (ok in --check) and had no row. Now each fails naming the node,
    in check mode too, and each has a row with the verdict unreachable and the reason."""
    lab = clean
    rc, output, rows, dummy = play_with_report(
        lab, "release_gpus.yml", node_down_inventory(lab), {"release_gpus_advanced": {"install_deps": False}},
        "down-%s" % check, limit="ct101,ct102,ct201", check=check)
    assert rc == 4, output
    assert re.search(r"^fatal: \[ct101 -> pve1\]: UNREACHABLE!", output, re.M), output
    peer = re.search(r"^fatal: \[ct102\]: FAILED! => (.*)$", output, re.M)
    assert peer and "node pve1 unreachable: nothing was read or released for ct102 (container 102)" in peer.group(1), output
    assert "not free" not in peer.group(1) and not re.search(r"^ok: \[ct102\]", output.split("Node path | Fail")[-1], re.M)
    recap = parse_recap(output)
    assert (recap["ct101"]["unreachable"], recap["ct102"]["failed"], recap["ct201"]["failed"]) == (1, 1, 0), output
    by_host = collections.defaultdict(list)
    for row in rows:
        by_host[row["host"]].append(row)
    assert sorted(by_host) == ["ct101", "ct102", "ct201"], rows
    for host, vmid in (("ct101", 101), ("ct102", 102)):
        (row,) = by_host[host]
        assert (row["node"], row["container"], row["verdict"]) == ("pve1", vmid, "unreachable"), row
        assert row["reason"].startswith("node pve1 unreachable"), row
    assert by_host["ct201"] and all(r["verdict"] == ("check" if check else "free") for r in by_host["ct201"]), rows
    table = output.split("GPU REPORT")[-1]
    assert re.search(r"^pve1\s+102\s+ct102\s.*\sunreachable\s.*node pve1 unreachable", table, re.M), table


def test_predeploy_writes_its_json_verdict_and_a_failed_run_never_says_ok(clean):
    """Issue 45 (failed on 443c3b6: a failed run quoted "PREDEPLOY OK" from the playbook's source, and wrote no
    verdict): predeploy_report_path gets the verdict, the exit code that ansible-playbook returns and each container's
    verdict, reasons and remedies, when the check fails, when a node is unreachable and when it passes."""
    lab = clean
    holder = lab.run("plain", 102, [0], 512)
    variables = {"predeploy_hosts": "ct101,ct102,ct201", "predeploy_expect_hosts": 4}
    rc, output, rows, path = play_with_report(lab, "predeploy_check.yml", lab.inventory, variables, "busy")
    assert rc == 2 and "PREDEPLOY OK" not in output, output
    with open(path) as handle:
        verdict = json.load(handle)
    assert (verdict["verdict"], verdict["exit_code"], verdict["ready"], verdict["checked"]) == ("not_ready", 2, False, 3)
    assert "PREDEPLOY FAIL: expected 4 containers, checked 3" in verdict["reasons"], verdict
    mine = {c["host"]: c for c in verdict["containers"]}
    assert sorted(mine) == ["ct101", "ct102", "ct201"], verdict
    assert mine["ct101"]["verdict"] == mine["ct201"]["verdict"] == "ready", verdict
    busy = mine["ct102"]
    assert (busy["verdict"], busy["node"], busy["container"]) == ("not_ready", "pve1", 102), busy
    assert busy["reasons"] == ["GPU 2 (%s): 512 MiB used, holders %d (container 102)"
                               % (uuid_of(lab, 102, 0), holder["node_holders"][0])], busy
    assert busy["remedies"] and "release_gpus" in busy["remedies"][0], busy
    assert os.stat(path).st_mode & 0o777 == 0o600
    # pve1 unreachable: its containers are unreachable, exit 4, and still no "PREDEPLOY OK"
    rc, output, rows, path = play_with_report(lab, "predeploy_check.yml", node_down_inventory(lab),
                                              {"predeploy_hosts": "ct101,ct102,ct201"}, "down")
    assert rc == 4 and "PREDEPLOY OK" not in output, output
    with open(path) as handle:
        verdict = json.load(handle)
    assert (verdict["verdict"], verdict["exit_code"]) == ("unreachable", 4), verdict
    mine = {c["host"]: c for c in verdict["containers"]}
    assert [mine[h]["verdict"] for h in ("ct101", "ct102", "ct201")] == ["unreachable", "unreachable", "ready"], verdict
    assert all(r.startswith("node pve1 unreachable") for h in ("ct101", "ct102") for r in mine[h]["reasons"]), verdict
    assert "make node pve1 reachable" in mine["ct102"]["remedies"][0], verdict
    assert sorted(r["host"] for r in rows if r["verdict"] == "unreachable") == ["ct101", "ct102"], rows
    # the holder gone: ready, exit 0, the OK line
    os.kill(holder["holders"][0], 9)
    wait_until(lambda: lab.gpus()[("102", 0)] == 0, 30, "GPU 0 of ct102 to be freed")
    rc, output, rows, path = play_with_report(lab, "predeploy_check.yml", lab.inventory,
                                              {"predeploy_hosts": "ct102", "predeploy_expect_hosts": 1}, "free")
    assert rc == 0 and predeploy_lines(output) == ["PREDEPLOY OK: every targeted GPU is free on 1 containers"], output
    with open(path) as handle:
        verdict = json.load(handle)
    assert (verdict["verdict"], verdict["exit_code"], verdict["ready"], verdict["reasons"]) == (
        "ready", 0, True, ["PREDEPLOY OK: every targeted GPU is free on 1 containers"]), verdict
    assert [(c["host"], c["verdict"], c["reasons"]) for c in verdict["containers"]] == [("ct102", "ready", [])], verdict


def test_predeploy_report_path_without_the_callback_fails_before_any_read(tmp_path):
    """predeploy_report_path is written by the gpu_report callback: asked for without it, the first play fails,
    naming what to set, and nothing is contacted (the static inventory's hosts refuse any connection)."""
    inv = static_inventory(tmp_path)
    run = predeploy([inv], True, ["predeploy_report_path=%s" % (tmp_path / "verdict.json")])
    assert run.rc == 2 and CHECK_PLAY not in run.output, run.output
    assert ("PREDEPLOY FAIL: predeploy_report_path is written by the gpu_report callback, which is not enabled: set"
            " ANSIBLE_CALLBACKS_ENABLED=gpuops.fleet.gpu_report") in run.output, run.output
    assert not (tmp_path / "verdict.json").exists()
