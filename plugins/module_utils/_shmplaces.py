# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The /dev/shm places an Engine reads and their users (private helper; evidence layer).

A mixin of _gpu_engine.Engine: this host's /dev/shm and, from a node, each running container's, read by the
bounded reader one part at a time and never through a link; the processes that use files there; the Report's
residue as _shm.judge weighs them. Removing is _shmclean's (act).
"""

from __future__ import annotations

import errno

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm


class ShmPlaces(object):
    """Engine's reading of /dev/shm (uses its proc_root, view, shm_dir, node_root, shm_prefixes and read_timeout)."""

    def shm_places(self):
        """{None: this host's /dev/shm, vmid: each running container's (from a node), through its init's root}, each
        read by the bounded reader one part at a time, never through a link (_read_place)."""
        parts = shm.folder_parts(self.shm_dir)
        spots = [(None, self.node_root, "self")]
        if self.view == "node":
            spots += [(vmid, "%s/%d/root" % (self.proc_root, init), init)
                      for vmid, init in sorted(node.container_inits(self.proc_root).items(), key=lambda i: int(i[0]))]
        places = dict((key, self._read_place(root, parts, procscan.namespace_inode(ns_of, "mnt", self.proc_root)))
                      for key, root, ns_of in spots)
        if self.view == "container" and places[None]["why"] is None:
            places[None]["why"] = self._foreign_why(places[None])
        return places

    def _foreign_why(self, place):
        """Inside a container, _shm.foreign_why of its /dev/shm: made outside it (a folder of the node's bound in)."""
        try:
            mountinfo = procscan.read_text("/proc/self/mountinfo")
        except OSError:
            mountinfo = ""
        return shm.foreign_why(place, self.foreign_owner(), shm.mount_of(self.shm_dir, mountinfo, place["dev"]))

    def foreign_owner(self):
        """Inside a container, the (uid, gid) an owner it does not map shows as; None elsewhere."""
        return tuple(node.overflow_id(kind) for kind in ("uid", "gid")) if self.view == "container" else None

    def _read_place(self, root, parts, mnt):
        """One /dev/shm folder: {path, label, root, parts, mnt, dev, entries (None: not read), why (not read)}."""
        label = root.rstrip("/") + "/" + "/".join(parts)
        place = {"path": self.shm_dir, "label": label, "root": root, "parts": parts, "mnt": mnt, "dev": None,
                 "ino": None, "entries": None, "why": None}
        timeout = self.read_timeout()
        try:
            place.update(procscan.list_folder(root, parts, timeout))
        except procscan.ReadBlocked:
            place["why"] = "%s did not answer within %gs (a hung mount?): not read, nothing in it is removed" % (
                label, timeout)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                place["entries"] = []
            elif exc.errno in (errno.ELOOP, errno.ENOTDIR):
                place["why"] = ("%s: a part of %s is a symbolic link or no folder (never followed): not read, nothing "
                                "in it is removed" % (label, self.shm_dir))
            else:
                place["why"] = "%s cannot be read (%s): nothing in it is removed" % (label, exc.strerror or exc)
        return place

    def _shm_key(self, pid, scan):
        """The place of a process's own /dev/shm: None (this host's), its container's vmid, or shm.UNKNOWN."""
        if self.view != "node":
            return None
        where = node.container_of_pid(pid, self.proc_root, scan)
        return None if where == node.HOST else (shm.UNKNOWN if where is None else where)

    def shm_users(self, scan, places):
        """(files some process maps or has open, {place: names its processes' fds and maps name}, [processes not
        read]) of a scan with shm: the evidence _shm.judge weighs. A name counts in its process's container's place
        and in each place seen from its mount namespace."""
        used = set()
        for files in scan.shm_files.values():
            used.update(files)
        names = {}
        for pid, paths in scan.shm_paths.items():
            mnt = procscan.namespace_inode(pid, "mnt", self.proc_root)
            keys = set([self._shm_key(pid, scan)]) | set(k for k, p in places.items() if mnt is not None and p["mnt"] == mnt)
            for key in keys:
                names.setdefault(key, set()).update(n for n in (shm.used_name(p) for p in paths) if n)
        why = dict((b["pid"], "its maps read %s" % ("was cut" if b.get("reason") == "truncated" else "blocked"))
                   for b in scan.blocked)
        unreadable = []
        for pid in scan.unreadable:
            key = self._shm_key(pid, scan)
            unreadable.append({"pid": pid, "key": key, "reason": why.get(pid), "everywhere": self.view == "node" and key is None,
                               "mnt": procscan.namespace_inode(pid, "mnt", self.proc_root)})
        return used, names, unreadable

    def _shm_report(self, report, places, scan, since):
        """The report's residue by place (shm_residue: this host's; shm_residue_by_container from a node) and the
        folders skipped, as _shm.judge weighs the places and their users."""
        used, names, unreadable = self.shm_users(scan, places)
        judged = shm.judge(places, used, names, unreadable, since, self.shm_prefixes, self.foreign_owner())
        report.shm_places, report.shm_judged = places, judged
        public = dict((key, [shm.public(e) for e in verdict["residue"]]) for key, verdict in judged.items())
        report.shm_residue = public[None]
        if self.view == "node":
            report.shm_residue_by_container = dict((k, v) for k, v in public.items() if k is not None)
        report.shm_skipped = [{"vmid": None if key is None else int(key), "path": self.shm_dir, "why": verdict["skipped"]}
                              for key, verdict in sorted(judged.items(), key=lambda i: shm.place_order(i[0]))
                              if verdict["skipped"]]
