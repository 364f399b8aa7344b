# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Respawn by parentage: what started a killed holder starting a GPU holder again (private helper).

Whatever started a holder may start it again: a supervisor, a shell loop, a launcher such as torchrun, behind a
wrapper that exits with its child. The watch follows each killed holder's ancestors up to its innermost manager
(W1), never above its container. A process that starts under one of them after the kill is a respawn when it holds
a targeted GPU by the pinning rule (a context mapped there, named by NVML; a GPU it only sees is not one, C3), or, at
the window's end, when it is the same program as a killed holder (argv apart from numbers, its unit's main process,
or its supervisord program) still starting. The watch reads the new processes and their maps, never a whole
snapshot: what it reads of a process it asks evidence (_lineage, _holder). No AnsibleModule here.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _jobs as jobs
from ansible_collections.gpuops.fleet.plugins.module_utils import _lineage as lineage
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import generic_unit

CHAIN_MAX = 16
# ancestors that start many programs for many people: the watch stops below them (a new login is no respawn)
NOT_WATCHED = ("sshd", "sshd-session", "cron", "crond", "atd", "systemd", "init", "dockerd", "containerd", "lxc-start",
               "lxc-attach", "tmux: server", "screen", "SCREEN", "login", "agetty")
# managers that restart their programs: watched, and the watch stops at them
RESTARTERS = ("supervisord", "runsv", "runsvdir", "s6-supervise", "s6-svscan", "containerd-shim", "conmon")


def how_to_stop(parent, unit=None):
    """One sentence on what to stop so that the holder stays dead."""
    if unit:
        return "stop the unit first (systemctl stop %s), then release again" % unit
    if parent["name"] == "supervisord":
        return "stop the program first (supervisorctl stop NAME), then release again"
    return ("stop pid %d (%s) or what runs it first (a shell loop, a launcher such as torchrun, a supervisor), "
            "then release again" % (parent["pid"], parent["name"]))


def identity(pid, proc_root, argv=None, cgroup=None, ppid=None):
    """What makes a process the same program as another (C3): its argv apart from numbers; its unit when it is the
    unit's main process (its parent an init: what Restart= starts again; never a generic unit); its supervisord
    program. A set of keys."""
    if argv is None:
        argv = jobs.read_argv(pid, proc_root)
    out = set([("argv", tuple(jobs.NUMBERS.sub("#", a) for a in argv))]) if argv else set()
    if cgroup is None:
        cgroup = lineage.cgroup_of(pid, proc_root)
    if ppid is None:
        stat = lineage.stat_of(pid, proc_root)
        ppid = stat["ppid"] if stat else None
    unit = lineage.service_unit(cgroup)
    if unit and not generic_unit(unit) and ppid and lineage.is_init(ppid, proc_root):
        out.add(("unit", cgroup))
    program = stopsets.supervisord_program(pid, proc_root)
    if program:
        out.add(("program", program))
    return out


