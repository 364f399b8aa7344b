"""CSV output of the lab's fake nvidia-smi, from a recorded driver snapshot line."""

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

SMI = Path(__file__).resolve().parents[3] / "tests" / "lab" / "driver" / "nvidia-smi"
loader = importlib.machinery.SourceFileLoader("fake_nvidia_smi", str(SMI))
spec = importlib.util.spec_from_loader("fake_nvidia_smi", loader)
smi = importlib.util.module_from_spec(spec)
loader.exec_module(smi)

UUID = "GPU-436a67f8-b036-56e2-b82d-b0824e5f34f0"


def gpu(used_v2=2048):
    g = smi.Gpu(["0", "4", UUID, "00000000:9A:00.0", "143771", "615", str(used_v2), "none"])
    g.procs = [(533, 2048)]
    return g


def test_query_gpu_used_leaves_the_floor_out(capsys):
    smi.csv(smi.GPU_FIELDS, "index,uuid,pci.bus_id,memory.total,memory.used,memory.reserved", [(gpu(),)], "csv")
    assert capsys.readouterr().out.splitlines() == [
        "index, uuid, pci.bus_id, memory.total [MiB], memory.used [MiB], memory.reserved [MiB]",
        "0, %s, 00000000:9A:00.0, 143771 MiB, 2048 MiB, 615 MiB" % UUID,
    ]


def test_query_gpu_subset_noheader_nounits(capsys):
    smi.csv(smi.GPU_FIELDS, "memory.used,index", [(gpu(0),)], "csv,noheader,nounits")
    assert capsys.readouterr().out.splitlines() == ["0, 0"]


def test_query_compute_apps(capsys):
    g = gpu()
    smi.csv(smi.APP_FIELDS, "pid,used_memory,gpu_uuid", [(g, p) for p in g.procs], "csv")
    assert capsys.readouterr().out.splitlines() == [
        "pid, used_gpu_memory [MiB], gpu_uuid",
        "533, 2048 MiB, %s" % UUID,
    ]


def test_unknown_field_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        smi.csv(smi.GPU_FIELDS, "index,temperature.gpu", [(gpu(),)], "csv")
    assert exit_info.value.code == 2
    assert 'Field "temperature.gpu" is not a valid field to query.' in capsys.readouterr().err


def test_select_by_index_uuid_or_bus_id():
    g = gpu()
    for ident in ("0", UUID, "00000000:9A:00.0", "0000:9a:00.0"):
        assert smi.select_gpus([g], ident) == [g]
