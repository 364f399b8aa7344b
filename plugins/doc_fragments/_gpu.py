# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Private documentation fragment: may change in any release.

from __future__ import annotations


class ModuleDocFragment(object):

    # Options shared by gpu_status and gpu_release (argument_spec: _gpu_engine.GPU_COMMON_ARGS)
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
      - Seconds one NVML call may take. The driver can hang; a call that does not return in time marks its GPU
        as failed (the task fails, naming the GPU) instead of hanging the task.
      - Must be more than 0.
    type: float
    default: 5.0
  redact:
    description:
      - Regular expressions whose matches are masked in the command lines this module returns, added to the
        defaults.
      - A pattern with one group masks only the group; otherwise the whole match is masked.
      - The defaults mask the values of C(--api-key X), C(--token X), C(--password X), C(--secret X) (also with
        C(=)), and of C(token=), C(*_TOKEN=), C(password=), C(secret=).
    type: list
    elements: str
    default: []
  cmdline:
    description:
      - Whether to return command lines (redacted) of holders and clients. Set to V(false) to leave them out.
    type: bool
    default: true
requirements:
  - psutil (on the target)
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
    link: https://github.com/gpuops/fleet/blob/main/docs/design.md
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
