# Copyright (c) 2026 gpuops maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
name: proxmox_gpu
short_description: Running Proxmox VE LXC containers and their NVIDIA GPUs, from the Proxmox VE API
version_added: 0.1.0
author: gpuops (@gpuops)
description:
  - Lists the LXC containers of a Proxmox VE cluster with one call to C(GET /cluster/resources?type=vm), finds
    each node's address with C(GET /cluster/status), and reads each selected container's running config
    (C(GET /nodes/NODE/lxc/VMID/config?current=1), so a pending change not yet applied is not taken for it) for the
    NVIDIA devices passed into it.
  - A redirect to another origin (scheme, host or port) than O(url)'s fails the inventory, naming the redirect's target,
    before anything is sent there, since a redirect would carry the ticket (C(PVEAuthCookie)) of O(password) to it, and a
    redirected login the password. The same holds for an API token.
  - A container whose config cannot be read (it is migrating, its node just dropped out, the request timed out, the
    user may not read it) is left out with a warning; the other containers are still listed.
  - An empty result is a warning that names the likely cause (a user or token without C(VM.Audit) sees no guests).
  - Every container becomes a host reached with the C(gpuops.fleet.pct) connection. C(ansible_host) is the address of the
    node that hosts the container at the time of the run, so a migrated container is found on its new node and
    C(pct exec) never fails with "vmid not on this node".
  - "Host variables: C(ansible_connection), C(ansible_host), C(ansible_pct_vmid) and C(proxmox_vmid) (the vmid, for
    the C(gpuops.fleet.pct) connection and as community.proxmox names it), C(proxmox_node), C(proxmox_name),
    C(proxmox_status), C(proxmox_tags), C(proxmox_tags_parsed), C(proxmox_pool), C(proxmox_gpu_devices),
    C(proxmox_gpu_minors), C(proxmox_gpu_container_devices) and C(proxmox_gpu_denied_devices)."
  - "C(proxmox_tags) and C(proxmox_tags_parsed) are as community.proxmox's inventory sets them: C(proxmox_tags) is
    Proxmox's C(tags) string as given (V(gpu;sglang)), C(proxmox_tags_parsed) the list of its tags split at C(;) or
    C(,), each stripped, in Proxmox's order (V([gpu, sglang])). A container without tags has neither. In 0.1.0
    C(proxmox_tags) was the list: a O(keyed_groups) entry with C(key: proxmox_tags) now makes one group of the whole
    string; use C(key: proxmox_tags_parsed). C(pct_vmid) is no longer set."
  - "C(proxmox_gpu_devices) are the node's C(/dev/nvidiaN) devices passed in, by minor: from C(devN) keys (any option
    order, C(path=) or not; not with C(deny-write)) and from C(lxc.mount.entry) lines by their source, when the
    container's C(lxc.cgroup2.devices.allow) (or C(lxc.cgroup.devices.allow)) rules, read in order with the C(deny)
    ones, let it read and write that device. C(/dev/nvidia3 dev/nvidia0) is minor 3, seen in the container as
    C(/dev/nvidia0): C(proxmox_gpu_container_devices) lists those paths in the same order. A mount entry that the rules
    do not allow is in C(proxmox_gpu_denied_devices), not in C(proxmox_gpu_devices)."
  - "Groups: C(gpu_containers) (containers with at least one C(/dev/nvidiaN)) and C(proxmox_node_NODE), plus those of
    O(groups) and O(keyed_groups)."
  - "With O(node_hosts) on (the default), each Proxmox VE node is a host too, in group C(proxmox_nodes), reached with
    plain C(ssh): C(ansible_connection=ssh), C(ansible_host) the node's C(ip) in C(GET /cluster/status) (its name when
    it has none), C(proxmox_node) (the node's name), C(proxmox_node_online) and C(proxmox_node_vmids) (the vmids of
    the containers this inventory lists on that node). Node hosts are named by O(node_hostname) and get the variables
    of O(node_compose); O(compose), O(groups) and O(keyed_groups) apply to containers only. A node host is in no
    C(proxmox_node_NODE) group: those hold the node's containers, which are reached through C(pct exec)."
  - "Every container then also gets C(proxmox_node_host), the inventory host name of the node host that runs it now,
    so C(hostvars[proxmox_node_host]) reaches its node (a migrated container points to its new node at the next run,
    with the cache on too)."
  - "Node hosts are the nodes in C(GET /cluster/status) (only those of O(nodes) when it is set), whether they run a
    listed container or not. A node that C(/cluster/status) shows offline is left out, with a warning: SSH to it would
    fail, and PVE lists no guest of an offline node as running. It is kept (with C(proxmox_node_online=false)) only
    when a listed container still names it as its node, so that C(proxmox_node_host) always names a host."
  - Values from the API are marked unsafe, so they are never templated.
  - With the inventory cache on, only the container configs are taken from the cache. The guest list, the nodes and
    their addresses are read at every run, and a cached config is used only for the same vmid, node and name, started at
    the same time, so a migrated container is reached on its new node and a reused vmid is read again.
  - The inventory file name must end with C(proxmox_gpu.yml) or C(proxmox_gpu.yaml).
  - Uses the C(https) backend of proxmoxer, with a ticket (O(user) and O(password)) or an API token
    (O(user), O(token_id) and O(token_secret)).
