"""Issue 45: the built tarball ships no empty dist/, no lab and nothing that needs it: not tests/integration,
tests/unit/lab or any other test that imports the lab, the developer's tools or a helper the tarball leaves out. Builds
the collection with ansible-galaxy from this clone (galaxy.yml's build_ignore) and reads the tarball's file list."""
import ast
import importlib.util
import os
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BIN = os.path.dirname(sys.executable)
LEFT_OUT = ("dist/", "tests/integration/", "tests/unit/lab/", "tests/lab/", "tests/tools/", "tests/bench/", ".venv/",
            ".cache/", ".lab/")


def imported_names(source):
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_tarball_leaves_out_the_lab_and_every_test_it_ships_imports_only_what_it_ships(tmp_path):
    proc = subprocess.run([os.path.join(BIN, "ansible-galaxy"), "collection", "build", REPO, "--output-path",
                           str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tarballs = [name for name in os.listdir(str(tmp_path)) if name.endswith(".tar.gz")]
    assert len(tarballs) == 1, tarballs
    with tarfile.open(os.path.join(str(tmp_path), tarballs[0])) as tar:
        members = dict((m.name[2:] if m.name.startswith("./") else m.name, m) for m in tar.getmembers())
        sources = dict((name, tar.extractfile(m).read().decode("utf-8")) for name, m in members.items()
                       if m.isfile() and name.startswith("tests/") and name.endswith(".py"))
    names = set(members)
    assert "galaxy.yml" not in names and "MANIFEST.json" in names and "roles/release_gpus/meta/argument_specs.yml" in names
    assert not [n for n in names if n == "dist" or any(n.startswith(p) or n + "/" == p for p in LEFT_OUT)], sorted(names)
    assert "tests/unit/playbooks/test_role_entry_validation.py" in sources, sorted(sources)
    shipped = set(os.path.splitext(n)[0] for n in names)
    wrong = []
    for name, source in sorted(sources.items()):
        folder = os.path.dirname(name)
        for module in sorted(imported_names(source)):
            if module == "ansible_collections" or os.path.join(folder, module) in shipped:
                continue    # the collection itself, or a helper beside the test that the tarball ships
            spec = importlib.util.find_spec(module)
            origin = os.path.realpath(spec.origin or "") if spec else ""
            if spec is None or origin.startswith(os.path.join(os.path.realpath(REPO), "tests") + os.sep):
                wrong.append("%s imports %s" % (name, module))   # the lab, a tool or a helper left out
    assert wrong == [], wrong
    # the deprecated playbook name still ships, beside the new one
    assert {"playbooks/gpu_info.yml", "playbooks/gpu_status.yml"} <= names
