# Quick start: `make demo` runs the main job, `make test` runs the tests (CI: the full suite,
# lint and format checks first), `make test-fast` the edit loop's tier (no test marked slow:
# the maths, rewards, data, filter, model parity and one rollout-and-update smoke check; its
# budget is 2 minutes on 2 CPU cores). Both run a test process per core (pytest-xdist) and
# print their slowest tests. All create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

demo: venv
	JAX_NUM_CPU_DEVICES=2 $(PY) -m dapo_jax.train --config=configs/dapo.py:tiny --workdir=runs/demo

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n auto --durations=15 tests

test-fast: venv
	$(PY) -m pytest -q -n auto -m "not slow" --durations=10 tests

clean:
	rm -rf $(VENV) runs
