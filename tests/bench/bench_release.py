"""Benchmark gpu_release (issue 4). Prints a Markdown fragment on stdout.

Default (lab, what `make bench` runs): one gpu_release task frees a tp_server over 8 GPUs, a
fork_inherit whose parent was killed and a defunct_leader, through ansible-playbook and
gpuops.fleet.pct. Records the module's elapsed_s and the task's time within the playbook run
(junit callback), and checks the truth (`labctl gpus`, host /proc) after each round.

`--cuda [--gib 120]` (a real NVIDIA GPU, GPU 0, run as root; for docs/gpu-results.md and
docs/fidelity.md): bare SIGKILL-to-free limit, gpu_status with `-c local` on plain,
fork_inherit, defunct_leader, mmap_only and monitor (tests/lab/cuda_workload.py), gpu_release
with `match` on the workload, a minimal NVML task, and the seed's manual way (pkill; sleep;
nvidia-smi; fuser is only listed, never `-k`, on a shared machine). Never resets the GPU.
"""
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))

from _enginelab import EngineLab, host_alive  # noqa: E402

ROUNDS = 3
MIB = 2048
ARGS = {"term_timeout": 5, "kill_timeout": 5, "advanced": {"verify_timeout": 10}}


def task_seconds(junit_dir):
    """The module task's time from the junit callback's report."""
    for path in glob.glob(os.path.join(junit_dir, "*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            if "module under test" in case.get("name", ""):
                return float(case.get("time"))
    return None


def lab_main():
    lab = EngineLab("engbench", ["--nodes", "1", "--containers", "1", "--gpus", "8"])
    rows = []
    try:
        pct_delay = os.environ.get("LAB_PCT_DELAY_BENCH", "0.3")
        lab.env["LAB_PCT_DELAY"] = pct_delay
        for round_no in range(ROUNDS):
            tp = lab.run("tp_server", 101, list(range(8)), mib=MIB)
            fork = lab.run("fork_inherit", 101, [0], mib=MIB)
            defunct = lab.run("defunct_leader", 101, [1], mib=MIB)
            os.kill(fork["roles"]["parent"], signal.SIGKILL)
            holders = tp["holders"] + [fork["roles"]["child"]] + defunct["holders"]
            before = sum(g["used_mib"] for g in lab.labctl("gpus"))
            junit = os.path.join(lab.workdir, "junit-%d" % round_no)
            play = lab.play("ct101", "gpu_release", ARGS, extra_env={
                "ANSIBLE_CALLBACKS_ENABLED": "ansible.builtin.tree,ansible.builtin.junit",
                "JUNIT_OUTPUT_DIR": junit, "JUNIT_TASK_CLASS": "False"})
            after = sum(g["used_mib"] for g in lab.labctl("gpus"))
            alive = [p for p in holders if host_alive(p)]
            if play.failed or after or alive:
                print("round %d failed: %r; used after %d MiB; alive %s" % (round_no, play, after, alive),
                      file=sys.stderr)
                return 1
            rows.append({"elapsed": play["elapsed_s"], "task": task_seconds(junit), "wall": play.seconds,
                         "before": before, "released": play["released_mib"], "rung": play["rung_reached"],
                         "signals": len(play["actions"])})
            lab.cleanup()
    finally:
        lab.cleanup()
        lab.down()
    lines = [
        "## One gpu_release task, lab (`tests/bench/bench_release.py`)",
        "",
        "Container ct101 sees 8 GPUs: `tp_server` (parent + 8 workers, %d MiB each), `fork_inherit` on GPU 0 with "
        "its parent SIGKILLed, `defunct_leader` on GPU 1; one `gpuops.fleet.gpu_release` task (all GPUs) through "
        "`gpuops.fleet.pct` with a %s s `pct` start-up delay. Truth checked after each round: every GPU at 0 MiB "
        "in `labctl gpus`, every holder gone from the host's /proc." % (MIB, pct_delay),
        "",
        "| round | held MiB | released MiB | signals | rung | module elapsed_s | task s (in the playbook) | "
        "ansible-playbook wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(rows):
        lines.append("| %d | %d | %d | %d | %s | %.3f | %s | %.2f |" % (
            i + 1, row["before"], row["released"], row["signals"], row["rung"], row["elapsed"],
            "%.2f" % row["task"] if row["task"] is not None else "n/a", row["wall"]))
    tasks = [r["task"] for r in rows if r["task"] is not None]
    lines += ["", "Medians: module elapsed_s %.3f s, task %s s, playbook %.2f s." % (
        statistics.median(r["elapsed"] for r in rows),
        "%.2f" % statistics.median(tasks) if tasks else "n/a",
        statistics.median(r["wall"] for r in rows))]
    print("\n".join(lines))
    return 0


# ---- real GPU (--cuda)

CUDA_WORKLOAD = os.path.join(REPO, "tests", "lab", "cuda_workload.py")


class Cuda(object):
    """Workloads on GPU 0 through cuda_workload.py, NVML for the truth, ansible-playbook -c local."""

    def __init__(self, gib, rehearse=False):
        import pynvml
        self.subprocess = subprocess
        self.pynvml = pynvml
        self.rehearse = rehearse
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.gib = gib
        self.procs = []
        self.workdir = tempfile.mkdtemp(prefix="gpuops-cuda-bench-")
        os.makedirs(os.path.join(self.workdir, "ansible_collections", "gpuops"))
        os.symlink(REPO, os.path.join(self.workdir, "ansible_collections", "gpuops", "fleet"))
        self.count = 0

    def used_mib(self):
        mem = self.pynvml.nvmlDeviceGetMemoryInfo(self.handle, version=self.pynvml.nvmlMemory_v2)
        return mem.used // 2 ** 20

    def wait_free(self, timeout=30):
        deadline = time.monotonic() + timeout
        while self.used_mib() > 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.used_mib()

    def start(self, scenario, gib=None):
        rfd, wfd = os.pipe()
        extra = ["--allocator", "lab"] if self.rehearse else []
        proc = self.subprocess.Popen([sys.executable, CUDA_WORKLOAD, scenario, "--gib", str(gib or self.gib),
                                      "--lifeline", str(rfd), "--lifetime", "900"] + extra,
                                     stdout=self.subprocess.PIPE, pass_fds=(rfd,))
        os.close(rfd)
        doc = json.loads(proc.stdout.readline())
        if "error" in doc:
            raise RuntimeError(doc["error"])
        self.procs.append((proc, wfd))
        return proc, doc

    def start_holders(self, scenario, gib=None):
        """Start one GPU_FACTS holder shape; returns the pids that hold its memory (for fork_inherit the
        child, once its parent is killed and reaped)."""
        proc, doc = self.start(scenario, gib=gib)
        holders = doc["holders"]
        if scenario == "fork_inherit":
            os.kill(doc["roles"]["parent"], signal.SIGKILL)
            proc.wait()
            holders = [doc["roles"]["child"]]
        time.sleep(0.3)
        return holders

    def stop_all(self):
        for proc, wfd in self.procs:
            os.close(wfd)           # the lifeline: every workload process ends itself
            try:
                proc.kill()
            except OSError:
                pass
            proc.wait()
        self.procs = []
        return self.wait_free()

    def play(self, module, args):
        self.count += 1
        book = os.path.join(self.workdir, "play-%d.yml" % self.count)
        tree = os.path.join(self.workdir, "tree-%d" % self.count)
        junit = os.path.join(self.workdir, "junit-%d" % self.count)
        with open(book, "w") as f:
            json.dump([{"hosts": "localhost", "gather_facts": False, "tasks": [
                {"name": "module under test", "gpuops.fleet." + module: args}]}], f)
        # Pipelining on, as gpuops.fleet.pct always runs modules; GPU_BENCH_PIPELINING=0 turns it off.
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=self.workdir, ANSIBLE_NOCOLOR="1",
                   ANSIBLE_PIPELINING=os.environ.get("GPU_BENCH_PIPELINING", "1") == "1" and "True" or "False",
                   ANSIBLE_DEPRECATION_WARNINGS="False", JUNIT_OUTPUT_DIR=junit, JUNIT_TASK_CLASS="False",
                   ANSIBLE_CALLBACKS_ENABLED="ansible.builtin.tree,ansible.builtin.junit", ANSIBLE_CALLBACK_TREE_DIR=tree)
        playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
        if not os.path.exists(playbook):  # ansible-core installed with pip --target
            playbook = shutil.which("ansible-playbook") or playbook
        started = time.monotonic()
        proc = self.subprocess.run([playbook, "-c", "local", "-i", "localhost,", "-e",
                                    "ansible_python_interpreter=" + sys.executable, book], env=env, check=False,
                                   stdout=self.subprocess.PIPE, stderr=self.subprocess.STDOUT, universal_newlines=True)
        wall = time.monotonic() - started
        with open(os.path.join(tree, "localhost")) as f:
            result = json.load(f)
        return proc.returncode, result, task_seconds(junit), wall


def _zombie(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def cuda_main(gib, rehearse=False):
    cuda = Cuda(gib, rehearse)
    out = ["## Real GPU (`tests/bench/bench_release.py --cuda --gib %g`)" % gib, ""]
    try:
        driver = cuda.pynvml.nvmlSystemGetDriverVersion()
        out.append("GPU 0: %s, driver %s; idle v2 used %d MiB." % (cuda.pynvml.nvmlDeviceGetName(cuda.handle), driver,
                                                                   cuda.used_mib()))
        # 1. the bare limit
        proc, doc = cuda.start("plain")
        held = cuda.used_mib()
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        reaped = time.monotonic() - start
        after = cuda.wait_free()
        freed = time.monotonic() - start
        cuda.stop_all()
        out += ["", "Bare limit: %d MiB held; SIGKILL to reaped %.3f s, v2 used at %d MiB after %.3f s."
                % (held, reaped, after, freed)]
        # 2. gpu_status on the GPU_FACTS scenarios
        out += ["", "### gpu_status (`-c local`) on real CUDA holders (%g GiB)" % min(gib, 4), "",
                "| scenario | expected holders | module holders | via | defunct_leader | clients | diagnosis (first) |",
                "|---|---|---|---|---|---|---|"]
        for scenario in ("plain", "fork_inherit", "defunct_leader", "mmap_only", "monitor"):
            expected = cuda.start_holders(scenario, gib=min(gib, 4))
            rc, res, task, wall = cuda.play("gpu_status", {"gpus": [0]})
            holders = res.get("holders", [])
            out.append("| %s | %s | %s | %s | %s | %s | %s |" % (
                scenario, expected, [h["pid"] for h in holders], [h["via"] for h in holders],
                [h["defunct_leader"] for h in holders], [c["pid"] for c in res.get("clients", [])],
                (res.get("diagnosis") or [res.get("msg", "")])[0].replace("|", "/")))
            cuda.stop_all()
        # 2b. gpu_release on each GPU_FACTS holder shape, verified by NVML afterwards
        out += ["", "### gpu_release (`-c local`, `match: cuda_workload`) per holder shape, %g GiB" % min(gib, 4), "",
                "| scenario | changed | signals | rung | module elapsed_s | task s | v2 used after | holders alive after |",
                "|---|---|---|---|---|---|---|---|"]
        for scenario in ("plain", "fork_inherit", "defunct_leader", "mmap_only"):
            holders = cuda.start_holders(scenario, gib=min(gib, 4))
            rc, res, task, wall = cuda.play("gpu_release", {"gpus": [0], "match": "cuda_workload"})
            time.sleep(0.2)
            alive = [p for p in holders if os.path.exists("/proc/%d" % p) and not _zombie(p)]
            out.append("| %s | %s | %s | %s | %s | %s | %d | %s |" % (
                scenario, res.get("changed"), [a["signal"] for a in res.get("actions", [])], res.get("rung_reached"),
                res.get("elapsed_s"), "%.2f" % task if task else "n/a", cuda.used_mib(), alive))
            cuda.stop_all()
        # 3. gpu_release with match, and a minimal NVML task
        out += ["", "### gpu_release (`-c local`, `match: cuda_workload`), %g GiB" % gib, "",
                "| round | held MiB | changed | signals | rung | module elapsed_s | task s (in the playbook) | "
                "playbook wall s | v2 used after |",
                "|---|---|---|---|---|---|---|---|---|"]
        for round_no in range(3):
            proc, doc = cuda.start("plain")
            held = cuda.used_mib()
            rc, res, task, wall = cuda.play("gpu_release", {"gpus": [0], "match": "cuda_workload"})
            proc.wait()
            out.append("| %d | %d | %s | %s | %s | %s | %s | %.2f | %d |" % (
                round_no + 1, held, res.get("changed"), [a["signal"] for a in res.get("actions", [])],
                res.get("rung_reached"), res.get("elapsed_s"), "%.2f" % task if task else "n/a", wall, cuda.used_mib()))
            cuda.stop_all()
        rc, res, task, wall = cuda.play("gpu_status", {"gpus": [0], "cmdline": False})
        out += ["", "Minimal NVML task (gpu_status on the idle GPU): task %.2f s within a %.2f s playbook." % (task, wall)]
        # 4. the seed's manual way
        proc, doc = cuda.start("plain")
        start = time.monotonic()
        cuda.subprocess.run("pkill -f '[c]uda_workload.py'; fuser -v /dev/nvidia0 >/dev/null 2>&1; sleep 1; "
                            "nvidia-smi --query-gpu=memory.used --format=csv,noheader", shell=True, check=False,
                            stdout=cuda.subprocess.DEVNULL)
        manual = time.monotonic() - start
        proc.wait()
        out += ["", "Seed's manual way (`pkill -f ...; fuser -v; sleep 1; nvidia-smi --query-gpu=memory.used`): "
                "%.2f s, v2 used after %d MiB." % (manual, cuda.used_mib())]
    finally:
        cuda.stop_all()
    print("\n".join(out))
    return 0


def main():
    if "--cuda" in sys.argv:
        gib = float(sys.argv[sys.argv.index("--gib") + 1]) if "--gib" in sys.argv else 120.0
        return cuda_main(gib, rehearse="--rehearse" in sys.argv)
    return lab_main()


if __name__ == "__main__":
    sys.exit(main())
