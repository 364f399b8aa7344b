"""Issue 41: a hostile container gets nothing from its facts. Its root controls its python3, so every module that runs
in it can return ansible_facts, and facts outrank inventory variables and role defaults.

One lab (one node, three containers). ct101 and ct102 get a hostile interpreter: the lab's python3 behind a script that
adds the facts of /tmp/hostile-facts.json (in the container) to every module result. Attack 1: ct101's facts name the
pct connection's variables (ansible_pct_vmid: 102, ansible_pct_executable: a script on the node); the next task must
not reach container 102, nor run the script, and fails naming the fact; with inject_facts_as_vars off it reaches ct101
through the node's own pct. Attack 3: ct102's facts set release_gpus_from: node, container_restart and an API endpoint
of the attacker (a listener in this test), with the controller's PROXMOX_TOKEN_* set; the role fails naming the fact,
no byte reaches the listener and the holder in ct102 is not signalled."""
import json
import os
import re
import socket
import threading

import pytest
import yaml

from _enginelab import EngineLab, VENV_BIN, host_alive
from _labfixture import module_lab

pytestmark = pytest.mark.real_lxc

LAYOUT = ["--nodes", "1", "--containers", "3", "--gpus", "6", "--layout", "101=0,1", "--layout", "102=2,3",
          "--layout", "103=4,5"]
lab = module_lab(lambda: EngineLab("hostile", LAYOUT))

HOSTILE = '''#!%(python)s
# the container's "python3": the real one, plus the facts of /tmp/hostile-facts.json in every module result
import json, os, subprocess, sys
proc = subprocess.run([%(python)r] + sys.argv[1:], stdout=subprocess.PIPE, check=False)
out = proc.stdout.decode()
if sys.argv[1:2] != ["-c"] and os.path.exists("/tmp/hostile-facts.json"):
    lines = out.rstrip("\\n").split("\\n")
    for i in range(len(lines) - 1, -1, -1):
        try:
            result = json.loads(lines[i])
        except ValueError:
            continue
        if isinstance(result, dict):
            with open("/tmp/hostile-facts.json") as f:
                result.setdefault("ansible_facts", {}).update(json.load(f))
            lines[i] = json.dumps(result)
            break
    out = "\\n".join(lines) + "\\n"
sys.stdout.write(out)
sys.exit(proc.returncode)
'''


