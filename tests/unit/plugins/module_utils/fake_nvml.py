"""A Python stand-in for the pynvml module, for unit tests of the engine.

Only the calls _nvml.Nvml makes. Faults per GPU: 'lost' raises NVML_ERROR_GPU_IS_LOST,
'hang' blocks until release() is called.
"""

import threading

MIB = 1024 * 1024
nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    def __init__(self, value):
        Exception.__init__(self, value)
        self.value = value

    def __str__(self):
        return {15: "GPU is lost", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found",
                3: "Not Supported"}.get(self.value, "Unknown Error")


class _Obj(object):
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeNvml(object):
    NVMLError = NVMLError
    nvmlMemory_v2 = nvmlMemory_v2

    def __init__(self, gpus, init_error=None):
        # gpus: list of dicts minor, used_mib, procs [(pid, mib)], fault
        self.gpus = gpus
        self.init_error = init_error
        self.unblock = threading.Event()
        self.calls = []

    def release(self):
        self.unblock.set()

    def _dev(self, handle):
        gpu = self.gpus[handle]
        fault = gpu.get("fault")
        if fault == "lost":
            raise NVMLError(15)
        if fault == "hang":
            self.unblock.wait()
        return gpu

    def nvmlInit(self):
        self.calls.append("init")
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04-fake"

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMinorNumber(self, handle):
        return self._dev(handle)["minor"]

    def nvmlDeviceGetUUID(self, handle):
        return "GPU-%08d-0000-0000-0000-000000000000" % self.gpus[handle]["minor"]

    def nvmlDeviceGetPciInfo(self, handle):
        return _Obj(busId=b"00000000:%02X:00.0" % (0x18 + handle))

    def nvmlDeviceGetName(self, handle):
        return "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._dev(handle)
        used = gpu.get("used_mib", 0) * MIB
        if version:
            return _Obj(total=143771 * MIB, reserved=615 * MIB, used=used, free=0, version=version)
        return _Obj(total=143771 * MIB, used=used + 615 * MIB, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        gpu = self._dev(handle)
        return [_Obj(pid=pid, usedGpuMemory=mib * MIB) for pid, mib in gpu.get("procs", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return []

    # health: gpu["health"] is a set of the lab's conditions (labdriver.HEALTH); an H200 by default
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle):
        if "retired_pages_pending" not in self._dev(handle).get("health", ()):
            raise NVMLError(3)
        return 1

    def nvmlDeviceGetRemappedRows(self, handle):
        health = self._dev(handle).get("health", ())
        return (0, int("row_remap_pending" in health), int("row_remap_pending" in health), int("row_remap_failure" in health))

    def nvmlDeviceGetEccMode(self, handle):
        return [1, 0 if "ecc_pending" in self._dev(handle).get("health", ()) else 1]

    def nvmlDeviceGetFieldValues(self, handle, ids):
        health = self._dev(handle).get("health", ())
        action = 2 if "node_reboot_required" in health else 1 if "reset_required" in health else 0
        return [_Obj(fieldId=i, nvmlReturn=0 if i == 230 else 3, value=_Obj(uiVal=action if i == 230 else 0)) for i in ids]
