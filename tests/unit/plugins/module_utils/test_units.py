"""Issue 20: what would respawn a container's holder, found from the node, and its stop inside the container."""
import json
import os
import stat
import threading

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _stopsets as stopsets
from ansible_collections.gpuops.fleet.plugins.module_utils import _units as units
from release_opts import release_opts


def holder(pid, cgroup, container="101"):
    return {"pid": pid, "name": "python3", "cgroup": procscan.parse_cgroup(cgroup), "container": container}


def environ(proc, pid, **env):
    with open(os.path.join(proc.root, str(pid), "environ"), "wb") as f:
        f.write(b"".join(("%s=%s" % kv).encode() + b"\0" for kv in sorted(env.items())))


def test_a_systemd_unit_is_named_by_the_holders_cgroup_inside_its_container(proc):
    proc.add(500, cgroup="0::/lxc/101/ns/system.slice/vllm-server.service\n")
    found = stopsets.find(holder(500, "0::/lxc/101/ns/system.slice/vllm-server.service\n"), proc.root)
    assert found["members"] == [{"pid": 500, "name": "python3", "uid": 0,
                                 "why": "in the unit's cgroup /system.slice/vllm-server.service"}]
    assert dict((k, found[k]) for k in ("vmid", "kind", "name", "argv", "evidence")) == {
        "vmid": 101, "kind": "systemd", "name": "vllm-server.service", "argv": ["systemctl", "stop", "vllm-server.service"],
        "evidence": "its cgroup in the container is /system.slice/vllm-server.service"}


def test_a_supervisord_program_is_named_by_its_environment_under_supervisord(proc):
    proc.add(1, comm="init", ppid=0)
    proc.add(40, comm="supervisord", ppid=1, argv=["/usr/bin/python3", "/usr/bin/supervisord", "-c", "/etc/sup.conf"])
    proc.add(41, comm="sh", ppid=40)
    proc.add(42, comm="python3", ppid=41)                       # a worker of the program's shell
    environ(proc, 41, SUPERVISOR_PROCESS_NAME="worker_1", SUPERVISOR_GROUP_NAME="workers", SECRET="x")
    found = stopsets.find(holder(42, "0::/lxc/101/ns/init.scope\n"), proc.root)
    assert (found["kind"], found["name"], found["argv"]) == (
        "supervisord", "workers:worker_1", ["supervisorctl", "-c", "/etc/sup.conf", "stop", "workers:worker_1"])
    assert "pid 41 runs under supervisord (pid 40 on the node)" in found["evidence"] and "SECRET" not in str(found)


def test_nothing_is_found_for_the_node_for_a_plain_parent_or_for_odd_names(proc):
    proc.add(1, comm="init", ppid=0)
    proc.add(40, comm="bash", ppid=1)
    proc.add(42, comm="python3", ppid=40)
    assert stopsets.find(holder(42, "0::/user.slice\n", container="host"), proc.root) is None
    assert stopsets.find(holder(42, "0::/lxc/101/ns/init.scope\n"), proc.root) is None
    assert stopsets.find(holder(42, "0::/lxc/101/ns/system.slice/a;b.service\n"), proc.root) is None
    proc.add(50, comm="supervisord", ppid=1)
    proc.add(51, comm="python3", ppid=50)
    environ(proc, 51, SUPERVISOR_PROCESS_NAME="x; reboot")
    assert stopsets.find(holder(51, "0::/lxc/101/ns/init.scope\n"), proc.root) is None


def test_found_for_gives_one_stop_per_unit_with_every_pid_it_runs(proc):
    cg = "0::/lxc/102/ns/system.slice/sglang.service\n"
    for pid in (60, 61):
        proc.add(pid, cgroup=cg)
    found = stopsets.found_for([holder(60, cg, "102"), holder(61, cg, "102"), holder(70, "0::/x\n", "host")], proc.root)
    assert [(u["vmid"], u["name"], u["pids"]) for u in found] == [(102, "sglang.service", [60, 61])]


def test_the_stop_runs_inside_the_container_with_a_clean_environment_and_reports_failures(tmp_path):
    record = tmp_path / "argv.json"
    attach = tmp_path / "lxc-attach"
    attach.write_text("#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open(%r, 'w'))\n"
                      "print('worker: stopped')\nsys.exit(int('%s' in sys.argv))\n" % (str(record), "bad"))
    attach.chmod(attach.stat().st_mode | stat.S_IXUSR)
    entry = {"vmid": 101, "kind": "supervisord", "name": "w:w", "argv": ["supervisorctl", "stop", "w:w"]}
    assert units.stop(entry, 10, attach=str(attach)) == {"ok": True, "text": "worker: stopped"}
    argv = json.loads(record.read_text())
    assert argv[:3] == ["-n", "101", "--clear-env"] and argv[-4:] == ["--", "supervisorctl", "stop", "w:w"]
    failed = units.stop(dict(entry, argv=["supervisorctl", "stop", "bad"]), 10, attach=str(attach))
    assert failed == {"ok": False, "text": "exit 1: worker: stopped"}
    missing = units.stop(entry, 10, attach=str(tmp_path / "none"))
    assert not missing["ok"] and "No such file" in missing["text"]


