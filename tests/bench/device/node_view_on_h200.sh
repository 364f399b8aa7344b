#!/usr/bin/env bash
# The issue-11 engine on a real GPU machine (no Proxmox there): which view it takes, what a holder
# carries (container, container_pid), by_container against NVML, and gpu_release still freeing the GPU.
#
# Here (with network), once: bash tests/bench/device/multi_gpu_modules.sh --prepare   (ansible wheels)
# On the GPU machine (device tool, carry [".cache/mgpu-wheels"]): bash tests/bench/device/node_view_on_h200.sh
# Writes under $OUT: node-view.log, status.json, release.json. Never resets a GPU or changes a setting;
# signals only its own holder (match: gpuops_nodeview_holder).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
OUT=${OUT:-$PWD/.cache/nodeview}
mkdir -p "$OUT"
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUNBUFFERED=1
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" .cache/mgpu-wheels/*.whl || exit 2
mkdir -p "$SITE/ansible_collections/gpuops" && ln -s "$PWD" "$SITE/ansible_collections/gpuops/fleet"
export PYTHONPATH=$SITE ANSIBLE_COLLECTIONS_PATH=$SITE ANSIBLE_NOCOLOR=1
run() { timeout 120 python3 -c 'import sys; from ansible.cli.adhoc import main; sys.argv[0]="ansible"; main()' \
    localhost -c local -e ansible_python_interpreter="$(command -v python3)" "$@"; }

# gpuops_nodeview_holder: 8 GiB on GPU 0, alive until killed (a lifeline ends it after 300 s)
timeout 300 python3 -c '
import sys, time, torch
sys.argv[0] = "gpuops_nodeview_holder"
x = torch.empty(8 << 30, dtype=torch.uint8, device="cuda:0")
import os
print("ready", os.getpid(), flush=True)
time.sleep(300)' gpuops_nodeview_holder > "$OUT/holder.log" 2>&1 &
holder=$!
for _ in $(seq 120); do grep -q ready "$OUT/holder.log" && break; sleep 0.5; done
{
    echo "holder shell pid $holder; pid 1: $(tr '\0' ' ' < /proc/1/cmdline | cut -c1-80)"
    echo "pid 1 environment has container=: $(tr '\0' '\n' < /proc/1/environ 2>/dev/null | grep -c '^container=')"
    echo "/etc/pve: $([ -e /etc/pve ] && echo yes || echo no); pct: $([ -e /usr/sbin/pct ] && echo yes || echo no)"
    run -m gpuops.fleet.gpu_status -a 'cmdline=false' -t "$OUT/status-tree" | head -3
    python3 - "$OUT/status-tree/localhost" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("view", r.get("view"), "in_container", r.get("in_container"))
for g in r["gpus"]:
    print("gpu", g["index"], "used", g["memory"]["used_mib"], "by_container", g.get("by_container"),
          "passed_into", g.get("passed_into"), "holders", g["holders"])
for h in r["holders"]:
    print("holder", h["pid"], h["name"], "gpus", h["gpus"], "container", h.get("container"), "container_pid", h.get("container_pid"))
PY
    run -m gpuops.fleet.gpu_release -a 'match=gpuops_nodeview_holder term_timeout=2 kill_timeout=5' -t "$OUT/release-tree" | head -3
    python3 - "$OUT/release-tree/localhost" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("release:", r.get("msg"), "changed", r.get("changed"), "view", r.get("view"), "rung", r.get("rung_reached"),
      "elapsed_s", r.get("elapsed_s"), "after", [(g["index"], g["used_mib"], g["free"]) for g in r.get("after") or []])
PY
    echo "holder alive after release: $(kill -0 $holder 2>/dev/null && echo yes || echo no)"
} 2>&1 | tee "$OUT/node-view.log"
cp "$OUT/status-tree/localhost" "$OUT/status.json" 2>/dev/null
cp "$OUT/release-tree/localhost" "$OUT/release.json" 2>/dev/null
worker=$(awk '/^ready/{print $2}' "$OUT/holder.log")
[ -n "$worker" ] && kill -9 "$worker" 2>/dev/null
kill -9 "$holder" 2>/dev/null
wait
exit 0
