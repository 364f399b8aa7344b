#!/usr/bin/env bash
# Sourced by the real-LXC device scripts (node_path_on_h200.sh, device_numbers_on_h200.sh), from the repository
# root: the collection and its wheels under $SITE (inside the repository: the container sees the host's root, not
# its /tmp), LXC (the real-LXC tool) and run (ansible ad hoc on localhost with this Python).
# shellcheck disable=SC2034  # LXC is the sourcing script's
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUNBUFFERED=1
rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" .cache/mgpu-wheels/*.whl || exit 2
mkdir -p "$SITE/ansible_collections/gpuops" && ln -sfn "$PWD" "$SITE/ansible_collections/gpuops/fleet"
export PYTHONPATH=$SITE ANSIBLE_COLLECTIONS_PATH=$SITE ANSIBLE_NOCOLOR=1
LXC=(python3 .cache/real-lxc/real_lxc_gpu.py)
run() { timeout 200 python3 -c 'import sys; from ansible.cli.adhoc import main; sys.argv[0]="ansible"; main()' \
    localhost -c local -e ansible_python_interpreter="$(command -v python3)" "$@"; }
