"""gpu_status against the lab, through ansible-playbook and gpuops.fleet.pct (issue 3).

One scene of workloads in ct101 (sees minors 0-7 as indexes 0-7) and ct102 (minors 4-7
as indexes 0-3) is read once; each test checks one scenario against what `labctl run`
built and what `labctl gpus` says. Faults and the legacy driver have their own runs.
"""
import subprocess

import pytest

from _enginelab import EngineLab, host_alive
from _labfixture import module_lab


lab = module_lab(lambda: EngineLab("engst1", ["--nodes", "1", "--containers", "3", "--gpus", "8",
                                              "--layout", "102=4,5,6,7", "--bare", "103"]))


@pytest.fixture(scope="module")
def scene(lab):
    s = {
        "plain": lab.run("plain", 101, [0], mib=1024, extra=["--fake-secret"]),
        "fork": lab.run("fork_inherit", 101, [1], mib=2048),
        "defunct": lab.run("defunct_leader", 101, [2], mib=3072),
        "zombie": lab.run("zombie", 101, [3], mib=512),
        "mmap": lab.run("mmap_only", 101, [4], mib=768),
        "tp": lab.run("tp_server", 101, [5, 6], mib=640),
        "monitor": lab.run("monitor", 101),
        "cpu": lab.run("bystander_cpu", 101),
        "ct102": lab.run("plain", 102, [3], mib=4096),     # minor 7, index 3 in ct102
    }
    # the dataloader keeps the memory of its dead parent (GPU_FACTS row 5)
    subprocess.run(["kill", "-9", str(s["fork"]["roles"]["parent"])], check=True)
    lab.labctl("gpus")  # the driver computes truth on query
    s["truth"] = lab.truth()
    s["ct101"] = lab.play("ct101", "gpu_info")
    s["ct102_status"] = lab.play("ct102", "gpu_info", {"cmdline": False})
    return s


def holder(play, pid):
    found = [h for h in play["holders"] if h["pid"] == pid]
    assert found, "pid %s not among holders %s" % (pid, [h["pid"] for h in play["holders"]])
    return found[0]


def gpu(play, index):
    return [g for g in play["gpus"] if g["index"] == index][0]


def scene_pids(scene):
    """Every live host pid the scene's workloads started (the killed fork parent and the zombie aside)."""
    dead = set([scene["fork"]["roles"]["parent"], scene["zombie"]["roles"]["zombie"]])
    return sorted(set(p for key, run in scene.items() if isinstance(run, dict) and "host_pids" in run
                      for p in run["host_pids"] + list(run["roles"].values()) if p and p not in dead))


def test_status_is_read_only_and_matches_driver_truth(lab, scene):
    play = scene["ct101"]
    assert play.failed is False and play["changed"] is False, play
    assert [p for p in scene_pids(scene) if not host_alive(p)] == []
    now = lab.truth()
    assert [(m, g["used_mib"], g["nvml_pids"]) for m, g in sorted(now.items())] == \
        [(m, g["used_mib"], g["nvml_pids"]) for m, g in sorted(scene["truth"].items())]
    assert play["in_container"] is True and play["driver_version"]
    for entry in play["gpus"]:
        truth = scene["truth"][entry["minor"]]
        assert entry["memory"]["used_mib"] == truth["used_mib"]
        assert entry["memory"]["v1_used_mib"] == truth["used_mib"] + 615
        assert entry["free"] == (truth["used_mib"] <= 64)
    assert play["all_free"] is False


def test_plain_holder_with_redacted_cmdline(scene):
    pid = scene["plain"]["container_holders"][0]
    h = holder(scene["ct101"], pid)
    assert h["via"] == ["fd", "mmap"] and h["gpus"] == [0] and not h["defunct_leader"]
    assert "--api-key ********" in h["cmdline"] and "sk-secret" not in scene["ct101"].output
    # LXC's cgroup namespace: inside, the container's cgroup is the root; lxc-attach puts tasks in /.lxc.
    assert h["nspid"] == [pid] and h["cgroup"] in ("/", "/.lxc") and h["user"] == "root"
    nvml = gpu(scene["ct101"], 0)["nvml_processes"]
    assert [(p["pid"], p["status"], p["used_mib"]) for p in nvml] == [(pid, "holder", 1024)]
    assert any(line.startswith("pid %d (" % pid) and "SIGTERM, then SIGKILL to %d frees it" % pid in line
               for line in scene["ct101"]["diagnosis"])


