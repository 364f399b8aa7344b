# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The Report of one snapshot (private helper; evidence layer): the GPU entries, the holders and clients (Holders,
read-only), and what gpu_info returns (as_dict). Built by _gpu_engine.Engine.snapshot."""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan


def gpu_entry(engine, index, view, holders, clients, orphans, jobs, residue, trusted):
    """The report's entry of GPU index (every field gpu_info returns per GPU but by_container and passed_into)."""
    gpu = engine.gpu(index) or {"index": index}
    minor = gpu.get("minor")
    # status' holders are those the evidence pins there (holds); the upper bound's other members are named apart
    # (ambiguous, mapped_by); clients have its device file open (has_open)
    out = {
        "index": index,
        "minor": minor,
        "uuid": gpu.get("uuid"),
        "pci_bus_id": gpu.get("pci_bus_id"),
        "name": gpu.get("name"),
        "holders": sorted(h["pid"] for h in holders if holder.holds(h, index)),
        "ambiguous": sorted(h["pid"] for h in holders if index in h["ambiguous_gpus"]),
        "mapped_by": sorted(h["pid"] for h in holders if index in h["maps_gpus"]),
        "clients": sorted(c["pid"] for c in clients if holder.has_open(c, minor)),
        "residue": None,
        "nvml_pids_trusted": trusted,
    }
    if view["error"] or view["memory"] is None:
        out.update({"memory": view["memory"], "free": False, "nvml_processes": [], "unattributed_mib": None,
                    "error": view["error"] or "NVML gave no memory figures", "error_kind": view["error_kind"]})
        return out
    mem = view["memory"]
    out["memory"] = dict((k, mem[k]) for k in ("total_mib", "used_mib", "reserved_mib", "v1_used_mib"))
    if mem.get("estimated"):
        out["memory"]["estimated"] = True
        out["memory"]["note"] = ("estimated: this driver has no v2 memory call; used is v1 used minus "
                                 "reserved_floor_mib (%d MiB)" % mem["reserved_mib"])
    out["free"] = engine.is_free(mem)
    notes = {
        "holder": "holds this GPU here",
        "client": "only has device files open here (an NVML client), no context",
        "own_tree": "part of this module's own process tree",
        "not_holder": "exists here but maps no /dev/nvidia* node",
        "not_visible": ("not visible here: the process no longer exists, or it lives outside this PID namespace "
                        "(on the node or in another container)" if engine.in_container
                        else "not visible here: the process no longer exists"),
    }
    accepted = set(h["pid"] for h in holders if "nvml" in h["evidence"] and holder.holds(h, index))
    out["nvml_processes"] = []
    for proc in view["procs"]:
        note = notes[proc["status"]]
        if proc["status"] in ("holder", "client", "not_holder") and proc["pid"] not in accepted:
            note = ("stale here: %s; the driver reports host pids (legacy) or the pid was reused, so this entry "
                    "pins nobody" % pinning.stale_why(proc["pid"], index, proc["status"]))
        out["nvml_processes"].append({"pid": proc["pid"], "used_mib": proc["used_mib"], "status": proc["status"],
                                      "matches_holder": proc["pid"] in accepted, "note": note})
    orphan = orphans.get(index)
    out["unattributed_mib"] = orphan["unaccounted"] if (orphan and not out["free"]) else 0
    if index in residue:
        job = jobs[residue[index]]
        out["residue"] = {"job": job["id"], "pids": job["pids"], "mib": pinning.orphan_mib(orphan)}
    out["error"] = None
    return out


class Report(object):
    def __init__(self, engine, targets, gpus, holders, clients, scan):
        self.engine = engine
        self.targets = list(targets)
        self.gpus = gpus
        self.holders = sorted(holders, key=lambda r: r["pid"])
        self.clients = sorted(clients, key=lambda r: r["pid"])
        self.scan = scan
        self.zombies = []
        for zombie in scan.zombies:
            parent = procscan.read_stat(zombie["ppid"], engine.proc_root) if zombie["ppid"] else None
            self.zombies.append({"pid": zombie["pid"], "name": zombie["comm"], "ppid": zombie["ppid"],
                                 "parent_name": parent["comm"] if parent else None, "holds": []})
        self.diagnosis = []
        self.views, self.orphans, self.jobs, self.residue = {}, {}, {}, {}
        self.nvml_stale, self.linked, self.unknown_gpus = [], [], []
        self.protected_holders = []
        self.unreadable = []
        self.shm_residue = self.shm_residue_by_container = self.shm_skipped = None
        self.shm_places, self.shm_judged = {}, {}
        self.conf_vmids = None   # node view: the vmids with a config on this node (None: unread, or not a node)
        self.mps_servers = {}    # server pid -> what its control daemon says of its clients (mps.read_servers)
        self.mps_nvml_unread = {}  # GPU index -> why NVML's MPS client list could not be read there

    @property
    def all_free(self):
        """True only when there are GPUs and each is free: no GPU is never "all free"."""
        return bool(self.gpus) and all(g["free"] for g in self.gpus)

    @property
    def errors(self):
        return [g for g in self.gpus if g.get("error")]

    def holder(self, pid):
        for record in self.holders:
            if record["pid"] == pid:
                return record
        return None

    def job_gpus(self, job_id):
        """The GPUs a job's members are pinned to, plus those holding its residue."""
        job = self.jobs[job_id]
        gpus = set(g for m in job["members"] for g in m["gpus"])
        gpus.update(index for index, owner in self.residue.items() if owner == job_id)
        return sorted(gpus)

    def as_dict(self):
        def clean(record):
            out = dict((k, v) for k, v in record.items() if not k.startswith("_"))
            if "shares_mib" in out:
                out["shares_mib"] = dict((str(k), v) for k, v in sorted(out["shares_mib"].items()))
            return out
        out = {
            "gpus": self.gpus,
            "holders": [clean(h) for h in self.holders],
            "protected_holders": [clean(h) for h in self.protected_holders],
            "clients": [clean(c) for c in self.clients],
            "zombies": self.zombies,
            "jobs": [{"id": job["id"], "pids": job["pids"], "gpus": self.job_gpus(job["id"]), "signature": job["signature"]}
                     for job in sorted(self.jobs.values(), key=lambda j: j["id"])],
            "holders_unattributed": [h["pid"] for h in self.holders if h["unattributed"]],
            "linked": [{"pids": pair["pids"], "why": pair["why"]} for pair in self.linked],
            "nvml_pids_trusted": not self.nvml_stale,
            "nvml_stale": self.nvml_stale,
            "unknown_gpus": self.unknown_gpus,
            "all_free": self.all_free,
            "driver_version": self.engine.driver_version,
            "in_container": self.engine.in_container,
            "view": self.engine.view,
            "unreadable": self.unreadable,
            "diagnosis": self.diagnosis,
        }
        if self.shm_residue is not None:
            out["shm_residue"] = self.shm_residue
        if self.shm_residue_by_container is not None:
            out["shm_residue_by_container"] = self.shm_residue_by_container
        if self.shm_skipped is not None:
            out["shm_skipped"] = self.shm_skipped
        return out
