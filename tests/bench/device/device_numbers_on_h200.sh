#!/usr/bin/env bash
# Issue 20 on a real GPU: a container's GPUs are read by device number (st_rdev), never by name. A real LXC
# container configured as Proxmox does (../shared/tools/real_lxc_gpu.py, in .cache/real-lxc) gets a second node
# for the same GPU under another name (/dev/nvidia5, 195:0); a holder inside maps the GPU. From the node,
# gpu_status must still count the container's GPU by number (passed_into), name the odd device in its
# diagnosis, and gpu_release (containers: [VMID], match) must free the GPU.
#
# Here, once: as for node_path_on_h200.sh (wheels in .cache/mgpu-wheels, lxc debs in .cache/real-lxc).
# On the GPU machine (device tool, carry [".cache/mgpu-wheels", ".cache/real-lxc"]):
#   bash tests/bench/device/device_numbers_on_h200.sh
# Writes under $OUT: device-numbers.log and the module results. Never resets a GPU or changes a setting; signals
# only its own holder (match: gpuops_dn_holder), and removes the container at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
NAME=devnumbers
OWN=gpuops_dn_holder
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh

{
    "${LXC[@]}" up .cache/real-lxc/debs "$VMID" 2>&1 | tail -2 || exit 3
    "${LXC[@]}" attach "$VMID" -- mknod -m 666 /dev/nvidia5 c 195 0
    echo "container /dev: $("${LXC[@]}" attach "$VMID" -- ls -l /dev/nvidia0 /dev/nvidia5 | tr -s ' ' | tr '\n' ';')"
    "${LXC[@]}" attach "$VMID" -- /bin/sh -c "python3 -c 'import time, torch; x = torch.empty(6 << 30, dtype=torch.uint8, device=\"cuda:0\"); print(\"ready\", flush=True); time.sleep(400)' gpuops_dn_holder > /run/dn-holder.log 2>&1 &"
    for _ in $(seq 120); do
        "${LXC[@]}" attach "$VMID" -- cat /run/dn-holder.log 2>/dev/null | grep -q ready && break
        sleep 1
    done
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
    run -m gpuops.fleet.gpu_status -a '{"cmdline": false}' -t "$OUT/tree-status" > /dev/null
    cp "$OUT/tree-status/localhost" "$OUT/status.json"
    python3 - "$OUT/status.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("== gpu_status | view", r.get("view"))
for g in r["gpus"]:
    print("   GPU", g["index"], "minor", g.get("minor"), "passed_into", g.get("passed_into"), "by_container",
          g.get("by_container"), "holders", [(h["pid"], h.get("container"), h.get("container_pid")) for h in g.get("holders_detail") or []] or g.get("holders"))
print("   diagnosis:", [d for d in r.get("diagnosis") or [] if "container" in d])
PY
    args='{"containers": [129], "shared_gpu": "own", "match": "gpuops_dn_holder", "gpus": ["0"], "term_timeout": 5, "kill_timeout": 5, "verify_timeout": 20}'
    run -m gpuops.fleet.gpu_release -a "$args" -t "$OUT/tree-release" > /dev/null
    cp "$OUT/tree-release/localhost" "$OUT/release.json"
    python3 - "$OUT/release.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("== gpu_release | msg:", r.get("msg"), "| changed", r.get("changed"))
print("   actions", [(a["signal"], a["pid"], a["name"], a["outcome"][:40]) for a in r.get("actions") or []])
print("   per_container", [(c["vmid"], c["verdict"], [(g["index"], g.get("minor"), g["before_mib"], g["after_mib"]) for g in c["gpus"]]) for c in r.get("per_container") or []])
PY
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
} 2>&1 | tee "$OUT/device-numbers.log"
exit 0
