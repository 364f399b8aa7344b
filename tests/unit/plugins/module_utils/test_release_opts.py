"""Releaser(engine, targets, opts) (issue 46): opts has attributes named as the keys of the options dict that
gpu_release passes to release(); release() converts such a dict at once, until _params.ReleaseOptions lands."""
import ast
import os
from types import SimpleNamespace

from ansible_collections.gpuops.fleet.plugins.module_utils._release import LEGACY_DEFAULTS, options_of

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = os.path.normpath(os.path.join(HERE, "..", "..", "..", "..", "plugins", "modules", "gpu_release.py"))


def module_option_keys():
    """The keys of the options dict gpu_release.main builds: its names tuple, options.update's keywords, and the
    keys it sets one by one."""
    with open(MODULE) as handle:
        tree = ast.parse(handle.read())
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "names":
            keys.update(e.value for e in node.value.elts)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
              and getattr(node.func.value, "id", None) == "options"):
            keys.update(k.arg for k in node.keywords)
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "options":
            keys.add(node.slice.value)
    return keys


def test_every_key_the_module_passes_is_an_option_attribute():
    keys = module_option_keys()
    assert {"term_timeout", "scope", "shared_gpu", "restart_backend", "shm_prefixes"} <= keys
    assert sorted(keys - set(LEGACY_DEFAULTS)) == []


def test_a_dict_is_converted_with_the_missing_keys_filled_and_an_object_is_kept():
    opts = options_of({"term_timeout": 2.5, "stop_concurrency": 3})
    assert (opts.term_timeout, opts.stop_concurrency, opts.kill_timeout, opts.shared_gpu) == (2.5, 3, 10.0, "all")
    given = SimpleNamespace(**LEGACY_DEFAULTS)
    assert options_of(given) is given
