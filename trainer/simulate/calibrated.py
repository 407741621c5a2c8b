"""A pipeline simulator (DP x PP, 1F1B or GPipe) calibrated from measured layer costs.

Calibration: every layer's forward and backward time is fitted, over profiled microbatches of varied size,
as c0 + c1 * n + c2 * q — for vision layers n = tiles (each tile has the same number of patches) and
q = 0; for text layers n = tokens and q = the sum of squared sample lengths (per-sample attention). The
microbatch a stage runs is padded the way the trainer pads it (packfeed.trainer.batch), so padding costs
what it costs in training.

Simulation: each stage runs its operations in schedule order; a forward needs the previous stage's forward
of that microbatch, a backward the next stage's backward; the step ends when the slowest replica's first
stage finishes its last backward. Bubble fraction = 1 - busy time / (stages x step time). Communication and
the DP all-reduce are not modelled (they are the same for every data strategy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from packfeed.trainer.batch import round_up
from packfeed.trainer.parallel.profile import LayerProfile

VISION_KINDS = ("vision_embed", "vit", "projector")


@dataclass(frozen=True)
class Features:
    """What a (padded) microbatch costs depend on."""

    tiles: int
    tokens: int
    square: float  # sum of squared sample lengths, the padding tail counted as one more sample


def features_of_carrier(carrier) -> Features:
    """Features of a first-stage carrier (pixels, input_ids, position_ids, cu_seqlens, ...)."""
    pixels, input_ids, _, cu_seqlens = carrier[:4]
    bounds = cu_seqlens.long().tolist()
    lengths = np.diff(bounds + [input_ids.numel()])
    return Features(int(pixels.shape[0]), int(input_ids.numel()), float((lengths.astype(np.float64) ** 2).sum()))


def padded_features(packs: Sequence[tuple[int, Sequence[int]]], token_multiple: int = 64) -> list[Features]:
    """The trainer's padding for one replica's step: packs given as (tiles, sample token lengths) are padded
    to the step's most tiles and most tokens (rounded up)."""
    tiles = max([t for t, _ in packs] + [1])
    tokens = round_up(max([int(sum(lengths)) for _, lengths in packs] + [1]), token_multiple)
    out = []
    for _, lengths in packs:
        real = np.asarray(lengths, dtype=np.float64)
        tail = tokens - real.sum()
        out.append(Features(tiles, tokens, float((real ** 2).sum() + tail ** 2)))
    return out


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


def stage_times(costs: Sequence[LayerCost], bounds: Sequence[int], microbatches: Sequence[Features]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(stages, M) forward and backward seconds."""
    stages, m = len(bounds) - 1, len(microbatches)
    forward, backward = np.zeros((stages, m)), np.zeros((stages, m))
    for s in range(stages):
        for j, f in enumerate(microbatches):
            for cost in costs[bounds[s]:bounds[s + 1]]:
                fw, bw = cost.times(f)
                forward[s, j] += fw
                backward[s, j] += bw
    return forward, backward


def schedule_order(stage: int, stages: int, m: int, schedule: str = "1f1b") -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warmup = min(stages - stage - 1, m)
    order = [("F", j) for j in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        if forward < m:
            order.append(("F", forward))
            forward += 1
        order.append(("B", backward))
        backward += 1
    return order


@dataclass
class Simulated:
    step_s: float
    busy_s: float
    stages: int

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_s / (self.stages * self.step_s) if self.step_s else 0.0


def simulate_pipeline(forward: np.ndarray, backward: np.ndarray, schedule: str = "1f1b") -> Simulated:
    """Step time of one replica: stages run their operations in order as soon as dependencies allow."""
    stages, m = forward.shape
    orders = [schedule_order(s, stages, m, schedule) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    position, clock = [0] * stages, [0.0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                op, j = orders[s][position[s]]
                need = ("F", s - 1, j) if op == "F" and s > 0 else \
                    ("B", s + 1, j) if op == "B" and s < stages - 1 else ("F", s, j) if op == "B" else None
                if need is not None and need not in done:
                    break
                start = max(clock[s], done.get(need, 0.0))
                clock[s] = start + (forward[s, j] if op == "F" else backward[s, j])
                done[(op, s, j)] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # cannot happen for 1F1B/GPipe orders
    return Simulated(max(clock), float(forward.sum() + backward.sum()), stages)


def simulate_step(costs: Sequence[LayerCost], bounds: Sequence[int], replicas: Sequence[Sequence[Features]],
                  schedule: str = "1f1b") -> Simulated:
    """A global step: every replica's pipeline; the step ends with the slowest (DP ranks wait for it)."""
    runs = [simulate_pipeline(*stage_times(costs, bounds, mbs), schedule) for mbs in replicas]
    slowest = max(r.step_s for r in runs)
    return Simulated(slowest, sum(r.busy_s for r in runs) / len(runs), len(bounds) - 1)


def planner_cost_model(costs: Sequence[LayerCost], patches_per_tile: int) -> dict[str, float]:
    """The measured costs as the loader's per-sample cost model (seconds, forward + backward): vision cost per
    ViT patch (tiles have a fixed size, so per-tile attention is part of the per-patch cost), LLM cost per
    token and per squared sample length. Pass it to PackStream(cost_model=...) / `packfeed plan --cost-model`."""
    per_tile = sum(c.forward[1] + c.backward[1] for c in costs if c.kind in VISION_KINDS)
    per_token = sum(c.forward[1] + c.backward[1] for c in costs if c.kind not in VISION_KINDS)
    per_square = sum(c.forward[2] + c.backward[2] for c in costs if c.kind not in VISION_KINDS)
    return {"vision_linear": per_tile / patches_per_tile, "vision_quadratic": 0.0, "llm_linear": per_token,
            "llm_quadratic": per_square}
