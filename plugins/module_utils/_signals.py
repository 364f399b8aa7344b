# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Signals, each guarded against pid reuse (private helper): the one place the release signals a scanned process.

No AnsibleModule here. psutil is needed here only (the guard without pidfd): declared with _deps, which the module's
glue validates.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps
from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where

psutil = None
with deps.declare("psutil", reason="to signal processes, each guarded against pid reuse"):
    import psutil


def _now_ticks(proc_root="/proc"):
    """Now, in the clock ticks since boot that /proc/PID/stat's starttime uses.

    starttime counts CLOCK_BOOTTIME from the node's boot. /proc/uptime is no such clock inside a
    Proxmox container: LXCFS replaces it with the container's uptime. So the live /proc is compared
    with CLOCK_BOOTTIME itself; only a recorded /proc tree (tests) supplies its own uptime file.
    """
    try:
        if proc_root == "/proc" and hasattr(time, "CLOCK_BOOTTIME"):
            seconds = time.clock_gettime(time.CLOCK_BOOTTIME)
        else:
            seconds = float(where.uptime_text(proc_root).split()[0])
        return int(seconds * os.sysconf("SC_CLK_TCK")) - 1
    except (OSError, ValueError, IndexError):
        return 0


def _pin(pid, use_pidfd):
    """(pidfd or None, "gone" or None): a pidfd pins the process, when this Python and kernel have one."""
    pidfd_open = getattr(os, "pidfd_open", None) if use_pidfd else None
    if pidfd_open is None or not hasattr(signal, "pidfd_send_signal"):
        return None, None
    try:
        return pidfd_open(pid), None
    except ProcessLookupError:
        return None, "gone"
    except OSError:
        return None, None


def _refusal(record, proc_root, recheck):
    """Why the pinned process of record is not signalled ("gone", "not sent: ..."), or None: send it."""
    pid = record["pid"]
    stat = where.stat_of(pid, proc_root)
    if stat is None:
        return "gone"
    if (pid, stat["starttime"]) != holder.ident_of(record):
        return "not sent: pid %d was reused by another process" % pid
    refusal = recheck(record) if recheck is not None else None
    if refusal == "gone":
        return "gone"
    if refusal:
        return "not sent: %s" % refusal
    return None


def _by_psutil(record, sig):
    """The signal through psutil, whose create-time check guards a reused pid (no pidfd)."""
    pid = record["pid"]
    try:
        proc = psutil.Process(pid)
        if record.get("create_time") is not None and abs(proc.create_time() - record["create_time"]) > 0.05:
            return "not sent: pid %d was reused by another process" % pid
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.AccessDenied as exc:
        return "error: access denied (%s)" % exc
    except psutil.Error as exc:
        return "error: %s" % exc
    return "sent"


def _deliver(record, sig, pidfd):
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except ProcessLookupError:
            return "gone"
        return "sent"
    if psutil is not None:
        return _by_psutil(record, sig)
    os.kill(record["pid"], sig)
    return "sent"


def send_guarded(record, sig, proc_root="/proc", use_pidfd=True, recheck=None):
    """Send sig to the process of record unless its pid now names another process; return the outcome.

    A pidfd pins the process; its start time is then checked, so the signal
    cannot reach a reused pid. Without pidfd (Python < 3.9, or use_pidfd=False),
    psutil's create-time check guards it. recheck(record), when given, is asked
    once the process is pinned (a node-side release re-reads the container) and
    a reason it gives stops the signal. Never raises: a refusal is an outcome.
    """
    pidfd, gone = _pin(record["pid"], use_pidfd)
    if gone:
        return gone
    try:
        return _refusal(record, proc_root, recheck) or _deliver(record, sig, pidfd)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return "gone"
        return "error: %s" % exc
    finally:
        if pidfd is not None:
            os.close(pidfd)
