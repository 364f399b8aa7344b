"""Issue 46: one options spec (_params), dependencies declared once (_deps), one result shape (_outcome)."""
import importlib

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps
from ansible_collections.gpuops.fleet.plugins.module_utils import _outcome as outcome
from ansible_collections.gpuops.fleet.plugins.module_utils import _params as params_mod
from ansible_collections.gpuops.fleet.plugins.module_utils import _release as release_mod
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils._params import ReleaseOptions
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import SelectorError

# the keys of the options dict gpu_release passed to _release.release() before issue 46, and the test hook nvidia_smi
OPTIONS = {"term_timeout", "kill_timeout", "verify_timeout", "gpu_reset", "reset_timeout", "lock_timeout", "timeout",
           "collateral", "collateral_tolerance_mib", "reset_blockers", "match", "protect", "scope", "shared_gpu",
           "container_restart", "container_timeout", "stop_found_units", "stop_timeout", "stop_concurrency",
           "skipped_containers", "shm_prefixes", "restart_backend", "nvidia_smi"}


class Failed(Exception):
    pass


class _Module(object):
    def __init__(self, params=None):
        self.params = params or {}
        self.failed = None

    def fail_json(self, **kwargs):
        self.failed = kwargs
        raise Failed(kwargs["msg"])


def spec_params(**given):
    """module.params as AnsibleModule gives them: every option, its spec default unless given."""
    params = dict((k, v.get("default")) for k, v in params_mod.RELEASE_ARGS.items())
    params["advanced"] = dict((k, v.get("default")) for k, v in params_mod.ADVANCED_ARGS.items())
    params["advanced"].update(given.pop("advanced", {}))
    params.update(given)
    return params


def test_release_options_take_every_default_from_the_module_spec():
    opts = ReleaseOptions.from_params(spec_params())
    assert set(opts.as_dict()) == OPTIONS
    # issue 46: _release.py's own defaults (shared_gpu all, stop_concurrency 1) lost to the module's spec
    assert opts.shared_gpu == "own" and opts.stop_concurrency == 4
    assert opts.term_timeout == 10.0 and opts.timeout == 180.0 and opts.collateral_tolerance_mib == 640
    assert opts.match is None and opts.protect.pids == set() and opts.shm_prefixes is None and opts.scope is None
    assert ReleaseOptions().as_dict() == opts.as_dict() | {"protect": None}, "the constructor's defaults are the spec's"


def test_release_options_from_params_compile_and_derive():
    opts = ReleaseOptions.from_params(spec_params(match="train", protect=["12", "nginx"], gpu_reset=True,
                                                  advanced={"clean_shm": True, "stop_timeout": 5.0}), scope="S")
    assert opts.match.search("python3 train.py") and opts.protect.pids == {12} and opts.scope == "S"
    assert opts.shared_gpu == "all", "a reset is about the whole GPU, whatever shared_gpu says"
    assert opts.stop_timeout == 5.0 and opts.shm_prefixes == shm.prefixes_with([]), "clean_shm: the built-in prefixes"
    with pytest.raises(SelectorError):
        ReleaseOptions.from_params(spec_params(match="("))


def test_release_options_are_read_only_and_refuse_unknown_names():
    opts = ReleaseOptions.from_params(spec_params())
    with pytest.raises(AttributeError):
        opts.term_timeout = 1.0
    with pytest.raises(AttributeError):
        opts.extra = 1
    with pytest.raises(TypeError, match="no option bogus"):
        ReleaseOptions(bogus=1)
    later = opts.replace(skipped_containers={"101": "locked"})
    assert later.skipped_containers == {"101": "locked"} and opts.skipped_containers is None
    assert not hasattr(opts, "__dict__")


def test_flat_params_read_the_advanced_dict_or_keep_flat_values():
    flat, labels = params_mod.flat_params({"advanced": {"timeout": 3.0}})
    assert flat["timeout"] == 3.0 and flat["stop_concurrency"] == 4 and labels["timeout"] == "advanced.timeout"
    again, dummy = params_mod.flat_params(flat)
    assert again["timeout"] == 3.0, "flat params (no advanced dict) keep their values"


def test_check_release_params_names_the_advanced_spelling():
    flat, labels = params_mod.flat_params(spec_params(advanced={"stop_concurrency": 0}))
    module = _Module(flat)
    with pytest.raises(Failed, match="advanced.stop_concurrency must be 1 or more, got 0"):
        params_mod.check_release_params(module, flat, labels)


