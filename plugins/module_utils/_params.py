# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The modules' options: argument specs, their checks, and ReleaseOptions (private helper; glue layer).

One spec per option, and each default only here: READ_ARGS (how GPUs are read: gpu_info's top-level options,
gpu_release's advanced ones; documented in doc_fragments/_gpu.py READING), INFO_ARGS (gpu_info), RELEASE_ARGS
(gpu_release, with ADVANCED_ARGS and API_ARGS; API_ARGS documented in doc_fragments/_proxmox_api.py).

The glue layer sits above act: the modules and this file are the only code that sees an AnsibleModule (the check_*
functions take one and call its fail_json). It imports nothing from decide or act, so gpu_info's import chain stays
free of the release code.
"""

from __future__ import annotations

import copy
import math

from ansible.module_utils.basic import env_fallback, missing_required_lib

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps
from ansible_collections.gpuops.fleet.plugins.module_utils import _shm as shm
from ansible_collections.gpuops.fleet.plugins.module_utils._redact import compile_patterns
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import Protect, compile_regex

# How GPUs are read: top-level options of gpu_info, gpu_release's advanced ones.
READ_ARGS = dict(
    threshold_mib=dict(type="int", default=64),
    nvml_timeout=dict(type="float", default=5.0),
    redact=dict(type="list", elements="str", default=[], no_log=False),
    cmdline=dict(type="bool", default=True),
    reserved_floor_mib=dict(type="int"),
)
GPUS_ARG = dict(type="list", elements="str", default=[])

INFO_ARGS = dict(
    READ_ARGS,
    gpus=GPUS_ARG,
    shm_residue=dict(type="bool", default=True),
    shm_prefixes=dict(type="list", elements="str", default=[]),
    need_mib=dict(type="int"),
    need_fraction=dict(type="float"),
    health=dict(type="bool", default=True),
    device_access=dict(type="bool", default=True),
)

# gpu_release's advanced options: how it reads, waits and cleans up, given in the advanced dict only.
ADVANCED_ARGS = dict(
    READ_ARGS,
    verify_timeout=dict(type="float", default=30.0),
    lock_timeout=dict(type="float", default=60.0),
    timeout=dict(type="float", default=180.0),
    collateral_tolerance_mib=dict(type="int", default=640),
    reset_blockers=dict(type="str", choices=["refuse", "stop_services"], default="refuse"),
    reset_timeout=dict(type="float", default=120.0),
    container_timeout=dict(type="float", default=60.0),
    stop_found_units=dict(type="bool", default=False),
    stop_timeout=dict(type="float", default=60.0),
    stop_concurrency=dict(type="int", default=4),
    clean_shm=dict(type="bool", default=False),
    shm_prefixes=dict(type="list", elements="str", default=[]),
)

# The container rung's Proxmox API credentials, named as community.proxmox names them, with its PROXMOX_* fallbacks.
API_ARGS = dict(
    api_host=dict(type="str", fallback=(env_fallback, ["PROXMOX_HOST"])),
    api_port=dict(type="int", fallback=(env_fallback, ["PROXMOX_PORT"])),
    api_user=dict(type="str", fallback=(env_fallback, ["PROXMOX_USER"])),
    api_password=dict(type="str", no_log=True, fallback=(env_fallback, ["PROXMOX_PASSWORD"])),
    api_token_id=dict(type="str", no_log=False, fallback=(env_fallback, ["PROXMOX_TOKEN_ID"])),
    api_token_secret=dict(type="str", no_log=True, fallback=(env_fallback, ["PROXMOX_TOKEN_SECRET"])),
    validate_certs=dict(type="bool", fallback=(env_fallback, ["PROXMOX_VALIDATE_CERTS"])),
    ca_path=dict(type="path", fallback=(env_fallback, ["PROXMOX_CA_PATH"])),
    api_timeout=dict(type="int", fallback=(env_fallback, ["PROXMOX_API_TIMEOUT"])),
)

# gpu_release: the short public set, the advanced dict and the Proxmox API credentials.
RELEASE_ARGS = dict(
    API_ARGS,
    gpus=GPUS_ARG,
    match=dict(type="str"),
    protect=dict(type="list", elements="str", default=[]),
    containers=dict(type="list", elements="int", default=[]),
    host_processes=dict(type="bool", default=False),
    shared_gpu=dict(type="str", default="own", choices=["all", "own"]),
    term_timeout=dict(type="float", default=10.0),
    kill_timeout=dict(type="float", default=10.0),
    gpu_reset=dict(type="bool", default=False),
    container_restart=dict(type="bool", default=False),
    collateral=dict(type="str", default="refuse", choices=["refuse", "stop"]),
    advanced=dict(type="dict", default={}, apply_defaults=True, options=ADVANCED_ARGS),
)

RELEASE_PACKAGES = ("psutil", "nvidia-ml-py")   # in the order they are named when missing
INFO_PACKAGES = ("nvidia-ml-py",)               # read-only gpu_info needs nothing but nvidia-ml-py


def info_spec():
    """gpu_info's argument spec, a copy (AnsibleModule may change what it is given)."""
    return copy.deepcopy(INFO_ARGS)


def release_spec():
    """gpu_release's argument spec, a copy."""
    return copy.deepcopy(RELEASE_ARGS)


def flat_params(params):
    """gpu_release's options as one flat dict, each advanced one from the advanced dict (its default when not given);
    and how each is spelled, for error messages ({name: 'advanced.NAME'})."""
    flat = dict(params)
    advanced = flat.get("advanced") or {}
    labels = {}
    for name, spec in ADVANCED_ARGS.items():
        labels[name] = "advanced." + name
        flat[name] = advanced[name] if name in advanced else flat.get(name, spec.get("default"))
    return flat, labels


def check_numbers(module, names, minimum=0.0, strict=False, labels=None, params=None):
    """Fail the task, naming the option and value, on inf, nan, or a value below (or at, if strict) minimum.

    params: the values to check (module.params by default); labels: {name: how the user spelled it}
    (gpu_release's C(advanced.NAME)).
    """
    labels = labels or {}
    params = module.params if params is None else params
    for name in names:
        value = params.get(name)
        if value is None:
            continue
        label = labels.get(name, name)
        if isinstance(value, float) and not math.isfinite(value):
            module.fail_json(msg="%s must be a finite number, got %s" % (label, value))
        if value < minimum or (strict and value == minimum):
            bound = ("more than %g" % minimum) if strict else ("%g or more" % minimum)
            module.fail_json(msg="%s must be %s, got %s" % (label, bound, value))


def check_common_params(module, labels=None, params=None):
    """Fail the task on a bad READ_ARGS value; returns the compiled redact patterns."""
    params = module.params if params is None else params
    check_numbers(module, ["nvml_timeout"], strict=True, labels=labels, params=params)
    check_numbers(module, ["reserved_floor_mib", "threshold_mib"], labels=labels, params=params)
    try:
        patterns = compile_patterns(params["redact"])
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    return patterns


def check_shm_prefixes(module, params=None, label="shm_prefixes"):
    """Fail the task on a bad shm_prefixes entry; returns the (prefix, stack) pairs with the built-in ones."""
    params = module.params if params is None else params
    for prefix in params["shm_prefixes"]:
        if not prefix or "/" in prefix or "\0" in prefix:
            module.fail_json(msg="%s: each must be a file name's start, without /, got %r" % (label, prefix))
    return shm.prefixes_with(params["shm_prefixes"])


def check_need(module):
    """gpu_info: fail on a need that no GPU could mean, before anything is read."""
    need_mib, fraction = module.params["need_mib"], module.params["need_fraction"]
    if need_mib is not None and need_mib <= 0:
        module.fail_json(msg="need_mib must be a positive number of MiB, got %r" % need_mib)
    if fraction is not None and not 0 < fraction <= 1:
        module.fail_json(msg="need_fraction must be above 0 and at most 1, got %r" % fraction)


def check_release_params(module, params, labels):
    """gpu_release: fail the task on a bad number, redact pattern or shm prefix (params flat, labels as flat_params
    gives them); returns the compiled redact patterns."""
    check_numbers(module, ["term_timeout", "kill_timeout", "verify_timeout", "lock_timeout", "reset_timeout",
                           "collateral_tolerance_mib"], labels=labels, params=params)
    check_numbers(module, ["timeout", "container_timeout", "stop_timeout"], strict=True, labels=labels, params=params)
    check_numbers(module, ["stop_concurrency"], minimum=1, labels=labels, params=params)
    patterns = check_common_params(module, labels, params)
    check_shm_prefixes(module, params, labels["shm_prefixes"])
    return patterns


def validate_libraries(module, packages):
    """Fail the task in one line when one of packages (declared through _deps) did not import: ansible-core's
    missing_required_lib words plus how to install it here, with missing_library (the package) for the role."""
    dep = deps.missing(packages)
    if dep is None:
        return
    msg = "%s %s" % (missing_required_lib(dep.package, reason=dep.reason), deps.install_hint(dep.package, dep.import_name))
    module.fail_json(msg=msg, missing_library=dep.package, exception=repr(dep.error))


class ReleaseOptions(object):
    """How one release runs: read-only once built. The attributes are the options that _release.release() reads.

    Built by from_params() from the module's params; every default comes from RELEASE_ARGS (a field left out of the
    constructor takes its spec default, or None for the DERIVED values: match, protect, scope, restart_backend ...).
    """

    __slots__ = ("term_timeout", "kill_timeout", "verify_timeout", "gpu_reset", "reset_timeout", "lock_timeout",
                 "timeout", "collateral", "collateral_tolerance_mib", "reset_blockers", "match", "protect", "scope",
                 "shared_gpu", "container_restart", "container_timeout", "stop_found_units", "stop_timeout",
                 "stop_concurrency", "skipped_containers", "shm_prefixes", "restart_backend", "nvidia_smi")
    # not the option as given: compiled or built by from_params and the glue (None when left out)
    DERIVED = ("match", "protect", "scope", "skipped_containers", "shm_prefixes", "restart_backend", "nvidia_smi")

    def __init__(self, **values):
        unknown = sorted(set(values) - set(self.__slots__))
        if unknown:
            raise TypeError("ReleaseOptions has no option %s" % ", ".join(unknown))
        defaults, dummy = flat_params(dict((k, v.get("default")) for k, v in RELEASE_ARGS.items()))
        for name in self.__slots__:
            default = None if name in self.DERIVED else defaults.get(name)
            object.__setattr__(self, name, values[name] if name in values else default)

    def __setattr__(self, name, value):
        raise AttributeError("ReleaseOptions is read-only: use replace(%s=...)" % name)

    def __repr__(self):
        return "ReleaseOptions(%s)" % ", ".join("%s=%r" % item for item in sorted(self.as_dict().items()))

    @classmethod
    def from_params(cls, params, **derived):
        """From module.params (the advanced dict included, or already flat): the options as given, match and
        protect compiled (raises SelectorError on a bad one), the /dev/shm prefixes when clean_shm is on, and
        shared_gpu all with gpu_reset (a reset is for memory no process holds, which own never counts). derived
        (scope, skipped_containers, restart_backend ...) is taken as given."""
        flat, dummy = flat_params(params)
        values = dict((name, flat[name]) for name in cls.__slots__ if name in flat and name not in derived)
        if "match" not in derived:
            values["match"] = compile_regex(flat["match"], "match") if flat.get("match") is not None else None
        if "protect" not in derived:
            values["protect"] = Protect(flat.get("protect"))
        if "shm_prefixes" not in derived:
            values["shm_prefixes"] = shm.prefixes_with(flat["shm_prefixes"]) if flat.get("clean_shm") else None
        if flat.get("gpu_reset"):
            values["shared_gpu"] = "all"
        values.update(derived)
        return cls(**values)

    def replace(self, **changes):
        """A copy with changes."""
        values = self.as_dict()
        values.update(changes)
        return type(self)(**values)

    def as_dict(self):
        """{option: value}: the dict _release.release() takes today."""
        return dict((name, getattr(self, name)) for name in self.__slots__)
