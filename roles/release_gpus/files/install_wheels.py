"""Install wheels from a folder with this Python, offline.

python3 install_wheels.py WHEEL_DIR BREAK_SYSTEM(0|1) PACKAGE...
Uses pip --no-index when pip exists; otherwise unpacks the wheels into
purelib (wheels are zip files made to be unpacked). Prints what it did.
"""
import glob
import os
import platform
import subprocess
import sys
import sysconfig
import zipfile

wheel_dir, break_system, packages = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]


def with_pip():
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", wheel_dir,
           "--disable-pip-version-check", "--no-input", "--no-warn-script-location"]
    if break_system:
        cmd.append("--break-system-packages")
    subprocess.check_call(cmd + packages, stdout=sys.stderr)
    print("pip --no-index installed " + " ".join(packages))


def pick(package):
    # psutil-7.2.2-cp36-abi3-manylinux..._x86_64.whl: keep this machine's or a pure wheel.
    prefix = package.replace("-", "_").lower() + "-"
    found = [w for w in glob.glob(os.path.join(wheel_dir, "*.whl"))
             if os.path.basename(w).lower().startswith(prefix)]
    fits = [w for w in found if w.endswith("-any.whl") or platform.machine() in os.path.basename(w)]
    if not fits:
        sys.exit("no wheel for %s (%s) in %s" % (package, platform.machine(), wheel_dir))
    return sorted(fits)[-1]


def unpack():
    site = sysconfig.get_paths()["purelib"]
    os.makedirs(site, exist_ok=True)
    for package in packages:
        wheel = pick(package)
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                parts = member.split("/")
                if ".data" in parts[0]:
                    # NAME.data/purelib/x -> x; scripts and headers are not needed here.
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                target = os.path.join(site, *parts)
                if member.endswith("/"):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with archive.open(member) as src, open(target, "wb") as dst:
                    dst.write(src.read())
        print("unpacked %s into %s" % (os.path.basename(wheel), site))


try:
    import pip  # noqa: F401 pylint: disable=unused-import
    HAVE_PIP = True
except ImportError:
    HAVE_PIP = False
if HAVE_PIP:
    with_pip()
else:
    unpack()
