# Copyright (c) 2026 gpuops maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
name: proxmox_gpu
short_description: Running Proxmox VE LXC containers and their NVIDIA GPUs, from the Proxmox VE API
version_added: 0.1.0
author: gpuops (@gpuops)
description:
  - Lists the running LXC containers of a Proxmox VE cluster with one call to C(GET /cluster/resources?type=vm), finds
    each node's address with C(GET /cluster/status), and reads each container's config
    (C(GET /nodes/NODE/lxc/VMID/config)) for the NVIDIA devices passed into it.
  - Every container becomes a host reached with the C(gpuops.fleet.pct) connection. C(ansible_host) is the address of the
    node that hosts the container at the time of the run, so a migrated container is found on its new node and
    C(pct exec) never fails with "vmid not on this node".
  - "Host variables: C(ansible_connection), C(ansible_host), C(pct_vmid), C(proxmox_node), C(proxmox_name),
    C(proxmox_status), C(proxmox_tags) (a list), C(proxmox_gpu_devices) (the C(/dev/nvidiaN) paths from C(devN) keys and
    C(lxc.mount.entry) lines, by minor) and C(proxmox_gpu_minors)."
  - "Groups: C(gpu_containers) (containers with at least one C(/dev/nvidiaN)) and C(proxmox_node_NODE), plus those of
    O(groups) and O(keyed_groups)."
  - Values from the API are marked unsafe, so they are never templated.
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
    type: bool
    default: true
    env:
      - name: PROXMOX_VALIDATE_CERTS
  ca_path:
    description:
      - CA bundle (PEM) to check the API's certificate against, instead of the system's.
      - On Proxmox VE the cluster's own CA is C(/etc/pve/pve-root-ca.pem).
      - Used only when O(validate_certs) is true.
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
      - An empty list keeps every running container.
    type: list
    elements: str
    default: []
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
  - key: proxmox_tags
    prefix: tag
