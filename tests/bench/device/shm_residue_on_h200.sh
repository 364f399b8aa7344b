#!/usr/bin/env bash
# Issue 21 on a real GPU host: shared-memory residue in a real LXC container configured as Proxmox does
# (../shared/tools/real_lxc_gpu.py, in .cache/real-lxc). Inside container 129's /dev/shm: a leaked NCCL segment
# (old), a segment a live process maps, and a file without a GPU stack's prefix. From the node: gpu_status must
# list only the leaked one for 129; gpu_release (containers: [129], clean_shm, a match nothing has) in check mode
# removes nothing, then removes only it; a second run changes nothing.
#
# Here, once: as for node_path_on_h200.sh (wheels in .cache/mgpu-wheels, lxc debs in .cache/real-lxc).
# On the GPU machine (device tool, carry [".cache/mgpu-wheels", ".cache/real-lxc"]):
#   bash tests/bench/device/shm_residue_on_h200.sh
# Writes under $OUT: shm-residue.log. Signals nothing (no process matches), never resets a GPU or changes a setting,
# touches only files it made in the container's /dev/shm, and removes the container at the end.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
NAME=shmresidue
OWN=gpuops_shm_user
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh

show() {
    python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("   msg:", r.get("msg"), "| changed", r.get("changed"))
for key in ("shm_residue", "shm_removed", "shm_left"):
    if key in r:
        print("  ", key, [(e["path"], e.get("vmid"), e["owner"]) for e in r[key]])
if "shm_residue_by_container" in r:
    print("   shm_residue_by_container", {k: [e["path"] for e in v] for k, v in r["shm_residue_by_container"].items()})
PY
}

{
    "${LXC[@]}" up .cache/real-lxc/debs "$VMID" 2>&1 | tail -2 || exit 3
    echo "container /dev/shm: $("${LXC[@]}" attach "$VMID" -- sh -c 'grep " /dev/shm " /proc/mounts || echo none')"
    "${LXC[@]}" attach "$VMID" -- sh -c 'mkdir -p /dev/shm; grep -q " /dev/shm " /proc/mounts || mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm'
    "${LXC[@]}" attach "$VMID" -- python3 -c "
import os, time
for name in ('nccl-gpuops-leak', 'PostgreSQL.gpuops'):
    with open('/dev/shm/' + name, 'wb') as f:
        f.write(bytes(1 << 20))
    os.utime('/dev/shm/' + name, (time.time() - 3600, time.time() - 3600))"
    "${LXC[@]}" attach "$VMID" -- /bin/sh -c "python3 -c 'import mmap, os, time; fd = os.open(\"/dev/shm/sgl_gpuops_live\", os.O_RDWR | os.O_CREAT, 0o600); os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); print(\"ready\", flush=True); time.sleep(300)' gpuops_shm_user > /run/shm-user.log 2>&1 &"
    for _ in $(seq 60); do
        "${LXC[@]}" attach "$VMID" -- cat /run/shm-user.log 2>/dev/null | grep -q ready && break
        sleep 1
    done
    echo "container /dev/shm files: $("${LXC[@]}" attach "$VMID" -- ls /dev/shm | tr '\n' ' ')"
    echo "== gpu_status from the node"
    run -m gpuops.fleet.gpu_status -a '{"cmdline": false}' -t "$OUT/tree-status" > /dev/null
    show "$OUT/tree-status/localhost"
    args='{"containers": [129], "shared_gpu": "own", "match": "gpuops_shm_nothing_matches", "clean_shm": true, "term_timeout": 5, "kill_timeout": 5, "verify_timeout": 20}'
    for step in check release again; do
        echo "== gpu_release clean_shm: $step"
        extra=()
        [ "$step" = check ] && extra=(--check)
        run -m gpuops.fleet.gpu_release -a "$args" "${extra[@]}" -t "$OUT/tree-$step" > /dev/null
        show "$OUT/tree-$step/localhost"
        echo "   container /dev/shm files: $("${LXC[@]}" attach "$VMID" -- ls /dev/shm | tr '\n' ' ')"
    done
    "${LXC[@]}" attach "$VMID" -- sh -c 'rm -f /dev/shm/nccl-gpuops-leak /dev/shm/PostgreSQL.gpuops /dev/shm/sgl_gpuops_live'
} 2>&1 | tee "$OUT/shm-residue.log"
exit 0
