# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The decision step (private helper): pure functions from evidence, targets and options to a plan.

Who is signalled, who is left alone and why, and what stops the task before any signal. It reads
only the records of a Report (the evidence) and never /proc, NVML or a signal: the act layer
(_release) asks it again on fresh evidence.
"""

from __future__ import annotations

from ansible_collections.gpuops.fleet.plugins.module_utils import _holder as holder
from ansible_collections.gpuops.fleet.plugins.module_utils import _pinning as pinning
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import matches


COLLATERAL_CHOICES = ("refuse", "stop")
IN_DRIVER = ("nvidia", "uvm")   # words of a wchan or kernel stack frame in the NVIDIA driver (nvidia*, uvm_*)


def stuck_in_driver(record):
    """The first D-state thread of a record whose wchan or kernel stack is in the NVIDIA driver (nvidia*, uvm*), or
    None. Such a thread ends only when the driver call returns: a container stop cannot end it, and can hang."""
    for thread in record.get("blocked_threads") or ():
        frames = [(frame or "").lower() for frame in [thread.get("wchan")] + list(thread.get("stack") or ())]
        if thread.get("state", "D") == "D" and any(word in frame for frame in frames for word in IN_DRIVER):
            return thread
    return None


def unconfigured_containers(requested, configs):
    """The refusal of a node-side scope with a vmid that has no config on this node (a typo, a container of
    another node), or None. configs: _node.configured_containers()'s evidence. A vmid is this node's when its
    VMID.conf is in /etc/pve/lxc; one in another node's folder is named with that node."""
    node = " %s" % configs["node"] if configs.get("node") else ""
    wanted = sorted(set(int(v) for v in requested))
    here = configs.get("here")
    if here is None:
        return ("containers: cannot tell whether %s %s a config on this node%s: %s; nothing was signalled"
                % (", ".join(str(v) for v in wanted), "has" if len(wanted) == 1 else "have", node,
                   configs.get("error") or "/etc/pve/lxc cannot be read"))
    missing = [v for v in wanted if v not in here]
    if not missing:
        return None
    elsewhere = configs.get("elsewhere") or {}
    words = []
    for vmid in missing:
        other = elsewhere.get(vmid)
        words.append("%d (its config is on node %s: release it there)" % (vmid, other) if other else str(vmid))
    conf = "/etc/pve/lxc/%s.conf" % (missing[0] if len(missing) == 1 else "VMID")
    return ("containers: %s %s no config on this node%s (no %s); this node's containers: %s; nothing was signalled"
            % (", ".join(words), "has" if len(missing) == 1 else "have", node, conf,
               ", ".join(str(v) for v in here) or "none"))


def reset_blockers(report, gpu, spared=()):
    """What blocks a reset of gpu (a snapshot's GPU entry): anything with a context that could be on it (may_hold),
    a process whose read blocked while it had it open, and any client with it open (a real reset fails while any
    process has the GPU open). spared: pids that will be stopped before the reset (the daemons' services).
    New records: the evidence is left as it is."""
    # the reset guard asks the upper bound (may_hold): a reset under a live context loses that work
    out = [h for h in report.holders if holder.may_hold(h, gpu["index"])]
    out += [dict(b, blocked_threads=[{"wchan": "%s (unreadable: blocked)" % (b.get("wchan") or "?")}])
            for b in report.unreadable if b["pid"] in gpu.get("blocked", ())]
    out += [dict(c, blocked_threads=[]) for c in report.clients if holder.has_open(c, gpu["minor"])]
    return [b for b in out if b["pid"] not in spared]


def reset_refusal(report, gpu, spared=()):
    """Why a reset of gpu would be refused now (a text), or None: a blocker, or a pid NVML lists that this node
    does not show."""
    blockers = reset_blockers(report, gpu, spared)
    if blockers:
        return "refused: %s still holds it" % ", ".join(
            "pid %d (%s%s)" % (b["pid"], b["name"], ", D state in %s" % b["blocked_threads"][0].get("wchan")
                               if b["blocked_threads"] else "") for b in blockers)
    listed = [p["pid"] for p in gpu.get("nvml_processes", []) if p["pid"] not in spared]
    if listed:
        pids = ", ".join(str(p) for p in listed)
        return "refused: NVML lists pid %s on it (a process this node does not show)" % pids
    return None


