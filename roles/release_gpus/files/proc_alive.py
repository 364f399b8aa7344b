"""Print the pids still alive for a pidfile or a cmdline regex, as JSON. Changes nothing.

python3 proc_alive.py PIDFILE PATTERN   (either may be empty)
"""
import json
import os
import re
import sys

pidfile, pattern = sys.argv[1], sys.argv[2]


def ancestors(pid):
    # This process and its parents carry the pattern in their argv: never count them.
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open("/proc/%d/stat" % pid) as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


mine = ancestors(os.getpid())
alive = []
if pidfile:
    try:
        with open(pidfile) as handle:
            pid = int(handle.read().split()[0])
        os.kill(pid, 0)
        alive.append(pid)
    except (OSError, ValueError, IndexError):
        pass
if pattern:
    regex = re.compile(pattern)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        # A zombie has an empty cmdline and is gone for every practical purpose.
        if cmdline and regex.search(cmdline):
            alive.append(int(entry))
print(json.dumps({"alive": sorted(set(alive))}))
