# Copyright (c) 2026 gpuops maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
name: pct
short_description: Run tasks inside Proxmox VE LXC containers over OpenSSH and C(pct exec)
description:
  - Reaches an LXC container by SSH to the Proxmox VE node that hosts it, then C(pct exec VMID -- /bin/sh -c CMD) there.
  - Built on ansible-core's C(ssh) connection, so ControlMaster/ControlPersist applies. The control socket is keyed by
    the node's host, port and user, so every container of one node shares one SSH connection.
  - With pipelining (on by default here) a module task costs one C(pct exec) call.
  - Files are streamed through the exec channel (C(cat > DST), C(cat < SRC)). No temporary file is made on the node,
    and a file is never held whole in memory.
  - Become (C(sudo), C(su), ...) works inside the container as with any POSIX host.
  - The node's login shell must be POSIX (C(sh), C(bash), C(dash), C(zsh)); commands are quoted for it.
author: gpuops maintainers (@gpuops)
version_added: 0.1.0
notes:
  - "Host variables are named C(ansible_pct_*) (C(ansible_pct_vmid), C(ansible_pct_exec_method), ...), as ansible-core
    names a connection's own variables. The older C(pct_*) names are aliases: they keep working, are deprecated, and
    go in 1.0.0. Where both are set, C(ansible_pct_*) wins."
  - "Facts cannot steer it. A container's root controls what every task in it returns, facts included, and facts
    outrank inventory variables. A fact named like one of this plugin's host variables (C(ansible_pct_vmid),
    C(pct_vmid), C(proxmox_vmid), C(ansible_pct_exec_method), ...) fails the task naming it, before anything runs on
    the node. The executables (O(pct_executable), O(lxc_attach_executable), O(ssh_executable)) come from configuration
    only. Set C(inject_facts_as_vars = False) as well (see the security guide)."
  - The node is O(host) (C(ansible_host)). A container runs only on one node at a time and moves on migration;
    the inventory must say where it is now. A wrong node fails with a message that names the node.
  - O(exec_method=lxc-attach) skips pct's Perl start-up (about 0.3 s a call). It also skips what pct checks
    first. pct loads the container's config (so a vmid that is not on this node fails with a clear message) and
    refuses a container that is not running with C(container 'VMID' not running!). With C(lxc-attach) a stopped or
    absent container gives lxc-attach's own, vaguer errors.
  - The container never sees the node session's environment (C(SSH_CONNECTION), C(SSH_CLIENT), C(SSH_AUTH_SOCK),
    the node's C(LANG), ...). C(pct exec) gets C(--keep-env 0) (pve-container 5.0.9 and later, Proxmox VE 8.2+),
    C(lxc-attach) gets C(--clear-env). The command then starts with lxc's C(PATH) and C(container=lxc), plus
    C(HOME=/root), C(USER=root) and C(LOGNAME=root) set by the plugin.
  - pct decodes its arguments by the node's locale (pve-common's C(decode('locale'))). The plugin runs pct with
    C(LC_ALL=C.UTF-8), so non-ASCII paths and commands arrive unchanged whatever locale the SSH session has.
  - Failures are told apart by where they happened. The node command prints a marker before it starts pct, and
    the container's shell prints another before the command runs; the plugin removes both. No marker means SSH
    failed (the host is UNREACHABLE and retried per O(reconnection_retries)). The first marker alone means pct,
    sudo or lxc-attach failed on the node (UNREACHABLE with pct's reason, whatever its exit code, never retried).
    Both markers mean the command ran, so its exit code and output are the task's, even 255 or a message such as
    C(Permission denied (publickey)). A connection dropped after that point is reported as such and never retried,
    because the command may still be running in the container.
  - The user inside the container is root (what C(pct exec) gives). C(ansible_user) is the node's SSH user.
    Ansible still sees that name as the remote user. That matters only for its become temp-file permission
    rules when O(node_become) is on.
  - Host key checking stays on by default (O(host_key_checking)); put the nodes' keys in known_hosts, e.g. with
    C(ansible_ssh_common_args='-o UserKnownHostsFile=/path/known_hosts').
  - "Boolean options (O(host_key_checking), O(node_become), O(pipelining), O(use_tty)) take a real boolean only: V(true)
    or V(false), or Ansible's other spellings (V(yes)/V(no), V(on)/V(off), V(1)/V(0)), from a variable, the environment
    or C(ansible.cfg). Any other value, such as V(maybe), fails the task naming the option and where it was set,
    before anything runs on the node; ansible-core alone would read it as false (for O(host_key_checking): no host
    key check)."
  - O(use_tty) defaults to V(true) as with C(ssh). It applies only to commands that are not pipelined, and it merges
    their stderr into stdout.
  - When forks reach one node together, the first opens the node's master connection under a lock in
    O(control_path_dir) and the others wait for it, so a node costs one SSH login whatever the forks.
  - The container needs C(/bin/sh) and C(cat). Tools that open their own SSH connection to C(ansible_host)
    (C(ansible.posix.synchronize)) reach the node, not the container.
options:
  host:
      description: Hostname/IP of the Proxmox VE node that hosts the container (C(ansible_host)).
      default: inventory_hostname
      type: string
      vars:
           - name: inventory_hostname
           - name: ansible_host
           - name: ansible_ssh_host
           - name: delegated_vars['ansible_host']
           - name: delegated_vars['ansible_ssh_host']
  host_key_checking:
      description: Determines if SSH should reject or not a connection after checking host keys.
      default: True
      type: boolean
      ini:
          - section: defaults
            key: 'host_key_checking'
          - section: ssh_connection
            key: 'host_key_checking'
      env:
          - name: ANSIBLE_HOST_KEY_CHECKING
          - name: ANSIBLE_SSH_HOST_KEY_CHECKING
      vars:
          - name: ansible_host_key_checking
          - name: ansible_ssh_host_key_checking
  password:
      description: Authentication password for the O(remote_user). Can be supplied as CLI option.
      type: string
      vars:
          - name: ansible_password
          - name: ansible_ssh_pass
          - name: ansible_ssh_password
  password_mechanism:
      description: Mechanism to use for handling ssh password prompt
      type: string
      default: ssh_askpass
      choices:
          - ssh_askpass
          - sshpass
          - disable
      env:
          - name: ANSIBLE_SSH_PASSWORD_MECHANISM
      ini:
          - {key: password_mechanism, section: ssh_connection}
      vars:
          - name: ansible_ssh_password_mechanism
  sshpass_prompt:
      description:
          - Password prompt that C(sshpass)/C(SSH_ASKPASS) should search for.
          - Supported by sshpass 1.06 and up when O(password_mechanism) set to V(sshpass).
          - Defaults to C(Enter PIN for) when pkcs11_provider is set.
          - Defaults to C(assword) when O(password_mechanism) set to V(ssh_askpass).
      default: ''
      type: string
      ini:
          - section: 'ssh_connection'
            key: 'sshpass_prompt'
      env:
          - name: ANSIBLE_SSHPASS_PROMPT
      vars:
          - name: ansible_sshpass_prompt
  ssh_args:
      description:
          - Arguments to pass to all SSH CLI tools.
          - Unlike C(ssh), no C(-C) by default. Between a controller and its Proxmox nodes compression costs more CPU
            than it saves (a 50 MB copy took three times as long with it on loopback).
          - Keep C(ControlMaster) and C(ControlPersist); they are what lets the containers of one node share one connection.
      default: '-o ControlMaster=auto -o ControlPersist=60s'
      type: string
      ini:
          - section: 'ssh_connection'
            key: 'ssh_args'
      env:
          - name: ANSIBLE_SSH_ARGS
      vars:
          - name: ansible_ssh_args
  ssh_common_args:
      description: Common extra args for all SSH CLI tools.
      type: string
      ini:
          - section: 'ssh_connection'
            key: 'ssh_common_args'
      env:
          - name: ANSIBLE_SSH_COMMON_ARGS
      vars:
          - name: ansible_ssh_common_args
      cli:
          - name: ssh_common_args
      default: ''
  ssh_executable:
      default: ssh
      description:
        - This defines the location of the SSH binary. It defaults to V(ssh) which will use the first SSH binary available in $PATH.
        - This option is usually not required, it might be useful when access to system SSH is restricted,
          or when using SSH wrappers to connect to remote hosts.
        - Only configuration sets it (environment or ini), never a host variable (see O(pct_executable)).
      type: string
      env: [{name: ANSIBLE_SSH_EXECUTABLE}]
      ini:
      - {key: ssh_executable, section: ssh_connection}
  ssh_extra_args:
      description: Extra exclusive to the SSH CLI.
      type: string
      vars:
          - name: ansible_ssh_extra_args
      env:
        - name: ANSIBLE_SSH_EXTRA_ARGS
      ini:
        - key: ssh_extra_args
          section: ssh_connection
      cli:
        - name: ssh_extra_args
      default: ''
  reconnection_retries:
      description:
        - Number of attempts to connect.
        - Ansible retries connections only if it gets an SSH error with a return code of 255.
        - Any errors with return codes other than 255 indicate an issue with program execution.
      default: 0
      type: integer
      env:
        - name: ANSIBLE_SSH_RETRIES
      ini:
        - section: connection
          key: retries
        - section: ssh_connection
          key: retries
      vars:
        - name: ansible_ssh_retries
  port:
      description: SSH port of the node.
      type: int
      ini:
        - section: defaults
          key: remote_port
      env:
        - name: ANSIBLE_REMOTE_PORT
      vars:
        - name: ansible_port
        - name: ansible_ssh_port
      keyword:
        - name: port
  remote_user:
      description:
          - User name with which to log in to the node, normally set by the remote_user keyword.
          - Commands inside the container run as root whatever this user is; see O(node_become) for a node user that is not root.
          - If no user is supplied, Ansible will let the SSH client binary choose the user as it normally.
      type: string
      ini:
        - section: defaults
          key: remote_user
      env:
        - name: ANSIBLE_REMOTE_USER
      vars:
        - name: ansible_user
        - name: ansible_ssh_user
      cli:
        - name: user
      keyword:
        - name: remote_user
  private_key_file:
      description:
          - Path to private key file to use for authentication.
      type: string
      ini:
        - section: defaults
          key: private_key_file
      env:
        - name: ANSIBLE_PRIVATE_KEY_FILE
      vars:
        - name: ansible_private_key_file
        - name: ansible_ssh_private_key_file
      cli:
        - name: private_key_file
          option: '--private-key'
  private_key:
      description:
        - Private key contents in PEM format. Requires the C(SSH_AGENT) configuration to be enabled.
      type: string
      env:
        - name: ANSIBLE_PRIVATE_KEY
      vars:
        - name: ansible_private_key
        - name: ansible_ssh_private_key
  private_key_passphrase:
      description:
        - Private key passphrase, dependent on O(private_key).
        - This does NOT have any effect when used with O(private_key_file).
      type: string
      env:
        - name: ANSIBLE_PRIVATE_KEY_PASSPHRASE
      vars:
        - name: ansible_private_key_passphrase
        - name: ansible_ssh_private_key_passphrase
  control_path:
    description:
      - This is the location to save SSH's ControlPath sockets, it uses SSH's variable substitution.
      - Since 2.3, if null (default), ansible will generate a unique hash. Use ``%(directory)s`` to indicate where to use the control dir path setting.
      - Before 2.3 it defaulted to ``control_path=%(directory)s/ansible-ssh-%%h-%%p-%%r``.
      - Be aware that this setting is ignored if C(-o ControlPath) is set in ssh args.
    type: string
    env:
      - name: ANSIBLE_SSH_CONTROL_PATH
    ini:
      - key: control_path
        section: ssh_connection
    vars:
      - name: ansible_control_path
  control_path_dir:
    default: ~/.ansible/cp
    description:
      - This sets the directory to use for ssh control path if the control path setting is null.
      - Also, provides the ``%(directory)s`` variable for the control path setting.
    type: string
    env:
      - name: ANSIBLE_SSH_CONTROL_PATH_DIR
    ini:
      - section: ssh_connection
        key: control_path_dir
    vars:
      - name: ansible_control_path_dir
  use_tty:
    default: true
    description: add -tt to ssh commands to force tty allocation.
    env: [{name: ANSIBLE_SSH_USETTY}]
    ini:
    - {key: usetty, section: ssh_connection}
    type: bool
    vars:
      - name: ansible_ssh_use_tty
  timeout:
    default: 10
    description:
        - This is the default amount of time we will wait while establishing an SSH connection.
        - It also controls how long we can wait to access reading the connection once established (select on the socket).
    env:
        - name: ANSIBLE_TIMEOUT
        - name: ANSIBLE_SSH_TIMEOUT
    ini:
        - key: timeout
          section: defaults
        - key: timeout
          section: ssh_connection
    vars:
      - name: ansible_ssh_timeout
    cli:
      - name: timeout
    type: integer
  pkcs11_provider:
    default: ""
    type: string
    description:
      - "PKCS11 SmartCard provider such as opensc, example: /usr/local/lib/opensc-pkcs11.so"
    env: [{name: ANSIBLE_PKCS11_PROVIDER}]
    ini:
      - {key: pkcs11_provider, section: ssh_connection}
    vars:
      - name: ansible_ssh_pkcs11_provider
  verbosity:
    default: 0
    type: int
    description:
      - Requested verbosity level for the SSH CLI.
    env: [{name: ANSIBLE_SSH_VERBOSITY}]
    ini:
      - {key: verbosity, section: ssh_connection}
    vars:
      - name: ansible_ssh_verbosity

  pipelining:
    description:
      - Send modules on the stdin of one C(pct exec) call instead of copying them into the container first.
      - On by default for this plugin (unlike C(ssh)). Inside the container C(sudo) must not need a tty (C(requiretty) off) when
        become is used.
    type: boolean
    default: true
    env:
      - name: ANSIBLE_PIPELINING
      - name: ANSIBLE_SSH_PIPELINING
    ini:
      - section: defaults
        key: pipelining
      - section: connection
        key: pipelining
      - section: ssh_connection
        key: pipelining
    vars:
      - name: ansible_pipelining
      - name: ansible_ssh_pipelining
  vmid:
    description:
      - VMID of the LXC container on the node O(host).
      - C(ansible_pct_vmid) wins over C(pct_vmid), which wins over C(proxmox_vmid), the variable that
        C(community.proxmox.proxmox_pct_remote) reads.
      - Required; a host without it fails with a message that names the variables.
      - Only a host variable sets it. There is no environment variable or ini key, because one default would send
        every host's tasks to the same container number on each node.
    type: int
    vars:
      - name: proxmox_vmid
      - name: pct_vmid
      - name: ansible_pct_vmid
        version_added: 0.2.0
  exec_method:
    description:
      - How the node enters the container.
      - V(pct) runs C(pct exec VMID --keep-env 0 -- ...), with Proxmox's checks and its Perl start-up (about 0.3 s)
        on every call. It needs pve-container 5.0.9 or later (Proxmox VE 8.2+) for C(--keep-env).
      - V(lxc-attach) runs C(lxc-attach -n VMID --clear-env -- ...) directly. It is faster but skips the config check
        and the running check (see notes).
    type: string
    default: pct
    choices: [pct, lxc-attach]
    vars:
      - name: pct_exec_method
      - name: ansible_pct_exec_method
        version_added: 0.2.0
    env:
      - name: ANSIBLE_PCT_EXEC_METHOD
    ini:
      - section: pct_connection
        key: exec_method
  node_become:
    description:
      - Run C(pct) (or C(lxc-attach)) through C(sudo -n) on the node, for a node user that is not root.
      - 'The node needs a sudoers rule without password for that command. Never allow all of C(/usr/sbin/pct):
        C(pct push), C(pct pull), C(pct set --mp0) and others read and write any file of the node, so that rule is
        root on the node. Allow only C(exec) into named containers, for example
        C(ansible ALL = (root) NOPASSWD: /usr/sbin/pct exec 101 --keep-env 0 -- *) (see the README).'
    type: boolean
    default: false
    vars:
      - name: pct_node_become
      - name: ansible_pct_node_become
        version_added: 0.2.0
    env:
      - name: ANSIBLE_PCT_NODE_BECOME
    ini:
      - section: pct_connection
        key: node_become
  pct_executable:
    description:
      - Path of C(pct) on the node.
      - Only configuration sets it (C(ANSIBLE_PCT_EXECUTABLE) or the ini key), never a host variable. The node's SSH
        user (root) runs it, and a host variable can be outranked by a fact that the container returns.
        The host variables C(pct_executable) and C(ansible_pct_executable) were removed in 0.3.0.
    type: string
    default: /usr/sbin/pct
    env:
      - name: ANSIBLE_PCT_EXECUTABLE
    ini:
      - section: pct_connection
        key: pct_executable
  lxc_attach_executable:
    description:
      - Path of C(lxc-attach) on the node, for O(exec_method=lxc-attach).
      - Only configuration sets it, never a host variable (see O(pct_executable)). The host variables
        C(pct_lxc_attach_executable) and C(ansible_pct_lxc_attach_executable) were removed in 0.3.0.
    type: string
    default: /usr/bin/lxc-attach
    env:
      - name: ANSIBLE_PCT_LXC_ATTACH_EXECUTABLE
    ini:
      - section: pct_connection
        key: lxc_attach_executable
  transfer_timeout:
    description:
      - Seconds a file transfer (put or fetch) may take on the node. C(timeout) there stops C(pct exec) (TERM, then
        KILL 5 s later) when C(pct) or the container does not finish, and the transfer fails naming this option.
        V(0) means no limit.
      - A limit on the node, not only on the controller, since killing the SSH client alone leaves C(pct exec) and
        the command in the container running on the node.
    type: int
    default: 300
    vars:
      - name: pct_transfer_timeout
      - name: ansible_pct_transfer_timeout
        version_added: 0.2.0
    env:
      - name: ANSIBLE_PCT_TRANSFER_TIMEOUT
    ini:
      - section: pct_connection
        key: transfer_timeout
  command_timeout:
    description:
      - Seconds a command may run inside the container before C(timeout) there stops it (TERM, then KILL 5 s later);
        such a command exits 124. V(0) means no limit.
      - Killing the SSH client alone would not stop the command, because C(lxc-attach) does not reliably pass signals on.
        The limit is therefore applied inside the container, which needs C(timeout) (coreutils or busybox) there.
      - The time to connect to the node is limited by O(timeout).
    type: int
    default: 0
    vars:
      - name: pct_command_timeout
      - name: ansible_pct_command_timeout
        version_added: 0.2.0
    env:
      - name: ANSIBLE_PCT_COMMAND_TIMEOUT
    ini:
      - section: pct_connection
        key: command_timeout
  _facts:
    description:
      - Internal, never set it. The host's C(ansible_facts), read so that a fact named like one of this plugin's
        variables (a fact that a module in the container returned, or that the fact cache holds) fails the task
        instead of choosing the container, the node, or how they are reached. Facts outrank inventory variables,
        and ansible-core keeps only its builtin connections' variables out of them.
      - With C(inject_facts_as_vars = False) (C(ANSIBLE_INJECT_FACT_VARS=False)) a fact cannot set a variable, so
        such a fact is only warned about.
    type: raw
    vars:
      - name: ansible_facts
"""

EXAMPLES = r"""
# inventory.yml: containers on two nodes; ansible_host is the node that hosts each container now.
# all:
#   children:
#     gpu_containers:
#       vars:
#         ansible_connection: gpuops.fleet.pct
#         ansible_user: root
#         ansible_ssh_private_key_file: ~/.ssh/pve_ed25519
#       hosts:
#         ct101: {ansible_host: pve1.example.org, ansible_pct_vmid: 101}
#         ct102: {ansible_host: pve1.example.org, ansible_pct_vmid: 102}
#         ct201: {ansible_host: pve2.example.org, ansible_pct_vmid: 201, ansible_pct_exec_method: lxc-attach}

- name: Check GPUs in every container
  hosts: gpu_containers
  gather_facts: false
  tasks:
    - name: Show the containers' GPU memory
      gpuops.fleet.gpu_info:

- name: A node user that is not root runs pct through sudo on the node
  hosts: gpu_containers
  vars:
    ansible_user: ansible
    ansible_pct_node_become: true
  tasks:
    - name: Become another user inside the container
      ansible.builtin.command: id -un
      become: true
      become_user: nobody
      changed_when: false
"""

import fcntl
import os
import re
import secrets
import selectors
import shlex
import subprocess
import tempfile
import time
import typing as t

from ansible import constants as C
from ansible.errors import AnsibleAuthenticationFailure, AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_native, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.plugins.connection.ssh import AnsibleControlPersistBrokenPipeError, Connection as SSHConnection
from ansible.utils.display import Display
from ansible.utils.path import unfrackpath
from ansible.vars import clean as core_clean

from ansible_collections.gpuops.fleet.plugins.plugin_utils._booleans import loose_booleans, refusal

display = Display()

CHUNK = 256 * 1024
CONTAINER_SHELL = '/bin/sh'
# pct decodes its arguments by the locale (pve-common JSONSchema: decode('locale', ...)).
PCT_LOCALE = 'C.UTF-8'
# What the command gets on top of lxc's cleared environment (PATH, container=lxc): pct exec runs it as root.
CONTAINER_ENV = (('HOME', '/root'), ('USER', 'root'), ('LOGNAME', 'root'))

# Proxmox's own words (pve-container src/PVE/LXC.pm, PVE/AbstractConfig.pm). pct dies through Perl's `die`,
# whose exit code follows errno (2 for a missing config), so the words count, not the code.
_NOT_RUNNING = re.compile(r"container '(\d+)' not running!")
_NO_CONFIG = re.compile(r"Configuration file 'nodes/([^/']+)/lxc/(\d+)\.conf' does not exist")
_NO_KEEP_ENV = re.compile(r'Unknown option: keep-env|unknown option --keep-env')
_HOSTKEY_CHANGED = 'REMOTE HOST IDENTIFICATION HAS CHANGED'
_HOSTKEY_FAILED = 'Host key verification failed'
_AUTH_FAILED = re.compile(r'Permission denied \([^)]*\)')
_SSH_CONNECT = re.compile(r'ssh: connect to host \S+ port \d+: (.+)|ssh: Could not resolve hostname \S+: (.+)|'
                          r'Connection timed out during banner exchange|Connection closed by \S+ port \d+')
# ssh's last words when the connection broke after the command had started (the last line of its stderr).
_SSH_DROPPED = re.compile(r'^(?:Connection to \S+ closed by remote host\.|client_loop: send disconnect: .+|'
                          r'Timeout, server \S+ not responding\.|mux_client_request_session: read from master failed: .+|'
                          r'Control master terminated unexpectedly)$')
_BROKEN_MUX = 'mux_client_hello_exchange: write packet: Broken pipe'
# How long an ssh that stopped reading its stdin has to exit before the write's broken pipe is the error: ansible-core
# waits 1 ms, and on a loaded machine an ssh refused by the node was still exiting then, so the play said "Data could
# not be sent" instead of ssh's own "Connection refused".
SSH_EXIT_GRACE_S = 5.0
_SUDO_PROBLEMS = ('a password is required', 'a terminal is required', 'is not in the sudoers file',
                  'is not allowed to execute')


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else ''


def _exited_within(process: subprocess.Popen, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


class _Quiet:
    """A Display stand-in that drops warnings (clean_facts warns about every name it removes)."""

    @staticmethod
    def warning(*args: t.Any, **kwargs: t.Any) -> None:
        pass


_REACHABLE: dict[tuple[str, ...], frozenset[str]] = {}


def fact_reachable_vars(names: t.Iterable[str]) -> frozenset[str]:
    """The variable names among names that a fact of the same name sets when inject_facts_as_vars is on: those that
    ansible-core's own clean_facts (lib/ansible/vars/clean.py) does not remove. It removes the builtin connections'
    variables (ansible_host, ansible_user, ansible_ssh_*, ...), never a collection's (ansible_pct_*, pct_vmid)."""
    key = tuple(sorted(set(names)))
    if key not in _REACHABLE:
        display_was = core_clean.display
        core_clean.display = _Quiet()
        try:
            kept = core_clean.clean_facts(dict.fromkeys(key))
        finally:
            core_clean.display = display_was
        _REACHABLE[key] = frozenset(kept)
    return _REACHABLE[key]


def colliding_facts(facts: t.Mapping[str, t.Any] | None, names: t.Iterable[str]) -> list[tuple[str, str]]:
    """(fact, variable) pairs: a key of ansible_facts that a fact named like a variable among names left there.

    ansible_facts holds a fact without its ansible_ prefix: a fact ansible_pct_vmid and a fact pct_vmid are both
    ansible_facts.pct_vmid, so each key stands for both names."""
    reachable = fact_reachable_vars(name for name in names if name != 'ansible_facts' and '[' not in name)
    pairs = []
    for key in sorted(facts or {}):
        for name in (key, 'ansible_' + key):
            if name in reachable:
                pairs.append((key, name))
    return pairs


class _Pump:
    """ssh's pipes during a put or fetch: local_file copied to its stdin (put), or its stdout to local_file (fetch),
    CHUNK at a time, its stderr kept; write_error is what writing local_file raised (the copy stops there)."""

    def __init__(self, proc: subprocess.Popen, local_file: t.BinaryIO, direction: str) -> None:
        self.proc, self.local_file, self.direction = proc, local_file, direction
        self.stderr = bytearray()
        self.pending = b''
        self.write_error: OSError | None = None
        self.stdout_open = True
        self.rc: int | None = None
        self.selector = selectors.DefaultSelector()
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            self.selector.register(stream, selectors.EVENT_READ)
        if direction == 'put':
            os.set_blocking(proc.stdin.fileno(), False)
            self.selector.register(proc.stdin, selectors.EVENT_WRITE)

    def run(self) -> None:
        """Copy until ssh has closed its pipes (or has exited with stdout closed), or writing local_file failed."""
        while self.selector.get_map() and self.write_error is None:
            for key, dummy in self.selector.select(1.0):
                if key.fileobj is self.proc.stdin:
                    self._feed()
                elif not self._read(key):
                    break
            # A new ControlPersist master inherits stderr and keeps it open: stop once ssh is gone.
            if not self.stdout_open and self.proc.poll() is not None:
                break

    def _stop_feeding(self) -> None:
        self.selector.unregister(self.proc.stdin)
        self.proc.stdin.close()

    def _feed(self) -> None:
        """Write the next piece of local_file to ssh's stdin; close it at the file's end, or when ssh closed it."""
        if not self.pending:
            self.pending = self.local_file.read(CHUNK)
        if not self.pending:
            self._stop_feeding()
            return
        try:
            written = os.write(self.proc.stdin.fileno(), self.pending)
        except BlockingIOError:
            return
        except BrokenPipeError:
            self._stop_feeding()
            return
        self.pending = self.pending[written:]

    def _read(self, key: selectors.SelectorKey) -> bool:
        """Take what ssh wrote on stdout or stderr; False when writing it to local_file failed (write_error)."""
        try:
            data = os.read(key.fd, CHUNK)
        except BlockingIOError:
            return True
        if not data:
            self.selector.unregister(key.fileobj)
            if key.fileobj is self.proc.stdout:
                self.stdout_open = False
        elif key.fileobj is self.proc.stderr:
            self.stderr += data
        elif self.direction == 'fetch':
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.local_file.fileno(), view):]
            except OSError as ex:
                self.write_error = ex
                return False
        return True

    def close(self, finished: bool) -> None:
        """Kill ssh unless the copy finished (a write that failed, or an exception: ssh must not block on a pipe
        nobody reads), wait for it (rc), keep the rest of its stderr, close its pipes."""
        self.selector.close()
        proc = self.proc
        if not finished and proc.poll() is None:
            proc.kill()
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        self.rc = proc.wait()
        try:
            while True:
                data = os.read(proc.stderr.fileno(), CHUNK)
                if not data:
                    break
                self.stderr += data
        except BlockingIOError:
            pass
        proc.stdout.close()
        proc.stderr.close()


