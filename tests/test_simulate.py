"""The trainer's layer-cost fit (packfeed.trainer.simulate.calibrated): linear and quadratic terms recovered."""

from __future__ import annotations

import numpy as np
import pytest
from packfeed.trainer.parallel.profile import LayerProfile
from packfeed.trainer.models.layer_model import Features
from packfeed.trainer.simulate.calibrated import fit_layer_costs


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
