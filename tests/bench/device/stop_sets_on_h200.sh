#!/usr/bin/env bash
# Issue 42 on a real GPU: in a real LXC container configured as Proxmox does (../shared/tools/real_lxc_gpu.py,
# copied with Debian's lxc debs into .cache/real-lxc), one supervisord runs two programs: gpuops_ss_holder (PyTorch,
# 8 GiB on GPU 0) and gpuops_ss_idle (a plain Python sleep, no GPU). One gpu_release on the node, with
# advanced.stop_found_units, must print one stop set (the holder's supervisord program, verdict stop, its members the
# holder's process and not the idle program's), stop only that program, leave the idle one running with the same pid,
# and verify GPU 0 free of the container; a second run changes nothing.
#
# Here, once: bash tests/bench/device/multi_gpu_modules.sh --prepare (ansible-core's cp312 wheels), then
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .cache/mgpu-wheels supervisor   (4.3.0: no setuptools needed);
#   mkdir -p .cache/real-lxc && cp ../shared/tools/real_lxc_gpu.py .cache/real-lxc/ &&
#   (cd .cache/real-lxc && python3 real_lxc_gpu.py fetch debs)
# On the GPU machine (device tool, carry [".cache/mgpu-wheels", ".cache/real-lxc"]):
#   bash tests/bench/device/stop_sets_on_h200.sh
# Writes under $OUT: stop-sets.log, check.json, release.json, again.json, expectations.txt, supervisord.log.
# Never resets a GPU or changes a setting; gpu_release signals only what matches gpuops_ss_holder; the script kills
# only the pids it started (read by their markers in container VMID's cgroup) and removes the container at the end
# (real_lxc_gpu.py down: lxc-stop, never lxc-destroy). Exit status: 0 when every expectation held, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
OUT=${OUT:-$PWD/.cache/stopsets}
mkdir -p "$OUT"
VMID=129
SITE=$PWD/.cache/ss-site
TREE=$PWD/.cache/ss-tree
# shellcheck source=tests/bench/device/real_lxc_site.sh
source tests/bench/device/real_lxc_site.sh
CONF=$PWD/.cache/ss-supervisord.conf
CTL=/usr/local/bin/supervisorctl
made_ctl=
EXPECT=$OUT/expectations.txt
: > "$EXPECT"

# node pids of container VMID whose argv has the word $1 (the markers below), one a line
own_pids() {
    python3 - "$1" "$VMID" <<'PY'
import os, sys
word, vmid = sys.argv[1].encode(), sys.argv[2]
for n in sorted((n for n in os.listdir("/proc") if n.isdigit()), key=int):
    try:
        argv = open("/proc/%s/cmdline" % n, "rb").read().split(b"\0")
        cgroup = open("/proc/%s/cgroup" % n).read()
    except OSError:
        continue
    if word in argv and "/lxc/%s/" % vmid in cgroup:
        print(n)
PY
}

# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() {
    local pid
    for pid in $(own_pids gpuops_ss_holder) $(own_pids gpuops_ss_idle); do kill -9 "$pid" 2>/dev/null; done
    "${LXC[@]}" attach "$VMID" -- cat /run/ss-supervisord.log > "$OUT/supervisord.log" 2>/dev/null
    "${LXC[@]}" down "$VMID" > /dev/null 2>&1
    if [ -n "$made_ctl" ]; then rm -f "$CTL"; fi
    rm -rf "$TREE"-*
}
trap cleanup EXIT

expect() {   # expect NAME CONDITION-STATUS (0 held)
    if [ "$2" = 0 ]; then echo "HELD   $1"; else echo "FAILED $1"; fi | tee -a "$EXPECT"
}

sv_status() { "${LXC[@]}" attach "$VMID" -- supervisorctl -c "$CONF" status 2>&1 | tr -s ' '; }
sv_pid() { sv_status | awk -v p="$1" '$1 == p && $2 == "RUNNING" {sub(",", "", $4); print $4}'; }
sv_state() { sv_status | awk -v p="$1" '$1 == p {print $2}'; }
apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ';'; }
gpu0_used() { nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits; }

exec > >(tee "$OUT/stop-sets.log") 2>&1
{
    # the tree copied to the device may be ahead of the .git there: name the engine by its files' hash
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ) | plugins/ sha256 $(find plugins -name '*.py' -print0 | sort -z \
        | xargs -0 sha256sum | sha256sum | cut -c1-12)"
    echo "GPU 0 used before anything: $(gpu0_used) MiB; compute apps: $(apps)"
    "${LXC[@]}" up .cache/real-lxc/debs "$VMID" 2>&1 | tail -2 || exit 3
    # the container's supervisorctl (its root is the host's; lxc-attach --clear-env gives it a plain PATH)
    if [ ! -e "$CTL" ]; then
        printf '#!/bin/sh\nPYTHONPATH=%s exec /usr/bin/python3 %s/bin/supervisorctl "$@"\n' "$SITE" "$SITE" > "$CTL"
        chmod 755 "$CTL"
        made_ctl=1
    fi
    cat > "$CONF" <<EOF
