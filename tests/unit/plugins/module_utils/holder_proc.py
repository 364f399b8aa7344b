"""A real process that holds fake device files the way a CUDA process does (for ladder tests).

python holder_proc.py KIND DEV_DIR MINOR: prints 'ready' once it maps the files, then sleeps.
Like CUDA on driver 580 (GPU_FACTS rows 9 and 12): the context's node is mapped 3 times,
every other /dev/nvidiaN of DEV_DIR twice.
KIND: plain, term_ignoring, defunct (the leader exits, threads keep the mappings),
let_go_on_term (on SIGTERM it closes and unmaps everything, then lives on: a checkpoint writer).
"""
import ctypes
import mmap
import os
import signal
import sys
import threading
import time

kind, dev_dir, minor = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "term_ignoring":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def let_go(signum, frame):
    for mapping in maps:
        mapping.close()
    for fd in fds:
        os.close(fd)


if kind == "let_go_on_term":
    signal.signal(signal.SIGTERM, let_go)
fds = [os.open(os.path.join(dev_dir, name), os.O_RDWR) for name in ("nvidiactl", "nvidia" + minor, "nvidia-uvm")]
maps = [mmap.mmap(fd, 4096) for fd in fds] + [mmap.mmap(fds[1], 4096) for dummy in range(2)]
for name in sorted(os.listdir(dev_dir)):
    if name.startswith("nvidia") and name[6:].isdigit() and name != "nvidia" + minor:
        fd = os.open(os.path.join(dev_dir, name), os.O_RDWR)
        maps += [mmap.mmap(fd, 4096) for dummy in range(2)]
sys.stdout.write("ready\n")
sys.stdout.flush()
if kind == "defunct":
    for dummy in range(2):
        threading.Thread(target=time.sleep, args=(600,)).start()
    ctypes.CDLL(None).syscall(60, 0)
while True:
    time.sleep(600)
