"""Issue 22: the container rung's Proxmox API credentials under community.proxmox's names (api_host, api_user, ...,
with PROXMOX_* fallbacks in gpu_release's argument_spec) and the errors that name what is missing. The deprecated
proxmox_api dict is gone (issue 45): test_knobs.py shows the module refusing it."""
import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils._restart import ApiBackend, RestartError, api_credentials

NONE = dict.fromkeys(("api_host", "api_port", "api_user", "api_password", "api_token_id", "api_token_secret",
                      "validate_certs", "ca_path", "api_timeout"))


def params(**given):
    return dict(NONE, **given)


def test_no_host_means_pct_on_the_node():
    assert api_credentials(params()) is None
    assert api_credentials(params(api_user="root@pam", api_token_id="x")) is None   # a stray PROXMOX_USER alone


def test_token_credentials_with_defaults():
    got = api_credentials(params(api_host="pve1", api_user="gpuops@pve", api_token_id="release", api_token_secret="s"))
    assert got == {"host": "pve1", "port": 8006, "user": "gpuops@pve", "token_id": "release", "token_secret": "s",
                   "password": None, "validate_certs": True, "ca_path": None, "timeout": 10}


def test_password_port_certs_and_timeout_are_passed():
    got = api_credentials(params(api_host="pve1", api_port=443, api_user="root@pam", api_password="pw",
                                 validate_certs=False, ca_path="/ca.pem", api_timeout=30))
    assert (got["port"], got["password"], got["validate_certs"], got["ca_path"], got["timeout"]) == (
        443, "pw", False, "/ca.pem", 30)


@pytest.mark.parametrize("given, words", [
    (dict(api_host="pve1", api_token_id="t", api_token_secret="s"), "api_host pve1 needs api_user (or PROXMOX_USER)"),
    (dict(api_host="pve1", api_user="u@pve", api_token_id="t"), "needs api_token_id and api_token_secret"),
    (dict(api_host="pve1", api_user="u@pve"), "or api_password (PROXMOX_PASSWORD)"),
])
def test_what_is_missing_is_named(given, words):
    with pytest.raises(RestartError, match=words.replace("(", r"\(").replace(")", r"\)")):
        api_credentials(params(**given))


def test_a_container_the_api_does_not_list_names_vm_audit():
    """A token without VM.Audit sees no guest at all: the restart rung says so rather than 'no container'."""
    class Resources(object):
        @staticmethod
        def get(**query):
            return []

    class Cluster(object):
        resources = Resources()

    class Api(object):
        cluster = Cluster()
    backend = ApiBackend.__new__(ApiBackend)
    backend.api, backend.nodes = Api(), {}
    with pytest.raises(RestartError, match=r"lists no container 101: no such vmid .*lacks VM.Audit on /vms/101"):
        backend.node_of(101)
