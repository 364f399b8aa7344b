"""Issue 21: the MPS control daemon is found by its full name, asked with its own pipe directory, never told to
quit. A stand-in control tool (the same file is the daemon with -d, as nvidia-cuda-mps-control is) answers as
rows 26-28 say."""
import os
import subprocess
import sys
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _mps as mps
from ansible_collections.gpuops.fleet.plugins.module_utils import _rungs as rungs

TOOL = r'''#!%s
import os, sys, time
if sys.argv[1:] == ["-d"]:
    time.sleep(60)
    sys.exit(0)
command = sys.stdin.readline().strip()
with open(os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "commands"), "a") as log:
    log.write(command + "\n")
answers = {"get_server_list": "540", "get_client_list 540": "488\n486"}
print(answers.get(command, "0" if command.startswith("terminate_client ") else "unknown command"))
'''


def test_the_control_daemon_is_found_and_asked_with_its_pipe_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(mps, "BIN_DIRS", (str(tmp_path),))   # the tool of a fixed system folder (issue 41)
    tool = tmp_path / "nvidia-cuda-mps-control"
    tool.write_text(TOOL % sys.executable)
    tool.chmod(0o755)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
    daemon = subprocess.Popen([str(tool), "-d"], env=env)
    try:
        deadline = time.monotonic() + 10
        found = []
        while time.monotonic() < deadline and not found:
            found = [c for c in mps.find_controls() if c["pid"] == daemon.pid]
            time.sleep(0.05)
        assert found, "the stand-in daemon was not found"
        control = found[0]
        assert control["binary"] == str(tool) and control["env"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert control["vmid"] is None
        assert mps.listing(control) == {"control": control, "servers": {540: [488, 486]}, "why": {}, "error": None}
        assert rungs.terminate_client(control, 540, 486) == (True, "0")
        assert mps.ask(control, "terminate_client 540 486")[0] is False   # below act: read-only queries only
        assert (pipe / "commands").read_text().splitlines() == [
            "get_server_list", "get_client_list 540", "terminate_client 540 486"]
    finally:
        daemon.kill()
        daemon.wait()


def test_a_daemon_whose_tool_cannot_be_found_is_said_so():
    ok, text = mps.ask({"pid": 1, "binary": None, "env": {}, "vmid": None}, "get_server_list")
    assert not ok and text.startswith("nvidia-cuda-mps-control not found")
