#!/usr/bin/env bash
# GPU_FACTS.md rows 1-21 on the real NVIDIA GPUs, for docs/fidelity.md (rows 9-21 need 2+ GPUs, else SKIP).
#
#   OUT=/path/to/results tests/bench/device/run_on_h200.sh      (from the repository root, as root)
#
# Needs python3 with torch, nvidia-ml-py (pynvml) and psutil; fuser, unshare, nsenter, nvidia-smi.
# Writes under $OUT: env.txt, nvidia-smi-before.txt / -after.txt, facts.json, facts.log,
# facts-logs-cuda/ (one log per holder), fidelity-preview.md.
# Reads the GPU only: it never resets it or changes a setting, and it signals only the
# processes it started (gpu_facts.py checks a per-run token before every kill).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...): exported here and forced again by every workload.
# GPU time: about 2-3 minutes (rows 1-8: ten PyTorch holders; 9-21: thirteen, three NCCL jobs),
# capped by --deadline (GPU_FACTS_DEADLINE, 330 s).
#
# Knobs: PYTHON (python3), GPU_FACTS_GIB (4, per holder), GPU_FACTS_ROW2_GIB (1,16,64,120),
# GPU_FACTS_INDEX (0), GPU_FACTS_DEADLINE (330), GPU_FACTS_EXTRA (more gpu_facts.py options, e.g. "--rows 9-21").
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-$PWD/.cache/h200}
PY=${PYTHON:-python3}
GIB=${GPU_FACTS_GIB:-4}
ROW2=${GPU_FACTS_ROW2_GIB:-1,16,64,120}
INDEX=${GPU_FACTS_INDEX:-0}
DEADLINE=${GPU_FACTS_DEADLINE:-330}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../../.." || exit 2

smi() { timeout 30 nvidia-smi "$@" 2>&1 || true; }

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "uname: $(uname -a)"
    echo "python: $($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
    echo "torch: $(timeout 60 "$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1)"
    echo "nvidia-ml-py: $($PY -c 'import importlib.metadata as m; print(m.version("nvidia-ml-py"))' 2>&1 | tail -1)"
    echo "psutil: $($PY -c 'import psutil; print(psutil.__version__)' 2>&1 | tail -1)"
    echo "fuser: $(fuser -V 2>&1 | head -1)"
    echo "unshare: $(unshare --version 2>&1 | head -1)"
    echo "cpus: $(nproc)  processes: $(find /proc -maxdepth 1 -name '[0-9]*' | wc -l)"
    echo "nccl: $(timeout 60 "$PY" -c 'import torch; print(torch.cuda.nccl.version())' 2>&1 | tail -1)"
    echo "gpus: $(timeout 30 nvidia-smi -L 2>&1 | tr '\n' ' ')"
    echo "multicast off: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS"
} > "$OUT/env.txt"
cat "$OUT/env.txt"

smi > "$OUT/nvidia-smi-before.txt"
smi topo -m >> "$OUT/nvidia-smi-before.txt"
smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$OUT/nvidia-smi-before.txt"
if smi --query-compute-apps=pid --format=csv,noheader | grep -q '[0-9]'; then
    echo "warning: compute processes already on the GPU; row 1 (idle floor) will fail" >&2
fi

# SIGTERM from timeout makes gpu_facts.py clean up; -k is the last resort (holders then end by their lifeline).
read -r -a extra <<< "${GPU_FACTS_EXTRA:-}"
timeout -k 20 $((DEADLINE + 30)) "$PY" tests/lab/gpu_facts.py --backend cuda --index "$INDEX" --gib "$GIB" \
    --row2-gib "$ROW2" --deadline "$DEADLINE" --json "$OUT/facts.json" "${extra[@]}" 2>&1 | tee "$OUT/facts.log"
rc=${PIPESTATUS[0]}

smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/nvidia-smi-after.txt"
smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv >> "$OUT/nvidia-smi-after.txt"
# the holders' logs travel as one file ($OUT brings back at most 8 files, 2 folders down)
if [ -d "$OUT/facts-logs-cuda" ]; then
    tar -C "$OUT" -czf "$OUT/facts-logs-cuda.tgz" facts-logs-cuda && rm -rf "$OUT/facts-logs-cuda"
fi

if [ -f "$OUT/facts.json" ]; then
    "$PY" tests/lab/fidelity_report.py --real "$OUT/facts.json" --lab none --out "$OUT/fidelity-preview.md" || true
fi

# --- later: module runs on the real GPU (issues 3 and 4) go here, results under $OUT ---

echo "gpu_facts exit $rc; results in $OUT"
exit "$rc"