def test_a_declared_import_that_fails_is_recorded_not_raised():
    dep = deps.declare("gpuops-no-such-lib", import_name="gpuops_no_such_lib", reason="to test")
    with dep:
        importlib.import_module("gpuops_no_such_lib")   # a name no package has
    assert not dep.found and isinstance(dep.error, ImportError)
    assert deps.missing(["psutil", "gpuops-no-such-lib"]) is dep
    assert deps.declare("gpuops-no-such-lib") is dep, "declared once"
    assert deps.missing(["psutil", "nvidia-ml-py"]) is None, "this venv has both, declared where they are imported"
    assert deps.missing(["never-declared"]).package == "never-declared"


def test_validate_libraries_fails_in_one_line_with_missing_library():
    deps.declare("gpuops-no-such-lib2", reason="to test the glue")
    with deps.declare("gpuops-no-such-lib2"):
        raise ImportError("No module named 'gpuops_no_such_lib2'")
    module = _Module()
    with pytest.raises(Failed):
        params_mod.validate_libraries(module, ["psutil", "gpuops-no-such-lib2"])
    msg = module.failed["msg"]
    assert module.failed["missing_library"] == "gpuops-no-such-lib2" and "\n" not in msg
    assert msg.startswith("Failed to import the required Python library (gpuops-no-such-lib2)")
    assert "This is required to test the glue." in msg and "-m pip install gpuops-no-such-lib2" in msg
    params_mod.validate_libraries(_Module(), params_mod.RELEASE_PACKAGES)   # both found: nothing happens


def test_install_hint_names_only_what_is_missing_and_the_roles_ways():
    line = deps.install_hint("nvidia-ml-py", "pynvml")
    assert "\n" not in line and "-m pip install nvidia-ml-py" in line
    assert "PEP 668" in line and "ansible_python_interpreter" in line and "release_gpus_advanced.wheel_dir" in line
    assert "python3-pynvml" in line and "psutil" not in line, "only what is missing is named"
    other = deps.install_hint("proxmoxer", "proxmoxer")
    assert "python3-proxmoxer" in other and "release_gpus" not in other, "the role does not install proxmoxer"


def test_psutil_is_declared_where_the_signals_are_sent():
    assert deps.get("psutil").found and release_mod.psutil is not None


def _result():
    """What release() returns, the parts _outcome reads: GPU 0 freed by SIGKILL from container 101, GPU 1 busy,
    GPU 2 reset."""
    return {
        "rung_reached": "reset",
        "before": [{"index": 0, "uuid": "U0", "free": False, "by_container": {"101": 300}},
                   {"index": 1, "uuid": "U1", "free": False},
                   {"index": 2, "uuid": "U2", "free": False}],
        "after": [{"index": 0, "uuid": "U0", "free": False, "free_for_scope": True},
                  {"index": 1, "uuid": "U1", "free": False}, {"index": 2, "uuid": "U2", "free": True}],
        "plan": [{"pid": 533, "gpus": [0]}, {"pid": 600, "gpus": [1]}],
        "actions": [{"pid": 533, "name": "python3", "signal": "SIGTERM", "outcome": "sent"},
                    {"pid": 533, "name": "python3", "signal": "SIGKILL", "outcome": "sent"},
                    {"pid": 600, "name": "python3", "signal": "SIGTERM", "outcome": "not sent: pid reused"},
                    {"pid": 0, "name": "GPU 2", "signal": "reset", "outcome": "done: reset"}],
        "per_container": [{"vmid": 101, "gpus": [{"index": 0, "rung": "sigkill"}], "verdict": "free",
                           "actions": [{"pid": 533, "name": "python3", "signal": "SIGKILL", "outcome": "sent"}]}],
    }


def test_the_result_shape_per_gpu_and_per_container():
    result = outcome.add_shape(_result(), check_mode=False)
    by_index = dict((g["index"], g) for g in result["per_gpu"])
    assert by_index[0] == {"index": 0, "uuid": "U0", "rung": "sigkill", "verdict": "free", "planned": [533],
                           "signals": ["SIGTERM 533 (python3)", "SIGKILL 533 (python3)"]}
    assert by_index[1]["rung"] == "none" and by_index[1]["signals"] == [] and by_index[1]["verdict"] == "busy"
    assert by_index[2]["rung"] == "reset" and by_index[2]["signals"] == ["reset GPU 2"]
    entry = result["per_container"][0]
    assert entry["rung"] == "sigkill" and entry["signals"] == ["SIGKILL 533 (python3)"] and entry["verdict"] == "free"
    assert set(_result()) < set(result), "keys are added, none removed"


def test_the_result_shape_before_the_ladder():
    result = _result()
    result["after"], result["actions"] = None, []
    planned = outcome.add_shape(dict(result), check_mode=True)["per_gpu"]
    assert [g["verdict"] for g in planned] == ["planned", "planned", "nothing to do"]
    stopped = outcome.add_shape(dict(result), check_mode=False)["per_gpu"]
    assert [g["verdict"] for g in stopped] == ["not released"] * 3
    assert outcome.add_shape({"per_container": []}, False)["per_gpu"] == []
