"""Lab stand-in for the MPS control daemon and its client tool (nvidia-cuda-mps-control), as GPU_FACTS rows 26-28
measured them on an H200.

    nvidia-cuda-mps-control -d --server-minor M     the daemon (run by the mps workload scenario)
    echo COMMAND | nvidia-cuda-mps-control           the client tool: one command per line, each answer printed

The daemon listens on $CUDA_MPS_PIPE_DIRECTORY/control (a unix socket), starts one server (a process named
nvidia-cuda-mps-server holding a 66 MiB context on minor M) and answers get_server_list, get_client_list SERVER,
terminate_client SERVER CLIENT (answers 0; the client process lives on and keeps its memory, row 28) and quit
(blocks while a client remains, row 28). Clients say `register PID` (lab only). Every command goes to
$CUDA_MPS_LOG_DIRECTORY/control.log, or the pipe directory's, as the real daemon logs them.
"""
import ctypes
import os
import signal
import socket
import sys
import time

PR_SET_NAME = 15
SERVER_MIB = 66   # the server's own share on an H200 (row 26)
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(os.path.dirname(HERE), "workloads", "workload.py")


def pipe_dir():
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def alive(pid):
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def start_server(minor, python):
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        os.execv(python, ["nvidia-cuda-mps-server", WORKLOAD, "plain", "--minors", str(minor), "--mib", str(SERVER_MIB),
                          "--foreground"])
    return pid


def daemon(minor, python):
    ctypes.CDLL(None).prctl(PR_SET_NAME, b"nvidia-cuda-mps", 0, 0, 0)
    signal.signal(signal.SIGCHLD, lambda *a: reap())
    path = os.path.join(pipe_dir(), "control")
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    server = start_server(minor, python)
    clients, terminated = [], []
    log = open(os.path.join(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or pipe_dir(), "control.log"), "a")
    sys.stdout.write("ready %d\n" % server)
    sys.stdout.flush()
    while True:
        conn = listener.accept()[0]
        with conn:
            command = conn.makefile().readline().strip()
            words = command.split()
            log.write("Cmd:%s\n" % command)
            log.flush()
            answer = "unknown command"
            if words[:1] == ["register"] and len(words) == 2:
                clients.append(int(words[1]))
                answer = "0"
            elif words == ["get_server_list"]:
                answer = str(server) if alive(server) else ""
            elif words[:1] == ["get_client_list"] and len(words) == 2:
                answer = "\n".join(str(c) for c in clients if alive(c)) if words[1] == str(server) else ""
            elif words[:1] == ["terminate_client"] and len(words) == 3:
                client = int(words[2])
                answer = "0" if words[1] == str(server) and client in clients else "1"
                terminated.append(client)
            elif words == ["quit"]:
                while [c for c in clients if alive(c)]:
                    time.sleep(0.1)
                os.kill(server, signal.SIGTERM)
                conn.sendall(b"")
                return 0
            conn.sendall((answer + "\n").encode())


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def tool():
    for line in sys.stdin:
        if not line.strip():
            continue
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(os.path.join(pipe_dir(), "control"))
        except OSError as exc:
            sys.stderr.write("Cannot find MPS control daemon process (%s)\n" % exc)
            return 1
        with conn:
            conn.sendall(line.encode())
            sys.stdout.write(conn.makefile().read())
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["-d"]:
        sys.exit(daemon(int(sys.argv[sys.argv.index("--server-minor") + 1]), sys.argv[sys.argv.index("--python") + 1]))
    sys.exit(tool())
