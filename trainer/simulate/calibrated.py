"""Layer costs calibrated from the trainer's measurements: every layer's forward and backward time is fitted,
over profiled microbatches of varied size, as c0 + c1 * n + c2 * q — for vision layers n = tiles (each tile has
the same number of patches) and q = 0; for text layers n = tokens and q = the sum of squared sample lengths
(per-sample attention). The fit becomes the planner's cost model and, per layer, what `packfeed simulate`
simulates a trainer's model with (OUT/cost_model.json)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from packfeed.trainer.models.layer_model import Features
from packfeed.trainer.parallel.profile import LayerProfile

VISION_KINDS = ("vision_embed", "vit", "projector")


@dataclass
class LayerCost:
    kind: str
    forward: tuple[float, float, float]
    backward: tuple[float, float, float]

    def _row(self, f: Features) -> np.ndarray:
        if self.kind in VISION_KINDS:
            return np.array([1.0, f.tiles, 0.0])
        return np.array([1.0, f.tokens, f.square])

    def times(self, f: Features) -> tuple[float, float]:
        row = self._row(f)
        return float(row @ np.array(self.forward)), float(row @ np.array(self.backward))


def _fit(rows: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """Least squares with non-negative coefficients (a negative per-token cost is noise, not physics):
    drop any negative term and refit."""
    active = [i for i in range(rows.shape[1]) if rows[:, i].any()]
    while True:
        coefficients = np.zeros(rows.shape[1])
        solution, *_ = np.linalg.lstsq(rows[:, active], seconds, rcond=None)
        coefficients[active] = solution
        negative = [i for i in active if coefficients[i] < 0]
        if not negative:
            return tuple(float(c) for c in coefficients)
        active = [i for i in active if i not in negative] or [0]


def fit_layer_costs(profile: Sequence[LayerProfile], features: Sequence[Features]) -> list[LayerCost]:
    """`features[k]` describes the k-th timed microbatch of the profile (in profiling order)."""
    costs = []
    for layer in profile:
        if len(layer.per_microbatch) != len(features):
            raise ValueError("one Features per profiled microbatch is needed to fit costs")
        template = LayerCost(layer.kind, (0, 0, 0), (0, 0, 0))
        rows = np.stack([template._row(f) for f in features])
        times = np.array(layer.per_microbatch)
        costs.append(LayerCost(layer.kind, _fit(rows, times[:, 0]), _fit(rows, times[:, 1])))
    return costs


def planner_cost_model(costs: Sequence[LayerCost], patches_per_tile: int) -> dict[str, float]:
    """The measured costs as the loader's per-sample cost model (seconds, forward + backward): vision cost per
    ViT patch (tiles have a fixed size, so per-tile attention is part of the per-patch cost), LLM cost per
    token and per squared sample length. Pass it to PackStream(cost_model=...) / `packfeed plan --cost-model`."""
    per_tile = sum(c.forward[1] + c.backward[1] for c in costs if c.kind in VISION_KINDS)
    per_token = sum(c.forward[1] + c.backward[1] for c in costs if c.kind not in VISION_KINDS)
    per_square = sum(c.forward[2] + c.backward[2] for c in costs if c.kind not in VISION_KINDS)
    return {"vision_linear": per_tile / patches_per_tile, "vision_quadratic": 0.0, "llm_linear": per_token,
            "llm_quadratic": per_square}
