"""verl's whole plug-in path (`python -m packfeed.cli.verl_ppo`), run in verl's own environment as far as verl runs
on a CPU: tests/verl_plugin_path.py there (its docstring lists the checks), the environment built by `make
verl-env` outside any test's timeout (CI builds it first)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from verl_env import VERL_ENV, built_python

SCRIPT = Path(__file__).with_name("verl_plugin_path.py")
CHECKS = {"installed", "composed", "in_rays_process", "balanced_v1", "balanced_legacy"}


@pytest.mark.timeout(600)
def test_verls_main_ppo_builds_packfeeds_trainers_and_they_balance_its_steps(tmp_path):
    python = built_python()
    if python is None:
        pytest.skip(f"verl's environment is not built under {VERL_ENV}: run `make verl-env` (minutes, once)")
    done = subprocess.run([str(python), str(SCRIPT)], capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')]
    assert {line["check"] for line in lines} == CHECKS
    by_check = {line["check"]: line for line in lines}
    assert by_check["installed"]["verl"] == "0.9.1"
    trainers = by_check["in_rays_process"]["trainers"]
    assert trainers["sync"] == "PackfeedPPOTrainerSync" and trainers["legacy"] == "PackfeedPPOTrainer"
    legacy = [line for line in lines if line["check"] == "balanced_legacy"]
    assert {line["prefix_grouper"] for line in legacy} == {False, True}
    assert all(line["groups_whole"] == 1.0 for line in legacy if line["prefix_grouper"])
