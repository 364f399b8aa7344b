# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""gpu_report_file: JSON on the controller, written in the worker (no stat and copy modules for each host)."""

from __future__ import annotations

import os

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.text.converters import to_bytes, to_native
from ansible.plugins.action import ActionBase
from ansible.plugins.filter.core import to_nice_json

from ansible_collections.gpuops.fleet.plugins.plugin_utils._safe_file import holds, replace_file

ARGUMENT_SPEC = {
    "path": {"type": "path", "required": True},
    "content": {"type": "raw", "required": True},
    "mode": {"type": "str", "default": "0600"},
}


def file_mode(text):
    """0644 -> 0o644; anything but 1 to 4 octal digits fails, naming the value."""
    if not isinstance(text, str) or not 1 <= len(text) <= 4 or any(c not in "01234567" for c in text):
        raise AnsibleActionFail("mode must be an octal string such as '0644', got %r" % (text,))
    return int(text, 8)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp
        dummy, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        path = os.path.abspath(args["path"])   # relative: from where ansible-playbook runs, as copy to localhost
        mode = file_mode(args["mode"])
        if not os.path.isdir(os.path.dirname(path)):
            raise AnsibleActionFail("path's folder does not exist on the controller: %s" % os.path.dirname(path))
        data = to_bytes(to_nice_json(args["content"]) + "\n")
        changed = not holds(path, mode, data)   # a symlink at path is a change: it is replaced, never followed
        result.update(changed=changed, path=path)
        if changed and not self._task.check_mode:
            try:
                replace_file(path, data, mode)
            except OSError as e:
                raise AnsibleActionFail("cannot write %s: %s" % (path, to_native(e)))
        return result
