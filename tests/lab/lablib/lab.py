"""Bring a lab up and down: state folder, cgroups, driver daemon, containers, nodes."""

import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

from lablib import container, sysutil
from lablib.common import (DEFAULT_PCT_DELAY, LAB_DIR, REPO, STATE_ROOT, LabError, cgroup2_mount,
                           freezer_mount, node_address, node_name, pid_alive, read_json, rmtree_quiet,
                           run_id, state_dir, vmid_for, wait_for, write_file, write_json)

GPU_DEV_SIZE = 4096
DEFAULT_FREE_DELAY = 0.15  # seconds from the last reference to memory back (the driver's FREE_DELAY_S)
NODE_USER, NODE_UID = "gpuops", 4242  # non-root node user with sudo (for become on the node)
UNPRIV_BASE = 100000  # lxc.idmap = u 0 100000 65536: container root on the node
CT_ROOTS = "/run/gpuops-lab-ct"  # a systemd container's root file system (an overlay), in its node's mount namespace
WHEELS = os.path.join(REPO, ".cache", "wheels")
VENV = os.path.join(REPO, ".lab", "venv")
VENV_BARE = os.path.join(REPO, ".lab", "venv-bare")
VENV_PACKAGES = ("psutil", "nvidia-ml-py", "supervisor", "proxmoxer", "requests")  # proxmoxer: the node-side container rung over the API


def _pveapi():
    """The lab API's module, imported by the commands that use it (http.server and ssl cost every labctl call
    about 35 ms)."""
    from lablib import pveapi
    return pveapi


def system_python():
    for candidate in ("/usr/bin/python3", sys.executable):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise LabError("no python3 found")