# stop sets (issue 42): what never is one, and what a set's main process must not be
GENERIC_UNITS = ("cron.service", "crond.service", "anacron.service", "atd.service", "ssh.service", "sshd.service",
                 "rc-local.service", "init.scope", "docker.service", "containerd.service", "systemd-logind.service",
                 "console-getty.service", "container-getty.service")
GENERIC_PREFIXES = ("getty@", "serial-getty@", "container-getty@", "console-getty@", "user@", "user-runtime-dir@",
                    "session-", "pve-container@", "lxc@", "ssh@", "sshd@", "run-")
MANAGERS = ("supervisord", "dockerd", "containerd", "systemd", "init", "runsvdir", "s6-svscan", "sshd", "sshd-session",
            "cron", "crond", "atd", "tmux: server", "tmux", "screen", "SCREEN", "containerd-shim", "lxc-start", "conmon",
            "jupyterhub", "xinetd", "inetd", "login", "dropbear", "xrdp-sesman", "gdm", "lightdm", "sddm", "slurmd",
            "slurmstepd", "gitlab-runner")


def generic_unit(name):
    """Why a systemd unit is a generic launcher or session unit (it runs many programs, or a login), or None."""
    if name in GENERIC_UNITS or name.startswith(GENERIC_PREFIXES):
        return "%s is a generic launcher or session unit (it starts many programs, or a login), never a stop set" % name
    return None


def _may_hold_untargeted(record, indexes, targets, planned, tolerance_mib):
    """The untargeted GPUs a member would lose work on: of a planned holder, its shares over the tolerance (its
    decision allowed the rest); of anything else, every untargeted GPU it may hold (_holder.may_hold), with no
    tolerance: its only work may be small. Either way the GPUs NVML cannot describe. [(index or 'minor N', MiB)]."""
    if record["pid"] in planned:
        out = list(pinning.untargeted_shares(record, targets, tolerance_mib)[0])
        out += [(i, None) for i in record["ambiguous_gpus"] if i not in targets]   # an unknown share of its memory
    else:
        # collateral (the restart rung's too) asks the upper bound (may_hold): a wrong "no" stops work unasked
        out = [(i, record["shares_mib"].get(i)) for i in indexes if i not in targets and holder.may_hold(record, i)]
    return out + [("minor %d" % m, None) for m in record.get("unknown_gpus") or ()]


def set_collateral(members, report, targets, all_gpu_indexes, planned, tolerance_mib):
    """The members of a stop set whose stop would take GPU work that is not targeted: [{pid, name, gpus, why}]."""
    holders = dict((h["pid"], h) for h in report.holders)
    indexes = sorted(all_gpu_indexes)
    blocked = set(b["pid"] for b in getattr(report, "unreadable", ()))
    out = []
    for member in members:
        record = holders.get(member["pid"])
        if record is not None:
            lost = _may_hold_untargeted(record, indexes, set(targets), planned, tolerance_mib)
            if lost:
                out.append({"pid": member["pid"], "name": member["name"], "gpus": [i for i, dummy in lost],
                            "why": "may hold %s, not targeted" % ", ".join(
                    ("GPU %s" % i if isinstance(i, int) else "the GPU of %s" % i)
                    + ("" if mib is None else " (%d MiB)" % mib) for i, mib in lost)})
        elif member["pid"] in blocked:
            out.append({"pid": member["pid"], "name": member["name"], "gpus": [],
                        "why": "its maps could not be read (blocked): it may hold any GPU"})
    return out


