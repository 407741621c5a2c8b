"""How the simulator cuts a pipeline's layers into stages (`--partition`).

- `balanced`: contiguous stages whose slowest one is as fast as possible for the mean microbatch (what OmniBal's
  model balance and Optimus's "Megatron-LM balanced" baseline aim for).
- `params`: stages of equal parameter counts (OmniBal's baseline, Table 4 (1)).
- `layers`: stages of equal layer counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PARTITIONS: tuple[str, ...] = ("balanced", "params", "layers")


def min_max_bounds(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries of `parts` non-empty contiguous parts minimising the largest part's sum (bisection on the
    largest sum with the exact greedy feasibility test, then empty parts filled by splitting the largest)."""
    w = np.asarray(weights, dtype=np.float64)
    if parts > len(w):
        raise ValueError(f"{parts} pipeline stages need at least as many layers, not {len(w)}")
    low, high = float(w.max(initial=0.0)), float(w.sum())
    for _ in range(100):
        if high - low <= 1e-12 * max(high, 1e-300):
            break
        middle = (low + high) / 2
        if len(_greedy_cuts(w, middle)) + 1 <= parts:
            high = middle
        else:
            low = middle
    bounds = [0, *_greedy_cuts(w, high), len(w)]
    while len(bounds) - 1 < parts:  # split the heaviest splittable part: the largest sum does not grow
        sizes = [(w[a:b].sum(), k) for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b - a > 1]
        _, k = max(sizes)
        a, b = bounds[k], bounds[k + 1]
        cut = a + 1 + int(np.argmin(np.abs(np.cumsum(w[a:b - 1]) - w[a:b].sum() / 2)))
        bounds.insert(k + 1, cut)
    return bounds


def _greedy_cuts(w: np.ndarray, limit: float) -> list[int]:
    cuts, total = [], 0.0
    for i, x in enumerate(w):
        if total + x > limit * (1 + 1e-12) and total > 0:
            cuts.append(i)
            total = 0.0
        total += x
    return cuts


def partition_bounds(method: str, layer_seconds: np.ndarray, params: np.ndarray, parts: int) -> list[int]:
    """`layer_seconds`: each layer's forward + backward time for the mean microbatch."""
    if method == "balanced":
        return min_max_bounds(layer_seconds, parts)
    if method == "params":
        return min_max_bounds(params, parts)
    if method == "layers":
        return min_max_bounds(np.ones(len(params)), parts)
    raise ValueError(f"--partition must be one of {', '.join(PARTITIONS)}, not {method!r}")
