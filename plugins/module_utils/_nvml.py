# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""NVML access under a timeout (private helper, may change any time).

The driver can hang inside a call. Each call runs in a daemon worker thread;
the caller gives up after `timeout` seconds and the GPU is reported failed.
A hung worker is abandoned (it dies with the process). After two hangs NVML
is treated as wedged and later calls fail at once.
"""

from __future__ import annotations

import threading

try:
    import queue
except ImportError:  # pragma: no cover
    import Queue as queue  # type: ignore

MIB = 1024 * 1024

try:
    import pynvml
    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR = None
except Exception as _exc:  # ImportError, or a broken install
    pynvml = None
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = _exc

_ERROR_TEXT = {
    9: "the NVIDIA driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)",
    12: "libnvidia-ml.so.1 was not found (NVML_ERROR_LIBRARY_NOT_FOUND)",
    13: "the NVML library lacks a function (NVML_ERROR_FUNCTION_NOT_FOUND)",
    15: "the GPU is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus or the driver lost it; "
        "only a reset or a node reboot brings it back",
    16: "the GPU needs a reset (NVML_ERROR_RESET_REQUIRED)",
    18: "the NVML library and the kernel driver versions differ (NVML_ERROR_LIB_RM_VERSION_MISMATCH)",
}


class NvmlFailure(Exception):
    """An NVML call failed, timed out or NVML is unusable; kind says which."""

    def __init__(self, message, kind="error", gpu=None, code=None):
        Exception.__init__(self, message)
        self.message = message
        self.kind = kind
        self.gpu = gpu
        self.code = code


def describe_nvml_error(exc):
    code = getattr(exc, "value", None)
    if code in _ERROR_TEXT:
        return code, _ERROR_TEXT[code]
    try:
        text = str(exc)
    except Exception:
        text = repr(exc)
    return code, "NVML error %s: %s" % (code, text)


class _Worker(threading.Thread):
    def __init__(self):
        threading.Thread.__init__(self, name="gpuops-nvml")
        self.daemon = True
        self.jobs = queue.Queue()

    def run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, kwargs, box, done = job
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            done.set()


class Nvml(object):
    """A small NVML session. Every method raises NvmlFailure, never a raw NVMLError."""

    def __init__(self, timeout=5.0, lib=None):
        self.timeout = float(timeout)
        self.lib = lib if lib is not None else pynvml
        self._worker = None
        self.hangs = 0
        self.wedged = None       # message once NVML is considered wedged
        self.failed = {}         # index -> NvmlFailure (lost or hung GPU)
        self.handles = {}
        self.initialized = False
        self.v2_missing = False  # NVML without the v2 memory call: poll v1 only

    # -- plumbing
    def _call(self, label, fn, *args, **kwargs):
        if self.wedged:
            raise NvmlFailure(self.wedged, kind="hang")
        if self._worker is None:
            self._worker = _Worker()
            self._worker.start()
        box = {}
        done = threading.Event()
        self._worker.jobs.put((fn, args, kwargs, box, done))
        if not done.wait(self.timeout):
            self._worker = None  # abandoned, blocked in the driver
            self.hangs += 1
            message = "%s did not return within %gs (NVML hang)" % (label, self.timeout)
            if self.hangs >= 2:
                self.wedged = "NVML is hung (%d calls did not return within %gs, last %s)" % (self.hangs, self.timeout, label)
            raise NvmlFailure(message, kind="hang")
        if "error" in box:
            exc = box["error"]
            if self.lib is not None and isinstance(exc, getattr(self.lib, "NVMLError", ())):
                code, text = describe_nvml_error(exc)
                kind = {15: "lost", 9: "not_loaded", 12: "library"}.get(code, "error")
                raise NvmlFailure("%s: %s" % (label, text), kind=kind, code=code)
            raise exc
        return box.get("value")

    def _gpu_call(self, index, label, fn, *args, **kwargs):
        if index in self.failed:
            raise self.failed[index]
        try:
            return self._call(label, fn, *args, **kwargs)
        except NvmlFailure as exc:
            exc.gpu = index
            if exc.kind in ("hang", "lost"):
                self.failed[index] = exc
            raise

    # -- session
    def init(self):
        if self.lib is None:
            raise NvmlFailure("nvidia-ml-py is not installed", kind="library")
        self._call("nvmlInit", self.lib.nvmlInit)
        self.initialized = True

    def shutdown(self):
        """Shut NVML down unless a call is stuck in the driver (that would hang too)."""
        if not self.initialized or self.hangs:
            return
        try:
            self._call("nvmlShutdown", self.lib.nvmlShutdown)
        except Exception:
            pass
        self.initialized = False
        if self._worker is not None:
            self._worker.jobs.put(None)
            self._worker = None

    def driver_version(self):
        try:
            return _text(self._call("nvmlSystemGetDriverVersion", self.lib.nvmlSystemGetDriverVersion))
        except NvmlFailure:
            return None

    def count(self):
        return int(self._call("nvmlDeviceGetCount", self.lib.nvmlDeviceGetCount))

    def handle(self, index):
        if index not in self.handles:
            self.handles[index] = self._gpu_call(index, "nvmlDeviceGetHandleByIndex(%d)" % index,
                                                 self.lib.nvmlDeviceGetHandleByIndex, index)
        return self.handles[index]

    def describe(self, index):
        """index, minor, uuid, pci_bus_id, name of one GPU (raises NvmlFailure)."""
        lib = self.lib
        handle = self.handle(index)
        info = {"index": index}
        info["minor"] = int(self._gpu_call(index, "nvmlDeviceGetMinorNumber", lib.nvmlDeviceGetMinorNumber, handle))
        info["uuid"] = _text(self._gpu_call(index, "nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID, handle))
        pci = self._gpu_call(index, "nvmlDeviceGetPciInfo", lib.nvmlDeviceGetPciInfo, handle)
        info["pci_bus_id"] = _text(getattr(pci, "busId", "")) or None
        info["name"] = _text(self._gpu_call(index, "nvmlDeviceGetName", lib.nvmlDeviceGetName, handle))
        return info

    def list_gpus(self):
        """Every GPU NVML sees; a GPU that fails carries `error` and `error_kind` instead of details."""
        gpus = []
        for index in range(self.count()):
            try:
                gpus.append(self.describe(index))
            except NvmlFailure as exc:
                gpus.append({"index": index, "minor": None, "uuid": None, "pci_bus_id": None,
                             "name": None, "error": exc.message, "error_kind": exc.kind})
        return gpus

    def memory(self, index):
        """MiB: total, used (v2, without reserved), reserved, v1_used. v2 falls back to v1 if absent."""
        lib = self.lib
        handle = self.handle(index)
        v1 = self._gpu_call(index, "nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, handle)
        out = {"total_mib": v1.total // MIB, "v1_used_mib": v1.used // MIB,
               "used_mib": v1.used // MIB, "reserved_mib": None, "api": "v1"}
        if self.v2_missing:
            return out
        try:
            v2 = self._gpu_call(index, "nvmlDeviceGetMemoryInfo_v2", lib.nvmlDeviceGetMemoryInfo,
                                handle, version=lib.nvmlMemory_v2)
        except NvmlFailure as exc:
            if exc.kind in ("hang", "lost"):
                raise
            # Not supported or no such function: this NVML has no v2 call, so stop asking.
            self.v2_missing = exc.code in (3, 13)
            return out
        out.update(used_mib=v2.used // MIB, reserved_mib=v2.reserved // MIB, api="v2")
        return out

    def processes(self, index):
        """Compute and graphics processes NVML names for one GPU: [{pid, used_mib}], one per pid."""
        lib = self.lib
        handle = self.handle(index)
        found = {}
        for label in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(lib, label, None)
            if fn is None:
                continue
            try:
                procs = self._gpu_call(index, label, fn, handle)
            except NvmlFailure as exc:
                if exc.kind in ("hang", "lost") or label.startswith("nvmlDeviceGetCompute"):
                    raise
                continue
            for proc in procs or ():
                used = getattr(proc, "usedGpuMemory", None)
                mib = used // MIB if isinstance(used, int) else None
                entry = found.setdefault(int(proc.pid), {"pid": int(proc.pid), "used_mib": None})
                if mib is not None:
                    entry["used_mib"] = (entry["used_mib"] or 0) + mib
        return [found[pid] for pid in sorted(found)]


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value
