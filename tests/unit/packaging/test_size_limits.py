"""Issue 46's size limits, in make test: no function in plugins/ over 60 lines or over 15 branches (pylint's
too-many-branches), no module_utils file over 600 lines, and no block of 6 lines or more repeated across plugins/
(pylint's duplicate-code, which needs every file in one run). Argument specs and doc strings are constants, not
functions, so they never count. pylint is the .venv's (requirements-dev.txt pins it, the version ansible-test's
sanity runs); a missing pylint fails here, never skips.

KNOWN_OVER would list an offender kept on purpose, with its reason (none today). A new offender anywhere fails, and
so does an entry there that is no longer over (the list only shrinks)."""
import ast
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLUGINS = os.path.join(REPO, "plugins")
MAX_FUNCTION_LINES = 60
MAX_BRANCHES = 15
MAX_MODULE_UTILS_LINES = 600
MIN_SIMILARITY_LINES = 6

# issue 46: emptied at merge (each is cut by the slice that owns its file)
KNOWN_OVER = {"lines": set(), "branches": set(), "files": set()}


def plugin_files():
    for root, dirs, files in os.walk(PLUGINS):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(root, name), REPO)


def functions(tree, prefix=""):
    """(qualified name, node) of every function and method, nested ones too (release.locked, Class.method)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")
        else:
            yield from functions(node, prefix)


def functions_over(path):
    with open(os.path.join(REPO, path)) as handle:
        tree = ast.parse(handle.read(), path)
    return sorted("%s::%s (%d lines)" % (path, name, node.end_lineno - node.lineno + 1) for name, node in functions(tree)
                  if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES)


def known(found, kind):
    """found less the KNOWN_OVER entries of kind (an entry names path::function or a path, before any ' (')."""
    return sorted(f for f in found if f.split(" (")[0] not in KNOWN_OVER[kind])


def test_the_function_lengths_are_counted_from_the_ast_nested_functions_and_methods_too():
    tree = ast.parse("class A:\n    def m(self):\n        def inner():\n            pass\n        return inner\n"
                     "SPEC = dict(\n    a=1,\n)\n")
    assert [(name, node.end_lineno - node.lineno + 1) for name, node in functions(tree)] == [("A.m", 4), ("A.m.inner", 2)]


def test_no_function_in_plugins_is_over_60_lines():
    over = [f for path in plugin_files() for f in functions_over(path)]
    assert known(over, "lines") == []
    still = set(f.split(" (")[0] for f in over)
    assert sorted(KNOWN_OVER["lines"] - still) == [], "no longer over 60 lines: take them out of KNOWN_OVER"


def test_no_module_utils_file_is_over_600_lines():
    over = []
    for path in plugin_files():
        if path.startswith("plugins/module_utils/"):
            with open(os.path.join(REPO, path)) as handle:
                count = len(handle.read().splitlines())
            if count > MAX_MODULE_UTILS_LINES:
                over.append("%s (%d lines)" % (path, count))
    assert known(over, "files") == []
    assert sorted(KNOWN_OVER["files"] - set(f.split(" (")[0] for f in over)) == [], "no longer over: take them out"


def pylint(*args):
    proc = subprocess.run([sys.executable, "-m", "pylint", "--disable=all", "--persistent=n", "--score=n",
                           "--msg-template={path}::{obj}::{msg_id}::{msg}"] + list(args) + ["plugins/"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert "No module named pylint" not in proc.stderr, "pylint is missing from the venv: make venv (requirements-dev.txt)"
    assert proc.returncode & 1 == 0 and proc.returncode & 32 == 0, proc.stdout + proc.stderr   # fatal or usage error
    return proc.stdout


def test_no_function_in_plugins_has_over_15_branches_and_no_block_of_6_lines_is_repeated():
    """One pylint run over plugins/ (duplicate-code compares every file with every other)."""
    out = pylint("--enable=too-many-branches,duplicate-code", "--max-branches=%d" % MAX_BRANCHES,
                 "--min-similarity-lines=%d" % MIN_SIMILARITY_LINES)
    branches = re.findall(r"^(\S+)::(\S+)::R0912::(.*)$", out, re.M)
    over = ["%s::%s (%s)" % (os.path.relpath(os.path.join(REPO, path), REPO), obj, msg) for path, obj, msg in branches]
    assert known(over, "branches") == []
    assert sorted(KNOWN_OVER["branches"] - set(f.split(" (")[0] for f in over)) == [], "no longer over: take them out"
    duplicates = out[out.find("R0801"):] if "R0801" in out else ""
    assert duplicates == ""
