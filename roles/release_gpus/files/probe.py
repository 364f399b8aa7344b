"""Look at the target and stop what would respawn the GPU workload, in one run; print one JSON line.

Run with the target's Python: python3 probe.py SPEC_JSON. Standard library only, so it runs before
psutil and nvidia-ml-py are installed. SPEC_JSON (all keys optional):

  supervisorctl, supervisor_config, programs, services, docker, commands, timeout, poll, check, refuse

It reports the interpreter, the missing libraries and the service tools, then stops, in this order,
the systemd units, supervisord programs, docker containers and stop commands it is given, each
bounded by timeout. Check mode (check: true) stops nothing and lists what it would stop. What does
not exist is listed in skipped, never a failure. A failure (a stop that did not work) is printed as
{"error": ...} beside what was done so far, and the exit status is 1. A non-empty refuse (the role's
check of its own variables) is such an error before anything is stopped.
"""
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import time

SUP_STATES = ("STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED", "FATAL", "UNKNOWN")
SUP_RUNNING = ("RUNNING", "STARTING", "BACKOFF", "STOPPING")
SUP_LINE = re.compile(r"^(\S+)\s+(%s)\b" % "|".join(SUP_STATES))


class StopError(Exception):
    pass


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
    if not tool:
        return ""
    path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    path += os.pathsep + os.pathsep.join(["/usr/local/sbin", "/usr/local/bin", os.path.dirname(sys.executable)])
    return shutil.which(tool, path=path) or ""


def run(argv, timeout, env=None):
    """(rc, stdout, stderr); a timeout is a StopError naming the command."""
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                              timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise StopError("%s did not finish within %s s" % (" ".join(argv), timeout)) from None
    except OSError as exc:
        raise StopError("%s: %s" % (argv[0], exc)) from None
    return proc.returncode, proc.stdout, proc.stderr


def first_line(*texts):
    for text in texts:
        for line in (text or "").splitlines():
            if line.strip():
                return line.strip()
    return ""


def ancestors(pid):
    # This process and its parents carry the pattern in their argv: never count them.
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open("/proc/%d/stat" % pid) as handle:
                pid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def alive_pids(pidfile, pattern):
    mine = ancestors(os.getpid())
    alive = []
    if pidfile:
        try:
            with open(pidfile) as handle:
                pid = int(handle.read().split()[0])
            os.kill(pid, 0)
            alive.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    if pattern:
        regex = re.compile(pattern)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in mine:
                continue
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as handle:
                    cmdline = handle.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            except OSError:
                continue
            # A zombie has an empty cmdline and is gone for every practical purpose.
            if cmdline and regex.search(cmdline):
                alive.append(int(entry))
    return sorted(set(alive))


