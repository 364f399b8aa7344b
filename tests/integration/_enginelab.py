"""Lab helpers for the gpu_status and gpu_release integration tests.

A real lab (tests/lab/labctl) and real ansible-playbook through gpuops.fleet.pct.
Tests assert the truth from `labctl gpus`, `labctl run` and the host's /proc,
never only the module's word.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LABCTL = os.path.join(REPO, "tests", "lab", "labctl")
if os.path.join(REPO, "tests", "lab") not in sys.path:
    sys.path.append(os.path.join(REPO, "tests", "lab"))
from lablib.common import clone_lab_id  # noqa: E402  (lab names unique to this clone)
from lablib.scenarios import gpus_of  # noqa: E402  (labctl gpus, in this process)
VENV_BIN = os.path.join(REPO, ".venv", "bin")
SITE_PACKAGES = os.path.join(REPO, ".venv", "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
if not os.path.exists(os.path.join(VENV_BIN, "ansible-playbook")):
    VENV_BIN = os.path.dirname(os.path.abspath(sys.executable))


def host_alive(pid):
    """True while the host pid exists and is not a one-thread zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return not (fields[0] in ("Z", "X") and int(fields[17]) <= 1)


class Play(object):
    def __init__(self, rc, result, output, seconds):
        self.rc = rc
        self.result = result or {}
        self.output = output
        self.seconds = seconds

    @property
    def failed(self):
        return self.rc != 0

    def __getitem__(self, key):
        if key not in self.result:
            raise KeyError("%r is not in the result of %r" % (key, self))
        return self.result[key]

    def get(self, key, default=None):
        return self.result.get(key, default)

    def __repr__(self):
        # msg first: pytest shortens a long explanation, and the message is what says why
        return "Play(rc=%d, msg=%r, result=%s)\n%s" % (self.rc, self.result.get("msg"),
                                                       json.dumps(self.result, indent=1)[:6000],
                                                       self.output if len(self.output) <= 6000
                                                       else self.output[:3000] + "\n...\n" + self.output[-3000:])


