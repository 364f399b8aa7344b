# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""clean_shm: remove the /dev/shm residue a report judged, in the folders a release may clean (private helper).

Act only (issue 43): the folders, their users and the verdicts are the engine's (_gpu_engine.shm_places,
shm_users) and _shm's (judge, shared_outside). Right before the removals the folders and every process's users
are read and judged again; a file is removed only when it is residue in both judgements, by the same (st_dev,
st_ino). The unlinks run in a helper process, bounded (a hung mount never hangs the release): it walks the folder
one part at a time with O_NOFOLLOW, checks the folder and each file are those judged, and unlinks by name in it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm

REMOVE_TIMEOUT_S = 5.0

# Runs in the helper: argv[1] is the job (JSON: root, parts, folder [dev, ino], since_ns, files [{name, dev, ino}]);
# it prints one JSON line: {"removed": [names], "left": [[name, why]]} or {"error": why}.
REMOVE_SOURCE = r"""
import json, os, stat, sys
job = json.loads(sys.argv[1])
removed, left = [], []
try:
    fd = os.open(job["root"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in job["parts"]:
        child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        os.close(fd)
        fd = child
    st = os.fstat(fd)
except OSError as exc:
    print(json.dumps({"error": "cannot open the folder: %s" % (exc.strerror or exc)}))
    sys.exit(0)
if [st.st_dev, st.st_ino] != job["folder"]:
    print(json.dumps({"error": "the folder is another one than the one judged"}))
    sys.exit(0)
for entry in job["files"]:
    try:
        st = os.stat(entry["name"], dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or [st.st_dev, st.st_ino] != [entry["dev"], entry["ino"]]:
            left.append([entry["name"], "another file than the one judged, or no longer a file"])
        elif st.st_mtime_ns >= job["since_ns"]:
            left.append([entry["name"], "changed since the release started"])
        else:
            os.unlink(entry["name"], dir_fd=fd)
            removed.append(entry["name"])
    except FileNotFoundError:
        pass   # gone already (a release inside the container, the program itself): neither removed here nor left
    except OSError as exc:
        left.append([entry["name"], exc.strerror or str(exc)])
print(json.dumps({"removed": removed, "left": left}))
"""


def in_scope(engine, scope, places):
    """The places a release may clean: this host's (None) inside a container, or from a node without containers
    or with host_processes; the scoped containers' (by vmid) from a node."""
    if engine.view != "node":
        return set([None])
    keys = set(k for k in places if k is not None and scope is not None and k in scope.containers)
    if scope is None or scope.host_processes or not scope.containers:
        keys.add(None)
    return keys


def chosen(places, judged, keys):
    """({key: residue to remove}, [{vmid, path, why}] folders in scope not cleaned: skipped when judged, or one
    mount with a folder out of scope)."""
    found, skipped = {}, []
    for key in sorted(keys, key=shm.place_order):
        why = judged[key]["skipped"] or shm.shared_outside(places, key, keys)
        if why:
            skipped.append({"vmid": None if key is None else int(key), "path": places[key]["path"], "why": why})
        else:
            found[key] = judged[key]["residue"]
    return found, skipped


def _judged_again(engine, since, prefixes):
    """The places, read again, and their verdicts on fresh evidence (every process's users read again)."""
    places = engine.shm_places()
    used, names, unreadable = engine.shm_users(engine.scan(places), places)
    return places, shm.judge(places, used, names, unreadable, since, prefixes, engine.foreign_owner())


def remove(place, entries, since, timeout):
    """Unlink entries from one place's folder in a bounded helper: (removed entries, [(entry, why)] left). A helper
    past timeout is killed and waited for at most the rest of timeout's second (then abandoned)."""
    job = {"root": place["root"], "parts": place["parts"], "folder": [place["dev"], place["ino"]],
           "since_ns": int(since * 1e9), "files": [{"name": e["name"], "dev": e["dev"], "ino": e["ino"]} for e in entries]}
    argv = [sys.executable or "python3", "-S", "-c", REMOVE_SOURCE, json.dumps(job)]
    try:
        dummy, out = helperproc.run_bounded(argv, timeout, kill_wait=min(helperproc.KILL_WAIT_S, 1.0))
        answer = json.loads(out.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return [], [(e, "%s did not answer within %gs (a hung mount?): not removed" % (place["label"], timeout))
                    for e in entries]
    except (ValueError, IndexError, OSError) as exc:
        return [], [(e, "the removal helper failed: %s" % exc) for e in entries]
    if "error" in answer:
        return [], [(e, "%s: %s" % (place["label"], answer["error"])) for e in entries]
    by_name = dict((e["name"], e) for e in entries)
    return [by_name[n] for n in answer["removed"]], [(by_name[n], why) for n, why in answer["left"]]


def clean(engine, report, scope, since, check_mode, prefixes):
    """The residue the report judged in the folders in scope, removed unless check_mode (each file only when judged
    residue again on fresh evidence). Returns (found, removed, left, skipped): entries with their vmid (None: this
    host's), left with why, skipped folders with why."""
    keys = in_scope(engine, scope, report.shm_places)
    found, skipped = chosen(report.shm_places, report.shm_judged, keys)
    listed = [shm.shown(e, None if key is None else int(key)) for key in sorted(found, key=shm.place_order) for e in found[key]]
    removed, left = [], []
    if check_mode or not listed:
        return listed, removed, left, skipped
    places, judged = _judged_again(engine, since, prefixes)
    for key in sorted(found, key=shm.place_order):
        vmid = None if key is None else int(key)
        why = "no longer running" if key not in places else judged[key]["skipped"] or shm.shared_outside(places, key, keys)
        if why and found[key]:
            skipped.append({"vmid": vmid, "path": report.shm_places[key]["path"],
                            "why": "when read again right before the removals: %s" % why})
        elif found[key]:
            still = set((e["dev"], e["ino"]) for e in judged[key]["residue"])
            done, not_done = _remove_in_time(engine, places[key], [e for e in found[key] if (e["dev"], e["ino"]) in still],
                                             since)
            removed += [shm.shown(e, vmid) for e in done]
            left += [dict(shm.shown(e, vmid), why=why) for e, why in not_done]
            left += [dict(shm.shown(e, vmid), why="in use, or changed, when read again right before the removals: kept",
                          kept=True) for e in found[key] if (e["dev"], e["ino"]) not in still]
    return listed, removed, left, skipped


def _remove_in_time(engine, place, entries, since):
    """remove() within the time left to the engine's deadline; with none left, nothing is removed (each left)."""
    left_s = REMOVE_TIMEOUT_S if engine.deadline is None else min(REMOVE_TIMEOUT_S, engine.deadline - time.monotonic())
    if not entries:
        return [], []
    if left_s <= 0:
        return [], [(e, "not removed: the task's timeout was reached") for e in entries]
    return remove(place, entries, since, left_s)


def outcome_words(found, removed, left, skipped, check_mode):
    """What clean() did, as the words a release's message gets ("" when nothing)."""
    msg = ""
    if skipped:
        msg += "; /dev/shm not cleaned in %s" % "; ".join(
            "%s: %s" % ("this host" if e["vmid"] is None else "container %d" % e["vmid"], e["why"]) for e in skipped)
    if check_mode and found:
        msg += "; %d shared-memory residue files would be removed" % len(found)
    elif removed or left:
        msg += "; %d shared-memory residue files removed%s" % (len(removed), "" if not left else ", %d left (%s)" % (
            len(left), "; ".join("%s: %s" % (e["path"], e["why"]) for e in left)))
    return msg
