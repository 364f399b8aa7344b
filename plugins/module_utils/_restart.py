# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The container rung: stop and start a Proxmox container from its node (private helper).

Through the Proxmox API (proxmoxer: status/stop, status/start, each task waited for) when
credentials are given, else `pct stop` / `pct start` on the node. No AnsibleModule here.
"""

from __future__ import annotations

import os
import subprocess
import time

from ansible_collections.gpuops.fleet.plugins.module_utils import _deps as deps
from ansible_collections.gpuops.fleet.plugins.module_utils import _helperproc as helperproc
from ansible_collections.gpuops.fleet.plugins.module_utils import _where as where

PCT_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
TASK_POLL_S = 0.25


class RestartError(Exception):
    pass


def find_pct():
    for directory in os.environ.get("PATH", "").split(os.pathsep) + list(PCT_DIRS):
        path = os.path.join(directory or ".", "pct")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


class PctBackend(object):
    """pct on this node; configs and HA resources read from /etc/pve."""

    name = "pct"

    def __init__(self, pct=None, conf_dir=None, ha_path=None):
        self.pct = pct or find_pct()
        self.conf_dir = conf_dir or where.pve_lxc_dir()
        self.ha_path = ha_path or where.pve_ha_resources()

    def lock_of(self, vmid):
        confs = where.container_configs(self.conf_dir) or {}
        conf = confs.get(str(vmid))
        if conf is None:
            raise RestartError("container %s has no config in %s on this node" % (vmid, self.conf_dir))
        return conf["keys"].get("lock")

    def ha_state(self, vmid):
        return where.ha_resources(self.ha_path).get(str(vmid))

    def _run(self, action, vmid, timeout):
        if self.pct is None:
            raise RestartError("pct not found in PATH or %s: is this a Proxmox VE node?" % ", ".join(PCT_DIRS))
        cmd = [self.pct, action, str(vmid)]
        started = time.monotonic()
        try:
            returncode, out = helperproc.run_bounded(cmd, timeout, env=dict(os.environ, LC_ALL="C"))
        except subprocess.TimeoutExpired:
            return {"task": " ".join(cmd), "ok": False, "seconds": round(time.monotonic() - started, 3),
                    "text": "did not return within %gs" % timeout}
        text = " ".join(out.split())[:400]
        return {"task": " ".join(cmd), "ok": returncode == 0, "seconds": round(time.monotonic() - started, 3),
                "text": text if returncode == 0 else "exit %d: %s" % (returncode, text)}

    def stop(self, vmid, timeout):
        return self._run("stop", vmid, timeout)

    def start(self, vmid, timeout):
        return self._run("start", vmid, timeout)

    def running(self, vmid, timeout):
        """True when `pct status` says running, False when stopped, None when it cannot tell."""
        done = self._run("status", vmid, timeout)
        words = done["text"].split() if done["ok"] else []
        return {"running": True, "stopped": False}.get(words[1]) if words[:1] == ["status:"] and len(words) > 1 else None


def load_proxmoxer():
    """proxmoxer's ProxmoxAPI, or None when its declared import failed. Imported only when the API is used (api_host),
    so that a release through pct never pays for proxmoxer and requests."""
    with deps.declare("proxmoxer", reason="for the container rung through the Proxmox API (api_host), on the node"):
        from proxmoxer import ProxmoxAPI
        return ProxmoxAPI
    return None


class ApiBackend(object):
    """The Proxmox REST API through proxmoxer's https backend."""

    name = "api"

    def __init__(self, api):
        ProxmoxAPI = load_proxmoxer()  # pylint: disable=invalid-name
        if ProxmoxAPI is None:
            raise RestartError("api_host needs the Python library proxmoxer (and requests) on the node: %s"
                               % deps.get("proxmoxer").error)
        kwargs = {"port": api.get("port") or 8006, "verify_ssl": api.get("ca_path") or api.get("validate_certs", True),
                  "timeout": api.get("timeout") or 10}
        if api.get("token_id"):
            kwargs.update(token_name=api["token_id"], token_value=api.get("token_secret"))
        else:
            kwargs.update(password=api.get("password"))
        try:
            self.api = ProxmoxAPI(api["host"], user=api["user"], backend="https", **kwargs)
        except Exception as exc:
            raise RestartError("the Proxmox API at %s refused the login: %s" % (api["host"], exc))
        self.nodes = {}

    def node_of(self, vmid):
        if str(vmid) not in self.nodes:
            for res in self.api.cluster.resources.get(type="vm"):
                if res.get("type") == "lxc":
                    self.nodes[str(res.get("vmid"))] = res.get("node")
        found = self.nodes.get(str(vmid))
        if found is None:
            raise RestartError("the Proxmox API lists no container %s: no such vmid (`pct list` on its node), or the "
                               "user or token lacks VM.Audit on /vms/%s (Proxmox hides what it may not see)"
                               % (vmid, vmid))
        return found

    def lock_of(self, vmid):
        return self.api.nodes(self.node_of(vmid)).lxc(vmid).config.get().get("lock")

    def ha_state(self, vmid):
        for res in self.api.cluster.ha.resources.get():
            if res.get("sid") == "ct:%s" % vmid:
                return res.get("state") or "started"
        return None

    def _task(self, action, vmid, timeout):
        where = self.api.nodes(self.node_of(vmid))
        started = time.monotonic()
        try:
            upid = getattr(where.lxc(vmid).status, action).post()
        except Exception as exc:
            return {"task": None, "ok": False, "seconds": round(time.monotonic() - started, 3), "text": str(exc)[:400]}
        while True:
            status = where.tasks(upid).status.get()
            if status.get("status") == "stopped":
                ok = status.get("exitstatus") == "OK"
                return {"task": upid, "ok": ok, "seconds": round(time.monotonic() - started, 3),
                        "text": status.get("exitstatus") or ""}
            if time.monotonic() - started >= timeout:
                return {"task": upid, "ok": False, "seconds": round(time.monotonic() - started, 3),
                        "text": "task still running after %gs" % timeout}
            time.sleep(TASK_POLL_S)

    def stop(self, vmid, timeout):
        return self._task("stop", vmid, timeout)

    def start(self, vmid, timeout):
        return self._task("start", vmid, timeout)

    def running(self, vmid, timeout):
        """True when the API says running, False when stopped, None when it cannot tell (timeout: the session's)."""
        try:
            status = self.api.nodes(self.node_of(vmid)).lxc(vmid).status.current.get().get("status")
        except Exception:  # pylint: disable=broad-except
            return None
        return {"running": True, "stopped": False}.get(status)


