# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The release ladder: TERM, KILL, wait, reset, verify (private helper).

Signals only processes that /proc shows holding a targeted GPU, each guarded
against pid reuse. No AnsibleModule here.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import subprocess
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import matches

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_IMPORT_ERROR = None
except Exception as _exc:
    psutil = None
    HAS_PSUTIL = False
    PSUTIL_IMPORT_ERROR = _exc

RUNGS = ("none", "sigterm", "sigkill", "wait", "reset")
POLL_S = 0.075
GRACE_S = 1.0            # once nothing visible here holds a GPU, how long to wait for its memory
RESPAWN_WINDOW_S = 3.0   # how long to watch a supervisor after its child was killed
SUPERVISOR_RE = re.compile(r"(^|/)(supervisord|systemd|init|runsv|runsvdir|s6-supervise|monit|circusd|pm2|tini|dumb-init)\b")
NVIDIA_SMI_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/local/nvidia/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


class ReleaseTimeout(Exception):
    """The overall `timeout` was reached."""


class LockTimeout(Exception):
    pass


def find_nvidia_smi(path_env=None):
    dirs = [d for d in (path_env if path_env is not None else os.environ.get("PATH", "")).split(os.pathsep) if d]
    for folder in dirs + list(NVIDIA_SMI_DIRS):
        candidate = os.path.join(folder, "nvidia-smi")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def is_supervisor(names, cmdline):
    return any(SUPERVISOR_RE.search(n) for n in names) or bool(cmdline and SUPERVISOR_RE.search(cmdline.split(" ")[0]))


def decide(report, targets, all_gpu_indexes, match=None, protect=None, protect_pids=()):
    """Split the holders of the targeted GPUs into those to signal and those left alone (with why).

    Pure: works on a Report's records, so it can be tested on recorded states.
    """
    targets = set(targets)
    all_targeted = set(all_gpu_indexes) <= targets
    to_signal, skipped = [], []
    for record in report.holders:
        pinned = targets.intersection(record["gpus"])
        if record["unattributed"]:
            pinned = pinned or targets.intersection(record["nvml_named_on"])
        if not pinned:
            if record["unattributed"] and not record["gpus"]:
                if not all_targeted:
                    skipped.append(_skip(record, "its context cannot be pinned to one GPU (only %s mapped) and not "
                                                 "every GPU is targeted" % ", ".join(record["mapped_devices"])))
                    continue
            else:
                continue  # holds only GPUs that are not targeted
        reason = None
        argv_line = " ".join(record.get("_argv") or ())
        if record["pid"] == 1:
            reason = "pid 1 is never signalled"
        elif record["pid"] in protect_pids:
            reason = "part of the module's own process tree"
        elif record.get("protected_name"):
            reason = "%s is on the built-in protect list" % record["protected_name"]
        elif protect is not None and protect.reason(record["pid"], record["names"], argv_line):
            reason = protect.reason(record["pid"], record["names"], argv_line)
        elif not matches(match, record["names"], argv_line):
            reason = "does not match `match` (%s)" % match.pattern
        if reason:
            skipped.append(_skip(record, reason))
        else:
            to_signal.append(record)
    return to_signal, skipped


def _skip(record, reason):
    return {"pid": record["pid"], "name": record["name"], "reason": reason}


def alive(record, proc_root="/proc"):
    """Still the same process and still able to hold something (a one-thread zombie holds nothing)."""
    stat = procscan.read_stat(record["pid"], proc_root)
    if stat is None or stat["starttime"] != record["starttime_ticks"]:
        return False
    return not (stat["state"] in ("Z", "X") and stat["num_threads"] <= 1)


def send_guarded(record, sig, proc_root="/proc"):
    """Send sig to the process of record unless its pid now names another process.

    A pidfd pins the process; its start time is then checked, so the signal
    cannot reach a reused pid. Without pidfd, psutil's create-time check guards it.
    """
    pid = record["pid"]
    pidfd = None
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pidfd = None
    try:
        stat = procscan.read_stat(pid, proc_root)
        if stat is None:
            return "gone"
        if stat["starttime"] != record["starttime_ticks"]:
            return "not sent: pid %d was reused by another process" % pid
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                return "gone"
            return "sent"
        if psutil is not None:
            try:
                proc = psutil.Process(pid)
                if record.get("create_time") is not None and abs(proc.create_time() - record["create_time"]) > 0.05:
                    return "not sent: pid %d was reused by another process" % pid
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                return "gone"
            return "sent"
        os.kill(pid, sig)
        return "sent"
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return "gone"
        return "error: %s" % exc
    finally:
        if pidfd is not None:
            os.close(pidfd)


