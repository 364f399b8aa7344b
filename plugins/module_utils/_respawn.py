# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Respawn by parentage: new processes under the parents of killed holders (private helper).

Whatever started a holder may start it again: a supervisor, a shell loop, a
launcher such as torchrun. Whatever the parent's name, a process that starts
under it after the kill and maps a targeted GPU, or that NVML names on one, is
a respawn. The watch reads the parents' children and their maps, never a whole
snapshot. No AnsibleModule here.
"""

from __future__ import annotations

import os

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

CHAIN_MAX = 16


def service_unit(cgroup):
    """The systemd unit a cgroup path ends in (NAME.service), or None."""
    last = str(cgroup or "").rstrip("/").rsplit("/", 1)[-1]
    return last if last.endswith(".service") else None


def _is_init(pid, proc_root):
    """pid 1 of its PID namespace (a node's or a container's init): it adopts orphans."""
    if pid == 1:
        return True
    try:
        status = procscan.parse_status(procscan.read_text("%s/%d/status" % (proc_root, pid)))
    except OSError:
        return False
    return (status.get("nspid") or [0])[-1] == 1


def _chain(pid, proc_root):
    """[{pid, name}] from pid up to the top of this PID namespace."""
    out = []
    for current in [pid] + procscan.ancestors(pid, proc_root)[:CHAIN_MAX]:
        stat = procscan.read_stat(current, proc_root)
        out.append({"pid": current, "name": stat["comm"] if stat else None})
    return out


def how_to_stop(parent, unit=None):
    """One sentence on what to stop so that the holder stays dead."""
    if unit:
        return "stop the unit first (systemctl stop %s), then release again" % unit
    if parent["name"] == "supervisord":
        return "stop the program first (supervisorctl stop NAME), then release again"
    return ("stop pid %d (%s) or what runs it first (a shell loop, a launcher such as torchrun, a supervisor), "
            "then release again" % (parent["pid"], parent["name"]))


class RespawnWatch(object):
    """Watches the live parents of the holders signalled since since_ticks (clock ticks of /proc starttime)."""

    def __init__(self, proc_root, devices, target_minors, since_ticks, known_pids=()):
        self.proc_root = proc_root
        self.devices = devices
        self.target_minors = set(target_minors)   # None among them: a GPU that cannot be described
        self.since = since_ticks
        self.known = set(known_pids)
        self.killed = set()
        self.old = set()        # pids seen started before the kill
        self.parents = {}       # pid -> {pid, name, starttime, chain, unit, cgroup, killed_names}
        self.pending = {}       # pid -> (stat, parent) of a new child that maps no targeted GPU yet
        self.found = None

    def add(self, record):
        """Watch the parent of a holder that was just signalled (an init only for a service's holder)."""
        self.killed.add(record["pid"])
        self.parents.pop(record["pid"], None)
        ppid = record.get("ppid")
        if ppid in self.parents:
            self.parents[ppid]["killed_names"].add(record["name"])
        if not ppid or ppid in self.parents or ppid in self.killed:
            return
        stat = procscan.read_stat(ppid, self.proc_root)
        if stat is None:
            return
        init = _is_init(ppid, self.proc_root)
        unit = service_unit(record.get("cgroup")) if init else None
        if init and not unit:
            return  # an orphan's adopter restarts nothing
        self.parents[ppid] = {"pid": ppid, "name": stat["comm"], "starttime": stat["starttime"],
                              "chain": _chain(ppid, self.proc_root), "unit": unit, "cgroup": record.get("cgroup"),
                              "killed_names": set([record["name"]])}

    def live_parents(self):
        return [p for p in self.parents.values() if procscan.same_process(p["pid"], p["starttime"], self.proc_root)]

    def _new_processes(self):
        """{pid: stat} of the processes started since the kill that this release did not know.

        A pid seen started before the kill is not read again while it stays listed (a poll reads
        only what is new); one that leaves the listing may come back as a new process.
        """
        out = {}
        listed = set(int(name) for name in os.listdir(self.proc_root) if name.isdigit())
        self.old &= listed
        for pid in listed - self.known - self.old:
            stat = procscan.read_stat(pid, self.proc_root)
            if stat is None:
                continue
            if stat["starttime"] >= self.since:
                out[pid] = stat
            else:
                self.old.add(pid)
        return out

    def _watched_parent(self, pid, new):
        """The watched parent pid descends from through processes started after the kill, or None."""
        current = pid
        for dummy in range(CHAIN_MAX):
            ppid = new[current]["ppid"]
            parent = self.parents.get(ppid)
            if parent is not None and procscan.same_process(ppid, parent["starttime"], self.proc_root):
                return parent
            if ppid not in new:
                return None
            current = ppid
        return None

    def _maps_target(self, pid):
        try:
            maps = procscan.read_bytes("%s/%d/maps" % (self.proc_root, pid))
        except OSError:
            return False
        root = "%s/%d/root" % (self.proc_root, pid)
        for path in procscan.parse_maps_counts(maps, self.devices):
            kind = self.devices.classify(path)
            if not kind or kind[0] != "gpu":
                continue
            if None in self.target_minors or procscan.gpu_minor(path, self.devices, root) in self.target_minors:
                return True
        return False

    def _cgroup(self, pid):
        try:
            return procscan.parse_cgroup(procscan.read_text("%s/%d/cgroup" % (self.proc_root, pid)))
        except OSError:
            return None

    def poll(self, nvml_named=None):
        """The first respawn seen now, as the `respawned` dict, or None.

        nvml_named, when given, is called only while a new child maps nothing targeted yet, and returns
        the pids NVML names on a targeted GPU.
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
            if parent["unit"] and self._cgroup(pid) != parent["cgroup"]:
                continue  # an init's new child of another unit
            hit = self._maps_target(pid)
            if not hit:
                if named is None:
                    named = set(nvml_named()) if nvml_named is not None else set()
                hit = "named by NVML on a targeted GPU" if pid in named else False
            if hit and procscan.same_process(pid, stat["starttime"], self.proc_root):
                return self._found(pid, stat, parent, "maps a targeted GPU" if hit is True else hit)
            pending[pid] = (stat, parent)
        self.pending = pending
        return None

    def _found(self, pid, stat, parent, evidence):
        self.found = {"pid": pid, "name": stat["comm"], "parent_pid": parent["pid"], "parent_name": parent["name"],
                      "chain": parent["chain"], "unit": parent["unit"], "evidence": evidence,
                      "how_to_stop": how_to_stop(parent, parent["unit"])}
        return self.found

    def starting_again(self):
        """At the window's end: a new child, still starting (no GPU yet), named like a holder killed under the
        same parent. A real CUDA program takes seconds to map its context; the same program started again
        under the same parent after the kill is a respawn all the same."""
        if self.found is not None:
            return self.found
        for pid, (stat, parent) in sorted(self.pending.items()):
            if stat["comm"] in parent["killed_names"] and procscan.same_process(pid, stat["starttime"], self.proc_root):
                return self._found(pid, stat, parent, "started again under the same parent as killed %s, still "
                                   "starting (no GPU mapped yet)" % stat["comm"])
        return None


def respawn_message(found):
    chain = " < ".join("%d (%s)" % (p["pid"], p["name"]) for p in found["chain"])
    return ("respawned by pid %d (%s): stop the service first (new holder pid %d (%s) appeared under the same parent "
            "after the kill: %s; parent chain %s); %s"
            % (found["parent_pid"], found["parent_name"], found["pid"], found["name"], found["evidence"], chain,
               found["how_to_stop"]))
