"""Lab helpers for the role and playbook tests (test_role_release_gpus.py, test_playbooks.py).

Real lab (tests/lab/labctl), real ansible-playbook through gpuops.fleet.pct; the truth that
tests assert comes from `labctl gpus` and /proc on the host, never from the role's word alone.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAB_DIR = os.path.join(REPO, "tests", "lab")
LABCTL = os.path.join(LAB_DIR, "labctl")
VENV_BIN = os.path.dirname(os.path.abspath(sys.executable))
PLAYBOOKS = os.path.join(REPO, "playbooks")
WHEELS = os.path.join(REPO, ".cache", "wheels")
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)"
                   r"\s+skipped=(\d+)\s+rescued=(\d+)\s+ignored=(\d+)")
# Each container sees 2 GPUs of its node as indexes 0 and 1.
LAYOUT = {"101": [0, 1], "102": [2, 3], "103": [4, 5], "201": [0, 1], "202": [2, 3], "203": [4, 5]}

if LAB_DIR not in sys.path:
    sys.path.append(LAB_DIR)
from lablib.common import LabError, clone_lab_id, proc_state, wait_for  # noqa: E402  (the lab's stdlib helpers, shared with demo.py)
from lablib.scenarios import gpus_of  # noqa: E402  (labctl gpus, in this process)


class PlayResult:
    def __init__(self, rc, output, recap, reports):
        self.rc = rc
        self.output = output
        self.recap = recap          # host -> {ok, changed, unreachable, failed, skipped, rescued, ignored}
        self.reports = reports      # host -> release_gpus_result (when the role wrote one)

    def changed(self, host=None):
        hosts = [host] if host else list(self.recap)
        return sum(self.recap[h]["changed"] for h in hosts)

    def failed_hosts(self):
        return sorted(h for h, r in self.recap.items() if r["failed"] or r["unreachable"])

    def __repr__(self):
        return "PlayResult(rc=%d, recap=%s)\n%s" % (self.rc, self.recap, self.output[-6000:])


class RoleLab:
    """One lab for a test module: 2 nodes x 3 containers, each container 2 GPUs of its own."""

    def __init__(self, lab_id, nodes=2, containers=3, bare=()):
        self.lab_id = lab_id = clone_lab_id(lab_id)
        self.env = dict(os.environ, LAB_ID=lab_id, LAB_PCT_DELAY="0.1", ANSIBLE_NOCOLOR="1",
                        ANSIBLE_FORCE_COLOR="0")
        self.workdir = tempfile.mkdtemp(prefix="gpuops-role-%s-" % lab_id)
        self.touched = set()
        self.labctl("down", parse=False)
        layout = []
        vmids = [str(n * 100 + c) for n in range(1, nodes + 1) for c in range(1, containers + 1)]
        for vmid in vmids:
            layout += ["--layout", "%s=%s" % (vmid, ",".join(str(m) for m in LAYOUT[vmid]))]
        for vmid in bare:  # a bare container is also unprivileged: the role installs into it as uid 100000
            layout += ["--bare", str(vmid), "--unprivileged", str(vmid)]
        self.labctl("up", "--nodes", str(nodes), "--containers", str(containers), *layout)
        self.inventory = self.labctl("inventory", parse=False)
        self.vmids = vmids

    # ---- lab
    def labctl(self, *args, parse=True, check=True):
        if parse and list(args) in (["gpus"], ["gpus", "--node", args[-1]]):
            return gpus_of(self.lab_id, args[2] if len(args) == 3 else None)
        proc = subprocess.run([LABCTL] + list(args), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=300, check=False)
        if check and proc.returncode:
            detail = (proc.stderr or proc.stdout).strip()
            raise AssertionError("labctl %s failed (%d): %s" % (" ".join(args), proc.returncode, detail))
        out = proc.stdout.strip()
        return json.loads(out.splitlines()[-1]) if parse else out

    @staticmethod
    def node_of(vmid):
        return "pve%d" % (int(vmid) // 100)

    def run(self, scenario, vmid, gpus=(), mib=512, extra=()):
        vmid = str(vmid)
        self.touched.add(vmid)
        args = ["run", scenario, "--node", self.node_of(vmid), "--vmid", vmid]
        if gpus:
            args += ["--gpus", ",".join(str(g) for g in gpus), "--mib", str(mib)]
        if extra:
            args += ["--"] + list(extra)
        return self.labctl(*args)

    def run_fork_inherit_orphan(self, vmid, gpu=0, mib=512):
        """fork_inherit, then SIGKILL the parent: the child keeps the memory (GPU_FACTS row 5)."""
        result = self.run("fork_inherit", vmid, [gpu], mib)
        parent, child = result["roles"]["parent"], result["roles"]["child"]
        os.kill(parent, signal.SIGKILL)
        wait_until(lambda: proc_state(parent) in (None, "Z"), 10, "parent %d to die" % parent)
        result["holders"] = [child]
        return result

    def exec(self, vmid, *cmd):
        vmid = str(vmid)
        return subprocess.run([LABCTL, "exec", "--node", self.node_of(vmid), "--vmid", vmid, "--"] + list(cmd),
                              env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=60, check=False)

    def gpus(self):
        """{(vmid, index): used_mib} from the fake driver's truth."""
        table = {}
        for gpu in self.labctl("gpus"):
            for vmid, index in (gpu.get("visible_in") or {}).items():
                table[(str(vmid), int(index))] = gpu["used_mib"]
        return table

    def all_free(self):
        return all(g["used_mib"] == 0 for g in self.labctl("gpus"))

    def reset(self):
        """Restart the containers a test used: kills its workloads, clears supervisord programs."""
        for vmid in sorted(self.touched):
            self.labctl("restart", "--node", self.node_of(vmid), "--vmid", vmid, parse=False, check=False)
        self.touched.clear()

    def down(self):
        try:
            self.labctl("down", parse=False, check=False)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- ansible
    def playbook(self, name, extra_vars=None, limit=None, check=False, args=()):
        report_dir = tempfile.mkdtemp(dir=self.workdir, prefix="report-")
        # These tests are the container path's (hosts with no node known: bare metal, no proxmox_node_host); the
        # lab's containers know their node, so the default (auto) would take the node path, which
        # test_role_fleet_node.py and test_node_side.py test.
        variables = {"release_gpus_report_dir": report_dir, "release_gpus_term_timeout": 2,
                     "release_gpus_kill_timeout": 5, "release_gpus_advanced": {"verify_timeout": 10},
                     "release_gpus_from": "container"}
        extra_vars = dict(extra_vars or {})
        # one dict replaces another at the same precedence: merge the test's advanced keys into these
        variables["release_gpus_advanced"].update(extra_vars.pop("release_gpus_advanced", {}))
        variables.update(extra_vars)
        vars_file = os.path.join(report_dir, "vars.json")
        with open(vars_file, "w") as f:
            json.dump(variables, f)
        cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", self.inventory,
               os.path.join(PLAYBOOKS, name), "-e", "@" + vars_file, "--forks", "12"] + list(args)
        if limit:
            cmd += ["--limit", limit]
        if check:
            cmd.append("--check")
        proc = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              universal_newlines=True, timeout=400, check=False)
        if proc.returncode:
            # shown whole under "Captured stdout" when the test fails (an assertion message is cut short)
            print("ansible-playbook %s exit %d:\n%s" % (name, proc.returncode, proc.stdout[-20000:]))
        recap = parse_recap(proc.stdout)
        reports = {}
        for entry in os.listdir(report_dir):
            if entry.endswith(".json") and entry != "vars.json":
                with open(os.path.join(report_dir, entry)) as f:
                    reports[entry[:-5]] = json.load(f)
        return PlayResult(proc.returncode, proc.stdout, recap, reports)


