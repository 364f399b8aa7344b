"""Releaser(engine, targets, opts) (issue 46): every option the act layer reads is a ReleaseOptions attribute, whose
defaults are the module's argument spec's (one place)."""
import ast
import os

from ansible_collections.gpuops.fleet.plugins.module_utils._params import RELEASE_ARGS, ReleaseOptions, flat_params

HERE = os.path.dirname(os.path.abspath(__file__))
UTILS = os.path.normpath(os.path.join(HERE, "..", "..", "..", "..", "plugins", "module_utils"))


def read_attributes(name):
    """The attributes read as opts.X or self.opts.X (or getattr(opts, "X", ...)) in one module_utils file."""
    with open(os.path.join(UTILS, name + ".py")) as handle:
        tree = ast.parse(handle.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if getattr(owner, "id", None) == "opts" or getattr(owner, "attr", None) == "opts":
                names.add(node.attr)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and node.args
              and getattr(node.args[0], "id", None) == "opts" and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def test_every_option_the_ladder_and_release_read_is_a_release_option():
    read = set()
    for name in ("_ladder", "_release", "_rungs", "_signals", "_units"):
        read |= read_attributes(name)
    assert {"term_timeout", "scope", "shared_gpu", "stop_concurrency", "container_timeout"} <= read
    assert sorted(read - set(ReleaseOptions.__slots__) - {"replace", "as_dict"}) == []


def test_the_defaults_are_the_specs_and_the_object_is_read_only():
    opts = ReleaseOptions()
    flat, dummy = flat_params(dict((k, v.get("default")) for k, v in RELEASE_ARGS.items()))
    for name in ReleaseOptions.__slots__:
        if name not in ReleaseOptions.DERIVED and name in flat:
            assert getattr(opts, name) == flat[name], name
    assert (opts.shared_gpu, opts.stop_concurrency) == ("own", 4)
    try:
        opts.term_timeout = 1.0
    except AttributeError as exc:
        assert "read-only" in str(exc)
    else:
        raise AssertionError("ReleaseOptions took a write")
