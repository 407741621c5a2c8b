"""Microbatch order for a 1F1B pipeline (MMScale Alg. 3) and a small 1F1B simulator.

A rank's M microbatches pass through P pipeline stages. With 1F1B, stage s runs P-s-1 warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards. The first stage sits
idle between its forward of microbatch k and the gradient of microbatch k-P+1 coming back: an *interval*.
Inter-microbatch reordering fills each interval with a forward of about its length:

- the smallest microbatch goes first, so every stage starts early;
- the P-1 smallest of the rest go last, where their intervals cannot be filled anyway;
- the first interval (before the first backward) gets P-1 microbatches whose summed forward time matches
  the critical path of the first microbatch; each later interval gets the single closest microbatch.

Intervals come from an incremental simulation of the schedule (the DP recurrence: an op starts when its
stage is free and its input has arrived), so reordering costs O(M (M + P)) per rank.
"""

from __future__ import annotations

import functools

import numpy as np

from packfeed.media.jit import kernel
from packfeed.v1.pipeline import one_f_one_b

FORWARD, BACKWARD = 0, 1


@functools.lru_cache(maxsize=64)
def stage_ops(p: int, l: int) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the kind (FORWARD/BACKWARD) and microbatch position of each operation of the contract's 1F1B
    order (`packfeed.v1.pipeline`), as arrays the compiled simulation walks. Read-only: they are cached."""
    kind = np.empty((p, 2 * l), dtype=np.int64)
    pos = np.empty((p, 2 * l), dtype=np.int64)
    for s in range(p):
        for k, (name, _, j) in enumerate(one_f_one_b(s, p, l)):
            kind[s, k], pos[s, k] = (FORWARD if name == "F" else BACKWARD), j
    kind.flags.writeable = pos.flags.writeable = False
    return kind, pos


@kernel(cache=True, nogil=True)
def _advance(f, b, order, kind, pos, end_f, end_b, stage_t, ptr):
    """Run every op whose microbatch is placed (order[pos] >= 0) and whose input is ready."""
    p = f.shape[1]
    n_ops = kind.shape[1]
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while ptr[s] < n_ops:
                j = pos[s, ptr[s]]
                mb = order[j]
                if mb < 0:
                    break
                if kind[s, ptr[s]] == FORWARD:
                    ready = 0.0 if s == 0 else end_f[j, s - 1]
                    if ready < 0:
                        break
                    end_f[j, s] = max(ready, stage_t[s]) + f[mb, s]
                    stage_t[s] = end_f[j, s]
                else:
                    ready = end_f[j, s] if s == p - 1 else end_b[j, s + 1]
                    if ready < 0:
                        break
                    end_b[j, s] = max(ready, stage_t[s]) + b[mb, s]
                    stage_t[s] = end_b[j, s]
                ptr[s] += 1
                progress = True


def simulate_1f1b(f: np.ndarray, b: np.ndarray, order: np.ndarray) -> float:
    """Makespan of one step: f[m, s] / b[m, s] are forward / backward times of microbatch m on stage s."""
    return _simulate_1f1b(f, b, order, *stage_ops(f.shape[1], f.shape[0]))


@kernel(cache=True, nogil=True)
def _simulate_1f1b(f, b, order, kind, pos):
    l, p = f.shape
    end_f = np.full((l, p), -1.0)
    end_b = np.full((l, p), -1.0)
    stage_t = np.zeros(p)
    ptr = np.zeros(p, dtype=np.int64)
    _advance(f, b, order, kind, pos, end_f, end_b, stage_t, ptr)
    return stage_t.max()


@kernel(cache=True, nogil=True)
def _closest_unused(f, used, target):
    """The unplaced microbatch whose first-stage forward time is closest to `target`."""
    best = -1
    best_gap = np.inf
    for m in range(f.shape[0]):
        if not used[m]:
            gap = abs(f[m, 0] - target)
            if gap < best_gap:
                best_gap = gap
                best = m
    return best


@kernel(cache=True, nogil=True)
def _inter_reorder(f, b, kind, pos):
    """Order of microbatches (indices into f) for 1F1B with f.shape[1] stages (`kind`, `pos`: `stage_ops`)."""
    l, p = f.shape
    size = np.zeros(l)
    for m in range(l):
        for s in range(p):
            size[m] += f[m, s]
    if p == 1 or l <= 2:
        return np.argsort(-size, kind="mergesort")

    by_size = np.argsort(size, kind="mergesort")
    order = np.full(l, -1, dtype=np.int64)
    used = np.zeros(l, dtype=np.bool_)
    order[0] = by_size[0]
    used[by_size[0]] = True
    # The P-1 smallest of the rest close the schedule, smallest last.
    n_rear = min(p - 1, l - 1)
    for r in range(n_rear):
        m = by_size[1 + r]
        order[l - 1 - r] = m
        used[m] = True
    n_middle = l - 1 - n_rear

    # First interval: the critical path of microbatch 0 through every stage and back to stage 1.
    first = order[0]
    interval = 0.0
    for s in range(1, p):
        interval += f[first, s] + b[first, s]
    n_first = min(p - 1, n_middle)
    for k in range(n_first):
        best = _closest_unused(f, used, interval / (n_first - k))
        order[1 + k] = best
        used[best] = True
        interval -= f[best, 0]

    end_f = np.full((l, p), -1.0)
    end_b = np.full((l, p), -1.0)
    stage_t = np.zeros(p)
    ptr = np.zeros(p, dtype=np.int64)
    for k in range(1 + n_first, 1 + n_middle):
        _advance(f, b, order, kind, pos, end_f, end_b, stage_t, ptr)
        returning = k - p + 1  # the backward that follows F(k) on stage 0
        arrival = end_b[returning, 1] if returning >= 0 else -1.0
        best = _closest_unused(f, used, arrival - stage_t[0] if arrival >= 0 else 0.0)
        order[k] = best
        used[best] = True
    return order


def inter_reorder_many(f: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The reordering for a batch of ranks: f, b are (ranks, microbatches, stages)."""
    return _inter_reorder_many(f, b, *stage_ops(f.shape[2], f.shape[1]))


