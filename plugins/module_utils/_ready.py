# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether the next job can start on a GPU: one verdict from evidence read elsewhere (private helper, may change
any time). Pure: memory, NVML's health readings and device access in, ready and not_ready out."""

from __future__ import annotations

import math

# A new process's own CUDA context, which an inference engine's free-memory check no longer counts as free: 526 MiB
# for torch on an idle H200, driver 580 (cudaMemGetInfo free 142,629 of 143,155 MiB; docs/gpu-results.md).
CUDA_CONTEXT_MIB = 526

RESET = ("reset the GPU from the node once nothing holds it (gpuops.fleet.gpu_release with gpu_reset: true), "
         "or reboot the node")
REBOOT = "reboot the node"
RELEASE = "free it: gpuops.fleet.gpu_release, or playbooks/release_gpus.yml"

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h's nvmlDeviceGpuRecoveryAction_t)
RECOVERY = {
    1: ("the driver asks for a GPU reset (recovery action GPU_RESET)", RESET),
    2: ("the driver asks for a node reboot (recovery action NODE_REBOOT)", REBOOT),
    3: ("the driver asks to drain peer-to-peer traffic (recovery action DRAIN_P2P)",
        "stop the jobs that use this GPU over NVLink, then reset it from the node"),
    4: ("the driver recommends drain and reset (recovery action DRAIN_AND_RESET)",
        "stop every job on the GPU, then " + RESET),
    5: ("the driver asks to recover the IMEX domain (recovery action RECOVER_IMEX_DOMAIN)",
        "restart the IMEX daemon of the NVLink domain"),
    6: ("the driver asks for a PCIe bus reset (recovery action BUS_RESET)", REBOOT),
    7: ("the driver asks for a system reboot (recovery action SYSTEM_REBOOT)", REBOOT),
}


def fmt(mib):
    return "{:,}".format(int(mib))


def need_of(memory, need_mib=None, need_fraction=None):
    """(MiB the next job needs free, how that was computed) or None when nothing is asked. need_fraction is taken
    of what CUDA calls total (NVML v2 total less reserved), as vLLM's gpu_memory_utilization and SGLang's
    mem_fraction_static are, plus the new process's own context."""
    if need_mib:
        return int(need_mib), "need_mib %s MiB" % fmt(need_mib)
    if need_fraction:
        usable = memory["total_mib"] - (memory.get("reserved_mib") or 0)
        share = int(math.ceil(need_fraction * usable))
        return share + CUDA_CONTEXT_MIB, "need_fraction %g of %s MiB = %s MiB, plus %s MiB for the new process's " \
            "CUDA context" % (need_fraction, fmt(usable), fmt(share), fmt(CUDA_CONTEXT_MIB))
    return None


def free_mib(memory):
    """NVML v2 free: total less reserved less used."""
    return memory["total_mib"] - (memory.get("reserved_mib") or 0) - (memory.get("used_mib") or 0)


def capacity(memory, need_mib=None, need_fraction=None):
    """The capacity entry when the GPU's free memory does not cover the need, else None."""
    need = need_of(memory, need_mib, need_fraction) if memory else None
    if need is None:
        return None
    free = free_mib(memory)
    if free >= need[0]:
        return None
    return {"check": "capacity", "need_mib": need[0], "free_mib": free,
            "reason": "%s MiB free, %s MiB needed (%s)" % (fmt(free), fmt(need[0]), need[1]),
            "remedy": "free the GPU (gpuops.fleet.gpu_release) or start the job with less memory"}


def health(readings):
    """(per-check summary [{check, call, state, value}], not_ready entries) from Nvml.health readings. A call that
    is not supported (or missing) is not applicable, never not ready; any other error is reported, not ready."""
    summary, failed = [], []
    for r in readings:
        check, call, value = r["check"], r["call"], r["value"]
        entry = {"check": check, "call": call, "value": value, "state": "ok"}
        summary.append(entry)
        if r.get("code") in (3, 13):
            entry["state"] = "not_applicable"
            continue
        if r.get("error"):
            entry["state"] = "unreadable"
            failed.append({"check": check, "call": call, "reason": "%s failed: %s" % (call, r["error"]),
                           "remedy": "look at the node's kernel log (Xid errors); " + RESET})
            continue
        why = _unhealthy(check, value)
        if why:
            entry["state"] = "not_ready"
            failed.append(dict(check=check, call=call, reason=why[0], remedy=why[1]))
    return summary, failed