def _structure_refusal(stop_set, planned, skipped):
    """Why a unit, program or docker container is not the planned holders' own program, or None."""
    main = stop_set["main"] or {}
    if stop_set["kind"] in ("systemd", "systemd-user"):
        generic = generic_unit(stop_set["name"])
        if generic:
            return generic
        if stop_set.get("dependents") is None:
            return "the units its stop would stop too (RequiredBy, BoundBy, ConsistsOf) could not be read"
        if stop_set["dependents"]:
            return "its stop would also stop %s (they require it, are bound to it or part of it)" % ", ".join(
                stop_set["dependents"])
    if main.get("pid") is None:
        return "it has no one main process (processes %s were started by its manager)" % (
            ", ".join(str(p) for p in main.get("tops") or ()) or "none")
    if main["name"] in MANAGERS or main.get("session_shell"):
        return ("its main process, pid %d (%s), manages several programs (%s): the set inside it for the holder "
                "could not be told" % (main["pid"], main["name"], "a login session's shell" if main.get("session_shell")
                                       else "a service manager"))
    held = [p for p in stop_set["pids"] if p == main["pid"] or main["pid"] in stop_set["chains"].get(p, ())]
    if held != list(stop_set["pids"]):
        return "its main process, pid %d (%s), is neither the holder nor one of its ancestors" % (main["pid"], main["name"])
    return _unsignalled(stop_set, planned, skipped) or _other_user(stop_set)


def _unsignalled(stop_set, planned, skipped):
    """Why a set takes a holder of a targeted GPU that is left alone (protect, match, ...), or None."""
    for member in stop_set["members"]:
        if member["pid"] in skipped and member["pid"] not in planned:
            return "pid %d (%s) in it holds a targeted GPU and is not signalled: %s" % (
                member["pid"], member["name"], skipped[member["pid"]])
    return None


def _other_user(stop_set):
    """Why a set runs another user's work (a spawner's servers, one per user), or None: every member that is not an
    ancestor of a planned holder runs as that holder's uid."""
    uids = dict((m["pid"], m.get("uid")) for m in stop_set["members"])
    holders = set(uids.get(p) for p in stop_set["pids"])
    above = set(a for p in stop_set["pids"] for a in stop_set["chains"].get(p, ()))
    for member in stop_set["members"]:
        if member["pid"] not in above and (member.get("uid") is None or member.get("uid") not in holders):
            return "pid %d (%s) in it runs as uid %s, not as the holder's (%s): another user's work" % (
                member["pid"], member["name"], member.get("uid"), ", ".join(str(u) for u in sorted(
                    holders, key=str)))
    return None


def stop_set_verdict(stop_set, report, targets, all_gpu_indexes, planned, skipped, collateral="refuse",
                     tolerance_mib=pinning.DEFAULT_TOLERANCE_MIB):
    """Whether a stop set may be stopped: {verdict (stop, refused, no set), reason, collateral}. Pure.

    stop_set: _stopsets' entry with pids (the planned holders it runs) and chains ({pid: its ancestors}); or kind
    "container" for a container restart, which every process of the container is in (container_restart: true is
    the consent for those that hold no GPU). planned: the pids to signal; skipped: {pid: why} of those left alone.
    A unit, program or docker container must be one program's: not a generic launcher or session unit, its main
    process no manager of several programs, and the holder or its ancestor; none of its members a holder that is
    not signalled. Any set's collateral is GPU work that is not targeted (set_collateral): refused unless
    collateral is stop, and printed either way."""
    if stop_set.get("problem"):
        return {"verdict": "no set", "reason": stop_set["problem"], "collateral": []}
    planned = set(planned)
    if stop_set["kind"] == "container":
        refusal = _unsignalled(stop_set, planned, skipped)
    else:
        refusal = _structure_refusal(stop_set, planned, skipped)
    if refusal:
        return {"verdict": "refused", "reason": refusal, "collateral": []}
    found = set_collateral(stop_set["members"], report, targets, all_gpu_indexes, planned, tolerance_mib)
    if found and collateral != "stop":
        return {"verdict": "refused", "collateral": found, "reason": "stopping it would take GPU work that is not "
                "targeted: %s; to go on, set collateral: stop" % "; ".join(
                    "pid %d (%s) %s" % (c["pid"], c["name"], c["why"]) for c in found)}
    return {"verdict": "stop", "reason": "every member is a planned holder or part of its program%s" % (
        "" if not found else "; collateral: stop takes %s" % ", ".join("pid %d" % c["pid"] for c in found)),
        "collateral": found}


