"""Run every test stage of gpuops.fleet and end with one pytest-style summary line.

Stages: sanity (ansible-test on a copy of the tracked files), unit (pytest),
lint (ansible-lint, production profile), integration (pytest against the lab).
"""
import argparse
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
STAGES = ("sanity", "unit", "lint", "integration")
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

    def add(self, passed, failed, skipped=0, failures=()):
        self.passed += passed
        self.failed += failed
        self.skipped += skipped
        self.failures.extend(failures)


def banner(text):
    print("\n" + "=" * 20 + " " + text + " " + "=" * 20, flush=True)


def tracked_files():
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.decode()
    return [p for p in out.split("\0") if p and os.path.lexists(os.path.join(REPO, p))]


def install_get_pip_standin(pip_version="24.2"):
    cache = os.path.expanduser("~/.ansible/test/cache")
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, "get_pip_%s.py" % pip_version.replace(".", "_"))
    with open(path, "w") as handle:
        handle.write(GET_PIP_STANDIN % pip_version)


def run_sanity(tally):
    banner("ansible-test sanity")
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
        cmd = [os.path.join(VENV_BIN, "ansible-test"), "sanity", "--python", "3.11",
               "--requirements", "--color", "no"] + list(SANITY_SKIPS)
        env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
        proc = subprocess.run(cmd, cwd=coll, env=env, stdout=subprocess.PIPE, check=False,
                              stderr=subprocess.STDOUT, text=True)
        print(proc.stdout[-20000:], flush=True)
        ran = re.findall(r"Running sanity test [\"']([^\"']+)[\"']", proc.stdout)
        failed = set()
        listing = re.search(r"FATAL: The \d+ sanity test\(s\) listed below.*?\n((?:[\w.-]+\n)+)", proc.stdout)
        if listing:
            failed = set(listing.group(1).split())
        if proc.returncode != 0 and not failed:
            failed = {"sanity"}
        tally.add(len([t for t in ran if t not in failed]) or (0 if proc.returncode else 1),
                  len(failed), failures=["sanity:" + name for name in sorted(failed)])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_pytest(tally, name, paths, extra=()):
    banner("pytest " + name)
    xml = os.path.join(tempfile.gettempdir(), "gpuops-%s-%d.xml" % (name, os.getpid()))
    # No PYTHONPATH: the venv already sees ansible_collections, and a PYTHONPATH would leak
    # into lab containers through pct exec (which keeps the environment).
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONPATH", None)
    cmd = [os.path.join(VENV_BIN, "python"), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           "--junitxml", xml] + list(extra) + list(paths)
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    passed = failed = skipped = 0
    failures = []
    if os.path.exists(xml):
        root = ET.parse(xml).getroot()
        for case in root.iter("testcase"):
            label = "%s::%s" % (case.get("classname"), case.get("name"))
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                failures.append(label)
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
        os.unlink(xml)
    if proc.returncode not in (0, 5) and failed == 0:
        failed, failures = 1, [name + ": pytest exit %d" % proc.returncode]
    tally.add(passed, failed, skipped, failures)


def run_lint(tally):
    banner("ansible-lint (production profile)")
    targets = [p for p in ("roles", "playbooks") if os.listdir(os.path.join(REPO, p))]
    if not targets:
        print("ansible-lint: no roles or playbooks yet")
        return
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
               ANSIBLE_COLLECTIONS_PATH=os.path.join(REPO, ".venv", "lib", "python3.11", "site-packages"))
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-lint"), "--profile", "production",
                           "--offline"] + targets, cwd=REPO, env=env, check=False)
    if proc.returncode == 0:
        tally.add(1, 0)
    else:
        tally.add(0, 1, failures=["ansible-lint"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=STAGES, action="append")
    args = parser.parse_args()
    stages = args.only or STAGES
    tally = Tally()
    start = time.monotonic()
    if "sanity" in stages:
        run_sanity(tally)
    if "unit" in stages:
        run_pytest(tally, "unit", ["tests/unit"])
    if "lint" in stages:
        run_lint(tally)
    if "integration" in stages:
        run_pytest(tally, "integration", ["tests/integration"])
    elapsed = time.monotonic() - start
    banner("summary")
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
