"""Run every `timing` test of the integration suite N times in a row; print each test's pass rate and slowest run.

    .venv/bin/python tests/tools/stress.py [--rounds 20] [-k EXPR]

Exit 0 only when every test passed every round. `make test-stress` runs it with 20 rounds.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.join(REPO, ".venv", "bin")
ROUND = re.compile(r"(?:(?<=\[)t\d+-|-t\d+(?=\])|\[t\d+\])")


def base_id(case):
    """tests/x.py::test_name[params] without the round (t0, t1, ...)."""
    path = (case.get("classname") or "").replace(".", "/") + ".py"
    return "%s::%s" % (path, ROUND.sub("", case.get("name") or ""))


def tally(xml_path):
    """{test id: [runs, passed, slowest seconds]} from a junit file."""
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        row = out.setdefault(base_id(case), [0, 0, 0.0])
        row[0] += 1
        if case.find("failure") is None and case.find("error") is None and case.find("skipped") is None:
            row[1] += 1
        row[2] = max(row[2], float(case.get("time") or 0))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to stress a subset")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    xml = os.path.join(tempfile.gettempdir(), "gpuops-stress-%d.xml" % os.getpid())
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
               GPUOPS_TIMING_REPEAT=str(args.rounds))
    env.pop("PYTHONPATH", None)
    cmd = [os.path.join(VENV_BIN, "python"), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "timing",
           "--junitxml", xml] + (["-k", args.keyword] if args.keyword else []) + ["tests/integration"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, check=False)
    rows = tally(xml) if os.path.exists(xml) else {}
    if os.path.exists(xml):
        os.unlink(xml)
    print("\n| test | passed | slowest run |\n|---|---|---|")
    for test_id, (runs, passed, slowest) in sorted(rows.items()):
        print("| `%s` | %d/%d | %.1f s |" % (test_id, passed, runs, slowest))
    bad = [t for t, (runs, passed, dummy) in rows.items() if passed != runs or runs < args.rounds]
    print("%d timing tests, %d passed every one of %d rounds" % (len(rows), len(rows) - len(bad), args.rounds))
    sys.exit(0 if rows and not bad and proc.returncode == 0 else 1)


if __name__ == "__main__":
    main()
