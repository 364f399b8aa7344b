"""The role gpuops.fleet.release_gpus, run by playbooks/release_gpus.yml against the lab.

Every assertion that memory is free or a process is alive reads the fake driver's truth
(`labctl gpus`) or the host's /proc, not only what the role says.
"""
import os
import re
import shutil

import pytest
from ansible.module_utils.ansible_release import __version__ as CORE_VERSION

from _labfixture import clean_role_lab, module_lab
from _rolelab import REPO, RoleLab, alive, make_venv, proc_state, wave_includes

LAB_ID = os.environ.get("ROLE_TEST_LAB_ID", "roletest")


lab = module_lab(lambda: RoleLab(LAB_ID))
clean = clean_role_lab()


@pytest.fixture(scope="module")
def fleet_release(lab):
    """Every kind of stuck workload at once, one playbook run, then a second run."""
    built = {
        "101": ("tp_server", lab.run("tp_server", 101, [0, 1], 1024)),
        "102": ("defunct_leader", lab.run("defunct_leader", 102, [0], 2048)),
        "103": ("fork_inherit", lab.run_fork_inherit_orphan(103, 1, 768)),
        "201": ("term_ignoring", lab.run("term_ignoring", 201, [0], 512)),
        "202": ("mmap_only", lab.run("mmap_only", 202, [1], 640)),
        "203": ("zombie+plain", lab.run("plain", 203, [0], 256)),
    }
    zombie = lab.run("zombie", 203, [1], 128)
    monitor = lab.run("monitor", 203)
    bystander = lab.run("bystander_cpu", 102)
    before = lab.gpus()
    try:
        first = lab.playbook("release_gpus.yml", {"release_gpus_node_concurrency": 3})
        after = lab.gpus()
        # the containers whose bystander, monitor and zombie still run; the other four add time, not cases
        second = lab.playbook("release_gpus.yml", {"release_gpus_node_concurrency": 3}, limit="ct102,ct203")
        yield {"built": built, "zombie": zombie, "monitor": monitor, "bystander": bystander,
               "before": before, "after": after, "first": first, "second": second}
    finally:
        lab.reset()


@pytest.mark.slow   # every kind of stuck workload in one fleet release: over a minute
def test_every_kind_of_stuck_workload_is_released(fleet_release):
    first = fleet_release["first"]
    assert first.rc == 0, first
    assert sorted(first.recap) == ["ct101", "ct102", "ct103", "ct201", "ct202", "ct203"], first
    assert first.failed_hosts() == [], first
    # release_gpus_node_concurrency 3: all containers of a node in one wave.
    # One wave: gpu_release ran once, in one task for all six. ansible-core 2.16's default callback prints no
    # "included:" line for a looped include_role; 2.17 and later name each wave's hosts there.
    runs = first.output.split("TASK [gpuops.fleet.release_gpus : Release | Run gpu_release]")[1:]
    assert len(runs) == 1 and sorted(re.findall(r"changed: \[(ct\d+)\]", runs[0].split("TASK [")[0])) == sorted(first.recap), runs
    waves = wave_includes(first.output)
    assert waves == {} if tuple(int(n) for n in CORE_VERSION.split(".")[:2]) < (2, 17) else list(waves) == [0] and len(waves[0]) == 6, waves
    busy_before = {k: v for k, v in fleet_release["before"].items() if v}
    assert {("101", 0), ("101", 1), ("102", 0), ("103", 1), ("201", 0), ("202", 1), ("203", 0)} <= set(busy_before)
    assert all(used == 0 for used in fleet_release["after"].values()), fleet_release["after"]
    for vmid, (scenario, result) in fleet_release["built"].items():
        for pid in result["holders"]:
            assert not alive(pid), "%s holder %d in ct%s survived (state %s)" % (scenario, pid, vmid, proc_state(pid))
        assert first.changed("ct" + vmid) >= 1, (vmid, first)


