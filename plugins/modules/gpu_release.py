#!/usr/bin/python
# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_release
short_description: Free NVIDIA GPU memory by escalating signals until it is verified free
version_added: 0.1.0
description:
  - Frees the memory of the selected GPUs and verifies it, or fails with a precise account of what still holds
    them and what would free them.
  - Climbs a ladder, each rung only while targeted memory is still held.
  - 1. Read the state. If every targeted GPU is free, nothing is signalled (C(changed=false)).
  - 2. SIGTERM every holder of a targeted GPU, then poll NVML and C(/proc) every 75 ms for up to O(term_timeout).
  - 3. SIGKILL the survivors, defunct leaders whose threads live included, and poll for up to O(kill_timeout).
  - 4. One-thread zombies hold nothing; they are reported with their parent, never signalled.
  - 5. Holders stuck in C(D) state are reported with their wchan and kernel stack; the module keeps waiting up to
    O(advanced.verify_timeout).
  - 6. With O(gpu_reset=true), a GPU that no process holds but whose memory is still used is reset with
    C(nvidia-smi --gpu-reset); the reset is refused while any holder remains.
  - 7. Verify that every targeted GPU's v2 C(used) is at most O(advanced.threshold_mib), else fail with the gpu_info
    diagnosis and what was tried.
  - "Which GPUs a holder holds is decided by evidence, not by the device nodes it maps: every CUDA process maps the
    node of every GPU visible to it. A holder that NVML names, where it maps a context, holds exactly the GPUs where
    NVML names it (an entry whose pid has no context there is stale and pins nobody). One that NVML does not name
    (the forked child of a dead parent, a pid NVML hides) is pinned to GPU N only when NVML shows orphaned memory on
    N, the holder maps a context on N, and no other holder fits. Anything else is unpinned, and is signalled only
    when every GPU it maps is targeted (see gpuops.fleet.gpu_info). A context on a GPU NVML cannot describe (lost,
    or its calls fail) holds that GPU: such a holder is never signalled for it, and counts as collateral of unknown
    size."
  - "Collateral: a holder that also holds a GPU that is not targeted (beyond O(advanced.collateral_tolerance_mib), the size of
    a bare context), or that belongs to a job spanning other GPUs, makes the task fail before any signal, naming the
    pid and the GPUs, unless O(collateral=stop). A job is a group of holders linked by sockets that share a rank
    signature (the same distributed-run settings such as C(MASTER_ADDR)/C(MASTER_PORT), a distributed launcher
    such as C(torchrun) as their common parent, or rank siblings: the same argv, or titles, apart from numbers).
    Connected holders without one (a client and its server) are only RV(linked), and each is signalled only for
    its own targeted GPUs."
  - Once the first holders are gone, the state is read again, and a holder pinned only now (the child that keeps a
    dead parent's memory) is signalled in turn, under the same rules.
  - "It signals only processes that C(/proc) shows holding a targeted GPU. Never: a pid known only from NVML, an
    NVML client (a process with the device files open but nothing mapped), pid 1, the module's own process tree,
    C(nvidia-persistenced), C(nv-hostengine), C(nv-fabricmanager), C(dcgm-exporter), C(sshd), C(lxc-attach), C(pct),
    or anything listed in O(protect)."
  - "An MPS server (C(nvidia-cuda-mps-server)) is signalled only with every client it serves: those its control
    daemon lists (C(get_client_list), pids mapped from a container's), and, where NVML has an MPS client list, every
    client NVML names. A client that stays (on a GPU that is not targeted, say) keeps the server, whatever its share
    there. A server whose clients cannot be known (no NVML MPS list, and no answer from a daemon) is never signalled;
    RV(not_signalled) and the diagnosis say why. Each ask of a control daemon waits at most 10 s, and never past
    O(advanced.timeout)."
  - Each signal is guarded against pid reuse (a pidfd and a start-time check, or psutil's create-time check), is
    recorded in RV(actions) and written to the target's log.
  - "Respawn by parentage: from the first signal to the verdict, and for 3 seconds after a verified release (up to
    6 while a new child is still starting), the live parents of the killed holders are watched, whatever their name
    (a supervisor, a shell loop, C(torchrun)). A process that starts under one of them after the kill and maps a
    targeted GPU, or that NVML names on one, fails the task with 'respawned by pid X (name): stop the service
    first', the parent's chain and what to stop (RV(respawned)). So does one still starting at the window's end
    (no GPU mapped yet: a real CUDA program takes seconds) that has the name of a holder killed under the same
    parent. It is never signalled. An init (pid 1 of its
    namespace) is watched only for the holders of a systemd service, and only for new processes of that service.
    Stopping services is the job of the C(gpuops.fleet.release_gpus) role."
author:
  - gpuops (@gpuops)
extends_documentation_fragment:
  - gpuops.fleet._gpu
  - gpuops.fleet._gpu.attributes
  - gpuops.fleet._gpu.actiongroup_gpu
  - gpuops.fleet._proxmox_api
attributes:
  check_mode:
    support: full
    details: Signals nothing and returns RV(plan), which pids would get which signal.
  diff_mode:
    support: none
  idempotent:
    support: full
    details: A second run on free GPUs sends no signal and reports C(changed=false).
  platform:
    support: full
    platforms: posix
options:
  match:
    description:
      - A regular expression searched in the name and the command line of each holder. Holders that do not match
        are reported, not signalled (the task then fails if their memory stays).
    type: str
  protect:
    description:
      - More processes never to signal, added to the built-in list. Each entry is a pid, or a regular expression
        that must match the whole process name or the whole command line.
    type: list
    elements: str
    default: []
  containers:
    description:
      - On a Proxmox VE node (the module sees every container's processes there), the vmids whose processes may be
        signalled. A process belongs to container VMID when the first C(lxc/VMID/ns) in its cgroup path names it;
        membership is read again at signal time, beside the pid-reuse guard.
      - On a node, a release with neither O(containers) nor O(host_processes) fails before any signal.
      - On a node, each vmid must have its config on this node (C(/etc/pve/lxc/VMID.conf); pve-container links
        C(/etc/pve/lxc) to the local node's C(/etc/pve/nodes/NODE/lxc)). A vmid without one (a typo, a container of
        another node) fails the task before anything, in check mode too, naming it, the node that has its config if
        any, and this node's containers; so does a C(/etc/pve/lxc) that cannot be read.
      - Inside a container, setting it fails the task (a container sees only its own processes).
      - The release also takes each listed container's own per-GPU locks (through C(/proc/INIT/root/run/lock)), so
        it never races a release running inside that container. A container whose lock cannot be taken (a link or a
        wrong owner planted there, never followed; a lock held past O(advanced.lock_timeout); a folder that does not answer
        within 5 s, a hung mount) is left out with verdict C(skipped) and the reason in RV(per_container); the others
        are released, and the task then fails naming it. Those locks are taken and held by a helper process that
        lives as long as the release (the module never holds them), so a hung mount there never hangs the module.
      - A listed container whose config carries a C(lock) (backup, migrate, snapshot) is left out before
        anything, with verdict C(skipped) in RV(per_container); the others are released, and the task then fails
        naming the lock.
      - "One container's refusal never stops the others: a refusal that concerns only the processes of some listed
        containers (a holder that also holds an untargeted GPU, a job only partly in scope, a restart that would
        stop untargeted work) leaves those containers out, with verdict C(refused) and the refusal as C(reason) in
        RV(per_container); nothing of them is signalled or stopped, the others are released, and the task then
        fails naming the refusal. A refusal about a process in no container stops the whole task before any signal."
    type: list
    elements: int
    default: []
  host_processes:
    description:
      - On a Proxmox VE node, also allow signalling processes that are in no container (the node's own, such as
        workers that survived C(docker rm -f)). The built-in protected names are never signalled.
    type: bool
    default: false
  shared_gpu:
    description:
      - On a node with O(containers), when a targeted GPU counts as free.
      - "V(own) (the default) counts it free when nothing of O(containers) (and of the node, with O(host_processes))
        holds it: no such holder, and their MiB by container (RV(before), C(by_container)) within
        O(advanced.threshold_mib). Memory of other containers is reported, not waited for: the message says
        C(this container's share is free; N MiB are held by others), and each RV(per_container) entry has it as
        C(note)."
      - V(all) demands the whole GPU free, whoever holds it. So does O(gpu_reset=true), whatever this option says,
        since a reset is for memory that no process holds, which V(own) never counts.
      - Inside a container, and on a host that is no Proxmox node, there is nothing else to tell apart, and the whole
        GPU must be free either way. The pre-deploy check (C(gpuops.fleet.predeploy_check)) always proves the whole
        GPU.
    type: str
    choices: [all, own]
    default: own
  term_timeout:
    description: Seconds to wait after SIGTERM before SIGKILL. 0 or more.
    type: float
    default: 10
  kill_timeout:
    description: Seconds to wait after SIGKILL for the holders to go. 0 or more.
    type: float
    default: 10
  gpu_reset:
    description:
      - Reset a targeted GPU with C(nvidia-smi --gpu-reset -i INDEX) when no process holds it but its memory is still
        used (leaked memory). Refused while any holder remains. C(nvidia-smi) is looked up in E(PATH) and in
        C(/usr/local/sbin), C(/usr/local/bin), C(/usr/local/nvidia/bin), C(/usr/sbin), C(/usr/bin), C(/sbin), C(/bin).
    type: bool
    default: false
  container_restart:
    description:
      - On a node, the container rung. When SIGKILL leaves targeted memory held by a scoped container (its processes
        come back faster than they die, or a holder is stuck), stop and start that container, and verify again.
      - A restart stops everything in the container, monitors and sshd included; C(container_restart=true) is the
        consent for the processes that hold no GPU. RV(restart_plan) lists every process and every GPU it affects, in
        check mode too. A container with GPU work that is not targeted makes the task fail before any signal unless
        O(collateral=stop). Such work is a process that may hold an untargeted GPU and is not a planned holder
        (whatever its size), or a planned holder's untargeted share beyond O(advanced.collateral_tolerance_mib).
      - The restart is decided again on the snapshot taken right before the stop (GPU work started since the plan
        refuses it), and runs only while a targeted GPU is still held there.
      - A container that is locked (backup, migrate, snapshot) or managed by HA is not restarted; the task fails
        naming the lock or the HA resource.
      - A thread stuck in the driver (D state) survives a container stop too; the stop then times out and the task
        fails naming the thread's wchan.
      - Through the Proxmox API with O(api_host) (or C(PROXMOX_HOST)), else with C(pct stop) and C(pct start) on the node.
    type: bool
    default: false
  collateral:
    description:
      - What to do when stopping a holder of a targeted GPU would also stop work on a GPU that is not targeted.
      - V(refuse) fails the task before any signal, naming each such pid, its name and its MiB on the other GPUs, or
        the job (linked ranks with a rank signature, such as a tensor-parallel job) and its GPUs.
      - V(stop) signals such holders anyway, and stops every process of such a job, since stopping part of a job
        leaves the rest hung and leaves residue on the targeted GPUs. RV(collateral) lists the GPUs freed that way.
      - Has no effect when every GPU is targeted (O(gpus) empty).
    type: str
    choices: [refuse, stop]
    default: refuse
  advanced:
    description:
      - How the release reads, waits, serialises and cleans up; the defaults suit most fleets.
      - Its keys are accepted in this dict only; a top-level spelling (C(verify_timeout) beside O(gpus)) fails as an
        unsupported parameter.
    type: dict
    default: {}
    suboptions:
      clean_shm:
        description:
          - When the targeted GPUs end free (already free, or verified free after the ladder), remove the GPU stacks'
            shared-memory residue in C(/dev/shm), as M(gpuops.fleet.gpu_info) finds it (see
            O(gpuops.fleet.gpu_info#module:shm_residue)), read afresh; from a node with O(containers), in each scoped
            container's C(/dev/shm) (the node's own only with O(host_processes)); from a node without O(containers),
            the node's own.
          - A file's users are found by the file itself (its device and inode in every process's maps, on the node and
            in every container, whatever path it is mapped by; an open fd by its path, in every folder on the same mount).
            Never a file a live process has open or maps, never one changed after the release started, never through a
            symlink at any part of the path. Users are read and judged again right before the removals.
          - A folder is not cleaned, with the reason in RV(shm_skipped), when it is one mount with a folder outside the
            scope (a container's C(/dev/shm) that is the node's own, by a bind mount, without O(host_processes)), when a
            process that could not be read may use it, when a part of its path is a symlink (a Debian-style
            C(/dev/shm -> /run/shm)), or when it does not answer in time (a hung mount). Inside a container the node's
            processes cannot be seen, so a C(/dev/shm) made outside the container (owned by an owner it does not map),
            a part of another file system bound in, or a mount bound in from outside (C(master:) in
            C(/proc/self/mountinfo)) is skipped too, to be cleaned from the node. From a node, no folder is cleaned while a
            node process cannot be read (it reaches every container's folder).
          - Check mode lists what would be removed (RV(shm_residue)) and removes nothing.
          - A file that could not be removed fails the task, naming it (RV(shm_left)); a folder not cleaned does not.
        type: bool
        default: false
      cmdline:
        description: "Whether to return command lines (redacted), as O(gpuops.fleet.gpu_info#module:cmdline)."
        type: bool
        default: true
      collateral_tolerance_mib:
        description:
          - A holder whose share of every untargeted GPU is at most this many MiB is stopped like any other holder of the
            targeted GPUs; the plan says which untargeted GPUs are freed as a side effect.
          - The default is just above a bare PyTorch context on an H200 (612 MiB). A share NVML cannot measure counts as
            above it. 0 or more.
        type: int
        default: 640
      container_timeout:
        description:
          - Seconds the stop, and then the start, of a container may take each. More than 0.
          - The start's time is reserved from O(advanced.timeout) before the stop begins; the stop gets what is left
            beside it, and with less than that plus 2 s left the container is not stopped. Once its stop has run, the
            start always runs, even when the module's hard stop lands meanwhile (held off until the start ends).
        type: float
        default: 60
      lock_timeout:
        description:
          - Seconds to wait for the per-GPU lock (a file lock in C(/run/lock/gpuops-fleet), created root-owned with mode
            0700; the task fails before any signal if that directory has another owner or mode, or is a symbolic link)
            that serialises two releases of the same
            GPU. The second release waits, then re-reads the state (usually finding the GPU free), or fails clearly.
          - 0 or more.
        type: float
        default: 60
      nvml_timeout:
        description: "Seconds one NVML call may take, as O(gpuops.fleet.gpu_info#module:nvml_timeout). More than 0."
        type: float
        default: 5.0
      redact:
        description: "More regular expressions masked in the command lines returned, as O(gpuops.fleet.gpu_info#module:redact)."
        type: list
        elements: str
        default: []
      reserved_floor_mib:
        description:
          - For drivers without NVML's v2 memory call only, as O(gpuops.fleet.gpu_info#module:reserved_floor_mib).
          - The release then says C(free by estimate), and never resets such a GPU.
        type: int
      reset_blockers:
        description:
          - With O(gpu_reset) on a Proxmox node, what to do about what would block the reset, listed before anything is
            signalled (RV(reset_blockers)) - the user holders (the ladder signals them first), NVML clients (monitors),
            the driver's daemons (C(nvidia-persistenced), C(nv-hostengine), C(dcgm-exporter), C(nv-fabricmanager), which
            serve every GPU of the node), persistence mode, C(nvidia_drm) in use, MIG mode.
          - C(refuse) fails before anything is signalled when any but a user holder is found, naming them all.
          - C(stop_services) stops each daemon through its service manager (systemd, or supervisord), never by signal,
            and turns persistence mode off (C(nvidia-smi -pm 0)), once the ladder leaves a GPU to reset; after the reset
            it restores persistence mode and starts the daemons again, each step in RV(reset_steps); a restart that fails
            fails the task. A monitor, a daemon under no service manager, C(nvidia_drm) in use and MIG mode still refuse.
          - Each stop is paired with its restore, which always runs. 20 s per restore step (a daemon started, persistence
            turned back on) are reserved from O(advanced.timeout) before the first stop; the stops and the reset get
            what is left beside them, and with less than that plus 2 s left nothing is stopped. The module's hard stop
            never interrupts a restore (it is held off until the restore ends), so a restore may run past
            O(advanced.timeout) by at most its own bound. What cannot be restored is in RV(left_changed), and fails the
            task.
          - Nothing is stopped for a GPU whose reset is already known to be refused (a holder in D state, a monitor, a
            pid NVML lists that the node does not show).
        type: str
        choices: [refuse, stop_services]
        default: refuse
      reset_timeout:
        description:
          - Seconds the reset itself (C(nvidia-smi --gpu-reset)) may take, and then how long to wait for the GPU to read
            free; its own budget, never cut short by O(advanced.verify_timeout). Bounded by O(advanced.timeout). 0 or more.
        type: float
        default: 120
      shm_prefixes:
        description:
          - More name prefixes that mark a C(/dev/shm) file as a GPU stack's for O(advanced.clean_shm), beside the built-in ones
            (C(nccl-), C(sgl_), C(torch_), C(vllm), C(psm_)). Each is a file name's start, without C(/).
        type: list
        elements: str
        default: []
      stop_concurrency:
        description:
          - How many containers have their O(advanced.stop_found_units) stops run at once (a container's own units one after
            another). 1 or more.
          - The role's node path sets it from C(release_gpus_node_concurrency).
        type: int
        default: 4
      stop_found_units:
        description:
          - On a node with O(containers), before any signal, stop the stop set of each planned holder (what would start
            it again), inside its container, through the container's own manager (C(lxc-attach -n VMID), no C(pct)
            start-up per call). Only a set decided V(stop) in RV(stop_sets) is stopped; a set refused or not found is
            never stopped, its holder is signalled alone, and the diagnosis names the set, its other members and what
            to stop by hand.
          - The innermost grouping above the holder, never past its container's init, is its set. A supervisord
            program, from the holder or an ancestor whose parent is C(supervisord), by the C(SUPERVISOR_GROUP_NAME) and
            C(SUPERVISOR_PROCESS_NAME) that supervisord puts in its programs' environment (C(supervisorctl -c CONF stop
            GROUP:NAME), CONF from supervisord's command line), comes before the unit that runs supervisord. A systemd
            unit is the first component below the slices of the holder's cgroup (C(lxc/VMID/ns/system.slice/NAME.service));
            a user's unit (C(user@UID.service/.../NAME.service)) is stopped through that user's manager
            (C(systemctl --user -M UID@ stop NAME)). A holder in a container nested inside the container has no set.
          - A docker container is read only from docker's own cgroup (C(system.slice/docker-ID.scope), C(docker/ID)) or
            a shim of the container's root in containerd's or docker's unit; its members are every process C(docker stop)
            ends. A supervisord program only of the container's one supervisord, the container root's, with a plain
            absolute C(-c); its members are every process started under that program's name.
          - A set is stopped only when it is one program's, the planned holder's, and takes no GPU work that is not
            targeted. Refused are a generic launcher or session unit (C(cron), C(ssh), C(getty@), C(user@), session scopes,
            C(rc-local), C(init.scope), C(docker.service), C(containerd.service) and the like); a set whose main process
            manages several programs (C(supervisord), C(dockerd), C(containerd), a login shell) or is neither the holder
            nor its ancestor; a unit whose stop would stop another live unit (one that requires it, is bound to it or
            part of it, asked of the container's own manager with C(systemctl show), or that cannot be asked); a set
            with a member that holds a targeted GPU and is not signalled, or that runs as
            another uid than the holder's and is not its ancestor (another user's work); and, unless
            O(collateral=stop), a set with a member that may hold an untargeted GPU (no tolerance for a process whose
            only GPUs are untargeted). Members that hold no GPU go with their program.
          - RV(found_units) lists each set stopped with the pids it runs and the outcome of its stop; in check mode, what
            would be stopped. Each stop is also an action (C(signal) is C(stop)). The GPUs are read again after the
            stops, and the ladder runs on what is left.
          - A docker container inside the LXC container (docker inside LXC) is found from the holder's cgroup
            (C(system.slice/docker-ID.scope) or C(docker/ID)) or from an ancestor C(containerd-shim) of docker's
            C(moby) namespace, and stopped with C(docker stop ID) inside the container; it comes before a supervisord
            that runs inside it. The lab cannot run docker, so this path is unit-tested only.
        type: bool
        default: false
      stop_timeout:
        description: Seconds each stop of O(advanced.stop_found_units) may take (within O(advanced.timeout)). More than 0.
        type: float
        default: 60
      threshold_mib:
        description:
          - The most MiB beyond the reserved floor (NVML v2 C(used)) that still counts as free, as
            O(gpuops.fleet.gpu_info#module:threshold_mib). 0 or more.
        type: int
        default: 64
      timeout:
        description:
          - Overall limit in seconds for the whole task, enforced by the module itself, so that a dropped SSH channel
            cannot leave it running forever. More than 0.
          - The asks of MPS control daemons count against it; when it is reached while the GPUs are first read (a
            daemon that does not answer), nothing is signalled and the task fails, naming the daemon.
        type: float
        default: 180
      verify_timeout:
        description:
          - Seconds to wait for the memory to be verified free once the signals are sent (and again after a reset).
          - When no process visible here holds a targeted GPU any more, the module waits at most 1 s more for its memory.
          - 0 or more.
        type: float
        default: 30
seealso:
  - module: gpuops.fleet.gpu_info
"""

EXAMPLES = r"""
- name: Free every GPU of this container
  gpuops.fleet.gpu_release:
  register: released

- name: Free GPUs 0 and 1, only signalling our own training jobs, with short timeouts
  gpuops.fleet.gpu_release:
    gpus: [0, 1]
    match: 'train\.py'
    term_timeout: 5
    kill_timeout: 5
    advanced:
      verify_timeout: 10

- name: Show what would be signalled
  gpuops.fleet.gpu_release:
  check_mode: true
  register: plan

- name: Free GPU 3 even if its tensor-parallel job spans other GPUs (the whole job is stopped)
  gpuops.fleet.gpu_release:
    gpus: [3]
    collateral: stop

- name: From the Proxmox node, free container 101's share of a GPU that other containers use too
  gpuops.fleet.gpu_release:
    gpus: [GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10]
    containers: [101]
  delegate_to: pve1

- name: The same, but wait until the whole GPU is free, whoever holds it
  gpuops.fleet.gpu_release:
    gpus: [GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10]
    containers: [101]
    shared_gpu: all
  delegate_to: pve1

- name: From the node, stop what runs the holders inside their containers first, and clean /dev/shm once free
  gpuops.fleet.gpu_release:
    containers: [101, 102]
    advanced:
      stop_found_units: true
      clean_shm: true
  delegate_to: pve1

- name: From the node, restart container 101 if its launcher respawns holders faster than SIGKILL
  gpuops.fleet.gpu_release:
    gpus: [GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10]
    containers: [101]
    container_restart: true
    api_host: pve1.example.com
    api_user: gpuops@pve
    api_token_id: release
    api_token_secret: "{{ vault_pve_token }}"
    ca_path: /etc/pve/pve-root-ca.pem
  delegate_to: pve1

# Never pass the secret through the task's environment: (it shows on -vvv's EXEC lines and in ps on the
# controller and the node); give it as an option, as the role does from the controller's PROXMOX_* variables.
- name: The same, with the credentials from the controller's PROXMOX_* environment (as the role reads them)
  gpuops.fleet.gpu_release:
    gpus: [GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10]
    containers: [101]
    container_restart: true
    api_host: pve1.example.com
    api_user: gpuops@pve
    api_token_id: "{{ lookup('ansible.builtin.env', 'PROXMOX_TOKEN_ID') }}"
    api_token_secret: "{{ lookup('ansible.builtin.env', 'PROXMOX_TOKEN_SECRET') }}"
  delegate_to: pve1

- name: Reset a GPU whose memory leaked (only from the node; refused while anything has it open)
  gpuops.fleet.gpu_release:
    gpus: [GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10]
    containers: [101]
    gpu_reset: true
  delegate_to: pve1

- name: Never touch the exporter started by our monitoring
  gpuops.fleet.gpu_release:
    protect:
      - my-exporter
      - '.*--metrics-port.*'
"""

RETURN = r"""
missing_library:
  description:
    - On a host where psutil or nvidia-ml-py does not import (or proxmoxer, with O(container_restart) and
      O(api_host)), the package to install (the task fails, its message saying how).
  returned: when a library is missing
  type: str
  sample: nvidia-ml-py
changed:
  description: Whether a signal was sent or a GPU was reset (in check mode, whether any would be signalled).
  returned: always
  type: bool
  sample: true
before:
  description:
    - Per targeted GPU, the state before the ladder.
    - Outside a container also C(by_container), the MiB per container from NVML's node view (C(host) for processes in
      no container, C(unattributed) for memory no process accounts for), and with O(shared_gpu=own) C(free_for_scope).
  returned: success or failure after NVML answered
  type: list
  elements: dict
  sample: [{"index": 0, "minor": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "used_mib": 33792,
            "reserved_mib": 615, "v1_used_mib": 34407, "free": false, "holders": [533], "error": null}]
after:
  description: Per targeted GPU, the state after the ladder (same fields as RV(before)); null in check mode.
  returned: success or failure after NVML answered
  type: list
  elements: dict
  sample: [{"index": 0, "minor": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "used_mib": 0,
            "reserved_mib": 615, "v1_used_mib": 615, "free": true, "holders": [], "error": null}]
released_mib:
  description: MiB freed on the targeted GPUs (sum of RV(before) used minus RV(after) used).
  returned: always
  type: int
  sample: 33792
actions:
  description: Every signal sent (or refused) and every reset tried, in order.
  returned: always
  type: list
  elements: dict
  contains:
    time:
      description: Wall-clock time, seconds since the epoch.
      type: float
      sample: 1764430000.512
    elapsed_s:
      description: Seconds since the task started.
      type: float
      sample: 0.061
    pid:
      description: The pid signalled (0 for a reset).
      type: int
      sample: 533
    name:
      description: The process name (or C(GPU N) for a reset).
      type: str
      sample: python3
    signal:
      description:
        - C(SIGTERM), C(SIGKILL), C(reset), C(stop) (a unit of O(advanced.stop_found_units)), C(container_stop) and
          C(container_start) (the container rung), or C(terminate_client) (an MPS client, through its control
          daemon, before C(SIGTERM)).
      type: str
      sample: SIGKILL
    outcome:
      description:
        - C(sent), C(gone), C(not sent... pid reused), C(not sent... out of scope) (node side, membership read again),
          or the result of a reset or a container stop or start (C(done...), C(refused...), C(failed...)).
      type: str
      sample: sent
    vmid:
      description: The container of a C(stop), C(container_stop) or C(container_start) step.
      type: int
      returned: for the container rung and the stops of O(advanced.stop_found_units)
      sample: 101
    task:
      description: The Proxmox task id (UPID) of a container step through the API, or the C(pct) command run.
      type: str
      returned: for the container rung
      sample: "UPID:pve1:0001A2B3:00C0FFEE:6752D3A0:vzstop:101:root@pam:"
    seconds:
      description: How long the container step took.
      type: float
      returned: for the container rung
      sample: 1.42
  sample: [{"time": 1764430000.512, "elapsed_s": 0.061, "pid": 533, "name": "python3", "signal": "SIGTERM", "outcome": "sent"}]
rung_reached:
  description:
    - The highest rung climbed; one of C(none), C(sigterm), C(sigkill), C(wait) (holders stuck in D state),
      C(container_restart) (node side), C(reset).
  returned: always
  type: str
  sample: sigkill
elapsed_s:
  description: Seconds the task took on the target.
  returned: always
  type: float
  sample: 0.31
remaining:
  description: The targeted GPUs still not free at the end, with what still holds them; empty when verified free.
  returned: always
  type: list
  elements: dict
  sample: [{"index": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "used_mib": 4096, "unattributed_mib": 0,
            "holders": [{"pid": 812, "name": "python3", "state": "D",
                         "blocked_threads": [{"tid": 812, "comm": "python3", "wchan": "__refrigerator", "stack": null}]}],
            "error": null}]
diagnosis:
  description: The gpu_info diagnosis of the final state, plus holders that were not signalled and why.
  returned: always
  type: list
  elements: str
  sample: ["pid 812 (python3) has thread 812 in D state (wchan __refrigerator) holding /dev/nvidia0, /dev/nvidiactl: ..."]
plan:
  description:
    - Which pids get which signals (decided before acting); in check mode nothing is sent.
    - C(gpus) lists the targeted GPU indexes the process is pinned to; for an unpinned holder (signalled only when
      every GPU it maps is targeted) the GPUs it maps, and C(unattributed) is true.
    - C(side_effect_gpus) lists the untargeted GPUs it also holds, with its MiB there (freed as a side effect).
    - C(job) is the job it belongs to (C(id), C(pids), C(gpus)), or null.
    - C(why) is C(pinned), C(unpinned_all_mapped), C(job_member) (stopped with its job, O(collateral=stop)) or
      C(job_residue) (this run saw a rank of its job die on a targeted GPU, and its peers keep residue there).
    - C(evidence) is the holder's evidence (see gpuops.fleet.gpu_info).
    - C(linked) lists the pids connected to it by TCP that are not of its job (see RV(linked)); they are signalled
      only for their own targeted GPUs.
    - C(stop_set) (on a node with O(containers)) names its stop set and that set's verdict (see RV(stop_sets)), or
      is null.
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 533, "name": "python3", "gpus": [1], "side_effect_gpus": [{"index": 0, "mib": 518}], "job": null,
            "evidence": ["nvml", "mapping"], "unattributed": false, "why": "pinned", "signals": ["SIGTERM", "SIGKILL"],
            "linked": [],
            "note": "SIGKILL only if it still holds a targeted GPU after term_timeout; frees GPU 0 (518 MiB) as a side effect"}]
