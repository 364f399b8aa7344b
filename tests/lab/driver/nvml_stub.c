/*
 * Lab stand-in for libnvidia-ml.so.1 (gpuops.fleet test lab).
 *
 * Every query asks the lab driver daemon (labdriver.py) over an AF_UNIX
 * socket, so memory and processes are the truth at call time. Only the
 * device identities are kept from nvmlInit, as handles.
 * ABI follows what nvidia-ml-py (pynvml.py) calls; see docs/design.md.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MIB 1048576ULL
#define MAX_DEVS 64
#define MAX_PROCS 4096
#define MAX_FDS (MAX_DEVS + 8)
#define NVML_MEMORY_V2 0x02000028U
#define NOT_AVAILABLE_UINT 0xFFFFFFFFU
#define DEFAULT_SOCKET "/run/nvidia-lab/driver.sock"
#define DEVICE_NAME "NVIDIA H200"
#define PCI_DEVICE_ID 0x233510DEU
#define PCI_SUBSYSTEM_ID 0x18BE10DEU
#define CUDA_DRIVER_VERSION 13000

/* hang: every call on the GPU; hang_memory, hang_procs: that call only; no_v2: no nvmlDeviceGetMemoryInfo_v2. */
enum { FAULT_NONE = 0, FAULT_LOST = 1, FAULT_HANG = 2, FAULT_HANG_MEMORY = 3, FAULT_HANG_PROCS = 4, FAULT_NO_V2 = 5 };

/* A handle points at one of these, filled at nvmlInit. */
typedef struct lab_device {
    unsigned int index;
    unsigned int minor;
    char uuid[96];
    char bus_id[32];
} lab_device_t;
typedef lab_device_t *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* v2 and v3 share this layout */

typedef struct {
    char busId[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t; /* nvmlDeviceGetPciInfo and _v2 */

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t; /* nvmlDeviceGetPciInfo_v3 */

/* Health conditions the daemon names on a HEALTH line (labdriver.HEALTH). */
enum {
    H_RETIRED_PENDING = 1, H_REMAP_PENDING = 2, H_REMAP_FAILURE = 4, H_ECC_PENDING = 8,
    H_RESET_REQUIRED = 16, H_NODE_REBOOT = 32, H_DRAIN_AND_RESET = 64,
};

/* One answer of the daemon's text snapshot. */
typedef struct {
    unsigned int index, minor;
    char uuid[96], bus_id[32];
    unsigned long long total, reserved, used; /* MiB, used is v2 */
    int fault;
    int health; /* H_* bits */
    int persistence;
} snap_dev_t;

typedef struct {
    unsigned int index, pid;
    unsigned long long mib;
} snap_proc_t;

typedef struct {
    char driver[80];
    int init_not_loaded, init_hang;
    int ndev, nproc, nmps;
    snap_dev_t dev[MAX_DEVS];
    snap_proc_t proc[MAX_PROCS];
    snap_proc_t mps[MAX_PROCS]; /* MPS clients (also in proc) */
} snapshot_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_refcount;
static lab_device_t g_devs[MAX_DEVS];
static unsigned int g_ndev;
static int g_fds[MAX_FDS];
static int g_nfds;
static char g_driver[80] = "580.159.04";

/* ---- talking to the daemon ---- */

static const char *socket_path(void)
{
    const char *p = getenv("NVIDIA_LAB_SOCKET");
    return (p && *p) ? p : DEFAULT_SOCKET;
}

/* The node a caller outside any container asks about (names are [A-Za-z0-9_-]). */
static void node_field(char *out, size_t len)
{
    const char *n = getenv("NVIDIA_LAB_NODE");
    out[0] = '\0';
    if (!n || !*n)
        return;
    for (const char *c = n; *c; c++)
        if (!isalnum((unsigned char)*c) && *c != '-' && *c != '_')
            return;
    snprintf(out, len, ",\"node\":\"%s\"", n);
}

/* Sends one request line, returns the whole answer (malloc'd) or NULL. */
static char *ask_daemon(const char *request)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return NULL;
    struct timeval tv = {30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, socket_path(), sizeof addr.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        return NULL;
    }
    size_t want = strlen(request), sent = 0;
    while (sent < want) {
        ssize_t n = write(fd, request + sent, want - sent);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            close(fd);
            return NULL;
        }
        sent += (size_t)n;
    }
    size_t cap = 16384, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf)
            break;
        if (len + 4096 > cap) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            free(buf);
            buf = NULL;
            break;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    if (buf)
        buf[len] = '\0';
    return buf;
}

