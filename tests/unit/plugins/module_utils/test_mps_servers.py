"""Issue 43, M2 and H1: an MPS server is never signalled blind, and the MPS asks keep within the release's deadline.

Unit-fake worlds (ProcTree, FakeNvml): an MPS server (66 MiB on GPUs 0 and 1, GPU_FACTS row 26) with a client on
each GPU. A stand-in control tool in a fixed system folder (_mps.BIN_DIRS) answers as a control daemon would, or
never answers. Nothing real is signalled: the release's send_guarded is a stand-in that ends a fake process.
"""
import json
import os
import shutil
import sys
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _ladder as ladder
from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _rungs as rungs
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from release_opts import release
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml

from conftest import ctx, vis
from fake_nvml import MIB, FakeNvml, NVMLError

SERVICE = "0::/system.slice/nvidia-mps.service\n"
TOOL = r'''#!%s
import json, os, sys
command = sys.stdin.readline().strip()
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
with open(os.path.join(pipe, "commands"), "a") as log:
    log.write(command + "\n")
with open(os.path.join(pipe, "answers.json")) as f:
    answers = json.load(f)
answer = answers.get(command, "0" if command.startswith("terminate_client ") else None)
if answer is None:
    sys.stdout.write("no such server\n")
    sys.exit(1)
sys.stdout.write(answer + "\n")
'''
SILENT = "#!/bin/sh\nexec sleep 1000\n"


class NoMpsList(FakeNvml):
    """An NVML whose MPS client list is Not Supported (or an older driver's): no client is known from NVML."""

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        raise NVMLError(3)


class MpsList(FakeNvml):
    """An NVML with the MPS client list (gpu["mps"]: [(pid, MiB)])."""

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        return [type("P", (), {"pid": pid, "usedGpuMemory": mib * MIB})() for pid, mib in self.gpus[handle].get("mps", [])]


def own_namespaces(proc, *pids):
    """pids (and the reader, "self") in this host's pid and mount namespaces."""
    for pid in ("self",) + pids:
        folder = os.path.join(proc.root, str(pid), "ns")
        os.makedirs(folder, exist_ok=True)
        for kind in ("pid", "mnt"):
            target = os.path.join(proc.root, "host-ns-" + kind)
            open(target, "a").close()
            os.symlink(target, os.path.join(folder, kind))


def control_daemon(proc, tmp_path, monkeypatch, text, answers=None, pid=299, cgroup=SERVICE, nspid=None):
    """A control daemon process (comm nvidia-cuda-mps, its tool in a fixed system folder) and its pipe folder."""
    folder = tmp_path / "usr-bin"
    folder.mkdir(exist_ok=True)
    tool = folder / "nvidia-cuda-mps-control"
    tool.write_text(text)
    tool.chmod(0o755)
    monkeypatch.setattr(mps, "BIN_DIRS", (str(folder),))
    pipe = tmp_path / "pipe"
    pipe.mkdir(exist_ok=True)
    (pipe / "answers.json").write_text(json.dumps(answers or {}))
    proc.add(pid, comm="nvidia-cuda-mps", argv=[str(tool), "-d"], cgroup=cgroup, nspid=nspid)
    with open(os.path.join(proc.root, str(pid), "environ"), "wb") as f:
        f.write(b"CUDA_MPS_PIPE_DIRECTORY=" + str(pipe).encode() + b"\0")
    return pipe


def mps_world(proc, cgroup=SERVICE, nspids=None):
    """Server 300 with its 66 MiB on GPUs 0 and 1, client 301 on GPU 0 (4 GiB), client 302 on GPU 1 (6 GiB)."""
    nspids = nspids or {}
    proc.add(300, comm="nvidia-cuda-mps", argv=["nvidia-cuda-mps-server"], maps=ctx(0) + ctx(1),
             fds=["/dev/nvidia0", "/dev/nvidia1"], cgroup=cgroup, nspid=nspids.get(300))
    proc.add(301, maps=ctx(0) + vis(1), fds=["/dev/nvidia0"], cgroup=cgroup, nspid=nspids.get(301))
    proc.add(302, maps=vis(0) + ctx(1), fds=["/dev/nvidia1"], cgroup=cgroup, nspid=nspids.get(302))
    return [{"minor": 0, "used_mib": 66 + 4096, "procs": [(300, 66), (301, 4096)]},
            {"minor": 1, "used_mib": 66 + 6144, "procs": [(300, 66), (302, 6144)]}]


