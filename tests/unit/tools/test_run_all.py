"""make test's second process (tests/tools/run_all.py): unit tests first, then sanity and lint at idle priority."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(REPO, "tests", "tools"))

import run_all  # noqa: E402  pylint: disable=wrong-import-position

POLICY = [sys.executable, "-c", "import os, subprocess, sys; print(os.sched_getscheduler(0)); sys.stdout.flush(); "
          "subprocess.run([sys.executable, '-c', 'import os; print(os.sched_getscheduler(0))'])"]


def policies(preexec_fn):
    """Scheduling policy of a program and of its child, started as run_all starts a stage's program."""
    out = subprocess.run(POLICY, preexec_fn=preexec_fn, capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]


def test_the_beside_process_runs_unit_first_and_sanity_and_lint_at_idle_priority(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(run_all, "BESIDE_PROCESS", {"idle": False})
    monkeypatch.setattr(run_all, "timed", lambda tally, stage, *args: ran.append((stage, run_all.idle_if_beside())))
    result = tmp_path / "tally.json"
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--tally-json", str(result), "--only", "sanity", "--only", "lint",
                                      "--only", "unit"])
    run_all.main()
    assert [stage for stage, dummy in ran] == ["unit", "sanity", "lint"]
    assert all(preexec is run_all.idle_priority for dummy, preexec in ran)
    assert json.loads(result.read_text())["failed"] == 0
    assert policies(run_all.idle_priority) == [os.SCHED_IDLE, os.SCHED_IDLE]   # children inherit it


def test_stages_run_alone_keep_the_normal_priority(monkeypatch):
    monkeypatch.setattr(run_all, "BESIDE_PROCESS", {"idle": False})
    assert run_all.idle_if_beside() is None
    assert policies(run_all.idle_if_beside()) == [os.SCHED_OTHER, os.SCHED_OTHER]