class RespawnWatch(object):
    """Watches the ancestors of the holders signalled since since_ticks (clock ticks of /proc starttime), up to their
    innermost manager (W1): a parent that exits with its child does not end the watch."""

    def __init__(self, proc_root, devices, target_minors, since_ticks, known_pids=(), stats=None):
        self.proc_root = proc_root
        self.stats = stats or {}   # pid -> the snapshot's stat of every process: the ancestors as they were
        self.devices = devices
        self.target_minors = set(target_minors)   # None among them: a GPU that cannot be described
        self.since = since_ticks
        self.known = set(known_pids)
        self.killed = set()
        self.identities = set()  # identity() keys of the killed holders
        self.old = set()        # pids seen started before the kill
        self.parents = {}       # pid -> {pid, name, starttime, chain, unit, cgroup}
        self.pending = {}       # pid -> (stat, parent) of a new child that maps no targeted GPU yet
        self.found = None

    def add(self, record):
        """Watch the ancestors of a holder that was just signalled, from its parent up to its innermost manager,
        never an init but for a service's holder, never above the container's init."""
        self.killed.add(record["pid"])
        self.parents.pop(record["pid"], None)
        self.identities |= identity(record["pid"], self.proc_root, record.get("_argv") or None, record.get("cgroup"),
                                    record.get("ppid"))
        where = lineage.where_of_cgroup(record.get("cgroup"))
        current = record.get("ppid")
        for dummy in range(CHAIN_MAX):
            if not current or current in self.parents:
                return
            stat, live = self._ancestor(current)
            if stat is None or stat["comm"] in NOT_WATCHED and not (live and lineage.is_init(current, self.proc_root)):
                return
            if live and where is not None and lineage.where_of_cgroup(lineage.cgroup_of(current, self.proc_root)) != where:
                return   # never above the holder's container (a pct exec's lxc-attach, the node's shell)
            if live and current not in self.killed and not self._watch(current, stat, record):
                return
            if stat["comm"].startswith(RESTARTERS) or (stat["session"] == current and stat.get("tty_nr")):
                return   # the innermost manager, or the top of a login's programs (a session leader with a terminal)
            current = stat["ppid"]

    def _ancestor(self, pid):
        """(stat, live) of an ancestor: read now; else, when it is gone since the snapshot (a wrapper that exited with
        its child between the signal and this read), the snapshot's stat, so that the walk goes on past it (W1);
        (None, False) when neither has it, or pid names another process now."""
        stat, known = lineage.stat_of(pid, self.proc_root), self.stats.get(pid)
        if stat is not None and (known is None or known["starttime"] == stat["starttime"]):
            return stat, True
        if known is not None and known["starttime"] < self.since:
            return known, False
        return None, False

    def _watch(self, pid, stat, record):
        """Watch pid; False when it is an init, watched only for a service's holder, and the chain ends there."""
        init = lineage.is_init(pid, self.proc_root)
        unit = lineage.service_unit(record.get("cgroup")) if init else None
        if init and not unit:
            return False  # an orphan's adopter restarts nothing
        self.parents[pid] = {"pid": pid, "name": stat["comm"], "starttime": stat["starttime"],
                             "chain": lineage.chain(pid, self.proc_root, CHAIN_MAX), "unit": unit, "cgroup": record.get("cgroup")}
        return not init

    def live_parents(self):
        return [p for p in self.parents.values() if holder.same_process((p["pid"], p["starttime"]), self.proc_root)]

    def _new_processes(self):
        """{pid: stat} of the processes started since the kill that this release did not know.

        A pid seen started before the kill is not read again while it stays listed (a poll reads
        only what is new); one that leaves the listing may come back as a new process.
        """
        out = {}
        listed = lineage.listed_pids(self.proc_root)
        self.old &= listed
        for pid in listed - self.known - self.old:
            stat = lineage.stat_of(pid, self.proc_root)
            if stat is None:
                continue
            if stat["starttime"] >= self.since:
                out[pid] = stat
            else:
                self.old.add(pid)
        return out

    def _watched_parent(self, pid, new):
        """The watched ancestor pid descends from through processes started after the kill, or None."""
        current = pid
        for dummy in range(CHAIN_MAX):
            ppid = new[current]["ppid"]
            parent = self.parents.get(ppid)
            if parent is not None and holder.same_process((ppid, parent["starttime"]), self.proc_root):
                return parent
            if ppid not in new:
                return None
            current = ppid
        return None

    def _same_program(self, pid):
        return bool(identity(pid, self.proc_root) & self.identities)

    def poll(self, nvml_named=None):
        """The first respawn seen now, as the `respawned` dict, or None.

        A respawn is a process started under a watched ancestor after the kill that holds a targeted GPU by the pinning
        rule: a context mapped on it (a GPU it only sees is not one), and NVML naming it on a targeted GPU when
        nvml_named (called once per poll, only when needed) is given. Its program may differ from the killed one's
        (a loop may pass a fresh token each round): what started the holder holds the GPU again.
        """
        if self.found is not None or not self.parents:
            return self.found
        new = self._new_processes()
        pending = {}
        named = None
        for pid in sorted(new):
            stat = new[pid]
            parent = self._watched_parent(pid, new)
            if parent is None or stat["state"] in ("Z", "X"):
                continue
            if parent["unit"] and lineage.parsed_cgroup(pid, self.proc_root) != parent["cgroup"]:
                continue  # an init's new child of another unit
            contexts = lineage.contexts_on(pid, self.proc_root, self.devices, self.target_minors)
            if contexts:
                if named is None:
                    named = set(nvml_named()) if nvml_named is not None else None
                if held_targets(pid, contexts, named) and holder.same_process((pid, stat["starttime"]), self.proc_root):
                    return self._found(pid, stat, parent, "%s, holding a targeted GPU (a context mapped%s)" % (
                        "the same program as a killed holder" if self._same_program(pid) else "started under it after "
                        "the kill", "" if named is None else ", named by NVML"))
            pending[pid] = (stat, parent)
        self.pending = pending
        return None

    def _found(self, pid, stat, parent, evidence):
        self.found = {"pid": pid, "name": stat["comm"], "parent_pid": parent["pid"], "parent_name": parent["name"],
                      "chain": parent["chain"], "unit": parent["unit"], "evidence": evidence,
                      "how_to_stop": how_to_stop(parent, parent["unit"])}
        return self.found

    def starting_again(self):
        """At the window's end: a new process under a watched ancestor, still starting (no GPU yet), that is the same
        program as a killed holder (its argv apart from numbers, its unit or its supervisord program). A real CUDA
        program takes seconds to map its context; the same program started again after the kill is a respawn."""
        if self.found is not None:
            return self.found
        for pid, (stat, parent) in sorted(self.pending.items()):
            if self._same_program(pid) and holder.same_process((pid, stat["starttime"]), self.proc_root):
                return self._found(pid, stat, parent, "the same program as a killed %s started again, still "
                                   "starting (no GPU mapped yet)" % stat["comm"])
        return None


def held_targets(pid, contexts, named):
    """The targeted GPUs (minors) a new process holds by the watch's evidence: a respawn is a trigger to act, so it
    asks holds, never the upper bound (a GPU it only sees, or maps, is no respawn). contexts: the targeted minors
    where it maps a context; named: the pids NVML names on the targeted GPUs (None: not asked). The watch reads no
    orphaned memory: a process NVML does not name holds nothing here."""
    evidence = {"pid": pid, "gpus": list(contexts) if named is None or pid in named else []}
    return [m for m in contexts if holder.holds(evidence, m)]


def respawn_message(found):
    chain = " < ".join("%d (%s)" % (p["pid"], p["name"]) for p in found["chain"])
    return ("respawned by pid %d (%s): stop the service first (new holder pid %d (%s) appeared under the same parent "
            "after the kill: %s; parent chain %s); %s"
            % (found["parent_pid"], found["parent_name"], found["pid"], found["name"], found["evidence"], chain,
               found["how_to_stop"]))
