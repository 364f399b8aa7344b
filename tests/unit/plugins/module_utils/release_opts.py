"""One way for the tests to build a release's options object (issue 46): attributes named as the keys of the
options dict that gpu_release passes to release(), each not given taken from the release's defaults."""
from types import SimpleNamespace

from ansible_collections.gpuops.fleet.plugins.module_utils._release import LEGACY_DEFAULTS


def release_opts(**given):
    return SimpleNamespace(**dict(LEGACY_DEFAULTS, **given))