collateral:
  description: Untargeted GPUs that the plan frees as a side effect, with their used MiB before and after (null in check mode).
  returned: always
  type: list
  elements: dict
  sample: [{"index": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "used_mib_before": 518, "used_mib_after": 0}]
jobs:
  description:
    - The jobs that the plan touches (holders linked by sockets that share a rank signature), with their pids, GPUs
      and C(signature), the evidence printed for them.
  returned: always
  type: list
  elements: dict
  sample: [{"id": 700, "pids": [700, 701, 702, 703], "gpus": [0, 1, 2, 3],
            "signature": ["rank siblings: process titles that differ only by a number (tp_rank#)"]}]
linked:
  description:
    - Pairs of holders, one of them in the plan, joined by a TCP connection but not one job (no rank signature, as
      a client and its server). For information only; nothing is signalled for a link.
  returned: always
  type: list
  elements: dict
  sample: [{"pids": [90, 91], "why": "connected by TCP, not one job: no rank signature"}]
nvml_stale:
  description: NVML entries that pin nobody, as in gpuops.fleet.gpu_info (before the first signal).
  returned: always
  type: list
  elements: dict
  sample: []
unknown_gpus:
  description:
    - GPUs NVML cannot describe, as in gpuops.fleet.gpu_info (before the first signal). A holder with a context on
      one is never signalled for it, and is stopped with a targeted GPU only with O(collateral=stop).
  returned: always
  type: list
  elements: dict
  sample: []
