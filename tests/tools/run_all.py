"""Run every test stage of gpuops.fleet and end with one pytest-style summary line.

Stages: sanity (ansible-test on a copy of the tracked files; pylint on plugins/ and roles/ only), unit (pytest),
lint (ansible-lint, production profile, and antsibull-docs lint-collection-docs), lab (the lab's self-tests, tests/integration/test_lab*.py),
integration (pytest against the lab); pylint-tests (pylint on tests/) only when asked (make pylint-tests,
make sanity, .ci/run). Unit, sanity and lint run one after another in a second process,
beside the lab and integration stages (their output is printed when they end): the lab stage waits on
its lab more than it computes, and the unit tests fill that time; sanity and lint then run at idle
priority (SCHED_IDLE), on the CPU time the lab and integration stages leave. The lab stage runs before
integration, and a broken lab stops the run there. Tests marked `timing` run --timing-repeat times (GPUOPS_TIMING_REPEAT).

A test that did not run never counts as passed: a sanity test whose program is
missing counts as skipped, and a skipped test fails the run unless
tests/allowed_skips.txt lists it with a reason. After a full run, every test that
docs/reliability.md lists must have run and passed.
"""
import argparse
import compileall
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.join(REPO, ".venv", "bin")
STAGES = ("sanity", "unit", "lint", "lab", "integration")   # make test
EXTRA_STAGES = ("pylint-tests",)   # make sanity and .ci/run, after make test
# Lab and integration tests mostly wait (on ansible-playbook, sshd, the lab): 3 workers on 2 cores took
# the two stages from 1,703 s to 1,057 s, all passing; each file keeps its own lab.
WORKERS = 3
BESIDE = ("sanity", "pylint-tests", "lint", "unit")   # stages run in a second process beside the others
LAB_TESTS = "tests/integration/test_lab*.py"
SLOWEST = 10
ALLOWED_SKIPS = os.path.join(REPO, "tests", "allowed_skips.txt")
RELIABILITY = os.path.join(REPO, "docs", "reliability.md")
TEST_ID = re.compile(r"`(tests/[\w/]+\.py::[\w\[\]-]+)`")
SANITY_SKIPS = (
    # Needs docker or a network to fetch its own tools; nothing here for it to check.
    "--skip-test", "pslint",
)
GET_PIP_STANDIN = """\
# Stand-in for pip's bootstrap script: the machine reaches PyPI but not the script's host.
import subprocess
import sys
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pip==%s"])
"""


class Tally:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.skipped = 0
        self.failures = []
        self.passed_ids = set()   # "tests/x.py::test_name" of every pytest test that passed
        self.prefixes = set()     # "tests/x.py::test_name[" of parametrized tests whose every case passed
        self.failed_prefixes = set()
        self.times = []           # (stage, seconds)
        self.durations = []       # (seconds, test id) of every pytest test

    def add(self, passed, failed, skipped=0, failures=()):
        self.passed += passed
        self.failed += failed
        self.skipped += skipped
        self.failures.extend(failures)


def allowed_skips():
    """{test id: reason} from tests/allowed_skips.txt (`ID  # reason`; a line without a reason does not count)."""
    out = {}
    if os.path.exists(ALLOWED_SKIPS):
        with open(ALLOWED_SKIPS) as handle:
            for line in handle:
                test_id, sep, reason = line.partition("#")
                if test_id.strip() and sep and reason.strip():
                    out[test_id.strip()] = reason.strip()
    return out


def reliability_tests():
    """Test ids that docs/reliability.md names, in order."""
    if not os.path.exists(RELIABILITY):
        return []
    with open(RELIABILITY) as handle:
        return list(dict.fromkeys(TEST_ID.findall(handle.read())))


def case_id(case):
    """tests/x/y.py::test_name[param] from a junit testcase."""
    classname = case.get("classname") or ""
    parts = classname.split(".")
    path = "/".join(parts) + ".py"
    for cut in range(len(parts), 0, -1):
        candidate = "/".join(parts[:cut]) + ".py"
        if os.path.exists(os.path.join(REPO, candidate)):
            path = candidate
            break
    return "%s::%s" % (path, case.get("name"))