def engine_for(proc, fake, view="host"):
    engine = Engine(Nvml(2.0, lib=fake), proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = view, False
    engine.start()
    return engine


def fake_signals(proc, fake, sent):
    """send_guarded's stand-in: records (pid, signal) and ends the fake process (its /proc entry and its NVML
    memory go); nothing real is signalled."""
    def send(record, sig, proc_root="/proc", use_pidfd=True, recheck=None):
        pid = record["pid"]
        sent.append((pid, sig))
        shutil.rmtree(os.path.join(proc.root, str(pid)), ignore_errors=True)
        for gpu in fake.gpus:
            mib = sum(m for p, m in gpu.get("procs", []) if p == pid)
            gpu["procs"] = [(p, m) for p, m in gpu.get("procs", []) if p != pid]
            gpu["mps"] = [(p, m) for p, m in gpu.get("mps", []) if p != pid]
            gpu["used_mib"] -= mib
        return "sent"
    return send


OPTS = dict(term_timeout=0.3, kill_timeout=0.3, verify_timeout=0.3)


# ---- M2: no NVML MPS list; the clients come from the control daemon

def test_m2_the_server_of_a_live_client_on_an_untargeted_gpu_is_never_signalled(proc, tmp_path, monkeypatch):
    """The issue's M2: NVML's MPS list is Not Supported; the server serves GPUs 0 and 1. Releasing GPU 0 took the
    server with GPU 0's client (its 66 MiB on GPU 1 is under the tolerance) while GPU 1's client lived. Its clients
    now come from the daemon's get_client_list: GPU 1's client stays, so the server is left alone, naming it."""
    control_daemon(proc, tmp_path, monkeypatch, TOOL % sys.executable,
                   {"get_server_list": "300", "get_client_list 300": "301\n302"})
    own_namespaces(proc, 299)
    engine = engine_for(proc, NoMpsList(mps_world(proc)))
    report = engine.snapshot([0])
    assert dict((r["pid"], r["mps_role"]) for r in report.holders) == {300: "server", 301: "client", 302: "client"}
    decision = decide(report, [0], [0, 1])
    assert [r["pid"] for r in decision.to_signal] == [301] and decision.refusals == []
    reasons = [s["reason"] for s in decision.skipped if s["pid"] == 300]
    assert len(reasons) == 1 and "pid 302 (GPU 1) stays" in reasons[0] and "collateral" in reasons[0], reasons
    assert "MPS server pid 300 serves pid 301, pid 302, as control daemon pid 299 lists them" in report.diagnosis
    both = decide(report, [0, 1], [0, 1])
    assert [r["pid"] for r in both.to_signal] == [300, 301, 302]


def test_m2_a_release_of_gpu_0_terminates_its_client_and_leaves_the_server(proc, tmp_path, monkeypatch):
    """The whole release of M2: terminate_client 300 301 through the daemon, then SIGTERM to 301 alone; the server
    is never signalled and is named in not_signalled; GPU 0 keeps the server's 66 MiB, so the task fails honestly."""
    pipe = control_daemon(proc, tmp_path, monkeypatch, TOOL % sys.executable,
                          {"get_server_list": "300", "get_client_list 300": "301\n302"})
    own_namespaces(proc, 299)
    fake = NoMpsList(mps_world(proc))
    sent = []
    monkeypatch.setattr(ladder, "send_guarded", fake_signals(proc, fake, sent))
    failed, msg, result = release(engine_for(proc, fake), [0], OPTS, lock_dir=str(tmp_path / "locks"),
                                  deadline=time.monotonic() + 30)
    assert failed and msg.startswith("GPU 0 not free after the ladder"), msg
    assert [pid for pid, dummy in sent] == [301]
    steps = [(a["pid"], a["signal"], a["outcome"]) for a in result["actions"]]
    assert steps[:2] == [(301, "terminate_client", "done: server 300, control daemon pid 299: 0"), (301, "SIGTERM", "sent")]
    assert [s["pid"] for s in result["not_signalled"]] == [300] and "pid 302 (GPU 1) stays" in result["not_signalled"][0][
        "reason"]
    commands = (pipe / "commands").read_text().splitlines()
    assert "terminate_client 300 301" in commands and "terminate_client 300 302" not in commands
    assert "quit" not in commands


@pytest.mark.parametrize("daemon", ["its client list fails", "no control daemon"])
def test_m2_a_server_whose_clients_cannot_be_known_is_never_signalled(proc, tmp_path, monkeypatch, daemon):
    """No NVML MPS list, and the daemon cannot tell the server's clients (get_client_list fails), or there is no
    daemon: the server is left alone even with every GPU targeted, and the diagnosis says why."""
    if daemon == "its client list fails":
        control_daemon(proc, tmp_path, monkeypatch, TOOL % sys.executable, {"get_server_list": "300"})
        own_namespaces(proc, 299)
    engine = engine_for(proc, NoMpsList(mps_world(proc)))
    report = engine.snapshot([0, 1])
    decision = decide(report, [0, 1], [0, 1])
    assert [r["pid"] for r in decision.to_signal] == [301, 302]
    reasons = [s["reason"] for s in decision.skipped if s["pid"] == 300]
    why = ("control daemon pid 299: get_client_list 300: no such server" if daemon == "its client list fails"
           else "no MPS control daemon lists it (0 found)")
    assert reasons == ["the MPS server, never signalled while its clients cannot be known: %s; NVML lists no MPS "
                       "client on GPU 0, 1" % why], reasons
    lines = [line for line in report.diagnosis if line.startswith("MPS server pid 300: its clients cannot be known")]
    assert len(lines) == 1 and why in lines[0] and "it is never signalled" in lines[0], report.diagnosis


def test_m2_a_daemon_in_a_container_lists_the_containers_pids_mapped_from_the_node(proc, tmp_path, monkeypatch):
    """From the node: the daemon of container 101 lists the server and its clients by the container's pids (10, 11,
    12). They are mapped to the node's (300, 301, 302) by container and NSpid, so the server is kept for GPU 1's
    client when GPU 0 is released, and goes with both clients when both GPUs are."""
    asked = []

    def run_bounded(argv, timeout, env=None):
        asked.append((argv[:3], argv[-1]))
        return 0, {"get_server_list": "10", "get_client_list 10": "11\n12"}.get(argv[-1], "0")
    monkeypatch.setattr(mps.helperproc, "run_bounded", run_bounded)
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: None)
    ct = "0::/lxc/101/ns/system.slice\n"
    proc.add(299, comm="nvidia-cuda-mps", argv=["nvidia-cuda-mps-control", "-d"], cgroup=ct, nspid=[299, 9])
    engine = engine_for(proc, NoMpsList(mps_world(proc, ct, {300: [300, 10], 301: [301, 11], 302: [302, 12]})), "node")
    report = engine.snapshot([0])
    entry = report.mps_servers[300]
    assert entry["server_as"] == 10 and entry["clients_as"] == {301: 11, 302: 12} and entry["control"]["vmid"] == "101"
    assert asked[0] == (["lxc-attach", "-n", "101"], "get_server_list")
    one = decide(report, [0], [0, 1])
    assert [r["pid"] for r in one.to_signal] == [301]
    assert [s["pid"] for s in one.skipped] == [300] and "pid 302 (GPU 1) stays" in one.skipped[0]["reason"]
    assert [r["pid"] for r in decide(report, [0, 1], [0, 1]).to_signal] == [300, 301, 302]


