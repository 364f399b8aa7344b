#!/usr/bin/env bash
# gpu_status / gpu_release on two real GPUs (issue 9, "Real GPUs"), for docs/gpu-results.md.
#
# Here (with network), once:   bash tests/bench/device/multi_gpu_modules.sh --prepare
#   downloads ansible-core 2.19 and its missing needs as cp312 wheels into .cache/mgpu-wheels and
#   exports HEAD's collection into .cache/mgpu-head (the pre-change baseline); both are git-ignored.
# On the GPU machine (root, repository root; device tool: kind nvidia-h200-x2,
#   carry [".cache/mgpu-wheels", ".cache/mgpu-head"]):
#   bash tests/bench/device/multi_gpu_modules.sh [--baseline] [more multi_gpu_modules.py options]
#   --baseline: run the modules from HEAD's export first (it also does the real gpu_release) and
#   from this working tree for gpu_status and check mode.
# Writes under $OUT: env.txt, nvidia-smi.txt, mgpu.log, mgpu.json, mgpu.md.
# Never resets a GPU or changes a setting; signals only its own processes (match: gpuops_mgpu_workload).
# Three rounds of fresh holders (round 3: none on both GPUs, default collateral); see the .py's docstring.
# GPU time: about 1-2 minutes, capped by MGPU_DEADLINE (240 s).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
WHEELS=.cache/mgpu-wheels
HEAD_COPY=.cache/mgpu-head
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUNBUFFERED=1

if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$WHEELS" && rm -f "$WHEELS"/*.whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$WHEELS" \
        'ansible-core>=2.19,<2.20' 'resolvelib>=0.5.3,<2' cryptography cffi pycparser || exit 2
    rm -rf "$HEAD_COPY" && mkdir -p "$HEAD_COPY"
    git archive HEAD galaxy.yml meta plugins | tar -x -C "$HEAD_COPY" || exit 2
    echo "HEAD $(git rev-parse --short HEAD)" > "$HEAD_COPY/REVISION"
    ls -la "$WHEELS"; du -sh "$WHEELS" "$HEAD_COPY"
    exit 0
fi

OUT=${OUT:-$PWD/.cache/mgpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
extra=()
if [ "${1:-}" = "--baseline" ]; then
    shift
    [ -d "$HEAD_COPY/plugins" ] || { echo "no $HEAD_COPY: run --prepare here and carry it" >&2; exit 2; }
    extra=(--collection "head=$HEAD_COPY" --collection "tree=$PWD")
fi
if ! "$PY" -c 'import ansible' 2>/dev/null || ! command -v ansible-playbook >/dev/null; then
    ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no ansible-core and no wheels in $WHEELS (carry it)" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mgpu-site \
        "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/mgpu-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/mgpu-site/bin:$PATH
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "uname: $(uname -a)"
    echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)"
    echo "ansible: $(ansible-playbook --version 2>&1 | head -1)"
    echo "packages: $("$PY" -c 'import importlib.metadata as m
def v(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return "missing"
print(" ".join("%s %s" % (n, v(n)) for n in ("torch", "nvidia-ml-py", "psutil", "jinja2", "pyyaml")))' 2>&1 | tail -1)"
    echo "unshare: $(unshare --version 2>&1 | head -1)"
    echo "head: $(cat "$HEAD_COPY/REVISION" 2>/dev/null)"
    echo "cpus: $(nproc)"
} > "$OUT/env.txt"
cat "$OUT/env.txt"
smi() { timeout 30 nvidia-smi "$@" 2>&1 || true; }
{ smi; smi topo -m; } > "$OUT/nvidia-smi.txt"

# SIGTERM from timeout makes the script stop its holders and write what it has; -k is the last resort
# (the holders then end by their lifeline).
timeout -k 15 "$(( ${MGPU_DEADLINE:-240} + 20 ))" "$PY" tests/bench/multi_gpu_modules.py --out "$OUT" \
    --deadline "${MGPU_DEADLINE:-240}" "${extra[@]}" "$@" 2>&1 | tee "$OUT/mgpu.log"
rc=${PIPESTATUS[0]}
{ echo; echo "after:"; smi --query-compute-apps=pid,process_name,used_memory --format=csv
  smi --query-gpu=index,memory.used --format=csv; } >> "$OUT/nvidia-smi.txt"
echo "multi_gpu_modules exit $rc; results in $OUT"
exit "$rc"
