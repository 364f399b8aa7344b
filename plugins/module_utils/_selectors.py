# Copyright (c) 2026 gpuops
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""GPU selectors, protect entries and `match` (private helper, may change any time)."""

from __future__ import annotations

import re


class SelectorError(ValueError):
    """A selector, regex or protect entry that cannot be used."""


def normalize_pci_bus_id(value):
    """Return `DDDDDDDD:BB:DD.F` (NVML's form, upper case) or None if not a PCI bus id."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", value.strip())
    if not m:
        return None
    domain, bus, dev, func = m.groups()
    return "%08X:%02X:%02X.%s" % (int(domain or "0", 16), int(bus, 16), int(dev, 16), func)


def describe_gpus(gpus):
    """One-line list of the GPUs that exist, for error messages."""
    if not gpus:
        return "no GPU is visible here"
    return "; ".join("%s (minor %s, %s, %s)" % (g["index"], g.get("minor"), g.get("uuid"), g.get("pci_bus_id")) for g in gpus)


def resolve_gpus(selectors, gpus):
    """Map selectors (NVML index, UUID or PCI bus id) to GPU indexes, in NVML order.

    `gpus` is a list of dicts with index, uuid, pci_bus_id. An empty or missing
    selector list means all GPUs. Raise SelectorError naming the value and the GPUs that exist.
    """
    if not selectors:
        return [g["index"] for g in gpus]
    wanted = set()
    for raw in selectors:
        value = str(raw).strip()
        found = None
        if re.fullmatch(r"\d+", value):
            found = [g for g in gpus if g["index"] == int(value)]
        elif value.upper().startswith("GPU-"):
            found = [g for g in gpus if str(g.get("uuid", "")).upper() == value.upper()]
        else:
            bus = normalize_pci_bus_id(value)
            if bus is not None:
                found = [g for g in gpus if normalize_pci_bus_id(str(g.get("pci_bus_id", ""))) == bus]
        if not found:
            raise SelectorError("GPU %r not found; GPUs here: %s" % (raw, describe_gpus(gpus)))
        wanted.add(found[0]["index"])
    return [g["index"] for g in gpus if g["index"] in wanted]


def compile_regex(value, option):
    """Compile a user regex, raising SelectorError that names the option and the value."""
    try:
        return re.compile(value)
    except (re.error, TypeError) as exc:
        raise SelectorError("%s: regular expression %r does not compile: %s" % (option, value, exc))


class Protect(object):
    """User protect entries: a pid, or a regex matching the whole name or the whole command line."""

    def __init__(self, entries):
        self.pids = set()
        self.patterns = []
        for entry in entries or ():
            text = str(entry).strip()
            if re.fullmatch(r"\d+", text):
                self.pids.add(int(text))
            else:
                self.patterns.append((text, compile_regex(text, "protect")))

    def reason(self, pid, names, cmdline):
        """Why this process is protected by the user, or None."""
        if pid in self.pids:
            return "pid %d is in protect" % pid
        for text, pattern in self.patterns:
            if any(pattern.fullmatch(n) for n in names if n) or (cmdline and pattern.fullmatch(cmdline)):
                return "protect entry %r matches" % text
        return None


def matches(pattern, names, cmdline):
    """`match`: a regex searched in the name or the command line."""
    if pattern is None:
        return True
    return any(pattern.search(n) for n in names if n) or bool(cmdline and pattern.search(cmdline))