[unix_http_server]
file=/run/ss-supervisor.sock
[supervisord]
pidfile=/run/ss-supervisord.pid
logfile=/run/ss-supervisord.log
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix:///run/ss-supervisor.sock
[program:gpuops_ss_holder]
command=/usr/bin/python3 -c "import time, torch; x = torch.empty(8 << 30, dtype=torch.uint8, device='cuda:0'); print('ready', flush=True); time.sleep(900)" gpuops_ss_holder
autostart=true
autorestart=true
startsecs=1
stopwaitsecs=10
stdout_logfile=/run/ss-holder.log
redirect_stderr=true
[program:gpuops_ss_idle]
command=/usr/bin/python3 -c "import time; print('ready', flush=True); time.sleep(900)" gpuops_ss_idle
autostart=true
autorestart=true
startsecs=1
stopwaitsecs=10
stdout_logfile=/run/ss-idle.log
redirect_stderr=true
EOF
    "${LXC[@]}" attach "$VMID" -- /bin/sh -c "PYTHONPATH=$SITE:\$PYTHONPATH $SITE/bin/supervisord -c $CONF"
    for _ in $(seq 120); do
        "${LXC[@]}" attach "$VMID" -- cat /run/ss-holder.log 2>/dev/null | grep -q ready \
            && [ "$(sv_state gpuops_ss_idle)" = RUNNING ] && [ "$(sv_state gpuops_ss_holder)" = RUNNING ] && break
        sleep 1
    done
    holder=$(own_pids gpuops_ss_holder | head -1)
    idle=$(own_pids gpuops_ss_idle | head -1)
    idle_ct=$(sv_pid gpuops_ss_idle)
    holder_ct=$(sv_pid gpuops_ss_holder)
    echo "supervisorctl before: $(sv_status | tr '\n' ';')"
    echo "node pids: holder $holder (container pid $holder_ct), idle $idle (container pid $idle_ct)"
    echo "container $VMID's processes (node pid, ppid, comm, argv):"
    python3 - "$VMID" <<'PY'
import os, sys
for n in sorted((n for n in os.listdir("/proc") if n.isdigit()), key=int):
    try:
        if "/lxc/%s/" % sys.argv[1] not in open("/proc/%s/cgroup" % n).read():
            continue
        stat = open("/proc/%s/stat" % n).read()
        argv = open("/proc/%s/cmdline" % n, "rb").read().split(b"\0")
    except OSError:
        continue
    comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    print("   %s %s %s %s" % (n, rest[1], comm, b" ".join(argv).decode("utf-8", "replace")[:110]))
PY
    mib_before=$(gpu0_used)
    echo "GPU 0 used with the holder: $mib_before MiB; compute apps: $(apps)"
    [ -n "$holder" ] && [ -n "$idle" ]; expect "setup: holder and idle programs RUNNING (node pids $holder, $idle)" $?

    args='{"gpus": ["0"], "containers": [129], "match": "gpuops_ss_holder", "shared_gpu": "own",
           "term_timeout": 5, "kill_timeout": 5, "advanced": {"stop_found_units": true, "verify_timeout": 20}}'
    echo "gpu_release args: $(echo "$args" | tr -s ' ')"
    for step in check release again; do
        extra=(); [ $step = check ] && extra=(--check)
        SECONDS=0
        run -m gpuops.fleet.gpu_release -a "$args" "${extra[@]}" -t "$TREE-$step" > /dev/null
        rc=$?
        echo "== $step ($SECONDS s, ansible rc $rc)"
        cp "$TREE-$step/localhost" "$OUT/$step.json" 2>/dev/null
        python3 - "$OUT/$step.json" "$step" "$holder" "$idle" "$EXPECT" <<'PY'
import json, sys
path, step, holder, idle, expect_file = sys.argv[1], sys.argv[2], int(sys.argv[3] or 0), int(sys.argv[4] or 0), sys.argv[5]
try:
    r = json.load(open(path))
except (OSError, ValueError) as exc:
    r = {"msg": "no result: %s" % exc}
print("   msg:", r.get("msg"), "| failed", r.get("failed"), "| changed", r.get("changed"), "| view", r.get("view"),
      "| scope", r.get("scope"))
print("   plan", [(p.get("pid"), p.get("name"), p.get("gpus"), p.get("why"), p.get("signals"), p.get("stop_set"))
                  for p in r.get("plan") or []])
print("   stop_sets:")
for s in r.get("stop_sets") or []:
    print("     " + json.dumps(s, sort_keys=True))
