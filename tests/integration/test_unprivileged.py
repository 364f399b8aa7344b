"""Unprivileged LXC containers (container root is uid 100000 on the node), as Proxmox VE makes them by default.

gpu_status runs in one through ansible-playbook and gpuops.fleet.pct and reports a holder right, while the
/proc reads an unprivileged root cannot make (another process's stack, root, a frozen task's wchan) fail; the
role's dependency install works in a bare unprivileged container and changes nothing on the host.
Runs as root; its own labs, torn down.
"""
import hashlib
import json
import os

import pytest

from _enginelab import EngineLab
from _labfixture import module_lab
from _rolelab import REPO, RoleLab

pytestmark = pytest.mark.real_lxc   # an unprivileged real LXC container (idmap, LXCFS)

lab = module_lab(lambda: EngineLab("unpriv", ["--nodes", "1", "--containers", "1", "--gpus", "2",
                                              "--unprivileged", "101"]))


def holder(play, pid):
    found = [h for h in play["holders"] if h["pid"] == pid]
    assert found, "pid %s not among holders %s" % (pid, [h["pid"] for h in play["holders"]])
    return found[0]


def test_container_root_is_unprivileged(lab):
    out = lab.exec(101, "cat", "/proc/self/uid_map").stdout.split()
    assert out == ["0", "100000", "65536"]


def test_gpu_status_reports_holder_and_survives_refused_proc_reads(lab):
    plain = lab.run("plain", 101, [1], mib=768)
    stuck = lab.run("stuck", 101, [0], mib=512)
    try:
        pid = plain["container_holders"][0]
        frozen = stuck["container_holders"][0]
        # What container root may not read here: a kernel stack, /proc/1/root of init started before attach.
        refused = lab.exec(101, "sh", "-c", "cat /proc/%d/stack; echo rc=$?; ls /proc/1/root/ >/dev/null; echo rc=$?;"
                           " cat /proc/%d/wchan; echo; echo ok" % (pid, frozen))
        codes = [ln for ln in refused.stdout.splitlines() if ln.startswith("rc=")]
        assert codes[0] != "rc=0" and refused.stdout.rstrip().endswith("ok"), refused.stdout  # stack: refused
        play = lab.play("ct101", "gpu_info")
        assert play.failed is False, play
        h = holder(play, pid)
        assert h["gpus"] == [1] and "fd" in h["via"], h
        g = [g for g in play["gpus"] if g["index"] == 1][0]
        assert g["memory"]["used_mib"] == 768 and g["holders"] == [pid], g
        assert [(p["pid"], p["used_mib"]) for p in g["nvml_processes"]] == [(pid, 768)]
        s = holder(play, frozen)
        assert s["gpus"] == [0] and s["state"] == "D", s
        g0 = [g for g in play["gpus"] if g["index"] == 0][0]
        assert g0["memory"]["used_mib"] == 512
    finally:
        lab.cleanup()


# ---- the role's dependency install in a bare unprivileged container

# (/root/.ansible/tmp is the controller's own local tmp: ansible-playbook runs on this host)
HOST_PATHS = ["/usr/lib/python3/dist-packages", "/tmp/.ansible"]


def listing(paths):
    """path -> (mode, size, mtime) of everything below paths: what a write anywhere below would change."""
    seen = {}
    for top in paths:
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                full = os.path.join(root, name)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                seen[full] = (st.st_mode, st.st_size, st.st_mtime_ns)
        if os.path.exists(top):
            st = os.lstat(top)
            seen[top] = (st.st_mode, st.st_mtime_ns)
    return seen


def host_site_packages():
    import site
    import sysconfig
    return sorted(set([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]] + site.getsitepackages()))


@pytest.fixture(scope="module")
def rolelab():
    role_lab = RoleLab("unprivrole", nodes=1, containers=2, bare=(102,))
    try:
        yield role_lab
    finally:
        role_lab.down()


def test_dependency_install_in_bare_unprivileged_container_leaves_host_alone(rolelab):
    status = json.loads(rolelab.labctl("status", parse=False, check=False))
    python = status["nodes"]["pve1"]["containers"]["102"]["python"]  # the inventory's ansible_python_interpreter
    assert status["nodes"]["pve1"]["containers"]["102"]["unprivileged"] is True
    probe = rolelab.exec(102, "sh", "-c", "cat /proc/self/uid_map; %s -c 'import psutil'" % python)
    assert probe.stdout.split()[:3] == ["0", "100000", "65536"] and "psutil" in probe.stdout, probe.stdout
    paths = HOST_PATHS + host_site_packages()
    before = listing(paths)
    digest = hashlib.sha1(repr(sorted(before.items())).encode()).hexdigest()
    plain = rolelab.run("plain", 102, [0], 256)
    # the lab has no index: the wheels come from the controller's folder
    result = rolelab.playbook("release_gpus.yml", {"release_gpus_advanced": {"wheel_dir": os.path.join(REPO, ".cache", "wheels")}},
                              limit="ct102")
    assert result.rc == 0, result
    imported = rolelab.exec(102, python, "-c", "import psutil, pynvml; print(psutil.__file__)")
    assert imported.returncode == 0, imported.stdout
    assert rolelab.gpus()[("102", 0)] == 0
    assert not os.path.exists("/proc/%d" % plain["holders"][0]) or \
        open("/proc/%d/stat" % plain["holders"][0]).read().split(")")[1].split()[0] in ("Z", "X")
    after = listing(paths)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert changed == [], "host paths changed by the install: %s" % changed[:20]
    assert hashlib.sha1(repr(sorted(after.items())).encode()).hexdigest() == digest