class GpuLocks(object):
    """Per-GPU flock files under lock_dir, taken in a fixed order (by UUID)."""

    def __init__(self, lock_dir="/run/lock"):
        self.lock_dir = lock_dir
        self.fds = []
        self.waited_s = 0.0

    def path(self, key):
        return os.path.join(self.lock_dir, "gpuops-fleet-gpu-%s.lock" % re.sub(r"[^A-Za-z0-9_.-]", "_", str(key)))

    def acquire(self, keys, timeout, clock=time.monotonic):
        if not os.path.isdir(self.lock_dir):
            os.makedirs(self.lock_dir, 0o755)
        start = clock()
        end = start + timeout
        for key in sorted(set(keys)):
            fd = os.open(self.path(key), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            self.fds.append(fd)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if clock() >= end:
                    self.release()
                    raise LockTimeout("another gpu_release holds the lock on GPU %s (%s) for more than %gs"
                                      % (key, self.path(key), timeout))
                time.sleep(0.05)
        self.waited_s = clock() - start

    def release(self):
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def gpu_summary(report):
    """Compact per-GPU state for before/after."""
    out = []
    for gpu in report.gpus:
        mem = gpu.get("memory") or {}
        out.append({"index": gpu["index"], "minor": gpu.get("minor"), "uuid": gpu.get("uuid"),
                    "used_mib": mem.get("used_mib"), "reserved_mib": mem.get("reserved_mib"),
                    "v1_used_mib": mem.get("v1_used_mib"), "free": gpu["free"], "holders": gpu.get("holders", []),
                    "error": gpu.get("error")})
    return out


class Releaser(object):
    """Runs the ladder for the targeted GPU indexes of an Engine."""

    def __init__(self, engine, targets, term_timeout=10.0, kill_timeout=10.0, verify_timeout=30.0,
                 gpu_reset=False, lock_timeout=60.0, match=None, protect=None, deadline=None,
                 log=None, check_mode=False, lock_dir="/run/lock", nvidia_smi=None, poll_s=POLL_S):
        self.engine = engine
        self.targets = list(targets)
        self.term_timeout = term_timeout
        self.kill_timeout = kill_timeout
        self.verify_timeout = verify_timeout
        self.gpu_reset = gpu_reset
        self.lock_timeout = lock_timeout
        self.match = match
        self.protect = protect
        self.deadline = deadline
        self.log = log or (lambda msg: None)
        self.check_mode = check_mode
        self.lock_dir = lock_dir
        self.nvidia_smi = nvidia_smi
        self.poll_s = poll_s
        self.proc_root = engine.proc_root
        self.actions = []
        self.rung = "none"
        self.started = time.monotonic()
        self.signalled = {}      # pid -> record
        self.skipped = []
        self.plan = []
        self.failure = None      # message when the task must fail
        self.respawned = None
        self.reset_done = False

    # -- helpers
    def now(self):
        return time.monotonic()

    def _left(self):
        if self.deadline is None:
            return None
        return self.deadline - self.now()

    def _check_deadline(self, during):
        left = self._left()
        if left is not None and left <= 0:
            raise ReleaseTimeout("the overall timeout was reached during %s" % during)

    def _until(self, seconds):
        end = self.now() + seconds
        if self.deadline is not None:
            end = min(end, self.deadline)
        return end

    def _set_rung(self, rung):
        if RUNGS.index(rung) > RUNGS.index(self.rung):
            self.rung = rung

    def _memory_free(self):
        return all(self.engine.is_free(self.engine.memory(index)) for index in self.targets)

    def _record(self, record, signame, outcome):
        action = {"time": round(time.time(), 3), "elapsed_s": round(self.now() - self.started, 3),
                  "pid": record["pid"], "name": record["name"], "signal": signame, "outcome": outcome}
        self.actions.append(action)
        self.log("gpuops.fleet.gpu_release: %s to pid %d (%s): %s" % (signame, record["pid"], record["name"], outcome))

    def _signal(self, records, sig, signame):
        sent = False
        for record in records:
            outcome = send_guarded(record, sig, self.proc_root)
            self._record(record, signame, outcome)
            if outcome == "sent":
                sent = True
                self.signalled[record["pid"]] = record
        return sent

    def _wait(self, seconds, watched, during):
        """Poll until the targets are free, the watched processes are gone, or time is up."""
        end = self._until(seconds)
        while True:
            if self._memory_free():
                return "free"
            if not [r for r in watched if alive(r, self.proc_root)]:
                return "gone"
            if self.now() >= end:
                self._check_deadline(during)
                return "timeout"
            time.sleep(self.poll_s)

    # -- respawn
    def _supervisors(self):
        """Live parents of killed holders that look like supervisors (or are the killed ones' common parent)."""
        parents = {}
        killed = set(self.signalled)
        for record in self.signalled.values():
            ppid = record["ppid"]
            if not ppid or ppid in killed or ppid in parents:
                continue
            stat = procscan.read_stat(ppid, self.proc_root)
            if stat is None:
                continue
            argv = []
            try:
                argv = [a.decode("utf-8", "replace") for a in
                        procscan.read_bytes("%s/%d/cmdline" % (self.proc_root, ppid)).split(b"\0") if a]
            except OSError:
                pass
            supervisor = is_supervisor([stat["comm"]], " ".join(argv))
            if ppid == 1 and supervisor:
                # init reaps orphans too: count it as a supervisor only for its services
                supervisor = str(record.get("cgroup") or "").endswith(".service")
            parents[ppid] = {"pid": ppid, "name": stat["comm"], "starttime": stat["starttime"],
                             "supervisor": supervisor}
        return parents

    def _new_holders(self, report, parents):
        """Holders of targeted GPUs that did not exist before and share a parent with a killed holder."""
        known = set(self._known_pids)
        found = []
        for record in report.holders:
            if record["pid"] in known:
                continue
            if not (set(self.targets).intersection(record["gpus"]) or record["unattributed"]):
                continue
            if record["ppid"] in parents:
                found.append((record, parents[record["ppid"]]))
        return found

    def _new_children(self, parents, since_ticks):
        """Processes started after the kill under one of the parents (a respawn in progress)."""
        found = []
        for name in os.listdir(self.proc_root):
            if not name.isdigit():
                continue
            stat = procscan.read_stat(int(name), self.proc_root)
            if stat is None or stat["ppid"] not in parents or stat["starttime"] < since_ticks:
                continue
            if int(name) in self._known_pids:
                continue
            names = set(r["name"] for r in self.signalled.values() if r["ppid"] == stat["ppid"])
            if stat["comm"] in names:
                found.append((stat, parents[stat["ppid"]]))
        return found

    def _respawn_message(self, parent, child_pid):
        return ("respawned by pid %d (%s): stop the service first (new holder pid %d appeared under the same "
                "parent after the kill)" % (parent["pid"], parent["name"], child_pid))

    def _check_respawn(self, watch_s=0.0):
        """Fail if new holders appear under the parent of a killed holder; watch supervisors for watch_s."""
        parents = self._supervisors()
        if not parents or (watch_s > 0 and not [p for p in parents.values() if p["supervisor"]]):
            return False  # after a verified release only a supervisor is watched (a scan costs time)
        report = self.engine.snapshot(self.targets)
        hits = self._new_holders(report, parents)
        if hits:
            record, parent = hits[0]
            self.respawned = {"pid": record["pid"], "parent_pid": parent["pid"], "parent_name": parent["name"]}
            self.failure = self._respawn_message(parent, record["pid"])
            return True
        watched = dict((p, v) for p, v in parents.items() if v["supervisor"])
        if not watched or watch_s <= 0:
            return False
        end = self._until(watch_s)
        since = self._kill_ticks
        while self.now() < end:
            hits = self._new_children(watched, since)
            if hits:
                stat, parent = hits[0]
                self.respawned = {"pid": stat["pid"], "parent_pid": parent["pid"], "parent_name": parent["name"]}
                self.failure = self._respawn_message(parent, stat["pid"])
                return True
            time.sleep(self.poll_s * 2)
        return False

    # -- the ladder
    def prepare(self, report):
        """Decide whom to signal; returns the plan (check mode's answer)."""
        own_tree = self.engine.own_tree_skip()
        self.to_signal, self.skipped = decide(report, self.targets, [g["index"] for g in self.engine.gpus],
                                              self.match, self.protect, own_tree)
        self._known_pids = set(r["pid"] for r in report.holders) | set(r["pid"] for r in report.clients)
        targets = sorted(self.targets)
        self.plan = [{"pid": r["pid"], "name": r["name"],
                      "gpus": [i for i in targets if i in r["gpus"] or i in r["nvml_named_on"]] or targets,
                      "unattributed": r["unattributed"],
                      "signals": ["SIGTERM", "SIGKILL"],
                      "note": "SIGKILL only if it still holds the GPU after term_timeout"
                              + ("; a defunct leader with %d live threads" % (r["live_threads"] or 0)
                                 if r["defunct_leader"] else "")}
                     for r in self.to_signal]
        return self.plan

    def run(self, report):
        """Climb the ladder from report (the state after the locks were taken)."""
        self._kill_ticks = _now_ticks(self.proc_root)
        term = list(self.to_signal)
        watched = list(self.to_signal)
        outcome = "gone"
        if self.to_signal:
            self._set_rung("sigterm")
            self._signal(term, signal.SIGTERM, "SIGTERM")
            outcome = self._wait(self.term_timeout, watched, "SIGTERM")
            survivors = [r for r in term if alive(r, self.proc_root)]
            if outcome != "free" and survivors:
                self._set_rung("sigkill")
                self._signal(survivors, signal.SIGKILL, "SIGKILL")
                outcome = self._wait(self.kill_timeout, watched, "SIGKILL")
        if outcome == "free":
            self._check_respawn(RESPAWN_WINDOW_S)
            return
        if self.signalled and self._check_respawn(0.0):
            return
        # D-state threads, or memory held by something not signalled: wait up to verify_timeout
        survivors = [r for r in watched if alive(r, self.proc_root)]
        if survivors:
            self._set_rung("wait")
        outcome = self._verify_wait(self.verify_timeout, watched)
        if outcome == "free":
            if self.signalled:
                self._check_respawn(RESPAWN_WINDOW_S)
            return
        if self.gpu_reset:
            self._reset()
            self._verify_wait(self.verify_timeout, [])

    def _verify_wait(self, seconds, watched):
        """Poll until free; stop GRACE_S after no watched process is left."""
        end = self._until(seconds)
        gone_since = None
        while True:
            if self._memory_free():
                return "free"
            now = self.now()
            if [r for r in watched if alive(r, self.proc_root)]:
                gone_since = None
            elif gone_since is None:
                gone_since = now
            if now >= end or (gone_since is not None and now - gone_since >= GRACE_S):
                self._check_deadline("verify")
                return "timeout"
            time.sleep(self.poll_s)

    def _reset(self):
        """nvidia-smi --gpu-reset for each targeted GPU still used; refused while anything holds it."""
        self._set_rung("reset")
        report = self.engine.snapshot(self.targets)
        unpinned = [h for h in report.holders if h["unattributed"]]
        smi = self.nvidia_smi or find_nvidia_smi()
        for gpu in report.gpus:
            if gpu["free"] or gpu.get("error"):
                continue
            fake = {"pid": 0, "name": "GPU %d" % gpu["index"]}
            blockers = [report.holder(pid) for pid in gpu["holders"]] + unpinned
            if blockers:
                names = ", ".join("pid %d (%s%s)" % (b["pid"], b["name"],
                                                     ", D state in %s" % b["blocked_threads"][0].get("wchan")
                                                     if b["blocked_threads"] else "") for b in blockers)
                self._record(fake, "reset", "refused: %s still holds it" % names)
                continue
            if smi is None:
                self._record(fake, "reset", "failed: nvidia-smi not found in PATH or %s" % ", ".join(NVIDIA_SMI_DIRS))
                continue
            cmd = [smi, "--gpu-reset", "-i", str(gpu["index"])]
            left = self._left()
            timeout = max(1.0, min(self.verify_timeout, left if left is not None else self.verify_timeout))
            env = dict(os.environ, LC_ALL="C")
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                      universal_newlines=True, check=False)
                text = " ".join(proc.stdout.split())[:300]
                if proc.returncode == 0:
                    self.reset_done = True
                    self._record(fake, "reset", "done: %s" % (text or "nvidia-smi --gpu-reset succeeded"))
                else:
                    self._record(fake, "reset", "failed (rc %d): %s" % (proc.returncode, text))
            except subprocess.TimeoutExpired:
                self._record(fake, "reset", "failed: nvidia-smi --gpu-reset did not return within %gs" % timeout)
            except OSError as exc:
                self._record(fake, "reset", "failed: %s" % exc)

    @property
    def changed(self):
        return bool(self.signalled) or self.reset_done


