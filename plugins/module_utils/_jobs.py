# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Tensor-parallel jobs: GPU holders joined directly by connected sockets (private helper).

NCCL's bootstrap and torch's TCP store link every pair of ranks by TCP
(GPU_FACTS row 21). Process group, session, a common parent or inherited
stdio group unrelated processes too, and links through a non-holder do not
count: only a socket of one holder whose peer socket belongs to another.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan

TCP_TABLES = ("tcp", "tcp6")


def _established(pid, proc_root):
    """Established TCP sockets in pid's network namespace: [(inode, local, remote)]."""
    out = []
    for table in TCP_TABLES:
        try:
            out.extend(procscan.parse_tcp_table(procscan.read_text("%s/%d/net/%s" % (proc_root, pid, table))))
        except OSError:
            continue
    return out


def links(holders, proc_root="/proc"):
    """Pairs (pid, pid) of holders joined by a connected TCP socket, read per network namespace."""
    by_netns = {}
    for record in holders:
        if record.get("_sockets"):
            by_netns.setdefault(procscan.namespace_inode(record["pid"], "net", proc_root), []).append(record)
    pairs = set()
    for netns, members in by_netns.items():
        if netns is None or len(members) < 2:
            continue
        owners = {}
        for record in members:
            for inode in record["_sockets"]:
                owners.setdefault(inode, set()).add(record["pid"])
        by_endpoints = {}
        for inode, local, remote in _established(members[0]["pid"], proc_root):
            if inode in owners:
                by_endpoints.setdefault((local, remote), set()).update(owners[inode])
        for (local, remote), pids in by_endpoints.items():
            for peer in by_endpoints.get((remote, local), ()):
                for pid in pids:
                    if pid != peer:
                        pairs.add((min(pid, peer), max(pid, peer)))
    return pairs


def find_jobs(holders, proc_root="/proc"):
    """{job id: {"id", "pids", "members"}}, one per group of two or more linked holders; sets record["job"]."""
    parent = dict((r["pid"], r["pid"]) for r in holders)

    def root(pid):
        while parent[pid] != pid:
            parent[pid] = parent[parent[pid]]
            pid = parent[pid]
        return pid

    for a, b in links(holders, proc_root):
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups = {}
    for record in holders:
        groups.setdefault(root(record["pid"]), []).append(record)
    jobs = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        job_id = min(m["pid"] for m in members)
        jobs[job_id] = {"id": job_id, "pids": sorted(m["pid"] for m in members),
                        "members": sorted(members, key=lambda m: m["pid"])}
    for record in holders:
        record["job"] = None
        for job in jobs.values():
            if record["pid"] in job["pids"]:
                record["job"] = job["id"]
    return jobs
