"""labctl: drive the gpuops.fleet GPU lab (see tests/lab/README.md). Run through tests/lab/labctl."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from lablib import container, scenarios  # noqa: E402
from lablib.common import LabError  # noqa: E402
from lablib.lab import Lab  # noqa: E402
from lablib.preflight import preflight  # noqa: E402


def _layout(text):
    vmid, sep, minors = text.partition("=")
    if not sep or not vmid.isdigit():
        raise argparse.ArgumentTypeError("expected VMID=MINOR,MINOR,... got %r" % text)
    try:
        return vmid, [int(m) for m in minors.split(",") if m.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("minors must be integers: %r" % text)


def _ints(text):
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, got %r" % text)


def _vmids(text):
    vmids = [v.strip() for v in text.split(",") if v.strip()]
    if not vmids or not all(v.isdigit() for v in vmids):
        raise argparse.ArgumentTypeError("expected VMID[,VMID...], got %r" % text)
    return vmids


def parser():
    p = argparse.ArgumentParser(prog="labctl", description="gpuops.fleet GPU lab (LAB_ID picks the lab)")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the lab (idempotent)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--containers", type=int, default=2, help="containers per node")
    up.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    up.add_argument("--layout", type=_layout, action="append", default=[], metavar="VMID=M,M,...",
                    help="minors a container sees, in NVML index order")
    up.add_argument("--nvml-pids", choices=("modern", "legacy"), default="modern")
    up.add_argument("--bare", action="append", default=[], metavar="VMID",
                    help="container whose python has no packages (repeatable)")
    up.add_argument("--unprivileged", action="append", default=[], metavar="VMID",
                    help="make this container unprivileged (lxc.idmap u/g 0 100000 65536; repeatable)")
    up.add_argument("--shared-run-lock", action="append", default=[], metavar="VMID",
                    help="this container bind-mounts the node's /run/lock at its /run/lock "
                         "(lxc.mount.entry in its conf; repeatable)")
    up.add_argument("--systemd", type=_vmids, action="append", default=[], metavar="VMID[,VMID...]",
                    help="these containers boot Debian's real systemd as their init, from a root file system of "
                         "their own (built once with mmdebstrap, cached in .cache/lab-rootfs; repeatable)")
    up.add_argument("--systemd-node", type=_vmids, action="append", default=[], metavar="VMID[,VMID...]",
                    help="as --systemd, and the container plays a Proxmox node for the modules run inside it: it "
                         "has /etc/pve, and its init's environment no container= (node daemons as systemd units)")
    up.add_argument("--free-delay", type=float, default=None, metavar="S",
                    help="seconds a freed allocation stays used and listed (default 0.15)")
    sub.add_parser("down", help="remove every process, cgroup and file of the lab")
    sub.add_parser("status", help="JSON status; exit 3 when the lab is not up, 1 when degraded")
    inv = sub.add_parser("inventory", help="print the path of the Ansible inventory")
    inv.add_argument("--api", action="store_true",
                     help="print the path of STATE/lab.proxmox_gpu.yml (the gpuops.fleet.proxmox_gpu inventory) instead")
    sub.add_parser("preflight", help="check kernel features and tools")
    ex = sub.add_parser("exec", help="run a command in a container, like pct exec")
    ex.add_argument("--node", required=True)
    ex.add_argument("--vmid", required=True)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    nx = sub.add_parser("node-exec", help="run a command on a node (its PID and mount namespaces), as root there")
    nx.add_argument("--node", required=True)
    nx.add_argument("cmd", nargs=argparse.REMAINDER)
    run = sub.add_parser("run", help="start a workload scenario in a container")
    run.add_argument("scenario")
    run.add_argument("--node", required=True)
    run.add_argument("--vmid", required=True)
    run.add_argument("--gpus", type=_ints, default=[], help="container NVML indexes, e.g. 0,1")
    run.add_argument("--mib", type=int, default=None, help="MiB per GPU")
    run.add_argument("--cuda-visible-devices", type=_ints, default=None, metavar="I,J",
                     help="CUDA_VISIBLE_DEVICES of the workload (container NVML indexes); --gpus must be among them")
    gp = sub.add_parser("gpus", help="the fake driver's truth, as a JSON list")
    gp.add_argument("--node")
    fa = sub.add_parser("fault", help="inject a fault into a GPU or into driver init")
    fa.add_argument("--node", required=True)
    fa.add_argument("--gpu", type=int, help="minor")
    fa.add_argument("--fault", choices=("lost", "hang", "hang_memory", "hang_procs", "no_v2", "none"),
                    help="hang*: the call never returns and its thread is frozen (state D, SIGKILL pends) until "
                         "the fault is cleared; no_v2: the library has no v2 memory call")
    fa.add_argument("--init", choices=("not_loaded", "hang", "none"))
    fa.add_argument("--health", choices=("retired_pages_pending", "row_remap_pending", "row_remap_failure", "ecc_pending",
                                         "reset_required", "node_reboot_required", "drain_and_reset", "none"),
                    help="add a health condition to --gpu MINOR (several may hold); none clears them")
    fa.add_argument("--persistence", choices=("on", "off"), help="persistence mode of --gpu MINOR (off at start)")
    lk = sub.add_parser("leak", help="leave MiB used on a GPU with no process holding it")
    lk.add_argument("--node", required=True)
    lk.add_argument("--gpu", type=int, required=True, help="minor")
    lk.add_argument("--mib", type=int, default=1024)
    mg = sub.add_parser("migrate", help="move a container to another node (stop, move its config, start there)")
    mg.add_argument("--vmid", required=True)
    mg.add_argument("--to", required=True, metavar="NODE")
    lo = sub.add_parser("lock", help="set (or --clear) the lock of a container's conf, as a backup or migration would")
    lo.add_argument("--vmid", required=True)
    what = lo.add_mutually_exclusive_group(required=True)
    what.add_argument("--lock", metavar="NAME", help="backup, migrate, snapshot, rollback, mounted, ...")
    what.add_argument("--clear", action="store_true")
    ha = sub.add_parser("ha", help="manage a container by HA (/etc/pve/ha/resources.cfg), or --remove it")
    ha.add_argument("--vmid", required=True)
    ha.add_argument("--state", default="started", choices=("started", "stopped", "enabled", "disabled", "ignored"))
    ha.add_argument("--remove", action="store_true")
    rs = sub.add_parser("restart", help="kill everything in a container and start its init again")
    rs.add_argument("--node", required=True)
    rs.add_argument("--vmid", required=True)
    return p


def main(argv):
    args, extra = parser().parse_known_args(argv)
    if extra and args.command != "run":
        parser().error("unrecognized arguments: %s" % " ".join(extra))
    lab = Lab()
    try:
        if args.command == "up":
            lab.up(args.nodes, args.containers, args.gpus, dict(args.layout), args.nvml_pids, args.bare,
                   args.free_delay, args.unprivileged, args.shared_run_lock,
                   [v for group in args.systemd + args.systemd_node for v in group],
                   [v for group in args.systemd_node for v in group])
            print(json.dumps(lab.status(), sort_keys=True))
        elif args.command == "down":
            lab.down()
        elif args.command == "status":
            st = lab.status()
            print(json.dumps(st, indent=1, sort_keys=True))
            return 3 if not st["up"] else (0 if st["healthy"] else 1)
        elif args.command == "inventory":
            cfg = lab.config
            if args.api and not cfg.get("api"):
                raise LabError("lab %s has no API (started by an older labctl): run labctl up again" % lab.rid)
            lab.write_inventory(cfg)
            print(lab.api_inventory_path() if args.api else lab.inventory_path())
        elif args.command == "preflight":
            preflight()
            print("preflight ok")
        elif args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise LabError("exec needs a command after --")
            ct = lab.container(args.node, args.vmid)
            if not container.is_running(ct):
                raise LabError("container '%s' not running!" % args.vmid)
            argv = container.attach_argv(lab.node_dir(args.node), args.vmid, cmd)
            # Like pct exec: environment kept, SSL_CERT_* dropped, Proxmox's PATH.
            env = {k: v for k, v in os.environ.items() if not k.startswith("SSL_CERT_")}
            env["PATH"] = container.PVE_PATH
            os.execvpe(argv[0], argv, env)
        elif args.command == "node-exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise LabError("node-exec needs a command after --")
            ncfg = lab.config["nodes"].get(args.node)
            if ncfg is None:
                raise LabError("no node %s in lab %s" % (args.node, lab.rid))
            env = dict(os.environ, PATH=container.PVE_PATH)
            argv = container.node_argv(ncfg, cmd)
            os.execvpe(argv[0], argv, env)
        elif args.command == "run":
            extra = extra[1:] if extra[:1] == ["--"] else extra
            result = scenarios.run(lab, args.scenario, args.node, args.vmid, args.gpus, args.mib, extra,
                                   args.cuda_visible_devices)
            print(json.dumps(result, sort_keys=True))
        elif args.command == "gpus":
            lab.config
            print(json.dumps(scenarios.gpus(lab, args.node), sort_keys=True))
        elif args.command == "fault":
            if [args.fault, args.init, args.health, args.persistence].count(None) != 3:
                raise LabError("fault takes --gpu MINOR --fault lost|hang|hang_memory|hang_procs|no_v2|none, "
                               "--gpu MINOR --health CONDITION|none, --gpu MINOR --persistence on|off, "
                               "or --init not_loaded|hang|none")
            if args.init is None and args.gpu is None:
                raise LabError("--fault, --health and --persistence need --gpu MINOR")
            request = {"op": "fault", "node": args.node}
            if args.fault is not None:
                request.update(minor=args.gpu, fault=args.fault)
            elif args.health is not None:
                request.update(minor=args.gpu, health=args.health)
            elif args.persistence is not None:
                request.update(minor=args.gpu, persistence=args.persistence)
            else:
                request["init"] = args.init
            print(json.dumps(scenarios.driver_request(lab, request)))
        elif args.command == "leak":
            print(json.dumps(scenarios.driver_request(
                lab, {"op": "leak", "node": args.node, "minor": args.gpu, "mib": args.mib})))
        elif args.command == "migrate":
            print(json.dumps(lab.migrate(args.vmid, args.to), sort_keys=True))
        elif args.command == "lock":
            print(json.dumps(lab.lock(args.vmid, None if args.clear else args.lock), sort_keys=True))
        elif args.command == "ha":
            print(json.dumps(lab.ha(args.vmid, args.state, args.remove), sort_keys=True))
        elif args.command == "restart":
            ct = lab.restart(args.node, args.vmid)
            print(json.dumps({"vmid": args.vmid, "node": args.node, "init_host_pid": ct["init_host_pid"]}))
    except LabError as exc:
        sys.stderr.write("labctl: %s\n" % exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
