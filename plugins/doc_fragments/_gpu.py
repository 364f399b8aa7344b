# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Private documentation fragment: may change in any release.

from __future__ import annotations


class ModuleDocFragment(object):

    # gpus, requirements and notes, shared by gpu_info and gpu_release
    DOCUMENTATION = r"""
options:
  gpus:
    description:
      - The GPUs to look at, each given as an NVML index (as NVML numbers them on this host or inside this
        container), a UUID (C(GPU-...)) or a PCI bus id (C(00000000:18:00.0), short forms accepted).
      - An empty list means every GPU NVML sees.
      - A value that names no GPU fails the task before anything else happens; the message lists the GPUs that exist.
    type: list
    elements: str
    default: []
requirements:
  - psutil (on the target, for gpuops.fleet.gpu_release; gpuops.fleet.gpu_info does not need it)
  - nvidia-ml-py (on the target, C(import pynvml))
notes:
  - Holders are found by reading C(/proc/PID/fd) and C(/proc/PID/maps) of every process (for a defunct thread-group
    leader, those of one of its live threads). A process that maps a C(/dev/nvidia*) node has a GPU context and is
    a holder; one that only has the files open (a monitor, an exporter, NVML itself) is a client.
  - Device nodes are mapped to NVML devices by minor number, taken from the node's C(st_rdev) when it is a character
    device (so C(lxc.mount.entry /dev/nvidia3 dev/nvidia0) is seen as minor 3) and from its name otherwise; a container
    that sees C(/dev/nvidia4) as NVML index 0 is handled.
  - A mapping of a GPU's node means that the process has a CUDA context somewhere, not that it holds this GPU; every
    CUDA process maps the node of every GPU visible to it. Where the memory is comes from NVML's per-GPU process lists.
  - The module's own process, its ancestors and its children are never counted.
  - NVML's process list is used as a hint only; inside a container it may name dead pids, hide processes of other
    PID namespaces, or (older drivers) give host pids.
seealso:
  - name: GPU_FACTS
    description: What a real H200 does when its processes die; the facts these modules are built on.
    link: https://github.com/gpuops/fleet/blob/main/docs/GPU_FACTS.md
"""

    # How GPUs are read (argument_spec: _params.READ_ARGS): gpu_info's top-level options;
    # gpu_release documents the same ones under its advanced option.
    READING = r"""
options:
  threshold_mib:
    description:
      - The most memory, in MiB, beyond the driver's reserved floor that still counts as free.
      - Compared with NVML's v2 C(used), which leaves the reserved floor out. NVML's v1 C(used) never reaches
        zero on a real GPU (it includes about 615 MiB of reserved memory on an H200).
      - Must be 0 or more.
    type: int
    default: 64
  nvml_timeout:
    description:
      - Seconds one NVML call may take. The driver can hang in the kernel; NVML runs in a helper process, which is
        killed and abandoned when a call does not return in time, so the GPU is marked failed (the task fails,
        naming the GPU or C(nvmlInit)) instead of hanging the task, and nothing of the task is left holding
        Ansible's pipes or the GPU locks.
      - Must be more than 0.
    type: float
    default: 5.0
  reserved_floor_mib:
    description:
      - Only for drivers whose NVML has no v2 memory call (C(nvmlDeviceGetMemoryInfo_v2), drivers before R510).
        Their v1 C(used) includes the driver's reserved memory (about 615 MiB on an H200), so it never reads as
        free, and without this option such a GPU fails as C(memory unverifiable on this driver) (gpu_release then
        signals nothing and never resets it).
      - When set, C(used) is v1 C(used) minus this many MiB, and the result says that it was estimated
        (C(memory.estimated), a diagnosis line); gpu_release then says C(free by estimate), never C(verified free).
        Use the v1 C(used) of an idle GPU of the same model and driver.
      - Ignored when the v2 call exists. Must be 0 or more.
    type: int
  redact:
    description:
      - Regular expressions whose matches are masked in the command lines this module returns, added to the
        defaults.
      - A pattern with exactly one group masks only the group (the whole match when that group did not take part);
        otherwise the whole match is masked.
      - The defaults mask the value of an option whose name says secret (C(--api-key X), C(--token X), C(--hf-token=X),
        C(--token:X), C(--password X), C(--pass X), C(--db-pass X), C(--passphrase X), C(--private-key X), C(--jwt X),
        C(--secret X), any C(--WORD-key X) such as C(--openai-key) or C(--wandb-key) but not C(--input-key),
        C(--sort-key) or C(--public-key)), the same names as C(NAME=X) (C(HF_TOKEN=X), C(MYSQL_PWD=X)), as JSON or Python
        keys (C({"api_key":"X"})) and as HTTP headers (C(X-Api-Key), C(X-Auth-Token), C(Authorization), C(Cookie)), a glued C(-pX) unless X
        is a port (C(-p8080)), C(sshpass -p X), C(redis-cli -a X), C(curl -u user:X) and the password of
        C(scheme://user:password@host).
      - Not masked, on purpose, a name that goes on (C(--password-file), C(--key-file), C(--max-tokens)), C(--key)
        alone (a key file), a separate C(-p X) of other programs (a port far more often; mysql's C(-p X) prompts and
        X is the database), and C(-u uid:gid) of programs other than curl.
    type: list
    elements: str
    default: []
  cmdline:
    description:
      - Whether to return command lines (redacted) of holders and clients. Set to V(false) to leave them out.
    type: bool
    default: true
"""

    ATTRIBUTES = r"""
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
  idempotent:
    description:
      - When run twice in a row with the same options, the second run reports no change (C(changed=false)), in check
        mode as well.
  platform:
    description: Target OS/families that can be operated against.
    platforms: posix
"""

    # The modules of the action group gpu (meta/runtime.yml), for module_defaults.
    ACTIONGROUP_GPU = r"""
attributes:
  action_group:
    description: Use C(group/gpuops.fleet.gpu) in C(module_defaults) to set defaults for this module.
    support: full
    membership:
      - gpuops.fleet.gpu
"""
