import os
from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._procscan import DeviceNames

from conftest import CTL, UVM

DEVS = DeviceNames("/dev")


def test_parse_stat_with_parentheses_and_spaces_in_comm():
    text = "812 (tp worker) (1)) D 700 812 812 0 -1 4194560 1 0 0 0 5 3 0 0 20 0 18 0 123456 1 1\n"
    stat = procscan.parse_stat(text)
    assert stat == {"pid": 812, "comm": "tp worker) (1)", "state": "D", "ppid": 700, "pgrp": 812, "session": 812,
                    "tty_nr": 0, "flags": 4194560, "num_threads": 18, "starttime": 123456}


def test_parse_status_nspid_uid_threads():
    text = ("Name:\tpython3\nState:\tZ (zombie)\nTgid:\t729\nPid:\t729\nPPid:\t1\nUid:\t1000\t1000\t1000\t1000\n"
            "Threads:\t18\nNSpid:\t729\t2\n")
    status = procscan.parse_status(text)
    assert status["name"] == "python3" and status["state"] == "Z" and status["threads"] == 18
    assert status["nspid"] == [729, 2] and status["uid"] == 1000 and status["ppid"] == 1


def test_classify_device_names():
    assert DEVS.classify("/dev/nvidia0") == ("gpu", 0)
    assert DEVS.classify("/dev/nvidia17 (deleted)") == ("gpu", 17)
    assert DEVS.classify("/dev/nvidiactl") == ("ctl", None)
    assert DEVS.classify("/dev/nvidia-uvm") == ("uvm", None)
    assert DEVS.classify("/dev/nvidia-uvm-tools") == ("uvm", None)
    assert DEVS.classify("/dev/nvidia-caps/nvidia-cap1") == ("caps", None)
    for other in ("/dev/null", "/dev/nvidia", "/dev/nvidia0x", "/tmp/dev/nvidia0", "/dev/nvidia-modesetx"):
        assert DEVS.classify(other) is None
    assert DeviceNames("/tmp/lab/dev").classify("/tmp/lab/dev/nvidia3") == ("gpu", 3)


def test_parse_maps_devices_from_recorded_text():
    text = (
        "55d0c000-55d0d000 r--p 00000000 08:01 1312                       /usr/bin/python3.11\n"
        "7f3c00000000-7f3c00001000 rw-s 00000000 00:05 1023               /dev/nvidiactl\n"
        "7f3c00001000-7f3c00002000 rw-s 00000000 00:05 1023               /dev/nvidiactl\n"
        "7f3c00200000-7f3c00400000 rw-s 00000000 00:05 1027               /dev/nvidia0\n"
        "7f3c00400000-7f3c00600000 rw-s 00000000 00:05 1031               /dev/nvidia-uvm (deleted)\n"
        "7f3c00600000-7f3c00601000 r--p 00000000 08:01 77                 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n"
        "7ffd1c2e0000-7ffd1c301000 rw-p 00000000 00:00 0                  [stack]\n"
    )
    assert procscan.parse_maps_devices(text.encode(), DEVS) == ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]
    assert procscan.parse_maps_devices(b"7f3c-7f3d r--p 0 08:01 77 /usr/lib/libnvidia-ml.so.1\n", DEVS) == []


def test_parse_cgroup_v2_and_v1():
    assert procscan.parse_cgroup("0::/lxc/101/ns/system.slice/x.service\n") == "/lxc/101/ns/system.slice/x.service"
    assert procscan.parse_cgroup("12:freezer:/stuck\n0::/lxc/102/ns\n") == "/lxc/102/ns"
    assert procscan.parse_cgroup("4:memory:/lxc/9\n") == "/lxc/9"


def test_scan_finds_rows_4_5_6_and_tells_clients(proc):
    gpu0 = ["/dev/nvidia0", CTL, UVM]
    proc.add(10, maps=gpu0, fds=gpu0)                                   # plain holder
    proc.add(11, comm="pt_data_worker", ppid=1, maps=gpu0, fds=gpu0)    # fork child (row 5)
    proc.add(12, maps=gpu0, fds=["/dev/null"])                          # mmap only (row 6)
    tasks = {13: {"state": "Z"}, 14: {"state": "S", "maps": gpu0, "fds": gpu0}, 15: {"state": "S"}}
    proc.add(13, state="Z", threads=3, tasks=tasks)                     # defunct leader (row 4)
    proc.add(20, comm="nvidia-smi", fds=["/dev/nvidia0", CTL, UVM, "/dev/nvidia-caps/nvidia-cap1"])  # client (row 8)
    proc.add(30, comm="zombie", state="Z", threads=1, ppid=10)          # one-thread zombie (row 3)
    proc.add(2, comm="kthreadd", raw_maps="", flags=0x208040)           # kernel thread (PF_KTHREAD)
    proc.add(40, comm="bash", fds=["/dev/pts/0", "/tmp/nvidia0"])       # unrelated
    result = procscan.scan(proc.root, DEVS)
    assert sorted(result.entries) == [10, 11, 12, 13, 20]
    e = result.entries
    assert e[10].is_holder and e[10].via == ["fd", "mmap"]
    assert e[12].is_holder and e[12].via == ["mmap"] and e[12].fd_devices == []
    assert e[13].defunct_leader and e[13].via == ["task"] and e[13].table_tid == 14
    assert e[13].map_devices == sorted(gpu0)
    assert not e[20].is_holder and e[20].map_devices == [] and "/dev/nvidia0" in e[20].fd_devices
    assert result.zombies == [{"pid": 30, "ppid": 10, "comm": "zombie"}]


