#!/usr/bin/env bash
# Issue 21 on a real GPU: MPS. This script starts its own MPS control daemon (its own CUDA_MPS_PIPE_DIRECTORY and
# CUDA_MPS_LOG_DIRECTORY under $OUT), a busy client (a matmul loop, 6 GiB) and an idle client (4 GiB), reads them
# with gpu_status, and runs gpu_release on GPU 0 with a match that names the busy client only: terminate_client
# through the control daemon, then SIGTERM/SIGKILL; the busy client's memory must go, the idle client and the
# server stay. Then the idle client is stopped and the daemon quit (quit blocks while a client remains, row 28).
#
# On the GPU machine (device tool, carry [".cache/mgpu-wheels"]): bash tests/bench/device/mps_on_h200.sh
# Writes under $OUT: mps.log, status.json, release.json. Never resets a GPU or changes a setting; signals only
# what it started (the match names its busy client), and quits its own MPS daemon at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
NAME=mps
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh
export CUDA_MPS_PIPE_DIRECTORY=$OUT/mps-pipe CUDA_MPS_LOG_DIRECTORY=$OUT/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
CTL=/usr/local/nvidia/bin/nvidia-cuda-mps-control
[ -x "$CTL" ] || CTL=$(command -v nvidia-cuda-mps-control)

# shellcheck disable=SC2317  # called by the EXIT trap
finish() {
    pkill -9 -f gpuops_mps_ 2>/dev/null
    sleep 2
    echo quit | timeout 20 "$CTL" > /dev/null 2>&1
    pkill -9 -f "$CUDA_MPS_PIPE_DIRECTORY" 2>/dev/null
}
trap finish EXIT

client() {  # NAME GIB BUSY
    python3 -c '
import sys, time, torch
end = time.time() + 300
x = torch.empty(int(float(sys.argv[2]) * (1 << 30)), dtype=torch.uint8, device="cuda:0")
a = torch.randn(4096, 4096, device="cuda:0")
print("ready", flush=True)
while time.time() < end:
    if sys.argv[3] == "busy":
        for _ in range(50):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    else:
        time.sleep(1)
' "$1" "$2" "$3" > "$OUT/$1.log" 2>&1 &
    echo $!
}

used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | tr -d ' '; }
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' '; }
wait_ready() { for _ in $(seq 1 120); do grep -q ready "$OUT/$1.log" 2>/dev/null && return 0; sleep 0.5; done; return 1; }

{
    echo "control: $CTL"
    "$CTL" -d && echo "daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
    echo "before: used $(used) MiB"
    busy=$(client gpuops_mps_busy 6 busy)
    idle=$(client gpuops_mps_idle 4 idle)
    if ! wait_ready gpuops_mps_busy || ! wait_ready gpuops_mps_idle; then
        echo "clients did not start"; cat "$OUT"/gpuops_mps_*.log; exit 3
    fi
    sleep 2
    echo "clients: busy $busy, idle $idle; used $(used) MiB; compute apps: $(apps)"
    echo "server list: $(echo get_server_list | "$CTL")"
    for s in $(echo get_server_list | "$CTL"); do echo "clients of $s: $(echo "get_client_list $s" | "$CTL")"; done
    run -m gpuops.fleet.gpu_status -a '{"gpus": [0], "cmdline": false}' > "$OUT/status.out" 2>&1
    sed -n '/{/,$p' "$OUT/status.out" | sed '1s/^[^{]*//' > "$OUT/status.json"
    python3 - "$OUT/status.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("gpu_status: view", r.get("view"), "| holders", [(h["pid"], h["name"], h.get("mps_role"), h["shares_mib"]) for h in r["holders"]])
print("  ", [l for l in r["diagnosis"] if l.startswith("MPS")])
PY
    before=$(used)
    t0=$(date +%s.%N)
    run -m gpuops.fleet.gpu_release -a '{"gpus": [0], "match": "gpuops_mps_busy", "term_timeout": 5, "kill_timeout": 5, "verify_timeout": 5}' > "$OUT/release.out" 2>&1
    t1=$(date +%s.%N)
    sed -n '/{/,$p' "$OUT/release.out" | sed '1s/^[^{]*//' > "$OUT/release.json"
    sleep 1
    echo "gpu_release took $(python3 -c "print(round($t1 - $t0, 1))") s; used $before -> $(used) MiB; compute apps now: $(apps)"
    python3 - "$OUT/release.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("gpu_release: failed", r.get("failed"), "| msg:", r.get("msg"))
for a in r.get("actions", []):
    print("   action", a["signal"], a["pid"], a["name"], a["outcome"])
for s in r.get("not_signalled", []):
    print("   not signalled", s["pid"], s["name"], s["reason"])
for p in r.get("plan", []):
    print("   plan", p["pid"], p["name"], p["signals"])
PY
    kill -0 "$busy" 2>/dev/null && echo "busy client ALIVE (unexpected)" || echo "busy client gone"
    kill -0 "$idle" 2>/dev/null && echo "idle client alive" || echo "idle client GONE (unexpected)"
    echo "server list after: $(echo get_server_list | "$CTL")"
    kill -9 "$idle"; sleep 3
    echo "after the idle client: used $(used) MiB; apps $(apps)"
    t0=$(date +%s.%N); echo quit | timeout 30 "$CTL"; echo "quit rc $? in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
    sleep 1; pgrep -fa nvidia-cuda-mps || echo "no MPS process left"
} 2>&1 | tee "$OUT/mps.log"
