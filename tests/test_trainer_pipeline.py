"""The reference trainer's pipeline against single-process training on the same packs (real torch.distributed,
gloo on CPU, packs received over real gRPC)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from spawned import spawn
from doc_commands import quoted_train
from packfeed.trainer.models.reference_inputs import microbatches_of
from packfeed.trainer.models.reference import VLMConfig, build_layers, run_layers
from packfeed.trainer.models import ReferenceModel
from trainer_workers import SMALL_MODEL, bubble_step, packfeed_train, pipeline_step


def reference(steps) -> tuple[float, dict[str, torch.Tensor]]:
    """Global-step loss and gradients in one process: every rank's microbatches, summed token losses / the
    global step's loss tokens."""
    model = VLMConfig(**SMALL_MODEL)
    layers = build_layers(model)
    total = 0.0
    for step in steps:
        batch = microbatches_of(step, model)
        chunks = [a.tensor_split(len(step.packs)) for a in batch.args]
        for m in range(len(step.packs)):
            (loss_sum,) = run_layers(layers, tuple(c[m] for c in chunks))
            loss = loss_sum.sum() / batch.shape.step_loss_tokens
            loss.backward()
            total += float(loss.detach())
    grads = {f"{i}.{name}": p.grad for i, layer in enumerate(layers) for name, p in layer.named_parameters()
             if p.grad is not None}
    return total, grads