print("   found_units", [(u["vmid"], u["kind"], u["name"], u["pids"], u.get("outcome")) for u in r.get("found_units") or []])
print("   actions", [(a["signal"], a["pid"], a["name"], a["outcome"][:70]) for a in r.get("actions") or []])
print("   per_container", [(c["vmid"], c["changed"], c["verdict"], [(g["index"], g["before_mib"], g["after_mib"], g["free"])
                                                                  for g in c.get("gpus") or []])
                         for c in r.get("per_container") or []])
print("   not_signalled", [(s["pid"], s["name"], s["reason"][:70]) for s in r.get("not_signalled") or []])
print("   after", [(g["index"], g["used_mib"], g.get("by_container"), g.get("free_for_scope")) for g in r.get("after") or []])
print("   diagnosis", r.get("diagnosis"))
sets = r.get("stop_sets") or []
checks = []
if step in ("check", "release"):
    one = sets[0] if len(sets) == 1 else {}
    members = [m["pid"] for m in one.get("members") or []]
    checks += [
        ("%s: one stop set" % step, len(sets) == 1),
        ("%s: the set is supervisord program gpuops_ss_holder:gpuops_ss_holder in 129" % step,
         (one.get("vmid"), one.get("kind"), one.get("name")) == (129, "supervisord", "gpuops_ss_holder:gpuops_ss_holder")),
        ("%s: verdict stop" % step, one.get("verdict") == "stop"),
        ("%s: members hold the holder's node pid %d" % (step, holder), holder in members),
        ("%s: members leave out the idle program's pid %d" % (step, idle), idle not in members),
        ("%s: the set's main is the holder" % step, (one.get("main") or {}).get("pid") == holder),
        ("%s: not failed" % step, not r.get("failed")),
        ("%s: changed" % step, r.get("changed") is True),
    ]
if step == "check":
    checks += [("check: outcome not run (None)", (sets[0] if sets else {}).get("outcome") is None),
               ("check: no action", not r.get("actions"))]
if step == "release":
    outcome = (sets[0] if sets else {}).get("outcome") or ""
    pc = dict((c["vmid"], c) for c in r.get("per_container") or [])
    after0 = [g for g in r.get("after") or [] if g["index"] == 0]
    by = (after0[0].get("by_container") or {}) if after0 else {}
    checks += [("release: stop_sets outcome starts with 'done: '", outcome.startswith("done: ")),
               ("release: per_container 129 free", (pc.get(129) or {}).get("verdict") == "free"),
               ("release: GPU 0 after holds nothing of 129", not by.get("129") and not by.get(129))]
if step == "again":
    checks += [("again: not changed", r.get("changed") is False), ("again: no action", not r.get("actions")),
               ("again: not failed", not r.get("failed"))]
with open(expect_file, "a") as f:
    for name, ok in checks:
        line = "%s %s" % ("HELD  " if ok else "FAILED", name)
        print(line)
        f.write(line + "\n")
PY
        echo "   supervisorctl: $(sv_status | tr '\n' ';')"
        echo "   node pids now: holder [$(own_pids gpuops_ss_holder | tr '\n' ' ')] idle [$(own_pids gpuops_ss_idle | tr '\n' ' ')]"
        echo "   GPU 0 used: $(gpu0_used) MiB; compute apps: $(apps)"
        if [ $step = check ]; then
            [ "$(sv_state gpuops_ss_holder)" = RUNNING ] && [ "$(own_pids gpuops_ss_holder | head -1)" = "$holder" ]
            expect "check: the holder's program still RUNNING, same pid" $?
        elif [ $step = release ]; then
            [ "$(sv_state gpuops_ss_holder)" = STOPPED ]; expect "release: the holder's program STOPPED" $?
            [ "$(sv_state gpuops_ss_idle)" = RUNNING ] && [ "$(sv_pid gpuops_ss_idle)" = "$idle_ct" ] \
                && [ "$(own_pids gpuops_ss_idle | head -1)" = "$idle" ]
            expect "release: the idle program RUNNING, same pid ($idle_ct in 129, $idle on the node)" $?
            ! nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw "$holder"
            expect "release: nvidia-smi lists no process of the holder ($holder)" $?
        fi
    done
    sleep 5
    echo "after 5 s: supervisorctl: $(sv_status | tr '\n' ';')"
    [ "$(sv_state gpuops_ss_holder)" = STOPPED ] && [ "$(sv_pid gpuops_ss_idle)" = "$idle_ct" ]
    expect "5 s later: holder still STOPPED (no respawn), idle still RUNNING with the same pid" $?
    echo "GPU 0 used at the end: $(gpu0_used) MiB (with the holder: $mib_before MiB); compute apps: $(apps)"
    echo "expectations: $(grep -c '^HELD' "$EXPECT") held, $(grep -c '^FAILED' "$EXPECT") failed"
}
! grep -q '^FAILED' "$EXPECT"
