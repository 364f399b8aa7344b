#!/usr/bin/env bash
# Issue 20 on a real GPU: one gpu_release on the node, for a real LXC container configured as Proxmox does
# (../shared/tools/real_lxc_gpu.py, copied with Debian's lxc debs into .cache/real-lxc), finds the supervisord
# program that runs the container's holder, stops it inside the container, and verifies the GPU free, while a
# holder of the node itself (outside containers: [VMID]) is spared.
#
# Here, once: bash tests/bench/device/multi_gpu_modules.sh --prepare (wheels, supervisor's among them);
#   mkdir -p .cache/real-lxc && cp ../shared/tools/real_lxc_gpu.py .cache/real-lxc/ &&
#   (cd .cache/real-lxc && python3 real_lxc_gpu.py fetch debs)
# On the GPU machine (device tool, carry [".cache/mgpu-wheels", ".cache/real-lxc"]):
#   bash tests/bench/device/node_path_on_h200.sh
# Writes under $OUT: node-path.log and the module results. Never resets a GPU or changes a setting; signals
# only its own holders (match: gpuops_np_holder), and removes the container at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
OUT=${OUT:-$PWD/.cache/nodepath}
mkdir -p "$OUT"
VMID=129
SITE=$PWD/.cache/np-site
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh
node_holder=
# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    if [ -n "$node_holder" ]; then kill -9 "$node_holder" 2>/dev/null; fi
    pkill -9 -f gpuops_np_holder 2>/dev/null
    "${LXC[@]}" down "$VMID" > /dev/null 2>&1
    rm -f /usr/local/bin/supervisorctl
}
trap cleanup EXIT

{
    "${LXC[@]}" up .cache/real-lxc/debs "$VMID" 2>&1 | tail -2 || exit 3
    # the container's supervisorctl (its root is the host's; lxc-attach --clear-env gives it a plain PATH)
    printf '#!/bin/sh\nPYTHONPATH=%s exec /usr/bin/python3 %s/bin/supervisorctl "$@"\n' "$SITE" "$SITE" > /usr/local/bin/supervisorctl
    chmod 755 /usr/local/bin/supervisorctl
    conf=$PWD/.cache/np-supervisord.conf
    cat > "$conf" <<EOF
[unix_http_server]
file=/run/np-supervisor.sock
[supervisord]
pidfile=/run/np-supervisord.pid
logfile=/run/np-supervisord.log
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix:///run/np-supervisor.sock
[program:gpuops_np]
command=/usr/bin/python3 -c "import time, torch; x = torch.empty(8 << 30, dtype=torch.uint8, device='cuda:0'); print('ready', flush=True); time.sleep(600)" gpuops_np_holder
autostart=true
autorestart=true
startsecs=1
stopwaitsecs=10
stdout_logfile=/run/np-holder.log
redirect_stderr=true
EOF
    "${LXC[@]}" attach "$VMID" -- /bin/sh -c "PYTHONPATH=$SITE:\$PYTHONPATH $SITE/bin/supervisord -c $conf"
    # a holder of the node itself, outside the container: never in scope
    timeout 400 python3 -c 'import time, torch; x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda:0"); print("ready", flush=True); time.sleep(400)' gpuops_np_holder_node > "$OUT/node-holder.log" 2>&1 &
    node_holder=$!
    for _ in $(seq 120); do
        grep -q ready "$OUT/node-holder.log" && "${LXC[@]}" attach "$VMID" -- cat /run/np-holder.log 2>/dev/null | grep -q ready && break
        sleep 1
    done
    echo "supervisorctl in $VMID: $("${LXC[@]}" attach "$VMID" -- supervisorctl -c "$conf" status)"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    args='{"containers": [129], "stop_found_units": true, "shared_gpu": "own", "match": "gpuops_np_holder", "gpus": ["0"], "term_timeout": 5, "kill_timeout": 5, "verify_timeout": 20}'
    for step in check release again; do
        extra=(); [ $step = check ] && extra=(--check)
        run -m gpuops.fleet.gpu_release -a "$args" "${extra[@]}" -t "$OUT/tree-$step" > /dev/null
        python3 - "$OUT/tree-$step/localhost" "$step" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("==", sys.argv[2], "| msg:", r.get("msg"), "| changed", r.get("changed"), "| view", r.get("view"), "| scope", r.get("scope"))
print("   found_units", [(u["vmid"], u["kind"], u["name"], u["pids"], u.get("outcome")) for u in r.get("found_units") or []])
print("   actions", [(a["signal"], a["pid"], a["name"], a["outcome"][:60]) for a in r.get("actions") or []])
print("   per_container", [(c["vmid"], c["changed"], c["verdict"], [(g["index"], g["before_mib"], g["after_mib"], g["free"]) for g in c["gpus"]]) for c in r.get("per_container") or []])
print("   not_signalled", [(s["pid"], s["name"], s["reason"][:70]) for s in r.get("not_signalled") or []])
print("   after", [(g["index"], g["used_mib"], g.get("by_container"), g.get("free_for_scope")) for g in r.get("after") or []])
PY
        cp "$OUT/tree-$step/localhost" "$OUT/$step.json" 2>/dev/null
        echo "   supervisorctl: $("${LXC[@]}" attach "$VMID" -- supervisorctl -c "$conf" status 2>&1 | tr -s ' ')"
        echo "   node holder alive: $(kill -0 $node_holder 2>/dev/null && echo yes || echo no)"
    done
    sleep 5
    echo "after 5 s: supervisorctl: $("${LXC[@]}" attach "$VMID" -- supervisorctl -c "$conf" status 2>&1 | tr -s ' ')"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
} 2>&1 | tee "$OUT/node-path.log"
exit 0
