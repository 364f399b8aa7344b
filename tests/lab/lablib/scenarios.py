"""`labctl run`: start a workload in a container and report its host pids.

Most scenarios go straight to tests/lab/workloads/workload.py (`--cuda-visible-devices` becomes its
CUDA_VISIBLE_DEVICES), `launcher_respawn` among them (a launcher that respawns its holder within a few
ms of each death: roles `launcher`, `holder`). Three are built here:
`respawn` (a supervisord program with autorestart), `stuck` (a plain holder frozen by
a cgroup v1 freezer: D state, SIGKILL waits), `leaked` (memory held by no process).
"""

import json
import os
import socket
import subprocess
import time

from lablib import container
from lablib.common import LAB_DIR, LabError, nspid_map, state_dir, wait_for

WORKLOAD = os.path.join(LAB_DIR, "workloads", "workload.py")
RUN_TIMEOUT = 90


def driver_request(lab, request, timeout=10.0):
    sock_path = os.path.join(lab.state, "driver", "driver.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(sock_path)
        except OSError as exc:
            raise LabError("driver daemon not reachable at %s: %s" % (sock_path, exc.strerror))
        s.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data.decode())
    if isinstance(answer, dict) and answer.get("ok") is False:
        raise LabError("driver: %s" % answer.get("error"))
    return answer


def gpus(lab, node=None):
    return driver_request(lab, {"op": "snapshot", "node": node} if node else {"op": "snapshot"})["gpus"]


def gpus_of(rid, node=None):
    """`labctl gpus [--node NODE]` of lab RID without a labctl process: the same request to its driver (tests
    read the truth hundreds of times a run, each labctl process about 0.1 CPU-s)."""
    return gpus(_LabState(state_dir(rid)), node)


class _LabState(object):
    def __init__(self, state):
        self.state = state


def attach(lab, node, vmid, cmd, timeout=RUN_TIMEOUT, input_text=None, cuda_visible=None):
    argv = container.attach_argv(lab.node_dir(node), vmid, cmd)
    # Like pct exec: the caller's environment minus SSL_CERT_*, with Proxmox's PATH.
    # CUDA_VISIBLE_DEVICES only when asked for (--cuda-visible-devices), never labctl's own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SSL_CERT_") and k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = container.PVE_PATH
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in cuda_visible)
    proc = subprocess.run(argv, input=input_text, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                          timeout=timeout, universal_newlines=True, check=False,
                          stdin=None if input_text is not None else subprocess.DEVNULL)
    return proc


def host_pids(ct, pids):
    """Container pids -> host pids, by NSpid in the container's pid namespace."""
    table = nspid_map(ct["pidns_inode"])
    missing = [p for p in pids if p not in table]
    if missing:
        raise LabError("container pids %s not found on the host" % missing)
    return [table[p] for p in pids]


def translate(ct, result):
    pids = list(result.get("pids", []))
    roles = dict(result.get("roles", {}))
    holders = list(result.get("holders", []))
    dead = set(result.get("dead", []))
    every = [p for p in dict.fromkeys(pids + list(roles.values()) + holders) if p not in dead]
    table = dict(zip(every, host_pids(ct, every)))
    # A pid the workload killed on purpose (fork_inherit --kill-parent) has no host pid any more.
    table.update((p, None) for p in dead)
    out = dict(result)
    out.update(node_pids=[_node_pid(table[p]) for p in pids], node_holders=[_node_pid(table[p]) for p in holders])
    out.update(pids=pids, host_pids=[table[p] for p in pids],
               roles={role: table[p] for role, p in roles.items()}, holders=[table[p] for p in holders],
               container_roles=roles, container_holders=holders)
    return out


def _node_pid(host_pid):
    """The pid its lab node sees (NSpid: host, node, container), what NVML's legacy mode reports there."""
    nspids = container._nspids(host_pid) if host_pid else []
    return nspids[1] if len(nspids) >= 3 else host_pid


def minors_for(ct, gpu_indexes):
    minors = []
    for index in gpu_indexes:
        if index < 0 or index >= len(ct["minors"]):
            raise LabError("container %s has GPU indexes 0..%d, not %d" % (ct["vmid"], len(ct["minors"]) - 1, index))
        minors.append(ct["minors"][index])
    return minors


def workload_argv(ct, scenario, minors, mib, extra, foreground=False):
    argv = [_lab_python(ct), WORKLOAD, scenario, "--minors", ",".join(str(m) for m in minors)]
    if mib is not None:
        argv += ["--mib", str(mib)]
    if foreground:
        argv.append("--foreground")
    return argv + list(extra)


def _lab_python(ct):
    # Workloads are the "application": they run with the full lab venv even in bare containers.
    return ct.get("supervisor_venv", "") + "/bin/python"


