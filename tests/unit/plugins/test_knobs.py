"""Issue 22's fewer knobs: gpu_release's short public set with one `advanced` dict (issue 45: the deprecated top-level
spellings and the proxmox_api dict are gone, refused as unsupported parameters), the role's main argument spec of 15
variables with `release_gpus_advanced` (each key's default in vars/main.yml), and shared_gpu: own saying how much
others hold."""
import os
import re
import subprocess
import sys

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.errors import UnsupportedError

from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _params as params_mod
from ansible_collections.gpuops.fleet.plugins.module_utils._release import held_by_others_mib, share_words
from ansible_collections.gpuops.fleet.plugins.modules import gpu_release

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BIN = os.path.dirname(sys.executable)
PUBLIC = {"gpus", "match", "protect", "containers", "host_processes", "shared_gpu", "term_timeout", "kill_timeout",
          "gpu_reset", "container_restart", "collateral", "advanced"}


def documented_options():
    doc = yaml.safe_load(gpu_release.DOCUMENTATION)
    return doc["options"]


def test_gpu_release_documents_the_short_set_and_advanced_only():
    options = documented_options()
    advanced = set(options["advanced"]["suboptions"])
    assert advanced == set(params_mod.ADVANCED_ARGS)
    # issue 45: no deprecated copy is left; with gpus and the credentials from the doc fragments, the top level is the
    # short public set
    assert not [k for k, v in options.items() if "deprecated" in str(v["description"]).lower()], sorted(options)
    assert set(options) == PUBLIC - {"gpus"}
    assert not advanced & set(params_mod.release_spec()), "an advanced key is also a top-level option"
    assert "proxmox_api" not in params_mod.release_spec()
    for name in advanced:
        sub = options["advanced"]["suboptions"][name]
        assert sub.get("default") == params_mod.ADVANCED_ARGS[name].get("default"), name


class _Module(object):
    def __init__(self, params):
        self.params = params


def test_flatten_advanced_takes_the_dict_and_its_defaults():
    params = {"advanced": {"verify_timeout": 5.0, "clean_shm": True}}
    flat, labels = params_mod.flat_params(_Module(params).params)
    assert flat["verify_timeout"] == 5.0 and flat["clean_shm"] is True
    assert flat["timeout"] == 180.0 and labels["timeout"] == "advanced.timeout"
    assert set(labels.values()) == set("advanced." + k for k in params_mod.ADVANCED_ARGS)
    assert "timeout" not in params, "module.params (the task's invocation) keeps what was given"


@pytest.mark.parametrize("given", [{"verify_timeout": 5}, {"timeout": 2, "advanced": {"timeout": 3}},
                                   {"proxmox_api": {"host": "pve1", "user": "root@pam"}}])
def test_a_removed_spelling_is_an_unsupported_parameter(given):
    """Issue 45: the top-level copies of the advanced keys and the proxmox_api dict are gone; ansible's own
    validation of the module's argument spec refuses each, naming it."""
    result = ArgumentSpecValidator(params_mod.release_spec()).validate(dict(given))
    unsupported = [e for e in result.errors if isinstance(e, UnsupportedError)]
    name = [k for k in given if k != "advanced"][0]
    assert len(unsupported) == 1 and name in str(unsupported[0]), [str(e) for e in result.errors]


