# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Tensor-parallel jobs: GPU holders joined directly by connected sockets (private helper).

NCCL's bootstrap and torch's TCP store link every pair of ranks by TCP
(GPU_FACTS row 21). Process group, session, a common parent or inherited
stdio group unrelated processes too, and links through a non-holder do not
count: only a socket of one holder whose peer socket belongs to another.
"""

from __future__ import annotations

import re

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


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NCCL_COMM_ID", "WORLD_SIZE")
LAUNCHERS = (re.compile(r"(^|/)torchrun$"), re.compile(r"(^|/)mpirun$"), re.compile(r"(^|/)mpiexec$"),
             re.compile(r"(^|/)deepspeed$"))
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
NUMBERS = re.compile(r"[0-9]+")
INTERPRETER = re.compile(r"^(python|perl|ruby|node|java)[0-9.]*$")


def read_argv(pid, proc_root):
    """The argv of a live pid (bounded read), [] when it cannot be read."""
    try:
        raw = procscan.read_bytes("%s/%d/cmdline" % (proc_root, pid))
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def is_launcher(argv):
    """torchrun, python -m torch.distributed.run, mpirun, deepspeed: never init, a supervisor or a shell."""
    if not argv:
        return False
    words = argv[:2] if len(argv) > 1 and "python" in argv[0].rsplit("/", 1)[-1] else argv[:1]
    if any(pattern.search(word) for word in words for pattern in LAUNCHERS):
        return True
    return any(argv[i] == "-m" and argv[i + 1] in LAUNCHER_MODULES for i in range(len(argv) - 1))


def signatures(record, proc_root="/proc"):
    """The rank signatures of one holder: {kind: key}; two linked holders sharing a key are ranks of one job."""
    out = {}
    env = procscan.read_environ(record["pid"], proc_root)
    dist = tuple((k, env[k]) for k in DIST_ENV if env.get(k))
    if dist:
        out["environment"] = dist
    parent = record.get("ppid")
    if parent and parent > 1 and is_launcher(read_argv(parent, proc_root)):
        out["launcher"] = parent
    argv = record.get("_argv") or []
    if argv:
        out["argv"] = tuple(NUMBERS.sub("#", a) for a in argv)
    title = record.get("name") or ""
    program = argv[0].rsplit("/", 1)[-1] if argv else ""
    # a title set by the program (prctl, setproctitle), not its executable's own name (python3)
    if NUMBERS.search(title) and title != program[:len(title)] and not INTERPRETER.match(title):
        out["title"] = NUMBERS.sub("#", title)
    return out


def _signature_text(kind, key):
    if kind == "environment":
        return "distributed-run settings " + " ".join("%s=%s" % pair for pair in key)
    if kind == "launcher":
        return "distributed launcher pid %d as common parent" % key
    if kind == "argv":
        return "rank siblings: the same argv apart from numbers"
    return "rank siblings: process titles that differ only by a number (%s)" % key


def find_jobs(holders, proc_root="/proc"):
    """({job id: {"id", "pids", "members", "signature"}}, [linked]); sets record["job"].

    A job is a group of holders joined by connected sockets, each link between two holders that
    share a rank signature, and one signature shared by every member (row 21; issue 18): matching
    distributed-run settings, a distributed launcher as common parent, or rank siblings. Members
    need not all be linked pairwise (ranks that meet at one TCP store link to its rank, not to each other).
    Linked holders without one are "linked": shown, never a job.
    """
    by_pid = dict((r["pid"], r) for r in holders)
    pairs = links(holders, proc_root)
    signs = dict((pid, signatures(by_pid[pid], proc_root)) for pid in set(p for pair in pairs for p in pair))
    return group_jobs(holders, pairs, signs)


def group_jobs(holders, pairs, signs):
    """The pure part of find_jobs: pairs of linked pids and each one's signatures ({kind: key}) -> (jobs, linked)."""
    parent = dict((r["pid"], r["pid"]) for r in holders)

    def root(pid):
        while parent[pid] != pid:
            parent[pid] = parent[parent[pid]]
            pid = parent[pid]
        return pid

    linked = []
    for a, b in sorted(pairs):
        shared = [kind for kind in ("environment", "launcher", "argv", "title")
                  if kind in signs[a] and signs[a].get(kind) == signs[b].get(kind)]
        if not shared:
            linked.append({"pids": [a, b], "why": "connected by TCP, not one job: no rank signature"})
            continue
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
        pids = sorted(m["pid"] for m in members)
        common = [kind for kind in ("environment", "launcher", "argv", "title")
                  if all(kind in signs[p] and signs[p][kind] == signs[pids[0]][kind] for p in pids)]
        if not common:
            # chained through different signatures (A-B by argv, B-C by environment): no one signature, no job
            linked.extend({"pids": [a, b], "why": "connected by TCP, not one job: the group shares no one rank "
                                                  "signature"} for a, b in sorted(pairs) if a in pids and b in pids)
            continue
        jobs[pids[0]] = {"id": pids[0], "pids": pids, "members": sorted(members, key=lambda m: m["pid"]),
                         "signature": [_signature_text(kind, signs[pids[0]][kind]) for kind in common]}
    for record in holders:
        record["job"] = None
        for job in jobs.values():
            if record["pid"] in job["pids"]:
                record["job"] = job["id"]
    return jobs, linked