def test_bystanders_and_monitor_survive(fleet_release):
    for name in ("monitor", "bystander"):
        pid = fleet_release[name]["host_pids"][0]
        assert alive(pid), "%s %d was signalled (state %s)" % (name, pid, proc_state(pid))
    report = fleet_release["first"].reports["ct203"]
    signalled = {a["pid"] for a in report["actions"]}
    monitor_in_ct = fleet_release["monitor"]["container_roles"]["monitor"]
    assert monitor_in_ct not in signalled


def test_report_has_before_after_and_rung_per_gpu(fleet_release):
    reports = fleet_release["first"].reports
    assert sorted(reports) == ["ct101", "ct102", "ct103", "ct201", "ct202", "ct203"]
    rows = {(host[2:], row["index"]): row for host, rep in reports.items() for row in rep["gpus"]}
    # term_ignoring ignores SIGTERM: only SIGKILL freed it.
    assert rows[("201", 0)]["rung"] == "sigkill", reports["ct201"]
    assert any(a["signal"] == "SIGKILL" and a["outcome"] == "sent" for a in reports["ct201"]["actions"])
    assert rows[("101", 0)]["rung"] in ("sigterm", "sigkill")
    assert rows[("101", 0)]["before_mib"] == 1024 and rows[("101", 0)]["after_mib"] == 0
    assert rows[("102", 1)]["rung"] == "none" and rows[("102", 1)]["before_mib"] == 0
    for (vmid, index), row in rows.items():
        assert row["free"] is True, row
        assert row["after_mib"] == fleet_release["after"][(vmid, index)] == 0


def test_second_run_changes_nothing(fleet_release):
    second = fleet_release["second"]
    assert second.rc == 0, second
    assert sorted(second.recap) == ["ct102", "ct203"], second
    assert second.changed() == 0, second
    assert all(not rep["actions"] for rep in second.reports.values()), second.reports


def test_from_node_without_a_node_fails_before_anything_is_stopped(clean):
    """Issue 22: release_gpus_from: node is checked first; with no node known, nothing is stopped or signalled."""
    lab = clean
    result = lab.run("respawn", 101, [0], 512)
    program = result["supervisor_program"]
    refused = lab.playbook("release_gpus.yml", {"release_gpus_from": "node", "release_gpus_gpus": [0],
                                                "release_gpus_supervisor_programs": [program],
                                                "release_gpus_advanced": {"node_host": ""}}, limit="ct101")
    assert refused.rc != 0, refused
    words = " ".join(refused.output.split())
    assert "release_gpus_from: node on ct101 needs its Proxmox node and its vmid, and no node is known" in words, words
    assert "nothing was stopped or signalled" in words
    status = lab.exec(101, "/usr/local/sbin/supervisorctl", "status", program)
    assert "RUNNING" in status.stdout, status.stdout
    assert lab.gpus()[("101", 0)] == 512


def task_lines(output):
    """The TASK [ lines of ansible-playbook's default output (skipped tasks and includes print one too)."""
    return [line for line in output.splitlines() if line.startswith("TASK [")]


