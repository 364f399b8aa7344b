"""predeploy_check.yml's own expressions, read from the playbook and evaluated in this process by ansible-core's
templating (issue 19): the variations of its input check. tests/integration/test_playbooks.py keeps end-to-end runs
of the same check (ansible-playbook, -e as a deploy script passes it)."""
import os

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

from _templating import REPO, trust_as_template


PLAYBOOK = os.path.join(REPO, "playbooks", "predeploy_check.yml")


def task(name):
    with open(PLAYBOOK) as handle:
        plays = yaml.safe_load(handle)
    return next(t for play in plays for t in play.get("tasks", ()) if t.get("name") == name)


def render(text, variables):
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(text))


def check_expect_hosts(variables):
    """(passes, failure message) of the task "Check predeploy_expect_hosts", as its assert evaluates them."""
    spec = task("Check predeploy_expect_hosts")["ansible.builtin.assert"]
    passes = render("{%% if %s %%}yes{%% else %%}no{%% endif %%}" % spec["that"], variables)
    return passes == "yes", " ".join(str(render(spec["fail_msg"], variables)).split())


MESSAGE = ("predeploy_expect_hosts must be a positive integer (the number of containers the check must read at least),"
           " got '%s'")


@pytest.mark.parametrize("value, shown", [
    ("abc", "abc"), ("0", "0"), ("-1", "-1"), ("", ""), ("7.0", "7.0"), (" 6", " 6"),     # -e key=value: strings
    (True, "True"), (2.5, "2.5"), (0, "0"), (-3, "-3"), ([6], "[6]"),                       # -e JSON: typed
], ids=repr)
def test_a_bad_predeploy_expect_hosts_is_refused_naming_the_value(value, shown):
    passes, message = check_expect_hosts({"predeploy_expect_hosts": value})
    assert not passes and message == MESSAGE % shown


@pytest.mark.parametrize("variables", [{}, {"predeploy_expect_hosts": 6}, {"predeploy_expect_hosts": "6"},
                                       {"predeploy_expect_hosts": "12"}], ids=repr)
def test_a_positive_integer_or_none_passes(variables):
    assert check_expect_hosts(variables)[0]
