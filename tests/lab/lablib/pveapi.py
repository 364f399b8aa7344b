"""A lab stand-in for the Proxmox VE REST API (https://ADDR:8006/api2/json), stdlib only.

Run as `python3 -I pveapi.py STATE` (labctl up does it). It reads the lab's files at every request,
so what it answers is the live state: containers are the `nodes/NODE/lxc/VMID.conf` files (a moved
config is a migrated container), running or not from their init pid. Start/stop go through the
same code as the lab's `pct`. Auth like PVE: a ticket from POST /access/ticket (cookie
`PVEAuthCookie`, plus `CSRFPreventionToken` on writes) or `Authorization: PVEAPIToken=root@pam!lab=SECRET`.
A second token, `root@pam!noaudit` (secret in STATE/api/token-noaudit), has no privilege: like a
privilege-separated PVE token without an ACL, it sees no guest and may read nothing.

Also like PVE: GET .../config merges a `[pve:pending]` section unless `current=1`; guests in a pool
(STATE/api/pools.json, {"POOL": [VMID, ...]}) carry `pool` in /cluster/resources.

Faults for tests: STATE/api/faults.json, read at each request, is a list of
{"path": REGEX (searched in the path after /api2/json, query included), "method": "GET", "status": CODE,
"message": TEXT, "delay": SECONDS}: the first matching entry delays the answer, then answers CODE with TEXT
(or normally, without "status").
"""

import hashlib
import http.server
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from lablib import container  # noqa: E402
from lablib.common import LabError, pid_alive, read_json, write_file  # noqa: E402

PORT = 8006
USER = "root@pam"
TOKEN_ID = "lab"
NOAUDIT_TOKEN_ID = "noaudit"
API_PREFIX = "/api2/json"


# ----- files the lab writes for the API (STATE/api/)
def api_dir(state):
    return os.path.join(state, "api")


