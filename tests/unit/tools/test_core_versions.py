"""Issue 45: make test on the newest tested ansible-core (2.21) with a Python it supports, the matrix on 2.16 to 2.20,
each core on a Python of its own, and one tested range everywhere it is stated."""
import os
import re
import subprocess
import sys

import ansible
import yaml
from ansible_test._util.target.common.constants import CONTROLLER_PYTHON_VERSIONS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tests", "tools"))

import matrix  # noqa: E402  pylint: disable=wrong-import-position
import run_all  # noqa: E402  pylint: disable=wrong-import-position

PICK = os.path.join(REPO, "tests", "tools", "pick_python.sh")
RUNNING = "%d.%d" % sys.version_info[:2]
CORE = ".".join(ansible.__version__.split(".")[:2])


def pick_table():
    """{core: [Python X.Y, newest first]} from pick_python.sh's case statement."""
    with open(PICK) as handle:
        text = handle.read()
    table = {}
    for cores, versions in re.findall(r"^\s*([\d. |]+)\)\s*versions=\"([\d. ]+)\"", text, re.M):
        for core in cores.split("|"):
            table[core.strip()] = versions.split()
    return table


def dev_core():
    """The core make test runs on: requirements-dev.txt's ansible-core>=X.Y,<X.Y+1."""
    with open(os.path.join(REPO, "requirements-dev.txt")) as handle:
        found = re.findall(r"^ansible-core>=(\d+\.\d+),<(\d+\.\d+)\s*$", handle.read(), re.M)
    assert len(found) == 1, found
    return found[0][0]


def minor(version):
    return tuple(int(part) for part in version.split("."))


