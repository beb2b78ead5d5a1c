# Two entry points for a fresh machine: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ckptd-installed
INTEGRATIONS_STAMP := $(VENV)/.ckptd-integrations-installed
#: pytest-xdist workers for the default suite (each test file runs whole on one worker).
TEST_WORKERS ?= 2
#: The torch the venv has, as a requirement: installing other packages never swaps it (no CUDA build).
TORCH_PIN = "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"

.PHONY: setup setup-integrations promtool demo test test-integrations test-slow test-all bench clean

setup: $(STAMP)

# The framework extras (lightning, huggingface) for the integrations test group, with torch pinned.
setup-integrations: $(INTEGRATIONS_STAMP)

# torch: the CPU build 2.13.0 when the venv has no torch (pyproject accepts a range 2.13 satisfies);
# the torch found or installed is then pinned, so that resolving the other packages never swaps it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip "setuptools>=77" wheel
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]' $(TORCH_PIN)
	touch $(STAMP)

# promtool (Debian's `prometheus` package) for the alert rules' tests (tests/test_deploy_monitoring.py): installed
# when missing and this is root on a machine with apt-get; elsewhere those tests skip, saying why.
promtool:
	@command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		prometheus >/dev/null; } ; } || echo "promtool not installed: the alert rules' promtool tests will skip"

$(INTEGRATIONS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,integrations]' $(TORCH_PIN)
	touch $(INTEGRATIONS_STAMP)

demo: setup
	$(VENV)/bin/ckptd demo

# The default suite, then the framework tests (marker integrations) once their extras are installed;
# with PYTORCH_TESTS=<dir> also PyTorch's own DCP tests against ckptd's plugins (test-pytorch-dcp).
test: setup promtool
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) test-integrations
	@if [ -n "$(PYTORCH_TESTS)" ]; then $(MAKE) test-pytorch-dcp; fi

test-integrations: setup-integrations
	$(PY) -m pytest -m integrations -n $(TEST_WORKERS) --dist loadfile

# The slow group (marker slow, the tests listed in tests/slow_tests.txt): variants and heavier scenarios of
# capabilities the default run also tests, kept out of it so that the default run stays under 8 minutes on 2 cores.
test-slow: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m slow

test-all: setup-integrations
	$(PY) -m pytest -m ''

# `make test` beside LOAD_BURNERS CPU-spinning processes (the busy-machine run): exit code, wall time and the load
# seen go to reports/load/. The 60 s per-test limit grows with the run's load per core (tests/time_limit.py).
LOAD_BURNERS ?= 20
.PHONY: test-under-load
test-under-load: setup
	$(PY) tests/run_under_load.py --burners $(LOAD_BURNERS) --report reports/load/$$(date -u +%Y-%m-%d).json -- $(MAKE) test

# PyTorch's own DCP test files (a copy kept outside this repository) with ckptd's storage plugins in
# place of FileSystemWriter/FileSystemReader (harness.dcp_swap); CKPTD_DCP_SWAP=0 runs them
# against DCP's own classes. PYTORCH_TEST_ARGS: more pytest arguments (-k, -x, file names).
.PHONY: test-pytorch-dcp
test-pytorch-dcp: setup
	@test -n "$(PYTORCH_TESTS)" || { echo "usage: make test-pytorch-dcp PYTORCH_TESTS=<dir with PyTorch's test/distributed/checkpoint files>"; exit 2; }
	$(PY) -m pip install --quiet expecttest $(TORCH_PIN)
	cd "$(PYTORCH_TESTS)" && PYTHONPATH="$(abspath tests)" "$(abspath $(PY))" -m pytest -p harness.dcp_swap -p no:cacheprovider -o addopts="" -rs $(or $(PYTORCH_TEST_ARGS),.)

bench: setup
	$(VENV)/bin/ckptd bench

# The soak run (benchmarks/soak.py, outside the test run): SOAK_MINUTES of training on two stand-in nodes
# under seeded faults, then a byte-for-byte comparison with an uninterrupted run; the report goes to reports/soak/.
SOAK_MINUTES ?= 60
SOAK_SEED ?= 1
.PHONY: soak
soak: setup
	$(PY) benchmarks/soak.py --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) \
		--report reports/soak/$$(date -u +%Y-%m-%d)-seed$(SOAK_SEED).json

# The fault matrix's long mode (every row its long_runs times; MATRIX_JOBS worker processes), then the
# report: reports/fault-matrix/REPORT.md and the table in docs/fault-matrix.md.
.PHONY: matrix
MATRIX_JOBS ?= 2
matrix: setup
	$(PY) tests/matrix/long_run.py --runs-for 1=500 --jobs $(MATRIX_JOBS) --out reports/fault-matrix/all.json
	$(PY) tests/matrix/long_run.py --merge 'reports/fault-matrix/*.json' --markdown reports/fault-matrix/REPORT.md --readme docs/fault-matrix.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# The documentation site (mkdocs.yml): `make docs` builds it into site/ with --strict (a broken link, a missing
# reference or an error class without a troubleshooting section fails), `make docs-serve` serves it with live
# reload on 127.0.0.1:8000. The tools come with the dev extra; tests/test_docs_site.py runs the same build.
.PHONY: docs docs-serve
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict

# A 3-node ckptd cluster on this machine (tests/cluster/: each node a network namespace on a bridge, addresses
# in 198.18.0.0/15, its own disk, daemon and `ckptd launch` supervisor, moto's S3 in a namespace of its own):
# a node lost and replaced mid-run, then compared byte for byte with an uninterrupted run. Needs root.
.PHONY: cluster-demo
cluster-demo: setup
	$(PY) tests/cluster/demo.py

# The object tier's conformance tests and the promotion/restore scenarios against LocalStack's own S3 provider
# (localstack-core in host mode, in a Python 3.13 venv of its own) instead of moto; not in the default run.
# Pins: localstack-core 2026.3 imports cbor2's decoder from where cbor2 5 has it, and its TLS certificate
# code needs pyOpenSSL's X509.add_extensions (gone in 24.3; that one needs cryptography < 44); twisted's TLS
# needs service-identity.
# TESTS: other pytest arguments (default: tests/s3compat/run.py's list). See docs/s3-compat.md.
PYTHON313 ?= python3.13
S3COMPAT_VENV ?= .venv-s3compat
.PHONY: test-s3-compat
test-s3-compat: setup $(S3COMPAT_VENV)/.installed
	$(PY) tests/s3compat/run.py --localstack-python $(S3COMPAT_VENV)/bin/python -- $(TESTS)

$(S3COMPAT_VENV)/.installed:
	$(PYTHON313) -m venv $(S3COMPAT_VENV)
	$(S3COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(S3COMPAT_VENV)/bin/python -m pip install --quiet 'localstack-core[runtime]' 'cbor2<6' 'pyopenssl<24.3' 'cryptography<44' service-identity
	touch $@