class Lab:
    def __init__(self):
        self.rid = run_id()
        self.state = state_dir(self.rid)
        self.cg2 = cgroup2_mount()
        self.freezer = freezer_mount()
        self.cg_root = os.path.join(self.cg2, "gpuops-lab-" + self.rid) if self.cg2 else None
        self.config_path = os.path.join(self.state, "labctl.json")

    @property
    def fz_root(self):
        """The lab's folder in the v1 freezer hierarchy (below this process's freezer cgroup)."""
        if not self.freezer or not os.path.isdir(self.state):
            return None
        return next((r for r in self.v1_roots() if r.startswith(self.freezer + "/")), None)

    # ----- paths and records
    @property
    def config(self):
        cfg = read_json(self.config_path)
        if cfg is None:
            raise LabError("lab %s is not up (run labctl up)" % self.rid)
        return cfg

    def node_dir(self, node):
        return os.path.join(self.state, "nodes", node)

    def container(self, node, vmid):
        cfg = self.config
        if node not in cfg["nodes"]:
            raise LabError("no node %s in lab %s (nodes: %s)" % (node, self.rid, ", ".join(sorted(cfg["nodes"]))))
        ct = container.load(self.node_dir(node), str(vmid))
        if ct is None:
            raise LabError("no container %s on node %s" % (vmid, node))
        return _live(ct)

    def find_node(self, vmid):
        for node, ncfg in self.config["nodes"].items():
            if str(vmid) in ncfg["containers"]:
                return node
        raise LabError("no container %s in lab %s" % (vmid, self.rid))

    # ----- up
    def shape(self, nodes, containers, gpus, layouts, nvml_pids, bare, unprivileged=(), shared_run_lock=(), systemd=(),
              systemd_node=()):
        shape = {"nvml_pids": nvml_pids, "nodes": {}}
        for k in range(1, nodes + 1):
            cts = {}
            for j in range(1, containers + 1):
                vmid = str(vmid_for(k, j))
                minors = layouts.get(vmid, list(range(gpus)))
                bad = [m for m in minors if m < 0 or m >= gpus]
                if bad:
                    raise LabError("layout of %s names minors %s, node has %d GPUs" % (vmid, bad, gpus))
                cts[vmid] = {"minors": minors, "bare": vmid in bare, "unprivileged": vmid in unprivileged}
                if vmid in shared_run_lock:  # only when set: the shape of a lab without it stays as it was
                    cts[vmid]["shared_run_lock"] = True
                if vmid in systemd:
                    cts[vmid]["systemd"] = True
                if vmid in systemd_node:
                    cts[vmid]["systemd_node"] = True
            shape["nodes"][node_name(k)] = {"gpus": gpus, "containers": cts}
        unknown = ((set(layouts) | set(bare) | set(unprivileged) | set(shared_run_lock) | set(systemd))
                   - {v for n in shape["nodes"].values() for v in n["containers"]})
        if unknown:
            raise LabError("--layout/--bare/--unprivileged/--systemd/--shared-run-lock name vmids not in the lab: %s"
                           % ", ".join(sorted(unknown)))
        both = set(bare) & set(systemd)
        if both:
            raise LabError("--bare and --systemd both name %s: a systemd container has its own root file system"
                           % ", ".join(sorted(both)))
        return shape

    def up(self, nodes=2, containers=2, gpus=8, layouts=None, nvml_pids="modern", bare=(), free_delay=None,
           unprivileged=(), shared_run_lock=(), systemd=(), systemd_node=()):
        shape = self.shape(nodes, containers, gpus, layouts or {}, nvml_pids, [str(b) for b in bare],
                           [str(u) for u in unprivileged], [str(v) for v in shared_run_lock],
                           [str(v) for v in systemd], [str(v) for v in systemd_node])
        self.free_delay = DEFAULT_FREE_DELAY if free_delay is None else float(free_delay)
        if self.free_delay < 0:
            raise LabError("--free-delay must be >= 0")
        from lablib.preflight import preflight
        preflight()
        existing = read_json(self.config_path)
        if existing is not None:
            if existing.get("shape") == shape:
                self.ensure()
                return existing
            sys.stderr.write("labctl: lab %s has another shape; rebuilding it\n" % self.rid)
            self.down()
        elif os.path.exists(self.state) or (self.cg_root and os.path.isdir(self.cg_root)):
            self.down()
        try:
            return self._build(shape)
        except BaseException:
            if os.environ.get("LAB_KEEP_FAILED") == "1":  # to read the logs of a failed build; labctl down after
                raise
            try:  # a half-built lab goes away; the build error is the one to report
                self.down()
            except LabError as exc:
                sys.stderr.write("labctl: %s\n" % exc)
            raise

    def _build(self, shape):
        os.makedirs(STATE_ROOT, exist_ok=True)
        os.makedirs(self.state)
        os.chmod(self.state, 0o711)  # the node user reads ssh/authorized_keys; nothing is listable
        for sub in ("ssh", "driver", "lib", "sbin", "nodes", "lxcfs", "pve/ha"):
            os.makedirs(os.path.join(self.state, sub))
        write_file(self.ha_path(), "")  # /etc/pve/ha/resources.cfg on every node (cluster-wide, as in PVE)
        ensure_venvs()
        self._build_library()
        self._write_sbin()
        self._ssh_keys()
        os.makedirs(self.cg_root, exist_ok=True)
        cfg = {"rid": self.rid, "repo": REPO, "state": self.state, "shape": shape, "nodes": {},
               "cgroup_root": self.cg_root, "freezer_root": self.fz_root,
               "driver": {"pid": None, "socket": os.path.join(self.state, "driver", "driver.sock")},
               "pct_delay": float(os.environ.get("LAB_PCT_DELAY", DEFAULT_PCT_DELAY)),
               "free_delay_s": self.free_delay}
        for k, (node, nshape) in enumerate(sorted(shape["nodes"].items(), key=lambda kv: int(kv[0][3:])), 1):
            cfg["nodes"][node] = self._build_node(node, k, nshape, cfg)
        self._write_driver_config(shape, cfg["free_delay_s"])
        self._known_hosts(cfg)
        cfg["driver"]["pid"] = self._start_driver()
        cfg["lxcfs_pid"] = self._start_lxcfs()
        cfg["api"] = self._start_api(cfg)
        for node, ncfg in cfg["nodes"].items():
            ncfg["sshd_pid"] = self._start_sshd(node, ncfg)
        self._write_driver_config(shape, cfg["free_delay_s"])  # now with each node's pid namespace
        for node, ncfg in cfg["nodes"].items():  # sshd listens once the node's mounts are made
            self._wait_sshd(node, ncfg)
        container.start_many([(self.node_dir(node), vmid) for node, ncfg in cfg["nodes"].items()
                              for vmid in ncfg["containers"]])
        write_json(self.config_path, cfg)
        self.write_inventory(cfg)
        return cfg

    def ensure(self):
        """Restart whatever died in an existing lab (labctl up on a lab that is up)."""
        cfg = self.config
        cfg["pct_delay"] = float(os.environ.get("LAB_PCT_DELAY", DEFAULT_PCT_DELAY))
        for node in cfg["nodes"]:
            path = os.path.join(self.node_dir(node), "node.json")
            write_json(path, dict(read_json(path), pct_delay=cfg["pct_delay"]))
        cfg["free_delay_s"] = getattr(self, "free_delay", DEFAULT_FREE_DELAY)
        lab_json = os.path.join(self.state, "lab.json")  # the driver reads it at each request
        write_json(lab_json, dict(read_json(lab_json) or {}, free_delay_s=cfg["free_delay_s"]))
        if not pid_alive(cfg["driver"]["pid"]):
            cfg["driver"]["pid"] = self._start_driver()
        if not pid_alive((cfg.get("api") or {}).get("pid")):
            cfg["api"] = self._start_api(cfg)
        if not pid_alive(cfg.get("lxcfs_pid")):
            cfg["lxcfs_pid"] = self._start_lxcfs()
        restarted = False
        for node, ncfg in cfg["nodes"].items():
            if not pid_alive(ncfg.get("sshd_pid")):
                ncfg["sshd_pid"] = self._start_sshd(node, ncfg)
                self._wait_sshd(node, ncfg)
                restarted = True
        if restarted:
            self._write_driver_config({"nvml_pids": cfg["shape"]["nvml_pids"], "nodes": cfg["nodes"]},
                                      cfg["free_delay_s"])
        container.start_many([(self.node_dir(node), vmid) for node, ncfg in cfg["nodes"].items()
                              for vmid in ncfg["containers"]])
        write_json(self.config_path, cfg)
        self.write_inventory(cfg)

    def _build_library(self):
        lib = os.path.join(self.state, "lib")
        # what build.sh made (the library and its unversioned link), copied: each lab owns its files
        shutil.copytree(built_library(), lib, symlinks=True, dirs_exist_ok=True)
        # -X: no links touched outside lib; -C: our own cache, the host's stays as it is.
        _run(["ldconfig", "-X", "-C", os.path.join(lib, "ld.so.cache"), lib])

    def _write_sbin(self):
        sbin = os.path.join(self.state, "sbin")
        smi = os.path.join(LAB_DIR, "driver", "nvidia-smi")
        write_file(os.path.join(sbin, "nvidia-smi"),
                   "#!/bin/sh\nexec %s %s \"$@\"\n" % (VENV + "/bin/python", smi), 0o755)
        # the MPS control tool where NVIDIA's packages put it in a container (its /usr/local/sbin and /usr/bin): the
        # node-side release asks a container's daemon by the tool's name, never by a path a process shows (issue 41)
        write_file(os.path.join(sbin, "nvidia-cuda-mps-control"),
                   "#!/bin/sh\nexec /usr/bin/python3 %s \"$@\"\n" % os.path.join(LAB_DIR, "driver", "mps_control.py"), 0o755)
        for tool in ("supervisorctl", "supervisord"):
            # the lab's config unless the caller names one (gpu_release names supervisord's own -c)
            write_file(os.path.join(sbin, tool),
                       "#!/bin/sh\ncase \" $* \" in *\" -c \"*|*\" --configuration\"*) exec %s/bin/%s \"$@\";; esac\n"
                       "exec %s/bin/%s -c /run/supervisor/supervisord.conf \"$@\"\n" % (VENV, tool, VENV, tool), 0o755)

    def _ssh_keys(self):
        key = os.path.join(self.state, "ssh", "id_ed25519")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuops-lab-" + self.rid, "-f", key])
        shutil.copy(key + ".pub", os.path.join(self.state, "ssh", "authorized_keys"))

    def _build_node(self, node, k, nshape, cfg):
        ndir = self.node_dir(node)
        for sub in ("dev/nvidia-caps", "lxc", "containers", "sbin", "bin", "etc/lxc", "lxcpath"):
            os.makedirs(os.path.join(ndir, sub))
        dev = os.path.join(ndir, "dev")
        names = ["nvidia%d" % m for m in range(nshape["gpus"])] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                                                                   "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2"]
        for name in names:
            with open(os.path.join(dev, name), "wb") as f:
                f.truncate(GPU_DEV_SIZE)
            os.chmod(os.path.join(dev, name), 0o666)
        address = node_address(self.rid, k)
        py = system_python()
        ncfg = {"node": node, "number": k, "address": address, "gpus": nshape["gpus"], "sshd_pid": None,
                "containers": {}}
        write_json(os.path.join(ndir, "node.json"), {
            "rid": self.rid, "node": node, "state": self.state, "node_dir": ndir, "python": py,
            "lab_dir": LAB_DIR, "repo": REPO, "address": address, "pct_delay": cfg["pct_delay"],
            "cgroup_root": self.cg_root, "freezer_root": self.fz_root, "init_pid": None, "pidns": None})
        write_file(os.path.join(ndir, "etc", "lxc", "lxc.conf"), "lxc.lxcpath = %s\n" % container.lxcpath(ndir))
        ct_roots = []  # the systemd containers' overlays, mounted by the node (nodeinit)
        for vmid, cshape in nshape["containers"].items():
            cg_rel = "/gpuops-lab-%s/%s/lxc/%s/ns" % (self.rid, node, vmid)
            bare_venv = self._bare_venv(vmid) if cshape["bare"] else None
            python = (bare_venv or VENV) + "/bin/python"
            unpriv = bool(cshape.get("unprivileged"))
            shared_lock = bool(cshape.get("shared_run_lock"))
            systemd = bool(cshape.get("systemd"))
            if systemd:
                ct_roots.append(self._systemd_root(ndir, vmid, unpriv))
            if bare_venv and unpriv:  # the role installs into it: container root (uid 100000) owns it
                _chown_tree(bare_venv, UNPRIV_BASE)
            write_file(container.conf_path(ndir, vmid), proxmox_conf(vmid, cshape["minors"], unpriv, dev, shared_lock))
            write_json(container.config_path(ndir, vmid), {
                "vmid": vmid, "node": node, "init_host_pid": None, "cgroup": cg_rel,
                "cgroup_path": self.cg2 + cg_rel, "minors": cshape["minors"], "python": python,
                "bare": cshape["bare"], "unprivileged": unpriv, "shared_run_lock": shared_lock,
                "running": False, "state": self.state,
                "freezer_path": self._freezer_path(node, vmid),
                "rid": self.rid, "supervisor_venv": VENV, "bare_venv": bare_venv, "systemd": systemd,
                "systemd_node": bool(cshape.get("systemd_node"))})
            self.write_lxc_config(node, vmid)
            ncfg["containers"][vmid] = {"minors": cshape["minors"], "python": python, "bare": cshape["bare"],
                                        "unprivileged": unpriv, "systemd": systemd}
        # Stand-ins seen at Proxmox's paths inside the node's mount namespace.
        # pct decodes its arguments by the node's locale: Python must not coerce a C locale to UTF-8.
        write_file(os.path.join(ndir, "sbin", "pct"), "#!/bin/sh\nPYTHONCOERCECLOCALE=0 exec %s -sB %s --node-dir %s \"$@\"\n"
                   % (py, os.path.join(LAB_DIR, "node", "pct"), ndir), 0o755)
        # The fake nvidia-smi on the node's /usr/bin (overlay), where Debian's NVIDIA packages put it.
        shutil.copy2(os.path.join(self.state, "sbin", "nvidia-smi"), os.path.join(ndir, "bin", "nvidia-smi"))
        # supervisorctl where Debian's supervisor package puts it: the node's root runs its tools from system folders
        # only, never one beside a process's own path (issue 41)
        shutil.copy2(os.path.join(self.state, "sbin", "supervisorctl"), os.path.join(ndir, "bin", "supervisorctl"))
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node, "-f", os.path.join(ndir, "ssh_host_ed25519_key")])
        self._node_user(ndir)
        write_file(os.path.join(ndir, "sshd_config"), sshd_config(self.state, ndir, address))
        cg = os.path.join(self.cg_root, node, "sshd")
        os.makedirs(cg)
        node_cgroups = [os.path.join(self.cg_root, node)] + [os.path.join(r, node) for r in self.v1_roots()]
        write_json(os.path.join(ndir, "nodeinit.json"), {"node_dir": ndir, "state": self.state, "cgroup_path": cg,
                                                         "cgroups": node_cgroups, "node": node, "gpus": nshape["gpus"],
                                                         "nodes": sorted(cfg["shape"]["nodes"]),
                                                         "supervisor_venv": VENV, "lab_dir": LAB_DIR,
                                                         "ct_roots": ct_roots})
        return ncfg

    def _systemd_root(self, ndir, vmid, unpriv):
        """A systemd container's root: an overlay its node mounts at CT_ROOTS/VMID (lower: the cached Debian tree,
        never written; upper: the container's own, under STATE, owned by its root)."""
        from lablib import rootfs
        own = os.path.join(ndir, "ctroot", vmid)
        upper, work = os.path.join(own, "upper"), os.path.join(own, "work")
        os.makedirs(upper, mode=0o755)
        os.makedirs(work, mode=0o700)
        if unpriv:
            os.chown(upper, UNPRIV_BASE, UNPRIV_BASE)
        return {"vmid": vmid, "lower": rootfs.path(UNPRIV_BASE if unpriv else 0), "upper": upper, "work": work,
                "target": os.path.join(CT_ROOTS, vmid)}

    def _bare_venv(self, vmid):
        """A private copy of .lab/venv-bare (pip only) for one container, so installs never leak between labs."""
        dst = os.path.join(self.state, "venvs", str(vmid))
        shutil.copytree(VENV_BARE, dst, symlinks=True)
        bindir = os.path.join(dst, "bin")
        for name in os.listdir(bindir):
            path = os.path.join(bindir, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            if data.startswith(b"#!") and VENV_BARE.encode() in data.split(b"\n", 1)[0]:
                with open(path, "wb") as f:
                    f.write(data.replace(VENV_BARE.encode(), dst.encode(), 1))
        return dst

    def _node_user(self, ndir):
        """passwd, group, shadow and sudoers.d for the node's namespace, with the lab's non-root user."""
        etc = os.path.join(ndir, "etc")
        home = os.path.join(ndir, "home", NODE_USER)
        os.makedirs(home)
        os.chown(home, NODE_UID, NODE_UID)
        os.makedirs(etc, exist_ok=True)
        extra = {"passwd": "%s:x:%d:%d:gpuops lab node user:%s:/bin/sh\n" % (NODE_USER, NODE_UID, NODE_UID, home),
                 "group": "%s:x:%d:\n" % (NODE_USER, NODE_UID),
                 "shadow": "%s:*:20000:0:99999:7:::\n" % NODE_USER}
        for name, line in extra.items():
            with open("/etc/" + name) as f:
                text = f.read()
            write_file(os.path.join(etc, name), text + ("" if text.endswith("\n") else "\n") + line,
                       0o640 if name == "shadow" else 0o644)
        if os.path.isdir("/etc/sudoers.d"):
            shutil.copytree("/etc/sudoers.d", os.path.join(etc, "sudoers.d"))
            write_file(os.path.join(etc, "sudoers.d", "gpuops-lab"),
                       "%s ALL=(ALL:ALL) NOPASSWD: ALL\n" % NODE_USER, 0o440)

    def _write_driver_config(self, shape, free_delay):
        nodes = {}
        for node, nshape in shape["nodes"].items():
            nodes[node] = {"gpus": nshape["gpus"], "dev_dir": os.path.join(self.node_dir(node), "dev"),
                           "pidns": (read_json(os.path.join(self.node_dir(node), "node.json")) or {}).get("pidns"),
                           "containers": {vmid: {"minors": c["minors"],
                                                 "cgroup": "/gpuops-lab-%s/%s/lxc/%s/ns" % (self.rid, node, vmid)}
                                          for vmid, c in nshape["containers"].items()}}
        write_json(os.path.join(self.state, "lab.json"),
                   {"rid": self.rid, "nvml_pids": shape["nvml_pids"], "free_delay_s": free_delay, "nodes": nodes})

    def _known_hosts(self, cfg):
        lines = []
        for node, ncfg in sorted(cfg["nodes"].items()):
            with open(os.path.join(self.node_dir(node), "ssh_host_ed25519_key.pub")) as f:
                keytype, key = f.read().split()[:2]
            lines.append("%s %s %s\n" % (ncfg["address"], keytype, key))
        write_file(os.path.join(self.state, "ssh", "known_hosts"), "".join(lines))

    def _spawn(self, argv, cgroup, log):
        """Start a daemon detached from us, inside cgroup; returns its pid."""
        os.makedirs(cgroup, exist_ok=True)

        def join():
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write("0")

        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True, preexec_fn=join, cwd="/")
        proc.returncode = 0  # lives on after we exit
        return proc.pid

    def _start_driver(self):
        daemon = os.path.join(LAB_DIR, "driver", "labdriver.py")
        if not os.path.exists(daemon):
            raise LabError("missing %s (the fake driver)" % daemon)
        sock = os.path.join(self.state, "driver", "driver.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        pid = self._spawn([system_python(), daemon, "--state", self.state], os.path.join(self.cg_root, "driver"),
                          os.path.join(self.state, "driver.log"))

        def ready():
            if not pid_alive(pid):
                raise LabError("driver daemon exited (see %s/driver.log)" % self.state)
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(sock)
                return True
            except OSError:
                return False

        wait_for(ready, 15, what="the driver socket %s" % sock)
        return pid

    def _start_sshd(self, node, ncfg):
        ndir = self.node_dir(node)
        try:
            socket.create_connection((ncfg["address"], 22), timeout=0.5).close()
        except OSError:
            pass
        else:
            raise LabError("%s:22 is already taken (another lab whose LAB_ID gives the same address?)"
                           % ncfg["address"])
        pidfile = os.path.join(ndir, "sshd.pid")
        if os.path.exists(pidfile):
            os.unlink(pidfile)
        init = os.path.join(LAB_DIR, "lablib", "nodeinit.py")
        pid = self._spawn([system_python(), "-I", init, os.path.join(ndir, "nodeinit.json")],
                          os.path.join(self.cg_root, node, "sshd"), os.path.join(ndir, "nodeinit.log"))

        def node_init():  # unshare --fork's child: pid 1 of the node's pid namespace
            if not pid_alive(pid):
                raise LabError("node %s exited: %s" % (node, _tail(os.path.join(ndir, "nodeinit.log"))))
            for kid in _children(pid):
                try:
                    if os.stat("/proc/%d/ns/pid" % kid).st_ino != _own_pidns():
                        return kid
                except OSError:
                    continue  # a child that exited between the listing and the stat (seen in CI): not the init
            return None

        init_pid = wait_for(node_init, 15, what="the init of node %s" % node)
        path = os.path.join(ndir, "node.json")
        ncfg["init_pid"], ncfg["pidns"] = init_pid, os.stat("/proc/%d/ns/pid" % init_pid).st_ino
        write_json(path, dict(read_json(path), init_pid=init_pid, pidns=ncfg["pidns"]))
        return pid

    def _start_lxcfs(self):
        """The lab's own LXCFS on STATE/lxcfs (nodes bind it on /var/lib/lxcfs, where LXC's hook finds it)."""
        mnt = os.path.join(self.state, "lxcfs")
        if any(row.split(" - ")[0].split()[4] == mnt for row in _host_mounts()):
            try:
                sysutil.umount(mnt)
            except OSError:
                pass
        pid = self._spawn(["lxcfs", "-f", "-p", os.path.join(self.state, "lxcfs.pid"), mnt],
                          os.path.join(self.cg_root, "lxcfs"), os.path.join(self.state, "lxcfs.log"))

        def ready():
            if not pid_alive(pid):
                raise LabError("lxcfs exited (see %s/lxcfs.log)" % self.state)
            return os.path.exists(os.path.join(mnt, "proc", "uptime"))

        wait_for(ready, 15, what="lxcfs on %s" % mnt)
        return pid

    def _freezer_path(self, node, vmid):
        return os.path.join(self.fz_root, node, "lxc", str(vmid), "ns") if self.fz_root else None

    def v1_roots(self):
        """HIERARCHY/OWN_CGROUP/gpuops-lab-RID for each cgroup v1 hierarchy, fixed at the first call (STATE)."""
        path = os.path.join(self.state, "cgroup_v1.json")
        roots = read_json(path)
        if roots is None:
            own = {}
            with open("/proc/self/cgroup") as f:
                for line in f:
                    num, ctrls, cg = line.rstrip("\n").split(":", 2)
                    for ctrl in ctrls.split(","):
                        own[ctrl] = cg
            roots = []
            for mnt, opts in cgroup_v1_mounts(with_options=True):
                ctrl = next((o for o in opts.split(",") if o in own or "name=" + o in own), None)
                base = own.get(ctrl, own.get("name=" + (ctrl or ""), "/")) if ctrl else "/"
                roots.append(os.path.normpath(mnt + base + "/gpuops-lab-" + self.rid))
            if os.path.isdir(self.state):
                write_json(path, roots)
        return roots

    def write_lxc_config(self, node, vmid):
        """LXCPATH/VMID/config as Proxmox VE 8 writes /var/lib/lxc/VMID/config (PVE::LXC::update_lxc_config)."""
        ndir = self.node_dir(node)
        ct = container.load(ndir, vmid)
        folder = os.path.join(container.lxcpath(ndir), str(vmid))
        os.makedirs(folder, exist_ok=True)
        write_file(os.path.join(folder, "config"), lxc_config(self.rid, self.state, node, ct,
                                                              container.conf_path(ndir, vmid)))

    def _start_api(self, cfg):
        """The lab's Proxmox REST API on node 1's address, port 8006 (lablib/pveapi.py)."""
        pveapi = _pveapi()
        first = sorted(cfg["nodes"].values(), key=lambda n: n["number"])[0]
        address = first["address"]
        try:
            socket.create_connection((address, pveapi.PORT), timeout=0.5).close()
        except OSError:
            pass
        else:
            raise LabError("%s:%d is already taken (another lab whose LAB_ID gives the same address?)"
                           % (address, pveapi.PORT))
        info = pveapi.make_credentials(self.state, address)
        pid = self._spawn([system_python(), "-I", os.path.join(LAB_DIR, "lablib", "pveapi.py"), self.state],
                          os.path.join(self.cg_root, "api"), os.path.join(self.state, "api", "api.log"))

        def ready():
            if not pid_alive(pid):
                raise LabError("lab API exited (see %s/api/api.log)" % self.state)
            try:
                socket.create_connection((address, pveapi.PORT), timeout=0.5).close()
                return True
            except OSError:
                return False

        wait_for(ready, 15, interval=0.05, what="the lab API on %s:%d" % (address, pveapi.PORT))
        return dict(info, pid=pid)

    def _wait_sshd(self, node, ncfg):
        def ready():
            if not pid_alive(ncfg["sshd_pid"]):
                raise LabError("sshd of %s exited (see %s/sshd.log)" % (node, self.node_dir(node)))
            try:
                with socket.create_connection((ncfg["address"], 22), timeout=0.5) as s:
                    return s.recv(4).startswith(b"SSH-")
            except OSError:
                return False

        wait_for(ready, 15, interval=0.05, what="sshd of %s on %s:22" % (node, ncfg["address"]))

    # ----- inventory
    def inventory_path(self):
        return os.path.join(self.state, "inventory.yml")

    def api_inventory_path(self):
        return os.path.join(self.state, "lab.proxmox_gpu.yml")

    def write_inventory(self, cfg):
        ssh = os.path.join(self.state, "ssh")
        common = {"ansible_user": "root", "ansible_ssh_private_key_file": os.path.join(ssh, "id_ed25519"),
                  "ansible_ssh_common_args": "-o UserKnownHostsFile=%s -o IdentitiesOnly=yes"
                                             % os.path.join(ssh, "known_hosts")}
        cts, nodes = {}, {}
        for node, ncfg in sorted(cfg["nodes"].items()):
            # The lab venv (psutil, nvidia-ml-py) runs on the node too: node-side modules need it.
            nodes[node] = dict(common, ansible_host=ncfg["address"], ansible_connection="ssh",
                               ansible_python_interpreter=VENV + "/bin/python", lab_node_user=NODE_USER)
            for vmid, c in sorted(ncfg["containers"].items()):
                cts["ct%s" % vmid] = dict(common, ansible_connection="gpuops.fleet.pct",
                                          ansible_host=ncfg["address"], pve_node_host=ncfg["address"],
                                          proxmox_node_host=node, pct_vmid=int(vmid), lab_node=node,
                                          ansible_python_interpreter=c["python"],
                                          # lab containers share the host's /root: keep temp files in their /tmp
                                          ansible_remote_tmp="/tmp/.ansible/tmp")
        inv = {"all": {"children": {"gpu_containers": {"hosts": cts}, "pve_nodes": {"hosts": nodes},
                                    "proxmox_nodes": {"hosts": {node: {} for node in nodes}}}}}
        write_file(self.inventory_path(), "# gpuops lab %s, written by labctl\n" % self.rid + to_yaml(inv))
        if cfg.get("api"):
            self.write_api_inventory(cfg)

    def write_api_inventory(self, cfg):
        """STATE/lab.proxmox_gpu.yml: the gpuops.fleet.proxmox_gpu inventory over the lab API."""
        pveapi = _pveapi()
        ssh = os.path.join(self.state, "ssh")
        bare = {vmid: c["python"] for ncfg in cfg["nodes"].values() for vmid, c in ncfg["containers"].items()
                if c.get("bare")}
        python = "'%s'" % (VENV + "/bin/python")
        if bare:  # bare containers keep their private venv wherever they run
            python = "%s.get(proxmox_vmid | string, %s)" % (json.dumps(bare, sort_keys=True), python)
        compose = {"ansible_user": "'root'",
                   "ansible_ssh_private_key_file": "'%s'" % os.path.join(ssh, "id_ed25519"),
                   "ansible_ssh_common_args": "'-o UserKnownHostsFile=%s -o IdentitiesOnly=yes'"
                                              % os.path.join(ssh, "known_hosts"),
                   "ansible_python_interpreter": python,
                   "pve_node_host": "ansible_host", "lab_node": "proxmox_node",
                   "ansible_remote_tmp": "'/tmp/.ansible/tmp'"}
        # node hosts (group proxmox_nodes, plain ssh): same key and known_hosts, the lab venv's python
        node_compose = {key: compose[key] for key in ("ansible_user", "ansible_ssh_private_key_file",
                                                      "ansible_ssh_common_args")}
        node_compose.update({"ansible_python_interpreter": "'%s'" % (VENV + "/bin/python"), "lab_node": "proxmox_node"})
        conf = {"plugin": "gpuops.fleet.proxmox_gpu", "url": "https://%s:%d" % (cfg["api"]["address"], pveapi.PORT),
                "user": pveapi.USER, "token_id": pveapi.TOKEN_ID, "token_secret": pveapi.read_secret(self.state, "token"),
                "ca_path": cfg["api"]["ca"], "compose": compose, "node_compose": node_compose}
        write_file(self.api_inventory_path(), "# gpuops lab %s, written by labctl (API %s)\n"
                   % (self.rid, cfg["api"]["url"]) + to_yaml(conf), 0o600)

    # ----- down
    def down(self):
        """Remove every process, cgroup and file of this lab. Returns what was left, if anything."""
        problems = []
        cfg = read_json(self.config_path) or {}
        if self.fz_root and os.path.isdir(self.fz_root):
            for group in _subdirs_deep(self.fz_root):
                container.thaw(group)
        for node, ncfg in (cfg.get("nodes") or {}).items():  # lxc-stop -k each container first
            for vmid in ncfg.get("containers", {}):
                ct = container.load(self.node_dir(node), vmid)
                if ct and container.is_running(ct):
                    try:
                        container.lxc_stop(self.node_dir(node), vmid, kill=True, timeout=10)
                    except LabError as exc:
                        problems.append(str(exc))
        if self.cg_root and os.path.isdir(self.cg_root):
            _write(os.path.join(self.cg_root, "cgroup.kill"), "1")
        if self.fz_root and os.path.isdir(self.fz_root):
            for group in _subdirs_deep(self.fz_root):
                container.thaw(group)
        if self.cg_root and os.path.isdir(self.cg_root):
            try:
                wait_for(lambda: not _populated(self.cg_root), 10, what="lab processes to die")
            except LabError as exc:
                problems.append(str(exc))
            for group in _subdirs_deep(self.cg_root):
                _rmdir(group, problems)
        try:  # cgroups empty out at exit; wait for the zombies to be reaped too
            wait_for(lambda: not lab_pids(self.rid), 10, what="lab processes to be reaped")
        except LabError:
            problems.append("processes left: %s" % lab_pids(self.rid))
        if self.fz_root and os.path.isdir(self.fz_root):
            for group in _subdirs_deep(self.fz_root):
                for pid in _read_ints(os.path.join(group, "cgroup.procs")):
                    _write(os.path.join(self.freezer, "cgroup.procs"), str(pid))
        for root in (read_json(os.path.join(self.state, "cgroup_v1.json")) or []):  # LXC's, in every hierarchy
            if os.path.isdir(root):
                for group in _subdirs_deep(root):
                    _rmdir(group, problems)
        lxcfs_mnt = os.path.join(self.state, "lxcfs")
        for row in _host_mounts():
            if row.split(" - ")[0].split()[4] == lxcfs_mnt:
                try:
                    sysutil.umount(lxcfs_mnt)
                except OSError as exc:
                    problems.append(str(exc))
        left = [row for row in _host_mounts() if self.state in row]
        if left:
            problems.append("mounts left: %s" % left)
        elif os.path.exists(self.state):
            rmtree_quiet(self.state)
        try:
            os.rmdir(STATE_ROOT)
        except OSError:
            pass
        if problems:
            raise LabError("down left: " + "; ".join(problems))

    # ----- status
    def status(self):
        cfg = read_json(self.config_path)
        if cfg is None:
            return {"rid": self.rid, "up": False, "state": self.state}
        out = {"rid": self.rid, "up": True, "state": self.state, "inventory": self.inventory_path(),
               "driver": {"pid": cfg["driver"]["pid"], "alive": pid_alive(cfg["driver"]["pid"])},
               "nodes": {}}
        healthy = out["driver"]["alive"]
        if cfg.get("api"):
            out["api"] = {"url": cfg["api"]["url"], "pid": cfg["api"]["pid"], "alive": pid_alive(cfg["api"]["pid"]),
                          "ca": cfg["api"]["ca"], "inventory": self.api_inventory_path()}
            healthy = healthy and out["api"]["alive"]
        for node, ncfg in sorted(cfg["nodes"].items()):
            nout = {"address": ncfg["address"], "sshd_pid": ncfg.get("sshd_pid"),
                    "sshd_alive": pid_alive(ncfg.get("sshd_pid")), "gpus": ncfg["gpus"], "containers": {}}
            healthy = healthy and nout["sshd_alive"]
            for vmid in sorted(ncfg["containers"]):
                ct = _live(container.load(self.node_dir(node), vmid))
                nout["containers"][vmid] = {"running": bool(ct.get("init_host_pid")),
                                            "init_host_pid": ct.get("init_host_pid"),
                                            "init_node_pid": ct.get("init_node_pid"),
                                            "unprivileged": bool(ct.get("unprivileged")), "minors": ct["minors"],
                                            "python": ct["python"], "cgroup": ct["cgroup"],
                                            "systemd": bool(ct.get("systemd"))}
                healthy = healthy and nout["containers"][vmid]["running"]
            out["nodes"][node] = nout
        out["healthy"] = bool(healthy)
        return out

    # ----- migrate
    def migrate(self, vmid, target):
        """Move a container to another node like `pct migrate --restart`: stop, move its config, start there."""
        cfg, vmid = self.config, str(vmid)
        source = self.find_node(vmid)
        if target not in cfg["nodes"]:
            raise LabError("no node %s in lab %s (nodes: %s)" % (target, self.rid, ", ".join(sorted(cfg["nodes"]))))
        if target == source:
            raise LabError("CT %s is already on node %s" % (vmid, target))
        src_dir, dst_dir = self.node_dir(source), self.node_dir(target)
        ct = container.load(src_dir, vmid)
        if ct.get("systemd"):
            raise LabError("CT %s boots systemd from a root file system its node %s mounts: the lab does not migrate it"
                           % (vmid, source))
        bad = [m for m in ct["minors"] if m >= cfg["nodes"][target]["gpus"]]
        if bad:
            raise LabError("CT %s uses minors %s, node %s has %d GPUs" % (vmid, bad, target, cfg["nodes"][target]["gpus"]))
        was_running = container.is_running(ct)
        if was_running:
            ct = container.stop(src_dir, vmid, graceful_timeout=10.0)
        cg_rel = "/gpuops-lab-%s/%s/lxc/%s/ns" % (self.rid, target, vmid)
        ct.update(node=target, cgroup=cg_rel, cgroup_path=self.cg2 + cg_rel, freezer_path=self._freezer_path(target, vmid))
        write_json(container.config_path(dst_dir, vmid), {k: v for k, v in ct.items() if k != "node_dir"})
        os.replace(container.conf_path(src_dir, vmid), container.conf_path(dst_dir, vmid))
        os.unlink(container.config_path(src_dir, vmid))
        rmtree_quiet(os.path.join(container.lxcpath(src_dir), vmid))
        self.write_lxc_config(target, vmid)
        cfg["nodes"][target]["containers"][vmid] = cfg["nodes"][source]["containers"].pop(vmid)
        write_json(self.config_path, cfg)
        self._write_driver_config({"nvml_pids": cfg["shape"]["nvml_pids"], "nodes": cfg["nodes"]},
                                  cfg.get("free_delay_s", DEFAULT_FREE_DELAY))
        self.write_inventory(cfg)
        if was_running:
            ct = container.start(dst_dir, vmid)
        return {"vmid": vmid, "from": source, "to": target, "running": was_running,
                "init_host_pid": ct.get("init_host_pid")}

    # ----- locks and HA (what a node-side release must respect)
    def ha_path(self):
        return os.path.join(self.state, "pve", "ha", "resources.cfg")

    def lock(self, vmid, name=None):
        """Write `lock: NAME` into the container's conf (None: remove it), like PVE's set_lock/remove_lock."""
        if name is not None and not re.match(r"^[a-z][a-z-]*$", name):
            raise LabError("lock must be a word like backup, migrate, snapshot: %r" % name)
        node, vmid = self.find_node(vmid), str(vmid)
        path = container.conf_path(self.node_dir(node), vmid)
        with open(path) as f:
            text = f.read()
        write_file(path + ".tmp", set_conf_key(text, "lock", name))
        os.replace(path + ".tmp", path)  # the folder is what /etc/pve/lxc shows: rename keeps it live
        return {"vmid": vmid, "node": node, "lock": name}

    def ha_resources(self):
        return _pveapi().parse_ha(_read_text(self.ha_path()))

    def ha(self, vmid, state="started", remove=False):
        """Add (or replace) `ct: VMID` in /etc/pve/ha/resources.cfg, or remove it."""
        self.find_node(vmid)
        sid = "ct:%s" % vmid
        resources = [r for r in self.ha_resources() if r["sid"] != sid]
        if not remove:
            resources.append({"sid": sid, "type": "ct", "state": state})
        path = self.ha_path()
        write_file(path + ".tmp", _pveapi().format_ha(resources))
        os.replace(path + ".tmp", path)
        return {"sid": sid, "state": None if remove else state, "resources": [r["sid"] for r in resources]}

    # ----- restart
    def restart(self, node, vmid):
        self.container(node, vmid)
        container.stop(self.node_dir(node), str(vmid))
        return container.start(self.node_dir(node), str(vmid))