requirements:
  - proxmoxer >= 2.0
  - requests
extends_documentation_fragment:
  - ansible.builtin.constructed
  - ansible.builtin.inventory_cache
options:
  plugin:
    description: Marks this file as a source for this plugin.
    type: str
    required: true
    choices: [gpuops.fleet.proxmox_gpu]
  url:
    description:
      - URL of the Proxmox VE API of any node of the cluster, for example V(https://pve1.example.org:8006).
      - The port defaults to 8006; a trailing C(/api2/json) is accepted.
    type: str
    required: true
    env:
      - name: PROXMOX_URL
  user:
    description: User with realm, for example V(root@pam) or V(ansible@pve). It needs C(VM.Audit) and C(Sys.Audit).
    type: str
    required: true
    env:
      - name: PROXMOX_USER
  password:
    description: Password of O(user), to get a ticket. Give either this, or O(token_id) and O(token_secret).
    type: str
    env:
      - name: PROXMOX_PASSWORD
  token_id:
    description: API token id of O(user), the part after C(!) in C(root@pam!ansible).
    type: str
    env:
      - name: PROXMOX_TOKEN_ID
  token_secret:
    description: Secret of the API token O(token_id).
    type: str
    env:
      - name: PROXMOX_TOKEN_SECRET
  validate_certs:
    description:
      - Check the API's TLS certificate.
      - Rather than turning this off for a self-signed certificate, trust it with O(ca_path).
      - A real boolean only, V(true) or V(false) (or Ansible's other boolean spellings V(yes)/V(no), V(on)/V(off),
        V(1)/V(0), in the file or in E(PROXMOX_VALIDATE_CERTS)). Any other value, such as V(maybe) or an empty
        E(PROXMOX_VALIDATE_CERTS), fails the inventory naming the option before any request; ansible-core alone would
        read it as false. The same holds for every boolean option of this plugin.
    type: bool
    default: true
    env:
      - name: PROXMOX_VALIDATE_CERTS
  ca_path:
    description:
      - CA bundle (PEM) to check the API's certificate against, instead of the system's.
      - On Proxmox VE the cluster's own CA is C(/etc/pve/pve-root-ca.pem).
      - Used only when O(validate_certs) is true. A path that does not exist, or cannot be read, fails the inventory
        naming it, before any request.
    type: path
    env:
      - name: PROXMOX_CA_PATH
  timeout:
    description: Seconds to wait for each API request.
    type: int
    default: 10
  tags:
    description:
      - Keep only containers that carry at least one of these Proxmox tags.
      - An empty list keeps every container.
    type: list
    elements: str
    default: []
  statuses:
    description:
      - Keep only containers in one of these states.
      - Add V(stopped) to list stopped containers too (for their GPU assignments; tasks cannot reach them).
    type: list
    elements: str
    choices: [running, stopped]
    default: [running]
  nodes:
    description: Keep only containers on these nodes. An empty list keeps every node.
    type: list
    elements: str
    default: []
  pools:
    description: Keep only containers in one of these resource pools. An empty list keeps every container.
    type: list
    elements: str
    default: []
  names:
    description:
      - Keep only containers whose Proxmox name matches one of these shell patterns (V(sglang-*), V(ct10?)).
      - An empty list keeps every name.
    type: list
    elements: str
    default: []
  hostname:
    description:
      - A template for the inventory host name, as in community.proxmox's inventory.
      - Its variables are the fields of the container's C(/cluster/resources) entry, such as C(name), C(vmid), C(node),
        C(status), C(tags) and C(pool); for example V({{ node }}-{{ vmid }}).
      - Without it the host is the container's name; a container without a name is C(ct<vmid>), as is one whose
        name from this template is empty (with a warning).
      - Two containers that get one host name, or one that gets the host name of a node host or of a host from
        another inventory source, fail the inventory with one line naming both, never one taking the other's host
        (and its tasks). Set this template (V({{ name }}-{{ vmid }})) where names repeat across nodes.
    type: str
  node_hosts:
    description:
      - Add each Proxmox VE node as a host of group C(proxmox_nodes), reached with plain C(ssh), and give every
        container C(proxmox_node_host).
      - Set it to V(false) for an inventory of containers only (no C(proxmox_nodes) group, no C(proxmox_node_host)).
    type: bool
    default: true
  node_hostname:
    description:
      - A template for the inventory host name of a node host.
      - Its variables are the fields of the node's C(GET /cluster/status) entry, such as C(name), C(ip), C(nodeid),
        C(online) and C(local); for example V(pve-{{ name }}).
      - Without it the host is the node's name. A name that is empty or already taken by another node or another
        source becomes C(node_<name>), with a warning; one taken by a container fails (see O(hostname)).
    type: str
  node_compose:
    description:
      - Variables of node hosts, from Jinja2 expressions, as O(compose) does for containers; for example the SSH user,
        key or Python interpreter of the nodes.
      - The expressions see the node host's variables (C(ansible_host), C(proxmox_node), C(proxmox_node_online),
        C(proxmox_node_vmids)). O(strict) applies as for O(compose).
    type: dict
    default: {}