def test_fork_inherit_child_holds_dead_parents_memory(scene):
    parent = scene["fork"]["container_roles"]["parent"]
    child = scene["fork"]["container_roles"]["child"]
    assert not host_alive(scene["fork"]["roles"]["parent"]) and host_alive(scene["fork"]["roles"]["child"])
    h = holder(scene["ct101"], child)
    assert h["name"] == "pt_data_worker" and h["gpus"] == [1] and "fd" in h["via"] and "mmap" in h["via"]
    g = gpu(scene["ct101"], 1)
    assert g["holders"] == [child] and g["memory"]["used_mib"] == 2048
    assert [(p["pid"], p["status"]) for p in g["nvml_processes"]] == [(parent, "not_visible")]
    assert "outside this PID namespace" in g["nvml_processes"][0]["note"]
    sentence = [line for line in scene["ct101"]["diagnosis"] if line.startswith("NVML names pid %d " % parent)]
    assert h["evidence"] == ["mapping", "dead_pid"] and h["maps_gpus"] == list(range(8))
    # its process group is the workload launcher's, not the dead parent's: never called its forked child
    assert sentence == ["NVML names pid %d on GPU 1, not visible here; the memory is held by pid %d (pt_data_worker), "
                        "the only holder NVML does not name that maps a context on GPU 1; SIGKILL to %d frees it"
                        % (parent, child, child)]


def test_defunct_leader_found_where_fuser_is_blind(lab, scene):
    leader = scene["defunct"]["container_roles"]["leader"]
    h = holder(scene["ct101"], leader)
    assert h["defunct_leader"] and h["state"] == "Z" and h["via"] == ["task"] and h["gpus"] == [2]
    assert h["live_threads"] >= 1 and h["thread_states"].get("Z") == 1
    expected = ("pid %d (%s) is a defunct leader with %d live threads holding GPU 2 (3.0 GiB by NVML); SIGKILL to %d "
                "frees it; fuser does not see it" % (leader, h["name"], h["live_threads"], leader))
    assert expected in scene["ct101"]["diagnosis"]
    fuser = lab.exec(101, "fuser", "-v", "/dev/nvidia2")
    assert " %d " % leader not in fuser.stdout


def test_zombie_holds_nothing_and_names_its_parent(scene):
    zombie = scene["zombie"]["container_roles"]["zombie"]
    parent = scene["zombie"]["container_roles"]["parent"]
    play = scene["ct101"]
    assert zombie not in [h["pid"] for h in play["holders"]]
    z = [z for z in play["zombies"] if z["pid"] == zombie][0]
    assert z["ppid"] == parent and z["holds"] == []
    assert gpu(play, 3)["free"] and gpu(play, 3)["holders"] == []
    assert any(line.startswith("pid %d (" % zombie) and "zombie holding nothing; its parent %d (" % parent in line
               for line in play["diagnosis"])


def test_mmap_only_holder(scene):
    pid = scene["mmap"]["container_holders"][0]
    h = holder(scene["ct101"], pid)
    assert h["via"] == ["mmap"] and h["fd_devices"] == [] and "/dev/nvidia4" in h["mapped_devices"]
    assert any(line.startswith("pid %d (" % pid) and "has no /dev/nvidia* file open but maps" in line
               for line in scene["ct101"]["diagnosis"])


def test_tp_server_workers_pinned_parent_not_a_holder(scene):
    roles = scene["tp"]["container_roles"]
    play = scene["ct101"]
    assert gpu(play, 5)["holders"] == [roles["worker0"]] and gpu(play, 6)["holders"] == [roles["worker1"]]
    assert holder(play, roles["worker0"])["name"] == "tp_worker0"
    assert roles["parent"] not in [h["pid"] for h in play["holders"] + play["clients"]]


def test_monitor_is_a_client_and_bystander_is_nothing(scene):
    play = scene["ct101"]
    monitor = scene["monitor"]["container_roles"]["monitor"]
    bystander = scene["cpu"]["container_roles"]["bystander"]
    assert monitor not in [h["pid"] for h in play["holders"]]
    client = [c for c in play["clients"] if c["pid"] == monitor][0]
    assert client["mapped_devices"] == [] and "/dev/nvidiactl" in client["fd_devices"]
    assert monitor in gpu(play, 0)["clients"]
    assert bystander not in [p["pid"] for p in play["holders"] + play["clients"]]
    # the whole list: the module's own NVML client (it has the device files open) is never in it
    assert [c["pid"] for c in play["clients"]] == [monitor]


def test_layout_minors_4_to_7_are_indexes_0_to_3(scene):
    play = scene["ct102_status"]
    assert [(g["index"], g["minor"]) for g in play["gpus"]] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    pid = scene["ct102"]["container_holders"][0]
    assert gpu(play, 3)["holders"] == [pid] and holder(play, pid)["gpus"] == [3]
    assert holder(play, pid)["cmdline"] is None   # cmdline: false
    # ct101's mmap_only holder on minor 4 is hidden from ct102 (modern driver): memory with no visible process
    assert gpu(play, 0)["memory"]["used_mib"] == 768 and gpu(play, 0)["holders"] == []
    assert gpu(play, 0)["unattributed_mib"] == 768 and gpu(play, 0)["nvml_processes"] == []
    assert any(line.startswith("GPU 0 (minor 4): 768 MiB is used by no process visible here; look from the node")
               for line in play["diagnosis"])


