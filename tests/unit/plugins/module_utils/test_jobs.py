"""Jobs from real sockets: processes linked by loopback TCP, read from the real /proc."""
import os
import socket
import subprocess
import sys

import pytest

from ansible_collections.gpuops.fleet.plugins.module_utils import _procscan as procscan
from ansible_collections.gpuops.fleet.plugins.module_utils._jobs import find_jobs, links

PEER = r'''
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sys.stdout.write("ready\n"); sys.stdout.flush()
time.sleep(60)
'''

LISTENER = r'''
import socket, sys, time
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4)
sys.stdout.write("%d\n" % srv.getsockname()[1]); sys.stdout.flush()
conn, dummy = srv.accept()
sys.stdout.write("accepted\n"); sys.stdout.flush()
time.sleep(60)
'''


def record(pid):
    """The fields find_jobs reads, from the real /proc."""
    fds, sockets = procscan._read_fd_devices("/proc/%d/fd" % pid, procscan.DeviceNames())
    return {"pid": pid, "_sockets": [int(s[len(procscan.SOCKET_PREFIX):-1]) for s in sockets]}


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def start(procs, code, *args, **kwargs):
    proc = subprocess.Popen([sys.executable, "-c", code] + list(args), stdout=subprocess.PIPE, text=True, **kwargs)
    procs.append(proc)
    return proc


def connected_pair(procs, env=None):
    listener = start(procs, LISTENER, env=env)
    port = listener.stdout.readline().strip()
    peer = start(procs, PEER, port, env=env)
    assert peer.stdout.readline().strip() == "ready"
    assert listener.stdout.readline().strip() == "accepted"    # its end of the link is an fd only from now on
    return listener, peer


@pytest.mark.parametrize("rendezvous", [True, False], ids=["same_rendezvous", "no_signature"])
def test_connected_processes_are_one_job_only_with_a_rank_signature(procs, rendezvous):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="2") if rendezvous else None
    listener, peer = connected_pair(procs, env)
    bystander = start(procs, "import time; time.sleep(60)", env=env)
    records = [record(p.pid) for p in (listener, peer, bystander)]
    assert records[0]["_sockets"] and records[1]["_sockets"]
    pair = sorted([listener.pid, peer.pid])
    assert links(records) == set([tuple(pair)])
    jobs, linked = find_jobs(records)
    if rendezvous:
        assert linked == [] and list(jobs.values())[0]["pids"] == pair
        assert list(jobs.values())[0]["signature"] == [
            "distributed-run settings MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2"]
        assert records[2]["job"] is None and records[0]["job"] == records[1]["job"]
    else:   # two different programs (a client and its server) are linked, never a job
        assert jobs == {} and linked == [{"pids": pair, "why": "connected by TCP, not one job: no rank signature"}]
        assert [r["job"] for r in records] == [None, None, None]


def test_a_shared_inherited_socket_is_no_link(procs):
    """Two processes inherit one connected TCP socket; its peer is this (non-holder) test."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, dummy = srv.accept()
    try:
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(a.fileno(),))
                for dummy in range(2)]
        procs.extend(kids)
        records = [record(k.pid) for k in kids]
        assert records[0]["_sockets"] and records[0]["_sockets"] == records[1]["_sockets"]
        assert links(records) == set() and find_jobs(records) == ({}, [])
    finally:
        for sock in (a, b, srv):
            sock.close()
