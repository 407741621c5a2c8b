# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   := demo-out

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard protos/packfeed/v1/*.proto)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/packfeed demo --out $(DEMO)

test: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/benchmarks

bench: $(STAMP)
	$(PY) -m pytest -q -s tests/benchmarks -m benchmark

clean:
	rm -rf $(DEMO) build *.egg-info