def api_credentials(params):
    """The container rung's API credentials from the module's options (community.proxmox's names), or None for pct
    on the node. Raises RestartError naming what is missing."""
    host = params.get("api_host")
    timeout = params.get("api_timeout") or 10
    if not host:
        return None
    if not params.get("api_user"):
        raise RestartError("api_host %s needs api_user (or PROXMOX_USER), USER@REALM" % host)
    if not params.get("api_password") and not (params.get("api_token_id") and params.get("api_token_secret")):
        raise RestartError("api_host %s needs api_token_id and api_token_secret (or PROXMOX_TOKEN_ID and "
                           "PROXMOX_TOKEN_SECRET), or api_password (PROXMOX_PASSWORD)" % host)
    validate = params.get("validate_certs")
    return {"host": host, "port": params.get("api_port") or 8006, "user": params["api_user"],
            "token_id": params.get("api_token_id"), "token_secret": params.get("api_token_secret"),
            "password": params.get("api_password"), "validate_certs": True if validate is None else validate,
            "ca_path": params.get("ca_path"), "timeout": timeout}


def backend_for(api):
    return ApiBackend(api) if api else PctBackend()


def refusal(backend, vmid):
    """Why this container may not be restarted (locked, managed by HA), or None."""
    try:
        lock = backend.lock_of(vmid)
        ha = backend.ha_state(vmid)
    except RestartError as exc:
        return str(exc)
    except Exception as exc:
        return "container %s: its config or HA state cannot be read (%s)" % (vmid, exc)
    if lock:
        return ("container %s is locked (%s): a backup, migration or snapshot is running; it is not restarted; "
                "wait for it to end" % (vmid, lock))
    if ha:
        return ("container %s is managed by HA (resource ct:%s, state %s): HA would start it again or fight the stop; "
                "it is not restarted; take it out of HA or use ha-manager" % (vmid, vmid, ha))
    return None
