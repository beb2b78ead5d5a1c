# Two entry points for a fresh machine: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckptd-installed
INTEGRATIONS_STAMP := $(VENV)/.ckptd-integrations-installed
#: The torch the venv has, as a requirement: installing other packages never swaps it (no CUDA build).
TORCH_PIN = "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"

.PHONY: setup setup-integrations demo test test-integrations test-all bench clean

setup: $(STAMP)

# The framework extras (lightning, huggingface) for the integrations test group, with torch pinned.
setup-integrations: $(INTEGRATIONS_STAMP)

# torch: the CPU build 2.13.0 when the venv has no torch (pyproject accepts a range 2.13 satisfies);
# the torch found or installed is then pinned, so that resolving the other packages never swaps it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH_PIN)
	touch $(STAMP)

$(INTEGRATIONS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,integrations]' $(TORCH_PIN)
	touch $(INTEGRATIONS_STAMP)

demo: setup
	$(VENV)/bin/ckptd demo

# The default suite, then the framework tests (marker integrations) once their extras are installed.
test: setup
	$(PY) -m pytest
	$(MAKE) test-integrations

test-integrations: setup-integrations
	$(PY) -m pytest -m integrations

test-all: setup-integrations
	$(PY) -m pytest -m ''

bench: setup
	$(VENV)/bin/ckptd bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
