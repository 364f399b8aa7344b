#!/usr/bin/python
# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_info
short_description: Who holds each NVIDIA GPU, and why its memory is not free
version_added: 0.2.0
description:
  - This module was called C(gpuops.fleet.gpu_status) before 0.2.0; that name still works, redirected here, and is
    deprecated (removed in 1.0.0).
  - Reports, for each selected GPU, its memory as NVML sees it, the processes that hold a context on it (found in
    C(/proc), not taken from NVML), the NVML-only clients that merely have the device files open, and what NVML's own
    process list says and whether it can be trusted here.
  - Finds what C(fuser) and C(nvidia-smi) miss, such as a defunct thread-group leader whose live threads still hold
    the GPU, a forked child that keeps a dead parent's memory through inherited file descriptors, and a process that
    closed its files but still maps the device.
  - "Pins each holder to the GPUs it really holds. Every CUDA process maps the node of every GPU visible to it, so a
    mapping only says that it has a context somewhere. NVML's per-GPU process list, read in the module's own PID
    namespace, says where the memory is: a holder NVML names holds exactly the GPUs where it is named. A holder NVML
    does not name is pinned to GPU N only when NVML names a dead or invisible pid on N (or shows memory no process
    it lists accounts for), the holder maps a context on N (the node mapped 3 times on driver 580), and no other
    holder fits that evidence. Otherwise it is unpinned, and C(ambiguous_gpus) says where two holders fit."
  - NVML's "pid P on GPU N" is accepted only when P maps N's node with a context. Any other entry of a live pid
    (an old driver giving host pids, or a reused pid) is stale (RV(nvml_stale)); its memory counts as orphaned, and P
    is pinned by its own mappings alone. Distrust is per entry, so a process that starts or exits never changes how
    the others are pinned.
  - A GPU NVML cannot describe (lost, or its calls fail) keeps its place by its minor (RV(unknown_gpus)); a holder
    with a context on it holds it, and it is never reported free.
  - Finds jobs, holders joined directly by connected TCP sockets that share a rank signature (the same
    distributed-run settings, a distributed launcher as common parent, or rank siblings), and lists other
    connected holders as RV(linked). Residue (memory the surviving ranks keep on a dead rank's GPU) is charged to a
    job only when the run saw that rank die; otherwise it is unattributed.
  - Returns C(diagnosis), a list of plain sentences, one per finding, each naming the pid and the remedy.
  - Says whether the next job can start (RV(ready)); each GPU gets C(ready) and C(not_ready), one entry per failed
    check (C(free), C(capacity), C(nvml), C(retired_pages), C(row_remap), C(ecc_mode), C(recovery_action),
    C(device_access)), each with its reason and remedy.
  - Read-only; C(changed) is always false.
author:
  - gpuops (@gpuops)
extends_documentation_fragment:
  - gpuops.fleet._gpu
  - gpuops.fleet._gpu.reading
  - gpuops.fleet._gpu.attributes
  - gpuops.fleet._gpu.actiongroup_gpu
attributes:
  check_mode:
    support: full
    details: This module does not change anything.
  diff_mode:
    support: N/A
    details: This module does not change anything.
  idempotent:
    support: full
  platform:
    support: full
    platforms: posix
options:
  shm_residue:
    description:
      - Read C(/dev/shm) for GPU stacks' shared-memory residue (RV(shm_residue)); from a Proxmox node, each running
        container's too, through its init's root (RV(shm_residue_by_container)).
      - Residue is a file (a segment, or a POSIX semaphore C(sem.NAME)) whose name has a GPU stack's prefix (C(nccl-),
        C(sgl_), C(torch_), C(vllm), C(psm_), and O(shm_prefixes)), that no live process has open or mapped (found by
        the file itself, its device and inode, in every process's maps on the node and in every container), and that
        was last changed before the check started. Anything else is never residue. A file on a mount that several
        folders show is listed once, under the first (this host's, then by vmid).
      - A folder is read one part at a time, never through a symlink, by a helper bounded in time; one that cannot be
        judged (a link in its path, no answer, a process not read that may use it) is in RV(shm_skipped).
      - Leaked segments of dead processes make the next launch of an inference server fail, even on a free GPU.
    type: bool
    default: true
  shm_prefixes:
    description:
      - More name prefixes that mark a C(/dev/shm) file as a GPU stack's, beside the built-in ones. Each is a file
        name's start, without C(/).
    type: list
    elements: str
    default: []
  need_mib:
    description:
      - The next job needs this many MiB free on each selected GPU (NVML v2 free, total less reserved less used); a
        GPU with less is not ready (check C(capacity), with both numbers).
      - Mutually exclusive with O(need_fraction).
    type: int
  need_fraction:
    description:
      - The next job takes this fraction (0 to 1) of each selected GPU, as an inference engine computes it (vLLM's
        C(gpu_memory_utilization), SGLang's C(mem_fraction_static)) of what CUDA calls total (NVML v2 total less
        reserved), and needs it free beside its own CUDA context (526 MiB, measured with torch on an H200).
      - Mutually exclusive with O(need_mib).
    type: float
  health:
    description:
      - Ask NVML whether each selected GPU needs a reset or a reboot (RV(gpus[].health)) - pending retired pages,
        a pending or failed row remap, an ECC mode change pending, the driver's recovery action. A call the GPU does
        not support (an H200 has no page retirement) is not applicable, never a reason for not ready.
    type: bool
    default: true
  device_access:
    description:
      - In a container or on a host that is not a Proxmox node, open each selected GPU's device files (found by
        their device number), C(nvidiactl) and C(nvidia-uvm), read and write as CUDA opens them, and close them; one
        that does not open makes the GPU not ready (check C(device_access)).
      - From a Proxmox node, read inside each running container a selected GPU is passed into (through
        C(lxc-attach), with the container's C(python3)), since access is each container's own (its device cgroup
        and C(/dev)); such an entry names its C(vmid). A container whose config passes a selected GPU in but
        cannot open it (C(deny-write), or raw cgroup rules without rw; see RV(gpus[].passed_unusable)) gets one
        entry for that GPU from its config, naming the rule that blocks it, whether it runs or not.
    type: bool
    default: true
seealso:
  - module: gpuops.fleet.gpu_release
"""

EXAMPLES = r"""
- name: Who holds the GPUs of this container
  gpuops.fleet.gpu_info:
  register: gpu

- name: Show the diagnosis
  ansible.builtin.debug:
    var: gpu.diagnosis

- name: Look at two GPUs only, by index and by UUID, without command lines
  gpuops.fleet.gpu_info:
    gpus:
      - 0
      - GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10
    cmdline: false

- name: From the Proxmox node, every container's holders and each GPU's MiB by container
  gpuops.fleet.gpu_info:
  delegate_to: pve1
  register: node_gpus

- name: Containers holding GPU 0 of the node
  ansible.builtin.debug:
    msg: "{{ node_gpus.gpus[0].by_container }}"

- name: Fail when a GPU is busy (more than 256 MiB beyond the reserved floor)
  gpuops.fleet.gpu_info:
    threshold_mib: 256
  register: gpu
  failed_when: not gpu.all_free

- name: Fail unless the next server (gpu_memory_utilization 0.9) can start on every GPU
  gpuops.fleet.gpu_info:
    need_fraction: 0.9
  register: gpu
  failed_when: not gpu.ready

- name: Mask connection strings too
  gpuops.fleet.gpu_info:
    redact:
      - '://[^:/]+:([^@]+)@'
"""

RETURN = r"""
missing_library:
  description: On a host where psutil or nvidia-ml-py does not import, the package to install (the task fails).
  returned: when a library is missing
  type: str
  sample: nvidia-ml-py
ready:
  description:
    - Whether the next job can start - every selected GPU is ready (RV(gpus[].ready)), at least one was selected,
      and no GPU stack's shared-memory residue was found (RV(shm_residue), and from a node RV(shm_residue_by_container)).
  returned: success
  type: bool
  sample: false
all_free:
  description: Whether every selected GPU uses at most O(threshold_mib) beyond its reserved floor (NVML v2 C(used)).
  returned: success
  type: bool
  sample: false
driver_version:
  description: The NVIDIA driver version NVML reports.
  returned: success
  type: str
  sample: 580.159.04
in_container:
  description: Whether the module ran in a child PID namespace (a container); NVML pids are then only partly visible.
  returned: success
  type: bool
  sample: true
view:
  description:
    - Where the module ran. C(container) (inside one, it sees only that container's processes), C(node) (a Proxmox
      VE node, found by C(/etc/pve) or C(pct); it sees every container's processes, with host pids) or C(host).
  returned: success
  type: str
  sample: node
gpus:
  description: One entry per selected GPU, in NVML order.
  returned: success
  type: list
  elements: dict
  contains:
    ready:
      description: Whether this GPU passed every check; C(not_ready) is then empty.
      type: bool
      returned: success
      sample: false
    not_ready:
      description:
        - One entry per failed check, each with C(check), C(reason) and C(remedy). C(free) (used memory above
          O(threshold_mib), with C(used_mib)), C(capacity) (with C(need_mib) and C(free_mib)), C(nvml) (the GPU
          cannot be read), C(retired_pages), C(row_remap), C(ecc_mode) and C(recovery_action) (with the NVML
          C(call)), C(device_access) (from a node, with the C(vmid) it was read in, or whose config passes the GPU
          in unusable, RV(gpus[].passed_unusable)).
      type: list
      elements: dict
      returned: success
      sample: [{"check": "capacity", "need_mib": 129367, "free_mib": 98867,
                "reason": "98,867 MiB free, 129,367 MiB needed (need_fraction 0.9 of 143,156 MiB ...)",
                "remedy": "free the GPU (gpuops.fleet.gpu_release) or start the job with less memory"}]
    health:
      description:
        - With O(health), each NVML health reading, with C(check), C(call), C(value) and C(state) (C(ok),
          C(not_applicable), C(not_ready), C(unreadable)).
      type: list
      elements: dict
      returned: when O(health) is true and the GPU could be read
      sample: [{"check": "retired_pages", "call": "nvmlDeviceGetRetiredPagesPendingStatus", "value": null,
                "state": "not_applicable"}]
    by_container:
      description:
        - Outside a container, the GPU's used MiB per container, from NVML's node view (the pid's container; a dead
          pid is charged to its heir's container). C(host) is memory of processes in no container, C(unattributed)
          memory no process accounts for. The values add up to C(memory.used_mib).
      type: dict
      returned: on a node or host
      sample: {"101": 4096, "102": 2048, "unattributed": 0}
    passed_into:
      description:
        - On a Proxmox node, the vmids whose config (C(/etc/pve/lxc/VMID.conf), a C(devN) key or an
          C(lxc.mount.entry)) passes this GPU in usable (not C(deny-write); a bound device only where the raw cgroup
          rules allow rw), read as the gpuops.fleet.proxmox_gpu inventory reads it; null where the configs cannot be
          read.
        - A passed device is the GPU its device number says (the node device's C(st_rdev)), never its name. A
          container with a process read here also counts when its own C(/dev) (read through that process's root)
          holds this GPU's device number under any name; a difference between its C(/dev) and its config (a GPU its
          config does not pass in, one it passes in that is not there, a device whose name is not its number) is a
          line of RV(diagnosis).
      type: list
      elements: int
      returned: on a node or host
      sample: [101, 102]
    passed_unusable:
      description:
        - "On a Proxmox node, the containers whose config passes this GPU in but that cannot open it read-write, read
          as RV(gpus[].passed_into) is, each with its C(vmid), the config key that passes it in (C(source): C(devN) or
          C(lxc.mount.entry)), the node's C(device), and the C(rule) that blocks it (C(deny-write), or the raw cgroup
          rule that leaves it without rw, as the config writes it: C(lxc.cgroup2.devices.deny: c 195:1 rwm)); null
          where the configs cannot be read."
        - With O(device_access), each is a C(device_access) entry of RV(gpus[].not_ready) with its C(vmid); the GPU
          is not ready, even idle.
      type: list
      elements: dict
      returned: on a node or host
      sample: [{"vmid": 101, "source": "dev1", "device": "/dev/nvidia1", "rule": "deny-write"}]
    index:
      description: NVML index (as numbered where the module runs).
      type: int
      sample: 0
    minor:
      description: Minor number of the GPU's device node (C(/dev/nvidiaMINOR)).
      type: int
      sample: 4
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10
    pci_bus_id:
      description: PCI bus id.
      type: str
      sample: "00000000:18:00.0"
    name:
      description: Product name.
      type: str
      sample: NVIDIA H200
    memory:
      description:
        - Memory in MiB; C(used) is NVML v2 C(used) (reserved floor left out), C(v1_used_mib) includes the floor.
        - On a driver without the v2 call the GPU fails as "memory unverifiable on this driver", unless
          O(reserved_floor_mib) is given; then C(used) is v1 C(used) minus that floor and C(estimated) is true.
      type: dict
      sample: {"total_mib": 143771, "used_mib": 10240, "reserved_mib": 615, "v1_used_mib": 10855}
    free:
      description: Whether C(used_mib) is at most O(threshold_mib).
      type: bool
      sample: false
    holders:
      description: Pids of the holders pinned to this GPU (NVML names them here, or the evidence pins them here).
      type: list
      elements: int
      sample: [533]
    ambiguous:
      description: Pids of holders that fit this GPU's orphaned memory equally well; none of them is pinned here.
      type: list
      elements: int
      sample: []
    mapped_by:
      description: Pids of every holder that maps this GPU's device node (with a context there or not).
      type: list
      elements: int
      sample: [533, 540]
    residue:
      description:
        - Memory kept here by the surviving ranks of a job after one of its ranks died (NVML lists no pid for it), as
          C(job) (its lowest pid), C(pids) and C(mib); null when there is none.
      type: dict
      sample: {"job": 700, "pids": [700, 702, 703], "mib": 291}
    nvml_pids_trusted:
      description: False when an NVML entry on this GPU is stale (see RV(nvml_stale)).
      type: bool
      sample: true
    protected_holders:
      description: Pids of the module's own ancestors pinned to this GPU; they count in C(free) and are never signalled.
      type: list
      elements: int
      sample: []
    blocked:
      description: Pids whose C(/proc) reads blocked (see RV(unreadable)) and that may hold this GPU; it is never taken for free on their account.
      type: list
      elements: int
      sample: []
    clients:
      description: Pids of NVML clients that have this GPU's device node open but map nothing.
      type: list
      elements: int
      sample: [611]
    nvml_processes:
      description:
        - NVML's process list for this GPU, each with its MiB and how it compares with C(/proc).
        - C(status) is C(holder), C(client), C(not_holder) (the pid exists here but holds no device node, as with
          legacy host pids) or C(not_visible) (dead, or, in a container, outside this PID namespace).
      type: list
      elements: dict
      sample: [{"pid": 560, "used_mib": 32768, "status": "not_visible", "matches_holder": false,
                "note": "not visible here: the process no longer exists"}]
    unattributed_mib:
      description: Used MiB that NVML's process list does not account for (hidden processes, leaked memory, residue).
      type: int
      sample: 0
    error:
      description: What NVML said (or that it hung) for this GPU; null when it answered.
      type: str
      sample: null
holders:
  description: Every process that maps a C(/dev/nvidia*) node (it has a GPU context), with its details.
  returned: success
  type: list
  elements: dict
  contains:
    pid:
      description: Process id, as seen where the module runs.
      type: int
      sample: 533
    ppid:
      description: Parent pid.
      type: int
      sample: 1
    name:
      description: Process name (comm).
      type: str
      sample: python3
    user:
      description: User name of the real uid.
      type: str
      sample: root
    create_time:
      description: Start time, seconds since the epoch.
      type: float
      sample: 1764430000.12
    state:
      description: State letter of the process (C(Z) for a defunct leader).
      type: str
      sample: Z
    thread_states:
      description: Count of threads per state letter.
      type: dict
      sample: {"Z": 1, "S": 18}
    defunct_leader:
      description: Whether the thread-group leader has exited while other threads live on (they hold the GPU).
      type: bool
      sample: true
    live_threads:
      description: Live threads of a defunct leader; null otherwise.
      type: int
      sample: 18
    blocked_threads:
      description: Threads in C(D) state, with their wchan and kernel stack where readable.
      type: list
      elements: dict
      sample: [{"tid": 812, "comm": "python3", "wchan": "__refrigerator", "stack": null}]
    via:
      description: How it holds the devices; C(fd), C(mmap), or C(task) (read through a live thread of a defunct leader).
      type: list
      elements: str
      sample: [fd, mmap]
    fd_devices:
      description: Device files it has open.
      type: list
      elements: str
      sample: [/dev/nvidia-uvm, /dev/nvidia0, /dev/nvidiactl]
    mapped_devices:
      description: Device files it maps.
      type: list
      elements: str
      sample: [/dev/nvidia-uvm, /dev/nvidia0, /dev/nvidiactl]
    gpus:
      description:
        - NVML indexes of the GPUs it is pinned to, by evidence (see C(evidence)); empty when unpinned.
        - Before 0.2.0 this listed the GPUs whose device node it maps; that is now C(maps_gpus).
      type: list
      elements: int
      sample: [1]
    maps_gpus:
      description: NVML indexes of the GPUs whose device node it maps (every GPU visible to a CUDA process).
      type: list
      elements: int
      sample: [0, 1]
    context_gpus:
      description: NVML indexes of the GPUs whose node it maps as a context does (3 mapping lines on driver 580).
      type: list
      elements: int
      sample: [1]
    map_lines:
      description: Mapping lines of each GPU's node in C(/proc/PID/maps), by NVML index.
      type: dict
      sample: {"0": 2, "1": 3}
    evidence:
      description:
        - Why it is pinned where it is; empty when unpinned. C(nvml) (NVML names it there), C(mapping) (it maps a
          context there; never alone), C(dead_pid) (NVML names a dead or invisible pid there), C(unaccounted)
          (memory there that no listed process accounts for), C(heir) (its process group or session id is that dead
          pid), C(nvml_stale) (NVML names a live pid there that has no context there).
      type: list
      elements: str
      sample: [nvml, mapping]
    ambiguous_gpus:
      description: GPUs whose orphaned memory it fits as well as another holder does; it is not pinned there.
      type: list
      elements: int
      sample: []
    shares_mib:
      description: Its MiB on each GPU it is pinned to, by NVML index (NVML's figure, or the dead pid's / unaccounted MiB).
      type: dict
      sample: {"0": 518, "1": 5638}
    heir_of:
      description: Dead pids whose memory it keeps and whose process group or session it belongs to (a forked child).
      type: list
      elements: int
      sample: []
    job:
      description: The id (lowest pid) of the job it belongs to (linked holders with a rank signature), or null.
      type: int
      sample: null
    pgrp:
      description: Process group id.
      type: int
      sample: 533
    session:
      description: Session id.
      type: int
      sample: 533
    unattributed:
      description:
        - True when it is pinned to no GPU (unpinned or ambiguous) and has no context on a GPU NVML cannot describe.
        - Such a holder is signalled only when every GPU it maps is targeted.
      type: bool
      sample: false
    unknown_gpus:
      description: Minors of the GPUs NVML cannot describe on which it has a context; it holds them.
      type: list
      elements: int
      sample: []
    unknown_mapped:
      description: Minors of the GPUs NVML cannot describe whose node it maps (with a context or not).
      type: list
      elements: int
      sample: []
    gpu_minors:
      description: Minor numbers of the C(/dev/nvidiaN) nodes it maps (from C(st_rdev) for a character device).
      type: list
      elements: int
      sample: [0, 1]
    fd_gpu_minors:
      description: Minor numbers of the C(/dev/nvidiaN) nodes it has open.
      type: list
      elements: int
      sample: [2]
    nvml_named_on:
      description: NVML indexes of the GPUs whose NVML process list names this pid.
      type: list
      elements: int
      sample: [2]
    mps_role:
      description:
        - C(client) (NVML's MPS list names it, or the control daemon of an MPS server lists it with
          C(get_client_list)), C(server) (C(nvidia-cuda-mps-server)), C(control) (the MPS control daemon, never
          signalled), or null.
        - With an MPS server among the processes, its control daemon is asked C(get_server_list) and
          C(get_client_list), each ask bounded (10 s); a daemon that does not answer in time is not asked again in
          the task, and the diagnosis names it.
      type: str
      sample: client
    mps_client_on:
      description: NVML indexes of the GPUs whose MPS client list names this pid.
      type: list
      elements: int
      sample: [0]
    holder:
      description: True for a holder (it maps a device node), false for a client.
      type: bool
      sample: true
    thread_count:
      description: Number of threads (the C(Z) leader of a defunct process included).
      type: int
      sample: 19
    starttime_ticks:
      description: Start time in clock ticks since boot (field 22 of C(/proc/PID/stat)); guards signals against pid reuse.
      type: int
      sample: 222746
    names:
      description: The names it goes by (comm, basename of argv[0], basename of the executable).
      type: list
      elements: str
      sample: [python, python3.11]
    protected_name:
      description: The built-in protected name it matches (gpu_release never signals it), or null.
      type: str
      sample: null
    nspid:
      description: The C(NSpid) line of C(/proc/PID/status) (pid in each nested PID namespace).
      type: list
      elements: int
      sample: [533]
    cgroup:
      description: The process's cgroup (v2 path).
      type: str
      sample: /lxc/101/ns/system.slice/sglang.service
    container:
      description:
        - Outside a container, the vmid of the container the process is in (the first C(lxc/VMID/ns) of its cgroup
          path), or C(host) when it is in none; null inside a container.
      type: str
      sample: "101"
    container_pid:
      description:
        - Outside a container, its pid inside that container (from C(NSpid), at the level of the container init's PID
          namespace, so Docker inside LXC gives the LXC-level pid); null for a process of the node or inside a container.
      type: int
      sample: 212
    parent_name:
      description: The parent's name.
      type: str
      sample: bash
    cmdline:
      description: Command line with secrets masked; null when O(cmdline=false).
      type: str
      sample: python3 serve.py --api-key ********
    truncated:
      description:
        - The files of this process that had more bytes than are read (C(cmdline) over 1 MiB; a process can point it at
          any amount of its own memory); what was cut is never matched against O(gpuops.fleet.gpu_release#module:protect).
      type: list
      elements: str
      sample: []
protected_holders:
  description: Ancestors of the module that hold a GPU (same fields as RV(holders)); never signalled, never left out of the verdict.
  returned: success
  type: list
  elements: dict
  sample: []
unreadable:
  description:
    - Processes whose C(/proc/PID/maps) or C(cmdline) read did not finish within a bounded wait (a thread stuck in the
      kernel holds, or queues behind, their memory-map lock), with C(reason) C(blocked), C(path), C(state),
      C(wchan), C(waited_s), the device files they have open and C(may_hold).
    - Processes whose C(/proc/PID/maps) has more than 16 MiB (the bytes read at most), with C(reason) C(truncated),
      C(path) and C(cap_bytes); C(may_hold) is true for every GPU, and they are never signalled.
  returned: success
  type: list
  elements: dict
  sample: [{"pid": 812, "name": "python3", "reason": "blocked", "path": "/proc/812/cmdline", "state": "D",
            "wchan": "fuse_wait_answer", "waited_s": 3.0, "fd_devices": ["/dev/nvidia0"], "may_hold": false}]
clients:
  description: Processes that have C(/dev/nvidia*) files open but map none (NVML clients such as monitors); same fields as RO(holders).
  returned: success
  type: list
  elements: dict
  sample: [{"pid": 611, "name": "nvidia-smi", "fd_devices": ["/dev/nvidia0", "/dev/nvidiactl"], "mapped_devices": []}]
zombies:
  description: One-thread zombies (they hold nothing), with the parent that has not reaped them.
  returned: success
  type: list
  elements: dict
  sample: [{"pid": 601, "name": "python3", "ppid": 600, "parent_name": "python3", "holds": []}]
jobs:
  description:
    - Groups of holders joined by connected TCP sockets that share a rank signature (the ranks of a tensor-parallel
      job), with their GPUs and C(signature), the evidence that makes them one job.
  returned: success
  type: list
  elements: dict
  sample: [{"id": 700, "pids": [700, 701], "gpus": [0, 1],
            "signature": ["rank siblings: the same argv apart from numbers"]}]
linked:
  description: Pairs of holders joined by a connected TCP socket that are not one job (no rank signature); for information only.
  returned: success
  type: list
  elements: dict
  sample: [{"pids": [812, 840], "why": "connected by TCP, not one job: no rank signature"}]
nvml_pids_trusted:
  description: False when any NVML entry is stale (see RV(nvml_stale)).
  returned: success
  type: bool
  sample: true
nvml_stale:
  description:
    - NVML entries "pid on GPU" whose pid lives here without a context on that GPU (legacy host pids, a reused
      pid). They pin nobody; their memory counts as orphaned on that GPU.
  returned: success
  type: list
  elements: dict
  sample: [{"gpu": 0, "pid": 560, "used_mib": 32768, "why": "pid 560 here has no context on GPU 0"}]
shm_residue:
  description:
    - With O(shm_residue), the GPU stacks' shared-memory residue in this host's C(/dev/shm) (on a node, the node's
      own), each with C(path), C(bytes) and C(owner) (the stack its prefix names).
  returned: when O(shm_residue) is true
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-Xk3a9Q", "bytes": 9437184, "owner": "nccl"}]
shm_skipped:
  description:
    - With O(shm_residue), the C(/dev/shm) folders whose residue could not be judged, each with C(vmid) (null for this
      host's), C(path) and C(why) (a process not read that may use it, a symlink in its path, no answer in time).
  returned: when O(shm_residue) is true
  type: list
  elements: dict
  sample: []
shm_residue_by_container:
  description:
    - From a Proxmox node with O(shm_residue), each running container's residue in its own C(/dev/shm) (as
      RV(shm_residue), paths as the container sees them), by vmid.
  returned: when O(shm_residue) is true and the module runs on a Proxmox node
  type: dict
  sample: {"101": [{"path": "/dev/shm/sgl_shm_2f1c", "bytes": 4096, "owner": "sglang"}], "102": []}
unknown_gpus:
  description:
    - GPUs NVML cannot describe (lost, or its calls fail), by C(minor), with their NVML C(index) when known and the
      pids that hold a context on them (C(held_by)).
  returned: success
  type: list
  elements: dict
  sample: [{"minor": 3, "index": null, "held_by": [13]}]
holders_unattributed:
  description: Pids of holders pinned to no GPU (those with a context on a GPU NVML cannot describe are left out).
  returned: success
  type: list
  elements: int
  sample: []
diagnosis:
  description: Plain sentences, one per finding, each naming the pid and the remedy.
  returned: always
  type: list
  elements: str
  sample:
    - pid 533 (python3) is a defunct leader with 18 live threads holding /dev/nvidia0; SIGKILL to 533 frees it; fuser does not see it
    - GPU 1 (minor 1) 3.9 GiB is used by no process visible here; look from the node
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import engine_from_params, no_gpu_message
from ansible_collections.gpuops.fleet.plugins.module_utils import _access as access
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _ready as ready
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._params import (
    INFO_PACKAGES, check_common_params, check_need, check_shm_prefixes, info_spec, validate_libraries,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import SelectorError


def start_engine(module, patterns):
    params = module.params
    engine = engine_from_params(params, patterns)
    try:
        engine.start()
    except NvmlFailure as exc:
        module.fail_json(msg="NVML cannot be used on this host: %s" % exc.message, diagnosis=[exc.message])
    try:
        targets = engine.select(params["gpus"])
    except SelectorError as exc:
        engine.nvml.shutdown()
        module.fail_json(msg=str(exc))
    no_gpu = no_gpu_message(engine, targets)
    if no_gpu:
        engine.nvml.shutdown()
        module.fail_json(msg=no_gpu, all_free=False)
    return engine, targets


def add_readiness(module, engine, report, result):
    """Each GPU's ready and not_ready (free, capacity, health, device access), and the top-level ready."""
    params = module.params
    access_reading = None
    node_access = {}
    if params["device_access"] and engine.view != "node":
        access_reading = access.read(engine.devices.dev_dir, [g["minor"] for g in result["gpus"] if g.get("minor") is not None])
    elif params["device_access"]:
        node_access = container_access(engine, report.scan, result["gpus"])
    for gpu in result["gpus"]:
        health_entries = []
        if params["health"] and not gpu.get("error"):
            try:
                gpu["health"], health_entries = ready.health(engine.nvml.health(gpu["index"]))
            except NvmlFailure as exc:
                health_entries = [ready.nvml_failure(exc.message, exc.kind)]
        access_entries = ready.access(access_reading, gpu.get("minor")) if access_reading is not None else []
        if params["device_access"] and engine.view == "node":
            access_entries += node_access_entries(gpu, node_access)
        gpu["ready"], gpu["not_ready"] = ready.gpu_verdict(gpu, engine.threshold_mib, health_entries, access_entries,
                                                           params["need_mib"], params["need_fraction"])
    residue = bool(result.get("shm_residue")) or any((result.get("shm_residue_by_container") or {}).values())
    result["ready"] = bool(result["gpus"]) and all(g["ready"] for g in result["gpus"]) and not residue


def node_access_entries(gpu, node_access):
    """From a node: one GPU's device-access entries, by container: a config that passes it in but that the container
    cannot open (passed_unusable: the rule that blocks it), else what was read inside the container (node_access)."""
    blocked = gpu.get("passed_unusable") or []
    out = [ready.unusable(entry, gpu["index"], gpu.get("minor")) for entry in blocked]
    for vmid in sorted(set(gpu.get("passed_into") or []) & set(node_access) - set(e["vmid"] for e in blocked)):
        reading, why = node_access[vmid]
        found = ready.access(reading, gpu.get("minor")) if reading is not None else [ready.access_unread(why)]
        out += [dict(entry, vmid=vmid, reason="container %s: %s" % (vmid, entry["reason"])) for entry in found]
    return sorted(out, key=lambda entry: entry["vmid"])


def container_access(engine, scan, gpus):
    """From a node: {vmid: (reading, why)} of device access read inside each running container that a selected GPU
    is passed into (its own device cgroup and /dev, through lxc-attach)."""
    running = node.container_inits(engine.proc_root, scan)
    minors = {}
    for gpu in gpus:
        for vmid in gpu.get("passed_into") or []:
            if str(vmid) in running and gpu.get("minor") is not None:
                minors.setdefault(vmid, set()).add(gpu["minor"])
    return dict((vmid, access.read_in_container(vmid, minors[vmid])) for vmid in sorted(minors))


def main():
    module = AnsibleModule(argument_spec=info_spec(), mutually_exclusive=[("need_mib", "need_fraction")],
                           supports_check_mode=True)
    patterns = check_common_params(module)
    prefixes = check_shm_prefixes(module)
    check_need(module)
    validate_libraries(module, INFO_PACKAGES)
    engine, targets = start_engine(module, patterns)
    if module.params["shm_residue"]:
        engine.shm_prefixes = prefixes
    try:
        report = engine.snapshot(targets)
        result = report.as_dict()
        add_readiness(module, engine, report, result)
    except Exception as exc:
        engine.nvml.shutdown()
        module.fail_json(msg="gpu_info failed: %s" % exc, exception=traceback.format_exc())
    engine.nvml.shutdown()
    errors = report.errors
    if errors:
        msg = "; ".join("GPU %s%s: %s" % (g["index"], " (%s)" % g["uuid"] if g.get("uuid") else "", g["error"])
                        for g in errors)
        module.fail_json(msg=msg, changed=False, **result)
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
