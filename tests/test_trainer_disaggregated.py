"""parallel.encoder=disaggregated (`packfeed.trainer.parallel.disaggregated`): the encoder on E processes of its
own beside the D LLM processes, each fed its own stream of one plan. The loss and every gradient equal colocated
training on the same samples (one process over the step's colocated packs) at E=1, D=2 and E=2, D=3 on gloo; a
wrong route differs; `packfeed train` runs it end to end with the losses of the encoder in the stages, fails
loudly when an encoder rank dies and resumes exactly from its checkpoint."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from spawned import spawn
from test_trainer_pipeline import reference
from trainer_workers import SMALL_MODEL, disaggregated_step, packfeed_train, restart_from

pytestmark = pytest.mark.slow


def copied(steps) -> list:
    for step in steps:
        for pack in step.packs:
            pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
    return steps


@functools.lru_cache(maxsize=4)
def served(index: str, dp: int, encoder_ranks: int) -> tuple[list, list]:
    """Every step of one epoch for the D LLM ranks then the E encoder ranks of a job with encoder ranks, and for
    the D ranks of the same plan served colocated (encoder_ranks 0), over real gRPC."""
    from packfeed.client import LocalServer, PackStream

    plan = dict(dp=dp, microbatches=2, seed=0)
    with LocalServer(index, workers=1) as server:
        split = [copied(list(PackStream(server.target, job="split", rank=r, encoder_ranks=encoder_ranks, **plan)))
                 for r in range(dp)]
        split += [copied(list(PackStream(server.target, job="split", encoder_rank=e, encoder_ranks=encoder_ranks,
                                         **plan))) for e in range(encoder_ranks)]
        colocated = [copied(list(PackStream(server.target, job="plain", rank=r, **plan))) for r in range(dp)]
    return split, colocated


def run_disaggregated(tmp_path, steps: list, dp: int, control: bool = False, pp: int = 1,
                      schedule: str = "1f1b", recompute: bool = False) -> list[dict]:
    """One step on dp x pp LLM ranks and len(steps) - dp encoder ranks (`steps`: the replicas', then the encoder
    ranks'); every rank's result, by global rank."""
    torch.save(steps, tmp_path / "steps.pt")
    world = len(steps) + dp * (pp - 1)
    spawn(disaggregated_step, args=(world, dp, str(tmp_path / "init"), str(tmp_path / "steps.pt"),
                                    str(tmp_path), control, pp, schedule, recompute), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def step_with_most_images(split: list, dp: int) -> int:
    return max(range(len(split[0])), key=lambda k: sum(
        int(p.image_encoder.view(-1, 3).shape[0]) for r in range(dp) for p in split[r][k].packs))


@pytest.mark.parametrize("dp, encoder_ranks", [(2, 1), (3, 2)])
def test_encoder_ranks_train_like_colocated_encoding(tmp_path, small_tile_index, dp, encoder_ranks):
    split, colocated = served(str(small_tile_index), dp, encoder_ranks)
    position = step_with_most_images(split, dp)
    # the same samples in the step (how they fall to ranks may differ: the LLM packs balance on the LLM alone)
    assert sorted(k for r in range(dp) for k in split[r][position].sample_keys) == \
        sorted(k for r in range(dp) for k in colocated[r][position].sample_keys)
    expected_loss, expected_grads = reference([colocated[r][position] for r in range(dp)])
    results = run_disaggregated(tmp_path, [steps[position] for steps in split], dp)
    assert sum(sum(r["losses"]) for r in results[:dp]) == pytest.approx(expected_loss, rel=1e-5)
    assert not any(r["losses"] for r in results[dp:])  # encoder ranks hold no loss
    llm, encoder = results[0]["grads"], results[dp]["grads"]
    assert not llm.keys() & encoder.keys() and llm.keys() | encoder.keys() == expected_grads.keys()
    for side in (results[:dp], results[dp:]):  # every rank of a side holds its side's averaged gradients
        for result in side:
            for name, got in result["grads"].items():
                torch.testing.assert_close(got, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert all(r["stats"]["all_to_all_bytes"] > 0 for r in results[dp:])


@pytest.mark.parametrize("dp, pp, encoder_ranks, schedule, recompute",
                         [(1, 2, 1, "1f1b", False), (2, 2, 1, "gpipe", True)])
def test_encoder_ranks_feed_a_pipelined_llm_like_colocated_encoding(tmp_path, small_tile_index, dp, pp,
                                                                     encoder_ranks, schedule, recompute):
    """The LLM in pp stages beside the encoder ranks: the first stages take each microbatch's features from the
    encoder ranks in their schedule's order; the loss (on the last stages) and every gradient (each stage's
    layers, the encoder's) equal one process over the colocated packs, with every layer recomputed too."""
    split, colocated = served(str(small_tile_index), dp, encoder_ranks)
    position = step_with_most_images(split, dp)
    expected_loss, expected_grads = reference([colocated[r][position] for r in range(dp)])
    results = run_disaggregated(tmp_path, [steps[position] for steps in split], dp, pp=pp, schedule=schedule,
                                recompute=recompute)
    llm = results[:dp * pp]
    assert sum(sum(r["losses"]) for r in llm[pp - 1::pp]) == pytest.approx(expected_loss, rel=1e-5)
    last_stages = set(range(pp - 1, dp * pp, pp))
    assert not any(r["losses"] for k, r in enumerate(results) if k not in last_stages)  # the loss lives there
    stages = [results[s]["grads"] for s in range(pp)] + [results[dp * pp]["grads"]]  # replica 0's, encoder 0's
    names = [name for grads in stages for name in grads]
    assert sorted(names) == sorted(expected_grads) and all(stages)  # each layer on exactly one stage or side
    for rank, result in enumerate(results):  # every replica of a stage, every encoder rank: the same gradients
        for name, got in result["grads"].items():
            torch.testing.assert_close(got, expected_grads[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    assert all(r["stats"]["all_to_all_bytes"] > 0 for r in results[dp * pp:])
    assert all(r["stats"]["all_to_all_s"] > 0 for r in llm[::pp])  # the first stages took part in the exchanges


@pytest.mark.parametrize("pp", [1, 2])
def test_a_wrong_route_is_caught(tmp_path, small_tile_index, pp):
    split, colocated = served(str(small_tile_index), 2, 1)
    position = step_with_most_images(split, 2)
    _, expected_grads = reference([colocated[r][position] for r in range(2)])
    results = run_disaggregated(tmp_path, [steps[position] for steps in split], 2, control=True, pp=pp)
    assert any(not torch.allclose(results[0]["grads"][name], expected_grads[name], rtol=1e-4, atol=1e-6)
               for name in results[0]["grads"])  # the first stage's layers took the wrong images' features


TRAIN = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
    "data.microbatches=2", "data.server_workers=1", "parallel.pp=1", "parallel.dp=2", "recompute.mode=none",
    "optim.warmup_steps=3"]
ENCODER_RANK = ["parallel.encoder=disaggregated", "parallel.encoder_ranks=1"]


def test_packfeed_train_with_an_encoder_rank_trains_like_the_encoder_in_the_stages(tmp_path, small_tile_index):
    """The issue's command: `packfeed train --nproc 3 ... parallel.dp=2 parallel.pp=1
    parallel.encoder=disaggregated parallel.encoder_ranks=1` gives the losses and gradient norms of
    `packfeed train --nproc 2 ... parallel.encoder=stages` on the same data and seed."""
    common = TRAIN + [f"data.index={small_tile_index}", "optim.steps=3"]
    _, stages = packfeed_train(2, common + ["parallel.encoder=stages"], tmp_path / "stages")
    log, split = packfeed_train(3, common + ENCODER_RANK, tmp_path / "split")
    assert "the encoder on 1 rank(s) of its own" in log and len(split) == 3
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in stages], rel=1e-5)
    assert [r["grad_norm"] for r in split] == pytest.approx([r["grad_norm"] for r in stages], rel=1e-5)
    assert all(r["all_to_all_bytes"] > 0 for r in split)