def mib_list(pairs):
    return ", ".join("GPU %d (%s)" % (index, "an unknown amount" if mib is None else "%d MiB" % mib)
                     for index, mib in pairs)


def _unpinned_reason(record, why):
    mapped = ", ".join(str(i) for i in record["maps_gpus"]) or "none"
    if why == "ambiguous":
        return ("ambiguous: the evidence on GPU %s fits more than one holder, so it is not pinned; it maps GPUs %s "
                "and is signalled only when all of them are targeted"
                % (", ".join(str(i) for i in record["ambiguous_gpus"]), mapped))
    return ("not pinned to any GPU (NVML does not name it and shows no orphaned memory where it maps a context); it "
            "maps GPUs %s and is signalled only when all of them are targeted" % mapped)


class Decision(object):
    """Who gets signalled, who is left alone and why, and what would stop the task before any signal."""

    def __init__(self):
        self.chosen = []        # (holder, why) pairs by pid; why: pinned, unpinned_all_mapped, job_residue, job_member
        self.skipped = []       # {pid, name, reason}
        self.refusals = []      # messages; any of them fails the task before a signal
        self.refused_pids = []  # per refusal, the pids it is about (a node-side release leaves their containers out)
        self.jobs = {}          # job id -> {"id", "pids", "gpus"} of the jobs touched
        self.protected = {}     # pid -> why, of the holders of a targeted GPU left alone by protect, match or pid 1

    @property
    def to_signal(self):
        """The holders to signal, by pid (the evidence records themselves, never written into)."""
        return [record for record, dummy in self.chosen]

    def why_of(self, pid):
        """Why pid is signalled (chosen's why), or None when it is not."""
        for record, why in self.chosen:
            if record["pid"] == pid:
                return why
        return None

    def refuse(self, msg, pids):
        self.refusals.append(msg)
        self.refused_pids.append(sorted(set(pids)))


class _Chooser(object):
    """The holders chosen so far ({pid: (holder, why)}) and the rules that leave one alone (protect, match, scope)."""

    def __init__(self, decision, match, protect, protect_pids, scope):
        self.decision, self.chosen = decision, {}
        self.match, self.protect, self.protect_pids, self.scope = match, protect, protect_pids, scope

    def consider(self, record, why):
        """Choose record for why unless a rule leaves it alone (then it is skipped); True when chosen."""
        protected = _protected_reason(record, self.match, self.protect, self.protect_pids)
        reason = protected or (self.scope.reason(record) if self.scope else None)
        if reason:
            self.decision.skipped.append(_skip(record, reason))
            if protected:
                self.decision.protected[record["pid"]] = protected
            return False
        self.chosen[record["pid"]] = (record, why)
        return True

    def record(self, pid):
        return self.chosen[pid][0]


