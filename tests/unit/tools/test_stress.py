"""The timing repeat (tests/integration/conftest.py) and the stress report (tests/tools/stress.py)."""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tests", "tools"))

import stress  # noqa: E402  pylint: disable=wrong-import-position

TESTS = '''
import pytest

@pytest.mark.timing
@pytest.mark.parametrize("kind", ["a", "b"])
def test_timed(kind):
    with open(%(log)r, "a") as handle:
        handle.write(kind + "\\n")
    assert kind != %(fail)r

def test_plain():
    pass
'''


def run_suite(tmp_path, repeat, fail="none"):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(os.path.join(REPO, "tests", "integration", "conftest.py"), str(suite / "conftest.py"))
    log = tmp_path / "runs.log"
    (suite / "test_timed.py").write_text(TESTS % {"log": str(log), "fail": fail})
    xml = tmp_path / "junit.xml"
    env = dict(os.environ, GPUOPS_TIMING_REPEAT=str(repeat))
    # its own basetemp: a nested run would otherwise prune the outer run's /tmp/pytest-of-USER/pytest-N in use
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml),
                           "--basetemp", str(tmp_path / "basetemp"), "-m", "timing", str(suite)], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, check=False)
    return proc, (log.read_text().split() if log.exists() else []), str(xml)


def test_a_timing_test_runs_as_many_times_as_asked_and_others_once(tmp_path):
    proc, runs, xml = run_suite(tmp_path, 3)
    assert proc.returncode == 0, proc.stdout
    assert sorted(runs) == ["a"] * 3 + ["b"] * 3
    rows = stress.tally(xml)
    assert sorted((t.split("::")[1], r[0], r[1]) for t, r in rows.items()) == [
        ("test_timed[a]", 3, 3), ("test_timed[b]", 3, 3)]


def test_one_failing_round_shows_in_the_pass_rate(tmp_path):
    proc, runs, xml = run_suite(tmp_path, 2, fail="b")
    assert proc.returncode != 0 and len(runs) == 4
    rows = dict((t.split("::")[1], r[:2]) for t, r in stress.tally(xml).items())
    assert rows == {"test_timed[a]": [2, 2], "test_timed[b]": [2, 0]}


def test_a_bad_repeat_count_is_refused_naming_it(tmp_path):
    proc, runs, dummy = run_suite(tmp_path, 0)
    assert proc.returncode != 0 and runs == [] and "GPUOPS_TIMING_REPEAT must be a positive integer, got '0'" in proc.stdout


def test_base_id_drops_only_the_round():
    class Case(dict):
        pass
    for name, expected in (("test_x[t3]", "test_x"), ("test_x[shell_loop-t12]", "test_x[shell_loop]"),
                           ("test_x[t0-shell_loop]", "test_x[shell_loop]"), ("test_x[tea]", "test_x[tea]")):
        case = Case(classname="tests.integration.test_gpu_release", name=name)
        assert stress.base_id(case) == "tests/integration/test_gpu_release.py::" + expected