def run(lab, scenario, node, vmid, gpu_indexes, mib=None, extra=(), cuda_visible=None):
    ct = lab.container(node, vmid)
    if not container.is_running(ct):
        raise LabError("container %s on %s is not running" % (vmid, node))
    minors = minors_for(ct, gpu_indexes)
    if cuda_visible is not None:
        minors_for(ct, cuda_visible)
        hidden = [i for i in gpu_indexes if i not in cuda_visible]
        if hidden:
            raise LabError("--gpus %s not among --cuda-visible-devices %s"
                           % (",".join(map(str, hidden)), ",".join(map(str, cuda_visible))))
    if scenario == "leaked":
        return run_leaked(lab, node, minors, mib)
    if scenario == "respawn":
        return run_respawn(lab, ct, node, vmid, minors, mib, extra, cuda_visible)
    base = "plain" if scenario == "stuck" else scenario
    proc = attach(lab, node, vmid, workload_argv(ct, base, minors, mib, extra), cuda_visible=cuda_visible)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode or not line.startswith("{"):
        raise LabError("workload %s failed (exit %d): %s" % (scenario, proc.returncode,
                                                             (proc.stderr or proc.stdout).strip()))
    result = translate(ct, json.loads(line))
    if cuda_visible is not None:
        result["cuda_visible_devices"] = ",".join(map(str, cuda_visible))
    if scenario == "stuck":
        return freeze(lab, ct, result)
    return result


def run_leaked(lab, node, minors, mib):
    for minor in minors:
        driver_request(lab, {"op": "leak", "node": node, "minor": minor, "mib": mib or 1024})
    return {"scenario": "leaked", "pids": [], "host_pids": [], "roles": {}, "holders": [],
            "minors": minors, "mib": mib or 1024}


def run_respawn(lab, ct, node, vmid, minors, mib, extra, cuda_visible=None):
    name = "gpuops-respawn-%d" % int(time.time() * 1000 % 10 ** 9)
    command = " ".join(_quote(a) for a in workload_argv(ct, "plain", minors, mib, extra, foreground=True))
    conf = ("[program:%s]\ncommand=%s\nautostart=true\nautorestart=true\nstartsecs=1\nstartretries=100\n"
            "stopsignal=TERM\nstopwaitsecs=5\nstdout_logfile=/run/supervisor/log/%s.out\n"
            "stderr_logfile=/run/supervisor/log/%s.err\n" % (name, command, name, name))
    if cuda_visible is not None:
        conf += 'environment=CUDA_VISIBLE_DEVICES="%s"\n' % ",".join(map(str, cuda_visible))
    path = "/run/supervisor/conf.d/%s.conf" % name
    proc = attach(lab, node, vmid, ["/bin/sh", "-c", 'cat > "$1"', "sh", path], input_text=conf)
    if proc.returncode:
        raise LabError("respawn: cannot write %s: %s" % (path, proc.stderr.strip()))
    proc = attach(lab, node, vmid, ["supervisorctl", "update"])
    if proc.returncode:
        raise LabError("respawn: supervisorctl update failed: %s" % (proc.stdout + proc.stderr).strip())
    root = "/proc/%d/root" % ct["init_host_pid"]
    out_path = root + "/run/supervisor/log/%s.out" % name

    def result_line():
        try:
            with open(out_path) as f:
                lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
        except FileNotFoundError:
            return None
        return lines[-1] if lines else None

    line = wait_for(result_line, 30, interval=0.05, what="supervisord program %s to hold its GPUs" % name)
    result = json.loads(line)
    with open(root + "/run/supervisor/supervisord.pid") as f:
        sup_pid = int(f.read().strip())
    result["roles"] = dict(result.get("roles", {}), supervisord=sup_pid, program=result["pids"][0])
    result["scenario"] = "respawn"
    out = translate(ct, result)
    out["supervisor_program"] = name
    out["supervisor_conf"] = path
    return out


def freeze(lab, ct, result):
    """Freeze the holders in a cgroup v1 freezer: D state, SIGKILL pends until thawed."""
    root = container.freezer_dir(ct)  # the container's own cgroup in the freezer hierarchy
    group = os.path.join(root, "stuck-%s-%d" % (ct["vmid"], result["host_pids"][0]))
    os.makedirs(group, exist_ok=True)
    for pid in dict.fromkeys(result["host_pids"]):
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    with open(os.path.join(group, "freezer.state"), "w") as f:
        f.write("FROZEN")

    def frozen():
        with open(os.path.join(group, "freezer.state")) as f:
            return f.read().strip() == "FROZEN"

    wait_for(frozen, 10, what="freezer %s" % group)
    result["scenario"] = "stuck"
    result["freezer"] = group
    return result


def _quote(arg):
    if arg and all(c.isalnum() or c in "/._-,=:" for c in arg):
        return arg
    return '"%s"' % arg.replace("\\", "\\\\").replace('"', '\\"')
