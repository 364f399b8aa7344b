"""Every module, plugin, playbook and module_utils file that docs/ and README.md name exists (issue 46).

The names are read as the docs write them: paths (`plugins/modules/x.py`, `modules/x.py`, `playbooks/x.yml`),
FQCNs (`gpuops.fleet.x`), private helpers (`_x.py`, and code spans that start with `_x`, such as `_x` or
`_x.function`). docs/design.md's layer diagram must also list the same files in the same layers as
tests/unit/plugins/module_utils/test_layering.py's LAYERS (issue 46's contradiction 13).
"""
import ast
import glob
import os
import re

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PLUGINS = os.path.join(REPO, "plugins")
DESIGN = os.path.join(REPO, "docs", "design.md")

# Files the docs may name before they exist (a change that lands in slices); empty: every name is a file today.
PENDING_MERGE = set()

# Names in the docs that are not this collection's: community.proxmox's connection plugin (docs/PVE_FACTS.md),
# and the user's own AWX project playbook in guide_predeploy.rst's example.
FOREIGN = {"plugins/connection/proxmox_pct_remote.py", "playbooks/predeploy.yml"}

# Code spans that start with an underscore but name no file: methods, variables, a role variable.
NOT_FILES = {"_release_gpus", "_kill_timeout", "_after_stops", "_leave_out_refused", "_ident"}

PLUGIN_DIRS = ("modules", "module_utils", "connection", "inventory", "callback", "action", "doc_fragments",
               "plugin_utils", "filter", "lookup", "test")
PATH = re.compile(r"(?<![\w/.-])(?:plugins/)?(%s)/([A-Za-z_]\w*)\.py\b" % "|".join(PLUGIN_DIRS))
PLAYBOOK = re.compile(r"(?<![\w/.-])playbooks/(\w+)\.yml\b")
FQCN = re.compile(r"\bgpuops\.fleet\.([a-z_][a-z0-9_]*)")
PRIVATE_FILE = re.compile(r"(?<=[` (,])(_[a-z][a-z0-9_]*)\.py\b")   # not at a line's start: markdown's _italics_
CODE_SPAN = re.compile(r"``([^`\n]+)``|`([^`\n]+)`")
PRIVATE_SPAN = re.compile(r"^(_[a-z][a-z0-9_]*)(?=$|[.(\s,:])")
LAYER_NAME = re.compile(r"(?<![\w.])_[a-z][a-z0-9_]*")


def doc_files():
    names = glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    names += glob.glob(os.path.join(REPO, "docs", "**", "*.rst"), recursive=True)
    return sorted(names) + [os.path.join(REPO, "README.md")]


def texts():
    for path in doc_files():
        with open(path) as handle:
            yield os.path.relpath(path, REPO), handle.read()


def private_files():
    """module_utils, plugin_utils and doc_fragments names, without .py."""
    found = set()
    for folder in ("module_utils", "plugin_utils", "doc_fragments"):
        found.update(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(PLUGINS, folder, "_*.py")))
    return found


def collection_names():
    """What gpuops.fleet.X may name: plugins, roles, playbooks, redirects, action groups, the docsite's labels."""
    names = {"docsite"}
    for folder in PLUGIN_DIRS:
        names.update(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(PLUGINS, folder, "*.py")))
    names.update(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "roles", "*")))
    names.update(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(REPO, "playbooks", "*.yml")))
    with open(os.path.join(REPO, "meta", "runtime.yml")) as handle:
        runtime = yaml.safe_load(handle)
    for routes in (runtime.get("plugin_routing") or {}).values():
        names.update(routes)
    names.update(runtime.get("action_groups") or {})
    return names


def test_every_plugin_path_the_docs_name_exists():
    missing = []
    for doc, text in texts():
        for folder, name in PATH.findall(text):
            path = "plugins/%s/%s.py" % (folder, name)
            if path in FOREIGN or (folder in ("module_utils", "plugin_utils") and name in PENDING_MERGE):
                continue
            if not os.path.exists(os.path.join(REPO, path)):
                missing.append((doc, path))
    assert missing == []


def test_every_playbook_the_docs_name_exists():
    missing = []
    for doc, text in texts():
        for name in PLAYBOOK.findall(text):
            path = "playbooks/%s.yml" % name
            if path not in FOREIGN and not os.path.exists(os.path.join(REPO, path)):
                missing.append((doc, path))
    assert missing == []


def test_every_fqcn_the_docs_name_is_a_plugin_role_playbook_or_redirect():
    known = collection_names()
    assert {"gpu_info", "gpu_release", "pct", "proxmox_gpu", "gpu_report", "release_gpus", "gpu_status"} <= known
    unknown = sorted(set((doc, name) for doc, text in texts() for name in FQCN.findall(text) if name not in known))
    assert unknown == []


def test_every_private_helper_the_docs_name_exists():
    files = private_files()
    missing = set()
    for doc, text in texts():
        named = set(PRIVATE_FILE.findall(text))
        for double, single in CODE_SPAN.findall(text):
            match = PRIVATE_SPAN.match((double or single).strip())
            if match and match.group(1) not in NOT_FILES:
                named.add(match.group(1))
        missing.update((doc, name) for name in named if name not in files and name not in PENDING_MERGE)
    assert sorted(missing) == []


def test_the_pending_names_are_not_files_yet_and_the_exceptions_are_no_files():
    """Once a slice's file exists, its name leaves PENDING_MERGE; a NOT_FILES name that became a file is checked."""
    files = private_files()
    assert sorted(PENDING_MERGE & files) == [], "issue 46: empty these from PENDING_MERGE"
    assert sorted(NOT_FILES & files) == []


def design_layers():
    """{layer: set of _names} from docs/design.md's diagram (the fenced block under "Layers and files")."""
    with open(DESIGN) as handle:
        text = handle.read()
    section = text[text.index("### Layers and files"):]
    block = section[section.index("```") + 3:]
    block = block[:block.index("```")]
    layers, current = {}, None
    for line in block.splitlines():
        words = line.split()
        if words and words[0] in ("glue", "act", "decide", "evidence", "read"):
            current = words[0]
        elif words and words[0].startswith("modules/"):
            current = None
        if current:
            layers.setdefault(current, set()).update(LAYER_NAME.findall(line))
    return layers


def layering_test_lists():
    """LAYERS and ORDER as test_layering.py assigns them (read, not imported: a test imports no other test)."""
    path = os.path.join(REPO, "tests", "unit", "plugins", "module_utils", "test_layering.py")
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in ("LAYERS", "ORDER"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["LAYERS"], found["ORDER"]


def test_the_design_diagram_lists_the_layering_tests_files_in_their_layers():
    layers, order = layering_test_lists()
    drawn = design_layers()
    assert set(drawn) == {"glue", "act", "decide", "evidence", "read"}
    assert set(layers) <= set(drawn)
    for layer, names in drawn.items():
        assert names - PENDING_MERGE == set(layers.get(layer, ())), layer
    # bottom-up, as the design reads them top-down: read, evidence, decide, act (and glue, once the merge adds it)
    assert list(order) == [o for o in ("read", "evidence", "decide", "act", "glue") if o in order]
