"""The role's node_view.yml, read from the role and evaluated in this process by ansible-core's templating (issue 40,
P2): a container whose config passes a GPU in that it cannot open gets that GPU with its own not_ready entry, and a
container with no GPU in its node's read is a message (predeploy_check.yml's "cannot read GPUs"), never an empty
list that passes. tests/integration/test_node_side.py runs the same through predeploy_check.yml on a lab node."""
import json
import os

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

from _templating import REPO, trust_as_template


TASKS = os.path.join(REPO, "roles", "release_gpus", "tasks", "node_view.yml")
BLOCKED = {"check": "device_access", "vmid": 101, "reason": "container 101: GPU 1 (/dev/nvidia1, passed in by dev1) "
           "cannot be opened read-write, blocked by deny-write", "remedy": "pass it in read-write"}


def gpu(index, passed_into, passed_unusable=(), not_ready=()):
    return {"index": index, "uuid": "GPU-%d" % index, "free": True, "memory": {"used_mib": 0}, "by_container": {},
            "holders": [], "clients": [], "passed_into": passed_into, "passed_unusable": list(passed_unusable),
            "ready": not not_ready, "not_ready": list(not_ready)}


def node_view(vmid, read):
    """The container's release_gpus_node_view, as the task "Take this container's GPUs from its node's read" sets it."""
    with open(TASKS) as handle:
        task = next(t for t in yaml.safe_load(handle) if t["name"] == "Node view | Take this container's GPUs from its node's read")
    variables = {"_route": {"node_path": True, "node": "pve1", "vmid": vmid, "first": False}, "_read": read}
    mine = Templar(loader=DataLoader(), variables=variables).template(trust_as_template(task["vars"]["_mine"]))
    return json.loads(mine) if isinstance(mine, str) else mine


def test_a_gpu_passed_in_unusable_is_the_containers_with_its_own_not_ready_entry():
    read = {"gpus": [gpu(0, [101, 102]), gpu(1, [], [{"vmid": 101, "source": "dev1", "rule": "deny-write"}], [BLOCKED])]}
    view = node_view(101, read)
    assert [(g["index"], g["ready"], g["not_ready"]) for g in view["gpus"]] == [(0, True, []), (1, False, [BLOCKED])]
    assert [(g["index"], g["ready"]) for g in node_view(102, read)["gpus"]] == [(0, True)]


def test_a_container_with_no_gpu_in_its_nodes_read_is_a_message_not_an_empty_list():
    read = {"gpus": [gpu(0, [101]), gpu(1, [101])]}
    assert node_view(103, read) == {"msg": "from node pve1: no GPU of container 103 in its node's read: its config "
                                           "passes none of the 2 GPUs in, and it holds no memory on any"}
    unread = {"gpus": [gpu(0, None), gpu(1, None)]}
    assert node_view(101, unread) == {"msg": "from node pve1: no GPU of container 101 in its node's read: the node's "
                                             "container configs could not be read, and it holds no memory on any"}
    assert node_view(101, {"msg": "NVML failed"}) == {"msg": "from node pve1: NVML failed"}
