"""docs/reliability.md names, for each fault, the test that proves its outcome: each named test must exist.

That each of them also ran and passed in `make test` is checked by tests/tools/run_all.py.
"""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DOC = os.path.join(REPO, "docs", "reliability.md")
TEST_ID = re.compile(r"`(tests/[\w/]+\.py::[\w\[\]-]+)`")


def listed():
    with open(DOC) as handle:
        return list(dict.fromkeys(TEST_ID.findall(handle.read())))


def functions(path):
    with open(os.path.join(REPO, path)) as handle:
        tree = ast.parse(handle.read())
    return set(node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef))


def test_every_fault_row_names_an_existing_test():
    rows = [line for line in open(DOC) if line.startswith("| ") and not line.startswith("| fault")
            and not line.startswith("|---")]
    assert len(rows) >= 25
    assert [row for row in rows if not TEST_ID.search(row)] == []
    missing = []
    for test_id in listed():
        path, name = test_id.split("::")
        if not os.path.exists(os.path.join(REPO, path)) or name.split("[")[0] not in functions(path):
            missing.append(test_id)
    assert missing == []