def make_credentials(state, address):
    """Self-signed certificate for ADDRESS, root@pam's password and the API token secret."""
    folder = api_dir(state)
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o700)
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    make_certificate(cert, key, address)
    write_file(os.path.join(folder, "password"), secrets.token_urlsafe(18) + "\n", 0o600)
    write_file(os.path.join(folder, "token"), secrets.token_hex(16) + "\n", 0o600)
    write_file(os.path.join(folder, "token-noaudit"), secrets.token_hex(16) + "\n", 0o600)
    info = {"address": address, "port": PORT, "url": api_url(address), "user": USER, "token_id": TOKEN_ID, "ca": cert}
    write_file(os.path.join(folder, "api.json"), json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def make_certificate(cert, key, address):
    """openssl req -x509 (a self-signed CA:TRUE leaf, so ca_path can trust it); python cryptography as a fallback."""
    openssl = _which("openssl")
    if openssl:
        proc = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                               "-nodes", "-keyout", key, "-out", cert, "-days", "30", "-subj", "/CN=%s" % address,
                               "-addext", "subjectAltName=IP:%s" % address,
                               "-addext", "basicConstraints=critical,CA:TRUE"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
        if proc.returncode:
            raise LabError("openssl req failed: %s" % proc.stdout.decode(errors="replace").strip()[-500:])
    else:
        _python_certificate(cert, key, address)
    os.chmod(key, 0o600)


def _python_certificate(cert, key, address):
    try:
        import datetime
        import ipaddress
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise LabError("the lab API needs openssl (apt-get install openssl) or python3-cryptography")
    pkey = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(pkey.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
           .not_valid_after(now + datetime.timedelta(days=30))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
           .sign(pkey, hashes.SHA256()))
    with open(key, "wb") as f:
        f.write(pkey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    with open(cert, "wb") as f:
        f.write(crt.public_bytes(serialization.Encoding.PEM))


def _which(name):
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(":") + ["/usr/bin", "/bin"]:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


def read_secret(state, name):
    with open(os.path.join(api_dir(state), name)) as f:
        return f.read().strip()


def api_url(address):
    return "https://%s:%d/api2/json" % (address, PORT)


# ----- the lab as PVE sees it
class PveError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def parse_conf(text):
    """Proxmox container config text: ({key: value}, [[lxc.key, value], ...]); pending and snapshot sections left out."""
    return parse_sections(text)[:2]


def parse_sections(text):
    """({key: value}, [[lxc.key, value], ...], {pending key: value}); snapshot sections left out."""
    keys, raw, pending = {}, [], {}
    section = keys
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            if line.lower() != "[pve:pending]":
                break
            section = pending
            continue
        if not line or line.startswith("#") or ":" not in line:
            continue
        key, value = (part.strip() for part in line.split(":", 1))
        if key.startswith("lxc.") and section is keys:
            raw.append([key, value])
        else:
            section[key] = value
    return keys, raw, pending


def parse_ha(text):
    """/etc/pve/ha/resources.cfg (section config: `ct: 101` then tab-indented `key value`) as a list of dicts."""
    resources, current = [], None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line[0] in " \t" and current is not None:
            key, dummy, value = line.strip().partition(" ")
            current[key] = value.strip()
            continue
        kind, sep, name = line.partition(":")
        if sep:
            current = {"sid": "%s:%s" % (kind.strip(), name.strip()), "type": kind.strip()}
            resources.append(current)
    return resources


def format_ha(resources):
    out = ""
    for r in resources:
        out += "%s: %s\n" % (r["type"], r["sid"].split(":", 1)[1])
        out += "".join("\t%s %s\n" % (k, v) for k, v in r.items() if k not in ("sid", "type"))
        out += "\n"
    return out


class LabView:
    def __init__(self, state):
        self.state = state

    @property
    def cfg(self):
        cfg = read_json(os.path.join(self.state, "labctl.json"))
        if cfg is None:
            raise PveError(500, "lab is not up")
        return cfg

    def node_dir(self, node):
        return os.path.join(self.state, "nodes", node)

    def nodes(self):
        return sorted(self.cfg["nodes"].items(), key=lambda kv: int(kv[0][3:]))

    def node_online(self, ncfg):
        return pid_alive(ncfg.get("sshd_pid"))

    def check_node(self, node):
        if node not in self.cfg["nodes"]:
            raise PveError(500, "hostname lookup '%s' failed - failed to get address info for: %s: Name or service not known"
                           % (node, node))

    def vmids(self, node):
        folder = os.path.join(self.node_dir(node), "lxc")
        try:
            return sorted(int(f[:-5]) for f in os.listdir(folder) if f.endswith(".conf") and f[:-5].isdigit())
        except FileNotFoundError:
            return []

    def record(self, node, vmid):
        self.check_node(node)
        ct = container.load(self.node_dir(node), str(vmid))
        if ct is None:
            raise PveError(500, "Configuration file 'nodes/%s/lxc/%s.conf' does not exist" % (node, vmid))
        return ct

    def conf_text(self, node, vmid):
        self.record(node, vmid)
        with open(container.conf_path(self.node_dir(node), vmid)) as f:
            return f.read()

    def config(self, node, vmid, current=False):
        """Like PVE's load_current_config: pending values taken in, pending deletions applied, unless current."""
        text = self.conf_text(node, vmid)
        keys, raw, pending = parse_sections(text)
        data = dict(keys)
        if not current:
            data.update((k, v) for k, v in pending.items() if k != "delete")
            for key in pending.get("delete", "").split(","):
                data.pop(key.strip().lstrip("!"), None)
        for key in ("cores", "memory", "swap", "unprivileged"):
            if key in data and data[key].isdigit():
                data[key] = int(data[key])
        if raw:
            data["lxc"] = raw
        data["digest"] = hashlib.sha1(text.encode()).hexdigest()
        return data

    def ha_resources(self):
        """/etc/pve/ha/resources.cfg (STATE/pve/ha/resources.cfg) as GET /cluster/ha/resources answers it."""
        try:
            with open(os.path.join(self.state, "pve", "ha", "resources.cfg")) as f:
                text = f.read()
        except FileNotFoundError:
            text = ""
        digest = hashlib.sha1(text.encode()).hexdigest()
        return [dict(r, state=r.get("state", "started"), digest=digest) for r in parse_ha(text)]

    def lock_of(self, node, vmid):
        return parse_conf(self.conf_text(node, vmid))[0].get("lock")

    def current(self, node, vmid):
        ct = self.record(node, vmid)
        keys = parse_conf(self.conf_text(node, vmid))[0]
        running = container.is_running(ct)
        ha = next((r for r in self.ha_resources() if r["sid"] == "ct:%s" % vmid), None)
        out = {"vmid": int(vmid), "name": keys.get("hostname", "ct%s" % vmid), "type": "lxc",
               "status": "running" if running else "stopped", "uptime": 0, "cpus": int(keys.get("cores", 1)),
               "maxmem": int(keys.get("memory", 512)) * 1024 * 1024, "maxswap": 0, "maxdisk": 0,
               "ha": {"managed": 1, "state": ha["state"]} if ha else {"managed": 0}}
        if keys.get("lock"):
            out["lock"] = keys["lock"]
        if keys.get("tags"):
            out["tags"] = keys["tags"]
        if running:
            out["pid"] = ct["init_host_pid"]
            out["uptime"] = uptime_of(ct["init_host_pid"])
        return out

    def pools(self):
        """{vmid: pool} from STATE/api/pools.json."""
        pools = read_json(os.path.join(api_dir(self.state), "pools.json")) or {}
        return {int(vmid): pool for pool, vmids in pools.items() for vmid in vmids}

    def resources(self, kind):
        out = []
        pools = self.pools()
        if kind in (None, "node"):
            for node, ncfg in self.nodes():
                out.append({"id": "node/%s" % node, "type": "node", "node": node,
                            "status": "online" if self.node_online(ncfg) else "offline"})
        if kind in (None, "vm"):
            for node, dummy in self.nodes():
                for vmid in self.vmids(node):
                    try:
                        cur = self.current(node, vmid)
                    except PveError:
                        continue  # moved away while we looked
                    item = {"id": "lxc/%d" % vmid, "type": "lxc", "node": node, "vmid": vmid, "name": cur["name"],
                            "status": cur["status"], "template": 0, "uptime": cur["uptime"],
                            "maxmem": cur["maxmem"], "maxcpu": cur["cpus"]}
                    if cur.get("tags"):
                        item["tags"] = cur["tags"]
                    if vmid in pools:
                        item["pool"] = pools[vmid]
                    out.append(item)
        return out

    def cluster_status(self):
        nodes = self.nodes()
        out = [{"type": "cluster", "id": "cluster", "name": "gpuops-lab-%s" % self.cfg["rid"], "nodes": len(nodes),
                "quorate": 1, "version": len(nodes)}]
        for k, (node, ncfg) in enumerate(nodes, 1):
            out.append({"type": "node", "id": "node/%s" % node, "name": node, "ip": ncfg["address"], "nodeid": k,
                        "online": 1 if self.node_online(ncfg) else 0, "local": 1 if k == 1 else 0, "level": ""})
        return out


def stop_timeout(params):
    """Seconds a stop task waits for lxc-stop: the call's `timeout`, else LAB_PCT_STOP_TIMEOUT, else 10 (as pct)."""
    for value in (params.get("timeout"), os.environ.get("LAB_PCT_STOP_TIMEOUT")):
        try:
            if value not in (None, "") and float(value) > 0:
                return float(value)
        except ValueError:
            raise PveError(400, "Parameter verification failed.")
    return 10.0


def uptime_of(pid):
    """Seconds since pid started, from /proc (0 when gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            boot_seconds = float(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return 0
    return max(0, int(boot_seconds - start_ticks / os.sysconf("SC_CLK_TCK")))


# ----- tasks (UPIDs)
class Tasks:
    TYPES = {"start": "vzstart", "stop": "vzstop", "shutdown": "vzshutdown", "reboot": "vzreboot",
             "migrate": "vzmigrate"}

    def __init__(self, view):
        self.view = view
        self.lock = threading.Lock()
        self.tasks = {}

    def run(self, node, vmid, action, user, params=None):
        ct = self.view.record(node, vmid)
        running = container.is_running(ct)
        params = params or {}
        # Like PVE: these checks die before a task is forked (HTTP 500).
        if action == "start" and running:
            raise PveError(500, "CT %s already running" % vmid)
        if action in ("stop", "shutdown", "reboot") and not running:
            raise PveError(500, "CT %s not running" % vmid)
        if action == "stop":
            params = dict(params, stop_timeout=stop_timeout(params))
        lock = self.view.lock_of(node, vmid)
        if lock and action in ("start", "stop", "shutdown", "reboot") and params.get("skiplock") not in ("1", "true"):
            raise PveError(500, "CT is locked (%s)" % lock)  # PVE::AbstractConfig::check_lock
        if action == "migrate":
            target = params.get("target")
            if not target:
                raise PveError(400, "Parameter verification failed.")
            if target == node:
                raise PveError(500, "target is local node.")
            self.view.check_node(target)
            if running and params.get("restart") not in ("1", "true"):
                raise PveError(500, "CT is running - use online migration or restart mode")
        now = int(time.time())
        with self.lock:
            fields = (node, os.getpid(), len(self.tasks) + 1, now, self.TYPES[action], vmid, user)
            upid = "UPID:%s:%08X:%08X:%08X:%s:%s:%s:" % fields
            self.tasks[upid] = {"upid": upid, "node": node, "pid": os.getpid(), "pstart": len(self.tasks) + 1,
                                "starttime": now, "type": self.TYPES[action], "id": str(vmid), "user": user,
                                "status": "running"}
        worker = threading.Thread(target=self._work, args=(upid, node, str(vmid), action, params), daemon=True)
        worker.start()
        return upid

    def _work(self, upid, node, vmid, action, params):
        node_dir = self.view.node_dir(node)
        try:
            if action == "migrate":
                self._migrate(vmid, params["target"])
            if action == "stop":
                # Like PVE::LXC::vm_stop: lxc-stop --kill under a timeout. A frozen (D state) task keeps the
                # container up: the task fails instead of hanging (nothing is thawed behind Proxmox's back).
                try:
                    container.stop(node_dir, vmid, thaw_first=False, timeout=params["stop_timeout"])
                except container.StopTimeout as exc:
                    raise LabError("%s - container did not stop" % exc)
            if action in ("shutdown", "reboot"):
                container.stop(node_dir, vmid, graceful_timeout=10.0)
            if action in ("start", "reboot"):
                container.start(node_dir, vmid)
            exitstatus = "OK"
        except (LabError, OSError) as exc:
            exitstatus = " ".join(str(exc).split()) or exc.__class__.__name__
        with self.lock:
            self.tasks[upid].update(status="stopped", exitstatus=exitstatus, endtime=int(time.time()))

    def _migrate(self, vmid, target):
        """Through labctl's own migrate (stop, move the config, start there), on this lab."""
        from lablib.lab import Lab
        os.environ["LAB_ID"] = self.view.cfg["rid"]
        Lab().migrate(vmid, target)

    def status(self, node, upid):
        with self.lock:
            task = self.tasks.get(upid)
            if task is None or task["node"] != node:
                raise PveError(500, "no such task")
            return dict(task)


# ----- HTTP
class Auth:
    def __init__(self, state):
        self.state = state
        self.tickets = {}  # ticket -> (user, CSRF token, issued)
        self.lock = threading.Lock()

    def password(self):
        return read_secret(self.state, "password")

    def token(self):
        return read_secret(self.state, "token")

    def login(self, username, password):
        if username != USER or not secrets.compare_digest(password or "", self.password()):
            return None
        ticket = "PVE:%s:%08X::%s" % (USER, int(time.time()), secrets.token_urlsafe(32))
        csrf = "%08X:%s" % (int(time.time()), secrets.token_urlsafe(24))
        with self.lock:
            self.tickets[ticket] = (USER, csrf, time.time())
        return {"ticket": ticket, "CSRFPreventionToken": csrf, "username": USER, "cap": {}}

    def check(self, headers, write):
        """The authenticated user, or PveError 401 (no or bad credentials)."""
        auth = headers.get("Authorization", "")
        if auth.startswith("PVEAPIToken="):
            match = re.match(r"^PVEAPIToken=([^!=]+)!([^=]+)[=:](.+)$", auth)
            if match and match.group(1) == USER and match.group(2) == TOKEN_ID \
                    and secrets.compare_digest(match.group(3), self.token()):
                return "%s!%s" % (USER, TOKEN_ID)
            if match and match.group(1) == USER and match.group(2) == NOAUDIT_TOKEN_ID \
                    and os.path.exists(os.path.join(api_dir(self.state), "token-noaudit")) \
                    and secrets.compare_digest(match.group(3), read_secret(self.state, "token-noaudit")):
                return "%s!%s" % (USER, NOAUDIT_TOKEN_ID)
            raise PveError(401, "invalid token value!")
        ticket = None
        for part in headers.get("Cookie", "").split(";"):
            name, sep, value = part.strip().partition("=")
            if sep and name == "PVEAuthCookie":
                ticket = urllib.parse.unquote(value)
        if ticket is None:
            raise PveError(401, "No ticket")
        with self.lock:
            entry = self.tickets.get(ticket)
        if entry is None or time.time() - entry[2] > 7200:
            raise PveError(401, "invalid PVE ticket")
        if write and headers.get("CSRFPreventionToken") != entry[1]:
            raise PveError(401, "Permission denied - invalid csrf token")
        return entry[0]


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "pve-api-daemon/3.0"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

    def _reply(self, code, data=None, reason=None):
        body = json.dumps({"data": data}).encode()
        self.send_response(code, reason)
        self.send_header("Content-Type", "application/json;charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=0")
        self.end_headers()
        self.wfile.write(body)

    def _params(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        if body and self.headers.get("Content-Type", "").startswith("application/json"):
            try:
                return {k: str(v) for k, v in json.loads(body).items()}
            except (ValueError, AttributeError):
                raise PveError(400, "Parameter verification failed.")
        return {k: v[-1] for k, v in urllib.parse.parse_qs(body, keep_blank_values=True).items()}

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def _handle(self, method):
        try:
            url = urllib.parse.urlsplit(self.path)
            if not url.path.startswith(API_PREFIX + "/"):
                raise PveError(501, "Method '%s %s' not implemented" % (method, url.path))
            path = url.path[len(API_PREFIX):].rstrip("/")
            query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
            params = self._params() if method in ("POST", "PUT") else {}
            params.update(query)
            if method == "POST" and path == "/access/ticket":
                data = self.server.auth.login(params.get("username"), params.get("password"))
                if data is None:
                    time.sleep(0.2)  # PVE delays failed logins (by more)
                    raise PveError(401, "authentication failure")
                return self._reply(200, data)
            user = self.server.auth.check(self.headers, method != "GET")
            self._fault(method, path + ("?" + url.query if url.query else ""))
            if user.endswith("!" + NOAUDIT_TOKEN_ID):
                return self._reply(200, self.route_unprivileged(method, path, params))
            self._reply(200, self.route(method, path, params, user))
        except PveError as exc:
            self._reply(exc.code, None, exc.message)
        except (LabError, OSError, ValueError, KeyError) as exc:
            self._reply(500, None, "lab API error: %s" % exc)

    def _fault(self, method, path):
        """The first matching entry of STATE/api/faults.json: wait its delay, then raise its status."""
        faults = read_json(os.path.join(api_dir(self.server.view.state), "faults.json")) or []
        for fault in faults:
            if fault.get("method", "GET") == method and re.search(fault["path"], path):
                time.sleep(float(fault.get("delay") or 0))
                if fault.get("status"):
                    raise PveError(int(fault["status"]), fault.get("message", "lab fault"))
                return

    def route_unprivileged(self, method, path, params):
        """What a user without any privilege gets: PVE filters lists by permission and refuses the rest."""
        if method == "GET" and path == "/cluster/resources":
            return []
        if method == "GET" and path == "/version":
            return {"version": "8.4.1", "release": "8.4", "repoid": "gpuopslab"}
        parts = path.strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "nodes" and parts[2] == "lxc":
            raise PveError(403, "Permission check failed (/vms/%s, VM.Audit)" % parts[3])
        raise PveError(403, "Permission check failed (/, Sys.Audit)")

    def route(self, method, path, params, user):
        view, parts = self.server.view, path.strip("/").split("/")
        if method == "GET":
            if path == "/version":
                return {"version": "8.4.1", "release": "8.4", "repoid": "gpuopslab"}
            if path == "/cluster/resources":
                return view.resources(params.get("type"))
            if path == "/cluster/status":
                return view.cluster_status()
            if path == "/cluster/ha/resources":
                return view.ha_resources()
            if len(parts) == 4 and parts[:3] == ["cluster", "ha", "resources"]:
                sid = urllib.parse.unquote(parts[3])
                sid = sid if ":" in sid else "ct:" + sid
                found = [r for r in view.ha_resources() if r["sid"] == sid]
                if not found:
                    raise PveError(500, "no such resource '%s'" % sid)
                return found[0]
            if path == "/nodes":
                return [{"node": n, "status": "online" if view.node_online(c) else "offline", "type": "node"}
                        for n, c in view.nodes()]
            if len(parts) == 3 and parts[0] == "nodes" and parts[2] == "lxc":
                view.check_node(parts[1])
                return [view.current(parts[1], v) for v in view.vmids(parts[1])]
            if len(parts) == 5 and parts[0] == "nodes" and parts[2] == "lxc" and parts[4] == "config":
                return view.config(parts[1], self._vmid(parts[3]), params.get("current") in ("1", "true"))
            if len(parts) == 6 and parts[:1] + parts[2:3] + parts[4:] == ["nodes", "lxc", "status", "current"]:
                return view.current(parts[1], self._vmid(parts[3]))
            if len(parts) == 5 and parts[0] == "nodes" and parts[2] == "tasks" and parts[4] == "status":
                return self.server.tasks.status(parts[1], urllib.parse.unquote(parts[3]))
        if method == "POST" and len(parts) == 6 and parts[0] == "nodes" and parts[2] == "lxc" \
                and parts[4] == "status" and parts[5] in Tasks.TYPES and parts[5] != "migrate":
            return self.server.tasks.run(parts[1], self._vmid(parts[3]), parts[5], user.split("!")[0], params)
        if method == "POST" and len(parts) == 5 and parts[0] == "nodes" and parts[2] == "lxc" and parts[4] == "migrate":
            return self.server.tasks.run(parts[1], self._vmid(parts[3]), "migrate", user.split("!")[0], params)
        raise PveError(501, "Method '%s %s%s' not implemented" % (method, API_PREFIX, path))

    @staticmethod
    def _vmid(text):
        if not text.isdigit():
            raise PveError(400, "Parameter verification failed.")
        return int(text)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def make_server(state, address, port=PORT):
    view = LabView(state)
    server = Server((address, port), Handler)
    server.view, server.auth, server.tasks = view, Auth(state), Tasks(view)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(os.path.join(api_dir(state), "cert.pem"), os.path.join(api_dir(state), "key.pem"))
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    return server


def serve(state, address, port=PORT):
    server = make_server(state, address, port)
    threading.Thread(target=_reap_children, daemon=True).start()
    server.serve_forever()


def _reap_children():
    """Container launchers started by start/reboot tasks are our children: reap them when they exit."""
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            pid = 0
        if not pid:
            time.sleep(0.5)


def main(argv):
    state = argv[0]
    serve(state, read_json(os.path.join(api_dir(state), "api.json"))["address"])


if __name__ == "__main__":
    main(sys.argv[1:])