static int parse_fault(const char *s)
{
    if (strcmp(s, "lost") == 0)
        return FAULT_LOST;
    if (strcmp(s, "hang") == 0)
        return FAULT_HANG;
    if (strcmp(s, "hang_memory") == 0)
        return FAULT_HANG_MEMORY;
    if (strcmp(s, "hang_procs") == 0)
        return FAULT_HANG_PROCS;
    if (strcmp(s, "no_v2") == 0)
        return FAULT_NO_V2;
    return FAULT_NONE;
}

/* Fetches and parses a text snapshot of the caller's view. 0 on success. */
static int fetch_snapshot(snapshot_t *s)
{
    char node[96], request[160];
    node_field(node, sizeof node);
    snprintf(request, sizeof request, "{\"op\":\"snapshot\",\"format\":\"text\"%s}\n", node);
    char *answer = ask_daemon(request);
    if (!answer)
        return -1;
    memset(s, 0, sizeof *s);
    int complete = 0;
    char *save = NULL;
    for (char *line = strtok_r(answer, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char fault[32];
        if (strncmp(line, "DRIVER ", 7) == 0) {
            snprintf(s->driver, sizeof s->driver, "%s", line + 7);
        } else if (strncmp(line, "FAULT_INIT ", 11) == 0) {
            s->init_not_loaded = strcmp(line + 11, "not_loaded") == 0;
            s->init_hang = strcmp(line + 11, "hang") == 0;
        } else if (strncmp(line, "DEV ", 4) == 0 && s->ndev < MAX_DEVS) {
            snap_dev_t *d = &s->dev[s->ndev];
            if (sscanf(line + 4, "%u %u %95s %31s %llu %llu %llu %31s", &d->index, &d->minor, d->uuid,
                       d->bus_id, &d->total, &d->reserved, &d->used, fault) == 8) {
                d->fault = parse_fault(fault);
                s->ndev++;
            }
        } else if (strncmp(line, "HEALTH ", 7) == 0) {
            unsigned int index;
            int used = 0;
            if (sscanf(line + 7, "%u %n", &index, &used) >= 1 && used > 0) {
                for (int i = 0; i < s->ndev; i++) {
                    if (s->dev[i].index != index)
                        continue;
                    const char *w = line + 7 + used;
                    s->dev[i].health |= (strstr(w, "retired_pages_pending") ? H_RETIRED_PENDING : 0) |
                                        (strstr(w, "row_remap_pending") ? H_REMAP_PENDING : 0) |
                                        (strstr(w, "row_remap_failure") ? H_REMAP_FAILURE : 0) |
                                        (strstr(w, "ecc_pending") ? H_ECC_PENDING : 0) |
                                        (strstr(w, "reset_required") ? H_RESET_REQUIRED : 0) |
                                        (strstr(w, "node_reboot_required") ? H_NODE_REBOOT : 0) |
                                        (strstr(w, "drain_and_reset") ? H_DRAIN_AND_RESET : 0);
                }
            }
        } else if (strncmp(line, "PERSISTENCE ", 12) == 0) {
            unsigned int index;
            int mode;
            if (sscanf(line + 12, "%u %d", &index, &mode) == 2)
                for (int i = 0; i < s->ndev; i++)
                    if (s->dev[i].index == index)
                        s->dev[i].persistence = mode;
        } else if (strncmp(line, "MPSPROC ", 8) == 0 && s->nmps < MAX_PROCS) {
            snap_proc_t *p = &s->mps[s->nmps];
            if (sscanf(line + 8, "%u %u %llu", &p->index, &p->pid, &p->mib) == 3)
                s->nmps++;
        } else if (strncmp(line, "PROC ", 5) == 0 && s->nproc < MAX_PROCS) {
            snap_proc_t *p = &s->proc[s->nproc];
            if (sscanf(line + 5, "%u %u %llu", &p->index, &p->pid, &p->mib) == 3)
                s->nproc++;
        } else if (strcmp(line, "END") == 0) {
            complete = 1;
        }
    }
    free(answer);
    return complete ? 0 : -1;
}

/*
 * A hung driver call never returns, and the calling thread is stuck in the kernel: the daemon
 * puts it into a cgroup v1 freezer (state D, SIGKILL pends until thawed, like a real driver hang).
 * Once thawed (fault cleared, container restarted, lab down) it still never returns.
 */
static void hang_forever(void)
{
    char node[96], request[200];
    node_field(node, sizeof node);
    snprintf(request, sizeof request, "{\"op\":\"hang\",\"tid\":%ld%s}\n", (long)syscall(SYS_gettid), node);
    free(ask_daemon(request));
    for (;;)
        pause();
}

/* ---- init and shutdown ---- */

static void close_fds(void)
{
    for (int i = 0; i < g_nfds; i++)
        close(g_fds[i]);
    g_nfds = 0;
}

/*
 * Opens a device node like the real library: fd only, never mapped (GPU_FACTS row 8).
 * Only the lab's regular files: a real NVIDIA character device is never opened.
 */
static int open_node(const char *name)
{
    const char *dir = getenv("NVIDIA_LAB_DEV_DIR");
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", (dir && *dir) ? dir : "/dev", name);
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
        return -1;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd >= 0 && g_nfds < MAX_FDS)
        g_fds[g_nfds++] = fd;
    return fd;
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount > 0) {
        g_refcount++;
        goto out;
    }
    snapshot_t *s = malloc(sizeof *s);
    int fetched = s ? fetch_snapshot(s) : -1;
    if (fetched == 0 && s->init_hang)
        hang_forever(); /* g_lock stays held: other threads' NVML calls queue behind it, as in a real driver */
    if (fetched != 0 || s->init_not_loaded) {
        free(s);
        ret = NVML_ERROR_DRIVER_NOT_LOADED;
        goto out;
    }
    if (open_node("nvidiactl") < 0) {
        free(s);
        ret = NVML_ERROR_DRIVER_NOT_LOADED;
        goto out;
    }
    open_node("nvidia-uvm");
    open_node("nvidia-caps/nvidia-cap1"); /* where present, like the real library */
    open_node("nvidia-caps/nvidia-cap2");
    g_ndev = 0;
    for (int i = 0; i < s->ndev; i++) {
        lab_device_t *d = &g_devs[g_ndev++];
        d->index = s->dev[i].index;
        d->minor = s->dev[i].minor;
        snprintf(d->uuid, sizeof d->uuid, "%s", s->dev[i].uuid);
        snprintf(d->bus_id, sizeof d->bus_id, "%s", s->dev[i].bus_id);
        char name[32];
        snprintf(name, sizeof name, "nvidia%u", d->minor);
        open_node(name);
    }
    if (s->driver[0])
        snprintf(g_driver, sizeof g_driver, "%s", s->driver);
    free(s);
    g_refcount = 1;