def run_pipeline(tmp_path, steps, dp: int, pp: int, bounds: list[int], schedule: str = "1f1b",
                 recompute: bool = False, precision: str = "fp32") -> list[dict]:
    steps_file = tmp_path / "steps.pt"
    torch.save(steps, steps_file)
    world = dp * pp
    spawn(pipeline_step, args=(world, dp, pp, str(tmp_path / "init"), str(steps_file), str(tmp_path), bounds,
                               schedule, recompute, precision), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def assert_matches(results, dp: int, pp: int, expected_loss: float, expected_grads: dict[str, torch.Tensor]):
    last_stage = [results[replica * pp + pp - 1] for replica in range(dp)]
    loss = sum(sum(r["losses"]) for r in last_stage)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for replica in range(dp):
        grads = {}
        for stage in range(pp):
            grads.update(results[replica * pp + stage]["grads"])
        assert grads.keys() == expected_grads.keys()
        for name, expected in expected_grads.items():
            torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, recompute", [("1f1b", False), ("gpipe", True)])
def test_two_stage_pipeline_matches_single_process(tmp_path, served_steps, schedule, recompute):
    step = served_steps[0][1]
    expected_loss, expected_grads = reference([step])
    n_layers = VLMConfig(**SMALL_MODEL).n_layers
    results = run_pipeline(tmp_path, [step], dp=1, pp=2, bounds=[0, 5, n_layers], schedule=schedule,
                           recompute=recompute)
    # one replica holds half the global step: its share of the loss, and its share of the gradient
    assert_matches(results, 1, 2, expected_loss, expected_grads)


@pytest.mark.slow
def test_bf16_autocast_pipeline_tracks_fp32(tmp_path, served_steps):
    """bf16 autocast with bf16 activations crossing the stage boundary: the same loss and gradient direction
    as fp32 single-process training, within bf16's precision."""
    step = served_steps[0][1]
    expected_loss, expected_grads = reference([step])
    n_layers = VLMConfig(**SMALL_MODEL).n_layers
    results = run_pipeline(tmp_path, [step], dp=1, pp=2, bounds=[0, 3, n_layers], precision="bf16")
    assert sum(results[1]["losses"]) == pytest.approx(expected_loss, rel=2e-2)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert grads.keys() == expected_grads.keys()
    ours = torch.cat([grads[name].float().flatten() for name in expected_grads])
    theirs = torch.cat([g.flatten() for g in expected_grads.values()])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    assert float(ours.norm() / theirs.norm()) == pytest.approx(1.0, abs=0.05)


@pytest.mark.slow
def test_data_parallel_pipelines_match_the_global_batch(tmp_path, served_steps):
    """DP 2 x PP 2: DDP averages over replicas, the loss scaling undoes it, and the result is the gradient of
    the whole global step's mean token loss — what one process gets from all 4 packs."""
    steps = [served_steps[0][2], served_steps[1][2]]
    assert steps[0].step_loss_tokens == steps[1].step_loss_tokens
    expected_loss, expected_grads = reference(steps)
    n_layers = VLMConfig(**SMALL_MODEL).n_layers
    results = run_pipeline(tmp_path, steps, dp=2, pp=2, bounds=[0, 6, n_layers])
    assert_matches(results, 2, 2, expected_loss, expected_grads)


@pytest.mark.slow
def test_server_and_trainer_run_end_to_end_and_reuse_their_decisions(tmp_path, small_tile_index):
    """docs/training.md's `packfeed train` line (torchrun, 2 stages, gloo, an embedded server) for 3 steps of a
    smaller model: the partition search and adaptive recompute run once, then a restart reuses both decisions
    from disk and trains exactly as the first run did (its trials changed nothing)."""
    import json

    nproc, quoted = quoted_train("tests/test_trainer_pipeline.py")
    assert nproc == 2 and "parallel.pp=2" in quoted
    out = tmp_path / "run"
    overrides = quoted + [f"data.index={small_tile_index}", "data.server_workers=1", "optim.steps=3",
                          "partition.top_k=2", "partition.trial_steps=1", "recompute.budget_mb=40"]
    overrides += [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
    first_log, records = packfeed_train(nproc, overrides, out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0 < r["loss"] < 20 and r["tokens"] > 0 and r["step_s"] > 0 for r in records)
    dataset = small_tile_index.parent.name  # what an embedded server calls an index's dataset
    assert all(list(r["samples_by_dataset"]) == [dataset] and r["samples_by_dataset"][dataset] > 0 for r in records)
    assert "cost model measured on this hardware written to" in first_log
    partition = json.loads((out / "partition.json").read_text())
    assert len(partition["candidates"]) >= 2 and all(c["measured_s"] for c in partition["candidates"][:2])
    recompute = [json.loads((out / f"recompute-stage{s}.json").read_text()) for s in range(2)]
    for decision in recompute:
        verified = [v for k, v in decision["measured"].items() if k.startswith("verify")]
        assert decision["fits"] == (verified[-1] <= decision["budget_bytes"])
    assert "partition search" in first_log

    second_log, both = packfeed_train(2, overrides, out)  # metrics.jsonl is appended: 3 lines, then 3 more
    assert f"partition {partition['bounds']} reused" in second_log
    assert "partition search" not in second_log
    # the first run's trials left weights, optimizer and stream as they were: it trained as the second, which ran
    # no trial
    again = both[len(records):]
    assert [(r["epoch"], r["step"]) for r in again] == [(r["epoch"], r["step"]) for r in records]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in records], rel=1e-6)

    # the cluster simulator predicts every measured step from what the run wrote (per-layer costs included)
    costs = json.loads((out / "cost_model.json").read_text())
    assert len(costs["layers"]) == VLMConfig(**SMALL_MODEL).n_layers
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--run", str(out), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)
    assert len(check["steps"]) == 5 and check["overhead_factor"] > 0 and check["cores"] == os.cpu_count()
    assert all(s["predicted_s"] > 0 and s["measured_s"] > 0 for s in check["steps"])
    assert np.isfinite(check["mean_abs_error"]) and "mean absolute error" in done.stderr


