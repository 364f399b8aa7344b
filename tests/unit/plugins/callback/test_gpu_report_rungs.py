"""One list of rungs (issue 46): the gpu_report callback orders and recognises the rungs as the module reports them.

The callback had its own copy, with "stop" (units stopped, no signal), which the module reports on a container's rows
but its own RUNGS lacked; the module's list, in ladder order, is now the one both read."""
import ast
import os

from ansible.plugins.loader import init_plugin_loader

init_plugin_loader()  # before the imports below, as the other plugin tests do: one collection loader for the run

from ansible_collections.gpuops.fleet.plugins.callback import gpu_report  # noqa: E402  pylint: disable=wrong-import-position
from ansible_collections.gpuops.fleet.plugins.module_utils import _release as release  # noqa: E402  pylint: disable=wrong-import-position

PLUGINS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "plugins"))


def rungs_the_module_sets():
    """Every rung literal the module_utils pass to _set_rung, and the ones a container row's rung expression names."""
    found = set()
    folder = os.path.join(PLUGINS, "module_utils")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "_set_rung":
                found.update(a.value for a in node.args if isinstance(a, ast.Constant))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "rung" for t in node.targets):
                found.update(outcomes(node.value))
    return found


def outcomes(expr):
    """The string constants an expression can evaluate to (the branches of its conditionals, never their tests)."""
    if isinstance(expr, ast.IfExp):
        return outcomes(expr.body) | outcomes(expr.orelse)
    return {expr.value} if isinstance(expr, ast.Constant) and isinstance(expr.value, str) else set()


def test_the_callback_reads_the_modules_rungs_in_the_modules_order():
    assert gpu_report.RUNGS == release.RUNGS
    assert list(gpu_report.RUNGS) == ["none", "stop", "sigterm", "sigkill", "wait", "container_restart", "reset"]


def test_every_rung_the_module_reports_is_in_the_one_list():
    reported = rungs_the_module_sets()
    assert {"sigterm", "sigkill", "wait", "container_restart", "reset", "stop", "none"} <= reported
    assert sorted(reported - set(release.RUNGS)) == []


def test_a_rung_from_the_one_list_shows_as_it_came_and_so_does_one_it_lacks():
    report = gpu_report.HostReport("ct101")
    report.add_role_result({"gpus": [{"uuid": "GPU-a", "index": 0, "before_mib": 900, "after_mib": 0, "free": True, "rung": "stop"},
                                     {"uuid": "GPU-b", "index": 1, "before_mib": 900, "after_mib": 0, "free": True, "rung": "later"}]})
    rows = dict((r["gpu_index"], r) for r in report.rows("pve1", 101))
    assert rows[0]["rung"] == "stop" and rows[1]["rung"] == "later"
