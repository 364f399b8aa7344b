"""meta/runtime.yml's action group gpu (issue 45): module_defaults: {group/gpuops.fleet.gpu: ...} reaches each module.

A real ansible-playbook on localhost: the group gives every module a `gpus` that is no list (a dict), so each task fails
in the module's own argument check, naming it, before anything is read. Without the group default the same task fails
elsewhere (no NVML here), so the message proves the default arrived.
"""
import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
PLAY = """
- hosts: localhost
  gather_facts: false
  vars:
    ansible_python_interpreter: "{{ ansible_playbook_python }}"
  module_defaults:
    group/gpuops.fleet.gpu:
      gpus: {not: a list}
  tasks:
    - {name: info, gpuops.fleet.gpu_info: {}, register: info, ignore_errors: true}
    - {name: release, gpuops.fleet.gpu_release: {}, register: release, ignore_errors: true}
    - {name: old name, gpuops.fleet.gpu_status: {}, register: status, ignore_errors: true}
    - name: outside the group
      gpuops.fleet.gpu_info: {}
      module_defaults: {group/gpuops.fleet.gpu: {}}
      register: outside
      ignore_errors: true
    - ansible.builtin.copy:
        dest: "{{ out }}"
        content: "{{ {'info': info.msg, 'release': release.msg, 'status': status.msg, 'outside': outside.msg} | to_json }}"
"""


def test_the_runtime_names_the_group_gpu_with_both_modules():
    with open(os.path.join(ROOT, "meta", "runtime.yml"), encoding="utf-8") as handle:
        runtime = yaml.safe_load(handle)
    assert runtime["action_groups"] == {"gpu": ["gpu_info", "gpu_release"]}


def test_module_defaults_of_the_group_reach_every_module(tmp_path):
    book, out = tmp_path / "play.yml", tmp_path / "msgs.json"
    book.write_text(PLAY)
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-c", "local", str(book), "-e", "out=%s" % out],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    msgs = json.loads(out.read_text())
    for task in ("info", "release", "status"):
        assert "argument 'gpus' is of type" in msgs[task] and "convert to list" in msgs[task], (task, msgs[task])
    assert "argument 'gpus'" not in msgs["outside"], msgs["outside"]
