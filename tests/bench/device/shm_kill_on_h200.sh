#!/usr/bin/env bash
# Issue 21 on a real GPU host (one GPU: no NCCL job across two): shared-memory residue from a SIGKILLed creator.
# A process creates a segment with multiprocessing.shared_memory (psm_*) and is SIGKILLed twice over: alone
# (Python's resource tracker, a separate process, may unlink it), and with its whole process group (the tracker
# dies too, as in an OOM kill of a container). gpu_status (host view) must report what is left, gpu_release
# clean_shm (a match nothing has) must list it in check mode and remove it, a second run must change nothing.
#
# On the GPU machine (device tool, carry [".cache/mgpu-wheels"]): bash tests/bench/device/shm_kill_on_h200.sh
# Writes under $OUT: shm-kill.log. Signals only what it started; touches only its own /dev/shm segments.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
NAME=shmkill
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh

# shellcheck disable=SC2317  # called by the EXIT trap
finish() { pkill -9 -f gpuops_shm_creator 2>/dev/null; }
trap finish EXIT

create() {  # prints the segment's name once created; the creator then sleeps in its own process group
    setsid python3 -c '
import sys, time
from multiprocessing import shared_memory
s = shared_memory.SharedMemory(create=True, size=1 << 20)
s.buf[:4] = b"gpu!"
print(s.name, flush=True)
time.sleep(300)
' gpuops_shm_creator > "$OUT/creator-$1.log" 2>&1 &
    for _ in $(seq 1 100); do [ -s "$OUT/creator-$1.log" ] && break; sleep 0.1; done
    head -1 "$OUT/creator-$1.log"
}

show() {
    python3 - "$1" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
r = json.loads(text[text.index("{"):])
print("   msg:", r.get("msg"), "| changed", r.get("changed"))
for key in ("shm_residue", "shm_removed", "shm_left"):
    if key in r:
        print("  ", key, [(e["path"], e["owner"], e["bytes"]) for e in r[key]])
PY
}

{
    alone=$(create alone)
    pid=$(pgrep -f "gpuops_shm_creator" | head -1)
    echo "creator alone: $alone (pid $pid; tracker $(pgrep -f resource_tracker | tr '\n' ' '))"
    kill -9 "$pid"
    for _ in $(seq 1 50); do [ -e "/dev/shm/$alone" ] || break; sleep 0.1; done
    if [ -e "/dev/shm/$alone" ]; then echo "  after SIGKILL of the creator alone: /dev/shm/$alone still there"
    else echo "  after SIGKILL of the creator alone: gone (the resource tracker unlinked it)"; fi
    pkill -9 -f gpuops_shm_creator; sleep 0.5
    group=$(create group)
    pgid=$(ps -o pgid= -p "$(pgrep -f "gpuops_shm_creator" | head -1)" | tr -d ' ')
    echo "creator with its group: $group (pgid $pgid)"
    kill -9 -- "-$pgid"
    sleep 1
    stat -c "  %n: %s bytes" "/dev/shm/$group" 2>&1
    sleep 1
    run -m gpuops.fleet.gpu_status -a '{"cmdline": false}' > "$OUT/status.out" 2>&1
    echo "gpu_status:"; python3 - "$OUT/status.out" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
r = json.loads(text[text.index("{"):])
print("   ready", r.get("ready"), "| shm_residue", [(e["path"], e["owner"]) for e in r.get("shm_residue", [])])
PY
    for mode in check real again; do
        flags=()
        [ "$mode" = check ] && flags=(--check)
        run -m gpuops.fleet.gpu_release -a '{"gpus": [0], "match": "gpuops_nothing_matches", "clean_shm": true}' "${flags[@]}" > "$OUT/release-$mode.out" 2>&1
        echo "gpu_release clean_shm ($mode):"; show "$OUT/release-$mode.out"
    done
    stat -c "  after: %n still there" "/dev/shm/$group" 2>/dev/null || echo "  after: /dev/shm/$group removed"
} 2>&1 | tee "$OUT/shm-kill.log"
