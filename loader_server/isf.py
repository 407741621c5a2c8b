"""ISF — Iterative Sampling and Filtering (OmniBal Alg. 1), with stronger guarantees.

Sampling walks a seeded permutation and adds samples to the open group until the next one would exceed
the vision cap or the token cap (next-fit). Filtering keeps the groups that reach a target and returns
the rest to the pool. Unlike the published code, nothing is lost: samples still pooled after the last
iteration are packed with first-fit-decreasing (the fewest, fullest packs), and samples that alone
exceed a cap are handled by a stated policy and always reported.

Packs are returned in CSR form: `members[offsets[p]:offsets[p+1]]` are the sample ids of pack p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@dataclass(frozen=True)
class Caps:
    vision_cap: int
    token_cap: int
    vision_target: int
    token_target: int

    def __post_init__(self):
        if self.vision_cap < 1 or self.token_cap < 1:
            raise ValueError(f"caps must be positive, got vision_cap={self.vision_cap} token_cap={self.token_cap}")
        if self.vision_target > self.vision_cap or self.token_target > self.token_cap:
            raise ValueError(f"targets must not exceed caps: {self}")


@numba.njit(cache=True, nogil=True)
def next_fit_starts(vision, tokens, vision_cap, token_cap):
    """Positions where a new group starts when filling groups greedily in the given order."""
    n = len(vision)
    starts = np.empty(n, dtype=np.int64)
    n_groups = 0
    v = vision_cap + 1  # forces a new group at position 0
    t = 0
    for i in range(n):
        if v + vision[i] > vision_cap or t + tokens[i] > token_cap:
            starts[n_groups] = i
            n_groups += 1
            v = 0
            t = 0
        v += vision[i]
        t += tokens[i]
    return starts[:n_groups]


@numba.njit(cache=True, nogil=True)
def first_fit_decreasing(order, vision, tokens, vision_cap, token_cap):
    """Pack samples (given in decreasing size order) into the first open bin they fit; returns bin per sample.

    Quadratic in the number of bins in the worst case, which is fine: it only sees ISF's leftovers.
    """
    n = len(order)
    bin_of = np.empty(n, dtype=np.int64)
    bin_v = np.zeros(n, dtype=np.int64)
    bin_t = np.zeros(n, dtype=np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        chosen = -1
        for b in range(n_bins):
            if bin_v[b] + vision[i] <= vision_cap and bin_t[b] + tokens[i] <= token_cap:
                chosen = b
                break
        if chosen < 0:
            chosen = n_bins
            n_bins += 1
        bin_v[chosen] += vision[i]
        bin_t[chosen] += tokens[i]
        bin_of[k] = chosen
    return bin_of, n_bins


def isf(
    candidates: np.ndarray,
    vision: np.ndarray,
    tokens: np.ndarray,
    caps: Caps,
    iterations: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack every sample id in `candidates` exactly once; each must fit the caps on its own.

    Returns (members, offsets). Packs kept by filtering come first, in the order they were formed,
    then the first-fit-decreasing packs of the leftovers.
    """
    if iterations < 1:
        raise ValueError("ISF needs at least one iteration")
    if len(candidates) and (vision[candidates].max() > caps.vision_cap or tokens[candidates].max() > caps.token_cap):
        raise ValueError("ISF candidates must each fit the caps; route oversize samples through the oversize policy")

    kept_members: list[np.ndarray] = []
    kept_sizes: list[np.ndarray] = []
    pool = np.asarray(candidates, dtype=np.int64)
    for _ in range(iterations):
        if len(pool) == 0:
            break
        order = pool[rng.permutation(len(pool))]
        pv, pt = vision[order], tokens[order]
        starts = next_fit_starts(pv, pt, caps.vision_cap, caps.token_cap)
        group_v = np.add.reduceat(pv, starts)
        group_t = np.add.reduceat(pt, starts)
        keep = (group_v >= caps.vision_target) | (group_t >= caps.token_target)
        sizes = np.diff(np.append(starts, len(order)))
        in_kept = np.repeat(keep, sizes)
        kept_members.append(order[in_kept])
        kept_sizes.append(sizes[keep])
        pool = order[~in_kept]

    if len(pool):
        # Largest first, ties broken by id so the result never depends on sort stability.
        size_key = pool_size_key(pool, vision, tokens, caps)
        order = pool[np.lexsort((pool, -size_key))]
        bin_of, n_bins = first_fit_decreasing(order, vision, tokens, caps.vision_cap, caps.token_cap)
        by_bin = np.argsort(bin_of, kind="stable")
        kept_members.append(order[by_bin])
        kept_sizes.append(np.bincount(bin_of, minlength=n_bins))

    members = np.concatenate(kept_members) if kept_members else np.empty(0, dtype=np.int64)
    sizes = np.concatenate(kept_sizes) if kept_sizes else np.empty(0, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return members, offsets


def pool_size_key(ids: np.ndarray, vision: np.ndarray, tokens: np.ndarray, caps: Caps) -> np.ndarray:
    """A sample's size relative to the caps: the fuller of its two dimensions."""
    return np.maximum(vision[ids] / caps.vision_cap, tokens[ids] / caps.token_cap)
