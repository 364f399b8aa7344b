"""Run id, loopback addresses and names of the lab (tests/lab/README.md, "What a lab is")."""

import hashlib
import os

import pytest

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib import common


def test_run_id_from_lab_id():
    assert common.run_id({"LAB_ID": "conn01"}) == "conn01"


def test_run_id_defaults_to_hash_of_clone(tmp_path):
    expected = hashlib.sha1(os.path.realpath(str(tmp_path)).encode()).hexdigest()[:8]
    assert common.run_id({}, repo=str(tmp_path)) == expected


@pytest.mark.parametrize("bad", ["a/b", "x" * 33, "a b", "../x"])
def test_run_id_rejects_unsafe_lab_id(bad):
    with pytest.raises(common.LabError, match="LAB_ID"):
        common.run_id({"LAB_ID": bad})


def test_hex_run_id_gives_design_address():
    # A = 1 + (0x3f % 254) = 64, B = 0xa2 = 162
    assert common.node_address("3fa2c0de", 2) == "127.64.162.2"


def test_hex_run_id_first_byte_ff_stays_in_range():
    assert common.node_address("fe00aaaa", 1) == "127.1.0.1"  # 1 + 254 % 254


def test_non_hex_lab_ids_sharing_a_prefix_get_different_addresses():
    ids = ["lab01", "lab02", "labit0fff", "labit0fffb", "conn01", "conn02"]
    addresses = {common.node_address(i, 1) for i in ids}
    assert len(addresses) == len(ids)
    for address in addresses:
        parts = [int(p) for p in address.split(".")]
        assert parts[0] == 127 and 1 <= parts[1] <= 254 and 0 <= parts[2] <= 255 and parts[3] == 1


def test_names():
    assert common.node_name(2) == "pve2"
    assert common.vmid_for(2, 3) == 203
    assert common.state_dir("abc") == "/run/gpuops-lab/abc"
