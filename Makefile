# Two entry points for a fresh machine: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckptd-installed

.PHONY: setup demo test test-all bench clean

setup: $(STAMP)

# torch: the CPU build 2.13.0 when the venv has no torch (pyproject accepts a range 2.13 satisfies);
# the torch found or installed is then pinned, so that resolving the other packages never swaps it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]' "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ckptd demo

test: setup
	$(PY) -m pytest

test-all: setup
	$(PY) -m pytest -m ''

bench: setup
	$(VENV)/bin/ckptd bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
