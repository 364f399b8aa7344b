#!/usr/bin/env bash
# Issue 17 on a real GPU: a torch holder restarted by its parent as soon as it dies (a shell loop, a
# Python loop, a parent named torchrun). gpu_release must fail naming the parent, never say "verified
# free" while the GPU is about to be taken again. With --baseline the same rounds run first with the
# collection before the change (.cache/mgpu-head), to show the false "free" there.
#
# Here (with network), once: bash tests/bench/device/multi_gpu_modules.sh --prepare   (ansible wheels),
#   then: rm -rf .cache/mgpu-head && mkdir -p .cache/mgpu-head &&
#         git archive BASE galaxy.yml meta plugins | tar -x -C .cache/mgpu-head
# On the GPU machine (device tool, carry [".cache/mgpu-wheels", ".cache/mgpu-head"]):
#   bash tests/bench/device/respawn_on_h200.sh [--baseline]
# Writes $OUT/respawn.log and $OUT/respawn.json. Never resets a GPU or changes a setting; signals only
# its own holders (match: gpuops_respawn_holder); every loop and holder it starts is killed at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
OUT=${OUT:-$PWD/.cache/respawn}
mkdir -p "$OUT"
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
SITE=$WORK/site
python3 -m pip install -q --no-index --no-deps --target "$SITE" .cache/mgpu-wheels/*.whl || exit 2
MARK=gpuops_respawn_holder
cat > "$WORK/holder.py" <<'PY'
import os, sys, time, torch
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
with open(sys.argv[2], "a") as f:
    f.write("%d %.3f\n" % (os.getpid(), time.time()))
time.sleep(300)
PY
cat > "$WORK/loop.py" <<'PY'
import subprocess, sys, time
deadline = time.monotonic() + 240          # the loop ends by itself
while time.monotonic() < deadline:
    subprocess.call(sys.argv[1:])
    time.sleep(0.1)
PY
mkdir -p "$WORK/bin"
{ echo "#!$(command -v python3)"; cat "$WORK/loop.py"; } > "$WORK/bin/torchrun" && chmod +x "$WORK/bin/torchrun"

collection() {  # $1: a folder with galaxy.yml, meta, plugins
    rm -rf "$WORK/coll" && mkdir -p "$WORK/coll/ansible_collections/gpuops" && ln -s "$(cd "$1" && pwd)" "$WORK/coll/ansible_collections/gpuops/fleet"
}
release() {  # the module through ansible, like a playbook task; $1: tree dir
    PYTHONPATH=$SITE ANSIBLE_COLLECTIONS_PATH=$WORK/coll ANSIBLE_NOCOLOR=1 timeout 120 python3 -c \
        'import sys; from ansible.cli.adhoc import main; sys.argv[0]="ansible"; main()' localhost -c local \
        -e ansible_python_interpreter="$(command -v python3)" -m gpuops.fleet.gpu_release \
        -a "{\"match\": \"$MARK\", \"gpus\": [\"0\"], \"term_timeout\": 2, \"kill_timeout\": 5, \"advanced\": {\"verify_timeout\": 10}}" -t "$1" > /dev/null 2>&1
}
starts() { [ -f "$WORK/ready" ] && wc -l < "$WORK/ready" || echo 0; }
wait_starts() {  # until the ready file has $1 lines, at most $2 s
    local end=$((SECONDS + $2))
    while [ "$(starts)" -lt "$1" ] && [ $SECONDS -lt $end ]; do sleep 0.2; done
    [ "$(starts)" -ge "$1" ]
}
stop_all() {
    pkill -9 -f "$WORK/loop.py" ; pkill -9 -f "$WORK/bin/torchrun"; pkill -9 -f "gpuops-respawn-shell"
    pkill -9 -f "$WORK/holder.py"
    local end=$((SECONDS + 30))
    while pgrep -f "$WORK/holder.py" > /dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
}
trap stop_all EXIT

round() {  # $1: label, $2: kind
    rm -f "$WORK/ready"
    case $2 in
        shell_loop) setsid sh -c "while :; do python3 $WORK/holder.py $MARK $WORK/ready; sleep 0.1; done # gpuops-respawn-shell" \
                        < /dev/null > /dev/null 2>&1 & ;;
        python_loop) setsid python3 "$WORK/loop.py" python3 "$WORK/holder.py" $MARK "$WORK/ready" < /dev/null > /dev/null 2>&1 & ;;
        torchrun) setsid "$WORK/bin/torchrun" python3 "$WORK/holder.py" $MARK "$WORK/ready" < /dev/null > /dev/null 2>&1 & ;;
    esac
    wait_starts 1 120 || { echo "$1 $2: the first holder never got ready"; stop_all; return; }
    local t0=$SECONDS
    release "$WORK/tree-$1-$2"
    local took=$((SECONDS - t0))
    wait_starts 2 60 && back=yes || back=no
    python3 - "$WORK/tree-$1-$2/localhost" "$1" "$2" "$took" "$back" "$OUT/respawn.jsonl" <<'PY'
import json, sys
path, label, kind, took, back, out = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError) as exc:
    r = {"msg": "no result: %s" % exc}
row = {"collection": label, "kind": kind, "failed": r.get("failed"), "msg": (r.get("msg") or "")[:400],
       "respawned": r.get("respawned"), "signalled": [a["pid"] for a in r.get("actions", []) if a.get("signal") in ("SIGTERM", "SIGKILL")],
       "task_s": int(took), "gpu_taken_again": back == "yes"}
print(json.dumps(row))
open(out, "a").write(json.dumps(row) + "\n")
PY
    stop_all
}

rm -f "$OUT/respawn.jsonl"
{
    nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader 2>&1 | head -2
    if [ "${1:-}" = "--baseline" ] && [ -d .cache/mgpu-head ]; then
        collection .cache/mgpu-head
        for kind in shell_loop python_loop torchrun; do round before $kind; done
    fi
    collection .
    for kind in shell_loop python_loop torchrun; do round after $kind; done
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
} 2>&1 | tee "$OUT/respawn.log"
python3 -c 'import json,sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1])], indent=1))' "$OUT/respawn.jsonl" > "$OUT/respawn.json"
exit 0
