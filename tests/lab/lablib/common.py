"""Lab identity, paths and small helpers shared by labctl, ctinit and the node stand-ins."""

import errno
import hashlib
import json
import os
import re
import time

LAB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(LAB_DIR))
STATE_ROOT = "/run/gpuops-lab"
DEFAULT_PCT_DELAY = 0.3


class LabError(Exception):
    """An error labctl reports in one line."""


def run_id(env=None, repo=REPO):
    env = os.environ if env is None else env
    rid = env.get("LAB_ID")
    if rid:
        if not all(c.isalnum() or c in "-_" for c in rid) or len(rid) > 32:
            raise LabError("LAB_ID must be 1-32 letters, digits, '-' or '_': %r" % rid)
        return rid
    return hashlib.sha1(os.path.realpath(repo).encode()).hexdigest()[:8]


def clone_lab_id(name, repo=REPO):
    """A test or demo lab name made unique to this clone, so runs from two clones never collide."""
    return "%s-%s" % (name, hashlib.sha1(os.path.realpath(repo).encode()).hexdigest()[:6])


def address_digits(rid):
    """Four hex digits for the address: RID itself when it is hex, else sha1(RID)."""
    if len(rid) >= 4 and all(c in "0123456789abcdef" for c in rid.lower()):
        return rid[:4]
    return hashlib.sha1(rid.encode()).hexdigest()[:4]


def node_address(rid, node_number):
    """127.A.B.N from the run id (tests/lab/README.md, "What a lab is")."""
    digits = address_digits(rid)
    return "127.%d.%d.%d" % (1 + int(digits[0:2], 16) % 254, int(digits[2:4], 16), node_number)


def state_dir(rid):
    return os.path.join(STATE_ROOT, rid)


def node_name(k):
    return "pve%d" % k


def vmid_for(k, j):
    return k * 100 + j


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def write_json(path, data):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def write_file(path, text, mode=0o644):
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def proc_state(pid):
    """State letter of a host pid, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid):
    """True when pid exists and is not a zombie."""
    if not pid:
        return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(predicate, timeout, interval=0.02, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise LabError("timed out after %.1fs waiting for %s" % (timeout, what))
        time.sleep(interval)


def parse_mountinfo(text):
    """Rows of mountinfo text as dicts (root, mount_point, fstype, source, options)."""
    rows = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf = left.split()
        rf = right.split()
        rows.append({"root": _unescape(lf[3]), "mount_point": _unescape(lf[4]),
                     "fstype": rf[0], "source": _unescape(rf[1]), "options": rf[2] if len(rf) > 2 else ""})
    return rows


def mountinfo(pid="self"):
    with open("/proc/%s/mountinfo" % pid) as f:
        return parse_mountinfo(f.read())


def _unescape(text):
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    if "\\" not in text:
        return text
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def cgroup2_mount():
    for row in mountinfo():
        if row["fstype"] == "cgroup2":
            return row["mount_point"]
    return None


def freezer_mount():
    for row in mountinfo():
        if row["fstype"] == "cgroup" and "freezer" in row["options"].split(","):
            return row["mount_point"]
    return None


def nspid_map(pidns_inode):
    """{pid inside namespace: host pid} for processes whose pid namespace is pidns_inode."""
    result = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat("/proc/%s/ns/pid" % name).st_ino != pidns_inode:
                continue
            with open("/proc/%s/status" % name) as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        result[int(line.split()[-1])] = int(name)
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return result


def rmtree_quiet(path):
    """rm -rf that never crosses a mount point (a left-over bind mount stays, loudly)."""
    if not os.path.lexists(path):
        return
    dev = os.lstat(path).st_dev
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            _unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                _unlink(full)
            elif os.lstat(full).st_dev == dev:
                try:
                    os.rmdir(full)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        raise
    os.rmdir(path)


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