def test_respawning_program_fails_until_its_service_is_stopped_and_the_common_path_runs_at_most_12_task_lines(clean):
    """A supervisord program respawns its holder: the release fails naming the respawn until the role is told to stop
    the program. Issue 13: dependencies present, one supervisord program to stop, one holder: at most 12 task lines."""
    lab = clean
    respawn = lab.run("respawn", 102, [0], 512)
    holder = lab.run("plain", 102, [1], 256)
    program = respawn["supervisor_program"]
    assert lab.gpus()[("102", 0)] == 512 and lab.gpus()[("102", 1)] == 256
    refused = lab.playbook("release_gpus.yml", {"release_gpus_gpus": [0]}, limit="ct102")    # GPU 1 left for below
    assert refused.rc != 0, refused
    assert "respawned by pid" in refused.output and "stop the service first" in refused.output, refused
    assert lab.gpus()[("102", 0)] > 0, "a respawned holder must hold the GPU again"
    assert alive(holder["holders"][0]) and lab.gpus()[("102", 1)] == 256
    done = lab.playbook("release_gpus.yml", {"release_gpus_supervisor_programs": [program]}, limit="ct102")
    assert done.rc == 0, done
    lines = task_lines(done.output)
    role_lines = [line for line in lines if line.startswith("TASK [gpuops.fleet.release_gpus : ")]
    # the whole playbook: its wave task and include_role line, then the role's own lines
    assert len(role_lines) <= 12 and len(lines) <= 12, "\n".join(lines)
    assert lab.gpus()[("102", 0)] == 0 and lab.gpus()[("102", 1)] == 0
    assert not alive(holder["holders"][0])
    report = done.reports["ct102"]
    assert report["stopped"] == ["supervisord program " + program], report
    assert report["changed"] is True and done.changed("ct102") >= 1, done
    assert any(a["signal"] == "SIGTERM" and a["outcome"] == "sent" for a in report["actions"]), report
    status = lab.exec(102, "/usr/local/sbin/supervisorctl", "status", program)
    assert "STOPPED" in status.stdout, status.stdout
    # nothing left: the same lines, nothing stopped, signalled or changed
    again = lab.playbook("release_gpus.yml", {"release_gpus_supervisor_programs": [program]}, limit="ct102")
    assert again.rc == 0 and again.changed() == 0, again
    assert len(task_lines(again.output)) <= 12
    assert again.reports["ct102"]["changed"] is False and again.reports["ct102"]["stopped"] == []


def test_check_mode_stops_and_signals_nothing(clean):
    lab = clean
    plain = lab.run("plain", 102, [0], 512)
    respawn = lab.run("respawn", 102, [1], 256)
    program = respawn["supervisor_program"]
    before = lab.gpus()
    checked = lab.playbook("release_gpus.yml", {"release_gpus_supervisor_programs": [program]},
                           limit="ct102", check=True)
    assert checked.rc == 0, checked
    assert checked.changed("ct102") >= 1, "check mode must report what it would do: %s" % checked
    for pid in plain["holders"] + respawn["holders"]:
        assert alive(pid), "check mode signalled %d" % pid
    assert lab.gpus()[("102", 0)] == before[("102", 0)] == 512
    assert lab.gpus()[("102", 1)] == before[("102", 1)] == 256
    status = lab.exec(102, "/usr/local/sbin/supervisorctl", "status", program)
    assert "RUNNING" in status.stdout, status.stdout
    plan = checked.reports["ct102"]["plan"]
    assert plain["container_holders"][0] in {p["pid"] for p in plan}, plan


def test_missing_services_are_reported_and_skipped(clean):
    lab = clean
    plain = lab.run("plain", 103, [0], 256)
    result = lab.playbook("release_gpus.yml", {
        "release_gpus_supervisor_programs": ["no-such-program"],
        "release_gpus_services": ["no-such-unit.service"],
        "release_gpus_advanced": {"docker_containers": ["no-such-container"],
                                  "stop_commands": [{"name": "no-such-daemon", "command": "/bin/false",
                                                     "pattern": "^no-such-daemon-xyz"}]},
    }, limit="ct103")
    assert result.rc == 0, result
    skipped = result.reports["ct103"]["stop_skipped"]
    assert "supervisord program no-such-program: no such program" in skipped, skipped
    assert "systemd unit no-such-unit.service: systemd does not run here" in skipped, skipped
    assert any(s.startswith("docker container no-such-container:") for s in skipped), skipped
    assert result.reports["ct103"]["stopped"] == []
    assert not alive(plain["holders"][0])
    assert lab.gpus()[("103", 0)] == 0


