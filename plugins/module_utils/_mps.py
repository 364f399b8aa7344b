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
import time

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


def _bound(timeout, deadline):
    return timeout if deadline is None else min(timeout, deadline - time.monotonic())


READ_QUERIES = ("get_server_list", "get_client_list")   # what this file asks: they change nothing


def prepared(control, command, timeout=ASK_TIMEOUT_S, deadline=None):
    """((argv, env, bound), None) that asks control's daemon command within timeout, never past deadline (a
    time.monotonic() value); (None, why) when it is not to be asked: no time left, or no tool to ask with. Builds
    the call only: a command that changes state (terminate_client) is run by the act layer (_rungs)."""
    bound = _bound(timeout, deadline)
    if bound <= 0:
        return None, "control daemon pid %d was not asked %r: no time was left before the overall timeout" % (
            control["pid"], command)
    if control["binary"] is None:
        return None, "%s not found (%s)" % (CONTROL, ", ".join(BIN_DIRS))
    pipe = control["env"].get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR
    settings = {"CUDA_MPS_PIPE_DIRECTORY": pipe}
    if control["env"].get("CUDA_MPS_LOG_DIRECTORY"):
        settings["CUDA_MPS_LOG_DIRECTORY"] = control["env"]["CUDA_MPS_LOG_DIRECTORY"]
    argv = ["sh", "-c", 'printf "%s\\n" "$1" | exec "$0"', control["binary"], command]
    env = dict(os.environ, **settings)
    if control.get("vmid"):
        argv = ["lxc-attach", "-n", str(control["vmid"]), "--clear-env", "--set-var", "PATH=" + CONTAINER_PATH] + [
            a for key, value in sorted(settings.items()) for a in ("--set-var", "%s=%s" % (key, value))] + ["--"] + argv
    return (argv, env, bound), None


def answer(control, command, bound, run):
    """(state, text) of run() (a bounded run of prepared's argv: (returncode, output)): ok, failed or timeout."""
    try:
        returncode, out = run()
    except subprocess.TimeoutExpired:
        return "timeout", "control daemon pid %d did not answer %r within %.1fs" % (control["pid"], command, bound)
    except OSError as exc:
        return "failed", "%s: %s" % (control["binary"], exc.strerror or exc)
    return ("ok" if returncode == 0 else "failed"), " ".join(out.split())


def _asked(control, command, timeout=ASK_TIMEOUT_S, deadline=None):
    """(state, text) of one read-only query (READ_QUERIES) to a control daemon: state ok, failed or timeout. It is
    given timeout seconds, never past deadline; with no time left it is not asked (failed, and the text says so)."""
    if command.split()[0] not in READ_QUERIES:
        return "failed", "%r is not a read-only query of the MPS control daemon (%s): not asked here" % (
            command, ", ".join(READ_QUERIES))
    call, why = prepared(control, command, timeout, deadline)
    if call is None:
        return "failed", why
    argv, env, bound = call
    return answer(control, command, bound, lambda: helperproc.run_bounded(argv, bound, env=env))


def ask(control, command, timeout=ASK_TIMEOUT_S, deadline=None):
    """(ok, text) of one read-only query to a control daemon, within timeout and never past deadline (see _asked)."""
    state, text = _asked(control, command, timeout, deadline)
    return state == "ok", text or "no output"


def _pids(text):
    """The pids of an answer (one a line), or None when it has anything else: an answer that is not a list."""
    words = text.split()
    return [int(word) for word in words] if all(word.isdigit() for word in words) else None


def listing(control, deadline=None, silent=None):
    """What one control daemon says of its servers, pids as it sees them: {"control", "servers": {server: [clients],
    or None when its client list could not be read}, "why": {server: why}, "error": why the server list could not
    be read, or None}. Each ask is bounded by the time left to deadline. silent ({daemon pid: why}), kept by the
    caller across reads, names the daemons that did not answer in time: they are not asked again."""
    out = {"control": control, "servers": {}, "why": {}, "error": None}
    state, text = _read(control, "get_server_list", deadline, silent)
    servers = _pids(text) if state == "ok" else None
    if servers is None:
        out["error"] = text if state != "ok" else "its server list is no list of pids: %r" % text[:80]
        return out
    for server in servers:
        state, text = _read(control, "get_client_list %d" % server, deadline, silent)
        clients = _pids(text) if state == "ok" else None
        out["servers"][server] = clients
        if clients is None:
            out["why"][server] = text if state != "ok" else "its client list is no list of pids: %r" % text[:80]
    return out