out:
    pthread_mutex_unlock(&g_lock);
    return ret;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t ret = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0)
        ret = NVML_ERROR_UNINITIALIZED;
    else if (--g_refcount == 0)
        close_fds();
    pthread_mutex_unlock(&g_lock);
    return ret;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

/* ---- helpers ---- */

static int initialized(void)
{
    pthread_mutex_lock(&g_lock);
    int up = g_refcount > 0;
    pthread_mutex_unlock(&g_lock);
    return up;
}

static int valid_handle(nvmlDevice_t h)
{
    return h >= g_devs && h < g_devs + g_ndev;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/*
 * Fresh truth for one device. On success *snap (caller frees) and *dev are set.
 * Faults apply to every call on a handle: hang blocks, lost returns 15.
 */
static nvmlReturn_t device_truth(nvmlDevice_t h, snapshot_t **snap, snap_dev_t **dev)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!valid_handle(h))
        return NVML_ERROR_INVALID_ARGUMENT;
    snapshot_t *s = malloc(sizeof *s);
    if (!s)
        return NVML_ERROR_UNKNOWN;
    if (fetch_snapshot(s) != 0) {
        free(s);
        return NVML_ERROR_UNKNOWN;
    }
    for (int i = 0; i < s->ndev; i++) {
        if (s->dev[i].minor != h->minor)
            continue;
        if (s->dev[i].fault == FAULT_HANG)
            hang_forever();
        if (s->dev[i].fault == FAULT_LOST)
            break;
        *snap = s;
        *dev = &s->dev[i];
        return NVML_SUCCESS;
    }
    free(s);
    return NVML_ERROR_GPU_IS_LOST;
}

