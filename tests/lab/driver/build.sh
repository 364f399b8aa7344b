#!/bin/sh
# Builds the lab's libnvidia-ml.so.1 stand-in into OUTDIR.
set -eu
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
gcc -shared -fPIC -O2 -Wall -Wextra -fvisibility=hidden \
    -Wl,-soname,libnvidia-ml.so.1 \
    -o "$1/libnvidia-ml.so.1" "$here/nvml_stub.c" -lpthread
ln -sf libnvidia-ml.so.1 "$1/libnvidia-ml.so"
