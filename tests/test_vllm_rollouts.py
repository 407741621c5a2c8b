"""Rollouts from real vLLM on the CPU, fed by a Packfeed prompt job (`packfeed.client.rollouts`): tests/
vllm_rollouts_check.py in vLLM's own environment (its docstring lists the checks), built by `make vllm-env` outside
any test's timeout (CI builds it first). A tiny Qwen2-VL built from a config, images in the prompts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vllm_env import VLLM_ENV, built_python

SCRIPT = Path(__file__).with_name("vllm_rollouts_check.py")


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, dict]:
    python = built_python()
    if python is None:
        message = f"vLLM's environment is not built under {VLLM_ENV}: run `make vllm-env` (minutes, once)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI builds it before the tests: see .ci/run)")
        pytest.skip(message)
    out = tmp_path_factory.mktemp("vllm")
    done = subprocess.run([str(python), str(SCRIPT), str(out)], capture_output=True, text=True, timeout=540,
                          cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    return {line["check"]: line for line in lines}


@pytest.mark.timeout(600)
def test_vllm_runs_at_the_hf_extras_transformers_floor(checks):
    assert checks["installed"]["vllm"] == "0.32.0" and checks["installed"]["transformers"] == "5.19.0"


@pytest.mark.timeout(600)
def test_vllm_greedy_completions_equal_transformers_on_the_trainers_pixels(checks):
    pairs = checks["greedy"]["pairs"]
    assert {pair["images"] for pair in pairs} >= {0, 1, 2}  # text prompts, one image and two
    for pair in pairs:
        assert len(pair["vllm"]) == 8 and pair["vllm"] == pair["transformers"], pair


@pytest.mark.timeout(600)
def test_vllm_behaviour_logprobs_put_equal_the_trainers_logprobs_of_the_same_tokens(checks):
    line = checks["logprobs"]
    trainer, behaviour = np.array(line["trainer"]), np.array(line["behaviour"])
    assert line["samples"] == 12 and len(trainer) >= 12  # 3 prompts x 4 completions, each with tokens trained
    assert np.all(behaviour < 0) and np.abs(trainer - behaviour).max() < 1e-4
    assert line["versions"] == [0]


@pytest.mark.timeout(600)
def test_a_vllm_weight_update_changes_generation_and_it_matches_again(checks):
    line = checks["weights"]
    assert line["loaded"] == [1]  # the worker's next step loaded the published version 1
    for before, after in zip(line["before"], line["after"]):
        assert before["vllm"] == before["transformers"] and after["vllm"] == after["transformers"]
    assert any(before["vllm"] != after["vllm"] for before, after in zip(line["before"], line["after"]))
