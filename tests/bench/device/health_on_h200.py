"""Issue 21 on a real GPU host: what the health and capacity calls answer (read-only: no setting changed).

Run with the host's python3 (nvidia-ml-py there) and, for the capacity rows, torch's venv:
  python3 tests/bench/device/health_on_h200.py > $OUT/health.json
  /opt/torch/.venv/bin/python tests/bench/device/health_on_h200.py --cuda >> $OUT/health.json
Each NVML call is recorded with its value or its error's name; NOT_SUPPORTED is the answer for "not applicable".
"""
import json
import os
import sys

import pynvml

MIB = 1024 * 1024


def call(name, *args):
    try:
        value = getattr(pynvml, name)(*args)
    except pynvml.NVMLError as exc:
        return {"error": str(exc), "code": exc.value}
    except AttributeError as exc:
        return {"error": "no such function: %s" % exc}
    if isinstance(value, (list, tuple)):
        return list(value)
    if hasattr(value, "_fields_"):
        return dict((f[0], getattr(value, f[0])) for f in value._fields_ if isinstance(getattr(value, f[0]), (int, float)))
    return value


def fields(handle, ids):
    try:
        values = pynvml.nvmlDeviceGetFieldValues(handle, ids)
    except pynvml.NVMLError as exc:
        return {"error": str(exc)}
    out = {}
    for field_id, value in zip(ids, values):
        out[str(field_id)] = {"ret": value.nvmlReturn, "type": value.valueType, "ui": value.value.uiVal,
                              "ull": value.value.ullVal}
    return out


def nvml_rows():
    pynvml.nvmlInit()
    rows = {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}
    for index in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        mem2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        rows["gpus"].append({
            "index": index,
            "uuid": pynvml.nvmlDeviceGetUUID(h),
            "memory_v1_mib": {"total": mem1.total // MIB, "free": mem1.free // MIB, "used": mem1.used // MIB},
            "memory_v2_mib": {"total": mem2.total // MIB, "reserved": mem2.reserved // MIB, "free": mem2.free // MIB,
                              "used": mem2.used // MIB},
            "retired_pages_pending": call("nvmlDeviceGetRetiredPagesPendingStatus", h),
            "remapped_rows": call("nvmlDeviceGetRemappedRows", h),
            "ecc_mode": call("nvmlDeviceGetEccMode", h),
            "persistence_mode": call("nvmlDeviceGetPersistenceMode", h),
            "repair_status": call("nvmlDeviceGetRepairStatus", h),
            "fields_226_227_230": fields(h, [226, 227, 230]),
            "mps_processes": [p.pid for p in call("nvmlDeviceGetMPSComputeRunningProcesses", h) or []]
            if isinstance(call("nvmlDeviceGetMPSComputeRunningProcesses", h), list) else
            call("nvmlDeviceGetMPSComputeRunningProcesses", h),
        })
    pynvml.nvmlShutdown()
    rows["nvidia_drm_refcnt"] = open("/sys/module/nvidia_drm/refcnt").read().strip() \
        if os.path.exists("/sys/module/nvidia_drm/refcnt") else None
    rows["mps_control"] = [p for p in ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
                           if os.path.exists(p)]
    comms = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                comms.append(open("/proc/%s/comm" % pid).read().strip())
            except OSError:
                pass
    daemons = ("nvidia-persistenced", "nv-hostengine", "nv-fabricmanager", "dcgm-exporter")
    rows["daemons"] = sorted(set(c for c in comms if c in daemons))
    return rows


def cuda_rows():
    import torch
    free, total = torch.cuda.mem_get_info(0)
    return {"cuda_mem_get_info_mib": {"free": free // MIB, "total": total // MIB}}


if __name__ == "__main__":
    print(json.dumps(cuda_rows() if "--cuda" in sys.argv else nvml_rows(), indent=1, default=str))
