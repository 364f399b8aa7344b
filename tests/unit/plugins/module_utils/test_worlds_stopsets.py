"""Invariants of the stop sets over generated worlds (issue 42, deliverable 6).

A world is one LXC container (101) on a Proxmox node, its init at node pid 100 (container pid 1, cgroup
/lxc/101/ns/init.scope), with a random mix of what runs programs in it: single-program systemd units (the holder
itself, an API server with GPU workers, a wrapper shell, a daemon that forked away from its unit's main process),
generic launcher units (cron, ssh without logind, rc-local), units whose main process manages several programs (tmux,
a login shell on a tty, supervisord under a custom name), supervisord (under supervisor.service, under init, or under
a custom unit) with 1-3 programs, docker containers (found by their containerd-shim's `-namespace moby -id`, or by
their cgroup behind an older shim; one may run supervisord inside), a user's services (user@1000.service/app.slice),
nested containers (their NSpid one level deeper than the container's init, no docker shim) and processes started by
hand. Any program process may hold contexts on 1-4 GPUs; the truth is which GPUs each holds and how many MiB.

The /proc tree is written with ProcTree (stat, status with NSpid, cmdline, cgroup, maps, fds, and environ with
SUPERVISOR_PROCESS_NAME and SUPERVISOR_GROUP_NAME for supervisord's programs), NVML is the fake, and the real engine
runs in the node view: Engine.snapshot, then Releaser.prepare and Releaser.find_units (units.plan_sets, each set
decided by _decide.stop_set_verdict) with a scope of container 101, for every target set and for collateral refuse
and stop; a container restart is decided as Releaser._restart_verdict decides it (stop_set_verdict on every process of
the container). Most worlds have NVML name every holder (the evidence is exact); the others leave some holders out of
NVML's lists, so that they are pinned by orphaned memory or are ambiguous (the evidence may say more than the truth).

The oracle is the truth, never the engine's evidence:
(a) no set decided "stop" (a unit, a program, a docker container, or the container's restart) has a member that
    truly holds an untargeted GPU, unless collateral is stop; a planned holder's untargeted share counts only over
    the tolerance (640 MiB);
(b) no set decided "stop" takes anything outside the holder's own program: its kind and name are a grouping of one
    program in the truth (never a generic launcher or session unit, never a unit whose main process manages several
    programs, never a docker container that runs supervisord), each member is of that program, and no member is a
    manager (supervisord, dockerd, containerd, a shim, a login shell, cron, sshd, tmux, a user's manager, a nested
    container's init) or the container's init;
(c) a holder in a nested container gets "no set";
(d) a user service's set is stopped through that user's manager (systemctl --user -M 1000@ ...);
and, as checks of the evidence layer and of the rule's other half: every set found is the holder's grouping in the
truth with exactly the truth's members, and where NVML names every holder, a set is decided "stop" exactly when the
truth allows it (its program's own, its main process the holder or an ancestor, no GPU collateral).
Whether anything is reported free that is not (the verify step) is test_worlds.py's invariant 4: no world here
reaches it. `make test` runs 2,000 worlds; `make test-deep` 100,000 (GPUOPS_WORLDS).
"""

import os
import pprint
import random
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._release import Releaser

from conftest import CTL, UVM, ProcTree, ctx, vis
from fake_nvml import FakeNvml
from release_opts import release_opts

WORLDS = int(os.environ.get("GPUOPS_WORLDS", "2000"))
SEEDS = st.integers(0, 2 ** 32 - 1)
TOLERANCE = 640
VMID = "101"
INIT = 100            # the container's init on the node (container pid 1)
MONITOR = 90          # lxc-start on the node
CT = "0::/lxc/101/ns"
USER = "/user.slice/user-1000.slice/user@1000.service"
SUPERVISORD = ["/usr/bin/python3", "/usr/bin/supervisord", "-n", "-c", "/etc/supervisor/supervisord.conf"]
MIBS = (300, 612, 2048, 30000)
# Three engine gaps these worlds found were fixed in issue 42 (their smallest worlds are the last tests below): a
# planned holder's ambiguous untargeted GPU was not collateral; a `docker exec`'d process was no member of its docker
# container; a docker container inside a nested container got a `docker stop` in container 101.
OWN_UNITS = ("vllm.service", "trainer.service", "sglang.service", "tgi.service", "ollama.service", "comfyui.service",
             "jobs@3.service", "batch-7.service")
USER_UNITS = ("jupyter.service", "notebook.service", "lab-runner.service")
PROGRAMS = ("trainer", "inference", "redis", "embedder", "api", "worker")