class _SSHFailed(AnsibleConnectionFailure):
    """SSH did not run the node command: retried per reconnection_retries."""


class Connection(SSHConnection):
    """SSH to a Proxmox VE node, then pct exec into one of its containers."""

    transport = 'gpuops.fleet.pct'
    has_pipelining = True

    def __init__(self, *args: t.Any, **kwargs: t.Any) -> None:
        super().__init__(*args, **kwargs)
        self._markers = (b'', b'', b'')

    # -- options: facts must not choose them ----------------------------------------------------

    def set_options(self, task_keys: dict[str, t.Any] | None = None, var_options: dict[str, t.Any] | None = None,
                    direct: dict[str, t.Any] | None = None) -> None:
        super().set_options(task_keys=task_keys, var_options=var_options, direct=direct)
        self._refuse_colliding_facts()
        problem = refusal('gpuops.fleet.pct', loose_booleans('connection', self._load_name, direct=direct,
                                                             variables=var_options, keys=task_keys))
        if problem:
            raise AnsibleError(problem + '; nothing was run')

    def _refuse_colliding_facts(self) -> None:
        """Fail (with inject_facts_as_vars on) or warn (off) when a fact is named like one of this plugin's variables.

        A container's root controls its python3, so any task in it can return ansible_facts; a fact outranks the
        inventory's host variables, and ansible-core filters only its builtin connections' names out of facts."""
        pairs = colliding_facts(self.get_option('_facts'), C.config.get_plugin_vars('connection', self._load_name))
        if not pairs:
            return
        by_key: dict[str, list[str]] = {}
        for key, name in pairs:
            by_key.setdefault(key, []).append(name)
        names = ', '.join('%s (ansible_facts.%s)' % (' or '.join(found), key) for key, found in by_key.items())
        if C.INJECT_FACTS_AS_VARS:
            raise AnsibleError(
                'gpuops.fleet.pct: refused: this host has facts named like the connection variables %s. A module that '
                'ran in the container returned them, or the fact cache holds them; facts outrank the inventory, so they '
                'would choose the container, the node or how they are reached. Nothing was run. Clear the facts '
                '(meta: clear_facts, or the fact cache) and set inject_facts_as_vars = False (ANSIBLE_INJECT_FACT_VARS='
                'False) so that no fact can become a variable.' % names)
        display.warning('gpuops.fleet.pct: this host has facts named like the connection variables %s; ignored, since '
                        'inject_facts_as_vars is off and a fact cannot set a variable.' % names)

    # -- the command the node runs --------------------------------------------------------------

    def _vmid(self) -> int:
        vmid = self.get_option('vmid')
        if vmid is None:
            raise AnsibleError('gpuops.fleet.pct: no container id; set ansible_pct_vmid (or pct_vmid, proxmox_vmid) for this host')
        return int(vmid)

    def _node_argv(self, container_argv: list[str]) -> list[str]:
        """argv the node runs to execute container_argv inside the container, environment cleared."""
        vmid = str(self._vmid())
        argv = []
        if self.get_option('node_become'):
            argv += ['sudo', '-n', '--']
        if self.get_option('exec_method') == 'lxc-attach':
            argv += [self.get_option('lxc_attach_executable'), '-n', vmid, '--clear-env', '--']
        else:
            argv += [self.get_option('pct_executable'), 'exec', vmid, '--keep-env', '0', '--']
        return argv + container_argv

    def _new_markers(self) -> tuple[str, str, str]:
        """One-off words on stderr: the node shell's before pct, the container shell's before the command,
        and the node shell's after pct returned (with its exit code)."""
        nonce = secrets.token_hex(8)
        markers = tuple('gpuops-pct-%s-%s' % (stage, nonce) for stage in ('node', 'container', 'end'))
        self._markers = tuple(marker.encode() for marker in markers)
        return markers

    def _node_command(self, container_script: str, node_limit: int = 0) -> str:
        """One string for the node's POSIX login shell; container_script runs under /bin/sh in the container.
        node_limit: seconds the node's own C(timeout) allows pct exec (0: none)."""
        node_marker, container_marker, end_marker = self._new_markers()
        env = ' '.join('%s=%s' % pair for pair in CONTAINER_ENV)
        script = "printf '%%s\\n' %s >&2; export %s\n%s" % (container_marker, env, container_script)
        argv = [CONTAINER_SHELL, '-c', script]
        limit = self.get_option('command_timeout')
        if limit:
            argv = ['timeout', '-k', '5', str(int(limit))] + argv
        node_argv = self._node_argv(argv)
        if node_limit:
            node_argv = ['timeout', '-k', '5', str(int(node_limit))] + node_argv
        words = ' '.join(shlex.quote(word) for word in node_argv)
        locale = 'LC_ALL=%s ' % PCT_LOCALE if self.get_option('exec_method') == 'pct' else ''
        return ("printf '%%s\\n' %s >&2; %s%s; rc=$?; printf '%%s %%s\\n' %s \"$rc\" >&2; exit \"$rc\""
                % (node_marker, locale, words, end_marker))

    def _wrap(self, cmd: str) -> str:
        """Ansible's shell command line, run by /bin/sh inside the container."""
        return self._node_command(cmd)

    # -- errors -------------------------------------------------------------------------------

    def _node_label(self) -> str:
        user = self.get_option('remote_user')
        return '%s%s' % ('%s@' % user if user else '', self.host)

    def _tool(self) -> str:
        if self.get_option('exec_method') == 'lxc-attach':
            return self.get_option('lxc_attach_executable')
        return self.get_option('pct_executable')

    def _strip_markers(self, data: bytes) -> tuple[bytes, list[bool]]:
        """data without the marker lines; which of the node, container and end markers it had."""
        seen = []
        for index, marker in enumerate(self._markers):
            tail = b' -?\\d+' if index == 2 else b''
            # a tty may end lines in \r\n, and a second tty (lxc-attach's own pty) in \r\r\n
            found = re.search(b'(?m)^' + re.escape(marker) + tail + b'\r*\n', data) if marker else None
            if found:
                data = data[:found.start()] + data[found.end():]
            seen.append(found is not None)
        return data, seen

    def _explain_ssh(self, text: str) -> AnsibleConnectionFailure:
        """SSH did not run the node command: say why in one line."""
        text = text.replace('\r', '')
        node = self._node_label()
        if _HOSTKEY_CHANGED in text:
            return AnsibleConnectionFailure(
                'host key of node %s does not match known_hosts (REMOTE HOST IDENTIFICATION HAS CHANGED); '
                'if the node was reinstalled, replace its key in known_hosts. Host key checking stays on.' % self.host)
        if _HOSTKEY_FAILED in text:
            return AnsibleConnectionFailure(
                'host key verification failed for node %s: its key is not in known_hosts (set UserKnownHostsFile '
                'in ansible_ssh_common_args, or add the verified key). Host key checking stays on.' % self.host)
        auth = _AUTH_FAILED.search(text)
        if auth:
            return AnsibleAuthenticationFailure(
                'SSH authentication to node %s failed (%s): check ansible_user and ansible_ssh_private_key_file.'
                % (node, auth.group(0)))
        connect = _SSH_CONNECT.search(text)
        if connect:
            reason = connect.group(1) or connect.group(2) or connect.group(0)
            hint = ' (is sshd running on the node?)' if 'refused' in reason else ''
            return _SSHFailed('SSH to node %s failed: %s%s' % (node, reason.strip(), hint))
        return _SSHFailed('SSH to node %s failed before the node ran pct: %s'
                          % (node, _first_line(text) or 'ssh exited 255 without a message'))

    def _explain_node(self, rc: int, text: str) -> AnsibleConnectionFailure:
        """The node ran its command but the container's shell never started: pct, sudo or lxc-attach said no."""
        text = text.replace('\r', '')  # a tty's line ends
        vmid = str(self._vmid())
        node = self._node_label()
        tool = self._tool()
        stopped = _NOT_RUNNING.search(text)
        if stopped and stopped.group(1) == vmid:
            return AnsibleConnectionFailure(
                "container '%s' not running! (node %s): start it (pct start %s) or leave it out of the play."
                % (vmid, node, vmid))
        elsewhere = _NO_CONFIG.search(text)
        if elsewhere and elsewhere.group(2) == vmid:
            return AnsibleConnectionFailure(
                "container %s is not on node %s (%s): pct found no nodes/%s/lxc/%s.conf there; no such vmid on this "
                "node (`pct list` on it shows its containers). A mistyped ansible_pct_vmid, or a container that moved: "
                "use an inventory that tracks nodes (gpuops.fleet.proxmox_gpu reads them from the "
                "Proxmox API) so that ansible_host names the node that hosts the container now."
                % (vmid, elsewhere.group(1), self.host, elsewhere.group(1), vmid))
        if self._tool_missing(rc, text, tool):
            return AnsibleConnectionFailure(
                '%s not found on node %s: is it a Proxmox VE node? Set ANSIBLE_PCT_EXECUTABLE (or '
                'ANSIBLE_PCT_LXC_ATTACH_EXECUTABLE, or the [pct_connection] ini keys) if the tool lives elsewhere.'
                % (tool, node))
        if self.get_option('node_become') and 'sudo' in text and any(p in text for p in _SUDO_PROBLEMS):
            return AnsibleConnectionFailure(
                'node_become: sudo on node %s refused to run %s without a password (%s); add a NOPASSWD sudoers '
                'rule for it (see the README).' % (node, tool, _first_line(text)))
        if self.get_option('node_become') and self._tool_missing(rc, text, 'sudo'):
            return AnsibleConnectionFailure('node_become: sudo is not installed on node %s.' % node)
        if _NO_KEEP_ENV.search(text):
            return AnsibleConnectionFailure(
                'pct on node %s does not know --keep-env (pve-container before 5.0.9, Proxmox VE before 8.2): '
                'upgrade the node, or use ansible_pct_exec_method=lxc-attach.' % node)
        if self.get_option('exec_method') == 'lxc-attach' and text.lstrip().startswith('lxc-attach'):
            return AnsibleConnectionFailure(
                'lxc-attach could not enter container %s on node %s (%s): it may be stopped or not on this node; '
                'exec_method=pct gives clearer errors.' % (vmid, node, _first_line(text)))
        return AnsibleConnectionFailure('%s could not enter container %s on node %s (exit code %d): %s'
                                        % (tool, vmid, node, rc, _first_line(text) or 'no message'))

    def _explain_after_start(self, rc: int, stderr: str, finished: bool) -> AnsibleConnectionFailure | None:
        """The command started in the container; None when rc and output are simply the command's.

        finished: the node shell printed the end marker, so pct returned and rc is its exit code.
        """
        vmid = str(self._vmid())
        if rc == 255 and not finished:
            lines = [line.strip() for line in stderr.replace('\r', '').splitlines() if line.strip()]
            said = _SSH_DROPPED.match(lines[-1]) if lines else None
            return AnsibleConnectionFailure(
                'SSH connection to node %s dropped while the command ran in container %s (%s); it was not retried, '
                'and the command may still be running in the container.'
                % (self._node_label(), vmid, said.group(0) if said else 'ssh exited 255 before the command ended'))
        if rc >= 128 and self.get_option('exec_method') == 'pct' and self._container_stopped():
            return AnsibleConnectionFailure(
                "container '%s' stopped while the task ran (node %s, exit code %d): the command did not finish."
                % (vmid, self._node_label(), rc))
        return None

    def _container_stopped(self) -> bool:
        """Ask pct on the node whether the container is still running (after a command died of a signal)."""
        argv = (['sudo', '-n', '--'] if self.get_option('node_become') else []) + \
            [self.get_option('pct_executable'), 'status', str(self._vmid())]
        cmd = self._build_command(self.get_option('ssh_executable'), 'ssh', self.host,
                                  ' '.join(shlex.quote(word) for word in argv))
        try:
            status = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, check=False,
                                    timeout=int(self.get_option('timeout')) + 10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return status.returncode == 0 and b'status: stopped' in status.stdout

    @staticmethod
    def _tool_missing(rc: int, text: str, tool: str) -> bool:
        """The node's shell (rc 127) or sudo (rc 1) could not find tool."""
        name = re.escape(tool)
        if rc == 1:
            return re.search(r'(?m)^sudo: %s: command not found$' % name, text) is not None
        shells = (r'(?m)^(?:\S+: )?(?:line \d+: |\d+: )?%s: (?:No such file or directory|(?:command )?not found)$',
                  r'(?m)^\S+: ?\d+: (?:no such file or directory|command not found): %s$')
        return rc == 127 and any(re.search(pattern % name, text) for pattern in shells)

    def _judge(self, rc: int, stdout: bytes, stderr: bytes) -> tuple[int, bytes, bytes]:
        """The command's own result, markers removed; or raise where SSH or the node failed."""
        stdout, in_out = self._strip_markers(stdout)
        stderr, in_err = self._strip_markers(stderr)
        node_seen, container_seen, finished = (a or b for a, b in zip(in_out, in_err))
        text = to_text(stderr) + '\n' + to_text(stdout)
        if container_seen:
            clear = self._explain_after_start(rc, to_text(stderr), finished)
            if clear is not None:
                raise clear
            return rc, stdout, stderr
        if rc == 0:
            return rc, stdout, stderr
        if node_seen:
            raise self._explain_node(rc, text)
        if _BROKEN_MUX in text:
            raise AnsibleControlPersistBrokenPipeError('ControlPersist broken pipe: %s' % _first_line(text))
        raise self._explain_ssh(text)

    def _bare_run(self, cmd: list[bytes], in_data: bytes | None, sudoable: bool = True,
                  checkrc: bool = True) -> tuple[int, bytes, bytes]:
        try:
            rc, stdout, stderr = super()._bare_run(cmd, in_data, sudoable=sudoable, checkrc=False)
        except AnsibleControlPersistBrokenPipeError:
            raise
        except AnsibleConnectionFailure as failure:
            if isinstance(failure, AnsibleAuthenticationFailure):
                raise
            raise self._explain_ssh(to_text(failure)) from None
        return self._judge(rc, stdout, stderr)

    def _send_initial_data(self, fh: t.Any, in_data: bytes, ssh_process: subprocess.Popen) -> None:
        """As ssh's, but an ssh that closed its stdin gets SSH_EXIT_GRACE_S to exit: then the run goes on to read its
        exit code and stderr, which say why (_judge)."""
        try:
            super()._send_initial_data(fh, in_data, ssh_process)
        except AnsibleConnectionFailure:
            if not _exited_within(ssh_process, SSH_EXIT_GRACE_S):
                raise
            try:
                fh.close()
            except OSError:
                pass

    def _retrying(self, cmd: list[bytes], attempt: t.Callable[[], tuple[int, bytes, bytes]]) -> tuple[int, bytes, bytes]:
        """Run attempt(); again once on the ControlPersist broken-pipe race (as ansible-core's ssh plugin does),
        and up to reconnection_retries times when SSH failed before the node ran anything."""
        tries = int(self.get_option('reconnection_retries')) + 1
        pipe_race_retried = False
        failures = 0
        while True:
            try:
                return attempt()
            except AnsibleControlPersistBrokenPipeError as race:
                if pipe_race_retried:
                    raise self._explain_ssh(to_text(race)) from None
                pipe_race_retried = True
                display.vvv('RETRYING BECAUSE OF CONTROLPERSIST BROKEN PIPE', host=self.host)
            except _SSHFailed:
                failures += 1
                if failures >= tries:
                    raise
                pause = min(2 ** (failures - 1) - 1, 30)
                display.vv('ssh_retry: attempt %d failed, pausing for %d seconds' % (failures, pause), host=self.host)
                time.sleep(pause)
            self._renew_sshpass_pipe(cmd)

    def _renew_sshpass_pipe(self, cmd: list[bytes]) -> None:
        """sshpass reads the password from a pipe that one run used up."""
        conn_password = self.get_option('password') or self._play_context.password
        if self.get_option('password_mechanism') == 'sshpass' and conn_password and cmd and cmd[0] == b'sshpass':
            self.sshpass_pipe = os.pipe()
            cmd[1] = b'-d' + to_bytes(self.sshpass_pipe[0], nonstring='simplerepr', errors='surrogate_or_strict')

    def _run(self, cmd: list[bytes], in_data: bytes | None, sudoable: bool = True,
             checkrc: bool = True) -> tuple[int, bytes, bytes]:
        return self._retrying(cmd, lambda: self._bare_run(cmd, in_data, sudoable=sudoable, checkrc=checkrc))

    # -- one SSH connection per node ----------------------------------------------------------

    def _ensure_master(self) -> None:
        """Open the node's ControlPersist master once, under a lock, so parallel forks share it.

        Without this, forks that start together each find no control socket and each open their own
        connection. A failure here is ignored: the real command reports it.
        """
        if self.get_option('password') or self._play_context.password:
            return
        cmd = self._build_command(self.get_option('ssh_executable'), 'ssh', '-N', '-f', self.host)
        if not getattr(self, '_persistent', False) or not self.control_path or not self.control_path_dir:
            return  # no ControlPersist, or a ControlPath of the user's own in ssh args
        socket_path = self.control_path % dict(directory=unfrackpath(self.control_path_dir))
        if '%' in socket_path or os.path.exists(socket_path):
            return  # ssh expands %h-style tokens itself: no path to watch; or the master is up
        timeout = int(self.get_option('timeout'))
        with open(socket_path + '.lock', 'a+') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.path.exists(socket_path):
                    return
                lock.seek(0)
                failed_at = lock.read().strip()
                if failed_at and time.time() - float(failed_at) < timeout + 5:
                    return  # another fork just failed to connect: don't queue behind it, fail on our own
                display.vvv('SSH: opening master connection to node %s' % self.host, host=self.host)
                try:
                    rc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, timeout=timeout + 5, check=False).returncode
                except (OSError, subprocess.TimeoutExpired) as ex:
                    display.vvv('SSH: master connection not opened: %s' % ex, host=self.host)
                    rc = -1
                lock.seek(0)
                lock.truncate()
                if rc != 0:
                    lock.write('%f' % time.time())
            except ValueError:
                pass  # a lock file that is not ours to read: just go on
            finally:
                lock.flush()
                fcntl.flock(lock, fcntl.LOCK_UN)

    # -- public methods -----------------------------------------------------------------------

    def _connect(self) -> Connection:
        self._vmid()
        return self

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True) -> tuple[int, bytes, bytes]:
        """Run cmd inside the container: ssh NODE pct exec VMID -- /bin/sh -c CMD."""
        ConnectionBase.exec_command(self, cmd, in_data=in_data, sudoable=sudoable)
        self.host = self.get_option('host') or self._play_context.remote_addr
        display.vvv('PCT EXEC in container %s on node %s' % (self._vmid(), self.host), host=self.host)
        self._ensure_master()
        return super().exec_command(self._wrap(cmd), in_data=in_data, sudoable=sudoable)

    def put_file(self, in_path: str, out_path: str) -> tuple[int, bytes, bytes]:  # type: ignore[override]
        """Stream a local file into the container: cat > OUT, no temporary file on the node."""
        ConnectionBase.put_file(self, in_path, out_path)
        self.host = self.get_option('host') or self._play_context.remote_addr
        display.vvv('PUT %s TO %s in container %s' % (in_path, out_path, self._vmid()), host=self.host)
        if not os.path.exists(to_bytes(in_path, errors='surrogate_or_strict')):
            raise AnsibleFileNotFound('file or module does not exist: %s' % to_native(in_path))
        self._ensure_master()
        remote = self._node_command('cat > %s' % shlex.quote(to_text(out_path)), self.get_option('transfer_timeout'))
        cmd = self._build_command(self.get_option('ssh_executable'), 'ssh', self.host, remote)
        return self._retrying(cmd, lambda: self._stream(cmd, in_path, out_path, 'put'))

    def fetch_file(self, in_path: str, out_path: str) -> tuple[int, bytes, bytes]:  # type: ignore[override]
        """Stream a file out of the container into a temporary file next to OUT, renamed to OUT once complete."""
        ConnectionBase.fetch_file(self, in_path, out_path)
        self.host = self.get_option('host') or self._play_context.remote_addr
        display.vvv('FETCH %s TO %s from container %s' % (in_path, out_path, self._vmid()), host=self.host)
        self._ensure_master()
        remote = self._node_command('exec cat < %s' % shlex.quote(to_text(in_path)), self.get_option('transfer_timeout'))
        cmd = self._build_command(self.get_option('ssh_executable'), 'ssh', self.host, remote)
        return self._retrying(cmd, lambda: self._stream(cmd, in_path, out_path, 'fetch'))

    # -- streaming ----------------------------------------------------------------------------

    def _stream(self, cmd: list[bytes], in_path: str, out_path: str, direction: str) -> tuple[int, bytes, bytes]:
        started = time.monotonic()
        if direction == 'put':
            with open(to_bytes(in_path, errors='surrogate_or_strict'), 'rb') as local_file:
                rc, stderr, dummy = self._pump(cmd, local_file, direction)
            self._check_deadline(rc, in_path, direction, started)
            return self._stream_result(rc, stderr, in_path, direction)
        b_out = to_bytes(out_path, errors='surrogate_or_strict')
        directory, name = os.path.split(b_out)
        fd, b_partial = tempfile.mkstemp(dir=directory or b'.', prefix=b'.' + name + b'.', suffix=b'.part')
        try:
            umask = os.umask(0o022)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # what open(OUT, 'wb') would have given
            with os.fdopen(fd, 'wb', buffering=0) as local_file:
                rc, stderr, write_error = self._pump(cmd, local_file, direction)
            if write_error is not None:
                raise AnsibleError('failed to fetch %s from container %s: writing %s failed: %s; ssh was stopped and '
                                   'the partial file removed' % (to_native(in_path), self._vmid(), to_native(out_path),
                                                                 write_error.strerror or write_error))
            self._check_deadline(rc, in_path, direction, started)
            result = self._stream_result(rc, stderr, in_path, direction)
            os.replace(b_partial, b_out)
            return result
        except BaseException:
            try:
                os.unlink(b_partial)
            except FileNotFoundError:
                pass
            raise

    def _check_deadline(self, rc: int, in_path: str, direction: str, started: float) -> None:
        """The node's timeout (exit 124, or 137 after its KILL) ended the transfer: say so, naming the option."""
        limit = self.get_option('transfer_timeout')
        # 124/137 before the limit is something else (the in-container command_timeout, an OOM kill)
        if limit and rc in (124, 137) and time.monotonic() - started >= limit:
            raise AnsibleError('failed to %s %s %s container %s: the transfer did not finish within %d s on node %s '
                               '(transfer_timeout); pct exec was stopped there' % (
                                   direction, to_native(in_path), 'into' if direction == 'put' else 'from',
                                   self._vmid(), int(limit), self._node_label()))

    def _stream_result(self, rc: int, stderr: bytes, in_path: str, direction: str) -> tuple[int, bytes, bytes]:
        """Raise for SSH, node or command failures of a put/fetch; markers removed."""
        rc, dummy, stderr = self._judge(rc, b'', stderr)
        if rc != 0:
            raise AnsibleError('failed to %s %s %s container %s: %s' % (
                direction, to_native(in_path), 'into' if direction == 'put' else 'from',
                self._vmid(), _first_line(to_text(stderr)) or 'exit code %d' % rc))
        return rc, b'', stderr

    def _pump(self, cmd: list[bytes], local_file: t.BinaryIO, direction: str) -> tuple[int, bytes, OSError | None]:
        """Run ssh; copy local_file to its stdin (put) or its stdout to local_file (fetch), CHUNK at a time.

        Returns ssh's exit code, its stderr, and the error that writing local_file raised (ssh is then killed,
        so that it never blocks on a full pipe while this waits for it).
        """
        display.vvv('SSH: STREAM %s' % ' '.join(shlex.quote(to_text(c)) for c in cmd), host=self.host)
        proc = self._spawn_ssh(cmd, direction)
        pump = _Pump(proc, local_file, direction)
        finished = False
        try:
            pump.run()
            finished = pump.write_error is None
        finally:
            pump.close(finished)
            self._cleanup_shm()
        return pump.rc, bytes(pump.stderr), pump.write_error

    def _spawn_ssh(self, cmd: list[bytes], direction: str) -> subprocess.Popen:
        """ssh started with pipes (stdin only for a put), the password handed to sshpass when there is one."""
        # ansible-core 2.19 hands a password to ssh through shared memory (_init_shm); 2.16-2.18 only through sshpass
        popen_kwargs = self._init_shm() if hasattr(self, '_init_shm') else {}
        if getattr(self, 'sshpass_pipe', None):   # set by _build_command from 2.19; absent before a password on 2.16-2.18
            popen_kwargs['pass_fds'] = self.sshpass_pipe
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if direction == 'put' else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen_kwargs)
        except OSError as ex:
            self._cleanup_shm()
            raise AnsibleError('Unable to execute ssh command line on a controller: %s' % ex) from None
        conn_password = self.get_option('password') or self._play_context.password
        if getattr(self, 'sshpass_pipe', None) and conn_password:
            os.close(self.sshpass_pipe[0])
            try:
                os.write(self.sshpass_pipe[1], to_bytes(conn_password) + b'\n')
            except OSError:
                pass
            os.close(self.sshpass_pipe[1])
            self.sshpass_pipe = None
        return proc

    def _cleanup_shm(self) -> None:
        """Drop the shared memory that handed the password to ssh's askpass helper."""
        if getattr(self, 'shm', None):
            self.shm.close()
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
            self.shm = None