def _read(control, command, deadline, silent):
    """_asked, unless the daemon did not answer earlier (silent): then it is not asked again."""
    if silent is not None and control["pid"] in silent:
        return "failed", "%s, earlier in this task: not asked again" % silent[control["pid"]]
    state, text = _asked(control, command, deadline=deadline)
    if state == "timeout" and silent is not None:
        silent[control["pid"]] = text
    if state != "ok" and not text.startswith("control daemon pid"):
        text = "control daemon pid %d: %s: %s" % (control["pid"], command, text or "no output")
    return state, text


def seen_as(record, control):
    """The pid by which control's daemon knows record's process, or None: a daemon of this host lists our pids; one
    in a container, that container's (its records carry container and container_pid)."""
    if control.get("vmid") is None:
        return record["pid"]
    where = record.get("container")
    if where in (None, node.HOST, node.UNATTRIBUTED) or node.vmid_key(where) != node.vmid_key(control["vmid"]):
        return None
    return record.get("container_pid")


def read_servers(servers, records, proc_root="/proc", node_view=False, deadline=None, silent=None):
    """Evidence on each MPS server record, read from the control daemons (each ask bounded by deadline): {server
    pid: {"clients": the pids of the records it serves, or None when they cannot be known, "why": why not, "unseen":
    the clients its daemon lists that no record here has and that may live, "control": the daemon that lists it,
    "server_as" and "clients_as" ({pid: pid as that daemon sees it})}}. {} when there is no server."""
    if not servers:
        return {}
    listings = [listing(c, deadline, silent) for c in find_controls(proc_root, node_view)]
    return dict((s["pid"], _evidence(s, records, listings, proc_root)) for s in servers)


def _evidence(server, records, listings, proc_root):
    """What the daemons that can see server say of its clients. One daemon's word decides only when every other
    daemon that can see it answered without listing it: a second daemon that lists it with other clients, or one
    that did not answer, leaves its clients unknown (a process of a container can call itself a control daemon)."""
    failed, found = [], []
    for entry in listings:
        listed = seen_as(server, entry["control"])
        if listed is not None and listed in entry["servers"]:
            found.append(_served(entry, listed, records, proc_root))
        elif listed is not None and entry["error"]:
            failed.append(entry["error"])
    if found and not failed and all((f["clients"], f["unseen"]) == (found[0]["clients"], found[0]["unseen"]) for f in found):
        return found[0]
    if found:
        why = "%d control daemons (pids %s) can see it, and %s: which one serves it cannot be told" % (
            len(found) + len(failed), ", ".join(str(f["control"]["pid"]) for f in found),
            "they list other clients" if not failed else "; ".join(failed))
        return dict(found[0], clients=None, why=why)
    why = "; ".join(failed) or "no MPS control daemon lists it (%d found)" % len(listings)
    return {"clients": None, "why": why, "unseen": [], "control": None, "server_as": None, "clients_as": {}}


def _served(entry, listed, records, proc_root):
    """The evidence of a server that entry's daemon lists as listed: its clients, mapped to the records here."""
    control = entry["control"]
    out = {"clients": None, "why": entry["why"].get(listed), "unseen": [], "control": control, "server_as": listed,
           "clients_as": {}}
    if entry["servers"][listed] is None:
        return out
    by_seen = dict((seen_as(r, control), r["pid"]) for r in records)
    for pid in entry["servers"][listed]:
        if by_seen.get(pid) is not None:
            out["clients_as"][by_seen[pid]] = pid
        elif control.get("vmid") is not None or os.path.exists("%s/%d" % (proc_root, pid)):
            out["unseen"].append(pid)   # gone only where its pid can be looked up: this host's daemon's
    out["clients"] = sorted(out["clients_as"])
    return out