def decide(report, targets, all_gpu_indexes, match=None, protect=None, protect_pids=(), collateral="refuse",
           tolerance_mib=pinning.DEFAULT_TOLERANCE_MIB, scope=None):
    """Split the holders of the targeted GPUs into those to signal and those left alone, with collateral checks.

    Pure: reads a Report's records (the evidence) and never writes into them or into the report; the Decision it
    returns carries (holder, why) pairs (chosen), so it can be tested on recorded states.
    """
    targets = set(targets)
    decision = Decision()
    chooser = _Chooser(decision, match, protect, protect_pids, scope)
    _choose_holders(report, targets, set(all_gpu_indexes) <= targets, chooser)
    in_job_refusal = set()
    for job_id in sorted(set(r["job"] for r, dummy in chooser.chosen.values() if r["job"] is not None)):
        in_job_refusal.update(_job_step(report, job_id, targets, collateral, tolerance_mib, chooser))
    _mps_servers_last(report, chooser.chosen, decision)
    unknown_index = dict((u["minor"], u["index"]) for u in getattr(report, "unknown_gpus", ()))
    if collateral != "stop":
        for record, dummy in sorted(chooser.chosen.values(), key=lambda pair: pair[0]["pid"]):
            if record["pid"] not in in_job_refusal:
                _collateral_refusal(record, targets, tolerance_mib, unknown_index, decision)
    decision.chosen = sorted(chooser.chosen.values(), key=lambda pair: pair[0]["pid"])
    return decision


def _choose_holders(report, targets, all_targeted, chooser):
    """Each holder that concerns the targets (pinning.relevance, or its job's residue on one) is chosen or skipped."""
    residue_jobs = set(job for index, job in report.residue.items() if index in targets)
    for record in report.holders:
        why = pinning.relevance(record, targets, all_targeted)
        if why is None and record["job"] in residue_jobs:
            why = "job_residue"
        if why in ("ambiguous", "unpinned"):
            chooser.decision.skipped.append(_skip(record, _unpinned_reason(record, why)))
        elif why:
            chooser.consider(record, why)


def _job_step(report, job_id, targets, collateral, tolerance_mib, chooser):
    """A job with a chosen member: all of it is stopped (collateral: stop) or the task is refused; returns the pids
    of a refused job (their own collateral is not refused twice)."""
    decision, chosen = chooser.decision, chooser.chosen
    job = report.jobs[job_id]
    job_gpus = report.job_gpus(job_id)
    decision.jobs[job_id] = {"id": job_id, "pids": job["pids"], "gpus": job_gpus, "signature": job["signature"]}
    skipped_pids = dict((k["pid"], k["reason"]) for k in decision.skipped)
    excluded = [m for m in job["members"] if m["pid"] in skipped_pids]
    outside = [m for m in job["members"] if m["pid"] not in chosen and m["pid"] not in skipped_pids]
    over = sorted(set(pair for m in job["members"] for pair in pinning.untargeted_shares(m, targets, tolerance_mib)[0]))
    first, members = min(job["pids"]), ", ".join(str(p) for p in job["pids"])
    picked = chooser.record(min(p for p in job["pids"] if p in chosen))
    if excluded:
        decision.refuse(
            "pid %d (%s) belongs to the job of pid %d (pids %s; processes linked by sockets are one unit), but "
            "pid %d (%s) of that job may not be signalled (%s): stopping part of a job leaves the rest hung; "
            "nothing was signalled" % (picked["pid"], picked["name"], first, members, excluded[0]["pid"],
                                       excluded[0]["name"], skipped_pids[excluded[0]["pid"]]), job["pids"])
        return job["pids"]
    if not outside and not over:
        return ()
    if collateral == "stop":
        for member in outside:
            if not chooser.consider(member, "job_member"):
                decision.refuse(
                    "pid %d (%s) belongs to the job of pid %d (pids %s) but may not be signalled (%s): stopping "
                    "part of a job leaves the rest hung; nothing was signalled"
                    % (member["pid"], member["name"], first, members, decision.skipped[-1]["reason"]), job["pids"])
        return ()
    untargeted = sorted(set(i for i in job_gpus if i not in targets))
    decision.refuse(
        "pid %d (%s) is one of the processes of a job linked by sockets (pids %s; a tensor-parallel job is one "
        "unit) that holds GPUs %s; %s not targeted%s: stopping part of it leaves the rest hung and residue on the "
        "targeted GPUs; nothing was signalled. To go on, set collateral: stop (stops the whole job), or target "
        "%s too"
        % (picked["pid"], picked["name"], members, ", ".join(str(i) for i in job_gpus),
           gpu_list_words(untargeted), " (%s)" % mib_list(over) if over else "", gpu_list_words(untargeted)),
        job["pids"])
    return job["pids"]


