"""The execution environment: the collection's meta/execution-environment.yml gives ansible-builder its
controller requirements (introspected from an install of the built tarball, as the image's builder stage
does), and the root execution-environment.yml is an example that installs gpuops.fleet by name and puts
the targets' wheels at the documented path; the role's offline install then works from that wheel folder,
as release_gpus_advanced.wheel_dir=/opt/gpuops/wheels does in AWX. `ansible-builder create` writes the build
context; no container engine and no network are needed."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest
import yaml
from ansible import __version__ as ansible_version

from _rolelab import REPO, VENV_BIN, RoleLab, alive, make_venv, parse_recap

LAB_ID = os.environ.get("EE_TEST_LAB_ID", "r13ee")
EE_WHEEL_DIR = "/opt/gpuops/wheels"   # documented in the AWX guide and execution-environment.yml


@pytest.fixture(scope="module")
def tarball(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "build", "--force", "--output-path",
                    str(out), REPO], check=True, stdout=subprocess.PIPE, timeout=300)
    (built,) = out.glob("gpuops-fleet-*.tar.gz")
    return built


@pytest.fixture(scope="module")
def installed(tarball, tmp_path_factory):
    """The tarball installed as a Galaxy install would: {path}/ansible_collections/gpuops/fleet."""
    path = tmp_path_factory.mktemp("collections")
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-galaxy"), "collection", "install", "--force", str(tarball),
                           "-p", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout
    return path


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """The example EE file in a scratch folder beside the repo's wheels, and its build context."""
    work = tmp_path_factory.mktemp("ee")
    shutil.copy(os.path.join(REPO, "execution-environment.yml"), work)
    os.makedirs(work / ".cache")
    os.symlink(os.path.join(REPO, ".cache", "wheels"), work / ".cache" / "wheels")
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-builder"), "create", "-f", "execution-environment.yml",
                           "-c", "context", "--output-filename", "Containerfile"], cwd=work, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout
    assert "WARNING" not in proc.stdout, proc.stdout   # e.g. "No matches for ... in additional_build_files"
    return work / "context"


def test_example_is_version_3_and_installs_the_collection_by_name(context):
    with open(os.path.join(REPO, "execution-environment.yml")) as handle:
        definition = yaml.safe_load(handle)
    assert definition["version"] == 3
    with open(context / "_build" / "requirements.yml") as handle:
        galaxy = yaml.safe_load(handle)
    assert galaxy["collections"] == [{"name": "gpuops.fleet"}]


def test_tarball_installs_and_ships_no_lab_bench_ci_or_wheel(tarball, installed):
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    assert (manifest["collection_info"]["namespace"], manifest["collection_info"]["name"]) == ("gpuops", "fleet")
    assert {"plugins/callback/gpu_report.py", "plugins/inventory/proxmox_gpu.py", "plugins/connection/pct.py",
            "roles/release_gpus/tasks/main.yml", "playbooks/release_gpus.yml", "COPYING",
            "meta/execution-environment.yml", "meta/ee-requirements.txt", "meta/ee-bindep.txt"} <= names
    leaked = sorted(n for n in names if n.startswith((".venv", ".cache", ".lab", ".ci", "tests/lab", "tests/bench",
                                                     "docs/facts")) or n.endswith(".whl") or n == "Makefile")
    assert not leaked, "build_ignore leaked: %s" % leaked[:20]
    assert (installed / "ansible_collections" / "gpuops" / "fleet" / "plugins" / "callback" / "gpu_report.py").exists()


def test_builder_reads_the_collections_python_requirements_and_bindep(installed, tmp_path):
    """What the image's builder stage runs: introspect the installed collections."""
    pip, bindep = tmp_path / "requirements.txt", tmp_path / "bindep.txt"
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-builder"), "introspect", "--write-pip", str(pip),
                           "--write-bindep", str(bindep), str(installed)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, universal_newlines=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout
    python = [line.split("#")[0].strip() for line in pip.read_text().splitlines() if line.split("#")[0].strip()]
    assert python == ["proxmoxer>=2.0", "requests>=2.28"], pip.read_text()
    system = bindep.read_text()
    assert "openssh-client [platform:dpkg]" in system and "openssh-clients [platform:rpm]" in system, system


