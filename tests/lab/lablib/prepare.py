"""Build what every lab bring-up needs and keeps (.lab/venv, .lab/venv-bare, the NVML stand-in), once, ahead of
the first `labctl up`: `make venv` runs it beside pip. Stdlib only; `labctl up` builds them itself when missing."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lablib.common import LabError  # noqa: E402  (the lab's package, from its folder)
from lablib.lab import built_library, ensure_venvs  # noqa: E402


def main():
    try:
        ensure_venvs()
        built_library()
    except LabError as exc:
        sys.stderr.write("lab prepare: %s\n" % exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
