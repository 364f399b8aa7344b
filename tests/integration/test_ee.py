"""execution-environment.yml: `ansible-builder create` writes the build context (no container engine needed), and the
context holds the collection, the Python requirements, bindep and the targets' wheels at the documented path; the
role's offline install then works from that wheel folder, as release_gpus_wheel_dir=/opt/gpuops/wheels does in AWX."""
import json
import os
import shutil
import subprocess
import tarfile

import pytest
import yaml

from _rolelab import REPO, VENV_BIN, RoleLab, alive, make_venv

LAB_ID = os.environ.get("EE_TEST_LAB_ID", "r13ee")
EE_WHEEL_DIR = "/opt/gpuops/wheels"   # documented in README (AWX) and execution-environment.yml


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """The EE file in a scratch folder beside a fresh collection tarball and the repo's wheels, and its context."""
    work = tmp_path_factory.mktemp("ee")
    shutil.copy(os.path.join(REPO, "execution-environment.yml"), work)
    os.makedirs(work / ".cache")
    os.symlink(os.path.join(REPO, ".cache", "wheels"), work / ".cache" / "wheels")
    subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "build", "--force", "--output-path",
                    str(work / ".cache" / "ee"), REPO], check=True, stdout=subprocess.PIPE, timeout=300)
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-builder"), "create", "-f", "execution-environment.yml",
                           "-c", "context", "--output-filename", "Containerfile"], cwd=work, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout
    assert "WARNING" not in proc.stdout, proc.stdout   # e.g. "No matches for ... in additional_build_files"
    return work / "context"


def test_definition_is_version_3():
    with open(os.path.join(REPO, "execution-environment.yml")) as handle:
        definition = yaml.safe_load(handle)
    assert definition["version"] == 3
    assert {"proxmoxer>=2.0", "requests>=2.28"} <= set(definition["dependencies"]["python"])


def test_context_holds_the_collection_that_installs(context, tmp_path):
    with open(context / "_build" / "requirements.yml") as handle:
        galaxy = yaml.safe_load(handle)
    assert galaxy["collections"] == [{"name": "/build/collections/gpuops-fleet.tar.gz", "type": "file"}]
    tarballs = list((context / "_build" / "collections").glob("gpuops-fleet-*.tar.gz"))
    assert len(tarballs) == 1, tarballs
    with tarfile.open(tarballs[0]) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    assert (manifest["collection_info"]["namespace"], manifest["collection_info"]["name"]) == ("gpuops", "fleet")
    assert {"plugins/callback/gpu_report.py", "plugins/inventory/proxmox_gpu.py", "plugins/connection/pct.py",
            "roles/release_gpus/tasks/main.yml", "playbooks/release_gpus.yml"} <= names
    assert not any(n.startswith((".venv", ".cache", ".lab")) for n in names), "build_ignore leaked"
    containerfile = (context / "Containerfile").read_text()
    assert "RUN mv /build/collections/gpuops-fleet-*.tar.gz /build/collections/gpuops-fleet.tar.gz" in containerfile
    # what the image's galaxy stage runs, here against the context's tarball
    requirements = tmp_path / "requirements.yml"
    requirements.write_text(yaml.safe_dump({"collections": [{"name": str(tarballs[0]), "type": "file"}]}))
    installed = tmp_path / "collections"
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "install", "--force", "-r", str(requirements),
                           "-p", str(installed)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout
    assert (installed / "ansible_collections" / "gpuops" / "fleet" / "plugins" / "callback" / "gpu_report.py").exists()


def test_context_holds_python_requirements_and_bindep(context):
    python = (context / "_build" / "requirements.txt").read_text().split()
    assert python == ["proxmoxer>=2.0", "requests>=2.28"]
    bindep = (context / "_build" / "bindep.txt").read_text().splitlines()
    assert "openssh-client [platform:dpkg]" in bindep and "openssh-clients [platform:rpm]" in bindep


def test_context_puts_the_targets_wheels_at_the_documented_path(context):
    wheels = sorted(p.name for p in (context / "_build" / "wheels").glob("*.whl"))
    assert any(w.startswith("psutil-") for w in wheels) and any(w.startswith("nvidia_ml_py-") for w in wheels), wheels
    assert "COPY _build/wheels/ %s/" % EE_WHEEL_DIR in (context / "Containerfile").read_text()
    with open(os.path.join(REPO, "README.md")) as handle:
        assert "release_gpus_wheel_dir: %s" % EE_WHEEL_DIR in handle.read()


def test_role_installs_offline_from_the_ee_wheel_folder(context):
    """The wheels as the EE ships them reach a target without psutil/nvidia-ml-py and no pip."""
    lab = RoleLab(LAB_ID, nodes=1, containers=1)
    root = os.path.join(REPO, ".lab", "ee-tests-%s" % lab.lab_id)
    shutil.rmtree(root, ignore_errors=True)
    try:
        python = make_venv(root, with_pip=False)
        probe = lab.exec(101, python, "-c", "import psutil")
        assert probe.returncode != 0, probe.stdout
        holder = lab.run("plain", 101, [0], 256)
        result = lab.playbook("release_gpus.yml", {"ansible_python_interpreter": python,
                                                   "release_gpus_wheel_dir": str(context / "_build" / "wheels"),
                                                   "release_gpus_deps_sources": ["wheels"]})
        assert result.rc == 0, result
        imported = lab.exec(101, python, "-c", "import psutil, pynvml; print(psutil.__file__)")
        assert imported.returncode == 0 and imported.stdout.startswith(root), imported.stdout
        assert not alive(holder["holders"][0]) and lab.gpus()[("101", 0)] == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
        lab.down()
