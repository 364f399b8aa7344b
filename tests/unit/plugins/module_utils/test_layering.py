"""Read, then decide, then act: each module_utils file imports only its own layer or the ones below (issue 18)."""
import ast
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = os.path.normpath(os.path.join(HERE, "..", "..", "..", "..", "plugins"))
PREFIX = "ansible_collections.gpuops.fleet.plugins.module_utils"

LAYERS = {
    "read": ("_helperproc", "_procread", "_procscan", "_nvml", "_nvmlhelper", "_pveconf", "_node", "_redact", "_selectors",
             "_access", "_mps", "_deps", "_procnames"),
    "evidence": ("_holder", "_lineage", "_pinning", "_jobs", "_shm", "_ready", "_blockers", "_stopsets", "_shmplaces",
                 "_report", "_diagnose", "_gpu_engine", "_where"),
    "decide": ("_decide", "_verdict"),
    "act": ("_hardstop", "_respawn", "_restart", "_units", "_locks", "_shmclean", "_signals", "_rungs", "_ladder", "_release"),
    "glue": ("_params", "_outcome"),   # the modules' options and result shape: above act, beside the modules
}
ORDER = ("read", "evidence", "decide", "act", "glue")
RANK = dict((name, ORDER.index(layer)) for layer, names in LAYERS.items() for name in names)


def imports_of(path):
    """module_utils names a file imports (from ... import _x, from ..._x import y), and top-level packages."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    ours, packages = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PREFIX:
                ours.update(alias.name for alias in node.names)
            elif node.module.startswith(PREFIX + "."):
                ours.add(node.module[len(PREFIX) + 1:])
            else:
                packages.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
    return ours, packages


def closure(path):
    seen, todo, packages = set(), [path], set()
    while todo:
        ours, pkgs = imports_of(todo.pop())
        packages |= pkgs
        for name in ours - seen:
            seen.add(name)
            todo.append(os.path.join(PLUGINS, "module_utils", name + ".py"))
    return seen, packages


def test_every_module_utils_file_has_a_layer():
    files = sorted(f[:-3] for f in os.listdir(os.path.join(PLUGINS, "module_utils")) if f.endswith(".py"))
    assert [f for f in files if f not in RANK and f != "__init__"] == []


@pytest.mark.parametrize("name", sorted(RANK))
def test_a_file_imports_only_its_layer_or_lower(name):
    ours, dummy = imports_of(os.path.join(PLUGINS, "module_utils", name + ".py"))
    upward = sorted(o for o in ours if RANK[o] > RANK[name])
    assert upward == [], "%s (%s) imports %s from a higher layer" % (name, ORDER[RANK[name]], upward)


def test_read_only_gpu_status_depends_on_no_decision_or_signalling_code_and_not_on_psutil():
    ours, packages = closure(os.path.join(PLUGINS, "modules", "gpu_info.py"))
    assert sorted(o for o in ours if ORDER.index("decide") <= RANK[o] <= ORDER.index("act")) == []
    assert "psutil" not in packages


def test_the_decision_step_reads_nothing():
    """Pure: no /proc, NVML, subprocess or signal; only evidence records in, a plan out."""
    ours, packages = imports_of(os.path.join(PLUGINS, "module_utils", "_decide.py"))
    assert ours <= {"_holder", "_pinning", "_selectors"} and packages <= {"__future__", "ansible_collections"}
