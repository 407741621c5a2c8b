"""parallel.encoder=phases (`packfeed.trainer.parallel.phases`): each DP rank encodes the images the plan routes
to it and an all-to-all hands every output to its consumer; the loss and every gradient equal colocated encoding
on the same packs (one process over every rank's colocated packs), at DP 2 and DP 4 on gloo; a wrong route
differs; `packfeed train` runs it end to end against the same plan served colocated."""

from __future__ import annotations

import pytest
import torch
from spawned import spawn
from test_trainer_pipeline import assert_matches, reference
from trainer_workers import SMALL_MODEL, packfeed_train, phase_step

pytestmark = pytest.mark.slow


def run_phases(tmp_path, steps, control: bool = False) -> list[dict]:
    torch.save(steps, tmp_path / "steps.pt")
    world = len(steps)
    spawn(phase_step, args=(world, str(tmp_path / "init"), str(tmp_path / "steps.pt"), str(tmp_path), control),
          nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("dp", [2, 4])
def test_the_all_to_all_trains_like_colocated_encoding(tmp_path, routed_steps, dp):
    routed, colocated = routed_steps(dp), routed_steps(dp, colocate=True)
    position = max(range(len(routed[0])), key=lambda k: sum(  # the step that routes the most images elsewhere
        int((p.image_encoder.view(-1, 3)[:, 0] != r).sum()) for r in range(dp) for p in routed[r][k].packs))
    expected_loss, expected_grads = reference([colocated[r][position] for r in range(dp)])
    results = run_phases(tmp_path, [routed[r][position] for r in range(dp)])
    assert_matches(results, dp, 1, expected_loss, expected_grads)
    assert sum(r["stats"]["all_to_all_bytes"] for r in results) > 0


def test_a_wrong_route_is_caught(tmp_path, routed_steps):
    routed, colocated = routed_steps(2), routed_steps(2, colocate=True)
    expected_loss, expected_grads = reference([colocated[r][0] for r in range(2)])
    results = run_phases(tmp_path, [routed[r][0] for r in range(2)], control=True)
    assert sum(sum(r["losses"]) for r in results) != pytest.approx(expected_loss, rel=1e-5)
    assert any(not torch.allclose(results[0]["grads"][name], expected, rtol=1e-4, atol=1e-6)
               for name, expected in expected_grads.items())


def test_packfeed_train_routes_the_encoder_and_trains_like_colocated(tmp_path, small_tile_index):
    """`packfeed train data.strategy=isf+phases parallel.encoder=phases` at DP 2: 3 steps give the losses and
    gradient norms of 3 steps on the same plan encoded colocated (parallel.encoder=stages opens it with
    colocate_encoder)."""
    overrides = [f"data.index={small_tile_index}", "data.microbatches=2", "data.server_workers=1",
                 "data.strategy=isf+phases", "parallel.pp=1", "parallel.dp=2", "recompute.mode=none",
                 "optim.warmup_steps=3", "optim.steps=3"] + [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
    _, colocated = packfeed_train(2, overrides, tmp_path / "colocated")
    log, routed = packfeed_train(2, overrides + ["parallel.encoder=phases"], tmp_path / "phases")
    assert "all-to-all" in log and len(routed) == 3
    assert [r["loss"] for r in routed] == pytest.approx([r["loss"] for r in colocated], rel=1e-5)
    assert [r["grad_norm"] for r in routed] == pytest.approx([r["grad_norm"] for r in colocated], rel=1e-5)
    assert all(r["all_to_all_bytes"] > 0 for r in routed) and not any("all_to_all_bytes" in r for r in colocated)