def banner(text):
    print("\n" + "=" * 20 + " " + text + " " + "=" * 20, flush=True)


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode()
    return [p for p in out.split("\0") if p and os.path.lexists(os.path.join(REPO, p))]


def venv_python_version(python=None):
    """X.Y of the venv's Python (.venv's by default): what ansible-test sanity runs on, not a fixed version."""
    return subprocess.run([python or os.path.join(VENV_BIN, "python"), "-c",
                           "import sys; print('%d.%d' % sys.version_info[:2])"],
                          check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def venv_site(python=None):
    """The venv's site-packages (where `make venv` links the collection)."""
    return subprocess.run([python or os.path.join(VENV_BIN, "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def install_get_pip_standin(python=None):
    """The stand-in for each pip version that the venv's ansible-test bootstraps (2.16-2.17: 23.1.2, 2.18-2.19:
    24.2, 2.20-2.21: 25.2), read from its own python_requirements.py."""
    source = os.path.join(venv_site(python), "ansible_test", "_internal", "python_requirements.py")
    with open(source) as handle:
        versions = set(re.findall(r"\bpip='([\d.]+)'", handle.read()))
    cache = os.path.expanduser("~/.ansible/test/cache")
    os.makedirs(cache, exist_ok=True)
    for pip_version in versions:
        path = os.path.join(cache, "get_pip_%s.py" % pip_version.replace(".", "_"))
        with open(path, "w") as handle:
            handle.write(GET_PIP_STANDIN % pip_version)
    return versions


def compile_sources():
    """Bytecode for the collection's and the tests' Python before any test runs. Where PYTHONDONTWRITEBYTECODE is set
    (this machine's image sets it), every labctl call, module run through EngineLab.direct and ansible-playbook
    start compiled the lab's, the module_utils' and the plugins' sources again: about 15 ms a labctl call."""
    for folder in ("plugins", "tests"):
        compileall.compile_dir(os.path.join(REPO, folder), quiet=1)


# pylint is most of sanity's CPU (72 of 85 CPU-s): over the shipped code in make test (24 CPU-s), over tests/ (21,800
# lines of tests, lab and tools, 48 CPU-s) in its own stage, which `make sanity` and .ci/run also run.
SANITY_RUNS = {
    "sanity": [("", ["--skip-test", "pylint"]), (" (pylint: plugins, roles)", ["--test", "pylint", "plugins/", "roles/"])],
    "pylint-tests": [(" (pylint: tests)", ["--test", "pylint", "tests/"])],
}


def idle_priority():
    """In a beside stage's program (preexec_fn): SCHED_IDLE, inherited by its children. Sanity and lint only
    compute; at idle priority they fill the cores that the integration workers leave while they wait (10-15% of
    two cores through that stage, measured), instead of slowing those workers down."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


BESIDE_PROCESS = {"idle": False}   # set in the beside process: its sanity and lint run at idle priority


def idle_if_beside():
    return idle_priority if BESIDE_PROCESS["idle"] else None


def run_sanity(tally, stage="sanity"):
    banner("ansible-test sanity" if stage == "sanity" else "ansible-test sanity --test pylint tests/")
    install_get_pip_standin()
    workdir = tempfile.mkdtemp(prefix="gpuops-sanity-")
    try:
        coll = os.path.join(workdir, "ansible_collections", "gpuops", "fleet")
        os.makedirs(coll)
        for rel in tracked_files():
            src = os.path.join(REPO, rel)
            dst = os.path.join(coll, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)
        git = ["git", "-c", "user.name=sanity", "-c", "user.email=sanity@localhost"]
        subprocess.run(git + ["init", "-q"], cwd=coll, check=True)
        subprocess.run(git + ["add", "-A"], cwd=coll, check=True)
        subprocess.run(git + ["commit", "-q", "-m", "sanity"], cwd=coll, check=True)
        for label, selection in SANITY_RUNS[stage]:
            sanity_run(tally, coll, label, selection)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def sanity_run(tally, coll, label, selection):
    cmd = [os.path.join(VENV_BIN, "ansible-test"), "sanity", "--python", venv_python_version(),
           "--requirements", "--color", "no"] + list(SANITY_SKIPS) + list(selection)
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(cmd, cwd=coll, env=env, stdout=subprocess.PIPE, check=False,
                          stderr=subprocess.STDOUT, text=True, preexec_fn=idle_if_beside())
    print(proc.stdout[-20000:], flush=True)
    ran = re.findall(r"Running sanity test [\"']([^\"']+)[\"']", proc.stdout)
    # a test whose program is missing ran nothing: skipped, never passed
    not_run = set(re.findall(r"Running sanity test [\"']([^\"']+)[\"']\s*\nWARNING: Required program [\"'][^\"']+[\"'] "
                             r"not found", proc.stdout))
    ran = [t for t in ran if t not in not_run]
    failed = set()
    listing = re.search(r"FATAL: The \d+ sanity test\(s\) listed below.*?\n((?:[\w.-]+\n)+)", proc.stdout)
    if listing:
        failed = set(listing.group(1).split())
    if proc.returncode != 0 and not failed:
        failed = {"sanity"}
    allowed = allowed_skips()
    skipped_bad = ["sanity:%s (skipped: its program is missing)" % name for name in sorted(not_run)
                   if "sanity:" + name not in allowed]
    tally.add(len([t for t in ran if t not in failed]) or (0 if proc.returncode else 1),
              len(failed) + len(skipped_bad), skipped=len(not_run),
              failures=["sanity:" + name + label for name in sorted(failed)] + skipped_bad)


def run_pytest(tally, name, paths, extra=(), env_extra=None):
    banner("pytest " + name)
    xml = os.path.join(tempfile.gettempdir(), "gpuops-%s-%d.xml" % (name, os.getpid()))
    # No PYTHONPATH: the venv already sees ansible_collections, and a PYTHONPATH would leak
    # into lab containers through pct exec (which keeps the environment).
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""), **(env_extra or {}))
    env.pop("PYTHONPATH", None)
    paths = [p for pattern in paths for p in (sorted(glob.glob(os.path.join(REPO, pattern))) or [pattern])]
    cmd = [os.path.join(VENV_BIN, "python"), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           "--junitxml", xml] + list(extra) + list(paths)
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    passed = failed = skipped = 0
    failures = []
    allowed = allowed_skips()
    if os.path.exists(xml):
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            label = case_id(case)
            tally.durations.append((float(case.get("time") or 0), label))
            prefix = label.split("[")[0] + "[" if "[" in label else None
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                failures.append(label)
                tally.failed_prefixes.add(prefix)
            elif case.find("skipped") is not None:
                skipped += 1
                tally.failed_prefixes.add(prefix)
                if label not in allowed:
                    failed += 1
                    failures.append("%s (skipped, and not in tests/allowed_skips.txt)" % label)
            else:
                passed += 1
                tally.passed_ids.add(label)
                if prefix:
                    tally.prefixes.add(prefix)
        os.unlink(xml)
    if proc.returncode not in (0, 5) and failed == 0:
        failed, failures = 1, [name + ": pytest exit %d" % proc.returncode]
    tally.add(passed, failed, skipped, failures)
    return failed


def run_lint(tally):
    banner("ansible-lint (production profile)")
    targets = [p for p in ("roles", "playbooks") if os.listdir(os.path.join(REPO, p))]
    if not targets:
        print("ansible-lint: no roles or playbooks yet")
        return
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
               ANSIBLE_COLLECTIONS_PATH=venv_site())
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-lint"), "--profile", "production",
                           "--offline"] + targets, cwd=REPO, env=env, check=False, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, preexec_fn=idle_if_beside())
    print(proc.stdout[-20000:], flush=True)
    if proc.returncode == 0:
        tally.add(1, 0)
    else:
        tally.add(0, 1, failures=["ansible-lint"])
    banner("antsibull-docs lint-collection-docs (guides and every plugin's and role's docs)")
    # antsibull-docs lints a copy of the collection in a temporary folder. Seen through the venv's link, the
    # collection's path is not the copy's, so the "edit on GitHub" link of each plugin climbed out to the
    # copy's random name; a name ending in "_" reads as an rST reference, and the lint failed one run in 37
    # ("Unknown target name: antsibull-docs-k319_1o"). With no other collection path, the copy is the
    # collection, and the link is plugins/modules/NAME.py.
    no_collections = tempfile.mkdtemp(prefix="gpuops-lint-collections-")
    try:
        proc = subprocess.run([os.path.join(VENV_BIN, "antsibull-docs"), "lint-collection-docs", "--plugin-docs", REPO],
                              cwd=REPO, env=dict(env, ANSIBLE_COLLECTIONS_PATH=no_collections,
                                                 ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="False"),
                              check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=idle_if_beside())
    finally:
        shutil.rmtree(no_collections, ignore_errors=True)
    print(proc.stdout[-20000:] or "passed", flush=True)
    if proc.returncode == 0:
        tally.add(1, 0)
    else:
        tally.add(0, 1, failures=["antsibull-docs lint-collection-docs"])


def check_reliability(tally):
    """Every test docs/reliability.md lists ran in this run and passed (not skipped)."""
    banner("docs/reliability.md: every listed test ran and passed")
    tally.prefixes -= tally.failed_prefixes
    listed = reliability_tests()

    def passed(test_id):
        # a parametrized test counts when every one of its cases that ran passed, and at least one did
        return test_id in tally.passed_ids or ("[" not in test_id and test_id + "[" in tally.prefixes)
    missing = [t for t in listed if not passed(t)]
    for test_id in missing:
        print("did not run and pass: " + test_id)
    print("%d listed, %d ran and passed" % (len(listed), len(listed) - len(missing)), flush=True)
    tally.add(1 if listed and not missing else 0, 1 if missing or not listed else 0,
              failures=["docs/reliability.md: %s did not run and pass" % t for t in missing]
              or ([] if listed else ["docs/reliability.md lists no test"]))


def timed(tally, stage, func, *args):
    started = time.monotonic()
    func(tally, *args)
    tally.times.append((stage, time.monotonic() - started))


def start_beside(stages):
    """Unit, sanity and lint in a second run_all process; returns (process, log path, tally path)."""
    log = tempfile.NamedTemporaryFile(prefix="gpuops-beside-", suffix=".log", delete=False)
    result = log.name[:-len(".log")] + ".json"
    cmd = [sys.executable, os.path.abspath(__file__), "--tally-json", result]
    for stage in stages:
        cmd += ["--only", stage]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), log, result


def join_beside(tally, beside):
    proc, log, result = beside
    proc.wait()
    log.close()
    with open(log.name) as handle:
        print(handle.read(), end="", flush=True)
    os.unlink(log.name)
    try:
        with open(result) as handle:
            data = json.load(handle)
        os.unlink(result)
    except (OSError, ValueError):
        tally.add(0, 1, failures=["sanity, lint and unit: their process ended without a result (exit %s)"
                                  % proc.returncode])
        return
    tally.add(data["passed"], data["failed"], data["skipped"], data["failures"])
    tally.times.extend((stage, seconds) for stage, seconds in data["times"])
    tally.durations.extend((seconds, label) for seconds, label in data["durations"])
    tally.passed_ids.update(data["passed_ids"])
    tally.prefixes.update(data["prefixes"])
    tally.failed_prefixes.update(data["failed_prefixes"])


def print_slowest(tally):
    if tally.durations:
        banner("the %d slowest tests" % SLOWEST)
        for seconds, label in sorted(tally.durations, reverse=True)[:SLOWEST]:
            print("%7.1f s  %s" % (seconds, label))
        per_file = {}
        for seconds, label in tally.durations:
            per_file[label.split("::")[0]] = per_file.get(label.split("::")[0], 0.0) + seconds
        banner("the %d slowest test files (their tests' time, summed over workers)" % SLOWEST)
        for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:SLOWEST]:
            print("%7.1f s  %s" % (seconds, path))
        # every test's time, slowest first, for a closer look than the two lists above
        os.makedirs(os.path.join(REPO, ".cache"), exist_ok=True)
        with open(os.path.join(REPO, ".cache", "test-durations.txt"), "w") as handle:
            for seconds, label in sorted(tally.durations, reverse=True):
                handle.write("%.1f\t%s\n" % (seconds, label))
        print("every test's time: .cache/test-durations.txt")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=STAGES + EXTRA_STAGES, action="append")
    parser.add_argument("--timing-repeat", type=int, default=int(os.environ.get("GPUOPS_TIMING_REPEAT", "1")),
                        help="runs of each test marked timing (default GPUOPS_TIMING_REPEAT, else 1)")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("GPUOPS_TEST_WORKERS", str(WORKERS))),
                        help="pytest-xdist workers for the lab and integration stages, one test file each at a time "
                             "(default GPUOPS_TEST_WORKERS, else %d; 1: one process)" % WORKERS)
    parser.add_argument("--tally-json", help=argparse.SUPPRESS)   # a second process's result, for start_beside
    args = parser.parse_args()
    if args.timing_repeat < 1:
        parser.error("--timing-repeat must be at least 1")
    stages = args.only or STAGES
    tally = Tally()
    start = time.monotonic()
    if args.tally_json is None:
        compile_sources()
    beside = None
    here = [stage for stage in stages if stage not in BESIDE]
    if args.tally_json is None and here and [stage for stage in stages if stage in BESIDE]:
        beside = start_beside([stage for stage in stages if stage in BESIDE])
    else:
        here = stages
    if args.tally_json is not None:
        BESIDE_PROCESS["idle"] = True
    if "unit" in here:   # first: its tests wait on processes and clocks, at normal priority
        timed(tally, "unit", run_pytest, "unit", ["tests/unit"])
    if "sanity" in here:
        timed(tally, "sanity", run_sanity)
    if "pylint-tests" in here:
        timed(tally, "pylint-tests", run_sanity, "pylint-tests")
    if "lint" in here:
        timed(tally, "lint", run_lint)
    repeat = {"GPUOPS_TIMING_REPEAT": str(args.timing_repeat)}
    # files in collection order (the slow ones first, tests/integration/conftest.py), not by test count
    parallel = (["-n", str(args.workers), "--dist", "loadfile", "--no-loadscope-reorder"]
                if args.workers > 1 else [])
    lab_broken = False
    if "lab" in here:
        started = time.monotonic()
        lab_broken = run_pytest(tally, "lab", [LAB_TESTS], parallel, repeat) > 0
        tally.times.append(("lab", time.monotonic() - started))
    if "integration" in here:
        if lab_broken:
            banner("pytest integration")
            print("not run: the lab's self-tests failed (make test-lab); fix the lab first", flush=True)
            tally.add(0, 1, failures=["integration: not run, the lab is broken"])
        else:
            timed(tally, "integration", run_pytest, "integration", ["tests/integration"],
                  ["--ignore-glob", os.path.join(REPO, LAB_TESTS)] + parallel, repeat)
    if beside is not None:
        join_beside(tally, beside)
    if args.tally_json:
        with open(args.tally_json, "w") as handle:
            json.dump({"passed": tally.passed, "failed": tally.failed, "skipped": tally.skipped,
                       "failures": tally.failures, "times": tally.times, "durations": tally.durations,
                       "passed_ids": sorted(tally.passed_ids), "prefixes": sorted(tally.prefixes),
                       "failed_prefixes": sorted(p for p in tally.failed_prefixes if p)}, handle)
        return
    if set(stages) >= set(("unit", "lab", "integration")):
        check_reliability(tally)
    print_slowest(tally)
    elapsed = time.monotonic() - start
    banner("summary")
    for stage, seconds in tally.times:
        print("time %-12s %6.0f s" % (stage, seconds))
    for label in tally.failures:
        print("FAILED " + label)
    line = "%d passed, %d failed" % (tally.passed, tally.failed)
    if tally.skipped:
        line += ", %d skipped" % tally.skipped
    print("%s in %.0fs" % (line, elapsed))
    print(line)
    ok = tally.failed == 0 and tally.passed > 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
