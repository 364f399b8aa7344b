"""What a hostile container or a local user can do to the gpu_report callback's output (issue 41, attack 7):
a planted symlink at report_path, and terminal escapes in the process names that the table prints."""
import json
import os
import stat

from ansible.plugins.loader import callback_loader, init_plugin_loader

init_plugin_loader()

GPU0 = "GPU-58e78f39-28a8-540b-ae76-41136bee224d"
EVIL_NAME = "py\x1b]0;pwned\x07thon\x1b[2J\x9b31m\x08\r\nX"


class Lines:
    """A stand-in for the callback's Display: keeps what it would print."""

    def __init__(self):
        self.lines = []

    def display(self, msg, *args, **kwargs):
        self.lines.append(msg)

    def banner(self, msg, *args, **kwargs):
        self.lines.append(msg)

    def warning(self, msg, *args, **kwargs):
        self.lines.append("[WARNING]: " + msg)


def run_stats(report_path, name="python3"):
    """The callback's end of run after one release in ct101 that sent SIGTERM to a process called name."""
    callback = callback_loader.get("gpuops.fleet.gpu_report")
    callback.set_options(direct={"report_path": str(report_path) if report_path else None})
    callback._display = Lines()
    module = __import__(type(callback).__module__, fromlist=["HostReport"])
    report = module.HostReport("ct101")
    module.ingest(report, "gpuops.fleet.gpu_release", {
        "before": [{"index": 0, "uuid": GPU0, "used_mib": 512, "free": False}],
        "after": [{"index": 0, "uuid": GPU0, "used_mib": 0, "free": True}],
        "plan": [{"pid": 42, "gpus": [0]}],
        "actions": [{"signal": "SIGTERM", "pid": 42, "name": name, "outcome": "sent"}]})
    callback._reports, callback._places = {"ct101": report}, {"ct101": ("pve1", 101)}
    callback.v2_playbook_on_stats(None)
    return callback._display.lines


def test_a_symlink_planted_at_report_path_is_replaced_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    os.chmod(victim, 0o644)
    target = tmp_path / "window.json"
    os.symlink(str(victim), str(target))
    run_stats(target)
    assert victim.read_text() == "keep me\n"
    assert not os.path.islink(target) and stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert json.loads(target.read_text())["rows"][0]["verdict"] == "freed"
    assert sorted(os.listdir(tmp_path)) == ["victim", "window.json"]   # no temporary file left


def test_an_existing_report_becomes_private(tmp_path):
    target = tmp_path / "window.json"
    target.write_text("{}")
    os.chmod(target, 0o644)
    run_stats(target)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600 and json.loads(target.read_text())["rows"]


def test_control_characters_never_reach_the_terminal_and_the_json_keeps_the_text(tmp_path):
    target = tmp_path / "window.json"
    lines = run_stats(target, name=EVIL_NAME)
    printed = "\n".join(lines)
    assert not [c for c in printed if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) <= 0x9f], repr(printed)
    assert len(lines) == 4, lines    # banner, header, one row, "written to": no line broken by the name
    assert "SIGTERM 42 (python X)" in lines[2], repr(lines[2])
    assert json.loads(target.read_text())["rows"][0]["actions"] == ["SIGTERM 42 (%s)" % EVIL_NAME]
    assert "\\u001b" in target.read_text()    # escaped by json, never raw
