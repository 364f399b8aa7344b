# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""NVML access under a timeout (private helper, may change any time).

The driver can hang inside a call, in the kernel, where no signal reaches the
calling thread and where a thread of this process would keep the process (and
with it Ansible's pipes and the GPU locks) alive after the task gave up. So
NVML runs in a helper process (this Python running _nvmlhelper.HELPER_SOURCE) that holds
none of this process's files. A call that does not answer within `timeout`
seconds gets its helper SIGKILLed and abandoned, and its GPU is reported
failed; a later call starts a new helper. After two hangs NVML is treated as
wedged and later calls fail at once.

An injected `lib` (unit tests) runs in a daemon thread of this process instead.

Without the v2 memory call, v1 `used` includes the driver's reserved memory
(GPU_FACTS row 1), so memory is "unverifiable" unless the caller gives the
reserved floor to subtract (an estimate, said so in the result).
"""

from __future__ import annotations

import inspect
import os
import threading

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps
from ansible_collections.gpuops.fleet.plugins.module_utils._nvmlhelper import (
    Const, Handle, HelperGone, _from_helper, _Helper, _to_helper)

try:
    import queue
except ImportError:  # pragma: no cover
    import Queue as queue  # type: ignore

MIB = 1024 * 1024
HELPER_START_S = 30.0   # how long a new helper may take to import nvidia-ml-py
V2_MISSING_CODES = (3, 13, 25)  # not supported, no such function, argument version mismatch
NOT_APPLICABLE_CODES = (3, 13)  # not supported (an H200 has no page retirement), no such function in this NVML
RECOVERY_ACTION_FIELD = 230     # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvidia-smi -q: "GPU Recovery Action")

pynvml = None
with deps.declare("nvidia-ml-py", import_name="pynvml", reason="to read the GPUs through NVML"):
    import pynvml

_ERROR_TEXT = {
    9: "the NVIDIA driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)",
    12: "libnvidia-ml.so.1 was not found (NVML_ERROR_LIBRARY_NOT_FOUND); in an LXC container, install the node's "
        "driver userland, the same version, with the driver's installer and --no-kernel-module, and pass "
        "/dev/nvidiactl and /dev/nvidia-uvm in beside /dev/nvidiaN",
    13: "the NVML library lacks a function (NVML_ERROR_FUNCTION_NOT_FOUND)",
    15: "the GPU is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus or the driver lost it; "
        "only a reset or a node reboot brings it back",
    16: "the GPU needs a reset (NVML_ERROR_RESET_REQUIRED)",
    18: "the NVML library and the kernel driver versions differ (NVML_ERROR_LIB_RM_VERSION_MISMATCH); in an LXC "
        "container, install the node's driver version of the userland (the driver's installer with "
        "--no-kernel-module), since the container shares the node's kernel module",
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
    """A small NVML session. Every method raises NvmlFailure, never a raw NVMLError.

    reserved_floor_mib: without the v2 memory call, subtract this from v1 used (an estimate);
    None: such memory is unverifiable and the GPU fails.
    isolate: run NVML in a helper process (default: unless a lib object is injected); a lib given with
    isolate=True must be a module the helper can import as pynvml from its folder.
    """

    def __init__(self, timeout=5.0, lib=None, reserved_floor_mib=None, isolate=None):
        self.timeout = float(timeout)
        self.in_process = (lib is not None) if isolate is None else not isolate
        self.lib = lib if lib is not None else pynvml
        self.reserved_floor_mib = reserved_floor_mib
        self._worker = None
        self._helper = None
        self.helpers_started = 0
        self.generation = 0      # +1 at each nvmlInit (a new helper too): indexes may name other GPUs after one
        self.requests = 0        # request ids: an answer names the request it answers
        self.hangs = 0
        self.wedged = None       # message once NVML is considered wedged
        self.failed = {}         # index -> NvmlFailure (lost or hung GPU)
        self.mps_unread = {}     # index -> why NVML's MPS client list could not be read at the last processes()
        self.handles = {}
        self.initialized = False
        self.v2_missing = False  # NVML without the v2 memory call
        self.v2_missing_in_library = False  # ... because nvidia-ml-py is too old to ask for it

    # -- plumbing
    def _hung(self, label):
        self.hangs += 1
        message = "%s did not return within %gs (NVML hang)" % (label, self.timeout)
        if self.hangs >= 2:
            self.wedged = "NVML is hung (%d calls did not return within %gs, last %s)" % (self.hangs, self.timeout, label)
        return NvmlFailure(message, kind="hang")

    def _call(self, label, name, *args, **kwargs):
        if self.wedged:
            raise NvmlFailure(self.wedged, kind="hang")
        if self.in_process:
            return self._call_thread(label, name, args, kwargs)
        return self._call_helper(label, name, args, kwargs)

    def _call_thread(self, label, name, args, kwargs):
        fn = getattr(self.lib, name, None)
        if fn is None:
            raise NvmlFailure("%s: %s" % (label, _ERROR_TEXT[13]), kind="error", code=13)
        if name == "nvmlDeviceGetHandleByIndex":
            args = list(args)
        else:
            args = [self.handles[a.index] if isinstance(a, Handle) else a for a in args]
        kwargs = dict((k, getattr(self.lib, v.name) if isinstance(v, Const) else v) for k, v in kwargs.items())
        if self._worker is None:
            self._worker = _Worker()
            self._worker.start()
        box = {}
        done = threading.Event()
        self._worker.jobs.put((fn, args, kwargs, box, done))
        if not done.wait(self.timeout):
            self._worker = None  # abandoned, blocked in the driver
            raise self._hung(label)
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, getattr(self.lib, "NVMLError", ())):
                raise _failure(label, *describe_nvml_error(exc))
            raise exc
        return box.get("value")

    def _start_helper(self):
        module_dir = os.path.dirname(os.path.abspath(self.lib.__file__)) if getattr(self.lib, "__file__", None) else ""
        helper = _Helper(module_dir)
        self.helpers_started += 1
        try:
            first = helper.read_line(max(HELPER_START_S, self.timeout))
        except HelperGone as exc:
            helper.kill()
            raise NvmlFailure("the NVML helper process could not start: %s" % exc, kind="library")
        if first is None or not first.get("ready"):
            helper.kill()
            why = "it did not start within %gs" % max(HELPER_START_S, self.timeout) if first is None else first.get("error")
            raise NvmlFailure("the NVML helper process could not start: %s" % why, kind="library")
        self._helper = helper
        if self.initialized:
            # a new helper after a hang: open NVML again before the call
            self._ask("nvmlInit", "nvmlInit", (), {})
            self.generation += 1
            for index in sorted(self.handles):
                if index not in self.failed:
                    self._ask("nvmlDeviceGetHandleByIndex(%d)" % index, "nvmlDeviceGetHandleByIndex", (index,), {})

    def _call_helper(self, label, name, args, kwargs):
        if self._helper is None:
            self._start_helper()
        return self._ask(label, name, args, kwargs)

    def _ask(self, label, name, args, kwargs):
        helper = self._helper
        self.requests += 1
        request = {"id": self.requests, "fn": name, "args": [_to_helper(a) for a in args],
                   "kwargs": dict((k, _to_helper(v)) for k, v in kwargs.items())}
        answer = None
        try:
            helper.send(request)
            answer = helper.read_answer(request["id"], self.timeout)
        except HelperGone as exc:
            raise NvmlFailure("%s: %s" % (label, exc), kind="error")
        finally:
            # No answer read (a hang, a dead helper, or anything raised meanwhile, such as a signal
            # handler's exception): its answer may still come, so this helper never serves again.
            if answer is None:
                helper.kill()
                self._helper = None
        if answer is None:
            helper.kill()
            self._helper = None
            raise self._hung(label)
        if "nvml_error" in answer:
            code = answer["nvml_error"]
            raise _failure(label, code, _ERROR_TEXT.get(code) or "NVML error %s: %s" % (code, answer.get("text")))
        if "error" in answer:
            raise NvmlFailure("%s: %s" % (label, answer["error"]), kind="error")
        return _from_helper(answer.get("value"))

    def _gpu_call(self, index, label, name, *args, **kwargs):
        if index in self.failed:
            raise self.failed[index]
        try:
            return self._call(label, name, *args, **kwargs)
        except NvmlFailure as exc:
            exc.gpu = index
            if exc.kind in ("hang", "lost"):
                self.failed[index] = exc
            raise

    # -- session
    def init(self):
        if self.lib is None:
            raise NvmlFailure("nvidia-ml-py is not installed", kind="library")
        self._call("nvmlInit", "nvmlInit")
        self.initialized = True
        self.generation += 1

    def shutdown(self):
        """Shut NVML down; a helper stuck in the driver was killed already, a thread is left behind."""
        self.handles = {}  # a handle is good for one session only
        if self.in_process:
            if not self.initialized or self.hangs:
                return
            try:
                self._call("nvmlShutdown", "nvmlShutdown")
            except Exception:
                pass
            self.initialized = False
            if self._worker is not None:
                self._worker.jobs.put(None)
                self._worker = None
            return
        if self._helper is None:
            self.initialized = False
            return
        if self.initialized and not self.wedged:
            try:
                self._call("nvmlShutdown", "nvmlShutdown")
            except NvmlFailure:
                pass
        self.initialized = False
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def driver_version(self):
        try:
            return _text(self._call("nvmlSystemGetDriverVersion", "nvmlSystemGetDriverVersion"))
        except NvmlFailure:
            return None

    def count(self):
        return int(self._call("nvmlDeviceGetCount", "nvmlDeviceGetCount"))

    def handle(self, index):
        if index not in self.handles:
            value = self._gpu_call(index, "nvmlDeviceGetHandleByIndex(%d)" % index, "nvmlDeviceGetHandleByIndex", index)
            self.handles[index] = value if self.in_process else Handle(index)
        return Handle(index)

    def describe(self, index):
        """index, minor, uuid, pci_bus_id, name of one GPU (raises NvmlFailure)."""
        handle = self.handle(index)
        info = {"index": index}
        info["minor"] = int(self._gpu_call(index, "nvmlDeviceGetMinorNumber", "nvmlDeviceGetMinorNumber", handle))
        info["uuid"] = _text(self._gpu_call(index, "nvmlDeviceGetUUID", "nvmlDeviceGetUUID", handle))
        pci = self._gpu_call(index, "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo", handle)
        info["pci_bus_id"] = _text(getattr(pci, "busId", "")) or None
        info["name"] = _text(self._gpu_call(index, "nvmlDeviceGetName", "nvmlDeviceGetName", handle))
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

    def library_has_v2(self):
        """Whether this nvidia-ml-py can ask for v2 memory (nvmlMemory_v2, and a version= argument)."""
        call = getattr(self.lib, "nvmlDeviceGetMemoryInfo", None)
        if call is None or not hasattr(self.lib, "nvmlMemory_v2"):
            return False
        try:
            return "version" in inspect.signature(call).parameters
        except (TypeError, ValueError):
            return True   # no signature to read: ask, and let NVML answer

    def memory(self, index):
        """MiB: total, used (without the reserved floor), reserved, v1_used, api (v2 or v1_estimated).

        Without the v2 call, used is v1 used minus reserved_floor_mib (estimated: True); with no floor
        given, NvmlFailure(kind="unverifiable"): v1 used never reads as free (GPU_FACTS row 1).
        """
        handle = self.handle(index)
        if not self.v2_missing and not self.library_has_v2():
            self.v2_missing = self.v2_missing_in_library = True
        v1 = self._gpu_call(index, "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo", handle)
        out = {"total_mib": v1.total // MIB, "v1_used_mib": v1.used // MIB, "used_mib": None,
               "reserved_mib": None, "api": "v2", "estimated": False}
        if not self.v2_missing:
            try:
                v2 = self._gpu_call(index, "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo",
                                    handle, version=Const("nvmlMemory_v2"))
            except NvmlFailure as exc:
                if exc.kind in ("hang", "lost") or exc.code not in V2_MISSING_CODES:
                    raise
                self.v2_missing = True  # this NVML has no v2 call: stop asking
            else:
                out.update(used_mib=v2.used // MIB, reserved_mib=v2.reserved // MIB)
                return out
        if self.reserved_floor_mib is None:
            missing = ("this nvidia-ml-py has no v2 memory call (nvmlDeviceGetMemoryInfo without version=): upgrade "
                       "nvidia-ml-py, or" if self.v2_missing_in_library else
                       "NVML has no v2 memory call (nvmlDeviceGetMemoryInfo_v2), and")
            raise NvmlFailure(
                "memory unverifiable on this driver: %s v1 used (%d MiB) includes the driver's reserved memory, so it "
                "never reads as free; set reserved_floor_mib to this GPU model's idle v1 used to estimate it"
                % (missing, out["v1_used_mib"]), kind="unverifiable", gpu=index)
        out.update(used_mib=max(0, out["v1_used_mib"] - self.reserved_floor_mib),
                   reserved_mib=self.reserved_floor_mib, api="v1_estimated", estimated=True)
        return out

    def processes(self, index):
        """Compute, graphics and MPS client processes NVML names for one GPU: [{pid, used_mib}], one per pid; an
        MPS client (NVML's MPS list, GPU_FACTS row 26) has "mps": True.

        The graphics and MPS lists are optional (a driver or an NVML without them, or MPS not running); why the MPS
        list could not be read is kept in mps_unread[index] (no MPS client is known from NVML there).
        """
        handle = self.handle(index)
        found = {}
        self.mps_unread.pop(index, None)
        for label in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                      "nvmlDeviceGetMPSComputeRunningProcesses"):
            mps = label == "nvmlDeviceGetMPSComputeRunningProcesses"
            try:
                procs = self._gpu_call(index, label, label, handle)
            except NvmlFailure as exc:
                if exc.kind in ("hang", "lost") or label.startswith("nvmlDeviceGetCompute"):
                    raise
                if mps:
                    self.mps_unread[index] = exc.message
                continue
            for proc in procs or ():
                used = getattr(proc, "usedGpuMemory", None)
                mib = used // MIB if isinstance(used, int) else None
                entry = found.setdefault(int(proc.pid), {"pid": int(proc.pid), "used_mib": None})
                if mps:
                    entry["mps"] = True   # an MPS client: listed with its MiB in the compute list too (row 26)
                    if entry["used_mib"] is None and mib is not None:
                        entry["used_mib"] = mib
                elif mib is not None:
                    entry["used_mib"] = (entry["used_mib"] or 0) + mib
        return [found[pid] for pid in sorted(found)]

    def mode(self, index, call):
        """A mode NVML reports for one GPU (persistence: nvmlDeviceGetPersistenceMode, MIG: nvmlDeviceGetMigMode,
        its current mode): 1 on, 0 off, not supported or failing to answer (a lost GPU raises)."""
        try:
            value = self._gpu_call(index, call, call, self.handle(index))
        except NvmlFailure as exc:
            if exc.kind in ("hang", "lost"):
                raise
            return 0
        if isinstance(value, (list, tuple)):
            value = value[0] if value else 0
        return 1 if value else 0

    def health(self, index):
        """What the driver says of one GPU's health: [{check, call, value, code, error}], value None with the
        code when the call failed (code 3 or 13: not applicable here). A lost or hung GPU raises NvmlFailure."""
        handle = self.handle(index)
        readings = []
        for check, call, args in (("retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus", ()),
                                  ("row_remap", "nvmlDeviceGetRemappedRows", ()),
                                  ("ecc_mode", "nvmlDeviceGetEccMode", ()),
                                  ("recovery_action", "nvmlDeviceGetFieldValues", ([RECOVERY_ACTION_FIELD],))):
            reading = {"check": check, "call": call, "value": None, "code": None, "error": None}
            readings.append(reading)
            try:
                value = self._gpu_call(index, call, call, handle, *args)
            except NvmlFailure as exc:
                if exc.kind in ("hang", "lost"):
                    raise
                reading.update(code=exc.code, error=exc.message)
                continue
            if check == "recovery_action":
                field = (value or [None])[0]
                code = getattr(field, "nvmlReturn", None)
                if code:
                    reading.update(code=code, error="%s: NVML error %s for field %d" % (call, code, RECOVERY_ACTION_FIELD))
                    continue
                value = getattr(getattr(field, "value", None), "uiVal", None)
            reading["value"] = [int(v) for v in value] if isinstance(value, (list, tuple)) else value
        return readings


def _failure(label, code, text):
    kind = {15: "lost", 9: "not_loaded", 12: "library"}.get(code, "error")
    return NvmlFailure("%s: %s" % (label, text), kind=kind, code=code)


def _text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value