def _collateral_refusal(record, targets, tolerance_mib, unknown_index, decision):
    """Refuse a chosen holder (collateral: refuse) whose stop would take untargeted work: a context on a GPU NVML
    cannot describe or an ambiguous one (where it may hold work: the upper bound), or a pinned share over the
    tolerance (what it holds there)."""
    unknown = [m for m in record.get("unknown_gpus") or () if unknown_index.get(m) not in targets]
    if unknown:
        decision.refuse(
            "pid %d (%s) also has a context on %s, which NVML cannot describe (lost, or its calls fail): "
            "stopping it would free an unknown amount there, and maybe stop its work; nothing was signalled. "
            "To go on, set collateral: stop" % (record["pid"], record["name"], unknown_words(unknown, unknown_index)),
            [record["pid"]])
        return
    ambiguous = [i for i in record["ambiguous_gpus"] if i not in targets]
    if ambiguous:
        words = gpu_list_words(ambiguous)
        decision.refuse(
            "pid %d (%s) also has a context on %s, where NVML's memory fits more than one holder (ambiguous): "
            "stopping it may free an unknown amount there, and stop its work; nothing was signalled. To go on, "
            "set collateral: stop, or target %s too" % (record["pid"], record["name"], words, words), [record["pid"]])
        return
    over, dummy = pinning.untargeted_shares(record, targets, tolerance_mib)
    if over:
        decision.refuse(
            "pid %d (%s) holds %s, which %s not targeted, beyond the %d MiB of a bare context "
            "(collateral_tolerance_mib): stopping it would stop its work there; nothing was signalled. To go on, "
            "set collateral: stop, or target %s too"
            % (record["pid"], record["name"], mib_list(over), "is" if len(over) == 1 else "are", tolerance_mib,
               gpu_list_words([i for i, dummy in over])), [record["pid"]])


def _mps_servers_last(report, chosen, decision):
    """An MPS server is a set: itself and every client it serves. It is signalled only when each of its clients is
    signalled too (or gone), whatever its own share: killing it under a live client leaves that client's work
    undefined (GPU_FACTS row 28). A server whose clients cannot be known is never signalled."""
    for record in [r for r, dummy in chosen.values() if r.get("mps_role") == "server"]:
        reason = mps_server_refusal(report, record, chosen)
        if reason:
            del chosen[record["pid"]]
            decision.skipped.append(_skip(record, reason))


def mps_server_refusal(report, server, chosen):
    """Why an MPS server may not be signalled with the processes chosen, or None. Its clients are those its control
    daemon lists (report.mps_servers) and, where NVML's MPS client list was read on every GPU, every client NVML
    names (it does not say whose); with neither, they cannot be known. A client its daemon lists that is not seen
    here may live: unknown too."""
    evidence = (getattr(report, "mps_servers", None) or {}).get(server["pid"]) or {}
    unread = getattr(report, "mps_nvml_unread", None) or {}
    if evidence.get("unseen"):
        return ("the MPS server, never signalled while its clients cannot be known: control daemon pid %d lists "
                "clients %s (pids as it sees them) that are not seen here" % (
                    evidence["control"]["pid"], ", ".join(str(p) for p in evidence["unseen"])))
    if evidence.get("clients") is None and unread:
        return ("the MPS server, never signalled while its clients cannot be known: %s; NVML lists no MPS client on "
                "GPU %s" % (evidence.get("why") or "no MPS control daemon was asked",
                            ", ".join(str(i) for i in sorted(unread))))
    clients = set(evidence.get("clients") or ())
    if not unread:
        clients.update(r["pid"] for r in report.holders if r.get("mps_client_on"))
    others = dict((r["pid"], r) for r in list(report.holders) + list(getattr(report, "clients", ())))
    left = sorted(p for p in clients if p not in chosen and p != server["pid"])
    if not left:
        return None
    return ("the MPS server, signalled only with all of its clients: %s stay%s; stopping the server under a live client "
            "leaves that client's work undefined (collateral, whatever the server's own share there)" % (
                ", ".join("pid %d (%s)" % (p, _gpu_words(others.get(p))) for p in left), "s" if len(left) == 1 else ""))


