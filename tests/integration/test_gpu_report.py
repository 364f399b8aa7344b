"""The gpuops.fleet.gpu_report callback on a real role run: its JSON rows against `labctl gpus` before and
after (node, container, GPU UUID, MiB), rung and verdict, and its printed table against the JSON."""
import json
import os
import re

from _labfixture import clean_role_lab, module_lab
from _rolelab import RoleLab, alive

LAB_ID = os.environ.get("GPU_REPORT_TEST_LAB_ID", "r13report")
REQUIRED = ("node", "container", "gpu_uuid", "gpu_index", "before_mib", "after_mib", "rung", "verdict", "actions")

lab = module_lab(lambda: RoleLab(LAB_ID, nodes=2, containers=1))
clean = clean_role_lab()


def truth(gpus):
    """{uuid: (node, vmid, index in the container, used_mib)} from `labctl gpus`."""
    out = {}
    for gpu in gpus:
        for vmid, index in (gpu.get("visible_in") or {}).items():
            out[gpu["uuid"]] = (gpu["node"], int(vmid), int(index), gpu["used_mib"])
    return out


def run_with_report(lab):
    path = os.path.join(lab.workdir, "gpu_report.json")
    lab.env.update(ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report", GPUOPS_REPORT_PATH=path)
    try:
        result = lab.playbook("release_gpus.yml")
    finally:
        for key in ("ANSIBLE_CALLBACKS_ENABLED", "GPUOPS_REPORT_PATH"):
            lab.env.pop(key)
    with open(path) as handle:
        return result, json.load(handle)["rows"]


def test_report_rows_match_the_drivers_truth_before_and_after(clean):
    lab = clean
    term = lab.run("plain", 101, [1], 512)
    stubborn = lab.run("term_ignoring", 201, [0], 1536)
    before = truth(lab.labctl("gpus"))
    result, rows = run_with_report(lab)
    after = truth(lab.labctl("gpus"))
    assert result.rc == 0, result
    assert not alive(term["holders"][0]) and not alive(stubborn["holders"][0])

    # one row per GPU the two containers see, each with every required key
    assert len(rows) == 4, rows
    expected_rung = {(101, 1): ("sigterm", "freed"), (201, 0): ("sigkill", "freed")}
    for row in rows:
        assert all(key in row for key in REQUIRED), row
        node, vmid, index, used_before = before[row["gpu_uuid"]]
        assert (row["node"], row["container"], row["gpu_index"]) == (node, vmid, index), row
        assert row["before_mib"] == used_before and row["after_mib"] == after[row["gpu_uuid"]][3] == 0, row
        assert (row["rung"], row["verdict"]) == expected_rung.get((vmid, index), ("none", "free")), row
        assert isinstance(row["actions"], list) and all(isinstance(a, str) for a in row["actions"]), row
    signalled = {(r["container"], r["gpu_index"]): r["actions"] for r in rows}
    assert signalled[(101, 1)] == ["SIGTERM %d (python)" % term["container_holders"][0]], signalled
    pid = stubborn["container_holders"][0]
    assert signalled[(201, 0)] == ["SIGTERM %d (python)" % pid, "SIGKILL %d (python)" % pid], signalled
    assert signalled[(101, 0)] == signalled[(201, 1)] == [], signalled

    # the table printed at the end holds the same rows, in the same order
    table = result.output.split("GPU REPORT", 1)[1].splitlines()[1:]
    assert table[0].split()[:3] == ["NODE", "CT", "HOST"], table
    for row, line in zip(rows, table[1:]):
        cells = [row["node"], str(row["container"]), "ct%s" % row["container"], str(row["gpu_index"]),
                 row["gpu_uuid"], str(row["before_mib"]), str(row["after_mib"]), row["rung"], row["verdict"]]
        assert line.split()[:9] == cells, (line, row)
        assert line.endswith("; ".join(row["actions"]) or "-"), (line, row)
    assert not re.match(r"\S", table[len(rows) + 1]) or table[len(rows) + 1].startswith("GPU report written"), table