def run_task(tmp_path, args):
    book = tmp_path / "play.yml"
    book.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False,
                                     "tasks": [{"gpuops.fleet.gpu_release": args}]}]))
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_DEPRECATION_WARNINGS="1", ANSIBLE_LOCALHOST_WARNING="0",
               ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    return subprocess.run([os.path.join(BIN, "ansible-playbook"), "-c", "local", str(book)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_bad_advanced_value_is_named_and_the_old_spelling_is_unsupported(tmp_path):
    new = run_task(tmp_path, {"advanced": {"verify_timeout": "nan"}})
    assert new.returncode == 2 and "advanced.verify_timeout must be a finite number, got nan" in new.stdout, new.stdout
    assert "DEPRECATION" not in new.stdout + new.stderr
    # issue 45: the top-level spelling is no longer read (deprecated in issue 22, removed): ansible's own error
    old = run_task(tmp_path, {"verify_timeout": 5})
    words = " ".join(old.stdout.split())
    assert old.returncode == 2 and "Unsupported parameters for (gpuops.fleet.gpu_release) module: verify_timeout" in words, words
    assert "DEPRECATION" not in old.stdout + old.stderr


def test_role_main_spec_has_at_most_15_variables_and_every_advanced_key_a_default():
    with open(os.path.join(REPO, "roles", "release_gpus", "meta", "argument_specs.yml")) as f:
        spec = yaml.safe_load(f)["argument_specs"]["main"]["options"]
    assert len(spec) <= 15 and "release_gpus_advanced" in spec, sorted(spec)
    with open(os.path.join(REPO, "roles", "release_gpus", "vars", "main.yml")) as f:
        role_vars = yaml.safe_load(f)
    defaults = role_vars["_release_gpus_advanced_defaults"]
    keys = spec["release_gpus_advanced"]["options"]
    assert set(defaults) == set(keys)
    for key, option in keys.items():
        # each key is read from the dict over its default (the flat variables of 0.1.0 were removed in 0.2.0)
        assert "_release_gpus_" + key in role_vars, key
        if "default" in option and not str(defaults[key]).startswith("{{"):
            assert option["default"] == defaults[key], (key, option["default"], defaults[key])
    with open(os.path.join(REPO, "roles", "release_gpus", "defaults", "main.yml")) as f:
        role_defaults = yaml.safe_load(f)
    assert set(role_defaults) == set(spec), "defaults/main.yml holds the main spec's variables, no more"
    assert defaults["deps_break_system_packages"] is False and defaults["wheel_dir"] == ""


class _Report(object):
    def __init__(self, gpus):
        self.gpus = gpus


def test_share_words_say_how_much_others_hold():
    report = _Report([
        {"index": 0, "memory": {"used_mib": 3000}, "by_container": {"101": 0, "102": 2000, "unattributed": 1000}},
        {"index": 1, "memory": {"used_mib": 500}, "by_container": {"101": 20, "host": 480}},
    ])
    one = node.Scope(["101"], False)
    assert held_by_others_mib(report, one) == 3480
    assert share_words(report, one) == "this container's share is free; 3480 MiB are held by others"
    two = node.Scope(["101", "102"], True)
    assert held_by_others_mib(report, two) == 1000
    assert share_words(report, two).startswith("the scope's share is free; 1000 MiB")


# ansible-core 2.21's `ansible-doc -t role` warns about its own internal collection, whatever the collection shown
# (2.21.5: "Collection at '.../ansible/_internal/ansible_collections/ansible/_protomatter' does not have a
# MANIFEST.json file, nor has it galaxy.yml: cannot detect version."); only that exact line is not ours.
CORE_OWN_WARNING = re.compile(r"^\[WARNING\]: Collection at '[^']*/ansible/_internal/ansible_collections/ansible/_protomatter' "
                              r"does not have a MANIFEST\.json file, nor has it galaxy\.yml: cannot detect version\.\n", re.M)


def test_ansible_doc_renders_the_role_and_every_plugin():
    """Issue 22: the role's docs (its 15 main variables and the advanced keys) and each plugin's render with
    ansible-doc from the collection."""
    def doc(*args):
        proc = subprocess.run([os.path.join(BIN, "ansible-doc")] + list(args), capture_output=True, text=True,
                              timeout=120, check=False, env=dict(os.environ, ANSIBLE_NOCOLOR="1"))
        assert proc.returncode == 0 and not CORE_OWN_WARNING.sub("", proc.stderr).strip(), (args, proc.stdout[-2000:], proc.stderr)
        return proc.stdout
    role = doc("-t", "role", "gpuops.fleet.release_gpus")
    assert "release_gpus_advanced" in role and "deps_break_system_packages" in role and "wheel_dir" in role
    modules = doc("-t", "module", "gpuops.fleet.gpu_info", "gpuops.fleet.gpu_release", "gpuops.fleet.gpu_report_file")
    for name in ("gpu_info", "gpu_release", "gpu_report_file"):    # one ansible-doc run renders the three
        assert re.search(r"^> (?:MODULE )?gpuops\.fleet\.%s\b" % name, modules, re.M | re.I), modules[:2000]
    for kind, name in (("connection", "pct"), ("inventory", "proxmox_gpu"), ("callback", "gpu_report")):
        assert "gpuops.fleet." + name in doc("-t", kind, "gpuops.fleet." + name)