@kernel(cache=True, nogil=True)
def _inter_reorder_many(f, b, kind, pos):
    out = np.empty((f.shape[0], f.shape[1]), dtype=np.int64)
    for r in range(f.shape[0]):
        out[r] = _inter_reorder(f[r], b[r], kind, pos)
    return out


def stage_fractions(mean_vision_cost: float, mean_llm_cost: float, stages: int) -> tuple[np.ndarray, np.ndarray]:
    """Share of the vision and LLM cost that each pipeline stage carries.

    Models a partition balanced for the average microbatch: vision layers come first, then LLM layers,
    and stage boundaries cut the average cumulative cost into equal parts. A microbatch heavier in
    vision than average then makes the early stages slower — the imbalance reordering works against.
    """
    total = mean_vision_cost + mean_llm_cost
    if total <= 0:
        return np.full(stages, 1.0 / stages), np.full(stages, 1.0 / stages)
    edges = np.linspace(0.0, total, stages + 1)
    lo, hi = edges[:-1], edges[1:]
    vision_part = np.clip(np.minimum(hi, mean_vision_cost) - lo, 0.0, None)
    llm_part = (hi - lo) - vision_part
    fv = vision_part / mean_vision_cost if mean_vision_cost > 0 else np.zeros(stages)
    fl = llm_part / mean_llm_cost if mean_llm_cost > 0 else np.zeros(stages)
    return fv, fl


def stage_times(vision_cost: np.ndarray, llm_cost: np.ndarray, fv: np.ndarray, fl: np.ndarray):
    """Forward and backward time per (microbatch, stage); backward costs twice the forward."""
    forward = np.outer(vision_cost, fv) + np.outer(llm_cost, fl)
    return forward, 2.0 * forward
