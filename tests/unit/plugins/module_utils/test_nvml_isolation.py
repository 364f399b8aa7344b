"""NVML in a helper process (issue 12 A5) and without the v2 memory call (A3)."""

import os
import textwrap
import time

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import Nvml, NvmlFailure, describe_nvml_error

from fake_nvml import FakeNvml, NVMLError

# A pynvml stand-in the helper imports; FAKE_NVML_HANG names a call that never returns.
FAKE_PYNVML = textwrap.dedent("""
    import os, time
    MIB = 1024 * 1024
    nvmlMemory_v2 = 0x02000028


    class NVMLError(Exception):
        def __init__(self, value):
            Exception.__init__(self, value)
            self.value = value


    class Obj(object):
        def __init__(self, **kw):
            self.__dict__.update(kw)


    def _maybe_hang(name):
        if name in os.environ.get("FAKE_NVML_HANG", "").split(","):
            while True:
                time.sleep(3600)


    def nvmlInit():
        _maybe_hang("nvmlInit")


    def nvmlShutdown():
        pass


    def nvmlDeviceGetCount():
        return 2


    def nvmlDeviceGetHandleByIndex(index):
        return index


    def nvmlDeviceGetMinorNumber(handle):
        return handle + 4


    def nvmlDeviceGetMemoryInfo(handle, version=None):
        _maybe_hang("nvmlDeviceGetMemoryInfo%d" % handle)
        if version:
            return Obj(total=1000 * MIB, reserved=615 * MIB, used=7 * MIB, free=0, version=version)
        return Obj(total=1000 * MIB, used=622 * MIB, free=0)


    def nvmlDeviceGetComputeRunningProcesses(handle):
        return [Obj(pid=42, usedGpuMemory=7 * MIB)]
""")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    (tmp_path / "pynvml.py").write_text(FAKE_PYNVML)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys
    sys.modules.pop("pynvml", None)
    module = importlib.import_module("pynvml")
    assert module.__file__.startswith(str(tmp_path))
    made = []

    def make(timeout=2.0, hang=""):
        monkeypatch.setenv("FAKE_NVML_HANG", hang)
        nvml = Nvml(timeout, lib=module, isolate=True)
        made.append(nvml)
        return nvml
    yield make
    sys.modules.pop("pynvml", None)
    for nvml in made:
        if nvml._helper is not None:
            nvml._helper.kill()


def test_calls_run_in_a_helper_that_holds_none_of_our_files(isolated):
    read_end, write_end = os.pipe()           # stands for Ansible's stdout
    os.set_inheritable(write_end, True)
    nvml = isolated()
    nvml.init()
    assert nvml.count() == 2 and nvml.describe.__name__
    assert nvml.memory(1) == {"total_mib": 1000, "v1_used_mib": 622, "used_mib": 7, "reserved_mib": 615,
                              "api": "v2", "estimated": False}
    assert nvml.processes(0) == [{"pid": 42, "used_mib": 7}]
    helper = nvml._helper.proc.pid
    assert helper != os.getpid()
    ours = os.readlink("/proc/self/fd/%d" % write_end)
    theirs = [os.readlink("/proc/%d/fd/%s" % (helper, fd)) for fd in os.listdir("/proc/%d/fd" % helper)]
    assert ours not in theirs and len(theirs) == 3, theirs
    nvml.shutdown()
    os.close(read_end)
    os.close(write_end)


def test_a_hung_call_kills_its_helper_and_a_new_one_serves_the_other_gpus(isolated):
    nvml = isolated(timeout=0.5, hang="nvmlDeviceGetMemoryInfo1")
    nvml.init()
    nvml.memory(0)
    first = nvml._helper.proc
    started = time.monotonic()
    with pytest.raises(NvmlFailure) as failure:
        nvml.memory(1)
    assert failure.value.kind == "hang" and failure.value.gpu == 1 and time.monotonic() - started < 30
    assert "nvmlDeviceGetMemoryInfo did not return within 0.5s (NVML hang)" in failure.value.message
    assert first.poll() is not None, "the hung helper was left running"
    assert nvml.memory(0)["used_mib"] == 7 and nvml.helpers_started == 2   # re-initialised in a new helper
    with pytest.raises(NvmlFailure):
        nvml.memory(1)  # a failed GPU fails at once
    nvml.shutdown()


def test_hang_in_init_fails_in_time(isolated):
    nvml = isolated(timeout=0.5, hang="nvmlInit")
    started = time.monotonic()
    with pytest.raises(NvmlFailure) as failure:
        nvml.init()
    assert failure.value.kind == "hang" and "nvmlInit did not return" in failure.value.message
    assert time.monotonic() - started < 30  # the hang lasts an hour