def run_pick(core, env, cwd=REPO, script=("bash", PICK)):
    return subprocess.run(list(script) + ([core] if core else []), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def bare_env(tmp_path, **extra):
    """PATH, pyenv root and system folders that hold no usable Python 3.10 to 3.14: only a pyenv-like shim of each,
    which fails as pyenv's does for a version that is not selected."""
    shims = tmp_path / "shims"
    shims.mkdir()
    for version in ("3.10", "3.11", "3.12", "3.13", "3.14"):
        shim = shims / ("python" + version)
        shim.write_text("#!/bin/sh\necho \"pyenv: python%s: command not found\" >&2\nexit 127\n" % version)
        shim.chmod(0o755)
    (tmp_path / "pyenv" / "versions").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    env = {"PATH": "%s:/bin" % shims, "HOME": str(tmp_path), "PYENV_ROOT": str(tmp_path / "pyenv"),
           "PICK_PYTHON_DIRS": str(tmp_path / "empty")}
    env.update(extra)
    return env


def test_make_venv_fails_with_one_line_naming_the_missing_python_when_none_is_supported(tmp_path):
    """No Python 3.12 to 3.14 on PATH, in pyenv or the system folders: make venv's script stops before it builds
    anything, with one line that names the versions, the core and where it looked."""
    env = bare_env(tmp_path)
    proc = run_pick("", env, script=("bash", os.path.join(REPO, "tests", "tools", "make_venv.sh"),
                                     str(tmp_path / "venv"), str(tmp_path / "wheels")))
    assert proc.returncode == 1, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "no Python 3.14, 3.13 or 3.12" in lines[0] and "ansible-core %s" % dev_core() in lines[0], lines
    assert str(tmp_path / "pyenv" / "versions") in lines[0] and "PY=" in lines[0], lines
    assert proc.stdout == "" and not (tmp_path / "venv").exists() and not (tmp_path / "wheels").exists()
    # a PY that names a Python the core does not support is refused the same way, in one line naming it
    proc = run_pick(dev_core(), dict(env, PY="/bin/sh"))
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr.strip().splitlines() == [
        "pick_python: PY=/bin/sh is not a working Python 3.14, 3.13, 3.12 (what ansible-core %s supports as a "
        "controller)" % dev_core()]


def test_pick_python_takes_the_newest_supported_build_behind_a_shim_that_does_not_run(tmp_path):
    """pyenv's shim of a version that is not selected fails; pick_python.sh takes pyenv's own build instead, the
    newest version the core supports first, and prints the interpreter's own path."""
    core = next(c for c, versions in sorted(pick_table().items(), key=lambda kv: minor(kv[0]), reverse=True)
                if RUNNING in versions)
    env = bare_env(tmp_path)
    build = tmp_path / "pyenv" / "versions" / (RUNNING + ".99") / "bin"
    build.mkdir(parents=True)
    (build / ("python" + RUNNING)).symlink_to(sys.executable)
    older = tmp_path / "pyenv" / "versions" / (RUNNING + ".1") / "bin"
    older.mkdir(parents=True)
    (older / ("python" + RUNNING)).symlink_to(sys.executable)
    proc = run_pick(core, env)
    assert proc.returncode == 0, proc
    assert proc.stdout.strip() == str(build / ("python" + RUNNING)), proc
    proc = run_pick("2.9", env)
    assert proc.returncode == 2 and "no controller Pythons known for ansible-core '2.9'" in proc.stderr, proc


def test_each_core_of_the_matrix_and_make_test_is_paired_with_a_python_it_supports():
    """pick_python.sh's table has every core that make test and the matrix run, newest Python first; the row of the
    core running this test is ansible-test's own CONTROLLER_PYTHON_VERSIONS, and this Python is in it (the
    matrix runs this test on each core, so each row is checked against its core). matrix.py's pick for this core
    is one of them, and it names the interpreter."""
    table = pick_table()
    for core in list(matrix.VERSIONS) + [dev_core()]:
        assert core in table, (core, table)
        assert table[core] == sorted(table[core], key=minor, reverse=True), table[core]
    assert sorted(table[CORE], key=minor) == sorted(CONTROLLER_PYTHON_VERSIONS, key=minor), (CORE, table[CORE])
    assert RUNNING in table[CORE]
    picked = matrix.python_for(CORE)
    assert os.path.isabs(picked) and matrix.python_version(picked) in table[CORE], picked
    # ansible-core 2.20 and 2.21 need Python 3.12 or newer, 2.18 and 2.19 3.11, 2.16 and 2.17 3.10 (PyPI's
    # Requires-Python and ansible-test's controller list agree)
    assert min(table["2.21"], key=minor) == min(table["2.20"], key=minor) == "3.12"
    assert min(table["2.16"], key=minor) == "3.10" and min(table["2.18"], key=minor) == "3.11"


def test_the_tested_range_is_the_same_in_runtime_yml_the_readme_the_matrix_and_make_test():
    """The matrix runs 2.16 up to the core before make test's (no gap), make test the newest (2.21);
    requires_ansible admits all of them with no upper cap below that core, and the README and the contributor's
    guide state that range."""
    from packaging.specifiers import SpecifierSet
    versions = list(matrix.VERSIONS)
    newest = dev_core()
    tested = versions + [newest]
    assert [minor(v) for v in tested] == [(2, minor(versions[0])[1] + n) for n in range(len(tested))], tested
    assert (versions[0], newest) == ("2.16", "2.21")
    with open(os.path.join(REPO, "meta", "runtime.yml")) as handle:
        spec = SpecifierSet(yaml.safe_load(handle)["requires_ansible"])
    assert all(spec.contains(v + ".0") for v in tested), spec
    assert spec.contains(newest + ".99") and not spec.contains("2.15.99"), spec
    with open(os.path.join(REPO, "README.md")) as handle:
        readme = handle.read()
    assert "**ansible-core %s to %s**" % (versions[0], newest) in readme
    assert "`make test` runs everything on %s" % newest in readme
    assert "on %s to %s" % (versions[0], versions[-1]) in readme
    with open(os.path.join(REPO, "docs", "docsite", "rst", "contributing.rst")) as handle:
        guide = " ".join(handle.read().split())
    assert "ansible-core %s to %s" % (versions[0], versions[-1]) in guide
    with open(os.path.join(REPO, ".ci", "run")) as handle:
        ci = handle.read()
    # every version and every cell of the matrix (no MATRIX_VERSIONS, no MATRIX_SANITY_ON): within its 45 minutes
    assert "\nexec make test-matrix\n" in ci and "MATRIX_VERSIONS" not in ci, ci
    assert "MATRIX_SANITY_ON=%s" % versions[-1] in guide   # the way out, should it take longer


def test_sanity_runs_on_the_venvs_own_python_in_make_test_and_in_the_matrix(monkeypatch, tmp_path):
    """ansible-test sanity gets --python X.Y of the venv it runs from (make test: .venv; the matrix: each core's
    venv), not a fixed 3.11; and the get-pip stand-in is written for the pip version that venv's ansible-test asks."""
    own = matrix.python_version(sys.executable)
    assert own == RUNNING
    make_test_python = run_all.venv_python_version()
    pips = run_all.install_get_pip_standin(sys.executable)
    assert pips and all(os.path.exists(os.path.expanduser("~/.ansible/test/cache/get_pip_%s.py" % v.replace(".", "_")))
                        for v in pips), pips
    commands = []

    class Done:   # what subprocess.run gives back, for the sanity program only
        returncode, stdout = 0, "Running sanity test 'import'\n"

    real_run = subprocess.run

    def record(cmd, *args, **kwargs):
        if os.path.basename(cmd[0]) == "ansible-test":
            commands.append(cmd)
            return Done()
        # the caller's own check, passed on
        return real_run(cmd, *args, **kwargs)  # pylint: disable=subprocess-run-check
    monkeypatch.setattr(run_all.subprocess, "run", record)
    run_all.sanity_run(run_all.Tally(), str(tmp_path), "", ["--test", "import"])
    ok, dummy, dummy = matrix.sanity(os.path.dirname(os.path.dirname(sys.executable)), dict(os.environ))
    assert ok and len(commands) == 2, commands
    assert commands[0][commands[0].index("--python") + 1] == make_test_python
    assert commands[1][commands[1].index("--python") + 1] == own


def test_the_matrix_names_each_cores_python_and_runs_sanity_only_where_asked(monkeypatch, capsys, tmp_path):
    """Each version's first line names its Python and interpreter, and the table has a Python column; with
    --sanity-on (.ci/run: 2.20), the other versions' sanity cells say `not run` and count neither way."""
    sanity_ran, pytest_ran = [], []
    monkeypatch.setattr(matrix, "venv_for", lambda version: str(tmp_path / version))
    monkeypatch.setattr(matrix, "core_version", lambda root: os.path.basename(root) + ".7")
    monkeypatch.setattr(matrix, "python_for", lambda version: "/opt/python-for-" + version)
    monkeypatch.setattr(matrix, "python_version", lambda python: {"2.16": "3.12", "2.20": "3.13"}[python.split(os.sep)[-3]])
    monkeypatch.setattr(matrix, "run", lambda cmd, env=None: pytest_ran.append((env["PATH"], cmd[-1])) or (True, 1.0, ""))
    monkeypatch.setattr(matrix, "sanity", lambda root, env: sanity_ran.append(root) or (True, 2.0, ""))
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--versions", "2.16", "2.20", "--sanity-on", "2.20"])
    try:
        matrix.main()
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert sanity_ran == [str(tmp_path / "2.20")], sanity_ran
    cells = ["tests/unit", "tests/integration/test_connection_pct.py", "tests/integration/test_role_release_gpus.py"]
    assert [cmd for dummy, cmd in pytest_ran] == cells * 2
    assert pytest_ran[0][0].startswith(os.path.join(str(tmp_path / "2.16"), "bin") + os.pathsep)
    assert "ansible-core 2.16.7 on Python 3.12 (/opt/python-for-2.16;" in out
    assert "ansible-core 2.20.7 on Python 3.13 (/opt/python-for-2.20;" in out
    assert "ansible-core 2.16.7 sanity     not run (--sanity-on 2.20)" in out
    assert "| ansible-core | Python | unit | connection | role | sanity |" in out
    assert "| 2.16.7 | 3.12 | pass (1 s) | pass (1 s) | pass (1 s) | not run |" in out
    assert "| 2.20.7 | 3.13 | pass (1 s) | pass (1 s) | pass (1 s) | pass (2 s) |" in out
    assert "matrix: 7 of 7 cells passed" in out