/* Identity calls go through the same fault check, then answer from the handle. */
static nvmlReturn_t device_check(nvmlDevice_t h)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    nvmlReturn_t ret = device_truth(h, &s, &d);
    free(s);
    return ret;
}

/* device_check for a getter that writes through one pointer: a null pointer is an invalid argument. */
static nvmlReturn_t device_check_out(nvmlDevice_t h, const void *out)
{
    return out ? device_check(h) : NVML_ERROR_INVALID_ARGUMENT;
}

/* ---- system ---- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, g_driver);
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    char v[96];
    snprintf(v, sizeof v, "%d.%s", CUDA_DRIVER_VERSION / 1000, g_driver);
    return copy_string(version, length, v);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version)
{
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    *version = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version)
{
    return nvmlSystemGetCudaDriverVersion(version);
}

/* ---- handles ---- */

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = g_ndev;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= g_ndev)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_devs[index];
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_ndev; i++) {
        if (strcasecmp(g_devs[i].uuid, uuid) == 0) {
            *device = &g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

/* Parses "dddddddd:bb:dd.f", "dddd:bb:dd.f" or "bb:dd.f". */
static int parse_bus_id(const char *s, unsigned int *dom, unsigned int *bus, unsigned int *dev, unsigned int *fn)
{
    char tail;
    if (sscanf(s, "%x:%x:%x.%x%c", dom, bus, dev, fn, &tail) == 4)
        return 0;
    *dom = 0;
    if (sscanf(s, "%x:%x.%x%c", bus, dev, fn, &tail) == 3)
        return 0;
    return -1;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device)
{
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    unsigned int d1, b1, v1, f1, d2, b2, v2, f2;
    if (!pciBusId || !device || parse_bus_id(pciBusId, &d1, &b1, &v1, &f1) != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < g_ndev; i++) {
        if (parse_bus_id(g_devs[i].bus_id, &d2, &b2, &v2, &f2) == 0 && d1 == d2 && b1 == b2 && v1 == v2 &&
            f1 == f2) {
            *device = &g_devs[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *pciBusId, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByPciBusId_v2(pciBusId, device);
}

/* ---- identity ---- */

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length)
{
    nvmlReturn_t ret = device_check(h);
    return ret != NVML_SUCCESS ? ret : copy_string(name, length, DEVICE_NAME);
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length)
{
    nvmlReturn_t ret = device_check(h);
    return ret != NVML_SUCCESS ? ret : copy_string(uuid, length, h->uuid);
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor)
{
    nvmlReturn_t ret = device_check_out(h, minor);
    if (ret == NVML_SUCCESS)
        *minor = h->minor;
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index)
{
    nvmlReturn_t ret = device_check_out(h, index);
    if (ret == NVML_SUCCESS)
        *index = h->index;
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci)
{
    unsigned int dom, bus, dev, fn;
    nvmlReturn_t ret = device_check_out(h, pci);
    if (ret != NVML_SUCCESS)
        return ret;
    if (parse_bus_id(h->bus_id, &dom, &bus, &dev, &fn) != 0)
        return NVML_ERROR_UNKNOWN;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", dom, bus, dev);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", dom, bus, dev);
    pci->domain = dom;
    pci->bus = bus;
    pci->device = dev;
    pci->pciDeviceId = PCI_DEVICE_ID;
    pci->pciSubSystemId = PCI_SUBSYSTEM_ID;
    return NVML_SUCCESS;
}

/* The legacy struct starts as the v3 one does: the short bus id, then the same five ids. */
_Static_assert(offsetof(nvmlPciInfo_v2_t, pciSubSystemId) == offsetof(nvmlPciInfo_t, pciSubSystemId) &&
                   offsetof(nvmlPciInfo_t, busId) <= sizeof(nvmlPciInfo_v2_t),
               "nvmlPciInfo_v2_t and nvmlPciInfo_t share their leading fields");

static nvmlReturn_t pci_info_legacy(nvmlDevice_t h, nvmlPciInfo_v2_t *pci)
{
    nvmlPciInfo_t v3;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = nvmlDeviceGetPciInfo_v3(h, &v3);
    if (ret != NVML_SUCCESS)
        return ret;
    memset(pci, 0, sizeof *pci);
    memcpy(pci, &v3, offsetof(nvmlPciInfo_t, busId));
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_v2_t *pci) { return pci_info_legacy(h, pci); }
EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_v2_t *pci) { return pci_info_legacy(h, pci); }

/* ---- memory ---- */

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *memory)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = device_truth(h, &s, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (d->fault == FAULT_HANG_MEMORY)
        hang_forever();
    /* v1: the reserved floor counts as used (GPU_FACTS row 1). */
    memory->total = d->total * MIB;
    memory->used = (d->reserved + d->used) * MIB;
    memory->free = memory->total - memory->used;
    free(s);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *memory)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    if (!memory)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t ret = device_truth(h, &s, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (d->fault == FAULT_NO_V2) {
        /* what nvidia-ml-py reports when the library has no such symbol (drivers before R510) */
        free(s);
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    }
    if (d->fault == FAULT_HANG_MEMORY)
        hang_forever();
    memory->total = d->total * MIB;
    memory->reserved = d->reserved * MIB;
    memory->used = d->used * MIB;
    memory->free = memory->total - memory->reserved - memory->used;
    free(s);
    return NVML_SUCCESS;
}

/* ---- processes ---- */

/* Fills v1 (16-byte) or v2/v3 (24-byte) process records with NVML's size protocol. */
static nvmlReturn_t running_processes_of(nvmlDevice_t h, unsigned int *count, void *infos, int v1_layout, int mps_list)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = device_truth(h, &s, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    if (d->fault == FAULT_HANG_PROCS)
        hang_forever();
    snap_proc_t *list = mps_list ? s->mps : s->proc;
    int nlist = mps_list ? s->nmps : s->nproc;
    unsigned int n = 0;
    for (int i = 0; i < nlist; i++)
        if (list[i].index == d->index)
            n++;
    if (n == 0) {
        *count = 0;
        ret = NVML_SUCCESS;
    } else if (*count < n || !infos) {
        *count = n;
        ret = NVML_ERROR_INSUFFICIENT_SIZE;
    } else {
        unsigned int k = 0;
        for (int i = 0; i < nlist; i++) {
            snap_proc_t *p = &list[i];
            if (p->index != d->index)
                continue;
            if (v1_layout) {
                nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + k;
                out->pid = p->pid;
                out->usedGpuMemory = p->mib * MIB;
            } else {
                nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + k;
                out->pid = p->pid;
                out->usedGpuMemory = p->mib * MIB;
                out->gpuInstanceId = NOT_AVAILABLE_UINT;
                out->computeInstanceId = NOT_AVAILABLE_UINT;
            }
            k++;
        }
        *count = k;
    }
    free(s);
    return ret;
}

static nvmlReturn_t running_processes(nvmlDevice_t h, unsigned int *count, void *infos, int v1_layout)
{
    return running_processes_of(h, count, infos, v1_layout, 0);
}

/* NVML's MPS client list: the clients only, not the server (GPU_FACTS row 26). */
EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes_of(h, count, infos, 0, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes_of(h, count, infos, 0, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    return running_processes_of(h, count, infos, 1, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes(h, count, infos, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes(h, count, infos, 0);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    return running_processes(h, count, infos, 1);
}

/* No graphics clients on a compute node: always empty. */
static nvmlReturn_t no_processes(nvmlDevice_t h, unsigned int *count)
{
    nvmlReturn_t ret = device_check_out(h, count);
    if (ret == NVML_SUCCESS)
        *count = 0;
    return ret;
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_processes(h, count);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos)
{
    (void)infos;
    return no_processes(h, count);
}

EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_v1_t *infos)
{
    (void)infos;
    return no_processes(h, count);
}

/* ---- health (what an H200 answers unless the lab sets a condition: docs/facts/health_h200.json) ---- */

/* Reads one device's health bits through the usual fault checks; -1 on failure (ret set). */
static int device_health(nvmlDevice_t h, nvmlReturn_t *ret)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    *ret = device_truth(h, &s, &d);
    if (*ret != NVML_SUCCESS)
        return -1;
    int bits = d->health;
    free(s);
    return bits;
}

/* An H200 remaps rows instead: Not Supported (GPU_FACTS row 29), unless the lab marks pages pending. */
EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t h, int *isPending)
{
    nvmlReturn_t ret;
    if (!isPending)
        return NVML_ERROR_INVALID_ARGUMENT;
    int bits = device_health(h, &ret);
    if (bits < 0)
        return ret;
    if (!(bits & H_RETIRED_PENDING))
        return NVML_ERROR_NOT_SUPPORTED;
    *isPending = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred)
{
    nvmlReturn_t ret;
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        return NVML_ERROR_INVALID_ARGUMENT;
    int bits = device_health(h, &ret);
    if (bits < 0)
        return ret;
    *corrRows = 0;
    *uncRows = (bits & (H_REMAP_PENDING | H_REMAP_FAILURE)) ? 1 : 0;
    *isPending = (bits & H_REMAP_PENDING) ? 1 : 0;
    *failureOccurred = (bits & H_REMAP_FAILURE) ? 1 : 0;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t h, int *current, int *pending)
{
    nvmlReturn_t ret;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    int bits = device_health(h, &ret);
    if (bits < 0)
        return ret;
    *current = 1;
    *pending = (bits & H_ECC_PENDING) ? 0 : 1;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType, nvmlReturn;
    union {
        double dVal;
        unsigned int uiVal;
        unsigned long ulVal;
        unsigned long long ullVal;
        long long sllVal;
        int siVal;
        unsigned short usVal;
    } value;
} nvmlFieldValue_t;

#define FI_GPU_RECOVERY_ACTION 230

/* Only the recovery action (field 230) is answered; any other field is Not Supported in its own return. */
EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int valuesCount, nvmlFieldValue_t *values)
{
    nvmlReturn_t ret;
    if (valuesCount < 0 || (valuesCount > 0 && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    int bits = device_health(h, &ret);
    if (bits < 0)
        return ret;
    struct timeval now;
    gettimeofday(&now, NULL);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now.tv_sec * 1000000LL + now.tv_usec;
        v->latencyUsec = 0;
        v->value.ullVal = 0;
        if (v->fieldId != FI_GPU_RECOVERY_ACTION) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        v->valueType = 1; /* unsigned int */
        v->nvmlReturn = NVML_SUCCESS;
        v->value.uiVal = (bits & H_NODE_REBOOT) ? 2 : (bits & H_DRAIN_AND_RESET) ? 4 : (bits & H_RESET_REQUIRED) ? 1 : 0;
    }
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t h, int *mode)
{
    snapshot_t *s = NULL;
    snap_dev_t *d = NULL;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = device_truth(h, &s, &d);
    if (ret != NVML_SUCCESS)
        return ret;
    *mode = d->persistence ? 1 : 0;
    free(s);
    return NVML_SUCCESS;
}

/* MIG is off, as on the H200 measured (GPU_FACTS row 29). */
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *currentMode, unsigned int *pendingMode)
{
    if (!currentMode || !pendingMode)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t ret = device_check(h);
    if (ret == NVML_SUCCESS)
        *currentMode = *pendingMode = 0;
    return ret;
}