# ---- the asks, bounded by the time left

def test_an_ask_is_capped_by_the_deadline_and_not_made_with_no_time_left(proc, tmp_path, monkeypatch):
    """Each ask gets ASK_TIMEOUT_S, never past the deadline; with no time left the tool is not even run."""
    pipe = control_daemon(proc, tmp_path, monkeypatch, SILENT)
    control = {"pid": 299, "binary": node.system_tool(mps.CONTROL, mps.BIN_DIRS), "env": {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, "vmid": None}
    started = time.monotonic()
    ok, text = mps.ask(control, "get_server_list", deadline=started + 0.5)
    took = time.monotonic() - started
    assert not ok and text == "control daemon pid 299 did not answer 'get_server_list' within 0.5s", text
    assert took < mps.ASK_TIMEOUT_S / 2, took
    runs = []
    monkeypatch.setattr(mps.helperproc, "run_bounded", lambda *a, **k: runs.append(a) or (0, "0"))
    ok, text = rungs.terminate_client(control, 300, 301, deadline=time.monotonic() - 0.1)
    assert not ok and runs == []
    assert text == ("control daemon pid 299 was not asked 'terminate_client 300 301': no time was left before the "
                    "overall timeout")


def test_h1_a_control_daemon_that_never_answers_ends_the_release_within_its_timeout(proc, tmp_path, monkeypatch):
    """H1: the daemon reads nothing and never answers. Its asks were 10 s each, whatever the timeout. The release
    ends within its timeout (3 s here), nothing signalled, and its message names the daemon."""
    control_daemon(proc, tmp_path, monkeypatch, SILENT)
    own_namespaces(proc, 299)
    proc.add(300, comm="nvidia-cuda-mps", argv=["nvidia-cuda-mps-server"], maps=ctx(0), fds=["/dev/nvidia0"],
             cgroup=SERVICE)
    proc.add(301, maps=ctx(0), fds=["/dev/nvidia0"], cgroup=SERVICE)
    fake = MpsList([{"minor": 0, "used_mib": 66 + 4096, "procs": [(300, 66), (301, 4096)], "mps": [(301, 4096)]}])
    sent = []
    monkeypatch.setattr(ladder, "send_guarded", fake_signals(proc, fake, sent))
    timeout = 3.0
    started = time.monotonic()
    failed, msg, result = release(engine_for(proc, fake), [0], dict(OPTS, timeout=timeout),
                                  lock_dir=str(tmp_path / "locks"), deadline=started + timeout)
    took = time.monotonic() - started
    assert took < timeout + 1.0 and result["elapsed_s"] < timeout + 1.0, (took, result["elapsed_s"])
    assert failed and sent == []
    assert "control daemon pid 299 did not answer 'get_server_list'" in msg, msg
    assert msg.startswith("the overall timeout was reached while the GPUs were read"), msg
    assert [line for line in result["diagnosis"] if "MPS server pid 300" in line and "control daemon pid 299" in line]
