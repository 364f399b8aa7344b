# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The NVML helper process and its wire format (private helper, read layer; issue 46: cut out of _nvml).

HELPER_SOURCE is the program the helper runs; _Helper starts one and reads its answers within a timeout; Handle,
Const and Fields are what crosses the pipe in place of pynvml's handles, constants and structs. _nvml.Nvml decides
when to start, ask, kill or abandon a helper.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc

# Runs in the helper: one JSON request per line on stdin, one JSON answer per line on stdout.
HELPER_SOURCE = r"""
import json, sys
if sys.argv[1:] and sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
try:
    import pynvml
except Exception as exc:
    sys.stdout.write(json.dumps({"error": "cannot import pynvml: %s" % exc}) + "\n")
    sys.exit(1)
handles = {}


def arg(value):
    if isinstance(value, dict) and "handle" in value:
        return handles[value["handle"]]
    if isinstance(value, dict) and "const" in value:
        return getattr(pynvml, value["const"])
    return value


def plain(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)) or hasattr(value, "_length_"):  # a ctypes array too
        return [plain(v) for v in value]
    if hasattr(value, "_fields_"):
        return {"__fields__": dict((f[0], plain(getattr(value, f[0]))) for f in value._fields_)}
    if hasattr(value, "__dict__"):
        return {"__fields__": dict((k, plain(v)) for k, v in vars(value).items())}
    return value


sys.stdout.write('{"ready": true}\n')
sys.stdout.flush()
for line in sys.stdin:
    request = json.loads(line)
    name = request["fn"]
    answer = {}
    try:
        if name == "nvmlDeviceGetHandleByIndex":
            index = request["args"][0]
            handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
            answer = {"value": None}
        elif not hasattr(pynvml, name):
            answer = {"nvml_error": 13, "text": "Function Not Found"}
        else:
            args = [arg(a) for a in request["args"]]
            kwargs = dict((k, arg(v)) for k, v in request["kwargs"].items())
            answer = {"value": plain(getattr(pynvml, name)(*args, **kwargs))}
    except pynvml.NVMLError as exc:
        answer = {"nvml_error": getattr(exc, "value", None), "text": str(exc)}
    except Exception as exc:
        answer = {"error": "%s: %s" % (type(exc).__name__, exc)}
    answer["id"] = request.get("id")
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
"""


class Handle(object):
    """A GPU handle in the helper, named by NVML index."""

    def __init__(self, index):
        self.index = index


class Const(object):
    """A pynvml constant, resolved where the call runs."""

    def __init__(self, name):
        self.name = name


class Fields(object):
    """An NVML struct or friendly object handed back by the helper."""

    def __init__(self, fields):
        self.__dict__.update(fields)


def _from_helper(value):
    if isinstance(value, list):
        return [_from_helper(v) for v in value]
    if isinstance(value, dict) and "__fields__" in value:
        return Fields(dict((k, _from_helper(v)) for k, v in value["__fields__"].items()))
    return value


def _to_helper(value):
    if isinstance(value, Handle):
        return {"handle": value.index}
    if isinstance(value, Const):
        return {"const": value.name}
    return value


class HelperGone(Exception):
    pass


class _Helper(object):
    """One helper process; call() answers or raises HelperGone / returns None on timeout."""

    def __init__(self, module_dir):
        self.proc = helperproc.spawn(HELPER_SOURCE, [module_dir or ""])
        self.buffer = b""

    def read_line(self, timeout):
        """One line from the helper, None when timeout passed first; raises HelperGone at EOF."""
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = end - time.monotonic()
            if left <= 0:
                return None
            ready = select.select([fd], [], [], left)[0]
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise HelperGone("the NVML helper process exited (status %s)" % self.proc.poll())
            self.buffer += chunk
        line, dummy, self.buffer = self.buffer.partition(b"\n")
        try:
            return json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            raise HelperGone("the NVML helper process answered what is not JSON: %r" % line[:200])

    def read_answer(self, request_id, timeout):
        """The answer to request_id, None when timeout passed first. An answer to an earlier request
        (one whose caller gave up) is skipped, never taken for this one."""
        end = time.monotonic() + timeout
        while True:
            answer = self.read_line(max(0.0, end - time.monotonic()))
            if answer is None or answer.get("id") == request_id:
                return answer
            if not isinstance(answer.get("id"), int) or answer["id"] > request_id:
                raise HelperGone("the NVML helper process answered request %r to request %d"
                                 % (answer.get("id"), request_id))

    def send(self, request):
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise HelperGone("the NVML helper process is gone: %s" % exc)

    def kill(self):
        """SIGKILL, without waiting: a helper stuck in the driver exits only when the call returns."""
        helperproc.abandon(self.proc)

    def close(self, timeout=2.0):
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        try:
            self.proc.stdout.close()
        except (OSError, ValueError):
            pass
