"""Issue 41: a hostile container gets nothing from a node-side release: no code of it runs on the node.

One lab: ct101 sees GPUs 0 and 1 and runs the lab's MPS workload (a control daemon, its server, a client per GPU);
ct102 sees GPU 1. The truth is the host's /proc and the marker files, never only the module's word.
"""
import os
import shutil
import tempfile

from _enginelab import REPO, EngineLab, host_alive
from _labfixture import clean_engine_lab, module_lab

lab = module_lab(lambda: EngineLab("hostile41", ["--nodes", "1", "--containers", "2", "--gpus", "2",
                                                 "--layout", "101=0,1", "--layout", "102=1"]))
clean = clean_engine_lab()
FAST = {"term_timeout": 1, "kill_timeout": 2, "advanced": {"verify_timeout": 3}}

# A control tool that only leaves a trace of who ran it, where: the node's root must never run it.
MARKER_TOOL = "#!/bin/sh\necho \"ran uid $(id -u) pidns $(readlink /proc/self/ns/pid)\" >> %s\necho 0\n"

# Inside the container: a copy of sleep at a path longer than PATH_MAX (so /proc/PID/exe cannot be read: ENAMETOOLONG),
# named nvidia-cuda-mps-control (comm nvidia-cuda-mps), started with argv[0] = the marker tool, in its own session.
HOSTILE = r"""
import os, shutil, sys
argv0 = sys.argv[1]
os.chdir("/tmp")
for dummy in range(18):
    os.mkdir("d" * 250)
    os.chdir("d" * 250)
shutil.copy("/bin/sleep", "nvidia-cuda-mps-control")
os.chmod("nvidia-cuda-mps-control", 0o755)
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/hostile-pipe"}
    os.execve("./nvidia-cuda-mps-control", [argv0, "3600"], env)
print(pid)
"""


def _host_pid_of(vmid_pid_text, clean, vmid):
    """The host pid of a container pid (NSpid's last entry is the container's)."""
    want = int(vmid_pid_text.strip().splitlines()[-1])
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as f:
                nspid = [line.split()[1:] for line in f if line.startswith("NSpid:")][0]
            with open("/proc/%s/comm" % name) as f:
                comm = f.read().strip()
        except (OSError, IndexError):
            continue
        if len(nspid) == 3 and int(nspid[-1]) == want and comm == "nvidia-cuda-mps":
            return int(name)
    raise AssertionError("container %s pid %d not found on the host" % (vmid, want))


def test_an_mps_control_lookalike_with_an_unreadable_exe_is_never_run_by_the_node(clean):
    """Attack 2: a process in ct101 named like an MPS control daemon, whose /proc/PID/exe cannot be read (a path
    longer than PATH_MAX) and whose argv[0] is a script at a path the node also has. A node-side release of an MPS
    client (GPU 1, containers: [101]) asks the control daemons: the lookalike is a process of container 101 (its
    namespaces are not the node's), asked, if at all, inside 101 by the tool's name; the script never runs, on
    the node or anywhere. The real client still gets terminate_client, then SIGTERM."""
    work = tempfile.mkdtemp(prefix="hostile-", dir=os.path.join(REPO, ".cache"))
    try:
        os.chmod(work, 0o755)
        tool, marker = os.path.join(work, "nvidia-cuda-mps-control"), os.path.join(work, "marker")
        with open(tool, "w") as f:
            f.write(MARKER_TOOL % marker)
        os.chmod(tool, 0o755)
        run = clean.run("mps", 101, [0, 1], mib=700)
        started = clean.exec(101, "python3", "-c", HOSTILE, tool)
        assert started.returncode == 0, started.stdout
        fake = _host_pid_of(started.stdout, clean, 101)
        clean.started.append({"host_pids": [fake], "_node": "pve1", "_vmid": 101})
        try:
            os.readlink("/proc/%d/exe" % fake)
            raise AssertionError("the lookalike's exe was readable")
        except OSError as exc:
            assert exc.errno == 36, exc    # ENAMETOOLONG
        play = clean.direct("pve1", "gpu_release", dict(FAST, gpus=["1"], containers=[101]))
        ran = open(marker).read() if os.path.exists(marker) else ""
        assert ran == "", "the container's script ran: %s" % ran
        assert not play.failed, play
        steps = [(a["signal"], a["outcome"][:4]) for a in play["actions"]][:2]
        assert steps == [("terminate_client", "done"), ("SIGTERM", "sent")], play["actions"]
        assert clean.used(1) == 0 and host_alive(run["roles"]["control"]) and host_alive(fake)
    finally:
        shutil.rmtree(work, ignore_errors=True)