def _now_ticks(proc_root="/proc"):
    """Now, in the clock ticks since boot that /proc/PID/stat's starttime uses."""
    try:
        uptime = float(procscan.read_text("%s/uptime" % proc_root).split()[0])
        return int(uptime * os.sysconf("SC_CLK_TCK")) - 1
    except (OSError, ValueError, IndexError):
        return 0


def _used(report):
    return dict((g["index"], (g.get("memory") or {}).get("used_mib")) for g in report.gpus)


def remaining_of(report):
    """What still holds memory on the GPUs that are not free."""
    out = []
    for gpu in report.gpus:
        if gpu["free"]:
            continue
        holders = []
        for pid in gpu.get("holders", []):
            record = report.holder(pid)
            if record is None:
                continue
            holders.append({"pid": pid, "name": record["name"], "state": record["state"],
                            "blocked_threads": record["blocked_threads"]})
        out.append({"index": gpu["index"], "uuid": gpu.get("uuid"),
                    "used_mib": (gpu.get("memory") or {}).get("used_mib"), "holders": holders,
                    "unattributed_mib": gpu.get("unattributed_mib"), "error": gpu.get("error")})
    return out


def release(engine, targets, options, check_mode=False, log=None, lock_dir="/run/lock", deadline=None):
    """Run gpu_release on an started Engine. Returns (failed, msg, result)."""
    started = time.monotonic()
    opts = dict(options)
    releaser = Releaser(engine, targets, term_timeout=opts.get("term_timeout", 10.0),
                        kill_timeout=opts.get("kill_timeout", 10.0), verify_timeout=opts.get("verify_timeout", 30.0),
                        gpu_reset=opts.get("gpu_reset", False), lock_timeout=opts.get("lock_timeout", 60.0),
                        match=opts.get("match"), protect=opts.get("protect"), deadline=deadline, log=log,
                        check_mode=check_mode, lock_dir=lock_dir, nvidia_smi=opts.get("nvidia_smi"))
    result = {"changed": False, "actions": releaser.actions, "rung_reached": "none", "plan": [],
              "not_signalled": [], "respawned": None, "released_mib": 0, "remaining": [], "diagnosis": []}

    def finish(failed, msg, before, after):
        result["rung_reached"] = releaser.rung
        result["changed"] = releaser.changed if not check_mode else bool(releaser.plan)
        result["before"] = gpu_summary(before)
        result["after"] = gpu_summary(after) if after is not None else None
        if after is not None:
            b, a = _used(before), _used(after)
            result["released_mib"] = max(0, sum((b[i] or 0) - (a.get(i) or 0) for i in b if b[i] is not None))
            result["remaining"] = remaining_of(after)
            result["diagnosis"] = list(after.diagnosis)
        result["plan"] = releaser.plan
        result["not_signalled"] = releaser.skipped
        result["respawned"] = releaser.respawned
        for skip in releaser.skipped:
            result["diagnosis"].append("pid %d (%s) holds a targeted GPU but was not signalled: %s"
                                       % (skip["pid"], skip["name"], skip["reason"]))
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        return failed, msg, result

    gpu_keys = [(engine.gpu(i) or {}).get("uuid") or "index-%d" % i for i in targets]
    locks = GpuLocks(lock_dir)
    if not check_mode:
        wait = opts.get("lock_timeout", 60.0)
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            locks.acquire(gpu_keys, wait)
        except LockTimeout as exc:
            return True, str(exc), dict(result, elapsed_s=round(time.monotonic() - started, 3))
    try:
        before = engine.snapshot(targets)
        broken = before.errors
        if broken:
            msg = "; ".join("GPU %s%s: %s" % (g["index"], " (%s)" % g["uuid"] if g.get("uuid") else "", g["error"])
                            for g in broken)
            result["diagnosis"] = list(before.diagnosis)
            return finish(True, "NVML failed, nothing was signalled: " + msg, before, None)
        if before.all_free:
            return finish(False, "every targeted GPU is already free", before, before)
        releaser.prepare(before)
        if check_mode:
            result["diagnosis"] = list(before.diagnosis)
            return finish(False, "check mode: %d processes would be signalled" % len(releaser.plan), before, None)
        try:
            releaser.run(before)
        except ReleaseTimeout as exc:
            after = engine.snapshot(targets)
            return finish(True, "%s (timeout %ss)" % (exc, opts.get("timeout")), before, after)
        after = engine.snapshot(targets)
    finally:
        locks.release()
    if releaser.failure:
        return finish(True, releaser.failure, before, after)
    if after.all_free:
        return finish(False, "verified free", before, after)
    busy = [g for g in after.gpus if not g["free"]]
    tried = ", ".join("%s to %d: %s" % (a["signal"], a["pid"], a["outcome"]) if a["pid"] else
                      "%s %s: %s" % (a["signal"], a["name"], a["outcome"]) for a in releaser.actions) or "nothing"
    failed, msg, res = finish(True, "", before, after)
    res_msg = ("GPU %s not free after the ladder (used %s MiB, threshold %s MiB); tried: %s; diagnosis: %s"
               % (", ".join(str(g["index"]) for g in busy),
                  ", ".join(str((g.get("memory") or {}).get("used_mib")) for g in busy),
                  engine.threshold_mib, tried, " | ".join(res["diagnosis"])))
    return failed, res_msg, res
