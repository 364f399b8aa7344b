"""Run the tests that depend on ansible-core's version against each older supported ansible-core (issues 22, 45).

    .venv/bin/python tests/tools/matrix.py [--versions 2.16 2.17 2.18 2.19 2.20] [--only unit ...]

For each version: a venv (.cache/matrix/VERSION) on the newest Python that core supports as a controller, found
here (tests/tools/pick_python.sh: 3.12 for 2.16 and 2.17, 3.13 from 2.18 on this machine; named in the output), with
that ansible-core, the targets' and the controller's packages and pytest, the collection linked into it; then the
unit tests, the pct connection's integration tests (tests/integration/test_connection_pct.py, its own lab), the
role's (tests/integration/test_role_release_gpus.py, its own lab: the role's templating differs between versions),
and the sanity tests that depend on core's version (validate-modules, import) on that venv's Python. Prints one
table; exits 0 only when every cell passed. `make test-matrix` runs it; `.ci/run` calls it after `make test`, which
runs everything on the newest tested core (requirements-dev.txt, 2.21). VERSIONS and that core are the range
meta/runtime.yml and the README state (tests/unit/tools/test_matrix.py).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import run_all

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERSIONS = ("2.16", "2.17", "2.18", "2.19", "2.20")
PICK_PYTHON = os.path.join(REPO, "tests", "tools", "pick_python.sh")
DEV_PACKAGES = ("pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6", "voluptuous", "pyyaml",
                "pylint==4.0.5")   # the size checks of tests/unit/packaging/test_size_limits.py run pylint
CELLS = ("unit", "connection", "role", "sanity")


def run(cmd, env=None, cwd=REPO, timeout=1800):
    """(ok, seconds, last lines of output)."""
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=timeout, check=False)
    return proc.returncode == 0, time.monotonic() - started, proc.stdout[-4000:]


def python_for(version):
    """The newest Python here that ansible-core VERSION supports as its controller (tests/tools/pick_python.sh),
    or SystemExit with its one line naming what is missing."""
    proc = subprocess.run(["bash", PICK_PYTHON, version], stdout=subprocess.PIPE, universal_newlines=True,
                          check=False, env={k: v for k, v in os.environ.items() if k != "PY"})
    if proc.returncode:
        raise SystemExit("matrix: ansible-core %s has no Python here (pick_python.sh says why, above)" % version)
    return proc.stdout.strip()


def venv_for(version):
    """A venv with ansible-core VERSION.* on python_for(VERSION) and the collection linked in; built once, reused
    while its stamp (the core and the interpreter) holds."""
    root = os.path.join(REPO, ".cache", "matrix", version)
    python = os.path.join(root, "bin", "python")
    stamp = os.path.join(root, ".stamp")
    interpreter = python_for(version)
    core = "ansible-core==%s.*" % version
    wanted = "%s on %s with %s" % (core, interpreter, " ".join(DEV_PACKAGES))   # a new package builds it again
    if not (os.path.exists(stamp) and open(stamp).read() == wanted):
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([interpreter, "-m", "venv", root], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", core,
                        "-r", os.path.join(REPO, "requirements-controller.txt"),
                        "-r", os.path.join(REPO, "requirements-target.txt")] + list(DEV_PACKAGES), check=True)
        supported = controller_pythons(python)
        if python_version(python) not in supported:
            raise SystemExit("matrix: ansible-core %s's ansible-test supports %s as a controller, not %s's Python %s"
                             " (tests/tools/pick_python.sh's table is wrong)"
                             % (version, ", ".join(supported), interpreter, python_version(python)))
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()
        link = os.path.join(site, "ansible_collections", "gpuops", "fleet")
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link):
            os.symlink(REPO, link)
        with open(stamp, "w") as handle:
            handle.write(wanted)
    return root


def core_version(root):
    return subprocess.run([os.path.join(root, "bin", "python"), "-c", "import ansible; print(ansible.__version__)"],
                          check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout.strip()


def python_version(python):
    return run_all.venv_python_version(python)


def controller_pythons(python):
    """ansible-test's CONTROLLER_PYTHON_VERSIONS in the venv of PYTHON."""
    return subprocess.run([python, "-c", "from ansible_test._util.target.common.constants import "
                           "CONTROLLER_PYTHON_VERSIONS as v; print(' '.join(v))"],
                          check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout.split()


def sanity(root, env):
    """validate-modules and import on a copy of the tracked files (ansible-test wants a collection tree)."""
    # ansible-test bootstraps pip in its venvs with a script this machine cannot download: 2.16 and 2.17 ask for
    # pip 23.1.2's, 2.18 and 2.19 for 24.2's, 2.20 for 25.2's; run_all's stand-in installs that pip from the index
    python = os.path.join(root, "bin", "python")
    run_all.install_get_pip_standin(python)
    work = tempfile.mkdtemp(prefix="gpuops-matrix-")
    try:
        coll = os.path.join(work, "ansible_collections", "gpuops", "fleet")
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                               check=True, stdout=subprocess.PIPE).stdout.decode().split("\0")
        for rel in (f for f in files if f and os.path.lexists(os.path.join(REPO, f))):
            os.makedirs(os.path.dirname(os.path.join(coll, rel)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, rel), os.path.join(coll, rel), follow_symlinks=False)
        git = ["git", "-c", "user.name=matrix", "-c", "user.email=matrix@localhost"]
        subprocess.run(git + ["init", "-q"], cwd=coll, check=True)
        subprocess.run(git + ["add", "-A"], cwd=coll, check=True)
        subprocess.run(git + ["commit", "-q", "-m", "matrix"], cwd=coll, check=True)
        return run([os.path.join(root, "bin", "ansible-test"), "sanity", "--python", python_version(python), "--requirements",
                    "--color", "no", "--test", "validate-modules", "--test", "import"], env=env, cwd=coll)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--only", choices=CELLS, action="append", help="run only these cells (default: all)")
    parser.add_argument("--sanity-on", nargs="+", metavar="VERSION",
                        help="run the sanity cell on these versions only (default: every version; the way for "
                             ".ci/run to stay within 45 minutes, should it outgrow them)")
    args = parser.parse_args()
    cells = args.only or list(CELLS)
    rows, failures = [], []
    started = time.monotonic()
    for version in args.versions:
        began = time.monotonic()
        root = venv_for(version)
        built = time.monotonic() - began
        env = dict(os.environ, PATH=os.path.join(root, "bin") + os.pathsep + os.environ.get("PATH", ""),
                   GPUOPS_TIMING_REPEAT="1", PCT_TEST_LAB_ID="mx%s" % version.replace(".", ""))
        env.pop("PYTHONPATH", None)
        python = os.path.join(root, "bin", "python")
        row = {"version": core_version(root), "python": python_version(python), "began": began}
        print("ansible-core %s on Python %s (%s; its venv ready in %.0f s)"
              % (row["version"], row["python"], python_for(version), built), flush=True)
        pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
        for cell in cells:
            if cell == "sanity" and args.sanity_on is not None and version not in args.sanity_on:
                row[cell] = None
                print("ansible-core %s %-10s not run (--sanity-on %s)" % (row["version"], cell, " ".join(args.sanity_on)),
                      flush=True)
                continue
            if cell == "unit":
                result = run(pytest + ["-n", "2", "tests/unit"], env=env)
            elif cell == "connection":
                result = run(pytest + ["tests/integration/test_connection_pct.py"], env=env)
            elif cell == "role":
                result = run(pytest + ["tests/integration/test_role_release_gpus.py"], env=env)
            else:
                result = sanity(root, env)
            row[cell] = result
            if not result[0]:
                failures.append("%s %s:\n%s" % (row["version"], cell, result[2]))
            verdict = "passed" if result[0] else "FAILED"
            print("ansible-core %s %-10s %s in %.0f s" % (row["version"], cell, verdict, result[1]), flush=True)
        row["total"] = time.monotonic() - row["began"]
        rows.append(row)
    print("\n| ansible-core | Python | " + " | ".join(cells) + " | total, venv included |")
    print("|---|---|" + "---|" * len(cells) + "---|")
    for row in rows:
        print("| %s | %s | %s | %.0f s |" % (row["version"], row["python"], " | ".join(
            "not run" if row[c] is None else "%s (%.0f s)" % ("pass" if row[c][0] else "FAIL", row[c][1]) for c in cells),
            row["total"]))
    for text in failures:
        print("\n==== FAILED " + text)
    passed = sum(1 for r in rows for c in cells if r[c] is not None and r[c][0])
    ran = sum(1 for r in rows for c in cells if r[c] is not None)
    print("\nmatrix: %d of %d cells passed in %.0f s" % (passed, ran, time.monotonic() - started))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
