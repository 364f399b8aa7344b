#!/usr/bin/env bash
# Sourced by the real-LXC device scripts (node_path_on_h200.sh, device_numbers_on_h200.sh), from the repository
# root: the collection and its wheels under $SITE (inside the repository: the container sees the host's root, not
# its /tmp), LXC (the real-LXC tool) and run (ansible ad hoc on localhost with this Python). With OWN set (a
# pattern of the script's own processes' command lines), at exit those are killed and container $VMID removed.
# shellcheck disable=SC2034  # LXC is the sourcing script's
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUNBUFFERED=1
# With NAME set: OUT (unless given) is .cache/NAME, SITE .cache/NAME-site, VMID 129 (unless set).
if [ -n "${NAME:-}" ]; then
    OUT=${OUT:-$PWD/.cache/$NAME}
    SITE=$PWD/.cache/$NAME-site
    VMID=${VMID:-129}
    mkdir -p "$OUT"
fi
rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" .cache/mgpu-wheels/*.whl || exit 2
mkdir -p "$SITE/ansible_collections/gpuops" && ln -sfn "$PWD" "$SITE/ansible_collections/gpuops/fleet"
export PYTHONPATH=$SITE ANSIBLE_COLLECTIONS_PATH=$SITE ANSIBLE_NOCOLOR=1
LXC=(python3 .cache/real-lxc/real_lxc_gpu.py)
run() { timeout 200 python3 -c 'import sys; from ansible.cli.adhoc import main; sys.argv[0]="ansible"; main()' \
    localhost -c local -e ansible_python_interpreter="$(command -v python3)" "$@"; }
# shellcheck disable=SC2317  # called by the EXIT trap
remove_own() {
    pkill -9 -f "$OWN" 2>/dev/null
    "${LXC[@]}" down "$VMID" > /dev/null 2>&1
}
if [ -n "${OWN:-}" ]; then trap remove_own EXIT; fi