not_signalled:
  description: Holders of targeted GPUs that were left alone, with the reason (protected, not matching O(match), unpinned, ambiguous).
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 640, "name": "python3", "reason": "does not match `match` (train)"}]
lock_wait_s:
  description: Seconds spent waiting for the per-GPU locks (another release of the same GPU held them).
  returned: always
  type: float
  sample: 0.0
lock_acquired_at:
  description:
    - When this task took the per-GPU locks, in seconds since the epoch (as C(actions[].time)); null when it took none
      (check mode, or it failed before).
    - A release that waited for another one took them after that one's last action.
  returned: always
  type: float
  sample: 1764600000.123
view:
  description: Where the module ran. C(container), C(node) (a Proxmox VE node) or C(host) (any other machine).
  returned: always
  type: str
  sample: node
scope:
  description: On a node, the containers whose processes may be signalled and whether processes in no container may be.
  returned: always
  type: dict
  sample: {"containers": [101], "host_processes": false}
restart_plan:
  description:
    - With O(container_restart), per scoped container that holds a targeted GPU, what a restart would stop.
    - C(processes) is every process of the container (C(pid) on the node, C(container_pid), C(name)); C(gpus) every
      GPU its holders hold or map; C(untargeted_gpus) those beyond the tolerance that are not targeted; C(refusal) the
      lock or HA resource that forbids the restart, or null; C(backend) is C(api) or C(pct).
  returned: always
  type: list
  elements: dict
  sample: [{"vmid": 101, "gpus": [0], "untargeted_gpus": [], "backend": "pct", "refusal": null,
            "processes": [{"pid": 4021, "container_pid": 1, "name": "init"}, {"pid": 4388, "container_pid": 77, "name": "gpu_worker"}]}]
