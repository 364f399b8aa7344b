"""Run every benchmark in tests/bench/ and write docs/benchmarks.md.

Each tests/bench/bench_*.py prints a Markdown fragment on stdout. All of them run in
this one invocation, so the ratios they quote compare figures taken on the same
machine at the same time.
"""
import datetime
import glob
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "docs", "benchmarks.md")


def cpu_model():
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def mem_gib():
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def main():
    scripts = sorted(glob.glob(os.path.join(REPO, "tests", "bench", "bench_*.py")))
    only = sys.argv[1:]
    if only:
        scripts = [s for s in scripts if any(name in os.path.basename(s) for name in only)]
    env = dict(os.environ, PATH=os.path.join(REPO, ".venv", "bin") + os.pathsep + os.environ.get("PATH", ""))
    sections = []
    failed = []
    for script in scripts:
        name = os.path.basename(script)
        print("running %s" % name, flush=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, script], cwd=REPO, env=env, stdout=subprocess.PIPE, check=False, text=True)
        took = time.monotonic() - start
        if proc.returncode != 0:
            failed.append(name)
            sections.append("## %s\n\nFAILED (exit %d after %.0f s); partial output:\n\n```\n%s\n```\n" % (name, proc.returncode, took, proc.stdout[-3000:]))
        else:
            sections.append(proc.stdout.strip() + "\n\n_%s ran in %.0f s._\n" % (name, took))
    header = [
        "# Benchmarks",
        "",
        "Written by `make bench` on %s UTC." % datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "",
        "Machine: %s, %d cores, %.0f GiB, Linux %s, Python %s." % (cpu_model(), os.cpu_count(), mem_gib(), platform.release(), platform.python_version()),
        "Every figure below was measured in this one run; these machines are noisy, so each quotes medians"
        " and ratios against the anchor measured beside it, not absolute times.",
        "Real-GPU figures live in `docs/gpu-results.md`, which `make bench` does not overwrite.",
        "",
    ]
    with open(OUT, "w") as handle:
        handle.write("\n".join(header) + "\n" + "\n".join(sections))
    print("wrote %s" % OUT)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
