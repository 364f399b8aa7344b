"""Report what the release_gpus role needs to know about the target, as one JSON line.

Run with the target's Python: python3 probe.py SUPERVISORCTL. Changes nothing.
"""
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig


def missing_modules():
    missing = []
    for module, package in (("psutil", "psutil"), ("pynvml", "nvidia-ml-py")):
        try:
            importlib.import_module(module)
        except Exception:  # a broken install counts as missing
            missing.append(package)
    return missing


def which(tool):
    # pct exec runs with PATH=/sbin:/bin:/usr/sbin:/usr/bin; also look in /usr/local
    # and beside the interpreter (a venv's bin may hold supervisorctl).
    path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    path += os.pathsep + os.pathsep.join(["/usr/local/sbin", "/usr/local/bin", os.path.dirname(sys.executable)])
    return shutil.which(tool, path=path) or ""


stdlib = sysconfig.get_path("stdlib") or ""
print(json.dumps({
    "python": sys.executable,
    "python_version": "%d.%d" % sys.version_info[:2],
    "machine": platform.machine(),
    "venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
    "externally_managed": os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED")),
    "has_pip": importlib.util.find_spec("pip") is not None,
    "missing": missing_modules(),
    "systemd": os.path.isdir("/run/systemd/system"),
    "tools": {
        "systemctl": which("systemctl"),
        "supervisorctl": which(sys.argv[1] if len(sys.argv) > 1 else "supervisorctl"),
        "docker": which("docker"),
    },
}))
