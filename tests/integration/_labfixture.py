"""Fixture factories shared by the integration test modules; each module keeps its own lab and LAB_ID."""
import time

import pytest


def wait_until(predicate, timeout=10.0, interval=0.05):
    """The predicate's first true value within timeout, else its last value (tests assert on it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def module_lab(build, name="lab"):
    """A module-scoped fixture `name`: the lab that build() brings up, torn down whatever happens."""
    @pytest.fixture(scope="module", name=name)
    def fixture():
        lab = build()
        try:
            yield lab
        finally:
            lab.down()
    return fixture


def clean_role_lab():
    """Fixture `clean` over a RoleLab `lab`: a test starts on free GPUs and leaves its containers
    restarted, whatever happens."""
    @pytest.fixture(name="clean")
    def fixture(lab):
        try:
            assert lab.all_free(), "lab GPUs not free before the test: %s" % lab.gpus()
            yield lab
        finally:
            lab.reset()
    return fixture


def clean_engine_lab():
    """Fixture `clean` over an EngineLab `lab`: after each test what it started is killed and every GPU must be free."""
    @pytest.fixture(name="clean")
    def fixture(lab):
        yield lab
        busy = lab.cleanup()
        assert not busy, "GPUs still used after clean-up: %s" % busy
    return fixture
