# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Private documentation fragment: may change in any release.

from __future__ import annotations


class ModuleDocFragment(object):

    # The Proxmox API credentials, named as community.proxmox names them, with the same PROXMOX_* fallbacks
    # (argument_spec: _params.API_ARGS)
    DOCUMENTATION = r"""
requirements:
  - proxmoxer and requests (on the Proxmox node that runs the task, only when O(api_host) is set; without it the
    container rung uses C(pct) and needs neither). The inventory plugin gpuops.fleet.proxmox_gpu needs them on the
    controller.
options:
  api_host:
    description:
      - The Proxmox VE API's host name or address. Setting it (here or in C(PROXMOX_HOST)) makes the container rung
        use the API; without it, C(pct) and the files under C(/etc/pve) of the node are used.
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_HOST) is used. The
        environment is the target's (the node's); the role C(gpuops.fleet.release_gpus) passes the controller's.
    type: str
  api_port:
    description:
      - The API's port. If not specified in the task, C(PROXMOX_PORT) is used, else 8006.
    type: int
  api_user:
    description:
      - The user, C(USER@REALM) (C(root@pam), C(gpuops@pve)). Required with O(api_host).
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_USER) is used.
    type: str
  api_password:
    description:
      - The user's password, when no API token is given.
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_PASSWORD) is used.
      - Give it in the task, from a vaulted variable or from the controller's C(PROXMOX_PASSWORD) read with the
        C(ansible.builtin.env) lookup; never through the task's C(environment) keyword, which shows it on the EXEC
        lines of C(-vvv) and in C(ps) on the controller and the node.
    type: str
  api_token_id:
    description:
      - The API token's id, the part after C(!) (C(release) of C(gpuops@pve!release)).
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_TOKEN_ID) is used.
    type: str
  api_token_secret:
    description:
      - The API token's secret.
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_TOKEN_SECRET) is used.
      - Give it in the task, from a vaulted variable or from the controller's C(PROXMOX_TOKEN_SECRET) read with the
        C(ansible.builtin.env) lookup; never through the task's C(environment) keyword, which shows it on the EXEC
        lines of C(-vvv) and in C(ps) on the controller and the node.
    type: str
  validate_certs:
    description:
      - Verify the API's TLS certificate.
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_VALIDATE_CERTS) is
        used, else V(true).
    type: bool
  ca_path:
    description:
      - A CA bundle to verify the API's certificate with (C(/etc/pve/pve-root-ca.pem) on a node).
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_CA_PATH) is used.
    type: path
  api_timeout:
    description:
      - Seconds one API request may take.
      - If the value is not specified in the task, the value of environment variable C(PROXMOX_API_TIMEOUT) is used,
        else 10.
    type: int
notes:
  - The token needs C(VM.PowerMgmt) on the containers it restarts and C(VM.Audit) (the container's lock, the node
    that hosts it) and C(Sys.Audit) (C(cluster/ha/resources)).
"""
