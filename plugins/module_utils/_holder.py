# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The holder type and its two predicates (private helper; evidence layer).

A Holder is one process read from /proc and pinned (_pinning.pin): a read-only record with its identity as a
value, ident = (pid, starttime in clock ticks), as psutil's Process._ident. Every rule that asks "does this
process hold GPU g" asks one of two questions, and says which:

- may_hold(gpu): the upper bound. Pinned or ambiguous there, or pinned nowhere and mapping it (or mapping no
  GPU at all). For refusing, collateral, the reset guard, the restart rung's collateral and status' blockers:
  where a wrong "no" loses work or reports a held GPU free.
- holds(gpu): backed by evidence. Pinned there (NVML names it with a context there, or it is the only holder
  that fits orphaned memory there). For triggers to act: what is signalled, a respawn, a container that still
  holds a target. A mapping alone is no evidence: every CUDA process maps every visible GPU (GPU_FACTS row 9).

has_open(minor) says whether a process (a holder or an NVML client) has GPU minor's device file open.
The module functions take any record (a Holder, or a plain dict in tests); the methods are the same rules.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan


def may_hold(record, gpu):
    """The upper bound: may this process hold GPU gpu (an index)?"""
    if gpu in record["gpus"] or gpu in record["ambiguous_gpus"]:
        return True
    mapped = record["maps_gpus"] or record.get("unknown_mapped")
    return not record["gpus"] and (not mapped or gpu in record["maps_gpus"])


def holds(record, gpu):
    """The evidence: is this process pinned to GPU gpu (an index, or a minor where the record is keyed by minor)?"""
    return gpu in record["gpus"]


def has_open(record, minor):
    """Has this process the device file of GPU minor open (a client's only tie to a GPU)?"""
    return minor in (record.get("fd_gpu_minors") or ())


def ident_of(record):
    """(pid, starttime in clock ticks): what names one process, as psutil's _ident; a reused pid differs."""
    return (record["pid"], record.get("starttime_ticks"))


def same_process(ident, proc_root="/proc"):
    """True while ident's pid still names the process that started at ident's starttime."""
    return procscan.same_process(ident[0], ident[1], proc_root)


def alive(record, proc_root="/proc"):
    """Still the same process and still able to hold something (a one-thread zombie holds nothing)."""
    stat = procscan.read_stat(record["pid"], proc_root)
    if stat is None or stat["starttime"] != record["starttime_ticks"]:
        return False
    return not (stat["state"] in ("Z", "X") and stat["num_threads"] <= 1)


def _read_only(*dummy, **kwargs):
    raise TypeError("a Holder is read-only once built")


class Holder(dict):
    """One process's evidence, read-only once built (a dict, so that h["gpus"] and the module's JSON keep working)."""

    __slots__ = ("ident",)

    def __init__(self, record):
        dict.__init__(self, record)
        self.ident = ident_of(record)

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = _read_only

    def __reduce__(self):
        return (Holder, (dict(self),))

    def __ior__(self, other):
        return _read_only()

    def may_hold(self, gpu):
        return may_hold(self, gpu)

    def holds(self, gpu):
        return holds(self, gpu)

    def has_open(self, minor):
        return has_open(self, minor)

    def alive(self, proc_root="/proc"):
        return alive(self, proc_root)

    def same_process(self, proc_root="/proc"):
        return same_process(self.ident, proc_root)


def freeze(records):
    """Holders of records (a Holder stays itself): built once the evidence is complete."""
    return [r if isinstance(r, Holder) else Holder(r) for r in records]