def test_packfeed_train_with_an_encoder_rank_beside_a_pipelined_llm_trains_like_the_encoder_in_the_stages(
        tmp_path, small_tile_index):
    """`packfeed train --nproc 3 ... parallel.dp=1 parallel.pp=2 parallel.encoder=disaggregated
    parallel.encoder_ranks=1` (2 LLM stages, 1 encoder rank) gives the losses and gradient norms of `--nproc 2 ...
    parallel.pp=2 parallel.encoder=stages` on the same data and seed, and resumes from its checkpoint (which
    records the LLM's stages) exactly."""
    common = TRAIN + [f"data.index={small_tile_index}", "parallel.dp=1", "parallel.pp=2", "partition.mode=layers",
                      "optim.steps=3"]
    _, stages = packfeed_train(2, common + ["parallel.encoder=stages"], tmp_path / "stages")
    split_run = common + ENCODER_RANK + ["checkpoint.every=1"]
    log, first_two = packfeed_train(3, split_run + ["optim.steps=2"], tmp_path / "split")
    assert "the LLM on 2 (dp 1 x pp 2, stages [" in log
    log, split = packfeed_train(3, split_run, tmp_path / "split")  # the same out: resumes after step 2
    assert "resuming from" in log and len(split) == 3 and split[:2] == first_two
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in stages], rel=1e-5)
    assert [r["grad_norm"] for r in split] == pytest.approx([r["grad_norm"] for r in stages], rel=1e-5)
    assert all(r["all_to_all_bytes"] > 0 for r in split)


