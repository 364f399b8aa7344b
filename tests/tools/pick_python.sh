#!/usr/bin/env bash
# Print the newest Python that ansible-core CORE supports as a controller, found on this machine:
#
#     tests/tools/pick_python.sh 2.21        # make venv (the core of requirements-dev.txt)
#     tests/tools/pick_python.sh 2.16        # make test-matrix, one call a core (tests/tools/matrix.py)
#
# PY, when set, is the only candidate (make venv PY=/usr/bin/python3.12). Otherwise, for each version newest first:
# python3.X on PATH, then pyenv's own builds (a pyenv shim of a version that is not selected does not run, so the
# shim alone is not enough), then /usr/local/bin and /usr/bin (PICK_PYTHON_DIRS: other folders). A candidate counts when it runs, is that version and
# can build a venv (ensurepip). Nothing found: one line on stderr naming what is missing, exit 1.
set -uo pipefail
core=${1:-}
# ansible-test's CONTROLLER_PYTHON_VERSIONS of each core, newest first
# (tests/unit/tools/test_pick_python.py checks them against the installed ansible-core)
case "$core" in
    2.16 | 2.17) versions="3.12 3.11 3.10" ;;
    2.18 | 2.19) versions="3.13 3.12 3.11" ;;
    2.20 | 2.21) versions="3.14 3.13 3.12" ;;
    *) echo "pick_python: no controller Pythons known for ansible-core '$core' (known: 2.16 to 2.21)" >&2; exit 2 ;;
esac

works() {   # $1 a path or command, $2 X.Y: prints the interpreter's own path when it is X.Y and has ensurepip
    "$1" -c 'import sys, ensurepip
if "%d.%d" % sys.version_info[:2] != sys.argv[1]:
    raise SystemExit(1)
print(sys.executable)' "$2" 2>/dev/null
}

if [ -n "${PY:-}" ]; then
    for version in $versions; do
        works "$PY" "$version" && exit 0
    done
    echo "pick_python: PY=$PY is not a working Python ${versions// /, } (what ansible-core $core supports as a controller)" >&2
    exit 1
fi
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
for version in $versions; do
    candidates=("python$version")
    # pyenv's builds of X.Y, newest patch first
    builds=()
    for build in "$pyenv_root/versions/$version".*; do
        [ -d "$build" ] && builds+=("$build")
    done
    while IFS= read -r build; do
        [ -n "$build" ] && candidates+=("$build/bin/python$version")
    done < <(printf '%s\n' "${builds[@]}" | sort -rV)
    for dir in ${PICK_PYTHON_DIRS:-/usr/local/bin /usr/bin}; do
        candidates+=("$dir/python$version")
    done
    for candidate in "${candidates[@]}"; do
        works "$candidate" "$version" && exit 0
    done
done
list=${versions% *}; list="${list// /, } or ${versions##* }"
echo "pick_python: no Python $list with venv support for ansible-core $core's controller (looked on PATH, in $pyenv_root/versions, ${PICK_PYTHON_DIRS:-/usr/local/bin /usr/bin}); install one (pyenv install ${versions%% *}, or apt-get install python${versions##* }-venv) or name it with PY=" >&2
exit 1
