"""No example passes a secret through a task's `environment:` (issue 41, attack 7).

Ansible puts a task's environment on the command line it runs (`VAR=value /usr/bin/python3 ...`): on `-vvv`'s EXEC
lines and in `ps` on the controller and the node. A secret goes in a module option (no_log), never there.
"""
import ast
import glob
import os
import re

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
SECRET_NAME = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN(?!_ID)|API_KEY|PASSPHRASE)", re.IGNORECASE)
ENV_KEY = re.compile(r"^(?P<indent>\s*)(?:-\s+)?environment:\s*(?P<inline>\{.*)?$")


def documents():
    """(name, text) of every example and doc: plugins' EXAMPLES and DOCUMENTATION, docs/, README.md, the roles' specs."""
    for path in sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "*.py"))):
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                yield "%s:%s" % (os.path.relpath(path, ROOT), node.targets[0].id), node.value.value
    patterns = ("docs/**/*.md", "docs/**/*.rst", "README.md", "roles/*/README.md", "roles/*/meta/argument_specs.yml",
                "playbooks/*.yml")
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            with open(path, encoding="utf-8") as handle:
                yield os.path.relpath(path, ROOT), handle.read()


def secrets_in_environment(text):
    """The secret-looking variables set under an `environment:` key (block or flow style)."""
    found, lines = [], text.splitlines()
    for number, line in enumerate(lines):
        match = ENV_KEY.match(line)
        if not match:
            continue
        if match.group("inline"):
            found += SECRET_NAME.findall(match.group("inline"))
            continue
        indent = len(match.group("indent"))
        for below in lines[number + 1:]:
            if below.strip() and len(below) - len(below.lstrip()) <= indent:
                break
            key = below.strip().split(":", 1)[0]
            if SECRET_NAME.search(key):
                found.append(key)
    return found


def test_the_check_finds_a_secret_in_environment():
    example = "- name: x\n  gpuops.fleet.gpu_release:\n    containers: [101]\n  environment:\n" \
              "    PROXMOX_TOKEN_ID: a\n    PROXMOX_TOKEN_SECRET: \"{{ vault }}\"\n  delegate_to: pve1\n"
    assert secrets_in_environment(example) == ["PROXMOX_TOKEN_SECRET"]
    assert secrets_in_environment("  environment: {PROXMOX_PASSWORD: x}\n") == ["PASSWORD"]
    assert secrets_in_environment("  environment:\n    PROXMOX_TOKEN_ID: a\n    LANG: C\n") == []


@pytest.mark.parametrize("name, text", list(documents()), ids=[name for name, dummy in documents()])
def test_no_example_passes_a_secret_through_environment(name, text):
    assert not secrets_in_environment(text), "%s sets %s through environment:" % (name, secrets_in_environment(text))
