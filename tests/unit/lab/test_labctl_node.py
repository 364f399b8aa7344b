"""Pure parts of the lab's Proxmox node view: lock lines in a conf, HA resources.cfg, the API's stop timeout."""

import pytest

import _labpath  # noqa: F401  pylint: disable=unused-import
from lablib import lab as lablab
from lablib import pveapi

CONF = ("arch: amd64\nhostname: ct101\nmemory: 65536\nswap: 0\n"
        "lxc.cgroup2.devices.allow: c 195:* rwm\n\n[snap1]\nhostname: old\n")


def test_lock_goes_into_the_main_section_sorted_and_comes_out_again():
    locked = lablab.set_conf_key(CONF, "lock", "backup")
    assert locked.splitlines()[:4] == ["arch: amd64", "hostname: ct101", "lock: backup", "memory: 65536"]
    assert pveapi.parse_conf(locked)[0]["lock"] == "backup"
    assert "[snap1]\nhostname: old" in locked
    relocked = lablab.set_conf_key(locked, "lock", "migrate")
    assert relocked.count("lock:") == 1 and "lock: migrate" in relocked
    assert lablab.set_conf_key(relocked, "lock", None) == CONF


def test_ha_resources_round_trip_in_section_format():
    text = pveapi.format_ha([{"sid": "ct:101", "type": "ct", "state": "started"},
                             {"sid": "ct:202", "type": "ct", "state": "stopped", "group": "gpu"}])
    assert text.startswith("ct: 101\n\tstate started\n")
    assert pveapi.parse_ha(text) == [{"sid": "ct:101", "type": "ct", "state": "started"},
                                     {"sid": "ct:202", "type": "ct", "state": "stopped", "group": "gpu"}]
    assert pveapi.parse_ha("") == []
    assert pveapi.parse_ha("ct: 101\n") == [{"sid": "ct:101", "type": "ct"}]


def test_stop_timeout(monkeypatch):
    monkeypatch.delenv("LAB_PCT_STOP_TIMEOUT", raising=False)
    assert pveapi.stop_timeout({}) == 10.0
    monkeypatch.setenv("LAB_PCT_STOP_TIMEOUT", "3")
    assert pveapi.stop_timeout({}) == 3.0
    assert pveapi.stop_timeout({"timeout": "1.5"}) == 1.5
    with pytest.raises(pveapi.PveError):
        pveapi.stop_timeout({"timeout": "soon"})