class EngineLab(object):
    """One lab for one test module; `up_args` as for `labctl up`."""

    def __init__(self, lab_id, up_args):
        self.lab_id = lab_id = clone_lab_id(lab_id)
        self.env = dict(os.environ, LAB_ID=lab_id, LAB_PCT_DELAY="0.05", ANSIBLE_NOCOLOR="1",
                        ANSIBLE_DEPRECATION_WARNINGS="False")
        # labctl run passes PATH into containers: keep the controller venv out (its supervisorctl is not the lab's)
        self.env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                           if p and os.path.abspath(p) != os.path.join(REPO, ".venv", "bin"))
        self.workdir = tempfile.mkdtemp(prefix="gpuops-engine-%s-" % lab_id)
        self.started = []        # labctl run results, for clean-up
        self.labctl("down", parse=False, check=False)
        self.labctl("up", *up_args)
        self.inventory = self.labctl("inventory", parse=False)
        self._hostvars = None
        self.count = 0

    # ---- lab
    def labctl(self, *args, parse=True, check=True, timeout=300):
        if parse and [str(a) for a in args] in (["gpus"], ["gpus", "--node", str(args[-1])]):
            return gpus_of(self.lab_id, str(args[2]) if len(args) == 3 else None)
        proc = subprocess.run([LABCTL] + [str(a) for a in args], env=self.env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout, check=False)
        if check and proc.returncode:
            command = " ".join(str(a) for a in args)
            detail = (proc.stderr or proc.stdout).strip()
            raise AssertionError("labctl %s failed (%d): %s" % (command, proc.returncode, detail))
        out = proc.stdout.strip()
        return json.loads(out.splitlines()[-1]) if parse else out

    def run(self, scenario, vmid, gpus=(), mib=512, node="pve1", extra=()):
        args = ["run", scenario, "--node", node, "--vmid", vmid]
        if gpus:
            args += ["--gpus", ",".join(str(g) for g in gpus)]
        if scenario not in ("monitor", "bystander_cpu"):
            args += ["--mib", mib]
        result = self.labctl(*(args + list(extra)))
        result["_node"], result["_vmid"] = node, vmid
        self.started.append(result)
        return result

    def truth(self, node="pve1"):
        """minor -> the fake driver's entry for that GPU."""
        return dict((g["minor"], g) for g in self.labctl("gpus", "--node", node))

    def used(self, minor, node="pve1"):
        return self.truth(node)[minor]["used_mib"]

    def exec(self, vmid, *cmd, node="pve1"):
        return subprocess.run([LABCTL, "exec", "--node", node, "--vmid", str(vmid), "--"] + list(cmd), env=self.env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=60,
                              check=False)

    def cleanup(self, node="pve1"):
        """Kill what tests started, stop respawning programs, reset leaked GPUs; the lab stays up."""
        for result in self.started:
            if result.get("supervisor_program"):
                self.exec(result["_vmid"], "supervisorctl", "stop", result["supervisor_program"], node=result["_node"])
                self.exec(result["_vmid"], "rm", "-f", result["supervisor_conf"], node=result["_node"])
                self.exec(result["_vmid"], "supervisorctl", "update", node=result["_node"])
            if result.get("freezer"):
                self.labctl("restart", "--node", result["_node"], "--vmid", result["_vmid"])
                self.wait_supervisord(result["_vmid"], result["_node"])
        for result in self.started:
            for pid in result.get("host_pids", []) + list(result.get("roles", {}).values()):
                if result.get("roles", {}).get("supervisord") == pid:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.started = []
        deadline = time.monotonic() + 10
        while True:
            busy = [g for g in self.labctl("gpus", "--node", node) if g["used_mib"]]
            if not busy or time.monotonic() > deadline:
                break
            for gpu in busy:
                if not gpu["holders"] and gpu["visible_in"]:
                    vmid, index = sorted(gpu["visible_in"].items())[0]
                    self.exec(vmid, "nvidia-smi", "--gpu-reset", "-i", str(index), node=node)
            time.sleep(0.2)
        return busy

    def wait_supervisord(self, vmid, node="pve1", timeout=15):
        """After a container restart, wait until its supervisord answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.exec(vmid, "supervisorctl", "pid", node=node).stdout.strip().isdigit():
                return
            time.sleep(0.2)
        raise AssertionError("supervisord in %s did not come back within %ss" % (vmid, timeout))

    def down(self):
        try:
            self.labctl("down", parse=False, check=False)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- ansible
    def hostvars(self, host):
        """The lab inventory's variables of one host."""
        if self._hostvars is None:
            import yaml
            with open(self.inventory) as f:
                groups = yaml.safe_load(f)["all"]["children"]
            self._hostvars = {}
            for group in ("gpu_containers", "pve_nodes"):
                self._hostvars.update(groups[group]["hosts"])
        return self._hostvars[host]

    def direct(self, host, module, args=None, check_mode=False, background=False):
        """Run one module in its host without ansible-playbook: the module's own code and argument spec, with the
        host's interpreter, in a container through labctl exec (as pct exec runs it) or on a node through
        labctl node-exec. For the variations of a scenario whose end-to-end play (play()) runs elsewhere: what it
        leaves out is the controller and the connection, about 2 CPU-seconds a run on this machine.
        Returns Play (rc 2 on failure, as ansible-playbook's)."""
        hv = self.hostvars(host)
        payload = json.dumps({"ANSIBLE_MODULE_ARGS": dict(args or {}, _ansible_check_mode=bool(check_mode))})
        # the controller venv's site-packages hold ansible-core and this collection (a symlink to the clone); put
        # them on this interpreter's path alone, not in an environment that what the module runs would inherit
        runner = ("import runpy, sys; sys.path.insert(0, %r); "
                  "runpy.run_module('ansible_collections.gpuops.fleet.plugins.modules.%s', run_name='__main__', "
                  "alter_sys=True)" % (SITE_PACKAGES, module))
        argv = [hv["ansible_python_interpreter"], "-c", runner]   # the arguments on stdin, as AnsiballZ passes them
        if "pct_vmid" in hv:
            cmd = [LABCTL, "exec", "--node", hv["lab_node"], "--vmid", str(hv["pct_vmid"]), "--"] + argv
        else:
            cmd = [LABCTL, "node-exec", "--node", host, "--"] + argv
        env = self.env
        started = time.monotonic()
        self.count += 1
        args_file = os.path.join(self.workdir, "args-%s-%d.json" % (host, self.count))
        with open(args_file, "w") as f:
            f.write(payload)
        with open(args_file) as stdin:
            proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    universal_newlines=True)

        def finish():
            out, err = proc.communicate(timeout=240)
            result = None
            for line in reversed(out.splitlines()):
                if line.startswith("{"):
                    result = json.loads(line)
                    break
            failed = proc.returncode != 0 or result is None or bool(result.get("failed"))
            return Play(2 if failed else 0, result, err + out, time.monotonic() - started)
        if background:
            return finish
        return finish()

    def play_tasks(self, host, module, args_list):
        """One ansible-playbook run of one module task per entry of args_list on one host, errors ignored (each task's
        own result still says failed); returns a Play per task, in order."""
        tasks = [{"name": "case %d" % i, "gpuops.fleet." + module: args, "register": "case_%d" % i, "ignore_errors": True}
                 for i, args in enumerate(args_list)]
        # the tree callback keeps a host's last result: this one carries every case's
        tasks.append({"name": "every case's result", "ansible.builtin.set_fact": {
            "cases": "{{ [%s] }}" % ", ".join("case_%d" % i for i in range(len(args_list)))}})
        whole = self._playbook(host, tasks)()
        if whole.failed or not whole.result:
            raise AssertionError("ansible-playbook of %d cases failed: %r" % (len(args_list), whole))
        return [Play(2 if case.get("failed") else 0, case, whole.output, whole.seconds)
                for case in whole["ansible_facts"]["cases"]]

    def play(self, host, module, args=None, check_mode=False, extra_env=None, background=False, task_extra=None):
        """Run one module task with ansible-playbook; returns Play (result from the tree callback)."""
        task = {"name": "module under test", "gpuops.fleet." + module: args or {}}
        if check_mode:
            task["check_mode"] = True
        task.update(task_extra or {})
        finish = self._playbook(host, [task], extra_env)
        if background:
            return finish
        return finish()

    def _playbook(self, host, tasks, extra_env=None):
        """Start ansible-playbook with these tasks on one host; returns finish(), which waits and returns Play
        (the host's last result, from the tree callback)."""
        self.count += 1
        tag = "%s-%d" % (host, self.count)
        tree = os.path.join(self.workdir, "tree-" + tag)
        book = os.path.join(self.workdir, "play-%s.yml" % tag)
        with open(book, "w") as f:
            json.dump([{"hosts": host, "gather_facts": False, "tasks": tasks}], f)
        env = dict(self.env, ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree", ANSIBLE_CALLBACK_TREE_DIR=tree)
        env.update(extra_env or {})
        cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", self.inventory, book]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                universal_newlines=True)

        def finish():
            output = proc.communicate(timeout=240)[0]
            result = None
            path = os.path.join(tree, host)
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
            return Play(proc.returncode, result, output, time.monotonic() - started)
        return finish