def test_encoder_ranks_auto_takes_the_split_packfeed_simulate_finds(tmp_path, small_tile_index):
    """`parallel.encoder_ranks=auto` with `--nproc 3`: the split the simulator's search finds on the run's own
    plans (each split planned as the run would open it), launched as dp + E processes."""
    from packfeed.trainer.config import load_config
    from packfeed.cli.encoder_split import searched_split

    overrides = TRAIN + [f"data.index={small_tile_index}", "optim.steps=1", "parallel.encoder=disaggregated",
                         "parallel.encoder_ranks=auto"]
    split = searched_split(load_config(None, overrides), 3)
    trials = split["search"]["trials"]
    assert split["encoder_ranks"] + split["dp"] == 3 and split["search"]["candidates"] == 2
    best = min(trials, key=lambda t: t["epoch_s"])
    assert (split["encoder_ranks"], split["dp"]) == (best["encoder_gpus"], best["llm_dp"])
    log, records = packfeed_train(3, overrides, tmp_path / "auto")
    assert f"{split['encoder_ranks']} encoder rank(s) + parallel.dp={split['dp']}" in log
    assert f"the encoder on {split['encoder_ranks']} rank(s) of its own" in log and len(records) == 1
    with pytest.raises(ValueError, match="give a number of processes or auto"):
        load_config(None, ["parallel.encoder=disaggregated", "parallel.encoder_ranks=many"])
    # pipelined: only splits that leave whole pipelines, E + dp x pp = G
    pipelined = load_config(None, [o for o in overrides if not o.startswith("parallel.pp")] + ["parallel.pp=2"])
    split = searched_split(pipelined, 5)
    assert split["search"]["candidates"] == 2 and split["encoder_ranks"] + 2 * split["dp"] == 5
    assert {(t["encoder_gpus"], t["llm_dp"]) for t in split["search"]["trials"]} <= {(1, 2), (3, 1)}
    with pytest.raises(ValueError, match="no split leaves the LLM whole pipelines"):
        searched_split(load_config(None, [o for o in overrides if not o.startswith("parallel.pp")] +
                                   ["parallel.pp=4"]), 4)


def worker_pids(parent: int, rank: int) -> list[int]:
    """The processes below `parent` that torchrun started as global rank `rank` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            ancestor = int(entry)
            while ancestor not in (0, 1, parent):
                ancestor = int(open(f"/proc/{ancestor}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ancestor == parent and f"RANK={rank}".encode() in environ:
            found.append(int(entry))
    return found


def encoder_rank_after_two_steps(run: subprocess.Popen, out: Path) -> int:
    """The pid of a 3-process run's encoder rank (global rank 2), once the run has logged two steps."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    victims = worker_pids(run.pid, 2)
    assert run.poll() is None and len(victims) == 1, "the run ended, or its encoder rank was not found"
    return victims[0]