def _gpu_words(record):
    if record is None:
        return "not seen here"
    if record.get("gpus"):
        return gpu_list_words(record["gpus"])
    return "no GPU pinned, maps %s" % (", ".join(str(i) for i in record.get("maps_gpus") or ()) or "none")


def unknown_words(minors, unknown_index):
    return ", ".join("the GPU of minor %d%s" % (m, "" if unknown_index.get(m) is None else " (GPU %d)" % unknown_index[m])
                     for m in minors)


def gpu_list_words(indexes):
    return ("GPU " if len(indexes) == 1 else "GPUs ") + ", ".join(str(i) for i in indexes)


def _protected_reason(record, match, protect, protect_pids):
    argv_line = " ".join(record.get("_argv") or ())
    if record["pid"] == 1:
        return "pid 1 is never signalled"
    if record["pid"] in protect_pids:
        return "part of the module's own process tree"
    if record.get("protected_name"):
        return "%s is on the built-in protect list" % record["protected_name"]
    if protect is not None and protect.reason(record["pid"], record["names"], argv_line):
        return protect.reason(record["pid"], record["names"], argv_line)
    if protect is not None and protect.patterns and "cmdline" in (record.get("truncated") or ()):
        return "its command line has more than the bytes read (truncated): `protect` cannot be checked on all of it"
    if not matches(match, record["names"], argv_line):
        return "does not match `match` (%s)" % match.pattern
    return None


def _skip(record, reason):
    return {"pid": record["pid"], "name": record["name"], "reason": reason}


def plan_entry(record, targets, decision, tolerance_mib):
    """One line of the plan: whom, for which targeted GPUs, what else it frees, and its job."""
    targets = set(targets)
    why = decision.why_of(record["pid"])
    if why == "pinned":
        gpus = sorted(targets & set(record["gpus"]))
    elif why == "unpinned_all_mapped":
        gpus = sorted(record["maps_gpus"]) or sorted(targets)
    else:
        gpus = sorted(targets & set(decision.jobs.get(record["job"], {}).get("gpus", ())))
    over, under = pinning.untargeted_shares(record, targets, tolerance_mib)
    side = [{"index": i, "mib": mib} for i, mib in sorted(over + under)]
    note = "SIGKILL only if it still holds a targeted GPU after term_timeout"
    if record["defunct_leader"]:
        note += "; a defunct leader with %d live threads" % (record["live_threads"] or 0)
    if side:
        note += "; frees %s as a side effect" % mib_list([(s["index"], s["mib"]) for s in side])
    if record.get("unknown_gpus"):
        note += "; also has a context on a GPU NVML cannot describe (minor %s): an unknown amount" % ", ".join(
            str(m) for m in record["unknown_gpus"])
    if record.get("mps_role") == "client":
        note = "an MPS client: terminate_client through the MPS control daemon first, then SIGTERM; " + note
    elif record.get("mps_role") == "server":
        note += "; the MPS server, stopped with all of its clients"
    if why == "job_member":
        note += "; stopped with its job (collateral: stop)"
    elif why == "job_residue":
        note += "; its job keeps residue on a targeted GPU"
    elif why == "unpinned_all_mapped":
        note += "; not pinned, but every GPU it maps is targeted"
    return {"pid": record["pid"], "name": record["name"], "gpus": gpus, "side_effect_gpus": side,
            "job": decision.jobs.get(record["job"]), "evidence": list(record["evidence"]),
            "unattributed": record["unattributed"], "why": why,
            "signals": (["terminate_client"] if record.get("mps_role") == "client" else []) + ["SIGTERM", "SIGKILL"],
            "note": note}
