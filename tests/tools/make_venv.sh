#!/usr/bin/env bash
# make venv: the test venv (.venv), the target wheels (.cache/wheels) and, beside the install, the lab's venvs
# and NVML stand-in (tests/lab/lablib/prepare.py).
# uv (from PyPI, kept in .cache/uv) builds the venv and installs the dev requirements: make venv took 14-34 s from
# fresh clones on 2 cores, where pip took 35-47 s (its venv 7 s, pip upgrade 3 s, install 34 s, measured); any uv
# step that fails falls back to pip, which gives the same packages from the same index.
# The controller's Python: the newest that the core of requirements-dev.txt supports (tests/tools/pick_python.sh;
# PY=/path/to/python names one); none: one line saying what is missing.
set -euo pipefail
venv=$1 wheels=$2
core=$(sed -n 's/^ansible-core>=\([0-9]*\.[0-9]*\).*/\1/p' requirements-dev.txt)
python=$(bash tests/tools/pick_python.sh "$core") || exit 1   # the interpreter itself, not a version manager's shim
echo "make venv: ansible-core $core on $python"
uv=.cache/uv/bin/uv
export UV_COMPILE_BYTECODE=1   # uv writes no bytecode by default, and PYTHONDONTWRITEBYTECODE may be set

get_uv() {
    [ -x "$uv" ] || "$python" -m pip install -q --disable-pip-version-check --target .cache/uv uv
}

if get_uv && "$uv" venv -q --clear --seed -p "$python" "$venv"; then
    installer=uv
else
    echo "make venv: uv is not available; pip builds the venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    installer=pip
fi
mkdir -p "$wheels"
# the targets' wheels: for the lab's containers and nodes, which run the system's python3 (lablib.lab.system_python),
# not the controller's Python
target=$("$python" -c 'import sys; sys.path.insert(0, "tests/lab"); from lablib.lab import system_python; print(system_python())')
target_version=$("$target" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
"$venv/bin/python" -m pip download -q -d "$wheels" --python-version "$target_version" --only-binary=:all: \
    -r requirements-target.txt supervisor proxmoxer requests
# the lab's venvs (from those wheels) and its NVML stand-in build on the core that the install leaves idle
"$python" tests/lab/lablib/prepare.py &
prepare=$!
if [ "$installer" != uv ] || ! "$uv" pip install -q -p "$venv/bin/python" -r requirements-dev.txt; then
    [ "$installer" = pip ] || echo "make venv: uv pip install failed; pip installs the requirements" >&2
    "$venv/bin/python" -m pip install -q -r requirements-dev.txt
fi
wait "$prepare"