class World(object):
    """The truth: processes (pid, ppid, comm, argv, cgroup inside the container, environ, NSpid depth, uid, a login
    shell's tty), what each is (role: init, manager or app; program: the one program it belongs to), the groupings
    (kind, name) -> {truth: own, generic or multi, members}, what each holder holds ({GPU: MiB}), and the holders NVML
    does not name."""

    def __init__(self, seed):
        self.seed = seed
        self.rng = random.Random(seed)
        self.gpus = self.rng.randint(1, 4)
        self.procs = {}
        self.groups = {}
        self.contexts = {}
        self.unnamed = set()
        self.next_pid = 200
        self.used = set()
        self.add(INIT, MONITOR, "systemd", ["/sbin/init"], "/init.scope", role="init", program=("init",))
        self.docker_daemons = False
        self.user_manager = None

    # -- building
    def pid(self):
        self.next_pid += self.rng.randint(1, 7)
        return self.next_pid

    def add(self, pid, ppid, comm, argv, cg, role="app", program=None, groups=(), env=None, depth=2, uid=0,
            tty=False, gpu=False):
        self.procs[pid] = {"pid": pid, "ppid": ppid, "comm": comm, "argv": list(argv), "cg": cg, "role": role,
                           "program": program or (role, pid), "env": env, "depth": depth, "uid": uid, "tty": tty,
                           "gpu": gpu}
        for key in groups:
            self.groups[key]["members"].append(pid)
        return pid

    def group(self, kind, name, truth):
        self.groups.setdefault((kind, name), {"truth": truth, "members": []})
        return (kind, name)

    def pick(self, pool):
        left = [n for n in pool if n not in self.used]
        if not left:
            return None
        name = self.rng.choice(left)
        self.used.add(name)
        return name

    def one_program(self, top_ppid, cg, program, groups, uid=0, depth=2, env=None):
        """One program's processes below top_ppid: the holder alone, an API server with GPU workers (and a helper
        that holds none), or a wrapper shell over the holder."""
        rng = self.rng
        shape = rng.choice(("single", "api", "wrapper"))
        kw = dict(program=program, groups=groups, uid=uid, depth=depth, env=env)
        if shape == "single":
            return self.add(self.pid(), top_ppid, "python3", ["python3", "serve.py", "--port", "8000"], cg, gpu=True,
                            **kw)
        if shape == "wrapper":
            top = self.add(self.pid(), top_ppid, "sh", ["sh", "-c", "python3 serve.py; exit $?"], cg, **kw)
            self.add(self.pid(), top, "python3", ["python3", "serve.py"], cg, gpu=True, **kw)
            return top
        top = self.add(self.pid(), top_ppid, "python3", ["python3", "-m", "api_server"], cg,
                       gpu=rng.random() < 0.3, **kw)
        for rank in range(rng.randint(1, 3)):
            self.add(self.pid(), top, "python3", ["python3", "-m", "worker", "--rank", str(rank)], cg, gpu=True, **kw)
        if rng.random() < 0.4:
            self.add(self.pid(), top, "tokenizer", ["tokenizer", "--threads", "4"], cg, **kw)
        return top

    def own_unit(self):
        name = self.pick(OWN_UNITS)
        if name is None:
            return
        key = self.group("systemd", name, "own")
        cg = "/system.slice/" + name
        if self.rng.random() < 0.15:
            # a daemon that forked away: its parent is the container's init, its cgroup still the unit's
            self.add(self.pid(), INIT, "runner", ["runner", "--daemon"], cg, program=("unit", name), groups=[key])
            self.add(self.pid(), INIT, "python3", ["python3", "daemon.py"], cg, program=("unit", name), groups=[key],
                     gpu=True)
            return
        self.one_program(INIT, cg, ("unit", name), [key])

    def generic_unit(self):
        kind = self.rng.choice(("cron", "ssh", "rc-local"))
        name = kind + ".service"
        key = self.group("systemd", name, "generic")
        cg = "/system.slice/" + name
        if kind == "cron":
            if not self.groups[key]["members"]:
                self.add(self.pid(), INIT, "cron", ["/usr/sbin/cron", "-f"], cg, role="manager", groups=[key])
            cron = self.groups[key]["members"][0]
            job = ("cron job", self.pid())
            if self.rng.random() < 0.5:
                shell = self.add(self.pid(), cron, "sh", ["/bin/sh", "-c", "python3 /opt/nightly.py"], cg, program=job,
                                 groups=[key])
                self.add(self.pid(), shell, "python3", ["python3", "/opt/nightly.py"], cg, program=job, groups=[key],
                         gpu=True)
            else:   # the job daemonised: its parent is init, its cgroup cron's
                self.add(self.pid(), INIT, "python3", ["python3", "/opt/nightly.py"], cg, program=job, groups=[key],
                         gpu=True)
        elif kind == "ssh":
            if not self.groups[key]["members"]:
                self.add(self.pid(), INIT, "sshd", ["sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups"], cg,
                         role="manager", groups=[key])
            listener = self.groups[key]["members"][0]
            session = self.add(self.pid(), listener, "sshd", ["sshd: root@pts/0"], cg, role="manager", groups=[key])
            shell = self.add(self.pid(), session, "bash", ["-bash"], cg, role="manager", groups=[key], tty=True)
            job = ("ssh session job", self.pid())
            self.add(self.pid(), shell if self.rng.random() < 0.6 else INIT, "python3", ["python3", "train.py"], cg,
                     program=job, groups=[key], gpu=True)
        else:
            self.add(self.pid(), INIT, "python3", ["python3", "/opt/boot-serve.py"], cg,
                     program=("rc.local daemon", self.next_pid), groups=[key], gpu=True)

    def multi_unit(self):
        """A unit whose main process manages several programs: a tmux server, or a login shell on a tty."""
        name = self.pick(("workbench.service", "kiosk.service"))
        if name is None:
            return
        key = self.group("systemd", name, "multi")
        cg = "/system.slice/" + name
        if name == "workbench.service":
            top = self.add(self.pid(), INIT, "tmux: server", ["tmux", "new-session", "-d"], cg, role="manager",
                           groups=[key])
        else:
            top = self.add(self.pid(), INIT, "bash", ["-bash"], cg, role="manager", groups=[key], tty=True)
        for n in range(self.rng.randint(1, 2)):
            shell = self.add(self.pid(), top, "bash", ["bash"], cg, program=("window", name, n), groups=[key]) \
                if top != INIT and name == "workbench.service" else top
            self.add(self.pid(), shell, "python3", ["python3", "job%d.py" % n], cg, program=("window", name, n),
                     groups=[key], gpu=True)

    def supervisor(self, ppid=INIT, cg=None, depth=2, groups=()):
        """supervisord (under supervisor.service, under init, or a custom unit; or inside a docker container) with
        1-3 programs; a program's environment may have been cleared (env -i), so that it is not seen as one."""
        rng = self.rng
        if cg is None:
            where = rng.choice(("supervisor.service", "init", "stack.service"))
            cg = "/init.scope" if where == "init" else "/system.slice/" + where
            groups = [] if where == "init" else [self.group("systemd", where, "multi")]
        names = [n for n in (self.pick(PROGRAMS) for dummy in range(rng.randint(1, 3))) if n]
        if not names:
            return
        conf = "/etc/supervisor/supervisord.conf" if depth > 2 or "/etc" not in self.used else "/opt/stack/sd.conf"
        self.used.add("/etc")
        sup = self.add(self.pid(), ppid, "supervisord", SUPERVISORD[:-1] + [conf], cg, role="manager", groups=groups,
                       depth=depth)
        grouped = rng.random() < 0.3
        for name in names:
            group = "workers" if grouped else name
            full = "%s:%s" % (group, name)
            env = {"SUPERVISOR_ENABLED": "1", "SUPERVISOR_PROCESS_NAME": name, "SUPERVISOR_GROUP_NAME": group,
                   "SUPERVISOR_SERVER_URL": "unix:///var/run/supervisor.sock"}
            if rng.random() < 0.08:
                env = {"PATH": "/usr/bin"}
                key = None
            else:
                key = self.group("supervisord", full, "own")
            program = ("program", sup, full)
            below = list(groups) + ([key] if key else [])
            if name == "redis":
                self.add(self.pid(), sup, "redis-server", ["redis-server", "*:6379"], cg, program=program,
                         groups=below, env=env, depth=depth)
            else:
                self.one_program(sup, cg, program, below, depth=depth, env=env)

    def docker(self):
        rng = self.rng
        if not self.docker_daemons:
            self.docker_daemons = True
            for unit, comm in (("containerd.service", "containerd"), ("docker.service", "dockerd")):
                key = self.group("systemd", unit, "generic")
                self.add(self.pid(), INIT, comm, ["/usr/bin/" + comm], "/system.slice/" + unit, role="manager",
                         groups=[key])
        cid = "%064x" % rng.getrandbits(256)
        by_shim = rng.random() < 0.6
        argv = (["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", cid, "-address",
                 "/run/containerd/containerd.sock"] if by_shim else
                ["containerd-shim", "-namespace", "moby", "-workdir",
                 "/var/lib/containerd/io.containerd.runtime.v1.linux/moby/" + cid, "-address",
                 "/run/containerd/containerd.sock", "-containerd-binary", "/usr/bin/containerd"])
        containerd = self.group("systemd", "containerd.service", "generic")
        shim = self.add(self.pid(), INIT, "containerd-shim", argv, "/system.slice/containerd.service", role="manager",
                        groups=[containerd])
        cg = rng.choice(("/system.slice/docker-%s.scope" % cid, "/docker/" + cid))
        inside = rng.choice(("app", "app", "tini", "supervisord"))
        if inside == "supervisord" and not [n for n in PROGRAMS if n not in self.used]:
            inside = "app"     # no program name left: supervisord would start nothing (deep run, seed 1953)
        key = self.group("docker", cid[:12], "multi" if inside == "supervisord" else "own")
        if inside == "supervisord":
            self.supervisor(shim, cg, 3, [key])
        elif inside == "tini":
            top = self.add(self.pid(), shim, "tini", ["/tini", "--", "python3", "serve.py"], cg,
                           program=("docker", cid), groups=[key], depth=3)
            self.one_program(top, cg, ("docker", cid), [key], depth=3)
        else:
            self.one_program(shim, cg, ("docker", cid), [key], depth=3)
        if rng.random() < 0.3:    # docker exec: the shim starts it too, in its cgroup
            program = ("docker", cid) if inside != "supervisord" else ("docker exec", cid)
            top = self.add(self.pid(), shim, "bash", ["bash"], cg, program=program, groups=[key], depth=3) \
                if rng.random() < 0.5 else shim
            self.add(self.pid(), top, "python3", ["python3", "debug.py"], cg, program=program, groups=[key],
                     depth=3, gpu=True)

    def user_services(self):
        if self.user_manager is None:
            manager = self.group("systemd-user", "user@1000.service", "generic")   # never found: a user@ unit
            self.user_manager = self.add(self.pid(), INIT, "systemd", ["/lib/systemd/systemd", "--user"],
                                         USER + "/init.scope", role="manager", uid=1000, groups=[manager])
        name = self.pick(USER_UNITS)
        if name is None:
            return
        key = self.group("systemd-user", name, "own")
        self.one_program(self.user_manager, USER + "/app.slice/" + name, ("user service", name), [key], uid=1000)

    def nested(self):
        """A container inside the container: an LXC one (its own cgroup tree), or a sandbox unit's unshare."""
        n = self.pid()
        program = ("nested", n)
        if self.rng.random() < 0.5:
            monitor = self.add(self.pid(), INIT, "lxc-start", ["lxc-start", "-F", "-n", "inner%d" % n],
                               "/lxc.monitor/inner%d" % n, role="manager")
            cg = "/lxc/inner%d/ns" % n
            top = self.add(self.pid(), monitor, "systemd", ["/sbin/init"], cg + "/init.scope", role="manager",
                           depth=3)
            self.add(self.pid(), top, "python3", ["python3", "serve.py"], cg + "/system.slice/app.service",
                     program=program, depth=3, gpu=True)
            if self.rng.random() < 0.3:   # docker in the nested container: its own
                cid = "%064x" % self.rng.getrandbits(256)
                argv = ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", cid]
                shim = self.add(self.pid(), top, "containerd-shim", argv, cg + "/system.slice/containerd.service",
                                role="manager", depth=3)
                self.add(self.pid(), shim, "python3", ["python3", "serve.py"],
                         cg + "/system.slice/docker-%s.scope" % cid, program=program, depth=4, gpu=True)
        else:
            name = self.pick(("sandbox.service",))
            if name is None:
                return
            key = self.group("systemd", name, "multi")
            cg = "/system.slice/" + name
            top = self.add(self.pid(), INIT, "unshare", ["unshare", "-fp", "--mount-proc", "python3", "run.py"], cg,
                           role="manager", groups=[key])
            self.add(self.pid(), top, "python3", ["python3", "run.py"], cg, program=program, groups=[key], depth=3,
                     gpu=True)

    def by_hand(self):
        """Started by hand: under init (pct exec), or in a user's login session (a scope: no unit to stop)."""
        if self.rng.random() < 0.5:
            self.add(self.pid(), INIT, "python3", ["python3", "try.py"], "/init.scope", gpu=True)
        else:
            cg = "/user.slice/user-1000.slice/session-%d.scope" % self.rng.randint(1, 9)
            shell = self.add(self.pid(), INIT, "bash", ["-bash"], cg, role="manager", uid=1000, tty=True)
            self.add(self.pid(), shell, "python3", ["python3", "notebook.py"], cg, uid=1000, gpu=True)

    def bystanders(self):
        """A unit of its own that holds no GPU (nginx: a master and a worker)."""
        key = self.group("systemd", "nginx.service", "own")
        if not self.groups[key]["members"]:
            top = self.add(self.pid(), INIT, "nginx", ["nginx: master process"], "/system.slice/nginx.service",
                           program=("unit", "nginx.service"), groups=[key])
            self.add(self.pid(), top, "nginx", ["nginx: worker process"], "/system.slice/nginx.service",
                     program=("unit", "nginx.service"), groups=[key])

    def draw(self):
        rng = self.rng
        parts = (self.own_unit, self.own_unit, self.own_unit, self.generic_unit, self.generic_unit, self.multi_unit,
                 self.supervisor, self.supervisor, self.docker, self.docker, self.user_services, self.nested,
                 self.by_hand, self.bystanders)
        for dummy in range(rng.randint(1, 4)):
            rng.choice(parts)()
        able = [p for p in sorted(self.procs) if self.procs[p]["gpu"]]
        if not able:
            self.own_unit() if "vllm.service" not in self.used else self.by_hand()
            able = [p for p in sorted(self.procs) if self.procs[p]["gpu"]]
        for pid in able:
            if rng.random() < 0.6:
                self.contexts[pid] = self.contexts_drawn()
        if not self.contexts:
            self.contexts[rng.choice(able)] = self.contexts_drawn()
        if rng.random() < 0.25:     # NVML does not name some holders: orphaned memory pins them, or it is ambiguous
            self.unnamed = set(p for p in self.contexts if rng.random() < 0.4)
        return self

    def contexts_drawn(self):
        size = min(self.gpus, self.rng.choice((1, 1, 1, 2, 2, 3, 4)))
        return dict((g, self.rng.choice(MIBS)) for g in sorted(self.rng.sample(range(self.gpus), size)))

    def supervisords(self):
        """How many supervisord processes the container runs (inside its docker containers too)."""
        return len([p for p in self.procs.values() if p["comm"] == "supervisord"])

    # -- what the engine reads
    def write(self, root):
        tree = ProcTree(root)
        tree.add(1, comm="systemd", ppid=0, cgroup="0::/init.scope\n")
        tree.add(MONITOR, comm="lxc-start", ppid=1, argv=["/usr/bin/lxc-start", "-F", "-n", VMID],
                 cgroup="0::/lxc.monitor/101\n")
        for pid in sorted(self.procs):
            proc = self.procs[pid]
            held = self.contexts.get(pid)
            maps = fds = ()
            if held:
                maps = [line for g in range(self.gpus) for line in (ctx(g) if g in held else vis(g))] + [CTL, UVM]
                fds = ["/dev/nvidia%d" % g for g in sorted(held)] + [CTL, UVM]
            nspid = [pid, 1] if pid == INIT else [pid, pid - 100, pid - 150, pid - 170][:proc["depth"]]
            tree.add(pid, comm=proc["comm"], ppid=proc["ppid"], argv=proc["argv"], nspid=nspid, uid=proc["uid"],
                     cgroup="%s%s\n" % (CT, proc["cg"]), maps=maps, fds=fds, session=pid if proc["tty"] else None)
            if proc["tty"]:
                login_tty(root, pid)
            if proc["env"] is not None:
                with open(os.path.join(str(root), str(pid), "environ"), "wb") as handle:
                    handle.write(b"".join(("%s=%s" % kv).encode() + b"\0" for kv in sorted(proc["env"].items())))
        gpus = []
        for g in range(self.gpus):
            on = [(pid, held[g]) for pid, held in sorted(self.contexts.items()) if g in held]
            gpus.append({"minor": g, "used_mib": sum(mib for dummy, mib in on),
                         "procs": [(pid, mib) for pid, mib in on if pid not in self.unnamed]})
        return gpus

    def ancestors(self, pid):
        out = []
        while pid in self.procs and pid not in out:
            out.append(pid)
            pid = self.procs[pid]["ppid"]
        return out

    def __repr__(self):
        lines = ["world seed=%d: %d GPUs, container %s; NVML does not name %s" % (
            self.seed, self.gpus, VMID, sorted(self.unnamed) or "none")]
        for pid in sorted(self.procs):
            p = self.procs[pid]
            lines.append("  %d ppid=%d %-15s %-8s %s depth=%d uid=%d%s%s program=%s holds=%s" % (
                pid, p["ppid"], p["comm"], p["role"], p["cg"], p["depth"], p["uid"], " tty" if p["tty"] else "",
                " env=%s:%s" % (p["env"].get("SUPERVISOR_GROUP_NAME"), p["env"].get("SUPERVISOR_PROCESS_NAME"))
                if p["env"] else "", p["program"], self.contexts.get(pid, {})))
        for key in sorted(self.groups):
            lines.append("  grouping %s %s: %s, members %s" % (key[0], key[1], self.groups[key]["truth"],
                                                               self.groups[key]["members"]))
        return "\n".join(lines)