class Stopper:
    def __init__(self, spec, tools, systemd):
        self.spec = spec
        self.tools = tools
        self.systemd = systemd
        self.timeout = float(spec.get("timeout", 60))
        self.check = bool(spec.get("check"))
        self.done, self.skipped, self.would = [], [], []

    def stopped(self, what):
        (self.would if self.check else self.done).append(what)

    def services(self):
        units = self.spec.get("services") or []
        if not units:
            return
        if not self.systemd:
            self.skipped += ["systemd unit %s: systemd does not run here" % u for u in units]
            return
        systemctl = self.tools.get("systemctl") or "systemctl"
        for unit in units:
            rc, out, err = run([systemctl, "show", "--property=LoadState,ActiveState", "--", unit], self.timeout)
            props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
            if rc != 0 and not props:
                raise StopError("systemctl show %s failed: %s" % (unit, first_line(err, out)))
            if props.get("LoadState") == "not-found":
                self.skipped.append("systemd unit %s: not found" % unit)
                continue
            if props.get("ActiveState") in ("inactive", "failed"):
                continue
            if not self.check:
                rc, out, err = run([systemctl, "stop", "--", unit], self.timeout)
                if rc != 0:
                    raise StopError("systemctl stop %s failed (%d): %s" % (unit, rc, first_line(err, out)))
            self.stopped("systemd unit " + unit)

    def programs(self):
        programs = self.spec.get("programs") or []
        if not programs:
            return
        tool = self.tools.get("supervisorctl")
        if not tool:
            self.skipped += ["supervisord program %s: %s not found" % (p, self.spec.get("supervisorctl") or "supervisorctl")
                             for p in programs]
            return
        argv = [tool] + (["-c", self.spec["supervisor_config"]] if self.spec.get("supervisor_config") else [])
        env = dict(os.environ, LC_ALL="C")
        rc, out, err = run(argv + ["status"], self.timeout, env)
        # rc 3: some program is not running; rc 4: no such program or no supervisord.
        if rc not in (0, 3, 4):
            raise StopError("supervisorctl status failed (%d): %s" % (rc, first_line(err, out)))
        pairs = [m.groups() for m in (SUP_LINE.match(line) for line in out.splitlines()) if m]
        known = [name for name, _state in pairs]
        running = [name for name, state in pairs if state in SUP_RUNNING]
        reachable = bool(pairs) or rc == 0
        for program in programs:
            prefix = re.compile("^" + re.escape(program) + "(:|$)")
            if not any(prefix.match(name) for name in known):
                why = "no such program" if reachable else "supervisord not reachable (%s)" % (first_line(out, err) or "no output")
                self.skipped.append("supervisord program %s: %s" % (program, why))
                continue
            if not any(prefix.match(name) for name in running):
                continue
            if not self.check:
                target = program if program in known else program + ":*"
                rc, out, err = run(argv + ["stop", target], self.timeout, env)
                if rc != 0 and "not running" not in out:
                    raise StopError("supervisorctl stop %s failed (%d): %s" % (target, rc, first_line(out, err)))
            self.stopped("supervisord program " + program)

    def docker(self):
        containers = self.spec.get("docker") or []
        if not containers:
            return
        tool = self.tools.get("docker")
        if not tool:
            self.skipped += ["docker container %s: docker not found" % c for c in containers]
            return
        for name in containers:
            rc, out, err = run([tool, "inspect", "--type=container", "--format={{.State.Running}}", name], self.timeout)
            if rc != 0:
                self.skipped.append("docker container %s: %s" % (name, first_line(err) or "not found"))
                continue
            if out.strip() != "true":
                continue
            if not self.check:
                rc, out, err = run([tool, "stop", "--time=%d" % int(self.timeout), name], self.timeout + 15)
                if rc != 0:
                    raise StopError("docker stop %s failed (%d): %s" % (name, rc, first_line(err, out)))
            self.stopped("docker container " + name)

    def validate(self):
        if self.spec.get("refuse"):  # the role's own check of its variables, before anything is stopped
            raise StopError(self.spec["refuse"])
        for item in self.spec.get("commands") or []:
            if not isinstance(item, dict) or "name" not in item or "command" not in item or not (
                    "pidfile" in item or "pattern" in item):
                raise StopError("release_gpus_advanced.stop_commands entries need name, command and a pidfile or a pattern"
                                " to wait on (the command runs only while that is alive): %s" % (item,))

    def commands(self):
        items = self.spec.get("commands") or []
        poll = max(float(self.spec.get("poll", 1)), 0.05)
        for item in items:
            pidfile, pattern = item.get("pidfile") or "", item.get("pattern") or ""
            pids = alive_pids(pidfile, pattern)
            if not pids:
                continue
            if self.check:
                self.would.append("stop command %s, for pids %s" % (item["name"], ", ".join(str(p) for p in pids)))
                continue
            timeout = float(item.get("timeout", self.timeout))
            command = item["command"]
            argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(a) for a in command]
            rc, out, err = run(argv, timeout)
            if rc != 0:
                raise StopError("stop command %s failed (%d): %s" % (item["name"], rc, first_line(err, out)))
            self.done.append("stop command " + item["name"])
            deadline = time.monotonic() + timeout
            while alive_pids(pidfile, pattern):
                if time.monotonic() >= deadline:
                    raise StopError("stop command %s ran, but pids %s were still alive after %s s" % (
                        item["name"], ", ".join(str(p) for p in alive_pids(pidfile, pattern)), timeout))
                time.sleep(poll)


def main():
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].startswith("{") else {
        "supervisorctl": sys.argv[1] if len(sys.argv) > 1 else "supervisorctl"}
    stdlib = sysconfig.get_path("stdlib") or ""
    systemd = os.path.isdir("/run/systemd/system")
    tools = {
        "systemctl": which("systemctl"),
        "supervisorctl": which(spec.get("supervisorctl") or "supervisorctl"),
        "docker": which("docker"),
    }
    result = {
        "python": sys.executable,
        "python_version": "%d.%d" % sys.version_info[:2],
        "machine": platform.machine(),
        "venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
        "externally_managed": os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED")),
        "has_pip": importlib.util.find_spec("pip") is not None,
        "missing": missing_modules(),
        "systemd": systemd,
        "tools": tools,
    }
    stopper = Stopper(spec, tools, systemd)
    rc = 0
    try:
        for step in (stopper.validate, stopper.services, stopper.programs, stopper.docker, stopper.commands):
            step()
    except StopError as exc:
        result["error"] = str(exc)
        rc = 1
    result.update(stopped=stopper.done, skipped=stopper.skipped, would_stop=stopper.would)
    print(json.dumps(result))
    if rc:
        sys.stderr.write(result["error"] + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
