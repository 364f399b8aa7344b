"""Row building of the gpuops.fleet.gpu_report callback, on results recorded from a lab run of the role
(role_run_stop_sigkill.json: ct101, supervisord program stopped, GPU 1 held by a SIGTERM-ignoring process)."""
import copy
import json
import os

from ansible.plugins.loader import init_plugin_loader

init_plugin_loader()  # before the import below, as the other plugin tests do: one collection loader for the run

from ansible_collections.gpuops.fleet.plugins.callback import gpu_report  # noqa: E402  pylint: disable=wrong-import-position

HERE = os.path.dirname(os.path.abspath(__file__))
GPU0 = "GPU-58e78f39-28a8-540b-ae76-41136bee224d"
GPU1 = "GPU-8dfd4597-6ea9-5a96-94c0-19f3426624dc"
LAB_VARS = {"ansible_host": "127.221.6.1", "pct_vmid": 101, "lab_node": "pve1"}


def recorded():
    with open(os.path.join(HERE, "role_run_stop_sigkill.json")) as handle:
        return json.load(handle)


def rows_of(entries, hostvars=None, failed=()):
    reports, places = {}, {}
    for entry in entries:
        host = entry["host"]
        report = reports.setdefault(host, gpu_report.HostReport(host))
        places[host] = gpu_report.host_place(hostvars or LAB_VARS, host)
        if entry.get("status") == "failed" or host in failed:
            report.failed = True
        gpu_report.ingest(report, entry["action"], entry["result"])
    return gpu_report.build_rows(reports, places)


def status_result(used0, used1):
    return {"host": "ct101", "action": "gpuops.fleet.gpu_info", "result": {"all_free": False, "gpus": [
        {"index": 0, "uuid": GPU0, "memory": {"used_mib": used0}, "free": used0 == 0},
        {"index": 1, "uuid": GPU1, "memory": {"used_mib": used1}, "free": used1 == 0}]}}


def test_role_run_gives_one_row_per_gpu_with_rung_actions_and_verdict():
    rows = rows_of(recorded())
    assert [(r["node"], r["container"], r["gpu_index"], r["gpu_uuid"]) for r in rows] == [
        ("pve1", 101, 0, GPU0), ("pve1", 101, 1, GPU1)]
    gpu0, gpu1 = rows
    assert (gpu1["before_mib"], gpu1["after_mib"], gpu1["rung"], gpu1["verdict"]) == (1536, 0, "sigkill", "freed")
    stopped = "stopped supervisord program gpuops-respawn-59194816"
    assert gpu1["actions"] == [stopped, "SIGTERM 10 (python)", "SIGKILL 10 (python)"]
    # GPU 0 was freed by the stop before gpu_release read it: its first reading is 0
    assert (gpu0["before_mib"], gpu0["after_mib"], gpu0["rung"], gpu0["verdict"]) == (0, 0, "none", "free")
    assert gpu0["actions"] == [stopped]
    for row in rows:
        assert set(row) >= {"node", "container", "gpu_uuid", "gpu_index", "before_mib", "after_mib", "rung",
                            "verdict", "actions"}


def test_an_earlier_reading_is_the_before_and_a_stop_is_the_rung():
    rows = rows_of([status_result(1024, 1536)] + recorded())
    gpu0, gpu1 = rows
    assert (gpu0["before_mib"], gpu0["after_mib"], gpu0["rung"], gpu0["verdict"]) == (1024, 0, "stop", "freed")
    assert (gpu1["before_mib"], gpu1["rung"]) == (1536, "sigkill")


def test_module_results_alone_without_the_role_fact():
    entries = [e for e in recorded() if e["action"] in gpu_report.RELEASE_ACTIONS + gpu_report.STATUS_ACTIONS]
    for entry in entries:
        entry["action"] = entry["action"].rsplit(".", 1)[-1]     # short names count too
    gpu1 = rows_of(entries)[1]
    assert (gpu1["before_mib"], gpu1["after_mib"], gpu1["rung"], gpu1["verdict"]) == (1536, 0, "sigkill", "freed")
    assert gpu1["actions"] == ["SIGTERM 10 (python)", "SIGKILL 10 (python)"]