# ---- no v2 memory call (A3)

class NoV2(FakeNvml):
    def __init__(self, gpus, code=13):
        FakeNvml.__init__(self, gpus)
        self.code = code
        self.v2_asked = 0

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if version:
            self.v2_asked += 1
            raise NVMLError(self.code)
        return FakeNvml.nvmlDeviceGetMemoryInfo(self, handle)


def test_without_v2_memory_is_unverifiable_never_v1_used():
    fake = NoV2([{"minor": 0, "used_mib": 0}])
    nvml = Nvml(1.0, lib=fake)
    nvml.init()
    with pytest.raises(NvmlFailure) as failure:
        nvml.memory(0)
    assert failure.value.kind == "unverifiable" and failure.value.gpu == 0
    assert failure.value.message.startswith("memory unverifiable on this driver")
    with pytest.raises(NvmlFailure):
        nvml.memory(0)
    assert fake.v2_asked == 1  # not asked again once missing


def test_without_v2_a_reserved_floor_gives_an_estimate():
    nvml = Nvml(1.0, lib=NoV2([{"minor": 0, "used_mib": 100}]), reserved_floor_mib=600)
    nvml.init()
    assert nvml.memory(0) == {"total_mib": 143771, "v1_used_mib": 715, "used_mib": 115, "reserved_mib": 600,
                              "api": "v1_estimated", "estimated": True}


def test_another_v2_error_is_a_failure_not_a_fallback():
    nvml = Nvml(1.0, lib=NoV2([{"minor": 0, "used_mib": 0}], code=999), reserved_floor_mib=600)
    nvml.init()
    with pytest.raises(NvmlFailure) as failure:
        nvml.memory(0)
    assert failure.value.kind == "error" and not nvml.v2_missing


class Interrupted(Exception):
    """Stands for an exception a signal handler raises mid-call (gpu_release's hard stop)."""


def test_a_call_interrupted_before_its_answer_never_answers_the_next_call(isolated, monkeypatch):
    from ansible_collections.gpuops.fleet.plugins.module_utils import _nvml
    nvml = isolated()
    nvml.init()
    first = nvml._helper.proc
    read_line = _nvml._Helper.read_line

    def interrupted(self, timeout):
        raise Interrupted()
    monkeypatch.setattr(_nvml._Helper, "read_line", interrupted)
    with pytest.raises(Interrupted):
        nvml.count()                       # its answer, 2, is left in the pipe
    monkeypatch.setattr(_nvml._Helper, "read_line", read_line)
    assert nvml.processes(0) == [{"pid": 42, "used_mib": 7}]
    assert first.poll() is not None and nvml.helpers_started == 2
    nvml.shutdown()


def test_an_answer_to_an_earlier_request_is_skipped(isolated):
    nvml = isolated()
    nvml.init()
    nvml._helper.send({"id": 0, "fn": "nvmlDeviceGetCount", "args": [], "kwargs": {}})   # answered, never read
    assert nvml.processes(0) == [{"pid": 42, "used_mib": 7}] and nvml.count() == 2
    assert nvml.helpers_started == 1
    nvml.shutdown()


class OldLibrary(FakeNvml):
    """An nvidia-ml-py from before the v2 memory call: no version= argument, no nvmlMemory_v2."""

    def __getattribute__(self, name):
        if name == "nvmlMemory_v2":
            raise AttributeError(name)
        return FakeNvml.__getattribute__(self, name)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return FakeNvml.nvmlDeviceGetMemoryInfo(self, handle)


def test_an_old_nvidia_ml_py_reaches_the_floor_fallback():
    nvml = Nvml(1.0, lib=OldLibrary([{"minor": 0, "used_mib": 100}]), reserved_floor_mib=600)
    nvml.init()
    assert nvml.memory(0)["api"] == "v1_estimated" and nvml.memory(0)["used_mib"] == 115
    bare = Nvml(1.0, lib=OldLibrary([{"minor": 0, "used_mib": 0}]))
    bare.init()
    with pytest.raises(NvmlFailure) as failure:
        bare.memory(0)
    assert failure.value.kind == "unverifiable" and "upgrade nvidia-ml-py" in failure.value.message


@pytest.mark.parametrize("code, words", [
    (12, ["libnvidia-ml.so.1 was not found", "--no-kernel-module", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
    (18, ["versions differ", "--no-kernel-module", "the node's driver version"]),
])
def test_a_missing_or_mismatched_nvml_names_the_remedy_in_a_container(code, words):
    """Issue 22: the two failures a new LXC container shows first say what to install and what to pass in."""
    class Error(Exception):
        value = code
    dummy, text = describe_nvml_error(Error())
    assert all(word in text for word in words), text
