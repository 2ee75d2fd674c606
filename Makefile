# Every target sets up .venv first, so `make run` and `make test` work on a fresh clone.
# All installs go through constraints.txt, which pins torch to the CPU wheel on disk.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test lint bench unit clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,dev,bench]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(PY) examples/quickstart.py

lint: install
	$(VENV)/bin/ruff check aioload tests examples
	$(VENV)/bin/ruff format --check aioload tests examples
	$(VENV)/bin/mypy --strict aioload

unit: install
	$(PY) -m pytest

test: lint unit

bench: install
	$(PY) -m aioload.bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
