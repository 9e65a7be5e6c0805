# Two commands do all set-up (see README):
#   make demo   -> creates .venv if missing, installs zeroshard and what the demo runs, runs it
#   make test   -> the same plus the test and integration dependencies, then ruff + the suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint slow clean

# torch, zeroshard and its plotting: all `zeroshard bench` imports (the demo's set-up).
$(BASE): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned: its CPU build is on disk here; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[plot]"
	touch $(BASE)

# Everything the tests need: pytest, ruff and the integrations (transformers, peft, TRL,
# Lightning), whose tests run in CI. One pip call on a fresh clone (one resolve, one
# editable build: ~5 s less than the demo's set-up followed by the rest).
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	test -f $(BASE) || $(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" -e ".[plot,dev]"
	touch $(BASE) $(STAMP)

setup: $(STAMP)

demo: $(BASE)
	$(BIN)/zeroshard bench

lint: $(STAMP)
	$(BIN)/ruff check src tests

# Three pytest workers, each file on one (module-level caches stay shared by its tests):
# the suite is CPU-bound on 2 cores, but its hang, timeout and restart checks wait, and a
# third worker fills those waits (cores busy 98% against 89% with two; README, "Tests").
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -m "not slow" -n 3 --dist loadfile tests

slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

clean:
	rm -rf $(VENV) build *.egg-info
