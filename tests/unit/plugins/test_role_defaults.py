"""Issue 46: each default of gpu_release lives in one place, _params's spec. The role release_gpus restates some
(defaults/main.yml, vars/main.yml's _release_gpus_advanced_defaults, meta/argument_specs.yml, and the task
invocations that pass module options); this test holds them to the module's spec, apart from the role's deliberate
differences listed below, each with its reason. A default changed on one side only fails here."""
import os
import re

import yaml

from ansible_collections.gpuops.fleet.plugins.module_utils._params import ADVANCED_ARGS, RELEASE_ARGS

ROLE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "roles", "release_gpus"))
TASK_FILES = ("main.yml", "node_release.yml", "fleet_node.yml")

# option: (the role's default, the module's default, why they differ)
DELIBERATE = {
    "match": ("", None, "the role's empty string means every holder; its tasks then omit the option"),
    "stop_found_units": (True, False, "the role stops the stop sets decided 'stop' (issue 42); the module only when asked"),
    "clean_shm": (True, False, "the role removes /dev/shm residue once the GPUs are free (issue 43); the module only when asked"),
}
# the role's main variables that are gpu_release options (release_gpus_NAME -> NAME)
MAIN_OPTIONS = ("gpus", "match", "protect", "shared_gpu", "term_timeout", "kill_timeout", "threshold_mib", "gpu_reset",
                "collateral", "container_restart")


def load(*parts):
    with open(os.path.join(ROLE, *parts)) as handle:
        return yaml.safe_load(handle)


def module_default(name):
    spec = RELEASE_ARGS.get(name) or ADVANCED_ARGS[name]
    return spec.get("default")


def role_defaults():
    """{module option: the role's default} from defaults/main.yml and vars/main.yml's advanced defaults."""
    defaults = load("defaults", "main.yml")
    out = dict((name, defaults["release_gpus_" + name]) for name in MAIN_OPTIONS)
    advanced = load("vars", "main.yml")["_release_gpus_advanced_defaults"]
    out.update((name, value) for name, value in advanced.items() if name in ADVANCED_ARGS)
    return out


def differences(role):
    """(option, role's, module's) where they differ and the difference is not listed as deliberate, or a listed one
    that no longer holds on either side."""
    out = []
    for name, value in sorted(role.items()):
        ours = module_default(name)
        if name in DELIBERATE:
            if (value, ours) != DELIBERATE[name][:2]:
                out.append((name, value, ours))
        elif value != ours:
            out.append((name, value, ours))
    return out


def test_every_role_default_of_a_module_option_is_the_modules_or_a_listed_deliberate_difference():
    role = role_defaults()
    assert set(MAIN_OPTIONS) <= set(role) and len(role) > len(MAIN_OPTIONS)
    assert differences(role) == []
    assert set(DELIBERATE) <= set(role), "a deliberate difference for an option the role no longer sets"


def test_a_default_changed_on_one_side_only_is_caught():
    role = role_defaults()
    assert differences(dict(role, stop_timeout=61)) == [("stop_timeout", 61, 60.0)]
    assert differences(dict(role, shared_gpu="all")) == [("shared_gpu", "all", "own")]
    assert differences(dict(role, clean_shm=False)) == [("clean_shm", False, False)], "a deliberate difference gone"


def test_the_role_argument_spec_states_the_same_defaults():
    spec = load("meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    role = role_defaults()
    for name in MAIN_OPTIONS:
        assert spec["release_gpus_" + name].get("default") == role[name], name
    advanced = spec["release_gpus_advanced"]["options"]
    for name in set(advanced) & set(ADVANCED_ARGS):
        if "default" in advanced[name]:
            assert advanced[name]["default"] == role[name], name


def release_tasks(tasks):
    for task in tasks or ():
        if "gpuops.fleet.gpu_release" in task:
            yield task["gpuops.fleet.gpu_release"]
        for key in ("block", "rescue", "always"):
            yield from release_tasks(task.get(key))


def literal_defaults(value):
    """The numbers a Jinja value falls back to (`| default(4)`)."""
    return [float(n) for n in re.findall(r"default\((-?\d+(?:\.\d+)?)\)", str(value))]


def test_the_task_invocations_pass_module_options_from_the_matching_variable():
    seen = 0
    for name in TASK_FILES:
        for args in release_tasks(load("tasks", name)):
            seen += 1
            assert set(args) <= set(RELEASE_ARGS), (name, sorted(set(args) - set(RELEASE_ARGS)))
            given = dict((k, v) for k, v in args.items() if k != "advanced")
            given.update(args.get("advanced") or {})
            assert set(args.get("advanced") or {}) <= set(ADVANCED_ARGS), name
            for option, value in given.items():
                # each option is read from its own variable (release_gpus_NAME, the advanced dict's
                # _release_gpus_NAME, or the API credentials' _release_gpus_api.NAME) ...
                assert re.search(r"\b_?release_gpus_(api\.)?%s\b" % option, str(value)) or option in (
                    "containers", "gpus", "stop_concurrency"), (name, option, value)
                # ... and a literal fallback in the task is the module's default
                for number in literal_defaults(value):
                    assert number == module_default(option), (name, option, value)
    assert seen >= 4
