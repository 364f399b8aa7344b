"""playbooks/gpu_status.yml, predeploy_check.yml and release_gpus.yml (throttle, serial,
max_fail_percentage) against the lab, through gpuops.fleet.pct. Truth from `labctl gpus` and /proc."""
import os
import re
import subprocess
import sys

import pytest

from _labfixture import clean_role_lab, module_lab
from _rolelab import REPO, RoleLab, alive, wave_includes

LAB_ID = os.environ.get("PLAYBOOK_TEST_LAB_ID", "playtest")


lab = module_lab(lambda: RoleLab(LAB_ID))
clean = clean_role_lab()


def test_gpu_status_reports_the_fleet_and_changes_nothing(clean):
    lab = clean
    holder = lab.run("plain", 101, [1], 384)
    monitor = lab.run("monitor", 201)
    result = lab.playbook("gpu_status.yml")
    assert result.rc == 0, result
    assert len(result.recap) == 6 and result.changed() == 0, result
    pid_in_ct = holder["container_holders"][0]
    assert re.search(r"ct101\s+GPU 1 .*used\s+384 MiB\s+BUSY holders %d\b" % pid_in_ct, result.output), result
    # the whole clients list: the monitor, and never the module's own NVML client
    assert re.search(r"ct201\s+GPU 0 .*used\s+0 MiB\s+free holders -\s+clients %d\""
                     % monitor["container_roles"]["monitor"], result.output), result
    assert alive(holder["holders"][0]) and alive(monitor["host_pids"][0])
    assert lab.gpus()[("101", 1)] == 384


def predeploy_lines(output):
    """The PREDEPLOY lines, as the README's deploy script greps them."""
    return re.findall(r'^ *"(PREDEPLOY [^"]*)', output, re.M)


def uuid_of(lab, vmid, index):
    return next(g["uuid"] for g in lab.labctl("gpus") if (g.get("visible_in") or {}).get(str(vmid)) == index)


def test_predeploy_check_fails_naming_the_busy_container_and_gpu(clean):
    lab = clean
    holder = lab.run("plain", 102, [0], 512)
    result = lab.playbook("predeploy_check.yml")
    assert result.rc == 2, result   # the documented exit status for a GPU at fault
    assert result.failed_hosts() == ["ct102"], result
    assert predeploy_lines(result.output) == [
        "PREDEPLOY FAIL: GPUs at fault: 1",
        "PREDEPLOY FAULT ct102: GPU 0 (%s): 512 MiB used, holders %d"
        % (uuid_of(lab, 102, 0), holder["container_holders"][0])], result
    assert alive(holder["holders"][0]), "predeploy_check must not release unless asked"
    assert lab.gpus()[("102", 0)] == 512


def test_predeploy_check_passes_on_free_gpus(clean):
    result = clean.playbook("predeploy_check.yml")
    assert result.rc == 0, result
    assert result.failed_hosts() == [] and len(result.recap) == 6, result
    assert predeploy_lines(result.output) == ["PREDEPLOY OK: every targeted GPU is free on 6 containers"], result


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
    with open(os.path.join(REPO, "README.md")) as handle:
        text = handle.read()
    block = text.split("<!-- predeploy-deploy-script -->", 1)[1].split("<!-- /predeploy-deploy-script -->", 1)[0]
    return block.split("```sh\n", 1)[1].rsplit("```", 1)[0]


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
        assert proc.returncode == 1 and "not deploying: GPUs busy" in proc.stderr, proc
        assert lines[0] == "PREDEPLOY FAIL: GPUs at fault: 1" and lines[1].startswith(
            "PREDEPLOY FAULT ct201: GPU 1 (%s): 512 MiB used" % uuid_of(lab, 201, 1)), proc
        assert "DEPLOYED" not in lines, proc
    else:
        assert proc.returncode == 0, proc
        assert lines == ["PREDEPLOY OK: every targeted GPU is free on 6 containers", "DEPLOYED"], proc


def test_predeploy_check_can_release_first(clean):
    lab = clean
    holder = lab.run_fork_inherit_orphan(103, 0, 256)
    result = lab.playbook("predeploy_check.yml", {"predeploy_release": True}, limit="ct103")
    assert result.rc == 0, result
    assert not alive(holder["holders"][0])
    assert lab.gpus()[("103", 0)] == 0


def test_release_is_throttled_per_node_but_parallel_across_nodes(clean):
    lab = clean
    holders = {vmid: lab.run("plain", vmid, [0], 128) for vmid in lab.vmids}
    result = lab.playbook("release_gpus.yml", {"release_gpus_node_concurrency": 1})
    assert result.rc == 0, result
    waves = wave_includes(result.output)
    assert sorted(waves) == [0, 1, 2], waves
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