def login_tty(root, pid):
    """A login shell: its stat's tty_nr is a terminal's (pts/1)."""
    for path in ("%s/%d/stat" % (root, pid), "%s/%d/task/%d/stat" % (root, pid, pid)):
        with open(path) as handle:
            head, sep, tail = handle.read().rpartition(")")
        fields = tail.split()
        fields[4] = "34817"
        with open(path, "w") as handle:
            handle.write(head + sep + " " + " ".join(fields) + "\n")


def target_sets(count):
    for mask in range(1, 1 << count):
        yield [g for g in range(count) if mask >> g & 1]


# ---- the oracle

def said(why, what, *details):
    """A failure's text, in full: what broke, its details, then the target set, the plan and the world."""
    return "\n".join([what] + [pprint.pformat(d, width=118) for d in details] + [why])


def true_collateral(world, members, targets, planned, collateral):
    """The members whose stop would take GPU work that is not targeted, by the truth: every untargeted context, of a
    planned holder only over the tolerance; none with collateral: stop."""
    if collateral == "stop":
        return []
    out = []
    for pid in members:
        for g, mib in sorted(world.contexts.get(pid, {}).items()):
            if g not in targets and (pid not in planned or mib > TOLERANCE):
                out.append((pid, g, mib))
    return out


def truth_of_set(world, entry):
    return world.groups.get((entry["kind"], entry["name"]))


