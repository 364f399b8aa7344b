#!/usr/bin/python
# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_report_file
short_description: Write a host's result as a JSON file on the controller, without a module run
version_added: 0.2.0
description:
  - Writes O(content) as indented JSON (the C(to_nice_json) filter's text, keys sorted) and a newline to O(path) on the
    controller. The role C(gpuops.fleet.release_gpus) writes each host's C(release_gpus_result) with it when
    C(release_gpus_report_dir) is set.
  - An action plugin that runs in the controller's worker; no module is started on the controller or on the target,
    where M(ansible.builtin.copy) delegated to C(localhost) starts two (C(stat) and C(copy)) for each host.
  - The file is replaced at once (written beside it, then renamed), so a reader never sees half a report. The file
    beside it is new (created with C(O_EXCL|O_NOFOLLOW)), and a symlink at O(path) is replaced, never followed.
    Unchanged content leaves the file as it is and reports no change.
author: gpuops (@gpuops)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.conn
  - ansible.builtin.action_common_attributes.flow
attributes:
  action:
    support: full
  async:
    support: none
  become:
    support: none
  bypass_host_loop:
    support: none
  check_mode:
    support: full
    details: In check mode nothing is written; C(changed) says whether the file would change.
  connection:
    support: none
  delegation:
    support: none
    details: It always writes on the controller.
  diff_mode:
    support: none
  platform:
    support: full
    platforms: posix
options:
  path:
    description:
      - The file on the controller. Its folder must exist. A relative path starts where C(ansible-playbook) runs.
    type: path
    required: true
  content:
    description:
      - The data to write (a dict, a list, or any value JSON can hold).
    type: raw
    required: true
  mode:
    description:
      - The file's permissions, as an octal string. The file is created with them (never wider for a moment).
      - The default keeps the report to the controller's user, since it names processes and their command lines.
    type: str
    default: '0600'
seealso:
  - module: ansible.builtin.copy
"""

EXAMPLES = r"""
- name: Keep each host's release result on the controller
  gpuops.fleet.gpu_report_file:
    path: "/var/log/gpu-releases/{{ inventory_hostname }}.json"
    content: "{{ release_gpus_result }}"
"""

RETURN = r"""
path:
  description: The file written, with C(~) expanded.
  returned: always
  type: str
  sample: /var/log/gpu-releases/ct129.json
"""
