# Every target sets up its own virtual environment (.venv) with pinned dependencies.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CODE   := $(wildcard src tests benchmarks examples)

.PHONY: venv demo test test-torch test-torches test-other-cpu lint typecheck bench docs-numbers clean

EXTRAS := test,progress,plot,lightning,accelerate,tensorboard
# The recipes' trainers (docs/transformers.md, timm.md, lightning.md; tests/integrations/test_recipes.py):
# both Lightning distributions, transformers, and timm without its torchvision (no CPU build
# of torchvision installs beside the CPU torch).
TRAINERS := lightning transformers
# torchtitan (tests/fp8/test_fsdp_gather_torchtitan.py): in .venv only, with the pinned torch it is
# tested on (the test skips in the venvs of the other torch versions).
TITAN := torchtitan

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q -c constraints.txt $(TRAINERS)
	$(PY) -m pip install -q -c constraints.txt --no-deps timm
	$(PY) -m pip install -q -c constraints.txt $(TITAN)
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

# The suite on another torch than the pinned one: make test-torch TORCH=2.14.1. CI runs
# test-torches: the oldest torch pyproject.toml declares and the newest installable.
TORCH_OLDEST := 2.12.1
TORCH_NEWEST := 2.14.1
# Its own venv with constraints.txt's pins but that torch, the same extras and trainers as .venv
# (the extras' requirements read from pyproject.toml) and mixprec run from src/ (PYTHONPATH: one
# venv serves any checkout; the copy installed without dependencies is there for its metadata,
# which test_packaging reads). torch wheels other than the pinned CPU one are CUDA builds: they
# run on the CPU.
comma      := ,
TORCH      ?=
TORCH_VENV ?= .venv-torch-$(TORCH)
TORCH_PY   := $(TORCH_VENV)/bin/python
EXTRA_DEPS := import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print("\n".join(p["dependencies"] + [r for e in sys.argv[1:] for r in p["optional-dependencies"][e]]))

$(TORCH_VENV)/.installed: pyproject.toml constraints.txt Makefile
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=<version>"; exit 2; }
	$(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_PY) -m pip install -q --upgrade pip
	grep -v '^torch==' constraints.txt > $(TORCH_VENV)/constraints.txt
	echo 'torch==$(TORCH)' >> $(TORCH_VENV)/constraints.txt
	$(TORCH_PY) -c '$(EXTRA_DEPS)' $(subst $(comma), ,$(EXTRAS)) > $(TORCH_VENV)/requirements.txt
	echo $(TRAINERS) | tr ' ' '\n' >> $(TORCH_VENV)/requirements.txt
	$(TORCH_PY) -m pip install -q -c $(TORCH_VENV)/constraints.txt -r $(TORCH_VENV)/requirements.txt
	$(TORCH_PY) -m pip install -q -c $(TORCH_VENV)/constraints.txt --no-deps timm .
	touch $@

test-torches:
	$(MAKE) test-torch TORCH=$(TORCH_OLDEST)
	$(MAKE) test-torch TORCH=$(TORCH_NEWEST)

test-torch: $(TORCH_VENV)/.installed
	$(TORCH_PY) -c 'import torch; print("torch", torch.__version__)'
	PYTHONPATH=$(CURDIR)/src $(TORCH_PY) -m pytest -q -p no:cacheprovider

# The suite as another x86 CPU runs it: torch's, MKL's and oneDNN's kernels held to SSE4 (other
# vector widths and blockings round float sums differently) on one thread. A test that pins one
# machine's digits fails here.
test-other-cpu: $(STAMP)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/run.py

docs-numbers: $(STAMP)
	$(PY) -m tests.docs.test_docs_numbers --write

clean:
	rm -rf $(VENV) .venv-torch-* build dist *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
