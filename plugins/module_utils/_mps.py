# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The MPS control daemon: find it, and ask it (private helper, may change any time).

Under MPS, SIGKILL of a client with outstanding work can leave the server and its other clients in an undefined
state; the control daemon's `terminate_client SERVER CLIENT` ends the client's GPU work safely, but neither ends
the process nor frees its memory (GPU_FACTS row 28), so the ladder follows it. The daemon is reached as its own
client tool reaches it: `nvidia-cuda-mps-control` with the daemon's CUDA_MPS_PIPE_DIRECTORY, a command on stdin.
A daemon in this PID namespace is asked directly (its pids are ours); from a Proxmox node, one inside an LXC
container is asked inside it, through lxc-attach, with the container's pids. `quit` is never sent (it blocks
while a client remains, row 28). The tool run is never a path a process shows (issue 41): this host's comes from
fixed system folders, a container's is its own, by name.
"""

from __future__ import annotations

import os
import re
import subprocess

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
BIN_DIRS = ("/usr/local/nvidia/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
CONTAINER_PATH = "/usr/local/nvidia/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ASK_TIMEOUT_S = 10.0


def _argv(pid, proc_root):
    try:
        return [a.decode("utf-8", "replace") for a in procscan.read_bytes("%s/%d/cmdline" % (proc_root, pid)).split(b"\0") if a]
    except OSError:
        return []


def _program(argv):
    """The program a process runs: argv[0], or the script an interpreter (python, sh) runs."""
    if len(argv) > 1 and re.match(r"^(python[0-9.]*|sh|bash)$", os.path.basename(argv[0])) and not argv[1].startswith("-"):
        return argv[1]
    return argv[0] if argv else ""


def _is_control(pid, proc_root):
    """Whether pid looks like the control daemon: comm nvidia-cuda-mps..., its program (or exe) named as the tool.
    A name only: it decides what to ask, never what to run."""
    stat = procscan.read_stat(pid, proc_root)
    if stat is None or not stat["comm"].startswith("nvidia-cuda-mps"):
        return False
    argv = _argv(pid, proc_root)
    names = set([os.path.basename(_program(argv))] if argv else [])
    try:
        names.add(os.path.basename(os.readlink("%s/%d/exe" % (proc_root, pid))))
    except OSError:
        pass
    return CONTROL in names


def _where(pid, proc_root, node_view):
    """(True, None): a daemon of this host, asked here; (True, vmid): one in that container, asked inside it; (False,
    None): neither. This host's only when its namespaces were read and are ours (unknown is never ours), and, from a
    node, root's; from a node, any other is its cgroup's container's, or skipped."""
    own = node.in_own_namespaces(pid, proc_root)
    if own:
        return (not node_view or node.root_owned(pid, proc_root)), None
    vmid = node.container_of_pid(pid, proc_root) if node_view else None
    return vmid not in (None, node.HOST, node.UNATTRIBUTED), vmid


def find_controls(proc_root="/proc", node_view=False):
    """The MPS control daemons to ask: [{pid, binary, env, vmid}]. vmid None: one of this host (its pid and mount
    namespaces ours), asked directly with the tool of a fixed system folder (BIN_DIRS); from a node (node_view), also
    those in LXC containers (vmid set), asked inside theirs by the tool's name (that container's PATH). No path a
    process shows (argv, exe) is ever run."""
    found = []
    for name in os.listdir(proc_root):
        if not name.isdigit() or not _is_control(int(name), proc_root):
            continue
        pid = int(name)
        ask_it, vmid = _where(pid, proc_root, node_view)
        if not ask_it:
            continue
        env = procscan.read_environ(pid, proc_root, ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"))
        binary = node.system_tool(CONTROL, BIN_DIRS) if vmid is None else CONTROL
        found.append({"pid": pid, "binary": binary, "env": env, "vmid": vmid})
    return sorted(found, key=lambda c: c["pid"])


def ask(control, command, timeout=ASK_TIMEOUT_S):
    """(ok, text) of one command to a control daemon."""
    if control["binary"] is None:
        return False, "%s not found (%s)" % (CONTROL, ", ".join(BIN_DIRS))
    pipe = control["env"].get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR
    settings = {"CUDA_MPS_PIPE_DIRECTORY": pipe}
    if control["env"].get("CUDA_MPS_LOG_DIRECTORY"):
        settings["CUDA_MPS_LOG_DIRECTORY"] = control["env"]["CUDA_MPS_LOG_DIRECTORY"]
    argv = ["sh", "-c", 'printf "%s\\n" "$1" | exec "$0"', control["binary"], command]
    env = dict(os.environ, **settings)
    if control.get("vmid"):
        argv = ["lxc-attach", "-n", str(control["vmid"]), "--clear-env", "--set-var", "PATH=" + CONTAINER_PATH] + [
            a for key, value in sorted(settings.items()) for a in ("--set-var", "%s=%s" % (key, value))] + ["--"] + argv
    try:
        returncode, out = helperproc.run_bounded(argv, timeout, env=env)
    except subprocess.TimeoutExpired:
        return False, "%s did not answer %r within %ss" % (CONTROL, command, timeout)
    except OSError as exc:
        return False, "%s: %s" % (control["binary"], exc.strerror or exc)
    text = " ".join(out.split())
    return returncode == 0, text or "no output"


def _pids(text):
    return [int(word) for word in text.split() if word.isdigit()]


def servers_and_clients(control):
    """{server pid: [client pids]} as the daemon lists them (get_server_list, get_client_list)."""
    ok, text = ask(control, "get_server_list")
    if not ok:
        return {}
    out = {}
    for server in _pids(text):
        ok, clients = ask(control, "get_client_list %d" % server)
        out[server] = _pids(clients) if ok else []
    return out
