"""gpuops.fleet.proxmox_gpu never follows a redirect to another origin (issue 41, attack 7).

Two small HTTPS servers on 127.0.0.1: the first is the API the inventory names, and answers the login or a GET with a
redirect to the second, which records every request. The ticket (the PVEAuthCookie), the password and the API token
must never reach the second; the plugin fails with one line naming itself and the redirect's target.
"""
import json
import os
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ansible.errors import AnsibleParserError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

init_plugin_loader()

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "lab")
if LAB not in sys.path:
    sys.path.insert(0, os.path.normpath(LAB))
from lablib.pveapi import make_certificate  # noqa: E402  pylint: disable=wrong-import-position,import-error

PASSWORD, TICKET, TOKEN = "pw-S3cret", "PVE:root@pam:TICKET-S3cret", "tok-S3cret"


class Api(ThreadingHTTPServer):
    """One HTTPS server: answers from a function of (method, path), records each request."""
    daemon_threads = True

    def __init__(self, context, answer):
        super().__init__(("127.0.0.1", 0), Handler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.answer, self.seen = answer, []
        self.url = "https://127.0.0.1:%d" % self.server_address[1]


class Handler(BaseHTTPRequestHandler):
    def _serve(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        self.server.seen.append({"method": self.command, "path": self.path, "cookie": self.headers.get("Cookie") or "",
                                 "authorization": self.headers.get("Authorization") or "", "body": body})
        status, headers, data = self.server.answer(self.command, self.path)
        payload = json.dumps({"data": data}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve

    def log_message(self, *args):  # pylint: disable=arguments-differ
        pass


@pytest.fixture(name="servers")
def fixture_servers(tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    make_certificate(cert, key, "127.0.0.1")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    started = []

    def start(answer):
        server = Api(context, answer)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server
    yield start, cert
    for server in started:
        server.shutdown()
        server.server_close()


def elsewhere(method, path):
    """The other host: a believable answer, so that only the assertions below can catch a followed redirect."""
    del path
    if method == "POST":
        return 200, {}, {"ticket": TICKET, "CSRFPreventionToken": "csrf", "username": "root@pam"}
    return 200, {}, []


def run_inventory(tmp_path, url, cert, auth):
    path = tmp_path / "fleet.proxmox_gpu.yml"
    path.write_text("plugin: gpuops.fleet.proxmox_gpu\nurl: %s\nuser: root@pam\nca_path: %s\ntimeout: 5\n%s"
                    % (url, cert, auth))
    plugin = inventory_loader.get("gpuops.fleet.proxmox_gpu")
    plugin.parse(InventoryData(), DataLoader(), str(path), cache=False)


@pytest.mark.parametrize("mode, where", [("password", "get"), ("password", "login"), ("token", "get")])
def test_a_redirect_to_another_host_is_refused_and_carries_nothing_there(servers, tmp_path, mode, where):
    start, cert = servers
    other = start(elsewhere)
    target = other.url + "/api2/json/elsewhere"

    def api(method, path):
        if path.endswith("/access/ticket") and where == "get":
            return 200, {}, {"ticket": TICKET, "CSRFPreventionToken": "csrf", "username": "root@pam"}
        code = 307 if method == "POST" else 302
        return code, {"Location": target}, None
    first = start(api)
    auth = "password: %s\n" % PASSWORD if mode == "password" else "token_id: ci\ntoken_secret: %s\n" % TOKEN
    try:
        run_inventory(tmp_path, first.url, cert, auth)
        error = None
    except Exception as exc:  # pylint: disable=broad-except  # checked below, after what reached the other host
        error = exc
    carried = [r for r in other.seen if TICKET in r["cookie"] or PASSWORD in r["body"] or TOKEN in r["authorization"]]
    assert not carried, carried
    assert not other.seen, other.seen          # nothing at all reaches the other host
    assert first.seen, "the API was never asked"
    assert isinstance(error, AnsibleParserError), repr(error)
    text = str(error)
    assert "\n" not in text.strip() and text.startswith("proxmox_gpu: ") and target in text, text
    assert "redirect" in text, text
