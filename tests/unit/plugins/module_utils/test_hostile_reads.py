"""Issue 41, attack 6: every /proc file is read up to a byte cap, the cut is said, and nothing is decided on it.

A container can point a process's cmdline (or environ) at a 64 GiB mapping of its own (PR_SET_MM_MAP): each read cost
the node-side run seconds and a gigabyte. Here the fake /proc files are sparse files of that kind of size.
"""
import os

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._decide import decide
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import Protect

from conftest import CTL, UVM, ctx, maps_lines
from fake_nvml import FakeNvml

MIB = 1 << 20


def huge(path, head, size):
    """head, then zeros up to size bytes (sparse: never written, as never-touched memory reads)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def node_engine(proc, gpus, monkeypatch):
    monkeypatch.setattr(node, "read_pve_confs", lambda *a, **k: {})
    engine = Engine(Nvml(2.0, lib=FakeNvml(gpus)), proc_root=proc.root, self_pid=999999)
    engine.view, engine.in_container = "node", False
    engine.start()
    return engine


def test_a_cmdline_pointed_at_gigabytes_is_read_up_to_its_cap_and_said_truncated(proc, monkeypatch):
    proc.add(60, comm="python3", maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0"])
    huge(os.path.join(proc.root, "60", "cmdline"), b"python3\0train.py\0", 256 * MIB)
    raw = procscan.read_bytes(os.path.join(proc.root, "60", "cmdline"))
    assert len(raw) <= 1 * MIB, "read %d bytes" % len(raw)
    assert procscan.is_truncated(raw)
    engine = node_engine(proc, [{"minor": 0, "used_mib": 600}], monkeypatch)
    holder = [h for h in engine.snapshot([0]).holders if h["pid"] == 60][0]
    assert holder["truncated"] == ["cmdline"] and holder["_argv"][:2] == ["python3", "train.py"], holder


def test_environ_and_cgroup_over_their_caps_are_cut_and_a_cut_cgroup_is_unknown(proc):
    proc.add(61, comm="python3", cgroup="0::/lxc/101/ns\n")
    huge(os.path.join(proc.root, "61", "environ"), b"A=1\0", 64 * MIB)
    huge(os.path.join(proc.root, "61", "cgroup"), b"0::/lxc/101/ns/" + b"x" * (2 * MIB), 2 * MIB + 64)
    assert procscan.read_environ(61, proc.root) == {"A": "1"}
    assert procscan.read_cgroup(61, proc.root) is None and node.container_of_pid(61, proc.root) is None


def test_maps_over_the_cap_may_hold_every_gpu_and_is_never_signalled(proc, monkeypatch):
    """Its device lines come after the cap: the process is unreadable (truncated), every GPU lists it as one it may
    hold (never taken for free on its account), the plan never signals it, and the diagnosis says why."""
    filler = "7f0000000000-7f0000001000 r--p 00000000 08:01 1312  /usr/lib/%s\n" % ("x" * 200)
    text = filler * (17 * MIB // len(filler) + 1) + maps_lines(ctx(0) + [CTL, UVM])
    proc.add(62, comm="python3", raw_maps=text, fds=["/dev/nvidia0"])
    scan = procscan.scan(proc.root)
    assert 62 not in scan.entries and [(b["pid"], b["reason"]) for b in scan.blocked] == [(62, "truncated")]
    engine = node_engine(proc, [{"minor": 0, "used_mib": 600}, {"minor": 1, "used_mib": 0}], monkeypatch)
    report = engine.snapshot([0, 1])
    assert [g["blocked"] for g in report.gpus] == [[62], [62]]
    assert [u["may_hold"] for u in report.unreadable] == [True]
    assert [line for line in report.diagnosis if line.startswith("pid 62 (python3) is unreadable: truncated")]
    assert [r["pid"] for r in decide(report, [0, 1], [0, 1]).to_signal] == []


def test_protect_is_never_judged_on_a_cut_command_line(proc, monkeypatch):
    """A protect pattern may match what was cut: a holder whose cmdline was truncated is never signalled under one."""
    proc.add(63, comm="python3", maps=ctx(0) + [CTL, UVM], fds=["/dev/nvidia0"])
    huge(os.path.join(proc.root, "63", "cmdline"), b"python3\0serve.py\0", 8 * MIB)
    engine = node_engine(proc, [{"minor": 0, "used_mib": 600}], monkeypatch)
    report = engine.snapshot([0])
    decision = decide(report, [0], [0], protect=Protect([".*--keep-me.*"]))
    assert [r["pid"] for r in decision.to_signal] == []
    assert [s["reason"] for s in decision.skipped if s["pid"] == 63][0].startswith("its command line has more than")