per_container:
  description:
    - On a node with O(containers), one entry per container in the scope, from this one task.
    - C(gpus) are the targeted GPUs its config passes in (or that it holds), by C(index) and C(minor) on the node and
      C(uuid), with C(before_mib) and C(after_mib), its
      own MiB by NVML's node view, C(others_mib) (what others hold there after, null in check mode), and C(free)
      (nothing of it holds the GPU with O(shared_gpu=own); the whole GPU free with V(all); null in check mode).
    - C(note) is C(this container's share is free; N MiB are held by others) when it is free by O(shared_gpu=own)
      while others hold more than O(advanced.threshold_mib) there, else empty.
    - C(changed) is true when something of it was signalled, stopped or restarted (in check mode, when something of it
      is planned). C(verdict) is C(free), C(busy), C(planned) or C(nothing to do) (check mode), or, with C(reason),
      C(skipped) for a locked container or C(refused) for one left out by a refusal (see O(containers)). A container
      with no GPU row is C(not passed in) when its config, read, passes none of the targeted GPUs in (and it holds
      none of them), else C(unknown) (a targeted GPU passed in but unusable by C(deny-write) or a cgroup rule, named
      in C(reason); no config for the vmid on this node; the configs unreadable). Empty is unknown, never free;
      C(unknown) fails the task.
    - C(planned) lists its pids in RV(plan); C(actions) the signals, stops and restarts that concern it (a restart
      with its C(task), the Proxmox task id or the pct command);
      C(not_signalled) its holders left alone; C(found_units) its part of RV(found_units) and C(stopped) the names
      of those stopped.
    - Each of its C(gpus) also has C(rung) (C(none) when it held nothing there, else the strongest step taken for
      it, C(stop) when a stop alone freed it) and C(signals) (C(SIGTERM 4388 (python3)) ...), as the role reports
      them.
    - The entry itself has C(rung), the strongest of its GPUs' rungs, and C(signals), each step taken for it (a
      signal sent, a stop or a container stop or start done), in the words of RV(per_gpu).
  returned: always
  type: list
  elements: dict
  sample: [{"vmid": 101, "changed": true, "verdict": "free", "note": "this container's share is free; 2048 MiB are held by others",
            "planned": [4388],
            "gpus": [{"index": 0, "minor": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "before_mib": 300, "after_mib": 0,
                      "others_mib": 2048,
                      "free": true, "rung": "sigterm", "signals": ["SIGTERM 4388 (python3)"]}],
            "found_units": [], "stopped": [],
            "actions": [{"pid": 4388, "name": "python3", "signal": "SIGTERM", "outcome": "sent"}], "not_signalled": [],
            "rung": "sigterm", "signals": ["SIGTERM 4388 (python3)"]}]