def test_stop_command_runs_only_while_its_process_lives(clean):
    lab = clean
    holder = lab.run("plain", 201, [1], 256)
    pid_in_ct = holder["container_holders"][0]
    command = {"name": "workload", "command": "kill %d" % pid_in_ct, "pattern": "workload.py plain", "timeout": 10}
    first = lab.playbook("release_gpus.yml", {"release_gpus_advanced": {"stop_commands": [command]}}, limit="ct201")
    assert first.rc == 0, first
    assert first.reports["ct201"]["stopped"] == ["stop command workload"]
    assert not alive(holder["holders"][0])
    assert first.reports["ct201"]["actions"] == [], "the stop command freed it; nothing left to signal"
    again = lab.playbook("release_gpus.yml", {"release_gpus_advanced": {"stop_commands": [command]}}, limit="ct201")
    assert again.rc == 0 and again.changed() == 0, again


@pytest.mark.parametrize("with_pip", [True, False], ids=["pip-no-index", "unpack-without-pip"])
def test_offline_dependency_path_installs_into_a_bare_python(clean, with_pip):
    lab = clean
    # A fresh interpreter per case, on a host path the container sees (its /tmp is private).
    root = os.path.join(REPO, ".lab", "role-tests-%s-%s" % (lab.lab_id, "pip" if with_pip else "nopip"))
    shutil.rmtree(root, ignore_errors=True)
    python = make_venv(root, with_pip=with_pip)
    try:
        probe = lab.exec(202, python, "-c", "import psutil")
        assert probe.returncode != 0 and "psutil" in probe.stdout, probe.stdout
        holder = lab.run("plain", 202, [0], 256)
        # An index that refuses at once, and no pip config from the machine: the online try fails, fast.
        variables = {"ansible_python_interpreter": python,
                     "release_gpus_advanced": {"deps_pip_extra_args": ["--isolated", "--index-url", "http://127.0.0.1:9/simple"],
                                               "wheel_dir": os.path.join(REPO, ".cache", "wheels")}}
        first = lab.playbook("release_gpus.yml", variables, limit="ct202")
        assert first.rc == 0, first
        # pip from an index is tried first (when there is pip) and fails: the container has no network.
        assert task_status(first.output, "Install from the package index with pip", "ct202") == (
            "ok" if with_pip else "skipping")
        assert task_status(first.output, "Install the wheels with the target's Python, without an index",
                           "ct202") == "changed"
        imported = lab.exec(202, python, "-c", "import psutil, pynvml; print(psutil.__file__)")
        assert imported.returncode == 0 and imported.stdout.startswith(root), imported.stdout
        assert not alive(holder["holders"][0])
        assert lab.gpus()[("202", 0)] == 0
        if with_pip:
            again = lab.playbook("release_gpus.yml", variables, limit="ct202")
            assert again.rc == 0 and again.changed() == 0, again
            assert task_status(again.output, "Install the wheels with the target's Python, without an index",
                               "ct202") is None, "imports checked first: nothing to install"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def task_status(output, task, host):
    """ok/changed/skipping/failed of a task for a host, from ansible-playbook's default output."""
    match = re.search(r"TASK \[[^\]]*%s\] \*+\n(?:.*\n)*?(ok|changed|skipping|fatal): \[%s\]"
                      % (re.escape(task), re.escape(host)), output)
    return match.group(1) if match else None


def test_missing_wheels_fail_with_a_clear_message(clean):
    lab = clean
    root = os.path.join(REPO, ".lab", "role-tests-%s-empty" % lab.lab_id)
    shutil.rmtree(root, ignore_errors=True)
    python = make_venv(root, with_pip=False)
    empty = os.path.join(lab.workdir, "no-wheels")
    os.makedirs(empty, exist_ok=True)
    try:
        variables = {"ansible_python_interpreter": python,
                     "release_gpus_advanced": {"wheel_dir": empty, "deps_sources": ["wheels"]}}
        result = lab.playbook("release_gpus.yml", variables, limit="ct203")
        assert result.rc != 0, result
        assert "No wheel for psutil, nvidia-ml-py in release_gpus_advanced.wheel_dir (%s)" % empty in result.output, result
    finally:
        shutil.rmtree(root, ignore_errors=True)