def test_modern_nvml_pids_are_translated_into_the_container(scene):
    # the plain holder: NVML (modern) gives the container pid, which /proc confirms
    pid = scene["plain"]["container_holders"][0]
    assert pid != scene["plain"]["holders"][0]
    assert gpu(scene["ct101"], 0)["nvml_processes"][0]["pid"] == pid
    # ct101 does not see ct102's holder on minor 7 (index 7 there): memory but no NVML process
    g7 = gpu(scene["ct101"], 7)
    assert g7["memory"]["used_mib"] == 4096 and g7["nvml_processes"] == [] and g7["holders"] == []


def test_bad_selector_names_value_and_lists_gpus(lab, scene):
    play = lab.direct("ct102", "gpu_info", {"gpus": ["0", "GPU-no-such"]})
    assert play.failed
    msg = play["msg"]
    assert msg.startswith("GPU 'GPU-no-such' not found; GPUs here: 0 (minor 4,")
    assert "3 (minor 7," in msg and "\n" not in msg


def test_check_mode_reports_the_same_and_changes_nothing(lab, scene):
    play = lab.direct("ct102", "gpu_info", {"gpus": [3]}, check_mode=True)
    assert not play.failed and play["changed"] is False and len(play["gpus"]) == 1
    pid = scene["ct102"]["container_holders"][0]
    assert play["gpus"][0]["holders"] == [pid] and play["gpus"][0]["memory"]["used_mib"] == 4096
    assert [h["pid"] for h in play["holders"]] == [pid] and holder(play, pid)["gpus"] == [3]
    assert host_alive(scene["ct102"]["holders"][0]) and lab.used(7) == 4096


def test_missing_libraries_give_one_line(lab):
    """ct103's Python has neither psutil nor nvidia-ml-py: read-only gpu_status needs only the second (issue 18)."""
    play = lab.play("ct103", "gpu_info")
    assert play.failed
    msg = play["msg"]
    assert "\n" not in msg and "-m pip install nvidia-ml-py" in msg and "psutil" not in msg
    release = lab.play("ct103", "gpu_release", {"gpus": [0]})
    assert release.failed and "\n" not in release["msg"] and "-m pip install psutil" in release["msg"]


def test_gpu_is_lost_is_a_named_failure(lab, scene):
    lab.labctl("fault", "--node", "pve1", "--gpu", 7, "--fault", "lost")
    try:
        play = lab.play("ct101", "gpu_info", {"gpus": [6, 7]})
    finally:
        lab.labctl("fault", "--node", "pve1", "--gpu", 7, "--fault", "none")
    assert play.failed
    assert play["msg"].startswith("GPU 7") and "NVML_ERROR_GPU_IS_LOST" in play["msg"]
    assert gpu(play, 7)["free"] is False and gpu(play, 6)["error"] is None
    assert "Traceback" not in play.output


@pytest.mark.timing
def test_nvml_hang_times_out_and_names_the_gpu(lab, scene):
    lab.labctl("fault", "--node", "pve1", "--gpu", 6, "--fault", "hang")
    try:
        play = lab.play("ct101", "gpu_info", {"gpus": [5, 6], "nvml_timeout": 1})
    finally:
        lab.labctl("fault", "--node", "pve1", "--gpu", 6, "--fault", "none")
    assert play.failed and play.seconds < 60
    assert "GPU 6" in play["msg"] and "did not return within 1s (NVML hang)" in play["msg"]
    assert gpu(play, 5)["error"] is None and gpu(play, 5)["holders"] == [scene["tp"]["container_roles"]["worker0"]]


def test_driver_not_loaded(lab, scene):
    lab.labctl("fault", "--node", "pve1", "--init", "not_loaded")
    try:
        play = lab.play("ct102", "gpu_info")
    finally:
        lab.labctl("fault", "--node", "pve1", "--init", "none")
    assert play.failed and "NVML_ERROR_DRIVER_NOT_LOADED" in play["msg"] and "Traceback" not in play.output


# ---- legacy driver: NVML gives host pids everywhere

legacy_lab = module_lab(lambda: EngineLab("englg1", ["--nodes", "1", "--containers", "1", "--gpus", "2",
                                                     "--nvml-pids", "legacy"]), name="legacy_lab")