class _Engine(object):
    proc_root = "/proc"
    view = "node"

    def gpu(self, index):
        return None


def _stops(monkeypatch, concurrency, meet=None):
    """Releaser.stop_units over 4 units in 3 containers with a stand-in stop; returns (releaser, calls, most at once)."""
    from ansible_collections.gpuops.fleet.plugins.module_utils import _release as release
    found = [{"vmid": v, "kind": "supervisord", "name": n, "argv": [], "pids": [p]}
             for v, n, p in ((101, "a:a", 1), (101, "b:b", 2), (102, "c:c", 3), (103, "d:d", 4))]
    lock, state, calls = threading.Lock(), {"now": 0, "most": 0}, []

    def stop(entry, timeout):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            calls.append(entry["name"])
        if meet is not None:
            meet.wait()
        with lock:
            state["now"] -= 1
        return {"ok": True, "text": "stopped"}

    monkeypatch.setattr(units, "stop", stop)
    releaser = release.Releaser(_Engine(), [], release_opts(stop_concurrency=concurrency))
    releaser.found_units = [dict((k, v) for k, v in u.items() if k != "argv") for u in found]
    releaser.stop_units(found)
    return releaser, calls, state["most"]


def test_stops_run_in_several_containers_at_once_within_the_bound(monkeypatch):
    # two at a time: each stop waits for a second one to be in flight, so a serial run would break the barrier
    releaser, calls, most = _stops(monkeypatch, 2, threading.Barrier(2, timeout=30))
    assert most == 2 and calls.index("a:a") < calls.index("b:b"), calls    # a container's own, one after another
    assert sorted(a["name"] for a in releaser.actions) == ["supervisord program %s" % n for n in ("a:a", "b:b", "c:c", "d:d")]
    assert all(u["outcome"] == "done: stopped" for u in releaser.found_units)
    dummy, calls, most = _stops(monkeypatch, 1)
    assert most == 1 and calls == ["a:a", "b:b", "c:c", "d:d"]


DOCKER_ID = "4f2a9c" + "0" * 52 + "abcdef"


def test_docker_inside_lxc_is_named_by_the_holders_cgroup_with_either_driver(proc):
    """The lab cannot run docker: this path is tested here only, with the cgroups docker makes inside LXC."""
    for pid, cgroup in ((500, "0::/lxc/101/ns/system.slice/docker-%s.scope\n" % DOCKER_ID),   # systemd driver
                        (502, "0::/lxc/101/ns/docker/%s\n" % DOCKER_ID)):                     # cgroupfs driver
        proc.add(pid, cgroup=cgroup)
        found = stopsets.find(holder(pid, cgroup), proc.root)
        assert (found["vmid"], found["kind"], found["name"], found["argv"]) == (
            101, "docker", DOCKER_ID[:12], ["docker", "stop", DOCKER_ID])
        assert found["evidence"].startswith("its cgroup in the container is /")
    bad = "0::/lxc/101/ns/system.slice/docker-%s.scope\n" % ("z" * 64)
    proc.add(501, cgroup=bad)
    assert stopsets.find(holder(501, bad), proc.root) is None


def test_docker_inside_lxc_is_found_from_its_shim_before_a_supervisord_inside_it(proc):
    proc.add(1, comm="init", ppid=0)
    shim = "0::/lxc/101/ns/system.slice/containerd.service\n"      # docker's shims run in containerd's unit, as root
    proc.add(30, comm="containerd-shim", ppid=1, cgroup=shim,
             argv=["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", DOCKER_ID, "-address", "/run/x"])
    proc.add(31, comm="supervisord", ppid=30, argv=["/usr/bin/python3", "/usr/bin/supervisord", "-c", "/etc/s.conf"],
             nspid=[31, 1])
    proc.add(32, comm="python3", ppid=31, nspid=[32, 2])
    environ(proc, 32, SUPERVISOR_PROCESS_NAME="server", SUPERVISOR_GROUP_NAME="server")
    found = stopsets.find(holder(32, "0::/lxc/101/ns/init.scope\n"), proc.root)
    assert (found["kind"], found["argv"]) == ("docker", ["docker", "stop", DOCKER_ID])
    assert "pid 31 runs under containerd-shim (pid 30 on the node) as docker container %s" % DOCKER_ID[:12] \
        in found["evidence"]
    proc.add(40, comm="containerd-shim", ppid=1, cgroup=shim,       # a containerd (not docker) namespace: not docker's
             argv=["/usr/bin/containerd-shim-runc-v2", "-namespace", "k8s.io", "-id", DOCKER_ID])
    proc.add(41, comm="python3", ppid=40, nspid=[41, 1])
    other = stopsets.find(holder(41, "0::/lxc/101/ns/init.scope\n"), proc.root)
    assert other["kind"] is None and "nested inside container 101" in other["problem"], other