per_gpu:
  description:
    - One entry per targeted GPU (as in RV(before)), on both paths (inside a container and from the node), saying what
      was done for it and how it ended. The same shape whichever path ran the release.
    - C(index) and C(uuid) as this host numbers and names the GPU.
    - C(rung) is the strongest step taken for it, weakest first C(none), C(stop) (a unit of
      O(advanced.stop_found_units)), C(sigterm), C(sigkill), C(wait) (a planned holder stuck in D state),
      C(container_restart) (a container that held it was stopped), C(reset).
    - C(signals) lists each step taken for it, a signal sent to a process planned for it (C(SIGKILL 533 (python3))),
      its reset (C(reset GPU 1)), or a stop or container stop in a container that held it (C(container_stop
      container 101)); steps refused or not sent are in RV(actions) only.
    - C(verdict) is C(free) or C(busy) once verified (with O(shared_gpu=own) on a node, free for the scope),
      C(planned) or C(nothing to do) in check mode, or C(not released) when the task stopped before the ladder
      (a refusal, a lock, NVML; C(msg) says why).
    - C(planned) lists the pids of RV(plan) pinned to it.
  returned: always
  type: list
  elements: dict
  sample: [{"index": 0, "uuid": "GPU-5d3c6a9e-2f0b-5a43-9f1e-6c2d7b1e4a10", "rung": "sigkill",
            "signals": ["SIGTERM 533 (python3)", "SIGKILL 533 (python3)"], "verdict": "free", "planned": [533]}]