"""

EXAMPLES = r"""
# gpu.proxmox_gpu.yml: every running container, with an API token (its secret from PROXMOX_TOKEN_SECRET)
plugin: gpuops.fleet.proxmox_gpu
url: https://pve1.example.org:8006
user: ansible@pve
token_id: inventory
ca_path: /etc/ssl/certs/pve-root-ca.pem

# gpu.proxmox_gpu.yml: only containers tagged gpu, ticket login (password from PROXMOX_PASSWORD),
# extra groups and variables
plugin: gpuops.fleet.proxmox_gpu
url: https://pve1.example.org:8006
user: root@pam
tags: [gpu]
compose:
  ansible_user: "'root'"
  gpu_count: proxmox_gpu_minors | length
groups:
  multi_gpu: proxmox_gpu_minors | length > 1
keyed_groups:
  - key: proxmox_tags_parsed
    prefix: tag
# ansible-inventory -i gpu.proxmox_gpu.yml --graph
#   @gpu_containers, @proxmox_node_pve1, @proxmox_nodes, @multi_gpu, @tag_gpu ...

# gpu.proxmox_gpu.yml: node hosts named pve-NODE, as root with a given key, for the node-side view
# (ansible-playbook -i gpu.proxmox_gpu.yml playbooks/gpu_info.yml -e gpu_status_hosts=proxmox_nodes);
# each container's proxmox_node_host names its node host (pve-pve1, ...)
plugin: gpuops.fleet.proxmox_gpu
url: https://pve1.example.org:8006
user: ansible@pve
token_id: inventory
node_hostname: "pve-{{ name }}"
node_compose:
  ansible_user: "'root'"
  ansible_ssh_private_key_file: "'~/.ssh/pve_nodes'"
  ansible_python_interpreter: "'/usr/bin/python3'"

# gpu.proxmox_gpu.yml: running and stopped containers of pool ml on pve1 and pve2, named NODE-VMID;
# no node hosts (node_hosts: false)
plugin: gpuops.fleet.proxmox_gpu
url: https://pve1.example.org:8006
user: ansible@pve
token_id: inventory
statuses: [running, stopped]
pools: [ml]
nodes: [pve1, pve2]
names: ["sglang-*", "vllm-*"]
hostname: "{{ node }}-{{ vmid }}"
node_hosts: false
"""

import fnmatch
import os
import re
import time

from ansible.errors import AnsibleError, AnsibleParserError
from ansible.module_utils.common.text.converters import to_native
from ansible.module_utils.six.moves.urllib.parse import urljoin, urlsplit
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable, Constructable, to_safe_group_name
from ansible.utils.unsafe_proxy import wrap_var

from ansible_collections.gpuops.fleet.plugins.module_utils._pveconf import NVIDIA_DEV, gpu_passthrough
from ansible_collections.gpuops.fleet.plugins.plugin_utils._booleans import loose_booleans, refusal

try:
    import requests  # proxmoxer's https backend calls sys.exit() when requests is missing: check first
    import proxmoxer
    from proxmoxer import ProxmoxAPI
    from proxmoxer.backends.https import ProxmoxHTTPAuthBase
    from proxmoxer.core import AuthenticationError, ResourceException
    HAS_PROXMOXER = True
    PROXMOXER_IMPORT_ERROR = None
except ImportError as exc:
    HAS_PROXMOXER = False
    PROXMOXER_IMPORT_ERROR = exc
    ProxmoxHTTPAuthBase = object

DEFAULT_PORT = 8006
CACHE_FORMAT = 2
NODES_GROUP = 'proxmox_nodes'
START_TOLERANCE_S = 20  # /cluster/resources uptimes come from pvestatd, refreshed about every 10 s


def split_tags(text):
    """Proxmox tags ('gpu;sglang', also ',' or ' ' separated) as a list."""
    return [tag for tag in re.split(r'[;, ]+', str(text or '')) if tag]


def tag_vars(tags):
    """proxmox_tags and proxmox_tags_parsed as community.proxmox's inventory sets them: the tags string as Proxmox
    gives it (left out when empty), and its tags split at ';' or ',', each stripped, in order (left out when the string
    is blank)."""
    if not tags:
        return {}
    found = {'proxmox_tags': str(tags)}
    if str(tags).strip():
        found['proxmox_tags_parsed'] = [tag.strip() for tag in str(tags).strip().replace(',', ';').split(';')]
    return found


def gpu_devices(config):
    """The node's /dev/nvidiaN paths a container can use, by minor."""
    return [dev['device'] for dev in gpu_passthrough(config) if dev['usable']]