def main_of(world, members):
    """The grouping's processes whose parent is not in it (the processes its manager started)."""
    inside = set(members)
    return [p for p in members if world.procs[p]["ppid"] not in inside]


def check_set(world, entry, targets, planned, collateral, exact, why):
    members = [m["pid"] for m in entry["members"]]
    holders = entry["pids"]
    nested = [p for p in holders if world.procs[p]["program"][0] == "nested"]
    # (c) a nested container's holder has no stop set
    assert not nested or entry["verdict"] == "no set", said(why, "(c) a nested holder's set", entry)
    if entry["kind"] is None:
        # no set: a nested container's holder, or a supervisord program while the container runs more than one
        # supervisord (a program's name cannot tell which: red team R4a)
        alone = [p for p in holders if p in nested or (world.supervisords() > 1 and expected_set(world, p) == "no set")]
        assert entry["verdict"] == "no set" and alone == holders, said(why, "a holder with no set", entry)
        return
    truth = truth_of_set(world, entry)
    assert truth is not None, said(why, "a set the truth does not have", entry)
    if entry["verdict"] == "stop":
        # what the stop takes: the whole grouping (docker stop, systemctl stop), whatever the evidence listed
        members = sorted(set(members) | set(truth["members"]))
        # (a) GPU collateral, by the truth
        lost = true_collateral(world, members, targets, planned, collateral)
        assert not lost, said(why, "(a) stopped, with untargeted GPU work (pid, GPU, MiB) %s" % lost, entry)
        # (b) the holder's own program: one program's grouping, every member of it, no manager, not init
        assert truth["truth"] == "own", said(why, "(b) a %s grouping stopped" % truth["truth"], entry)
        programs = set(world.procs[p]["program"] for p in holders)
        assert len(programs) == 1, said(why, "(b) holders of several programs in one set", programs, entry)
        assert all(world.procs[m]["program"] in programs for m in members), said(
            why, "(b) a member of another program", [(m, world.procs[m]["program"]) for m in members], entry)
        assert all(world.procs[m]["role"] == "app" for m in members) and INIT not in members, said(
            why, "(b) a manager or the container's init taken", entry)
        # (d) a user's service through its own manager
        if entry["kind"] == "systemd-user" or list(programs)[0][0] == "user service":
            assert entry["argv"][:4] == ["systemctl", "--user", "-M", "1000@"], said(
                why, "(d) the wrong manager", entry)
    # the evidence layer: the set is the holders' grouping in the truth, with exactly its members
    assert sorted(m["pid"] for m in entry["members"]) == sorted(truth["members"]), said(why, "members", entry, truth)
    assert set(holders) <= set(truth["members"]), said(why, "holders outside their set", entry)
    if exact:
        # the rule's other half, where the evidence is exact: stopped exactly when the truth allows it
        tops = main_of(world, truth["members"])
        if entry["kind"] == "docker":
            tops = tops[:1]    # its entrypoint (started first); a `docker exec`'d process is a member, never its main
        own_program = truth["truth"] == "own" and len(tops) == 1 and all(
            tops[0] in world.ancestors(h) for h in holders)
        unplanned = [m for m in members if m not in planned and set(world.contexts.get(m, ())) & set(targets)]
        assert not unplanned, said(why, "a member that holds a targeted GPU is not planned", unplanned, entry)
        want = "stop" if own_program and not true_collateral(world, members, targets, planned, collateral) \
            else "refused"
        assert entry["verdict"] == want, said(why, "exact evidence: decided %s, the truth says %s" % (
            entry["verdict"], want), entry)


