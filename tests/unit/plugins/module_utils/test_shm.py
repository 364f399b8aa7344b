"""Issue 21: GPU stacks' shared-memory residue in /dev/shm, read by gpu_status."""
import os
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils import _shmclean as shmclean
from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import Engine
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml

from fake_nvml import FakeNvml

OLD = time.time() - 3600


def segment(folder, name, size=4096, mtime=OLD):
    path = os.path.join(folder, name)
    with open(path, "wb") as handle:
        handle.write(b"\0" * size)
    os.utime(path, (mtime, mtime))
    return path


def place_of(folder):
    """A /dev/shm place as the engine reads it: the folder walked from / one part at a time."""
    parts = shm.folder_parts(folder)
    place = {"path": "/dev/shm", "label": folder, "root": "/", "parts": parts, "mnt": None, "why": None}
    place.update(procscan.list_folder("/", parts))
    return place


def test_only_unused_old_files_with_a_gpu_stacks_prefix_are_residue(tmp_path):
    folder = str(tmp_path)
    for name in ("nccl-old", "nccl-mapped", "sgl_open", "PostgreSQL.1234", "sem.torch_lock", "psm_3f2a", "myapp_seg"):
        segment(folder, name, size=2 << 20)
    segment(folder, "sgl_new", mtime=time.time() + 60)                 # changed after the check started
    os.symlink(segment(folder, "elsewhere"), os.path.join(folder, "nccl-link"))   # never followed
    os.mkdir(os.path.join(folder, "vllm_dir"))                          # not a file
    mapped = os.stat(os.path.join(folder, "nccl-mapped"))
    judged = shm.judge({None: place_of(folder)}, set([(mapped.st_dev, mapped.st_ino)]), {None: set(["sgl_open"])}, [],
                       time.time(), shm.prefixes_with(["myapp_"]))
    assert [dict((k, e[k]) for k in ("path", "bytes", "owner")) for e in judged[None]["residue"]] == [
        {"path": "/dev/shm/myapp_seg", "bytes": 2 << 20, "owner": "extra"},
        {"path": "/dev/shm/nccl-old", "bytes": 2 << 20, "owner": "nccl"},
        {"path": "/dev/shm/psm_3f2a", "bytes": 2 << 20, "owner": "python (vllm, torch)"},
        {"path": "/dev/shm/sem.torch_lock", "bytes": 2 << 20, "owner": "torch"}]
    assert judged[None]["skipped"] is None
    with pytest.raises(OSError):
        place_of(os.path.join(folder, "missing"))
    assert [shm.used_name(p) for p in ("/dev/shm/a", "/dev/shm/a (deleted)", "/tmp/a", "/dev/shm/x/y")] == \
        ["a", None, None, None]


def test_gpu_status_reads_residue_and_what_live_processes_use_from_their_maps_and_fds(proc, tmp_path):
    folder = str(tmp_path / "shm")
    os.mkdir(folder)
    for name in ("nccl-dead", "nccl-mapped", "sgl_open", "torch_other"):
        segment(folder, name)
    proc.add(700, comm="python3", maps=["/dev/shm/nccl-mapped"], fds=["/dev/shm/sgl_open"])
    proc.add(701, comm="python3", maps=["/dev/shm/torch_other (deleted)"])   # a deleted one: another file
    engine = Engine(Nvml(2.0, lib=FakeNvml([{"minor": 0, "used_mib": 0}])), proc_root=proc.root, self_pid=999999)
    engine.start()
    engine.shm_prefixes, engine.shm_dir = shm.PREFIXES, folder
    report = engine.snapshot([0])
    assert sorted(report.scan.shm_paths) == [700, 701]
    assert [e["path"] for e in report.shm_residue] == [folder + "/nccl-dead", folder + "/torch_other"]
    assert report.shm_residue_by_container is None                     # not on a node
    assert ("/dev/shm holds 2 GPU stack files no live process uses (8 KiB of nccl, torch: %s/nccl-dead, "
            "%s/torch_other): leaked by dead processes, they can make the next launch fail; remove them before it"
            % (folder, folder)) in report.diagnosis
    assert report.as_dict()["shm_residue"] == report.shm_residue
    engine.shm_prefixes = None                                          # gpu_release: not read
    assert "shm_residue" not in engine.snapshot([0]).as_dict()


def test_remove_never_follows_a_symlink_and_leaves_a_file_changed_since(tmp_path):
    folder = str(tmp_path / "shm")
    os.mkdir(folder)
    target = segment(str(tmp_path), "precious")
    for name in ("nccl-a", "nccl-b", "nccl-c"):
        segment(folder, name)
    place = place_of(folder)
    found = shm.judge({None: place}, set(), {}, [], time.time())[None]["residue"]
    os.unlink(os.path.join(folder, "nccl-b"))
    os.symlink(target, os.path.join(folder, "nccl-b"))          # swapped for a link after the read
    segment(folder, "nccl-c", mtime=time.time() + 5)            # written again after the release started
    removed, left = shmclean.remove(place, found, time.time(), 10.0)
    assert [e["path"] for e in removed] == ["/dev/shm/nccl-a"]
    assert [e["path"] for e, why in left] == ["/dev/shm/nccl-b", "/dev/shm/nccl-c"]
    assert os.path.exists(target) and sorted(os.listdir(folder)) == ["nccl-b", "nccl-c"]
    link = str(tmp_path / "link")
    os.symlink(folder, link)
    linked = dict(place, parts=shm.folder_parts(link))
    assert shmclean.remove(linked, found[2:], time.time(), 10.0)[0] == []      # the folder itself is not followed either
    assert os.path.exists(os.path.join(folder, "nccl-c"))
