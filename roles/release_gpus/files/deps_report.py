"""Import psutil and pynvml with this Python and print what was found, as one JSON line (the role's report of a
dependency install): each distribution's name, version and the folder it imports from, and the interpreter. Fails (an ImportError's
traceback, exit 1) when one does not import. Standard library only, Python 3.6 and later."""
import json
import os
import sys

import psutil
import pynvml


def folder(module):
    """The folder the module was imported from: site-packages for a package (psutil/) and for a module (pynvml.py)."""
    path = os.path.dirname(os.path.abspath(module.__file__))
    return os.path.dirname(path) if os.path.basename(module.__file__).startswith("__init__.") else path


def version(distribution, module):
    try:
        from importlib import metadata
        return metadata.version(distribution)
    except Exception:  # Python < 3.8, or an OS package without metadata under that name
        return str(getattr(module, "__version__", "") or "unknown")


print(json.dumps({"python": sys.executable, "packages": [
    {"name": "psutil", "version": version("psutil", psutil), "path": folder(psutil)},
    {"name": "nvidia-ml-py", "version": version("nvidia-ml-py", pynvml),
     "path": folder(pynvml)}]}))