def check_restart(world, verdict, members, targets, planned, collateral, exact, why):
    lost = true_collateral(world, members, targets, planned, collateral)
    if verdict["verdict"] == "stop":
        assert not lost, said(why, "(a) the restart stops untargeted GPU work (pid, GPU, MiB) %s" % lost, verdict)
    if exact:
        assert verdict["verdict"] == ("refused" if lost else "stop"), said(
            why, "exact evidence: the restart", lost, verdict)


def expected_set(world, pid):
    """The kind and name of the set the truth puts a holder in: the innermost grouping that has it; "no set" in a
    nested container; None for a scope (by hand, a login session) or a process whose program hides from
    supervisord's environment under init."""
    proc = world.procs[pid]
    if proc["program"][0] == "nested":
        return "no set"
    keys = [k for k, g in world.groups.items() if pid in g["members"]]
    for kind in ("docker", "supervisord", "systemd-user", "systemd"):
        found = [k for k in keys if k[0] == kind]
        if found:
            return "no set" if kind == "supervisord" and world.supervisords() > 1 else found[0]
    return None


def run_world(world, root):
    """The real engine over world, every check made; returns what was decided, one dict per target set and collateral
    mode: targets, collateral, refusals, sets ({(kind, name) or ("no set", holders): verdict}), restart (verdict)."""
    gpus = world.write(root)
    confs = {VMID: node.parse_pve_conf("".join("dev%d: /dev/nvidia%d\n" % (g, g) for g in range(world.gpus)))}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(node, "read_pve_confs", lambda *a, **k: confs)
        # the container's manager, asked which live units a stop would stop too: none in these worlds
        patch.setattr(stopsets, "unit_dependents", lambda entry, *a, **k: [])
        engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=root, self_pid=999999)
        engine.view, engine.in_container = "node", False
        engine.start()
        try:
            report = engine.snapshot(list(range(world.gpus)))
            return check_report(world, engine, report, root)
        finally:
            engine.nvml.shutdown()