def test_status_alone_reports_the_reading_as_before_and_after():
    gpu0, gpu1 = rows_of([status_result(0, 300)])
    assert (gpu0["before_mib"], gpu0["after_mib"], gpu0["verdict"]) == (0, 0, "free")
    assert (gpu1["before_mib"], gpu1["after_mib"], gpu1["rung"], gpu1["verdict"]) == (300, 300, "none", "busy")


def test_check_mode_release_is_a_check_verdict():
    release = copy.deepcopy(next(e for e in recorded() if e["action"] == "gpuops.fleet.gpu_release"))
    release["result"].update(after=None, actions=[], changed=True)
    rows = rows_of([release])
    assert [r["verdict"] for r in rows] == ["check", "check"] and rows[1]["after_mib"] is None


def test_failed_release_without_a_reading_after_is_failed():
    release = copy.deepcopy(next(e for e in recorded() if e["action"] == "gpuops.fleet.gpu_release"))
    del release["result"]["after"]
    release["status"] = "failed"
    rows = rows_of([release])
    assert [(r["before_mib"], r["after_mib"], r["verdict"]) for r in rows] == [(0, None, "failed"), (1536, None, "failed")]


def test_loop_results_are_read_item_by_item():
    status = status_result(0, 64)
    looped = {"host": "ct101", "action": "gpuops.fleet.gpu_info", "result": {"results": [status["result"]]}}
    assert [r["after_mib"] for r in rows_of([looped])] == [0, 64]


def test_unreachable_host_gets_one_row():
    report = gpu_report.HostReport("ct102")
    report.unreachable = True
    rows = gpu_report.build_rows({"ct102": report}, {"ct102": ("pve1", 102)})
    assert [(r["node"], r["container"], r["gpu_uuid"], r["verdict"]) for r in rows] == [("pve1", 102, None, "unreachable")]


def test_place_from_each_inventory():
    # gpuops.fleet.proxmox_gpu
    assert gpu_report.host_place({"proxmox_node": "pve2", "pct_vmid": 201, "ansible_host": "10.0.0.2"}, "ct201") == ("pve2", 201)
    # the lab's static inventory
    assert gpu_report.host_place(LAB_VARS, "ct101") == ("pve1", 101)
    # other spellings of the vmid, and a string vmid
    assert gpu_report.host_place({"proxmox_vmid": "305", "proxmox_node": "pve3"}, "x") == ("pve3", 305)
    # a node itself: no container, the node is the host
    assert gpu_report.host_place({"ansible_host": "127.0.0.9"}, "pve1") == ("pve1", None)
    # a container known only by vmid and its node's address
    assert gpu_report.host_place({"vmid": 7, "ansible_host": "10.0.0.7"}, "ct7") == ("10.0.0.7", 7)


def test_table_has_a_line_per_row_in_column_order():
    rows = rows_of(recorded())
    lines = gpu_report.render_table(rows)
    assert lines[0].split()[:4] == ["NODE", "CT", "HOST", "GPU"] and len(lines) == 3
    assert lines[2].split()[:9] == ["pve1", "101", "ct101", "1", GPU1, "1536", "0", "sigkill", "freed"]


def test_node_side_status_gives_a_row_per_container_of_a_shared_gpu():
    def node_status(shares):
        return {"host": "pve1", "action": "gpuops.fleet.gpu_info", "result": {"view": "node", "gpus": [
            {"index": 0, "uuid": GPU0, "memory": {"used_mib": sum(shares.values())}, "free": not sum(shares.values()),
             "by_container": shares}]}}
    rows = rows_of([node_status({"101": 1000, "102": 700}), node_status({"102": 700})],
                   hostvars={"ansible_host": "127.221.6.1"})
    got = [(r["node"], r["container"], r["gpu_uuid"], r["before_mib"], r["after_mib"], r["verdict"]) for r in rows]
    assert got == [("pve1", "101", GPU0, 1000, 0, "freed"), ("pve1", "102", GPU0, 700, 700, "busy")]


