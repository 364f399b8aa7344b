"""One way for the tests to build a release's options object (issue 46): _params.ReleaseOptions, whose defaults are
the module's argument spec's.

The engine's tests were written for a release of everything in scope, one unit stop at a time (shared_gpu all,
stop_concurrency 1): TEST_BASE says so once, and a test that wants the module's own defaults passes them."""
from ansible_collections.gpuops.fleet.plugins.module_utils import _release
from ansible_collections.gpuops.fleet.plugins.module_utils._holder import Holder
from ansible_collections.gpuops.fleet.plugins.module_utils._params import ReleaseOptions

TEST_BASE = dict(shared_gpu="all", stop_concurrency=1)


def release_opts(**given):
    return ReleaseOptions(**dict(TEST_BASE, **given))


def release(engine, targets, options, **kwargs):
    """_release.release with a test's options dict made a ReleaseOptions (an object is passed as it is)."""
    if isinstance(options, dict):
        options = release_opts(**options)
    outcome = _release.release(engine, targets, options, **kwargs)
    assert holders_in(outcome[2]) == [], "a read-only Holder in the result: ansible-core 2.16-2.18's remove_values fails"
    return outcome


def holders_in(value, path="result"):
    """Where a Holder sits in a module result (its no-log pass rebuilds each dict as type(value)() and fills it)."""
    if isinstance(value, Holder):
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in holders_in(v, "%s.%s" % (path, k))]
    if isinstance(value, (list, tuple)):
        return [p for n, v in enumerate(value) for p in holders_in(v, "%s[%d]" % (path, n))]
    return []