def parse_recap(output):
    """host -> {ok, changed, unreachable, failed, skipped, rescued, ignored} from PLAY RECAP lines."""
    recap = {}
    for line in output.splitlines():
        match = RECAP.match(line)
        if match:
            keys = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
            recap[match.group(1)] = dict(zip(keys, (int(g) for g in match.groups()[1:])))
    return recap


def wave_includes(output):
    """{wave: [hosts]} from the include lines of release_gpus.yml's wave loop."""
    waves = {}
    for hosts, wave in re.findall(r"included: gpuops\.fleet\.release_gpus for (.+) => \(item=wave (\d+)\)", output):
        waves.setdefault(int(wave), []).extend(h.strip() for h in hosts.split(","))
    return waves


def alive(pid):
    return proc_state(pid) not in (None, "Z", "X")


def wait_until(predicate, timeout, what):
    try:
        wait_for(predicate, timeout, interval=0.05, what=what)
    except LabError as exc:
        raise AssertionError(str(exc)) from None


def make_venv(path, with_pip=True):
    """A fresh interpreter without psutil/nvidia-ml-py, on a host path the containers can see."""
    args = [sys.executable if not os.path.exists("/usr/bin/python3") else "/usr/bin/python3", "-m", "venv"]
    if not with_pip:
        args.append("--without-pip")
    subprocess.run(args + [path], check=True, timeout=300, stdout=subprocess.DEVNULL)
    return os.path.join(path, "bin", "python")
