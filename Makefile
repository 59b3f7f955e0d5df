# `make up` and `make test` are the two commands of the README: both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml scripts/install-system-deps.sh
	scripts/install-system-deps.sh
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: install lint up demo test test-slow bench schemas results clean
install: $(VENV)/.installed

up: install
	$(VENV)/bin/gpusched up

demo: install
	$(VENV)/bin/gpusched demo

test: install lint
	$(PY) -m pytest

# The rules every branch passes: ruff (pyflakes, isort, complexity <= 15) on the whole repo,
# mypy on the whole library and the services (configured in pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test-slow: install
	$(PY) -m pytest -m slow

bench: install
	$(PY) bench/bench_log.py --quick
	$(PY) bench/bench_placement.py
	$(PY) bench/bench_cycle.py
	$(PY) bench/bench_churn.py --nodes 1000 --rounds 10
	$(PY) bench/bench_sim.py
	$(PY) bench/bench_mig_placement.py
	$(PY) bench/bench_e2e.py --quick
	$(PY) bench/bench_sign.py --quick
	$(PY) bench/bench_rss.py --quick
	$(PY) bench/bench_dashboard.py --updates 5

schemas: install
	$(VENV)/bin/gpusched schemas

results: install
	$(PY) bench/results.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis tests/artifacts