class Listener:
    """The attacker's endpoint: records every connection made to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.got = []
        self.stop = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            self.got.append((peer, data))
            conn.close()

    def close(self):
        self.stop = True
        self.thread.join(2)
        self.sock.close()


def write_in(lab, vmid, path, text, mode="644"):
    done = lab.exec(vmid, "sh", "-c", "cat > %s <<'GPUOPS_EOF'\n%sGPUOPS_EOF\nchmod %s %s" % (path, text, mode, path))
    assert done.returncode == 0, done.stdout


def hostile_inventory(lab, facts):
    """The lab inventory with ct101 and ct102 on the hostile interpreter, each returning its own facts."""
    with open(lab.inventory) as f:
        inventory = yaml.safe_load(f)
    hosts = inventory["all"]["children"]["gpu_containers"]["hosts"]
    for host, vmid in (("ct101", 101), ("ct102", 102), ("ct103", 103)):
        write_in(lab, vmid, "/tmp/whoami", host + "\n")
        if host in facts:
            write_in(lab, vmid, "/tmp/hostile-python", HOSTILE % {"python": hosts[host]["ansible_python_interpreter"]}, "755")
            write_in(lab, vmid, "/tmp/hostile-facts.json", json.dumps(facts[host]) + "\n")
            hosts[host]["ansible_python_interpreter"] = "/tmp/hostile-python"
    path = os.path.join(lab.workdir, "hostile-inventory.yml")
    with open(path, "w") as f:
        yaml.safe_dump(inventory, f)
    return path


def playbook(lab, inventory, hosts, tasks, env=None):
    import subprocess
    book = os.path.join(lab.workdir, "hostile-%s.yml" % hosts.replace(",", "-"))
    with open(book, "w") as f:
        yaml.safe_dump([{"hosts": hosts, "gather_facts": False, "tasks": tasks}], f)
    run_env = dict(lab.env, PROXMOX_USER="gpuops@pve", PROXMOX_TOKEN_ID="fleet", PROXMOX_TOKEN_SECRET="s3cret-token-41")
    run_env.update(env or {})
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", inventory, book], env=run_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=400,
                          check=False)
    return proc.stdout


def whoami_tasks(lab):
    """ping (a module: the container's python3 returns its facts), then which container a raw command reaches."""
    return [{"name": "A module runs with the container's python3", "ansible.builtin.ping": None},
            {"name": "Which container the next task reaches", "ansible.builtin.raw": "cat /tmp/whoami",
             "register": "whoami", "ignore_errors": True},
            {"name": "Keep its answer", "ansible.builtin.copy": {
                "content": "{{ whoami | to_json }}", "dest": lab.workdir + "/whoami-{{ inventory_hostname }}.json"},
             "delegate_to": "localhost", "check_mode": False}]


def evil_pct(lab):
    marker = os.path.join(lab.workdir, "evil-pct-ran")
    path = os.path.join(lab.workdir, "evil-pct")
    with open(path, "w") as f:
        f.write("#!/bin/sh\ntouch %s\nexec /usr/sbin/pct \"$@\"\n" % marker)
    os.chmod(path, 0o755)
    return path, marker


def answer(lab, host):
    with open(os.path.join(lab.workdir, "whoami-%s.json" % host)) as f:
        return json.load(f)


def test_facts_from_containers_steer_neither_the_connection_nor_the_role_nor_credentials(lab):
    """Attacks 1 and 3 in one play: ct101's facts aim its connection at container 102 and at a script on the node;
    ct102's facts turn the role to the node path with a container restart and the attacker's API endpoint."""
    listener = Listener()
    try:
        script, marker = evil_pct(lab)
        holder = lab.run("plain", 102, [0], 256)
        facts = {"ct101": {"ansible_pct_vmid": 102, "ansible_pct_executable": script},
                 "ct102": {"release_gpus_from": "node", "release_gpus_container_restart": True,
                           "release_gpus_advanced": {"proxmox_api": {"api_host": "127.0.0.1", "api_port": listener.port,
                                                                     "validate_certs": False}}}}
        inventory = hostile_inventory(lab, facts)
        tasks = whoami_tasks(lab) + [{"name": "The role, on the container whose facts set its settings",
                                      "ansible.builtin.include_role": {"name": "gpuops.fleet.release_gpus"},
                                      "vars": {"release_gpus_term_timeout": 2, "release_gpus_kill_timeout": 3},
                                      "when": "inventory_hostname == 'ct102'"}]
        out = playbook(lab, inventory, "ct101,ct102", tasks)
        # attack 3, first: no byte of the controller's credentials left, and nothing of ct102 was signalled
        assert listener.got == [], "the attacker's endpoint was reached: %r" % listener.got
        assert all(host_alive(pid) for pid in holder["holders"]), "the holder in ct102 was signalled"
        # attack 1: ct101's next task reached no other container and ran no script of its choosing: refused, named
        ct101 = answer(lab, "ct101")
        assert ct101.get("stdout", "").strip() != "ct102", out
        assert ct101.get("failed") and "refused" in ct101["msg"], ct101
        assert "pct_vmid or ansible_pct_vmid (ansible_facts.pct_vmid)" in ct101["msg"], ct101
        assert not os.path.exists(marker), "the node ran the script a fact named"
        # ct102's facts name no connection variable: its tasks still reach ct102 itself
        assert answer(lab, "ct102")["stdout"].strip() == "ct102", out
        # attack 3: the role fails naming the facts, before anything reaches the node or the attacker
        assert "release_gpus on ct102: refused: facts named like settings" in out, out
        assert "ansible_facts.release_gpus_advanced" in out and "ansible_facts.release_gpus_from" in out, out
        assert "fatal: [ct102]" in out and "TASK [gpuops.fleet.release_gpus : Node |" not in out, out
        assert lab.used(2) == 256
    finally:
        listener.close()
        lab.cleanup()


def test_with_inject_facts_as_vars_off_the_next_task_reaches_the_same_container_through_the_nodes_pct(lab):
    """The recommended setting: a fact is no variable, so the same facts only bring a warning, and the next task runs
    in ct101 through the node's /usr/sbin/pct."""
    script, marker = evil_pct(lab)
    inventory = hostile_inventory(lab, {"ct101": {"ansible_pct_vmid": 102, "ansible_pct_executable": script}})
    out = playbook(lab, inventory, "ct101", whoami_tasks(lab), env={"ANSIBLE_INJECT_FACT_VARS": "False"})
    assert answer(lab, "ct101")["stdout"].strip() == "ct101", out
    assert not os.path.exists(marker), out
    assert "ignored, since inject_facts_as_vars is off" in out.replace("\n", " "), out


BAD_PROBE = '''#!/bin/sh
# a hostile container's python3: the role's probe (python3 -c PROBE SPEC) fails; anything else runs as usual
if [ "$1" = "-c" ]; then echo hostile >&2; exit 1; fi
exec /usr/bin/python3 "$@"
'''


def test_a_container_that_fails_its_own_probe_never_stops_its_nodes_release_for_the_others(tmp_path):
    """Red team of issue 41: on the node path one gpu_release runs on the node for all of its containers, from the
    first of them. ct1's python3 fails the role's probe (a stop list is set), so ct1 leaves the play: the node task
    must still run, from ct2, whose result is its own (it said "no result" for every container of the node). No lab:
    local connections, a node that is this machine's plain python3 (its module stops at its own checks)."""
    import subprocess
    bad = tmp_path / "badpy"
    bad.write_text(BAD_PROBE)
    bad.chmod(0o755)
    inventory = tmp_path / "inv.ini"
    inventory.write_text("[gpu_containers]\nct1 pct_vmid=101 ansible_python_interpreter=%s\n"
                         "ct2 pct_vmid=102 ansible_python_interpreter=/usr/bin/python3\n[gpu_containers:vars]\n"
                         "ansible_connection=local\nproxmox_node_host=nodeA\nrelease_gpus_services=[\"no-such-unit\"]\n"
                         "[proxmox_nodes]\nnodeA ansible_connection=local ansible_python_interpreter=/usr/bin/python3\n"
                         % bad)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", str(inventory),
                           os.path.join(repo, "playbooks", "release_gpus.yml"),
                           "-e", json.dumps({"release_gpus_advanced": {"install_deps": False}})],
                          cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                          timeout=300, check=False)
    out = proc.stdout
    assert "fatal: [ct1]" in out and "ok: [ct2 -> nodeA]" in out, out[-3000:]
    said = re.search(r"no result from node nodeA for ct2 \(container 102\): its gpu_release failed.*?The node said: (.*?)\"", out)
    assert said and said.group(1).strip(), out[-3000:]     # the node's own answer, not a skipped task's silence
