"""gpu_report_file through ansible-playbook on localhost: the JSON text, no change when the same, check mode writes
nothing, and bad values fail naming themselves."""
import json
import os
import stat
import subprocess
import sys

BIN = os.path.dirname(sys.executable)
RESULT = {"gpus": [{"uuid": "GPU-1", "free": True, "holders": []}], "all_free": True, "note": "caf\u00e9"}


def task(path, mode=None, content=True):
    """One gpu_report_file task; play() registers it and ignores its errors."""
    args = {"path": str(path)}
    if content:
        args["content"] = RESULT
    if mode is not None:
        args["mode"] = mode
    return args


def play(tmp_path, tasks, check=False):
    """The registered result of each task; a last task writes them to a file beside tmp_path."""
    out = tmp_path.parent / (tmp_path.name + "-results.json")
    body = [{"gpuops.fleet.gpu_report_file": args, "register": "r%d" % n, "ignore_errors": True}
            for n, args in enumerate(tasks)]
    body.append({"ansible.builtin.copy": {"dest": str(out), "content": "{{ [%s] | to_json }}"
                                          % ", ".join("r%d" % n for n in range(len(tasks)))},
                 "check_mode": False})
    book = tmp_path / "play.yml"
    book.write_text(json.dumps([{"hosts": "localhost", "gather_facts": False, "tasks": body}]))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    cmd = [os.path.join(BIN, "ansible-playbook"), "-c", "local", str(book)] + (["--check"] if check else [])
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.exists(), proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_writes_sorted_indented_json_once_and_then_reports_no_change(tmp_path):
    first, second = play(tmp_path, [task(tmp_path / "ct1.json"), task("ct1.json")])   # relative: from the cwd
    assert first["changed"] is True and first["path"] == str(tmp_path / "ct1.json"), first
    assert second["changed"] is False, second
    text = (tmp_path / "ct1.json").read_text(encoding="utf-8")
    assert json.loads(text) == RESULT
    assert text.endswith("}\n") and '\n    "all_free": true,' in text, text
    assert stat.S_IMODE(os.stat(tmp_path / "ct1.json").st_mode) == 0o600   # the default: a report names processes
    assert sorted(os.listdir(tmp_path)) == ["ct1.json", "play.yml"]   # no temporary file left beside it


def test_check_mode_writes_nothing_and_says_it_would_change(tmp_path):
    (result,) = play(tmp_path, [task(tmp_path / "ct1.json")], check=True)
    assert result["changed"] is True, result
    assert not (tmp_path / "ct1.json").exists()


def test_a_new_mode_alone_is_a_change(tmp_path):
    first, second = play(tmp_path, [task(tmp_path / "ct1.json"), task(tmp_path / "ct1.json", mode="0644")])
    assert first["changed"] and second["changed"], (first, second)
    assert stat.S_IMODE(os.stat(tmp_path / "ct1.json").st_mode) == 0o644


def test_bad_values_fail_naming_them_and_write_nothing(tmp_path):
    bad_mode, no_folder, no_content = play(tmp_path, [task(tmp_path / "ct1.json", mode="rw-r"),
                                                      task(tmp_path / "missing" / "ct1.json"),
                                                      task(tmp_path / "x.json", content=False)])
    assert bad_mode["failed"] and "got 'rw-r'" in bad_mode["msg"], bad_mode
    assert no_folder["failed"] and str(tmp_path / "missing") in no_folder["msg"], no_folder
    assert no_content["failed"] and "content" in no_content["msg"], no_content
    assert sorted(os.listdir(tmp_path)) == ["play.yml"]


def test_a_planted_symlink_is_replaced_never_followed_and_a_report_is_private(tmp_path):
    """Issue 41, attack 7: a symlink at the report's name, even to a file that already holds the same report with the
    same mode, is replaced by a regular file; the file it pointed to is left as it was. The default mode is 0600."""
    victim = tmp_path / "victim.json"
    (first,) = play(tmp_path, [task(victim, mode="0640")])
    before = victim.read_bytes()
    os.symlink(str(victim), str(tmp_path / "ct1.json"))
    result, fresh = play(tmp_path, [task(tmp_path / "ct1.json", mode="0640"), task(tmp_path / "ct2.json")])
    assert first["changed"] and result["changed"], (first, result)
    assert not os.path.islink(tmp_path / "ct1.json") and json.loads((tmp_path / "ct1.json").read_text()) == RESULT
    assert victim.read_bytes() == before and stat.S_IMODE(os.stat(victim).st_mode) == 0o640
    assert fresh["changed"] and stat.S_IMODE(os.stat(tmp_path / "ct2.json").st_mode) == 0o600
