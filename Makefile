# gpuops.fleet: one entry point for set-up, tests, demo and benchmarks.
# Every target works as root on a fresh Debian machine with Python 3.12 or newer (ansible-core 2.21's controller
# needs 3.12 to 3.14): make venv picks the newest found on PATH or in pyenv (tests/tools/pick_python.sh), or PY=.
SHELL := /bin/bash
VENV := .venv
VPY := $(VENV)/bin/python
WHEELS := .cache/wheels
APT_PACKAGES := openssh-server openssh-client psmisc gcc libc6-dev iproute2 util-linux procps git sudo openssl python3-venv shellcheck lxc lxcfs mmdebstrap

.PHONY: all venv system-packages test sanity pylint-tests unit lint test-lab integration test-stress test-deep test-respawn test-matrix demo bench gpu-facts clean lab-down

all: test

system-packages: .cache/system.stamp
.cache/system.stamp:
	@bash tests/tools/install_system_packages.sh $(APT_PACKAGES)
	@mkdir -p .cache && touch $@

venv: $(VENV)/.stamp
$(VENV)/.stamp: requirements-controller.txt requirements-target.txt requirements-dev.txt .cache/system.stamp
	@# uv when it installs, else pip (14-34 s against 35-47 s, measured); the lab's venvs and NVML stand-in build beside
	bash tests/tools/make_venv.sh $(VENV) $(WHEELS)
	@# the collection, linked into the venv's site-packages (lib/python3.X, the Python picked)
	link=$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ansible_collections/gpuops/fleet && \
		mkdir -p "$${link%/*}" && ln -sfn "$(CURDIR)" "$$link"
	touch $@

# Every test; each `timing` test 3 times (GPUOPS_TIMING_REPEAT=N to change it).
test: venv
	@$(VPY) tests/tools/run_all.py --timing-repeat $${GPUOPS_TIMING_REPEAT:-3}

# ansible-test sanity over everything: make test's sanity stage (pylint over the shipped code) and pylint-tests.
sanity: venv
	@$(VPY) tests/tools/run_all.py --only sanity --only pylint-tests

# pylint over tests/ (the tests, the lab and the tools); .ci/run runs it after make test.
pylint-tests: venv
	@$(VPY) tests/tools/run_all.py --only pylint-tests

unit: venv
	@$(VPY) tests/tools/run_all.py --only unit

lint: venv
	@$(VPY) tests/tools/run_all.py --only lint

integration: venv
	@$(VPY) tests/tools/run_all.py --only lab --only integration

# The lab's self-tests alone (make test runs them before the integration tests).
test-lab: venv
	@$(VPY) tests/tools/run_all.py --only lab

# The decision step's and the stop sets' invariants over 100,000 generated worlds each (make test runs 2,000).
test-deep: venv
	@GPUOPS_WORLDS=100000 $(VPY) -m pytest -q -p no:cacheprovider tests/unit/plugins/module_utils/test_worlds.py \
		tests/unit/plugins/module_utils/test_worlds_stopsets.py

# Every timing-sensitive test (marker `timing`) 20 times in a row: pass rate and slowest run of each.
test-stress: venv
	@$(VPY) tests/tools/stress.py --rounds 20

# The tests that depend on ansible-core's version (unit, the pct connection's and the role's integration tests,
# validate-modules and import) against each older supported ansible-core, 2.16 to 2.20, each on a Python it supports
# (make test runs everything on 2.21); .ci/run calls it after make test. MATRIX_VERSIONS picks some versions,
# MATRIX_SANITY_ON the versions whose sanity cell runs (all by default; 2.20 alone if .ci/run outgrows 45 minutes).
test-matrix: venv
	@$(VPY) tests/tools/matrix.py $${MATRIX_VERSIONS:+--versions $$MATRIX_VERSIONS} \
		$${MATRIX_SANITY_ON:+--sanity-on $$MATRIX_SANITY_ON}

# The respawn tests alone, 20 rounds (supervisord, a shell loop, a Python loop, a parent named torchrun).
test-respawn: venv
	@$(VPY) tests/tools/stress.py --rounds 20 -k "respawn and not sibling"

demo: venv
	@$(VPY) tests/lab/demo.py

bench: venv
	@$(VPY) tests/tools/bench_all.py

gpu-facts: venv
	@$(VPY) tests/lab/gpu_facts.py --backend lab --json docs/facts/lab.json && $(VPY) tests/lab/fidelity_report.py

lab-down:
	-@tests/lab/labctl down

clean: lab-down
	rm -rf $(VENV) .cache .lab .bench tests/output