def api_endpoint(url):
    """(host, port) from the url option; accepts a trailing /api2/json and a missing scheme."""
    parts = urlsplit(url if '://' in url else 'https://' + url)
    if parts.scheme != 'https':
        raise AnsibleParserError('proxmox_gpu: url must be https://HOST[:PORT], got %r' % url)
    if not parts.hostname:
        raise AnsibleParserError('proxmox_gpu: no host in url %r' % url)
    return parts.hostname, parts.port or DEFAULT_PORT


def node_online(item):
    """Whether a /cluster/status node entry says the node is online (an entry without the field counts as online)."""
    online = item.get('online')
    if online is None:
        return True
    try:
        return bool(int(online))
    except (TypeError, ValueError):
        return str(online).lower() in ('true', 'yes')


def started_at(guest, now):
    """When a running guest started (from its uptime), or None."""
    try:
        uptime = int(guest.get('uptime') or 0)
    except (TypeError, ValueError):
        return None
    return int(now) - uptime if guest.get('status') == 'running' and uptime > 0 else None


class ConfigUnreadable(Exception):
    """One container's config could not be read; the others still can."""


class RedirectRefused(AnsibleParserError):
    """The API answered with a redirect to another origin: nothing is sent there, and the whole inventory fails."""


class NotTheApi(AnsibleParserError):
    """The url answered with something that is not the Proxmox VE API's JSON: the whole inventory fails."""


def not_json(api_url, request, body):
    """One line for an answer that is not JSON: the plugin, the request, and the start of what came back."""
    text = ' '.join(to_native(body[:60] if isinstance(body, bytes) else str(body)[:60], errors='replace').split())
    return NotTheApi('proxmox_gpu: the Proxmox VE API at %s answered %s with something that is not JSON (%r...); is url '
                     'the API of a Proxmox VE node (https://HOST:8006), not a web page or a proxy\'s?' % (api_url, request, text))


def origin(url):
    """(scheme, host, port) of a URL: where a ticket or a token may go."""
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or '').lower(), parts.port or {'https': 443, 'http': 80}.get(parts.scheme)


def refuse_redirects_elsewhere(session, api_url):
    """A response hook on a requests session: a redirect to another origin than api_url's fails before it is followed
    (requests would carry the PVEAuthCookie there, and a 307 the password)."""
    home = origin(api_url)

    def hook(response, *args, **kwargs):
        del args, kwargs
        if response.is_redirect:
            target = urljoin(response.url, response.headers.get('location', ''))
            if origin(target) != home:
                raise RedirectRefused('proxmox_gpu: the Proxmox VE API at %s answered %s %s with a redirect to %s, another '
                                      'host; refused, nothing was sent there (set url to the API itself)'
                                      % (api_url, response.request.method, urlsplit(response.url).path, target))
        return response
    session.hooks.setdefault('response', []).append(hook)


class TicketAuth(ProxmoxHTTPAuthBase):
    """proxmoxer's password login, through a session that refuses a redirect elsewhere (proxmoxer's own login follows
    any redirect, a 307 with the password in its body). Sends the ticket as proxmoxer does: a cookie, and the CSRF
    token on a request that changes something."""

    def __init__(self, base_url, user, password, **kwargs):
        super(TicketAuth, self).__init__(**kwargs)
        session = requests.Session()
        refuse_redirects_elsewhere(session, base_url)
        response = session.post(base_url + '/access/ticket', data={'username': user, 'password': password},
                                verify=self.verify_ssl, timeout=self.timeout)
        if response.status_code != 200:
            raise AuthenticationError("Couldn't authenticate user: %s to %s/access/ticket code: %s"
                                      % (user, base_url, response.status_code))
        try:
            data = response.json().get('data') or {}
        except (ValueError, AttributeError):
            raise not_json(base_url, 'POST access/ticket', response.content) from None
        if not isinstance(data, dict) or not data.get('ticket'):
            raise not_json(base_url, 'POST access/ticket', response.content)
        if data.get('NeedTFA') is not None:
            raise AuthenticationError('%s needs a second factor (TFA); use an API token (token_id, token_secret)' % user)
        self.ticket, self.csrf = data['ticket'], data['CSRFPreventionToken']

    def get_cookies(self):
        return requests.cookies.cookiejar_from_dict({self.service + 'AuthCookie': self.ticket})

    def get_tokens(self):
        return self.ticket, self.csrf

    def __call__(self, req):
        if req.method != 'GET':
            req.headers['CSRFPreventionToken'] = self.csrf
        return req


