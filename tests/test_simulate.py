"""The pipeline simulator: closed-form cases, imbalance, the trainer's padding rule, and cost fitting."""

from __future__ import annotations

import numpy as np
import pytest
from packfeed.trainer.parallel.profile import LayerProfile
from packfeed.trainer.simulate.calibrated import (
    Features,
    fit_layer_costs,
    padded_features,
    schedule_order,
    simulate_pipeline,
    simulate_step,
    stage_times,
)


@pytest.mark.parametrize("stages, m", [(2, 2), (4, 8), (3, 1), (4, 16)])
def test_uniform_1f1b_matches_the_closed_form(stages, m):
    forward, backward = np.full((stages, m), 1.0), np.full((stages, m), 2.0)
    result = simulate_pipeline(forward, backward)
    assert result.step_s == pytest.approx((m + stages - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))


def test_1f1b_order_runs_every_microbatch_once_with_bounded_warmup():
    for stage in range(4):
        order = schedule_order(stage, 4, 8)
        assert sorted(order) == sorted([("F", j) for j in range(8)] + [("B", j) for j in range(8)])
        in_flight = peak = 0
        for op, _ in order:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - stage  # what makes 1F1B's memory lower than GPipe's (8 in flight)


def test_an_unbalanced_microbatch_costs_more_than_its_share():
    even = np.full((4, 8), 1.0)
    skewed = even.copy()
    skewed[:, 3] = 3.0  # same total work as 2 extra microbatches, all in one
    assert simulate_pipeline(skewed, 2 * skewed).step_s > simulate_pipeline(even, 2 * even).step_s + 2 * 3.0


def test_the_slowest_replica_sets_the_step():
    costs = fit_layer_costs([LayerProfile("llm", 0, 0, 0, 0, 0, 0, [(1e-3 * n, 2e-3 * n) for n in (1, 2, 3)])],
                            [Features(1, n * 100, 0.0) for n in (1, 2, 3)])
    small, large = [Features(1, 100, 0.0)] * 2, [Features(1, 300, 0.0)] * 2
    both = simulate_step(costs, [0, 1], [small, large])
    alone = simulate_step(costs, [0, 1], [large])
    assert both.step_s == pytest.approx(alone.step_s)


def test_fit_recovers_linear_and_quadratic_terms():
    rng = np.random.default_rng(0)
    features = [Features(int(t), int(n), float(q)) for t, n, q in
                zip(rng.integers(1, 16, 30), rng.integers(100, 5000, 30), rng.uniform(1e4, 1e7, 30))]
    truth = (0.002, 3e-6, 4e-10)
    times = [(truth[0] + truth[1] * f.tokens + truth[2] * f.square, 0.0) for f in features]
    (cost,) = fit_layer_costs([LayerProfile("llm", 0, 0, 0, 0, 0, 0, times)], features)
    assert cost.forward == pytest.approx(truth, rel=1e-6)
    vision_times = [(0.001 + 0.01 * f.tiles, 0.0) for f in features]
    (vision,) = fit_layer_costs([LayerProfile("vit", 0, 0, 0, 0, 0, 0, vision_times)], features)
    assert vision.forward[:2] == pytest.approx((0.001, 0.01), rel=1e-6) and vision.forward[2] == 0


def test_padding_follows_the_trainer():
    features = padded_features([(3, [100, 50]), (5, [10])], token_multiple=64)
    assert [(f.tiles, f.tokens) for f in features] == [(5, 192), (5, 192)]
    assert features[0].square == 100 ** 2 + 50 ** 2 + 42 ** 2
    assert features[1].square == 10 ** 2 + 182 ** 2


def test_stage_times_sum_their_layers():
    profile = [LayerProfile(kind, 0, 0, 0, 0, 0, 0, [(s, 2 * s)]) for kind, s in
               (("vit", 1.0), ("vit", 1.0), ("llm", 4.0))]
    costs = fit_layer_costs(profile, [Features(1, 10, 0.0)])
    forward, backward = stage_times(costs, [0, 2, 3], [Features(1, 10, 0.0)])
    assert forward[:, 0].tolist() == pytest.approx([2.0, 4.0]) and backward[:, 0].tolist() == pytest.approx([4.0, 8.0])
