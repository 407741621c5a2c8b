"""Every example in examples/ runs as its docstring says, on a fresh folder: the commands read from the file and
run as written (a line ending in `&` as a background server, stopped at the end), against a server that needs a
token, which every client takes from `PACKFEED_AUTH_TOKEN` as the server does. Without the variable a trainer is
refused (the control). examples/first_steps.py is the README tour's last command (its test runs it as
written); without a token, examples/stateful_loader.py runs in tests/test_loaders.py."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doc_commands import REPO, commands_run_by

pytestmark = pytest.mark.slow
EXAMPLES = REPO / "examples"
SERVED = "(serve a job as in examples/hf_trainer.py)"


def docstring_commands(example: Path) -> list[str]:
    """The indented command lines of an example's docstring, continuation lines joined."""
    doc = ast.get_docstring(ast.parse(example.read_text()), clean=False) or ""
    commands, current = [], ""
    for line in doc.splitlines():
        code = line.strip()
        if not line.startswith("    ") or not (current or code.startswith(("packfeed", "torchrun", "python", "("))):
            continue
        current += code.rstrip("\\").strip() + " "
        if not code.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return commands


def wait_for_port(address: str, server: subprocess.Popen, seconds: float = 120) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited: {server.stdout.read()[-3000:]}"
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"nothing listens on {address} after {seconds} s")


def serving(serve: str, folder: Path, env: dict) -> subprocess.Popen:
    """A docstring's `packfeed serve ... &`, started in `folder` and listening."""
    server = subprocess.Popen(shlex.split(serve.rstrip("& ")), cwd=folder, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    wait_for_port(re.search(r"--listen (\S+)", serve)[1], server)
    return server


def test_every_example_says_how_it_runs():
    examples = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert examples == ["first_steps.py", "hf_trainer.py", "lightning_fit.py", "stateful_loader.py", "trl_grpo.py",
                        "vllm_rollouts.py"]  # the last runs in vLLM's environment: tests/test_vllm_rollouts.py
    assert "python examples/first_steps.py tour/index.parquet" in commands_run_by("tests/test_readme_tour.py")
    for name in ("lightning_fit.py", "stateful_loader.py"):
        assert docstring_commands(EXAMPLES / name)[0] == SERVED


def test_the_examples_run_as_written_against_a_server_with_a_token(tmp_path):
    setup = docstring_commands(EXAMPLES / "hf_trainer.py")
    (serve,) = [c for c in setup if c.endswith("&")]
    trainers = [c for c in setup if c.startswith("torchrun")]
    for name in ("lightning_fit.py", "stateful_loader.py"):
        trainers += [c for c in docstring_commands(EXAMPLES / name) if c != SERVED]
    documented = commands_run_by("tests/test_examples.py")  # docs/training.md: ZeRO-3, and GRPO's own server
    (zero3,) = [c for c in documented if "ds_zero3" in c]
    trainers.append(zero3)
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    bin_dir = str(Path(sys.executable).parent)  # `packfeed`, `torchrun` and `python` as an activated .venv has them
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PACKFEED_AUTH_TOKEN": "s3cret"}
    env.pop("PACKFEED_CONFIG", None)

    def run(command: str, environment: dict) -> subprocess.CompletedProcess:
        return subprocess.run(command, shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True,
                              timeout=600)

    for command in setup[:setup.index(serve)]:
        done = run(command, env)
        assert done.returncode in (0, 3), f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"  # 3: skips
    server = serving(serve, tmp_path, env)
    try:
        # the control: the lightest trainer (no model to import) without the token; refused, it saves nothing
        lightest = next(c for c in trainers if "stateful_loader.py" in c)
        refused = run(lightest, {k: v for k, v in env.items() if k != "PACKFEED_AUTH_TOKEN"})
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stdout + refused.stderr
        outputs = {}
        for command in trainers:
            done = run(command, env)
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            outputs[command] = done.stdout + done.stderr
    finally:
        server.terminate()
        server.wait(timeout=60)
    grpo = docstring_commands(EXAMPLES / "trl_grpo.py")  # the same dataset, its own server with a live spool
    (grpo_serve,) = [c for c in grpo if c.endswith("&")]
    assert grpo[:grpo.index(grpo_serve)] == setup[:setup.index(serve)]
    # the docs say what runs here (the server in a shell of its own there)
    assert [c for c in documented if c != zero3] == [c.rstrip("& ") for c in grpo[grpo.index(grpo_serve):]]
    server = serving(grpo_serve, tmp_path, env)
    try:
        (grpo_run,) = [c for c in grpo if c.startswith("torchrun")]
        done = run(grpo_run, env)
        assert done.returncode == 0, f"{grpo_run}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    finally:
        server.terminate()
        server.wait(timeout=60)
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(math.isfinite(s["loss"]) for s in steps), done.stdout
    resumed = next(out for command, out in outputs.items() if "hf_trainer.py" in command and "--resume" in command)
    rates = [float(rate) for rate in re.findall(r"'learning_rate': '?([0-9.e-]+)", resumed)]
    assert rates and min(rates) > 0, resumed[-2000:]  # the resumed steps continue the job's schedule, not at 0
    fitted = next(out for command, out in outputs.items() if "lightning_fit.py" in command)
    assert re.search(r"step \d+: epoch \d+ step \d+, loss \d+\.\d+", fitted), fitted[-2000:]
    assert (tmp_path / "trainer-out").is_dir() and (tmp_path / "lightning-out").is_dir()
    assert (tmp_path / "dcp-out").is_dir()
    # ZeRO-3 ran (a shard of the model per rank), without Accelerate's expected accumulation warning
    assert len(list((tmp_path / "zero3-out").glob("checkpoint-*/global_step*/zero_pp_rank_*_model_states.pt"))) >= 2
    assert "Gradient accumulation steps mismatch" not in outputs[zero3]
