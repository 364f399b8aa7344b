"""Jobs from real sockets: processes linked by loopback TCP, read from the real /proc."""
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


def start(procs, code, *args):
    proc = subprocess.Popen([sys.executable, "-c", code] + list(args), stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def test_connected_processes_form_one_job_and_a_bystander_none(procs):
    listener = start(procs, LISTENER)
    port = listener.stdout.readline().strip()
    peer = start(procs, PEER, port)
    assert peer.stdout.readline().strip() == "ready"
    assert listener.stdout.readline().strip() == "accepted"    # its end of the link is an fd only from now on
    bystander = start(procs, "import time; time.sleep(60)")
    records = [record(p.pid) for p in (listener, peer, bystander)]
    assert records[0]["_sockets"] and records[1]["_sockets"]
    assert links(records) == set([(min(listener.pid, peer.pid), max(listener.pid, peer.pid))])
    jobs = find_jobs(records)
    assert list(jobs.values())[0]["pids"] == sorted([listener.pid, peer.pid])
    assert records[2]["job"] is None and records[0]["job"] == records[1]["job"]


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
        assert links(records) == set() and find_jobs(records) == {}
    finally:
        for sock in (a, b, srv):
            sock.close()
