"""The node stand-ins (pct, lxc-info, lxc-attach) on a node folder with stopped containers.

Real subprocesses of the real scripts; no namespaces needed because nothing runs.
"""

import json
import os
import subprocess
import sys

import pytest

from _labpath import LAB_DIR

NODE_TOOLS = os.path.join(LAB_DIR, "node")


@pytest.fixture
def node_dir(tmp_path):
    d = tmp_path / "nodes" / "pve1"
    (d / "lxc").mkdir(parents=True)
    (d / "containers").mkdir()
    (d / "node.json").write_text(json.dumps({
        "node": "pve1", "python": sys.executable, "lab_dir": LAB_DIR, "pct_delay": 0.0,
        "freezer_root": None}))
    for vmid in ("101", "102"):
        (d / "lxc" / ("%s.conf" % vmid)).write_text("hostname: ct%s\ndev0: /dev/nvidia0\n" % vmid)
        (d / "containers" / ("%s.json" % vmid)).write_text(json.dumps({
            "vmid": vmid, "node": "pve1", "running": False, "init_host_pid": None,
            "cgroup_path": str(tmp_path / "cg" / vmid), "minors": [0]}))
    return str(d)


def tool(name, node_dir, *args, env=None):
    full_env = dict(os.environ, LAB_PCT_DELAY="0")
    full_env.update(env or {})
    return subprocess.run([sys.executable, os.path.join(NODE_TOOLS, name), "--node-dir", node_dir] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, env=full_env,
                          timeout=30, check=False)


PCT_PM = "/usr/share/perl5/PVE/CLI/pct.pm"


@pytest.mark.parametrize("command", [["exec", "305", "--", "true"], ["enter", "305"], ["status", "305"],
                                     ["config", "305"]])
def test_vmid_on_another_node(node_dir, command):
    """load_config dies with errno ENOENT (pmxcfs's answer): Perl's die exits 2."""
    res = tool("pct", node_dir, *command)
    assert (res.returncode, res.stderr.strip()) == (2, "Configuration file 'nodes/pve1/lxc/305.conf' does not exist")


@pytest.mark.parametrize("command, message", [
    (["exec", "101", "--", "true"], "container '101' not running!"),
    (["enter", "101"], "container '101' not running!"),
    (["push", "101", "/etc/hostname", "/tmp/x"], "can only push files to a running CT"),
    (["pull", "101", "/a", "/tmp/b"], "can only pull files from a running VM at %s line 664." % PCT_PM),
    (["push", "305", "/etc/hostname", "/tmp/x"], "can only push files to a running CT"),  # check_running first
    (["stop", "101"], "CT 101 not running"),
    (["stop", "305"], "CT 305 not running"),
    (["shutdown", "101"], "CT 101 not running"),
    (["reboot", "101"], "VM 101 not running"),
])
def test_stopped_container(node_dir, command, message):
    """check_running's open of /proc/net/unix leaves errno ENOTTY: Perl's die exits 25."""
    res = tool("pct", node_dir, *command)
    assert (res.returncode, res.stderr.strip()) == (25, message)


def test_start_of_a_vmid_not_here_fails_in_its_task(node_dir):
    """vm_start loads the config inside its task: the task's error, and upid_exit's exit(-1)."""
    res = tool("pct", node_dir, "start", "305")
    assert (res.returncode, res.stderr.strip()) == (255, "Configuration file 'nodes/pve1/lxc/305.conf' does not exist")


@pytest.mark.parametrize("command", [["start", "101"], ["start", "101", "--skiplock", "0"]])
def test_locked_container_does_not_start(node_dir, command):
    with open(os.path.join(node_dir, "lxc", "101.conf"), "a") as f:
        f.write("lock: backup\n[snap1]\nlock: snapshot\n")
    res = tool("pct", node_dir, *command)
    assert (res.returncode, res.stderr.strip()) == (255, "CT is locked (backup)")
    listing = tool("pct", node_dir, "list").stdout.splitlines()
    assert listing[1].split() == ["101", "stopped", "backup", "ct101"]


def test_options_pct_does_not_have(node_dir):
    res = tool("pct", node_dir, "shutdown", "101", "--skiplock")
    assert res.returncode == 255
    assert res.stderr.splitlines()[:2] == ["400 Parameter verification failed.",
                                           "skiplock: property is not defined in schema and the schema does not "
                                           "allow additional properties"]


def test_status_list_config(node_dir):
    assert tool("pct", node_dir, "status", "102").stdout == "status: stopped\n"
    listing = tool("pct", node_dir, "list").stdout.splitlines()
    assert listing[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert [ln.split() for ln in listing[1:]] == [["101", "stopped", "ct101"], ["102", "stopped", "ct102"]]
    assert tool("pct", node_dir, "config", "101").stdout == "dev0: /dev/nvidia0\nhostname: ct101\n"


@pytest.mark.parametrize("vmid, error", [("abc", "type check ('integer') failed - got 'abc'"),
                                         ("99", "value must have a minimum value of 100"),
                                         ("1000000000", "value must have a maximum value of 999999999")])
def test_unknown_command_and_bad_vmid(node_dir, vmid, error):
    """pve-vmid (pve-common JSONSchema): a parameter exception, printed with the command's usage."""
    assert tool("pct", node_dir, "frobnicate", "101").returncode == 255
    res = tool("pct", node_dir, "exec", vmid, "--", "true")
    assert res.returncode == 255
    assert res.stderr.splitlines() == ["400 Parameter verification failed.", "vmid: " + error,
                                       "pct exec <vmid> [<extra-args>] [OPTIONS]"]


def test_pct_pays_its_start_up_delay(node_dir):
    import time
    start = time.monotonic()
    tool("pct", node_dir, "status", "101", env={"LAB_PCT_DELAY": "0.4"})
    assert time.monotonic() - start >= 0.4


def test_pct_outside_a_lab_node(tmp_path):
    res = tool("pct", str(tmp_path), "list")
    assert res.returncode == 255 and "lab node not configured" in res.stderr


def _pct_module():
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("lab_pct", os.path.join(NODE_TOOLS, "pct"))
    spec = importlib.util.spec_from_loader("lab_pct", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_pct_decodes_arguments_by_the_node_locale():
    """pve-common decodes pct's arguments with decode('locale') and exec passes them on as UTF-8."""
    pct = _pct_module()
    assert pct.perl_argv(["caf\u00e9", "plain"], "utf-8") == [b"caf\xc3\xa9", b"plain"]
    assert pct.perl_argv(["caf\u00e9"], "ascii") == [b"caf\xef\xbf\xbd\xef\xbf\xbd"]  # C locale: U+FFFD per byte
    assert pct.perl_argv([os.fsdecode(b"caf\xe9")], "iso8859-1") == [b"caf\xc3\xa9"]


def test_pct_reads_the_locale_of_its_environment():
    code = ("import importlib.machinery as m, importlib.util as u; l = m.SourceFileLoader('p', %r); "
            "mod = u.module_from_spec(u.spec_from_loader('p', l)); l.exec_module(mod); print(mod.locale_codec())"
            % os.path.join(NODE_TOOLS, "pct"))
    for lang, codec in (("C", "ascii"), ("C.UTF-8", "utf-8")):
        env = dict(os.environ, LC_ALL=lang, PYTHONCOERCECLOCALE="0", PYTHONPATH=LAB_DIR)
        out = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, universal_newlines=True,
                             check=True).stdout.strip()
        assert out == codec, (lang, out)