def test_a_container_restart_is_the_rung_of_a_node_side_release():
    entry = {"index": 0, "uuid": GPU0, "used_mib": 900, "free": False}
    result = {"before": [entry], "after": [dict(entry, used_mib=0, free=True)], "rung_reached": "container_restart",
              "plan": [{"pid": 40, "gpus": [0]}],
              "actions": [{"pid": 40, "name": "gpu_worker", "signal": "SIGKILL", "outcome": "sent"},
                          {"pid": 0, "name": "container 101", "vmid": 101, "signal": "container_stop", "outcome": "done: OK"},
                          {"pid": 0, "name": "container 101", "vmid": 101, "signal": "container_start", "outcome": "done: OK"}]}
    row, = rows_of([{"host": "ct101", "action": "gpuops.fleet.gpu_release", "result": result}])
    assert (row["rung"], row["verdict"], row["after_mib"]) == ("container_restart", "freed", 0)
    assert "restarted container 101" in row["actions"]


def test_a_delegated_node_release_for_several_containers_adds_rows_only_through_each_containers_part():
    node_result = {"before": [{"index": 0, "uuid": GPU0, "used_mib": 900, "free": False}],
                   "after": [{"index": 0, "uuid": GPU0, "used_mib": 0, "free": True}], "actions": [], "plan": [],
                   "per_container": [{"vmid": 101}, {"vmid": 102}]}
    mine = {"check_mode": False, "stopped": ["gpuops:w"], "gpus": [
        {"index": 0, "uuid": GPU0, "before_mib": 300, "after_mib": 0, "free": True, "signals": [], "rung": "stop"}]}
    reports = {"ct101": gpu_report.HostReport("ct101"), "ct102": gpu_report.HostReport("ct102")}
    gpu_report.ingest(reports["ct101"], "gpuops.fleet.gpu_release", node_result, delegated=True)
    assert reports["ct101"].gpus == {}     # the node's whole-GPU reading is nobody's row
    for host in reports:
        gpu_report.ingest(reports[host], "ansible.builtin.set_fact", {"ansible_facts": {"release_gpus_result": mine}})
    places = {"ct101": ("pve1", 101), "ct102": ("pve1", 102)}
    rows = gpu_report.build_rows(reports, places)
    assert [(r["container"], r["before_mib"], r["after_mib"], r["rung"], r["verdict"], r["actions"]) for r in rows] == [
        (101, 300, 0, "stop", "freed", ["stopped gpuops:w"]), (102, 300, 0, "stop", "freed", ["stopped gpuops:w"])]
    direct = gpu_report.HostReport("pve1")
    gpu_report.ingest(direct, "gpuops.fleet.gpu_release", node_result)       # run on the node itself: its rows
    assert [(r["before_mib"], r["after_mib"]) for r in direct.rows("pve1", None)] == [(900, 0)]


def test_what_a_release_left_changed_fails_its_rows_and_is_named():
    """Issue 40: a restore that could not complete (left_changed) is in the report, on a normal end and on the
    module's hard stop, whose result has no readings."""
    left = [{"kind": "service", "what": "systemd nvidia-persistenced.service", "state": "stopped", "why": "exit 1: no"}]
    release = {"host": "ct101", "action": "gpuops.fleet.gpu_release", "result": {
        "before": [{"index": 0, "uuid": GPU0, "used_mib": 0, "free": True}],
        "after": [{"index": 0, "uuid": GPU0, "used_mib": 0, "free": True}], "actions": [], "plan": [],
        "left_changed": left}}
    rows = rows_of([release])
    assert [(r["verdict"], r["actions"]) for r in rows] == [
        ("failed", ["LEFT CHANGED: systemd nvidia-persistenced.service stopped (exit 1: no)"])], rows
    hard_stop = {"host": "ct101", "action": "gpuops.fleet.gpu_release", "status": "failed",
                 "result": {"msg": "the overall timeout was reached (hard stop)", "actions": [], "left_changed": left}}
    rows = rows_of([hard_stop])
    assert [(r["verdict"], r["actions"]) for r in rows] == [
        ("failed", ["LEFT CHANGED: systemd nvidia-persistenced.service stopped (exit 1: no)"])], rows