NVIDIA_MAJOR, NVIDIA_UVM_MAJOR = 195, 508  # 195 is fixed; nvidia-uvm's major differs per host
NODE_RUN_LOCK = "/run/lock"  # the node's (nodeinit makes it on the node's tmpfs /run); --shared-run-lock binds it


def proxmox_conf(vmid, minors, unprivileged=False, dev_dir="/dev", shared_run_lock=False):
    """/etc/pve/lxc/VMID.conf: GPUs as devN keys, plus the older raw style (device rules, lxc.mount.entry).

    shared_run_lock: the node's /run/lock bound at the container's /run/lock, as an admin writes it
    (the container's init binds it back above its own tmpfs /run)."""
    lines = ["arch: amd64", "cores: 8", "hostname: ct%s" % vmid, "memory: 65536",
             "net0: name=eth0,bridge=vmbr0,ip=dhcp,type=veth", "ostype: debian",
             "rootfs: local-lvm:vm-%s-disk-0,size=64G" % vmid, "swap: 0", "unprivileged: %d" % bool(unprivileged)]
    devs = ["/dev/nvidia%d" % m for m in minors]
    devs += ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
             "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]
    lines += ["dev%d: %s" % (i, d) for i, d in enumerate(devs)]
    if minors:
        lines.append("tags: gpu")
    raw = ["lxc.cgroup2.devices.allow: c %d:* rwm" % NVIDIA_MAJOR,
           "lxc.cgroup2.devices.allow: c %d:* rwm" % NVIDIA_UVM_MAJOR]
    # The lab's device files are regular files: these binds carry them in; the rules above enforce nothing.
    raw += ["lxc.mount.entry: %s/%s %s none bind,optional,create=file" % (dev_dir, d[len("/dev/"):], d[1:])
            for d in devs]
    if shared_run_lock:
        raw.append("lxc.mount.entry: %s %s none bind,create=dir 0 0" % (NODE_RUN_LOCK, NODE_RUN_LOCK.lstrip("/")))
    return "\n".join(sorted(lines) + raw) + "\n"


