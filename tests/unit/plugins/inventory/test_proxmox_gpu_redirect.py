"""gpuops.fleet.proxmox_gpu never follows a redirect to another origin (issue 41, attack 7).

Two small HTTPS servers on 127.0.0.1: the first is the API the inventory names, and answers the login or a GET with a
redirect to the second, which records every request. The ticket (the PVEAuthCookie), the password and the API token
must never reach the second; the plugin fails with one line naming itself and the redirect's target.
"""

import pytest

from ansible.errors import AnsibleParserError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, inventory_loader

init_plugin_loader()

from _https_api import https_apis  # noqa: E402  pylint: disable=wrong-import-position,import-error

PASSWORD, TICKET, TOKEN = "pw-S3cret", "PVE:root@pam:TICKET-S3cret", "tok-S3cret"


@pytest.fixture(name="servers")
def fixture_servers(tmp_path):
    with https_apis(tmp_path) as pair:
        yield pair


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
