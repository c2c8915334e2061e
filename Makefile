# The two set-up commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The build pip picks depends on its index: the public PyPI serves CUDA builds on Linux x86_64; for the CPU-only
# build, install torch==2.13.0 from https://download.pytorch.org/whl/cpu into $(VENV) first (README.md).
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test bench clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash tools/demo.sh

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf demo_out runs
