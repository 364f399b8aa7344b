#!/usr/bin/env bash
# make venv: the test venv (.venv), the target wheels (.cache/wheels) and, beside the install, the lab's venvs
# and NVML stand-in (tests/lab/lablib/prepare.py).
# uv (from PyPI, kept in .cache/uv) builds the venv and installs the dev requirements: make venv took 14-34 s from
# fresh clones on 2 cores, where pip took 35-47 s (its venv 7 s, pip upgrade 3 s, install 34 s, measured); any uv
# step that fails falls back to pip, which gives the same packages from the same index.
set -euo pipefail
py=$1 venv=$2 wheels=$3
python=$("$py" -c 'import sys; print(sys.executable)')   # the interpreter itself, not a version manager's shim
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
"$venv/bin/python" -m pip download -q -d "$wheels" -r requirements-target.txt supervisor proxmoxer requests
# the lab's venvs (from those wheels) and its NVML stand-in build on the core that the install leaves idle
"$python" tests/lab/lablib/prepare.py &
prepare=$!
if [ "$installer" != uv ] || ! "$uv" pip install -q -p "$venv/bin/python" -r requirements-dev.txt; then
    [ "$installer" = pip ] || echo "make venv: uv pip install failed; pip installs the requirements" >&2
    "$venv/bin/python" -m pip install -q -r requirements-dev.txt
fi
wait "$prepare"