def test_legacy_nvml_host_pids_are_not_trusted(legacy_lab):
    run = legacy_lab.run("plain", 101, [1], mib=1024)
    host_pid, ct_pid = run["node_holders"][0], run["container_holders"][0]  # the node is the host
    play = legacy_lab.direct("ct101", "gpu_info")
    assert not play.failed, play
    g = gpu(play, 1)
    assert g["holders"] == [ct_pid]                       # /proc's word
    assert [p["pid"] for p in g["nvml_processes"]] == [host_pid]   # NVML's host pid
    assert g["nvml_processes"][0]["status"] in ("not_visible", "not_holder")
    assert g["nvml_processes"][0]["matches_holder"] is False


# ---- issue 21: readiness (capacity, health, device access)

def test_readiness_names_capacity_health_and_their_remedies_and_clears_with_the_condition(lab, scene):
    """ct102's GPUs are minors 4-7. Pending retired pages on minor 4 and a pending row remap on minor 5 make them not
    ready with the reset remedy; need_mib above free memory gives the numbers; once cleared, both are ready, and
    page retirement is not applicable (an H200 answers Not Supported), never a reason."""
    lab.labctl("fault", "--node", "pve1", "--gpu", 4, "--health", "retired_pages_pending")
    lab.labctl("fault", "--node", "pve1", "--gpu", 5, "--health", "row_remap_pending")
    try:
        play = lab.direct("ct102", "gpu_info", {"gpus": [0, 1, 3], "need_mib": 140000, "cmdline": False})
    finally:
        for minor in (4, 5):
            lab.labctl("fault", "--node", "pve1", "--gpu", minor, "--health", "none")
    assert play.failed is False and play["ready"] is False, play
    checks = dict((g["index"], dict((e["check"], e) for e in g["not_ready"])) for g in play["gpus"])
    assert checks[0]["retired_pages"]["call"] == "nvmlDeviceGetRetiredPagesPendingStatus"
    assert checks[0]["retired_pages"]["remedy"].startswith("reset the GPU")
    assert checks[1]["row_remap"]["remedy"].startswith("reset the GPU") and "retired_pages" not in checks[1]
    held = gpu(play, 3)
    assert sorted(checks[3]) == ["capacity", "free"], held["not_ready"]
    total = held["memory"]["total_mib"] - held["memory"]["reserved_mib"]
    assert checks[3]["capacity"]["free_mib"] == total - held["memory"]["used_mib"] and held["memory"]["used_mib"] >= 4096
    assert checks[3]["capacity"]["need_mib"] == 140000 and "140,000 MiB needed" in checks[3]["capacity"]["reason"]
    assert all(g["ready"] is False for g in play["gpus"])
    after = lab.direct("ct102", "gpu_info", {"gpus": [1], "need_mib": 1000, "cmdline": False})
    assert [e["check"] for e in gpu(after, 1)["not_ready"]] == ["free"], after["gpus"]  # ct101's tp_server holds it
    states = dict((h["check"], h["state"]) for h in gpu(after, 1)["health"])
    assert states == {"retired_pages": "not_applicable", "row_remap": "ok", "ecc_mode": "ok", "recovery_action": "ok"}


def test_readiness_rejects_a_bad_need_before_reading(lab, scene):
    play = lab.direct("ct102", "gpu_info", {"need_fraction": 1.5})
    assert play.failed and "need_fraction must be above 0 and at most 1, got 1.5" in play["msg"]
    both = lab.direct("ct102", "gpu_info", {"need_fraction": 0.5, "need_mib": 10})
    assert both.failed and "mutually exclusive" in both["msg"]


def test_a_device_file_that_does_not_open_makes_its_gpu_not_ready(lab, scene):
    """ct102's /dev/nvidia5 (its GPU 1) covered by a file of a read-only tmpfs: it no longer opens read-write as CUDA
    opens it, so GPU 1 is not ready, and GPU 2 (/dev/nvidia6) still opens. (A revoked device cgroup gives EPERM on a
    real node; the lab's device files are files, so EROFS stands in for it.)"""
    made = lab.exec(102, "sh", "-ec", "mkdir -p /run/rofs && mount -t tmpfs -o size=1m tmpfs /run/rofs && "
                    "touch /run/rofs/nvidia5 && mount -o remount,ro /run/rofs && mount --bind /run/rofs/nvidia5 /dev/nvidia5")
    assert made.returncode == 0, made.stdout
    try:
        play = lab.direct("ct102", "gpu_info", {"gpus": [1, 2], "cmdline": False})
    finally:
        undone = lab.exec(102, "sh", "-ec", "umount /dev/nvidia5 && umount /run/rofs")
    assert undone.returncode == 0, undone.stdout
    entries = [e for e in gpu(play, 1)["not_ready"] if e["check"] == "device_access"]
    assert play["ready"] is False and len(entries) == 1, play["gpus"]
    assert entries[0]["reason"] == "/dev/nvidia5 does not open: Read-only file system (EROFS)", entries
    assert "read-only" in entries[0]["remedy"]
    assert [e for e in gpu(play, 2)["not_ready"] if e["check"] == "device_access"] == []