def test_context_puts_the_targets_wheels_at_the_documented_path(context):
    wheels = sorted(p.name for p in (context / "_build" / "wheels").glob("*.whl"))
    assert any(w.startswith("psutil-") for w in wheels) and any(w.startswith("nvidia_ml_py-") for w in wheels), wheels
    assert "COPY _build/wheels/ %s/" % EE_WHEEL_DIR in (context / "Containerfile").read_text()
    with open(os.path.join(REPO, "docs", "docsite", "rst", "guide_awx.rst")) as handle:
        assert "wheel_dir: %s" % EE_WHEEL_DIR in handle.read()


def operator_inventory(lab, path):
    """The lab's inventory as an operator without root SSH writes it: the node user gpuops (NOPASSWD sudo) on the
    node hosts (become for the role's node tasks) and for the pct connection (pct exec through sudo -n)."""
    with open(lab.inventory) as handle:
        inv = yaml.safe_load(handle)
    groups = inv["all"]["children"]
    for host in groups["pve_nodes"]["hosts"].values():
        host["ansible_user"] = "gpuops"
    for host in groups["gpu_containers"]["hosts"].values():
        host.update(ansible_user="gpuops", ansible_pct_node_become=True)
    with open(path, "w") as handle:
        yaml.safe_dump(inv, handle)
    return str(path)


def report_rows(path):
    with open(path) as handle:
        return json.load(handle)["rows"]


@pytest.fixture(scope="module")
def lab():
    """One lab node with two containers, for both tests that run the role (its own lab: one bring-up)."""
    built = RoleLab(LAB_ID, nodes=1, containers=2)
    try:
        yield built
    finally:
        built.down()


