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


SETUP = docstring_commands(EXAMPLES / "hf_trainer.py")
(SERVE,) = [c for c in SETUP if c.endswith("&")]
DOCUMENTED = commands_run_by("tests/test_examples.py")  # docs/training.md: ZeRO-3, and GRPO's own server
(ZERO3,) = [c for c in DOCUMENTED if "ds_zero3" in c]


def run(command: str, folder: Path, environment: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, shell=True, cwd=folder, env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def examples_folder(tmp_path_factory) -> tuple[Path, dict]:
    """A fresh folder with examples/ and the dataset hf_trainer.py's docstring makes (its commands before the
    server, as written), and the environment its commands run in: `packfeed`, `torchrun` and `python` as an
    activated .venv has them, the server's token exported."""
    folder = tmp_path_factory.mktemp("examples")
    shutil.copytree(EXAMPLES, folder / "examples")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PACKFEED_AUTH_TOKEN": "s3cret"}
    env.pop("PACKFEED_CONFIG", None)
    for command in SETUP[:SETUP.index(SERVE)]:
        done = run(command, folder, env)
        assert done.returncode in (0, 3), f"{command}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"  # 3: skips
    return folder, env


def run_served(serve: str, commands: list[tuple[str, dict]], folder: Path,
               env: dict) -> list[subprocess.CompletedProcess]:
    """Each (command, environment) in turn against the docstring's server `serve`, started for them in `env`."""
    server = serving(serve, folder, env)
    try:
        return [run(command, folder, environment) for command, environment in commands]
    finally:
        server.terminate()
        server.wait(timeout=60)


def succeeded(command: str, done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def test_the_examples_run_as_written_against_a_server_with_a_token(examples_folder):
    folder, env = examples_folder
    trainers = [c for c in SETUP if c.startswith("torchrun")]
    for name in ("lightning_fit.py", "stateful_loader.py"):
        trainers += [c for c in docstring_commands(EXAMPLES / name) if c != SERVED]
    # the control: the lightest trainer (no model to import), as one process, without the token; refused
    lightest = next(c for c in trainers if "stateful_loader.py" in c)
    assert lightest.startswith("torchrun --nproc-per-node 2 ")
    one = lightest.replace("torchrun --nproc-per-node 2 ", "python ", 1)
    without = {k: v for k, v in env.items() if k != "PACKFEED_AUTH_TOKEN"}
    refused, *done = run_served(SERVE, [(one, without)] + [(c, env) for c in trainers], folder, env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stdout + refused.stderr
    outputs = {command: succeeded(command, result) for command, result in zip(trainers, done)}
    resumed = next(out for command, out in outputs.items() if "hf_trainer.py" in command and "--resume" in command)
    rates = [float(rate) for rate in re.findall(r"'learning_rate': '?([0-9.e-]+)", resumed)]
    assert rates and min(rates) > 0, resumed[-2000:]  # the resumed steps continue the job's schedule, not at 0
    fitted = next(out for command, out in outputs.items() if "lightning_fit.py" in command)
    assert re.search(r"step \d+: epoch \d+ step \d+, loss \d+\.\d+", fitted), fitted[-2000:]
    assert (folder / "trainer-out").is_dir() and (folder / "lightning-out").is_dir()
    assert (folder / "dcp-out").is_dir()


def test_the_documented_zero3_and_grpo_examples_run_as_written_against_a_server_with_a_token(examples_folder):
    """docs/training.md's ZeRO-3 command against hf_trainer.py's server, then examples/trl_grpo.py's own server (a
    live spool) and its run, on the same dataset."""
    folder, env = examples_folder
    (zero3,) = run_served(SERVE, [(ZERO3, env)], folder, env)
    # ZeRO-3 ran (a shard of the model per rank), without Accelerate's expected accumulation warning
    assert "Gradient accumulation steps mismatch" not in succeeded(ZERO3, zero3)
    assert len(list((folder / "zero3-out").glob("checkpoint-*/global_step*/zero_pp_rank_*_model_states.pt"))) >= 2
    grpo = docstring_commands(EXAMPLES / "trl_grpo.py")  # the same dataset, its own server with a live spool
    (grpo_serve,) = [c for c in grpo if c.endswith("&")]
    assert grpo[:grpo.index(grpo_serve)] == SETUP[:SETUP.index(SERVE)]
    # the docs say what runs here (the server in a shell of its own there)
    assert [c for c in DOCUMENTED if c != ZERO3] == [c.rstrip("& ") for c in grpo[grpo.index(grpo_serve):]]
    (grpo_run,) = [c for c in grpo if c.startswith("torchrun")]
    (done,) = run_served(grpo_serve, [(grpo_run, env)], folder, env)
    succeeded(grpo_run, done)
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(math.isfinite(s["loss"]) for s in steps), done.stdout