def set_conf_key(text, key, value):
    """The conf text with KEY set to value (None: removed) in its main section, keys kept sorted as PVE writes them."""
    lines = text.splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.startswith("[")), len(lines))
    main = [ln for ln in lines[:end] if not ln.startswith(key + ":")]
    if value is not None:
        at = next((i for i, ln in enumerate(main)
                   if ln.startswith("lxc.") or (":" in ln and not ln.startswith("#") and ln.split(":")[0] > key)),
                  len(main))
        main.insert(at, "%s: %s" % (key, value))
    return "\n".join(main + lines[end:]) + "\n"


def _read_text(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def lxc_config(rid, state, node, ct, pve_conf_path):
    """The LXC config Proxmox VE 8 derives from VMID.conf (PVE::LXC::update_lxc_config), for the lab.

    Kept: cgroup dirs (with the lab's prefix before lxc/VMID), includes, monitor.unshare, idmap,
    console, tty, TERM, uts name, the raw lxc.* lines of VMID.conf, device rules for devN.
    Lab: rootfs is the host's root file system (bound read-write by each node, never written:
    the init mounts tmpfs where the container writes), no network (lxc.net.0.type = empty instead of
    a veth on vmbr0), STATE and the clone bound at their own paths, ctinit.py as init.
    9.x differs: it may add lxc.init.cmd for an entrypoint and lxc.environment.runtime for env.
    """
    vmid, unpriv = ct["vmid"], bool(ct.get("unprivileged"))
    # Proxmox's lines as they are: LXC puts them below the cgroup of the node's init
    # (gpuops-lab-RID/NODE), the lab's prefix before lxc/VMID/ns.
    out = ["lxc.cgroup.relative = 0",
           "lxc.cgroup.dir.monitor = lxc.monitor/%s" % vmid,
           "lxc.cgroup.dir.container = lxc/%s" % vmid,
           "lxc.cgroup.dir.container.inner = ns",
           "lxc.arch = amd64",
           "lxc.include = /usr/share/lxc/config/common.conf"]  # no debian.common.conf here: PVE falls back
    if unpriv:
        out.append("lxc.include = /usr/share/lxc/config/userns.conf")
        out.append("lxc.mount.auto = sys:mixed")
    keys, raw = {}, []
    with open(pve_conf_path) as f:
        for line in f:
            key, sep, value = line.strip().partition(":")
            if not sep or line.startswith("#"):
                continue
            if key.startswith("lxc."):
                raw.append("%s = %s" % (key, value.strip()))
            else:
                keys[key] = value.strip()
    for key in sorted(k for k in keys if re.match(r"^dev\d+$", k)):
        match = re.match(r"^/dev/nvidia(\d+)", keys[key].split(",")[0])
        if match:
            out.append("lxc.cgroup2.devices.allow = c %d:%s rw" % (NVIDIA_MAJOR, match.group(1)))
    out.append("lxc.monitor.unshare = 1")
    if unpriv:
        out += ["lxc.idmap = u 0 %d 65536" % UNPRIV_BASE, "lxc.idmap = g 0 %d 65536" % UNPRIV_BASE]
    systemd = bool(ct.get("systemd"))
    out += ["lxc.console.path = none", "lxc.cgroup2.devices.deny = c 5:1 rwm", "lxc.tty.max = 2",
            "lxc.environment = TERM=linux", "lxc.uts.name = %s" % keys.get("hostname", "CT%s" % vmid),
            # the node's bind of the host's root file system, or a systemd container's own (an overlay)
            "lxc.rootfs.path = %s" % (os.path.join(CT_ROOTS, vmid) if systemd else "/run/gpuops-lab-rootfs"),
            "lxc.net.0.type = empty"]
    out += raw
    out += ["lxc.autodev = 1", "lxc.tty.dir =",  # LXC 5 here cannot make /dev/lxc/ttyN in a privileged autodev
            "lxc.mount.entry = %s %s none bind,create=dir 0 0" % (state, state.lstrip("/")),
            "lxc.mount.entry = %s %s none bind,create=dir 0 0" % (REPO, REPO.lstrip("/")),
            # a systemd container: its own /usr/bin/python3 (Debian's), which ends in exec /sbin/init
            "lxc.init.cmd = %s -I %s %s %s" % ("/usr/bin/python3" if systemd else system_python(), container.CTINIT,
                                               "--systemd" if systemd else "--inner",
                                               container.config_path(os.path.join(state, "nodes", node), vmid))]
    return "\n".join(out) + "\n"


def sshd_config(state, node_dir, address):
    return "\n".join([
        "# gpuops lab node sshd, written by labctl",
        "ListenAddress %s:22" % address,
        "HostKey %s/ssh_host_ed25519_key" % node_dir,
        "PidFile %s/sshd.pid" % node_dir,
        "AuthorizedKeysFile %s/ssh/authorized_keys" % state,
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "MaxSessions 100",
        "MaxStartups 100:30:200",
        "AcceptEnv LANG LC_*",
        "Subsystem sftp internal-sftp",
        "",
    ])


def to_yaml(value, indent=0):
    pad = "  " * indent
    out = ""
    for key, item in value.items():
        if isinstance(item, dict):
            out += "%s%s:%s\n" % (pad, key, "" if item else " {}")
            out += to_yaml(item, indent + 1)
        else:
            out += "%s%s: %s\n" % (pad, key, json.dumps(item) if isinstance(item, str) else item)
    return out


def built_library():
    """The folder .lab/lib/DIGEST where driver/build.sh put the stand-in libnvidia-ml.so.1, compiled once per
    source (build.sh and nvml_stub.c); each lab copies it (gcc cost about 0.35 CPU-s a bring-up)."""
    driver = os.path.join(LAB_DIR, "driver")
    digest = hashlib.sha256()
    for name in ("build.sh", "nvml_stub.c"):
        path = os.path.join(driver, name)
        if not os.path.exists(path):
            raise LabError("missing %s (the fake driver)" % path)
        with open(path, "rb") as handle:
            digest.update(name.encode() + b"\0" + handle.read() + b"\0")
    cache = os.path.join(REPO, ".lab", "lib")
    out = os.path.join(cache, digest.hexdigest()[:16])
    built = os.path.join(out, "libnvidia-ml.so.1")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(built):
            staging = out + ".new"
            shutil.rmtree(staging, ignore_errors=True)
            _run(["sh", os.path.join(driver, "build.sh"), staging])
            os.rename(staging, out)
    return out


def ensure_venvs():
    """Build .lab/venv (psutil, nvidia-ml-py, supervisor, offline from .cache/wheels) and .lab/venv-bare once."""
    os.makedirs(os.path.dirname(VENV), exist_ok=True)
    with open(os.path.join(os.path.dirname(VENV), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        py = system_python()
        if not os.path.exists(os.path.join(VENV, ".lab-ready")):
            if not os.path.isdir(WHEELS):
                raise LabError("missing %s (make venv downloads psutil, nvidia-ml-py, supervisor there)" % WHEELS)
            shutil.rmtree(VENV, ignore_errors=True)
            _run([py, "-m", "venv", VENV])
            _run([VENV + "/bin/pip", "install", "-q", "--no-index", "--find-links", WHEELS] + list(VENV_PACKAGES))
            write_file(os.path.join(VENV, ".lab-ready"), "ok\n")
        if not os.path.exists(os.path.join(VENV_BARE, ".lab-ready")):
            shutil.rmtree(VENV_BARE, ignore_errors=True)
            _run([py, "-m", "venv", VENV_BARE])
            write_file(os.path.join(VENV_BARE, ".lab-ready"), "ok\n")


def _run(argv):
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          check=False)
    if proc.returncode:
        raise LabError("%s failed (%d): %s" % (" ".join(argv), proc.returncode,
                                               proc.stdout.decode(errors="replace").strip()[-2000:]))
    return proc.stdout.decode(errors="replace")


def _write(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
    except (FileNotFoundError, ProcessLookupError):
        pass


def _read_ints(path):
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _populated(cg):
    try:
        with open(os.path.join(cg, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False


def _subdirs_deep(root):
    """root and every folder under it, deepest first."""
    found = []
    for entry in os.walk(root):
        found.append(entry[0])
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def _rmdir(path, problems):
    for dummy in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    problems.append("cgroup %s" % path)


def _live(ct):
    """The record with init pids asked of LXC now (pct start on a node records only the node's view)."""
    node_pid, host_pid = container.init_pid(ct)
    ct.update(init_node_pid=node_pid, init_host_pid=host_pid, running=bool(host_pid))
    if host_pid:
        ct["pidns_inode"] = os.stat("/proc/%d/ns/pid" % host_pid).st_ino
    return ct


def _tail(path, lines=5):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:])
    except OSError:
        return "(no log %s)" % path


def _children(pid):
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _own_pidns():
    return os.stat("/proc/self/ns/pid").st_ino


def cgroup_v1_mounts(with_options=False):
    rows = []
    with open("/proc/self/mountinfo") as f:
        for row in f.read().splitlines():
            if " - cgroup " in row:
                rows.append((row.split(" - ")[0].split()[4], row.split(" - ")[1].split()[2]))
    return rows if with_options else [mnt for mnt, opts in rows]


def _chown_tree(path, uid):
    for root, dirs, files in os.walk(path):
        for name in [root] + [os.path.join(root, n) for n in dirs + files]:
            os.lchown(name, uid, uid)


def _host_mounts():
    with open("/proc/self/mountinfo") as f:
        return f.read().splitlines()


def lab_pids(rid):
    """Host pids whose cgroup v2 path is under this lab's folder (zombies included)."""
    mark = "::/gpuops-lab-%s/" % rid
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/cgroup" % name) as f:
                    if mark in f.read():
                        found.append(int(name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return found