def test_role_installs_offline_from_the_ee_wheel_folder(context, lab):
    """The wheels as the EE ships them reach a target without psutil/nvidia-ml-py and no pip."""
    root = os.path.join(REPO, ".lab", "ee-tests-%s" % lab.lab_id)
    shutil.rmtree(root, ignore_errors=True)
    try:
        python = make_venv(root, with_pip=False)
        probe = lab.exec(101, python, "-c", "import psutil")
        assert probe.returncode != 0, probe.stdout
        holder = lab.run("plain", 101, [0], 256)
        result = lab.playbook("release_gpus.yml", {"ansible_python_interpreter": python,
                                                   "release_gpus_advanced": {
                                                       "wheel_dir": str(context / "_build" / "wheels"),
                                                       "deps_sources": ["wheels"]}}, limit="ct101")
        assert result.rc == 0, result
        imported = lab.exec(101, python, "-c", "import psutil, pynvml; print(psutil.__file__)")
        assert imported.returncode == 0 and imported.stdout.startswith(root), imported.stdout
        assert not alive(holder["holders"][0]) and lab.gpus()[("101", 0)] == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_operator_installs_the_tarball_and_runs_the_playbooks_by_name(tarball, lab, tmp_path):
    """Issues 22 and 45: a fresh venv with only ansible-core, the built tarball installed by ansible-galaxy into an
    empty collections path, no clone on any path, and the lab's non-root node user `gpuops` with sudo (become for the
    node tasks, sudo -n for pct): `ansible-playbook gpuops.fleet.release_gpus --check` changes nothing, the real run
    frees the GPUs, a second run changes nothing, and `gpuops.fleet.predeploy_check` writes its JSON verdict; every
    host of each play has a row in the report. `ansible-doc gpuops.fleet.gpu_info` renders."""
    venv, collections = tmp_path / "operator", tmp_path / "collections"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bindir = str(venv / "bin")
    pip = subprocess.run([os.path.join(bindir, "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "ansible-core==%s" % ansible_version], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         universal_newlines=True, timeout=600, check=False)
    assert pip.returncode == 0, pip.stdout
    rows_path = tmp_path / "rows.json"
    env = dict(lab.env, ANSIBLE_COLLECTIONS_PATH=str(collections), PATH=bindir + os.pathsep + os.environ["PATH"],
               ANSIBLE_CALLBACKS_ENABLED="gpuops.fleet.gpu_report", GPUOPS_REPORT_PATH=str(rows_path))
    env.pop("PYTHONPATH", None)

    def run(*argv):
        return subprocess.run([os.path.join(bindir, argv[0])] + list(argv[1:]), cwd=str(tmp_path), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=600,
                              check=False)
    installed = run("ansible-galaxy", "collection", "install", str(tarball), "-p", str(collections))
    assert installed.returncode == 0, installed.stdout
    listed = run("ansible-galaxy", "collection", "list", "gpuops.fleet", "--format", "json")
    assert list(json.loads(listed.stdout)) == [str(collections / "ansible_collections")], listed.stdout   # no clone
    inv = operator_inventory(lab, tmp_path / "operator.yml")
    sshd_log = os.path.join(os.path.dirname(lab.inventory), "nodes", "pve1", "sshd.log")
    logged_before = os.path.getsize(sshd_log)
    hosts = ["ct101", "ct102"]
    holders = {"ct101": lab.run("plain", 101, [0], 256), "ct102": lab.run("plain", 102, [1], 128)}
    pids = {host: h["holders"][0] for host, h in holders.items()}

    check = run("ansible-playbook", "-i", inv, "gpuops.fleet.release_gpus", "--check")
    assert check.returncode == 0, check.stdout
    assert all(alive(pid) for pid in pids.values()), check.stdout
    assert lab.gpus()[("101", 0)] == 256 and lab.gpus()[("102", 1)] == 128, check.stdout
    rows = report_rows(rows_path)
    assert sorted({r["host"] for r in rows}) == hosts, rows
    assert sorted((r["host"], r["before_mib"], r["verdict"]) for r in rows if r["before_mib"]) \
        == [("ct101", 256, "check"), ("ct102", 128, "check")], rows

    play = run("ansible-playbook", "-i", inv, "gpuops.fleet.release_gpus")
    assert play.returncode == 0, play.stdout
    assert not any(alive(pid) for pid in pids.values()), play.stdout
    assert lab.gpus()[("101", 0)] == 0 and lab.gpus()[("102", 1)] == 0, play.stdout
    rows = report_rows(rows_path)
    assert sorted({r["host"] for r in rows}) == hosts, rows
    assert sorted((r["host"], r["before_mib"], r["verdict"]) for r in rows if r["before_mib"]) \
        == [("ct101", 256, "freed"), ("ct102", 128, "freed")], rows

    again = run("ansible-playbook", "-i", inv, "gpuops.fleet.release_gpus")
    assert again.returncode == 0, again.stdout
    recap = parse_recap(again.stdout)
    assert sorted(recap) == hosts and all(r["changed"] == 0 for r in recap.values()), again.stdout
    assert sorted({r["host"] for r in report_rows(rows_path)}) == hosts

    verdict_path = tmp_path / "predeploy.json"
    predeploy = run("ansible-playbook", "-i", inv, "gpuops.fleet.predeploy_check", "-e", "predeploy_expect_hosts=2",
                    "-e", "predeploy_report_path=%s" % verdict_path)
    assert predeploy.returncode == 0, predeploy.stdout
    with open(verdict_path) as handle:
        verdict = json.load(handle)
    assert (verdict["verdict"], verdict["exit_code"], verdict["ready"], verdict["checked"]) == ("ready", 0, True, 2), verdict
    assert [(c["host"], c["verdict"]) for c in verdict["containers"]] == [("ct101", "ready"), ("ct102", "ready")], verdict
    # every login of these runs was the node user's, none root's (sshd's own log on the node)
    with open(sshd_log, errors="replace") as handle:
        handle.seek(logged_before)
        logins = re.findall(r"Accepted publickey for (\S+)", handle.read())
    assert logins and set(logins) == {"gpuops"}, logins
    doc = run("ansible-doc", "gpuops.fleet.gpu_info")
    assert doc.returncode == 0 and doc.stdout.startswith("> MODULE gpuops.fleet.gpu_info (%s" % collections), doc.stdout
