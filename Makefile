# Every target sets up .venv first, so `make run` and `make test` work on a fresh clone.
# All installs go through constraints.txt, which pins torch to the CPU wheel on disk.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install run test test-integration lint docs bench bench-sweep bench-auto bench-ray bench-gpu bench-cores test-gpu soak unit test-compat clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,dev,bench,docs,examples,frameworks,ray]'
	touch $(STAMP)

install: $(STAMP)

# The main demo: JPEGs decoded and augmented by workers, a small CNN trained with `async for`,
# then loader.stats() and images/s next to torch's DataLoader. It installs aioload with only the
# `examples` extra (Pillow, trio), not the test, docs, bench and framework tools `install` adds.
RUN_STAMP := $(VENV)/.run-stamp

$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip -c constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[examples]'
	touch $(RUN_STAMP)

run: $(RUN_STAMP)
	$(PY) examples/train_images.py

lint: install
	$(VENV)/bin/ruff check aioload benchmarks tests examples
	$(VENV)/bin/ruff format --check aioload benchmarks tests examples
	$(VENV)/bin/mypy --strict

# The docs site (mkdocs-material, API pages from docstrings) into site/; --strict fails on any
# warning. NO_MKDOCS_2_WARNING silences mkdocs-material's banner about MkDocs 2.0 (we pin <2).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

unit: install
	$(PY) -m pytest

# pytest checks the site that `docs` built (tests/docs/test_site.py) rather than building it again.
# The slowest tests, apart: Ray in a loopback-only network namespace, the frameworks
# (Lightning, accelerate, HF Trainer), every example run as a user runs it, the benchmarks'
# own tests (each runs small benchmarks end to end), and the reliability matrix (signals,
# kills and limits over every front end and start method, each in a fresh process).
INTEGRATION := tests/ray tests/frameworks tests/docs/test_examples.py tests/features/test_bench.py \
	tests/reliability

test: lint docs
	AIOLOAD_BUILT_SITE=site $(PY) -m pytest $(addprefix --ignore=,$(INTEGRATION))

test-integration: install
	$(PY) -m pytest $(INTEGRATION)

# tests/conformance and a smoke subset (tools/compat/smoke.txt) against every torch release of
# tools/compat/releases.txt, as users install them (the registry's CUDA builds, and the CPU
# wheel), and under the other Pythons of tools/compat/pythons.txt (pyenv's 3.12 and 3.13 with the
# registry's torch). One venv per entry, kept between runs outside the checkout in
# $AIOLOAD_COMPAT_DIR (default ~/.cache/aioload-compat); aioload runs from this checkout.
test-compat:
	$(PYTHON) tools/compat/matrix.py

# aioload vs torch, the peers (torchdata.nodes, SPDL) and each workload's no-loader floor, with
# issue 17's targets as PASS/FAIL; writes docs/benchmarks.{md,json,png}. About 15 minutes.
# aioload's bytecode is compiled first, as an installed package's is: the editable install has
# none, and where PYTHONDONTWRITEBYTECODE is set every fresh process of the start-up figures
# would compile the package again (about 20 ms of its first batch).
bench: install
	$(PY) -m compileall -q aioload
	$(PY) -m benchmarks
	$(PY) -m benchmarks.seeding --json docs/seeding.json --notes docs/benchmark-notes.md
	$(PY) -m benchmarks.uneven --json docs/benchmarks-uneven.json --docs docs/benchmarks.md
	$(PY) -m benchmarks.threads --json docs/benchmarks-threads.json --docs docs/benchmarks.md

# For a many-core machine (about 4 minutes on 16 cores): at 2, 4, 8 and 14 workers, the floor,
# aioload (in order and not) and torch on tiny, image and uneven samples, with aioload's busy
# share and in-order wait; writes docs/benchmarks-cores.json and its section of
# docs/benchmarks.md.
# `$(PY) -m benchmarks.cores --quick --no-write` checks it on any machine.
bench-cores: install
	$(PY) -m compileall -q aioload
	$(PY) -m benchmarks.cores

# 2 Ray actors vs 2 local workers vs torch's DataLoader (cpu and image), inside a loopback-only
# network namespace (it re-runs itself under `unshare -n`); rows into docs/benchmarks.md.
bench-ray: install
	$(PY) -m benchmarks.ray --json docs/benchmarks_ray.json --docs

# num_workers/prefetch_factor/worker_concurrency="auto" against a small grid of hand-set numbers
# and torch's defaults, per workload, alternating, medians, peak RSS; writes
# docs/benchmarks-auto.{md,json}. About 17 minutes on 2 cores.
bench-auto: install
	$(PY) -m compileall -q aioload
	$(PY) -m benchmarks.auto

# How the cost grows with sample size, batch size and num_workers; writes the sweep section of
# docs/benchmarks.md and docs/benchmarks-sweep.{json,png}. About 5 minutes.
bench-sweep: install
	$(PY) -m benchmarks.sweep

# Not part of `make test`: 1,000 loaders with random breaks and worker kills; counts must be flat.
soak: install
	$(PY) tests/soak.py --json docs/soak.json

# Need a CUDA GPU (and a CUDA build of torch); they say so and stop where there is none.
bench-gpu: install
	$(PY) -m benchmarks.gpu

test-gpu: install
	$(PY) -m pytest tests/gpu -rs

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