def test_a_kernel_thread_is_known_by_its_flag_not_by_empty_maps(proc):
    gpu0 = ["/dev/nvidia0", CTL, UVM]
    proc.add(2, comm="kthreadd", raw_maps="", flags=0x208040, fds=gpu0)    # PF_KTHREAD: never read further
    proc.add(60, comm="python3", state="R", raw_maps="", fds=gpu0)         # exiting: mappings gone, files open
    result = procscan.scan(proc.root, DEVS)
    assert sorted(result.entries) == [60] and result.entries[60].fd_devices == sorted(gpu0)
    assert procscan.read_stat(2, proc.root)["flags"] & procscan.PF_KTHREAD


def test_scan_skips_given_pids(proc):
    proc.add(10, maps=["/dev/nvidia0"], fds=["/dev/nvidia0"])
    proc.add(11, maps=["/dev/nvidia0"], fds=["/dev/nvidia0"])
    assert sorted(procscan.scan(proc.root, DEVS, skip_pids={11}).entries) == [10]


def test_thread_details_reports_d_state_wchan_and_stack(proc):
    proc.add(50, threads=2, tasks={50: {"state": "S"},
                                   51: {"state": "D", "wchan": "__refrigerator",
                                        "stack": "[<0>] __refrigerator+0x4c/0x130\n[<0>] get_signal+0x6f1/0x8f0\n"}})
    counts, blocked = procscan.thread_details(50, proc.root)
    assert counts == {"S": 1, "D": 1}
    assert blocked[0]["tid"] == 51 and blocked[0]["wchan"] == "__refrigerator"
    assert blocked[0]["stack"][0].startswith("[<0>] __refrigerator")


def test_ancestors_and_descendants(proc):
    proc.add(1, comm="init", ppid=0)
    proc.add(5, comm="sshd", ppid=1)
    proc.add(6, comm="python3", ppid=5)
    proc.add(7, comm="nvidia-smi", ppid=6)
    assert procscan.ancestors(6, proc.root) == [5, 1]
    assert procscan.is_descendant(7, 6, proc.root)
    assert not procscan.is_descendant(5, 6, proc.root)


def test_same_process_compares_start_time(proc):
    proc.add(60, starttime=4242)
    assert procscan.same_process(60, 4242, proc.root)
    assert not procscan.same_process(60, 4243, proc.root)
    assert not procscan.same_process(61, 4242, proc.root)


def test_a_pid_reused_while_its_tables_are_read_is_never_a_holder(proc, monkeypatch):
    """The process dies and its pid is reused while its tables are read: start times differ."""
    gpu0 = ["/dev/nvidia0", CTL, UVM]
    proc.add(50, maps=gpu0, fds=gpu0, starttime=1000)
    proc.add(51, maps=gpu0, fds=gpu0, starttime=1000)
    real = procscan.READER.read_many

    def reuse_50_midway(requests, lane=0):
        answers = real(requests, lane)
        if any(path.endswith("/50/fd") for dummy, path, dummy2 in requests):
            stat_path = os.path.join(proc.root, "50", "stat")
            with open(stat_path) as f:
                text = f.read()
            with open(stat_path, "w") as f:
                f.write(text.replace(" 1000 1000000 ", " 2500 1000000 "))   # a new process, a later start
        return answers
    monkeypatch.setattr(procscan.READER, "read_many", reuse_50_midway)
    result = procscan.scan(proc.root, DEVS)
    assert sorted(result.entries) == [51]


def test_a_character_device_is_its_gpu_by_st_rdev_not_its_name(tmp_path):
    """Proxmox's `lxc.mount.entry: /dev/nvidia3 dev/nvidia0`: the node named nvidia0 is minor 3 (never opened here)."""
    import stat
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(str(dev / "nvidia0"), stat.S_IFCHR | 0o600, os.makedev(195, 3))
    os.mknod(str(dev / "nvidiactl"), stat.S_IFCHR | 0o600, os.makedev(195, 255))
    (dev / "nvidia1").write_bytes(b"")   # a regular file (the lab's): its name
    names = DeviceNames(str(dev))
    assert procscan.gpu_minor(str(dev / "nvidia0"), names) == 3
    assert procscan.gpu_minor(str(dev / "nvidia1"), names) == 1
    assert procscan.gpu_minor(str(dev / "nvidiactl"), names) is None
