# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Optional Python libraries, declared where they are imported (private helper; read layer, imports nothing of ours).

A file that needs an optional library imports it inside a declaration:

    psutil = None
    with deps.declare("psutil", reason="..."):
        import psutil

A failed import is recorded, not raised; the module glue (_params.validate_libraries) later fails the task in one
line naming what is missing and how to install it. One declaration per library: psutil where the signals are sent,
nvidia-ml-py in _nvml, proxmoxer in _restart.
"""

from __future__ import annotations

import sys

OS_PACKAGES = {"psutil": "python3-psutil", "nvidia-ml-py": "python3-pynvml", "proxmoxer": "python3-proxmoxer"}  # Debian's
ROLE_INSTALLS = ("psutil", "nvidia-ml-py")   # what the release_gpus role installs on a target (deps_pip_packages)

_DECLARED = {}   # package -> Dependency, in the order first declared


class Dependency(object):
    """One optional library: its package name, import name, why it is needed and the import's error (None: found)."""

    __slots__ = ("package", "import_name", "reason", "error", "tried")

    def __init__(self, package, import_name, reason):
        self.package = package
        self.import_name = import_name
        self.reason = reason
        self.error = None
        self.tried = False

    @property
    def found(self):
        return self.tried and self.error is None

    def __enter__(self):
        self.tried = True
        self.error = None
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None or not issubclass(exc_type, Exception):
            return False        # found; or a KeyboardInterrupt, SystemExit: never swallowed
        self.error = exc        # ImportError, or a broken install that raises something else
        return True


def declare(package, import_name=None, reason=None):
    """The declaration of package (a context manager around its import); declared again, the same record."""
    dep = _DECLARED.get(package)
    if dep is None:
        dep = _DECLARED[package] = Dependency(package, import_name or package, reason)
    return dep


def get(package):
    """The Dependency declared for package, or None when no imported file declares it."""
    return _DECLARED.get(package)


def missing(packages):
    """The first of packages whose declared import failed (a Dependency), or None. A package never declared counts
    as missing: the file that imports it was not loaded, which is a bug of the caller."""
    for package in packages:
        dep = _DECLARED.get(package)
        if dep is None:
            dep = Dependency(package, package, None)
            dep.error = ImportError("%s was never declared (no file that imports it was loaded)" % package)
            return dep
        if not dep.found:
            return dep
    return None


def install_hint(package, import_name):
    """One line: how to install package for this Python (pip, a virtual environment, the OS package, the role)."""
    python = sys.executable or "python3"
    role = " (or run the gpuops.fleet.release_gpus role, which installs it)" if package in ROLE_INSTALLS else ""
    wheels = ", or let the role push wheels (release_gpus_advanced.wheel_dir)" if package in ROLE_INSTALLS else ""
    return ("The Python library %s (import %s) is missing for %s on this host: install it with "
            "'%s -m pip install %s'%s; where that Python is externally managed (PEP 668: pip says "
            "externally-managed-environment), install it into a virtual environment and point ansible_python_interpreter "
            "at its python, or install the OS package (%s)%s"
            % (package, import_name, python, python, package, role,
               OS_PACKAGES.get(package, "python3-" + import_name), wheels))
