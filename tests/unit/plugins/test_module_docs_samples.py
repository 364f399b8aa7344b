"""Every module's documented samples render as written (issue 45): a sample is of its field's documented type.

YAML turns some unquoted text into another type: `00000000:18:00.0` is the sexagesimal float 1080.0, `1e3` may be a
float, `yes` a bool. ansible-doc and the docsite then show the converted value. This reads DOCUMENTATION and RETURN of
each module as ansible-doc does (yaml.safe_load) and checks each sample, nested ones too, against its field's type.
"""
import ast
import glob
import os

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODULES = sorted(glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py")))
TYPES = {"str": (str,), "string": (str,), "path": (str,), "int": (int,), "integer": (int,), "float": (int, float),
         "bool": (bool,), "boolean": (bool,), "list": (list,), "dict": (dict,)}


def module_docs(path):
    """{name: parsed YAML} of the module's DOCUMENTATION, EXAMPLES and RETURN."""
    docs = {}
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", "") in (
                "DOCUMENTATION", "RETURN"):
            docs[node.targets[0].id] = yaml.safe_load(node.value.value)
    return docs


def mismatches(fields, where):
    """(where, type, sample) for each sample, at any depth, that is not of its field's type (null is always allowed)."""
    found = []
    for name, field in (fields or {}).items():
        if not isinstance(field, dict):
            continue
        here = "%s.%s" % (where, name)
        if "sample" in field:
            found += wrong(field, field["sample"], here)
        for sub in ("contains", "suboptions"):
            found += mismatches(field.get(sub), here)
    return found


def wrong(field, value, where):
    """What in value, a sample of field, is not of the documented type (the elements of a list, the keys of a dict)."""
    kind = field.get("type")
    if value is None or kind not in TYPES:
        return []
    if not isinstance(value, TYPES[kind]) or (kind in ("int", "integer", "float") and isinstance(value, bool)):
        return [(where, kind, value)]
    found = []
    if kind == "list" and field.get("elements"):
        element = dict(field, type=field["elements"])
        element.pop("elements")
        for index, item in enumerate(value):
            found += wrong(element, item, "%s[%d]" % (where, index))
    elif kind == "dict" and isinstance(field.get("contains"), dict):
        for key, item in value.items():
            if isinstance(field["contains"].get(key), dict):
                found += wrong(field["contains"][key], item, "%s.%s" % (where, key))
    return found


@pytest.mark.parametrize("path", MODULES, ids=[os.path.basename(p) for p in MODULES])
def test_every_sample_is_of_its_documented_type(path):
    docs = module_docs(path)
    assert set(docs) == {"DOCUMENTATION", "RETURN"}, sorted(docs)
    found = mismatches(docs["DOCUMENTATION"].get("options"), "options") + mismatches(docs["RETURN"], "RETURN")
    assert found == [], found


def test_the_checker_catches_an_unquoted_bus_id_and_a_bool_for_an_int():
    doc = yaml.safe_load("gpus:\n  type: list\n  elements: dict\n  contains:\n    pci_bus_id: {type: str, sample: 00000000:18:00.0}\n"
                         "    minor: {type: int}\n  sample: [{pci_bus_id: '0:1', minor: yes}]\n")
    assert mismatches(doc, "RETURN") == [("RETURN.gpus[0].minor", "int", True), ("RETURN.gpus.pci_bus_id", "str", 1080.0)]


def test_gpu_info_is_not_applicable_to_diff_mode_as_read_only_modules_say():
    docs = module_docs(os.path.join(ROOT, "plugins", "modules", "gpu_info.py"))
    assert docs["DOCUMENTATION"]["attributes"]["diff_mode"]["support"] == "N/A"
    assert docs["RETURN"]["gpus"]["contains"]["pci_bus_id"]["sample"] == "00000000:18:00.0"
