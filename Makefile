# Every target sets up its own virtual environment (.venv) with pinned dependencies.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CODE   := $(wildcard src tests benchmarks examples)

.PHONY: venv demo test test-other-cpu lint typecheck bench docs-numbers clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,progress,plot,lightning,accelerate,tensorboard]'
	# The recipes' trainers (docs/transformers.md, timm.md, lightning.md; tests/test_recipes.py):
	# both Lightning distributions, transformers, and timm without its torchvision (no CPU build
	# of torchvision installs beside the CPU torch).
	$(PY) -m pip install -q -c constraints.txt lightning transformers
	$(PY) -m pip install -q -c constraints.txt --no-deps timm
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mixprec demo

lint: $(STAMP)
	$(PY) -m ruff check $(CODE)
	$(PY) -m ruff format --check $(CODE)

typecheck: $(STAMP)
	$(PY) -m mypy

test: lint typecheck
	$(PY) -m pytest -q

# The suite as another x86 CPU runs it: torch's, MKL's and oneDNN's kernels held to SSE4 (other
# vector widths and blockings round float sums differently) on one thread. A test that pins one
# machine's digits fails here.
test-other-cpu: $(STAMP)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

docs-numbers: $(STAMP)
	$(PY) -m tests.test_docs_numbers --write

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
