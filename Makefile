# Two commands for a fresh clone; each creates .venv (and installs meshpar into it) when missing.
#   make train   train the tiny transformer on 8 fake CPU devices with FSDP
#   make test    run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test bench
train: $(VENV)/installed
	$(PY) -m launch.train --config tiny --cpu-devices 8 --mesh fsdp=8

test: $(VENV)/installed
	$(PY) -m pytest

bench: $(VENV)/installed
	$(PY) -m launch.bench

$(VENV)/installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@
