"""Run the tests that depend on ansible-core's version against each supported ansible-core (issue 22).

    .venv/bin/python tests/tools/matrix.py [--versions 2.16 2.17 2.18 2.19]

For each version: a venv (.cache/matrix/VERSION) with that ansible-core, the targets' and the controller's
packages and pytest, the collection linked into it; then the unit tests, the pct connection's integration tests
(tests/integration/test_connection_pct.py, its own lab), the role's (tests/integration/test_role_release_gpus.py,
its own lab: the role's templating differs between versions), and the sanity tests that depend on core's version
(validate-modules, import). Prints one table; exits 0 only when every cell passed. `make test-matrix` runs it;
`.ci/run` calls it after `make test`. The versions here are the range meta/runtime.yml and the README state.
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
VERSIONS = ("2.16", "2.17", "2.18", "2.19")
DEV_PACKAGES = ("pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6", "voluptuous", "pyyaml")
CELLS = ("unit", "connection", "role", "sanity")


def run(cmd, env=None, cwd=REPO, timeout=1800):
    """(ok, seconds, last lines of output)."""
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=timeout, check=False)
    return proc.returncode == 0, time.monotonic() - started, proc.stdout[-4000:]


def venv_for(version):
    """A venv with ansible-core VERSION.* and the collection linked in; built once, reused while its stamp holds."""
    root = os.path.join(REPO, ".cache", "matrix", version)
    python = os.path.join(root, "bin", "python")
    stamp = os.path.join(root, ".stamp")
    wanted = "ansible-core==%s.*" % version
    if not (os.path.exists(stamp) and open(stamp).read() == wanted):
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", root], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wanted,
                        "-r", os.path.join(REPO, "requirements-controller.txt"),
                        "-r", os.path.join(REPO, "requirements-target.txt")] + list(DEV_PACKAGES), check=True)
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


def sanity(root, env):
    """validate-modules and import on a copy of the tracked files (ansible-test wants a collection tree)."""
    # ansible-test bootstraps pip in its venvs with a script this machine cannot download: 2.16 and 2.17 ask for
    # pip 23.1.2's, 2.18 and 2.19 for 24.2's; run_all's stand-in installs that pip from the package index
    for pip_version in ("23.1.2", "24.2"):
        run_all.install_get_pip_standin(pip_version)
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
        return run([os.path.join(root, "bin", "ansible-test"), "sanity", "--python", "3.11", "--requirements",
                    "--color", "no", "--test", "validate-modules", "--test", "import"], env=env, cwd=coll)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(VERSIONS))
    parser.add_argument("--only", choices=CELLS, action="append", help="run only these cells (default: all)")
    args = parser.parse_args()
    cells = args.only or list(CELLS)
    rows, failures = [], []
    started = time.monotonic()
    for version in args.versions:
        root = venv_for(version)
        env = dict(os.environ, PATH=os.path.join(root, "bin") + os.pathsep + os.environ.get("PATH", ""),
                   GPUOPS_TIMING_REPEAT="1", PCT_TEST_LAB_ID="mx%s" % version.replace(".", ""))
        env.pop("PYTHONPATH", None)
        python = os.path.join(root, "bin", "python")
        row = {"version": core_version(root)}
        pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
        for cell in cells:
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
        rows.append(row)
    print("\n| ansible-core | " + " | ".join(cells) + " |")
    print("|---|" + "---|" * len(cells))
    for row in rows:
        print("| %s | %s |" % (row["version"], " | ".join("%s (%.0f s)" % ("pass" if row[c][0] else "FAIL", row[c][1])
                                                          for c in cells)))
    for text in failures:
        print("\n==== FAILED " + text)
    passed = sum(1 for r in rows for c in cells if r[c][0])
    print("\nmatrix: %d of %d cells passed in %.0f s" % (passed, len(rows) * len(cells), time.monotonic() - started))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
