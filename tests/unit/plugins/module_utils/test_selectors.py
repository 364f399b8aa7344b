import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.gpuops.fleet.plugins.module_utils._selectors import (
    Protect, SelectorError, compile_regex, matches, normalize_pci_bus_id, resolve_gpus,
)

GPUS = [
    {"index": 0, "minor": 4, "uuid": "GPU-aaaa", "pci_bus_id": "00000000:18:00.0"},
    {"index": 1, "minor": 5, "uuid": "GPU-bbbb", "pci_bus_id": "00000000:2A:00.0"},
    {"index": 2, "minor": 6, "uuid": "GPU-cccc", "pci_bus_id": "00000000:3A:00.0"},
]


def test_empty_selects_all():
    assert resolve_gpus([], GPUS) == [0, 1, 2]
    assert resolve_gpus(None, GPUS) == [0, 1, 2]


def test_index_uuid_and_bus_ids_in_nvml_order():
    assert resolve_gpus(["2", "gpu-AAAA", "0000:2a:00.0"], GPUS) == [0, 1, 2]
    assert resolve_gpus([1, "2A:00.0"], GPUS) == [1]


@pytest.mark.parametrize("bad", ["3", "GPU-dddd", "00000000:99:00.0", "nvidia0"])
def test_unknown_selector_names_value_and_lists_gpus(bad):
    with pytest.raises(SelectorError) as err:
        resolve_gpus([bad], GPUS)
    text = str(err.value)
    assert repr(bad) in text
    for gpu in GPUS:
        assert gpu["uuid"] in text and "minor %d" % gpu["minor"] in text


def test_minor_is_not_an_index():
    # a container that sees minors 4-7 as indexes 0-3: "4" is not a valid index here
    with pytest.raises(SelectorError):
        resolve_gpus(["4"], GPUS)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_pci_bus_id_normalizes_every_spelling(domain, bus, dev, func):
    canonical = "%08X:%02X:%02X.%d" % (domain, bus, dev, func)
    assert normalize_pci_bus_id(canonical) == canonical
    assert normalize_pci_bus_id(("%04x:%02x:%02x.%d" % (domain, bus, dev, func)).lower()) == canonical
    if domain == 0:
        assert normalize_pci_bus_id("%02x:%02x.%d" % (bus, dev, func)) == canonical


def test_compile_regex_names_option_and_value():
    with pytest.raises(SelectorError, match=r"match: regular expression '\[oops' does not compile"):
        compile_regex("[oops", "match")


def test_protect_pid_and_whole_name_or_cmdline():
    protect = Protect(["42", "my-exporter", ".*--metrics-port.*"])
    assert protect.reason(42, ["python3"], "python3 x.py")
    assert protect.reason(7, ["my-exporter"], "/opt/my-exporter")
    assert protect.reason(8, ["python3"], "python3 exp.py --metrics-port 9400")
    assert protect.reason(9, ["my-exporter-2"], "my-exporter-2") is None  # whole name only
    assert protect.reason(10, ["python3"], "python3 train.py") is None


def test_match_searches_name_and_cmdline():
    pattern = compile_regex(r"train\.py", "match")
    assert matches(pattern, ["python3"], "python3 /srv/train.py --lr 1")
    assert not matches(pattern, ["python3"], "python3 serve.py")
    assert matches(None, ["anything"], "")
