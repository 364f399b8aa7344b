#!/usr/bin/env bash
# gpu_status / gpu_release on the real GPU (issues 3 and 4), for docs/gpu-results.md and docs/fidelity.md.
# Run from the repository root on the GPU machine, with ansible-core importable (PYTHONPATH) and
# ansible-playbook on PATH. Signals only this script's own cuda_workload.py processes (match).
set -uo pipefail
OUT=${OUT:-$PWD/.cache/h200}
GIB=${GPU_RELEASE_GIB:-120}
mkdir -p "$OUT"
export LC_ALL=C.UTF-8 LANG=C.UTF-8
timeout -k 20 400 python3 tests/bench/bench_release.py --cuda --gib "$GIB" 2>&1 | tee "$OUT/modules.md"
exit "${PIPESTATUS[0]}"