def test_a_killed_encoder_rank_fails_the_run_loudly_and_it_resumes_exactly(tmp_path, small_tile_index):
    common = TRAIN + [f"data.index={small_tile_index}", "data.epochs=30", "checkpoint.every=1"] + ENCODER_RANK
    _, straight = packfeed_train(3, common + ["optim.steps=6"], tmp_path / "straight")
    killed = tmp_path / "killed"
    run = subprocess.Popen([sys.executable, "-m", "packfeed.cli", "train", "--nproc", "3", *common,
                            "optim.steps=200", f"out={killed}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        os.kill(encoder_rank_after_two_steps(run, killed), signal.SIGKILL)
        _, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0 and "(exitcode: -9) local_rank: 2" in stderr, stderr[-3000:]
    done = len((killed / "metrics.jsonl").read_text().splitlines())
    saved = int((killed / "checkpoints" / "latest").read_text().removeprefix("step-"))
    # a step's checkpoint is written before its metrics line (Loop.run): the kill may fall between the two
    assert 2 <= saved <= done + 1 and done < 200
    restart_from(killed, tmp_path / "resumed", saved)  # the killed run's own checkpoint, its later lines dropped
    log, resumed = packfeed_train(3, common + [f"optim.steps={saved + 2}"], tmp_path / "resumed")
    assert "resuming from" in log
    # the killed run's lines, then the resumed steps after its checkpoint (when the kill fell between checkpoint
    # `saved` and its line, that step has no line: its checkpoint is where the run goes on from)
    expected = [r for k, r in enumerate(straight[:saved + 2]) if k < done or k >= saved]
    assert len(resumed) == len(expected) == done + 2
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in expected], rel=1e-6)
    assert [(r["epoch"], r["step"]) for r in resumed] == [(r["epoch"], r["step"]) for r in expected]


NAMED = re.compile(r"Not responding: [^\n]*rank 2 \(encoder rank 0\)[^\n]*\n")


def test_a_stopped_encoder_rank_fails_the_run_within_the_timeout_naming_it(tmp_path, small_tile_index):
    """SIGSTOP leaves a process alive and silent (a hung kernel, a paused container): the LLM ranks' next
    exchange with it times out after parallel.timeout_s, and the run fails naming the encoder rank."""
    timeout_s = 15
    out = tmp_path / "stopped"
    common = TRAIN + [f"data.index={small_tile_index}", "data.epochs=30"] + ENCODER_RANK
    run = subprocess.Popen([sys.executable, "-m", "packfeed.cli", "train", "--nproc", "3", *common,
                            "optim.steps=200", f"parallel.timeout_s={timeout_s}", f"out={out}"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read() -> None:  # as it comes: the run is judged by what it says while the stopped rank still holds it
        for line in run.stderr:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victims = []
    try:
        victims.append(encoder_rank_after_two_steps(run, out))
        os.kill(victims[0], signal.SIGSTOP)
        stopped = time.monotonic()
        deadline = stopped + timeout_s + 240
        while run.poll() is None and time.monotonic() < deadline and not NAMED.search("".join(lines)):
            time.sleep(0.2)
        waited = time.monotonic() - stopped
        # named: the launcher would now wait 30 s for the stopped process to take its SIGTERM; it is killed instead
        # (unless the launcher's own kill got there first)
        try:
            os.kill(victims[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.wait(timeout=120)
        reader.join(timeout=60)
        stderr = "".join(lines)
    finally:
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    # the encoder rank is named; under load an LLM rank whose own collective has not timed out yet may be too
    assert NAMED.search(stderr), stderr[-3000:]
    assert f"parallel.timeout_s = {timeout_s}" in stderr
    assert waited < timeout_s + 240