class InventoryModule(BaseInventoryPlugin, Constructable, Cacheable):
    """LXC containers with their current node and their NVIDIA devices."""

    NAME = 'gpuops.fleet.proxmox_gpu'

    def verify_file(self, path):
        if not super(InventoryModule, self).verify_file(path):
            return False
        if not path.endswith(('proxmox_gpu.yml', 'proxmox_gpu.yaml')):
            self.display.vvv('proxmox_gpu: skipping %s, its name does not end with proxmox_gpu.yml or proxmox_gpu.yaml'
                             % path)
            return False
        return True

    def set_options(self, task_keys=None, var_options=None, direct=None):
        """As ansible-core's, then refuse a bool option whose value is no boolean (validate_certs: maybe), which
        ansible-core would read as false."""
        super(InventoryModule, self).set_options(task_keys=task_keys, var_options=var_options, direct=direct)
        problem = refusal('proxmox_gpu', loose_booleans('inventory', self._load_name, direct=direct, variables=var_options,
                                                        keys=task_keys))
        if problem:
            raise AnsibleParserError(problem)

    # -- API --------------------------------------------------------------------------------------

    def _connect(self):
        if not HAS_PROXMOXER:
            raise AnsibleError('proxmox_gpu needs the proxmoxer and requests Python packages on the controller: %s'
                               % to_native(PROXMOXER_IMPORT_ERROR))
        url, user = self.get_option('url'), self.get_option('user')
        host, port = api_endpoint(url)
        verify = self.get_option('validate_certs')
        if verify and self.get_option('ca_path'):
            verify = self.get_option('ca_path')
            if not os.path.exists(verify):
                raise AnsibleParserError('proxmox_gpu: ca_path %s does not exist (the CA bundle, PEM, that signed the '
                                         "API's certificate; on Proxmox VE /etc/pve/pve-root-ca.pem)" % verify)
            if not os.access(verify, os.R_OK):
                raise AnsibleParserError('proxmox_gpu: ca_path %s cannot be read by this user' % verify)
        auth = {}
        if self.get_option('token_id') and self.get_option('token_secret'):
            auth = {'token_name': self.get_option('token_id'), 'token_value': self.get_option('token_secret')}
        elif self.get_option('password'):
            auth = {'password': self.get_option('password')}
        else:
            raise AnsibleParserError('proxmox_gpu: give password, or token_id and token_secret, for %s' % user)
        try:
            return self._guarded_api(host, port, user, verify, auth)
        except AuthenticationError as exc:
            raise AnsibleParserError('proxmox_gpu: authentication failed for %s at %s (wrong password?): %s'
                                     % (user, url, to_native(exc)))
        except requests.exceptions.RequestException as exc:
            raise AnsibleParserError(self._request_error(url, 'POST access/ticket', exc))

    def _guarded_api(self, host, port, user, verify, auth):
        """ProxmoxAPI whose session refuses a redirect to another origin; in password mode its ticket comes from
        TicketAuth (the login refuses one too)."""
        timeout = self.get_option('timeout')
        password = auth.pop('password', None)
        if password is not None:   # a placeholder token: no login here, TicketAuth replaces it below
            auth = {'token_name': 'unused', 'token_value': 'unused'}
        api = ProxmoxAPI(host, port=port, user=user, backend='https', service='PVE', verify_ssl=verify, timeout=timeout,
                         **auth)
        store = getattr(api, '_store', None) or {}
        session, base_url = store.get('session'), store.get('base_url')
        if session is None or base_url is None:
            raise AnsibleParserError('proxmox_gpu: this proxmoxer (%s) keeps its session elsewhere; the plugin cannot '
                                     'refuse redirects through it: use proxmoxer 2.x' % getattr(proxmoxer, '__version__', '?'))
        refuse_redirects_elsewhere(session, base_url)
        if password is not None:
            session.auth = TicketAuth(base_url, user, password, verify_ssl=verify, timeout=timeout)
        return api

    def _request_error(self, url, request, exc):
        if isinstance(exc, requests.exceptions.SSLError):
            return ('proxmox_gpu: TLS certificate of %s not trusted (set ca_path to the CA that signed it, '
                    'for Proxmox /etc/pve/pve-root-ca.pem): %s' % (url, to_native(exc)))
        if isinstance(exc, requests.exceptions.Timeout):
            return ('proxmox_gpu: the Proxmox VE API at %s did not answer %s within %s s (option timeout): %s'
                    % (url, request, self.get_option('timeout'), to_native(exc)))
        return ('proxmox_gpu: cannot reach the Proxmox VE API at %s (%s; is pveproxy running there? address, port, '
                'firewall): %s' % (url, request, to_native(exc)))

    def _get(self, api, path, expect=list, **params):
        """The data of GET path: a list (expect=list) or a dict (expect=dict), or None. NotTheApi when the answer is
        not the API's JSON (proxmoxer hands back {'errors': BODY} for a body that is no JSON, a KeyError for JSON
        without data)."""
        request = 'GET ' + path
        try:
            answer = api(path).get(**params)
        except KeyError:
            raise NotTheApi('proxmox_gpu: the Proxmox VE API at %s answered %s with JSON that has no data; is url the '
                            'API of a Proxmox VE node (https://HOST:8006)?' % (self.get_option('url'), request)) from None
        except ResourceException as exc:
            if exc.status_code == 401:
                raise AnsibleParserError('proxmox_gpu: authentication failed for %s at %s (wrong token?): %s'
                                         % (self.get_option('user'), self.get_option('url'), to_native(exc)))
            raise AnsibleParserError('proxmox_gpu: GET %s failed: %s' % (path, to_native(exc)))
        except requests.exceptions.RequestException as exc:
            raise AnsibleParserError(self._request_error(self.get_option('url'), request, exc))
        if isinstance(answer, dict) and set(answer) == {'errors'} and isinstance(answer['errors'], bytes):
            raise not_json(self.get_option('url'), request, answer['errors'])
        if answer is not None and not isinstance(answer, expect):
            raise NotTheApi('proxmox_gpu: the Proxmox VE API at %s answered %s with a JSON %s where PVE gives a %s; is '
                            'url the API of a Proxmox VE node (https://HOST:8006)?'
                            % (self.get_option('url'), request, type(answer).__name__, expect.__name__))
        return answer

    def _config(self, api, node, vmid):
        """The container's running config (current=1: pending changes left out); ConfigUnreadable when it fails."""
        path = 'nodes/%s/lxc/%d/config' % (node, vmid)
        try:
            return self._get(api, path, expect=dict, current=1)
        except AnsibleParserError as exc:
            if isinstance(exc, (RedirectRefused, NotTheApi)) or 'authentication failed' in to_native(exc):
                raise
            raise ConfigUnreadable(to_native(exc))

    def _selected(self, guest):
        if guest.get('type') != 'lxc' or guest.get('template'):
            return False
        if guest.get('status') not in (self.get_option('statuses') or ['running']):
            return False
        wanted = set(self.get_option('tags') or [])
        if wanted and not wanted.intersection(split_tags(guest.get('tags'))):
            return False
        if self.get_option('nodes') and guest.get('node') not in self.get_option('nodes'):
            return False
        if self.get_option('pools') and guest.get('pool') not in self.get_option('pools'):
            return False
        names = self.get_option('names') or []
        return not names or any(fnmatch.fnmatchcase(str(guest.get('name') or ''), pat) for pat in names)

    def _warn_empty(self, resources, selected):
        guests = [g for g in resources if g.get('type') in ('lxc', 'qemu')]
        who = self.get_option('user')
        if self.get_option('token_id') and self.get_option('token_secret'):
            who = '%s!%s' % (who, self.get_option('token_id'))
        if not guests:
            self.display.warning(
                'proxmox_gpu: the Proxmox VE API at %s lists no guests at all to %s. PVE silently leaves out every '
                'guest the caller may not see: the user or API token likely lacks VM.Audit (a privilege-separated '
                'token needs its own ACL, for example PVEAuditor on /vms).' % (self.get_option('url'), who))
        elif not selected:
            lxc = [g for g in guests if g.get('type') == 'lxc' and not g.get('template')]
            self.display.warning(
                'proxmox_gpu: no container selected at %s: %d guests listed, %d LXC containers (%d running); check the '
                'options statuses, tags, nodes, pools and names.'
                % (self.get_option('url'), len(guests), len(lxc), len([g for g in lxc if g.get('status') == 'running'])))

    def _fetch(self, cached_configs):
        """The selected containers (what the hosts are built from), the configs to cache, and the node hosts.

        The guest list and the nodes with their addresses are read at every run; a cached config is used only for
        the same vmid, node and name, started at the same time.
        """
        api = self._connect()
        resources = [g for g in self._get(api, 'cluster/resources', type='vm') or [] if isinstance(g, dict)]
        now = time.time()
        selected = sorted((g for g in resources if self._selected(g)), key=lambda g: int(g.get('vmid', 0)))
        want_nodes = self.get_option('node_hosts')
        if not selected:
            self._warn_empty(resources, selected)
            return [], {}, self._node_entries(self._node_status(api), []) if want_nodes else []
        status = [item for item in self._get(api, 'cluster/status') or [] if isinstance(item, dict)]
        addresses = {item['name']: item.get('ip') or item['name'] for item in status
                     if item.get('type') == 'node' and item.get('name')}
        found, configs = [], {}
        for guest in selected:
            node, vmid = guest['node'], int(guest['vmid'])
            identity = {'node': node, 'name': guest.get('name') or '', 'started': started_at(guest, now)}
            entry = cached_configs.get(str(vmid))
            if not (entry and self._same_container(entry, identity)):
                try:
                    config = self._config(api, node, vmid)
                except ConfigUnreadable as exc:
                    self.display.warning('proxmox_gpu: left out CT %d (%s) on %s, its config could not be read: %s'
                                         % (vmid, guest.get('name') or '?', node, exc))
                    continue
                entry = dict(identity, hostname=config.get('hostname') or '', passthrough=gpu_passthrough(config))
            configs[str(vmid)] = entry
            usable = [dev for dev in entry['passthrough'] if dev['usable']]
            found.append({'vmid': vmid, 'node': node, 'address': addresses.get(node, node),
                          'name': guest.get('name') or entry['hostname'], 'status': guest['status'],
                          'tags': guest.get('tags'), 'pool': guest.get('pool'),
                          'gpu_devices': [dev['device'] for dev in usable],
                          'gpu_container_devices': [dev['path'] for dev in usable],
                          'gpu_denied_devices': [dev['device'] for dev in entry['passthrough'] if not dev['usable']],
                          'resource': dict(guest)})
        if not found:
            self._warn_empty(resources, found)
        return found, configs, self._node_entries(status, found) if want_nodes else []

    def _node_status(self, api):
        """/cluster/status when no container needs it: a failure (no Sys.Audit) leaves only the node hosts out."""
        try:
            return [item for item in self._get(api, 'cluster/status') or [] if isinstance(item, dict)]
        except AnsibleParserError as exc:
            if isinstance(exc, (RedirectRefused, NotTheApi)) or 'authentication failed' in to_native(exc):
                raise
            self.display.warning('proxmox_gpu: no node hosts (%s), the nodes could not be read: %s'
                                 % (NODES_GROUP, to_native(exc)))
            return []

    def _node_entries(self, status, containers):
        """The node hosts: the nodes of /cluster/status (of the nodes option, when set) that are online, and the node
        of every listed container (so that proxmox_node_host always names a host), sorted by name."""
        wanted = self.get_option('nodes') or []
        entries = {}
        for item in status:
            if item.get('type') == 'node' and item.get('name') and (not wanted or item['name'] in wanted):
                entries[str(item['name'])] = item
        vmids = {}
        for ct in containers:
            vmids.setdefault(str(ct['node']), []).append(ct['vmid'])
        nodes, offline = [], []
        for name in sorted(set(entries) | set(vmids)):
            item = entries.get(name) or {'type': 'node', 'name': name}
            online = node_online(item)
            if not online and name not in vmids:
                offline.append(name)
                continue
            nodes.append({'name': name, 'address': item.get('ip') or name, 'online': online,
                          'vmids': sorted(vmids.get(name, [])), 'status': dict(item)})
        if offline:
            self.display.warning('proxmox_gpu: left out of %s the node%s %s, offline in /cluster/status at %s'
                                 % (NODES_GROUP, 's' if len(offline) > 1 else '', ', '.join(offline),
                                    self.get_option('url')))
        return nodes

    @staticmethod
    def _same_container(entry, identity):
        if entry.get('node') != identity['node'] or entry.get('name') != identity['name']:
            return False
        if entry.get('started') is None or identity['started'] is None:
            return False  # stopped, or no uptime: read it again
        return abs(entry['started'] - identity['started']) <= START_TOLERANCE_S

    # -- inventory --------------------------------------------------------------------------------

    def _host_name(self, ct):
        """The host name the container asks for: its name, the hostname template's, or ct<vmid> when empty."""
        fallback = 'ct%d' % ct['vmid']
        template = self.get_option('hostname')
        if not template:
            return ct['name'] or fallback
        self.templar.available_variables = wrap_var(ct['resource'])
        try:
            name = str(self.templar.template(template)).strip()
        except Exception as exc:  # pylint: disable=broad-except
            if self.get_option('strict'):
                raise AnsibleParserError('proxmox_gpu: hostname template failed for CT %d: %s' % (ct['vmid'], to_native(exc)))
            self.display.warning('proxmox_gpu: hostname template failed for CT %d, named it %s: %s'
                                 % (ct['vmid'], fallback, to_native(exc)))
            return fallback
        if not name:
            self.display.warning('proxmox_gpu: hostname template gave CT %d an empty name; named it %s' % (ct['vmid'], fallback))
            return fallback
        return name

    def _claim_host_names(self, containers):
        """{host name: container}. Two containers of one host name, or one named like a host the inventory already
        has, fail naming both: one would silently take the other's name (and its tasks)."""
        claimed = {}
        for ct in containers:
            name = self._host_name(ct)
            other = claimed.get(name)
            if other is not None:
                raise AnsibleParserError(
                    "proxmox_gpu: CT %d on %s and CT %d on %s both get the host name %r; rename one, or set the option "
                    "hostname (for example '{{ name }}-{{ vmid }}')" % (other['vmid'], other['node'], ct['vmid'], ct['node'], name))
            if name in self.inventory.hosts:
                raise AnsibleParserError('proxmox_gpu: CT %d on %s gets the host name %r, already a host of the inventory '
                                         '(another source); rename it, or set the option hostname' % (ct['vmid'], ct['node'], name))
            claimed[name] = ct
        return claimed

    def _node_host_name(self, node, claimed):
        name, fallback = node['name'], 'node_%s' % node['name']
        template = self.get_option('node_hostname')
        if template:
            self.templar.available_variables = wrap_var(node['status'])
            try:
                name = str(self.templar.template(template)).strip()
            except Exception as exc:  # pylint: disable=broad-except
                if self.get_option('strict'):
                    raise AnsibleParserError('proxmox_gpu: node_hostname template failed for node %s: %s'
                                             % (node['name'], to_native(exc)))
                self.display.warning('proxmox_gpu: node_hostname template failed for node %s, named it %s: %s'
                                     % (node['name'], fallback, to_native(exc)))
                name = ''
        ct = claimed.get(name)
        if ct is not None:
            raise AnsibleParserError("proxmox_gpu: CT %d on %s gets the host name %r, the host name of node %s; rename the "
                                     "container, or set the option hostname or node_hostname" % (ct['vmid'], ct['node'], name, node['name']))
        if name and name not in self.inventory.hosts:
            return name
        candidate, count = fallback, 1
        while candidate in self.inventory.hosts:
            count += 1
            candidate = '%s_%d' % (fallback, count)
        if name or not template:
            self.display.warning('proxmox_gpu: the host name %r of node %s is %s; named it %s'
                                 % (name, node['name'], 'already taken' if name else 'empty', candidate))
        return candidate

    def _populate_nodes(self, nodes, claimed):
        """Node hosts in proxmox_nodes; returns {node name: inventory host name}. claimed: the containers' host names."""
        strict = self.get_option('strict')
        group = self.inventory.add_group(NODES_GROUP)
        names = {}
        for node in nodes:
            host = self.inventory.add_host(self._node_host_name(node, claimed), group=group)
            names[node['name']] = host
            hostvars = wrap_var({
                'ansible_connection': 'ssh',
                'ansible_host': node['address'],
                'proxmox_node': node['name'],
                'proxmox_node_online': node['online'],
                'proxmox_node_vmids': node['vmids'],
            })
            for key, value in hostvars.items():
                self.inventory.set_variable(host, key, value)
            self._set_composite_vars(self.get_option('node_compose'), hostvars, host, strict=strict)
        return names

    def _populate(self, containers, nodes):
        strict = self.get_option('strict')
        gpu_group = self.inventory.add_group('gpu_containers')
        claimed = self._claim_host_names(containers)
        hosts = [(ct, self.inventory.add_host(name)) for name, ct in claimed.items()]
        node_hosts = self._populate_nodes(nodes, claimed) if self.get_option('node_hosts') else {}
        for ct, host in hosts:
            minors = [int(NVIDIA_DEV.match(path).group(1)) for path in ct['gpu_devices']]
            hostvars = {
                'ansible_connection': 'gpuops.fleet.pct',
                'ansible_host': ct['address'],
                'ansible_pct_vmid': ct['vmid'],
                'proxmox_vmid': ct['vmid'],
                'proxmox_node': ct['node'],
                'proxmox_name': ct['name'],
                'proxmox_status': ct['status'],
                'proxmox_pool': ct['pool'],
                'proxmox_gpu_devices': ct['gpu_devices'],
                'proxmox_gpu_minors': minors,
                'proxmox_gpu_container_devices': ct['gpu_container_devices'],
                'proxmox_gpu_denied_devices': ct['gpu_denied_devices'],
            }
            hostvars.update(tag_vars(ct['tags']))
            if ct['node'] in node_hosts:
                hostvars['proxmox_node_host'] = node_hosts[ct['node']]
            hostvars = wrap_var(hostvars)
            for key, value in hostvars.items():
                self.inventory.set_variable(host, key, value)
            node_group = self.inventory.add_group(to_safe_group_name('proxmox_node_%s' % ct['node']))
            self.inventory.add_child(node_group, host)
            if minors:
                self.inventory.add_child(gpu_group, host)
            self._set_composite_vars(self.get_option('compose'), hostvars, host, strict=strict)
            self._add_host_to_composed_groups(self.get_option('groups'), hostvars, host, strict=strict)
            self._add_host_to_keyed_groups(self.get_option('keyed_groups'), hostvars, host, strict=strict)

    def parse(self, inventory, loader, path, cache=True):
        super(InventoryModule, self).parse(inventory, loader, path, cache)
        self._read_config_data(path)
        cache_key = self.get_cache_key(path)
        use_cache = self.get_option('cache')
        cached_configs = {}
        if use_cache and cache:
            try:
                cached = self._cache[cache_key]
            except KeyError:
                cached = None
            if isinstance(cached, dict) and cached.get('format') == CACHE_FORMAT:
                cached_configs = cached.get('configs') or {}
        containers, configs, nodes = self._fetch(cached_configs)
        if use_cache:
            self._cache[cache_key] = {'format': CACHE_FORMAT, 'configs': configs}
        self._populate(containers, nodes)