reads:
  description:
    - How the GPUs were read while the release waited. C(full) counts full reads (NVML and a walk of C(/proc));
      C(fast) counts polls that read NVML alone (with O(shared_gpu=own) on a node, between full reads at most 1 s
      apart). A fast poll only tells that the scope still holds a GPU, never that it is free.
  returned: always
  type: dict
  sample: {"fast": 24, "full": 4}
shm_residue:
  description:
    - With O(advanced.clean_shm), the residue found once the GPUs were free (C(path) as its container sees it, C(bytes),
      C(owner), C(vmid), null for this host's); in check mode, what would be removed.
  returned: with O(advanced.clean_shm), when the targeted GPUs end free
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-Xk3a9Q", "bytes": 9437184, "owner": "nccl", "vmid": 101}]
shm_removed:
  description: With O(advanced.clean_shm), the residue files removed (as in RV(shm_residue)).
  returned: with O(advanced.clean_shm), when the targeted GPUs end free
  type: list
  elements: dict
  sample: [{"path": "/dev/shm/nccl-Xk3a9Q", "bytes": 9437184, "owner": "nccl", "vmid": 101}]
shm_left:
  description:
    - With O(advanced.clean_shm), residue files not removed, each with C(why); these fail the task.
    - One in use, or changed, when read again right before the removals has C(kept) true and fails nothing.
  returned: with O(advanced.clean_shm), when the targeted GPUs end free
  type: list
  elements: dict
  sample: []
shm_skipped:
  description:
    - With O(advanced.clean_shm), the C(/dev/shm) folders in scope that were not cleaned, each with C(vmid) (null for
      this host's), C(path) and C(why) (one mount with a folder out of scope, a process not read that may use it, a
      symlink in its path, no answer in time).
  returned: with O(advanced.clean_shm), when the targeted GPUs end free
  type: list
  elements: dict
  sample: [{"vmid": 101, "path": "/dev/shm", "why": "it is one mount with the node's /dev/shm, outside the scope: nothing on it is removed"}]
reset_blockers:
  description:
    - With O(gpu_reset) on a node, what would block a reset of the targeted GPUs, each with C(kind) (C(user_holder),
      C(nvml_client), C(daemon), C(persistence_mode), C(nvidia_drm), C(mig_mode)), C(what), C(gpus) (the indexes it
      blocks; a daemon serves every GPU of the node) and C(action) (what is done about it, or C(refused)).
  returned: always
  type: list
  elements: dict
  sample: [{"kind": "daemon", "what": "pid 812 (nvidia-persistenced), a daemon that serves every GPU of the node: 0 (GPU-...)",
            "gpus": [0, 1], "action": "stop supervisord nvidia-persistenced:nvidia-persistenced, start it again after the reset"}]
reset_steps:
  description:
    - With O(advanced.reset_blockers=stop_services), each step around the reset in order (C(stop), C(persistence_off),
      C(persistence_on), C(start)), with C(target), C(ok) and C(outcome).
  returned: always
  type: list
  elements: dict
  sample: [{"step": "stop", "target": "systemd nvidia-persistenced.service", "ok": true, "outcome": "done"}]
left_changed:
  description:
    - What a stop changed that its restore could not put back, each with C(kind) (C(service), C(persistence),
      C(container)), C(what), C(state) (as it was left) and C(why) (the restore's outcome). Not empty fails the task.
    - Also returned when the module's hard stop or an error ends the task (every registered restore runs first).
  returned: always
  type: list
  elements: dict
  sample: [{"kind": "service", "what": "systemd nvidia-persistenced.service", "state": "stopped",
            "why": "exit 1: Job for nvidia-persistenced.service failed"}]
found_units:
  description:
    - With O(advanced.stop_found_units), the stop sets decided V(stop) (see RV(stop_sets)) that run the planned holders
      in their containers (C(vmid), C(kind) C(systemd), C(systemd-user), C(docker) or C(supervisord), C(name), C(pids),
      C(evidence)) and, once tried, C(outcome) (C(done...) or C(failed...)).
  returned: always
  type: list
  elements: dict
  sample: [{"vmid": 101, "kind": "supervisord", "name": "gpu_worker:gpu_worker", "pids": [4388],
            "evidence": "pid 4388 runs under supervisord (pid 4101 on the node) as program gpu_worker:gpu_worker",
            "outcome": "done: gpu_worker:gpu_worker: stopped"}]
stop_sets:
  description:
    - On a node with O(containers), every stop set of the planned holders, decided, whether or not
      O(advanced.stop_found_units) stops it, in check mode too.
    - C(vmid), C(kind) (C(systemd), C(systemd-user), C(supervisord), C(docker); null when there is none), C(name),
      C(pids) (the planned holders it runs), C(main) (C(pid), C(name); the process its manager started), C(members)
      (C(pid), C(name), C(uid), C(why) each is in it), C(dependents) (of a unit, the live units its stop would stop
      too), C(evidence), C(verdict) (V(stop), V(refused) or V(no set)), C(reason),
      C(collateral) (members that may hold an untargeted GPU, with C(gpus) and C(why)), C(how_to_stop) (what to run
      by hand) and C(outcome) (null until its stop ran; C(not run...) with O(advanced.stop_found_units) off).
  returned: always
  type: list
  elements: dict
  sample: [{"vmid": 101, "kind": "supervisord", "name": "trainer:trainer", "pids": [4388],
            "main": {"pid": 4388, "name": "python3", "session_shell": false},
            "members": [{"pid": 4388, "name": "python3", "why": "the program's process (started by supervisord pid 4101)"}],
            "evidence": "pid 4388 runs under supervisord (pid 4101 on the node) as program trainer:trainer",
            "manager_uid": null, "problem": null, "verdict": "stop",
            "reason": "every member is a planned holder or part of its program", "collateral": [],
            "how_to_stop": "`pct exec 101 -- supervisorctl stop trainer:trainer`", "outcome": "done: trainer:trainer: stopped"}]
respawned:
  description:
    - The respawn that failed the task, null otherwise. The killed holders' ancestors are watched up to each one's
      innermost manager (a wrapper that exits with its child does not end the watch; a user's service manager counts
      as an init; never above the container). A process started under one of them after the kill is a respawn when
      it holds a targeted GPU by the pinning rule (a context mapped there, named by NVML; a GPU it only sees is not
      one), or when it is the same program as a killed holder (its argv apart from numbers, its unit's main process,
      or its supervisord program) still starting when the window ends.
    - C(pid) and C(name) are the new holder's (never signalled); C(parent_pid) and C(parent_name) the watched
      ancestor that started it; C(chain) that ancestor and its ancestors up to pid 1 (C(pid), C(name)); C(unit) the
      systemd service when the ancestor is an init; C(evidence) why it is a respawn; C(how_to_stop) what to stop
      before releasing again.
  returned: always
  type: dict
  sample: {"pid": 702, "name": "python3", "parent_pid": 35, "parent_name": "sh", "unit": null,
           "evidence": "the same program as a killed holder, holding a targeted GPU (a context mapped, named by NVML)",
           "chain": [{"pid": 35, "name": "sh"}, {"pid": 12, "name": "bash"}, {"pid": 1, "name": "init"}],
           "how_to_stop": "stop pid 35 (sh) or what runs it first (a shell loop, a launcher such as torchrun, a
             supervisor), then release again"}
"""

import signal
import time
import traceback

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.gpuops.fleet.plugins.module_utils._gpu_engine import engine_from_params, no_gpu_message, view_of
from ansible_collections.gpuops.fleet.plugins.module_utils import _decide as decide
from ansible_collections.gpuops.fleet.plugins.module_utils import _hardstop as hardstop
from ansible_collections.gpuops.fleet.plugins.module_utils import _node as node
from ansible_collections.gpuops.fleet.plugins.module_utils import _outcome as outcome
from ansible_collections.gpuops.fleet.plugins.module_utils import _restart as restart
from ansible_collections.gpuops.fleet.plugins.module_utils._nvml import NvmlFailure
from ansible_collections.gpuops.fleet.plugins.module_utils._params import (
    RELEASE_PACKAGES, ReleaseOptions, check_release_params, flat_params, release_spec, validate_libraries,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._release import (
    ReleaseTimeout, backstop_result, left_changed_words, release,
)
from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import SelectorError

BACKSTOP_S = 5.0  # the hard alarm fires this long after `timeout`, should a wait overrun it


def _backstop(signum, frame):
    """The hard stop: ReleaseTimeout, held off while a restore runs (_hardstop)."""
    hardstop.on_alarm(signum, frame)


def _left_changed_words(kept):
    words = left_changed_words(kept.get("left_changed"))
    return "; " + words if words else ""


def check_scope(module, params):
    """The node-side scope (a _node.Scope), or None inside a container or on a plain host without one.

    Fails the task, before NVML is opened, on options that do not fit where it runs.
    """
    view = view_of()
    bad = [c for c in params["containers"] if c < 100]
    if bad:
        module.fail_json(msg="containers: %s is no Proxmox vmid (vmids are 100 or more)" % bad[0])
    if view == "container":
        if params["containers"] or params["host_processes"]:
            module.fail_json(msg="containers and host_processes apply on a Proxmox node only; this task runs inside a "
                                 "container, which sees only its own processes")
        if params["gpu_reset"]:
            module.fail_json(msg="gpu_reset is refused inside a container: a reset needs every process of the node off "
                                 "the GPU, which only the node can see; run gpu_release with gpu_reset: true on the "
                                 "Proxmox node (delegate_to the node, containers: [VMID]), or the release_gpus role "
                                 "with release_gpus_from: node")
    if params["stop_found_units"] and not params["containers"]:
        module.fail_json(msg="advanced.stop_found_units needs containers: [VMID, ...] (whose units it may stop), on the "
                             "Proxmox node")
    if params["container_restart"] and not params["containers"]:
        module.fail_json(msg="container_restart needs containers: [VMID, ...] (the containers it may restart), on the "
                             "Proxmox node")
    if view == "node" and not (params["containers"] or params["host_processes"]):
        module.fail_json(msg="gpu_release runs on a Proxmox node here, where it sees the processes of every container: "
                             "it signals nothing without a scope; set containers: [VMID, ...] to signal those "
                             "containers' processes, and host_processes: true to also signal processes in no container")
    if view == "node" and params["containers"]:
        # a vmid with no config on this node (a typo, another node's container) fails before anything, in check mode
        # too: never "already free" for a container that is not here
        refusal = decide.unconfigured_containers(params["containers"], node.configured_containers())
        if refusal:
            module.fail_json(msg=refusal, changed=False)
    if params["containers"] or params["host_processes"]:
        return node.Scope(params["containers"], params["host_processes"])
    return None


def read_options(module, params):
    """The release's options (ReleaseOptions), after the checks that need no library and no GPU."""
    scope = check_scope(module, params)
    try:
        return ReleaseOptions.from_params(params, scope=scope)
    except (ValueError, SelectorError) as exc:
        module.fail_json(msg=str(exc))
    return None  # not reached: fail_json exits


def leave_out_locked(opts):
    """On a node: the containers whose config carries a lock (backup, migrate, snapshot) leave the scope, each with
    its reason in skipped_containers; the task fails naming them once the others are released."""
    scope = opts.scope
    if scope is None or not scope.containers or view_of() != "node":
        return opts
    skipped = node.locked_containers(sorted(scope.containers, key=int))
    if not skipped:
        return opts
    kept = node.Scope([c for c in scope.containers if c not in skipped], scope.host_processes)
    return opts.replace(scope=kept, skipped_containers=skipped)


def start_engine(module, engine, gpus):
    """Open NVML and select the targeted GPUs; fails the task, nothing signalled, when that cannot be done."""
    try:
        engine.start()
    except NvmlFailure as exc:
        module.fail_json(msg="NVML cannot be used on this host, nothing was signalled: %s" % exc.message,
                         changed=False, diagnosis=[exc.message])
    try:
        targets = engine.select(gpus)
    except SelectorError as exc:
        module.fail_json(msg=str(exc), changed=False)
    no_gpu = no_gpu_message(engine, targets)
    if no_gpu:
        module.fail_json(msg=no_gpu + "; nothing was signalled", changed=False)
    return targets


def with_restart_backend(module, params, opts):
    """With container_restart: the container rung's backend (the Proxmox API, proxmoxer validated, or pct)."""
    if not params["container_restart"]:
        return opts
    try:
        api = restart.api_credentials(params)
        if api:
            restart.load_proxmoxer()
            validate_libraries(module, ["proxmoxer"])
        return opts.replace(restart_backend=restart.backend_for(api))
    except restart.RestartError as exc:
        module.fail_json(msg="%s; nothing was signalled" % exc, changed=False)
    return None  # not reached: fail_json exits


def fail_unfinished(module, exc, params, started, progress):
    """A hard stop (ReleaseTimeout) or an unexpected error: what was done so far, after any restore still due."""
    signal.setitimer(signal.ITIMER_REAL, 0)
    trace = traceback.format_exc()
    kept = backstop_result(progress)   # runs any restore still registered first
    if isinstance(exc, ReleaseTimeout):
        module.fail_json(msg="%s (timeout %ss); the state is unknown, run gpuops.fleet.gpu_info%s"
                         % (exc, params["timeout"], _left_changed_words(kept)),
                         elapsed_s=round(time.monotonic() - started, 3), **kept)
    module.fail_json(msg="gpu_release failed: %s%s" % (exc, _left_changed_words(kept)), exception=trace, **kept)


def finish(module, opts, failed, msg, result):
    """Exit with the result, its per-GPU and per-container shape added; a container left out fails the task."""
    skipped = opts.skipped_containers
    if skipped:
        failed = True
        msg = "%s; left out: %s" % (msg, "; ".join(skipped[v] for v in sorted(skipped, key=int)))
    outcome.add_shape(result, module.check_mode)
    if failed:
        module.fail_json(msg=msg, **result)
    module.exit_json(msg=msg, **result)


def main():
    module = AnsibleModule(argument_spec=release_spec(), supports_check_mode=True)
    started = time.monotonic()
    params, labels = flat_params(module.params)
    # bad input fails before NVML is even opened
    patterns = check_release_params(module, params, labels)
    opts = read_options(module, params)
    validate_libraries(module, RELEASE_PACKAGES)
    opts = leave_out_locked(opts)

    deadline = started + params["timeout"]
    signal.signal(signal.SIGALRM, _backstop)
    signal.setitimer(signal.ITIMER_REAL, params["timeout"] + BACKSTOP_S)
    engine = engine_from_params(params, patterns)
    progress = {}
    try:
        targets = start_engine(module, engine, params["gpus"])
        opts = with_restart_backend(module, params, opts)
        # release() takes the options as a dict until it takes the ReleaseOptions itself (issue 46, slice "cut")
        failed, msg, result = release(engine, targets, opts.as_dict(), check_mode=module.check_mode, log=module.log,
                                      deadline=deadline, progress=progress)
    except Exception as exc:  # ReleaseTimeout (the hard stop) included; fail_json's SystemExit is no Exception
        fail_unfinished(module, exc, params, started, progress)
    signal.setitimer(signal.ITIMER_REAL, 0)
    engine.nvml.shutdown()
    finish(module, opts, failed, msg, result)


if __name__ == "__main__":
    main()