def check_report(world, engine, report, root):
    exact = not world.unnamed
    held = dict((h["pid"], h) for h in report.holders)
    assert sorted(held) == sorted(world.contexts), said(repr(world), "the holders read", sorted(held))
    processes = node.processes_by_container(root, report.scan).get(VMID, [])
    members = [p["pid"] for p in processes]
    assert sorted(members) == sorted(world.procs), said(repr(world), "the container's processes", members)
    decided = []
    for targets in target_sets(world.gpus):
        for collateral in ("refuse", "stop"):
            why = "targets %s, collateral %s" % (targets, collateral)
            releaser = Releaser(engine, targets, release_opts(collateral=collateral,
                                                              collateral_tolerance_mib=TOLERANCE,
                                                              scope=node.Scope([int(VMID)], proc_root=root),
                                                              stop_found_units=True))
            releaser.prepare(report)
            allowed = releaser.find_units(report)
            planned = set(r["pid"] for r in releaser.to_signal)
            why = "%s, planned %s, refusals %s\n%r" % (why, sorted(planned), releaser.refusals, world)
            covered = {}
            for entry in releaser.stop_sets:
                for pid in entry["pids"]:
                    assert pid not in covered, said(why, "a holder in two sets", entry)
                    covered[pid] = entry
                check_set(world, entry, targets, planned, collateral, exact, why)
            for pid in planned:
                want = expected_set(world, pid)
                entry = covered.get(pid)
                got = None if entry is None else ("no set" if entry["kind"] is None else (entry["kind"], entry["name"]))
                assert got == want, said(why, "pid %d's set: found %s, the truth's %s" % (pid, got, want))
            assert [e for e in releaser.stop_sets if e["verdict"] == "stop"] == allowed, said(why, "stopped", allowed)
            verdict = releaser._restart_verdict(report, VMID, processes)   # pylint: disable=protected-access
            check_restart(world, verdict, members, targets, planned, collateral, exact, why)
            decided.append({"targets": targets, "collateral": collateral, "refusals": releaser.refusals,
                            "restart": verdict["verdict"], "sets": dict(
                                (("no set", tuple(e["pids"])) if e["kind"] is None else (e["kind"], e["name"]),
                                 e["verdict"]) for e in releaser.stop_sets)})
    return decided