# ansible-inventory -i gpu.proxmox_gpu.yml --graph
#   @gpu_containers, @proxmox_node_pve1, @multi_gpu, @tag_gpu ...
"""

import re

from ansible.errors import AnsibleError, AnsibleParserError
from ansible.module_utils.common.text.converters import to_native
from ansible.module_utils.six.moves.urllib.parse import urlsplit
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable, Constructable, to_safe_group_name
from ansible.utils.unsafe_proxy import wrap_var

try:
    import requests  # proxmoxer's https backend calls sys.exit() when requests is missing: check first
    from proxmoxer import ProxmoxAPI
    from proxmoxer.core import AuthenticationError, ResourceException
    HAS_PROXMOXER = True
    PROXMOXER_IMPORT_ERROR = None
except ImportError as exc:
    HAS_PROXMOXER = False
    PROXMOXER_IMPORT_ERROR = exc

NVIDIA_DEV = re.compile(r'^/dev/nvidia(\d+)$')
DEV_KEY = re.compile(r'^dev\d+$')
DEFAULT_PORT = 8006


def split_tags(text):
    """Proxmox tags ('gpu;sglang', also ',' or ' ' separated) as a list."""
    return [tag for tag in re.split(r'[;, ]+', str(text or '')) if tag]


def gpu_devices(config):
    """The /dev/nvidiaN paths a container config passes in, from devN keys and lxc.mount.entry lines, by minor."""
    paths = []
    for key, value in config.items():
        if DEV_KEY.match(key):
            path = str(value).split(',', 1)[0]
            paths.append(path[len('path='):] if path.startswith('path=') else path)
    for entry in config.get('lxc') or []:
        if len(entry) == 2 and entry[0] == 'lxc.mount.entry':
            fields = str(entry[1]).split()
            if fields:
                paths.append(fields[0])
                if len(fields) > 1:
                    paths.append('/' + fields[1].lstrip('/'))
    minors = {}
    for path in paths:
        match = NVIDIA_DEV.match(path)
        if match:
            minors[int(match.group(1))] = path
    return [minors[m] for m in sorted(minors)]


def api_endpoint(url):
    """(host, port) from the url option; accepts a trailing /api2/json and a missing scheme."""
    parts = urlsplit(url if '://' in url else 'https://' + url)
    if parts.scheme != 'https':
        raise AnsibleParserError('proxmox_gpu: url must be https://HOST[:PORT], got %r' % url)
    if not parts.hostname:
        raise AnsibleParserError('proxmox_gpu: no host in url %r' % url)
    return parts.hostname, parts.port or DEFAULT_PORT


class InventoryModule(BaseInventoryPlugin, Constructable, Cacheable):
    """Running Proxmox VE LXC containers with their current node and their NVIDIA devices."""

    NAME = 'gpuops.fleet.proxmox_gpu'

    def verify_file(self, path):
        return super(InventoryModule, self).verify_file(path) and path.endswith(('proxmox_gpu.yml', 'proxmox_gpu.yaml'))

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
        auth = {}
        if self.get_option('token_id') and self.get_option('token_secret'):
            auth = {'token_name': self.get_option('token_id'), 'token_value': self.get_option('token_secret')}
        elif self.get_option('password'):
            auth = {'password': self.get_option('password')}
        else:
            raise AnsibleParserError('proxmox_gpu: give password, or token_id and token_secret, for %s' % user)
        try:
            return ProxmoxAPI(host, port=port, user=user, backend='https', service='PVE', verify_ssl=verify,
                              timeout=self.get_option('timeout'), **auth)
        except AuthenticationError as exc:
            raise AnsibleParserError('proxmox_gpu: authentication failed for %s at %s (wrong password?): %s'
                                     % (user, url, to_native(exc)))
        except requests.exceptions.RequestException as exc:
            raise AnsibleParserError(self._request_error(url, exc))

    def _request_error(self, url, exc):
        if isinstance(exc, requests.exceptions.SSLError):
            return ('proxmox_gpu: TLS certificate of %s not trusted (set ca_path to the CA that signed it, '
                    'for Proxmox /etc/pve/pve-root-ca.pem): %s' % (url, to_native(exc)))
        return 'proxmox_gpu: cannot reach the Proxmox VE API at %s: %s' % (url, to_native(exc))

    def _get(self, api, path, **params):
        try:
            return api(path).get(**params)
        except ResourceException as exc:
            if exc.status_code == 401:
                raise AnsibleParserError('proxmox_gpu: authentication failed for %s at %s (wrong token?): %s'
                                         % (self.get_option('user'), self.get_option('url'), to_native(exc)))
            raise AnsibleParserError('proxmox_gpu: GET %s failed: %s' % (path, to_native(exc)))
        except requests.exceptions.RequestException as exc:
            raise AnsibleParserError(self._request_error(self.get_option('url'), exc))

    def _fetch(self):
        """One record per running, selected container: what the hosts are built from (and what the cache keeps)."""
        api = self._connect()
        resources = self._get(api, 'cluster/resources', type='vm') or []
        status = self._get(api, 'cluster/status') or []
        addresses = {item['name']: item.get('ip') or item['name'] for item in status if item.get('type') == 'node'}
        wanted = set(self.get_option('tags') or [])
        found = []
        for guest in sorted(resources, key=lambda g: int(g.get('vmid', 0))):
            if guest.get('type') != 'lxc' or guest.get('template') or guest.get('status') != 'running':
                continue
            tags = split_tags(guest.get('tags'))
            if wanted and not wanted.intersection(tags):
                continue
            node, vmid = guest['node'], int(guest['vmid'])
            config = self._get(api, 'nodes/%s/lxc/%d/config' % (node, vmid))
            found.append({'vmid': vmid, 'node': node, 'address': addresses.get(node, node),
                          'name': guest.get('name') or config.get('hostname') or '', 'status': guest['status'],
                          'tags': tags, 'gpu_devices': gpu_devices(config)})
        return found

    # -- inventory --------------------------------------------------------------------------------

    def _populate(self, containers):
        strict = self.get_option('strict')
        gpu_group = self.inventory.add_group('gpu_containers')
        for ct in containers:
            name = ct['name'] if ct['name'] and ct['name'] not in self.inventory.hosts else 'ct%d' % ct['vmid']
            host = self.inventory.add_host(name)
            minors = [int(NVIDIA_DEV.match(path).group(1)) for path in ct['gpu_devices']]
            hostvars = {
                'ansible_connection': 'gpuops.fleet.pct',
                'ansible_host': ct['address'],
                'pct_vmid': ct['vmid'],
                'proxmox_node': ct['node'],
                'proxmox_name': ct['name'],
                'proxmox_status': ct['status'],
                'proxmox_tags': ct['tags'],
                'proxmox_gpu_devices': ct['gpu_devices'],
                'proxmox_gpu_minors': minors,
            }
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
        user_cache_setting = self.get_option('cache')
        attempt_to_read_cache = user_cache_setting and cache
        cache_needs_update = user_cache_setting and not cache
        containers = None
        if attempt_to_read_cache:
            try:
                containers = self._cache[cache_key]
            except KeyError:
                cache_needs_update = True
        if containers is None:
            containers = self._fetch()
        if cache_needs_update:
            self._cache[cache_key] = containers
        self._populate(containers)
