"""A small HTTPS server on 127.0.0.1 that stands in for the Proxmox VE API in the inventory's unit tests.

It answers from a function answer(method, path) -> (status, headers, body): a body of bytes goes as it is (HTML with
status 200, a proxy's page: text/html when it starts with "<"), anything else as PVE wraps it ({"data": body}). It
records every request (method, path, cookie, authorization, body) in `seen`. The certificate is the lab's
(lablib.pveapi.make_certificate), so these tests stay out of the tarball with the lab (galaxy.yml's build_ignore).
"""
import contextlib
import json
import os
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "lab")
if LAB not in sys.path:
    sys.path.insert(0, os.path.normpath(LAB))
from lablib.pveapi import make_certificate  # noqa: E402  pylint: disable=wrong-import-position,import-error


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
        payload = data if isinstance(data, bytes) else json.dumps({"data": data}).encode()
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Type", "text/html" if payload.startswith(b"<") else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve

    def log_message(self, *args):  # pylint: disable=arguments-differ
        pass


@contextlib.contextmanager
def https_apis(tmp_path):
    """(start, cert): start(answer) serves one more API on its own port; every one is shut down on the way out."""
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
    try:
        yield start, cert
    finally:
        for server in started:
            server.shutdown()
            server.server_close()