@pytest.mark.slow
def test_a_checkpoint_taken_at_dp4_restarts_the_trainer_at_dp2(tmp_path, small_tile_index):
    """Elastic resume in the reference trainer: 4 ranks train a step and checkpoint; 2 ranks restart from it,
    open a job that re-plans the rest of the epoch for DP 2 from the four saved stream positions, and train on."""
    overrides = [f"data.index={small_tile_index}", "data.microbatches=2", "data.server_workers=1",
                 "partition.mode=layers", "recompute.mode=none", "checkpoint.every=1", "optim.warmup_steps=1",
                 "data.epochs=3"] + [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
    out = tmp_path / "elastic"
    _, first = packfeed_train(4, overrides + ["optim.steps=1", "parallel.dp=4", "parallel.pp=1"], out, timeout=900)
    saved = sorted((out / "checkpoints" / "step-000001").glob("stream-rank*.json"))
    assert len(saved) == 4
    stopped_in = json.loads(saved[0].read_text())["next"][0]  # the epoch the old job stopped in
    log, records = packfeed_train(2, overrides + ["optim.steps=3", "parallel.dp=2", "parallel.pp=1"], out, timeout=900)
    assert "elastic resume" in log and "after 1 steps" in log
    resumed = records[len(first):]
    assert len(resumed) == 2 and (resumed[0]["epoch"], resumed[0]["step"]) == (stopped_in, 0)
    assert all(r["loss"] > 0 for r in resumed)
    assert (out / "checkpoints" / "latest").read_text() == "step-000003"
    assert len(list((out / "checkpoints" / "step-000003").glob("stream-rank*.json"))) == 2


def run_bubbles(tmp_path, steps, dp: int, pp: int, schedule: str = "1f1b", control: bool = False) -> list[dict]:
    steps_file = tmp_path / "steps.pt"
    torch.save(steps, steps_file)
    world = dp * pp
    spawn(bubble_step, args=(world, dp, pp, str(tmp_path / "init"), str(steps_file), str(tmp_path), schedule,
                             control), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("dp, pp, schedule", [(1, 2, "1f1b"), (1, 4, "gpipe"), (2, 2, "1f1b")])
def test_encoder_in_the_bubbles_trains_like_the_encoder_in_the_stages(tmp_path, served_steps, dp, pp, schedule):
    """parallel.encoder=bubbles: every rank encodes its share of the tiles in its idle time; the loss and every
    gradient (the encoder's summed over the ranks' shares) equal one process training on the same packs, as
    parallel.encoder=stages does (the tests above)."""
    steps = [served_steps[r][0] for r in range(dp)]
    expected_loss, expected_grads = reference(steps)
    results = run_bubbles(tmp_path, steps, dp, pp, schedule)
    assert_matches(results, dp, pp, expected_loss, expected_grads)
    encoder_layers = ReferenceModel(VLMConfig(**SMALL_MODEL)).vision.encoder_layers
    for rank, result in enumerate(results):  # every rank holds the same, whole encoder gradient
        encoder = {k: v for k, v in result["grads"].items() if int(k.split(".")[0]) < encoder_layers}
        assert encoder.keys() == {k for k in expected_grads if int(k.split(".")[0]) < encoder_layers}
        for name, grad in encoder.items():
            torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.slow
def test_a_misplaced_feature_in_the_bubbles_is_caught(tmp_path, served_steps):
    """The control: features put one tile off at the first stage change the loss and the gradients."""
    step = served_steps[0][0]
    expected_loss, expected_grads = reference([step])
    results = run_bubbles(tmp_path, [step], 1, 2, control=True)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert sum(results[1]["losses"]) != pytest.approx(expected_loss, rel=1e-5)
    assert any(not torch.allclose(grads[name], expected, rtol=1e-4, atol=1e-6)
               for name, expected in expected_grads.items())


@pytest.mark.slow
def test_packfeed_train_with_the_encoder_in_the_bubbles_resumes_and_trains_like_stages(tmp_path, small_tile_index):
    """`packfeed train parallel.encoder=bubbles`: 2 steps, a checkpoint and a restart for a third give the steps,
    losses and gradient norms of 3 uninterrupted steps with the encoder in the stages (weights, AdamW, the LR
    warm-up and the stream position restored)."""
    overrides = [f"data.index={small_tile_index}", "data.microbatches=2", "data.server_workers=1",
                 "partition.mode=layers", "recompute.mode=none", "checkpoint.every=2",
                 "optim.warmup_steps=3"] + [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
    _, stages = packfeed_train(2, overrides + ["optim.steps=3"], tmp_path / "stages")
    bubbles = overrides + ["parallel.encoder=bubbles"]
    packfeed_train(2, bubbles + ["optim.steps=2"], tmp_path / "bubbles")
    log, resumed = packfeed_train(2, bubbles + ["optim.steps=3"], tmp_path / "bubbles")
    assert "resuming from" in log and "after 2 steps" in log and "in the bubbles" in log
    assert [(r["epoch"], r["step"]) for r in resumed] == [(r["epoch"], r["step"]) for r in stages]
    assert (tmp_path / "bubbles" / "checkpoints" / "latest").read_text() == "step-000002"
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in stages], rel=1e-5)
    assert [r["grad_norm"] for r in resumed] == pytest.approx([r["grad_norm"] for r in stages], rel=1e-5)
    assert all(r["encoder_s"] > 0 for r in resumed[2:])
