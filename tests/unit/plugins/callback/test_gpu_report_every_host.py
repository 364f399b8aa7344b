"""Issue 45: every host of a play gets a row in the gpu_report table and JSON, whatever its tasks did: unreachable,
failed (by any task, not only the collection's modules), skipped, or never reached by a task. A real ansible-playbook
run on the controller: local hosts, and one whose ssh is refused (port 9 on loopback)."""
import json
import os
import subprocess
import sys

import pytest
import yaml

BIN = os.path.dirname(sys.executable)

FIRST_PLAY = """
- hosts: ok1,failed1,down1,skip1
  gather_facts: false
  tasks:
    - ansible.builtin.ping:
      when: inventory_hostname != 'skip1'
    - ansible.builtin.fail:
        msg: broken on purpose
      when: inventory_hostname == 'failed1'
"""
# a play broken off by max_fail_percentage: never1 is never reached, and ansible-playbook exits 2, not 4
SECOND_PLAY = """
- hosts: first1,never1
  gather_facts: false
  serial: 1
  max_fail_percentage: 0
  tasks:
    - ansible.builtin.fail:
        msg: the first batch fails, so the play stops before never1
"""


@pytest.mark.parametrize("broken", [False, True], ids=["one-play", "then-broken-off"])
def test_every_host_of_the_play_has_a_row_with_its_verdict_and_reason(tmp_path, broken):
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    hosts = {name: dict(local, proxmox_node="pve1", proxmox_vmid=vmid)
             for name, vmid in (("ok1", 101), ("failed1", 102), ("skip1", 104), ("first1", 105), ("never1", 106))}
    hosts["down1"] = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 9,
                      "proxmox_node": "pve1", "proxmox_vmid": 103}
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    (tmp_path / "play.yml").write_text(FIRST_PLAY + (SECOND_PLAY if broken else ""))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report",
               GPUOPS_REPORT_PATH=str(tmp_path / "rows.json"), ANSIBLE_HOST_KEY_CHECKING="0")
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml"),
                           "-e", "predeploy_report_path=%s" % (tmp_path / "verdict.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == (2 if broken else 4), proc.stdout + proc.stderr
    # the exit status in predeploy_report_path's file is the one ansible-playbook returned, whichever play decided it
    assert json.loads((tmp_path / "verdict.json").read_text())["exit_code"] == proc.returncode
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    got = {row["host"]: (row["container"], row["verdict"]) for row in rows}
    expected = {"ok1": (101, "no result"), "failed1": (102, "failed"), "down1": (103, "unreachable"),
                "skip1": (104, "skipped")}
    if broken:
        expected.update(first1=(105, "failed"), never1=(106, "skipped"))
    assert got == expected, rows
    reasons = {row["host"]: row["reason"] for row in rows}
    assert reasons["failed1"] == "broken on purpose", reasons
    assert reasons["down1"].startswith("unreachable: ") and "port 9" in reasons["down1"], reasons
    assert reasons["skip1"] == "every task on it was skipped", reasons
    assert not broken or reasons["never1"] == "no task ran on it: the play ended before it got one", reasons
    assert reasons["ok1"] == "no GPU was read for it", reasons
    table = proc.stdout.split("GPU REPORT")[1].splitlines()
    assert table[1].split()[10:12] == ["VERDICT", "REASON"], table
    for host, (vmid, verdict) in got.items():   # one line each in the table too
        (line,) = [ln for ln in table if ln.split()[2:3] == [host]]
        assert line.split()[:3] == ["pve1", str(vmid), host] and " %s " % verdict in line, line


RESCUED = """
- hosts: ok1,rescued1
  gather_facts: false
  tasks:
    - block:
        - ansible.builtin.fail:
            msg: failed, then rescued
          when: inventory_hostname == 'rescued1'
      rescue:
        - ansible.builtin.debug:
            msg: rescued
"""


def test_a_rescued_failure_fails_neither_the_host_nor_the_verdicts_exit_code(tmp_path):
    """Red team of issue 45: a failure inside a block that its rescue handles leaves ansible-playbook at 0; the
    pre-deploy file's exit code and the host's row must say so (the role rescues gpu_release's failure)."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "proxmox_node": "pve1"}
    hosts = {"ok1": dict(local, proxmox_vmid=101), "rescued1": dict(local, proxmox_vmid=102)}
    (tmp_path / "inventory.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    (tmp_path / "play.yml").write_text(RESCUED)
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report",
               GPUOPS_REPORT_PATH=str(tmp_path / "rows.json"))
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.yml"), str(tmp_path / "play.yml"),
                           "-e", "predeploy_report_path=%s" % (tmp_path / "verdict.json")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "verdict.json").read_text())["exit_code"] == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert sorted((row["host"], row["verdict"]) for row in rows) == [("ok1", "skipped"), ("rescued1", "no result")], rows