def scratch():
    """A tmpfs when there is one: thousands of /proc trees are written."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="gpuops-stopsets-", dir=base)


@settings(max_examples=WORLDS, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(SEEDS)
def test_stop_sets_take_only_the_holders_own_program_and_no_untargeted_gpu_work(seed):
    world = World(seed).draw()
    root = scratch()
    try:
        decided = run_world(world, os.path.join(root, "proc"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # every target set was decided under both collateral modes, each decision checked against the truth above
    assert [(d["targets"], d["collateral"]) for d in decided] == [
        (t, c) for t in target_sets(world.gpus) for c in ("refuse", "stop")], decided


def test_a_world_prints_its_seed_and_processes():
    text = repr(World(7).draw())
    assert text.startswith("world seed=7: ") and "grouping" in text and "ppid=" in text


# ---- the engine's gaps these worlds found (fixed in issue 42), each in its smallest world

CID = "5e" * 32


def small_world(gpus):
    world = World(0)
    world.gpus, world.procs, world.groups, world.contexts = gpus, {}, {}, {}
    world.add(INIT, MONITOR, "systemd", ["/sbin/init"], "/init.scope", role="init", program=("init",))
    return world


def run_small(world):
    """What run_world decided, by (targets, collateral)."""
    root = scratch()
    try:
        return dict(((tuple(d["targets"]), d["collateral"]), d) for d in run_world(world, os.path.join(root, "proc")))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_planned_holders_ambiguous_untargeted_gpu_is_collateral(monkeypatch):
    """trainer.service's one process holds GPU 0 (2 GiB) and GPU 1 (30 GiB); a process started by hand holds GPU 1
    (2 GiB); NVML names neither (forks of dead parents). GPU 0's orphaned memory pins the trainer there; GPU 1's fits
    both, so both are ambiguous there. Releasing GPU 0 with collateral: refuse planned the trainer (decide counted no
    untargeted share of it) and decided `systemctl stop trainer.service`: its 30 GiB on GPU 1 went with it. Now the
    ambiguous GPU is collateral: the holder, its unit and the restart are refused."""
    world = small_world(2)
    key = world.group("systemd", "trainer.service", "own")
    world.add(210, INIT, "python3", ["python3", "train.py"], "/system.slice/trainer.service",
              program=("unit", "trainer.service"), groups=[key], gpu=True)
    world.add(220, INIT, "python3", ["python3", "try.py"], "/init.scope", gpu=True)
    world.contexts = {210: {0: 2048, 1: 30000}, 220: {1: 2048}}
    world.unnamed = set([210, 220])
    decided = run_small(world)[((0,), "refuse")]
    assert decided["sets"] == {("systemd", "trainer.service"): "refused"} and decided["restart"] == "refused", decided
    assert [r for r in decided["refusals"] if r.startswith("pid 210 (python3) also has a context on GPU 1")], decided


def test_a_docker_exec_holders_set_is_its_whole_container():
    """Docker container C runs a server on GPU 1 (2 GiB); `docker exec` started a job on GPU 0 in it. Releasing GPU 0
    found C by the job's shim, listed the job alone as its members, and decided `docker stop C`: the server's work on
    GPU 1 went with it. Now every process of C is a member and its main is its entrypoint (the server, no ancestor of
    the job): refused, with collateral: stop too."""
    world = small_world(2)
    containerd = world.group("systemd", "containerd.service", "generic")
    key = world.group("docker", CID[:12], "own")
    world.add(205, INIT, "containerd-shim", ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", CID],
              "/system.slice/containerd.service", role="manager", groups=[containerd])
    cg = "/system.slice/docker-%s.scope" % CID
    world.add(210, 205, "python3", ["python3", "serve.py"], cg, program=("docker", CID), groups=[key], depth=3)
    world.add(220, 205, "python3", ["python3", "debug.py"], cg, program=("docker", CID), groups=[key], depth=3)
    world.contexts = {210: {1: 2048}, 220: {0: 2048}}
    decided = run_small(world)
    for collateral in ("refuse", "stop"):
        assert decided[((0,), collateral)]["sets"] == {("docker", CID[:12]): "refused"}, decided[((0,), collateral)]


def test_a_docker_container_inside_a_nested_container_has_no_set():
    """A nested LXC container in 101 runs docker; its container's process holds GPU 0. Its set was that docker
    container, to be stopped by `docker stop` run in container 101, where no such container is: it is "no set", as
    any holder of a nested container."""
    world = small_world(1)
    world.add(205, INIT, "lxc-start", ["lxc-start", "-F", "-n", "inner"], "/lxc.monitor/inner", role="manager")
    world.add(210, 205, "systemd", ["/sbin/init"], "/lxc/inner/ns/init.scope", role="manager", depth=3)
    world.add(215, 210, "containerd-shim", ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", CID],
              "/lxc/inner/ns/system.slice/containerd.service", role="manager", depth=3)
    world.add(220, 215, "python3", ["python3", "serve.py"], "/lxc/inner/ns/system.slice/docker-%s.scope" % CID,
              program=("nested", 205), depth=4, gpu=True)
    world.contexts = {220: {0: 2048}}
    decided = run_small(world)
    assert [d["sets"] for d in decided.values()] == [{("no set", (220,)): "no set"}] * 2, decided