def _unhealthy(check, value):
    """(reason, remedy) when a reading says the GPU needs a reset or a reboot, else None."""
    if check == "retired_pages" and value:
        return "retired pages are pending (nvmlDeviceGetRetiredPagesPendingStatus: 1); they retire at the next " \
            "reset", RESET
    if check == "row_remap" and value:
        corrected, uncorrected, pending, failure = (list(value) + [0, 0, 0, 0])[:4]
        if failure:
            return "a row remap failed (nvmlDeviceGetRemappedRows: %d corrected, %d uncorrected rows, failure " \
                "occurred)" % (corrected, uncorrected), REBOOT + "; a failure that comes back needs the GPU serviced"
        if pending:
            return "a row remap is pending (nvmlDeviceGetRemappedRows: %d corrected, %d uncorrected rows); it is " \
                "applied at the next reset" % (corrected, uncorrected), RESET
    if check == "ecc_mode" and value and len(value) == 2 and value[0] != value[1]:
        return "ECC mode changes from %s to %s at the next reset (nvmlDeviceGetEccMode)" % (
            _on(value[0]), _on(value[1])), RESET
    if check == "recovery_action" and value:
        return RECOVERY.get(value, ("the driver asks for recovery action %s" % value, REBOOT))
    return None


def _on(value):
    return "on" if value else "off"


def access(reading, minor):
    """not_ready entries from device access (_access.read) for the GPU of minor."""
    out = []
    for shared in reading["shared"]:
        if shared["error"]:
            out.append({"check": "device_access", "reason": "%s does not open: %s" % (shared["path"], shared["error"]),
                        "remedy": _access_remedy(shared["error"], shared["path"])})
    gpu = reading["gpus"].get(minor)
    if gpu is None:
        return out
    if not gpu["paths"]:
        out.append({"check": "device_access", "reason": "no device file of GPU minor %d (195:%d) in this /dev" % (minor, minor),
                    "remedy": "pass it in from the node (devN: /dev/nvidia%d in the container's config)" % minor})
    for failed in gpu["errors"]:
        out.append({"check": "device_access", "reason": "%s does not open: %s" % (failed["path"], failed["error"]),
                    "remedy": _access_remedy(failed["error"], failed["path"])})
    return out


def access_unread(why):
    """The entry of a container whose device access could not be read from its node."""
    return {"check": "device_access", "reason": "device access could not be read inside the container: %s" % why,
            "remedy": "check that the container runs and has python3, then run gpu_info inside it"}


def unusable(blocked, index, minor):
    """The entry of a container whose config passes GPU index (minor) in but cannot open it: a passed_unusable entry
    of the node's read (vmid, source, device, rule)."""
    vmid, source, rule = blocked["vmid"], blocked["source"], blocked["rule"]
    conf = "/etc/pve/lxc/%s.conf" % vmid
    restart = "then restart the container (pct reboot %s)" % vmid
    if rule == "deny-write":
        remedy = "pass it in read-write: remove deny-write from %s in %s, %s" % (source, conf, restart)
    else:
        remedy = "allow it read-write in %s (lxc.cgroup2.devices.allow: c 195:%s rw, after any rule that denies it), %s" % (
            conf, minor, restart)
    return {"check": "device_access", "vmid": vmid, "remedy": remedy,
            "reason": "container %s: GPU %s (%s, passed in by %s) cannot be opened read-write, blocked by %s" % (
                vmid, index, blocked.get("device"), source, rule)}


def _access_remedy(error, path):
    if "EPERM" in error or "EACCES" in error:
        return "the container's device access was revoked (a systemctl daemon-reload on the node can do it): " \
            "restart the container from the node (pct reboot VMID)"
    if "EROFS" in error:
        return "the device file is on a read-only mount: pass it in read-write (devN: %s without deny-write)" % path
    if "ENOENT" in error:
        return "pass %s in from the node (devN: %s in the container's config)" % (path, path)
    return "look at the node's kernel log for the device"


def nvml_failure(error, kind):
    """The entry of a GPU NVML could not read."""
    remedy = REBOOT + " (a lost GPU comes back only after a reset or a reboot)" if kind == "lost" else \
        REBOOT + " (the driver is hung on this GPU)" if kind == "hang" else RESET
    return {"check": "nvml", "reason": error, "remedy": remedy}


def gpu_verdict(gpu, threshold_mib, health_entries=(), access_entries=(), need_mib=None, need_fraction=None):
    """(ready, not_ready) of one gpu_info GPU entry: free, capacity, health, device access, in that order."""
    if gpu.get("error"):
        not_ready = [nvml_failure(gpu["error"], gpu.get("error_kind"))]
        return False, not_ready + list(access_entries)
    not_ready = []
    memory = gpu.get("memory") or {}
    if not gpu.get("free"):
        not_ready.append({"check": "free", "used_mib": memory.get("used_mib"),
                          "reason": "%s MiB used (threshold %s MiB), holders %s" % (
                              memory.get("used_mib"), threshold_mib, ", ".join(str(p) for p in gpu.get("holders") or [])
                              or "none visible"),
                          "remedy": RELEASE})
    short = capacity(memory, need_mib, need_fraction) if memory.get("total_mib") else None
    if short:
        not_ready.append(short)
    not_ready += list(health_entries) + list(access_entries)
    return not not_ready, not_ready
