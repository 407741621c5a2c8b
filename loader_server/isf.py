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
def shuffled(ids, seed):
    """A copy of `ids` in a random order: Fisher-Yates driven by splitmix64 from `seed`.

    Our own generator, so the order is fixed by the seed alone, whatever numpy or numba version runs it.
    """
    out = ids.copy()
    state = np.uint64(seed)
    for k in range(len(out) - 1, 0, -1):
        state += np.uint64(0x9E3779B97F4A7C15)
        z = state
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        j = np.int64((z >> np.uint64(11)) % np.uint64(k + 1))  # bias < (k+1) / 2^53: negligible
        out[k], out[j] = out[j], out[k]
    return out


@numba.njit(cache=True, nogil=True)
def sample_and_filter(order, vision, tokens, vision_cap, token_cap, vision_target, token_target):
    """One ISF round over samples in `order`: next-fit groups, keep those reaching a target.

    Returns (kept members in group order, kept group sizes, samples returned to the pool).
    """
    n = len(order)
    kept = np.empty(n, dtype=np.int64)
    sizes = np.empty(n, dtype=np.int64)
    pool = np.empty(n, dtype=np.int64)
    n_kept = n_groups = n_pool = 0
    start = 0
    v = t = 0
    for k in range(n + 1):
        i = order[k] if k < n else -1
        if k == n or v + vision[i] > vision_cap or t + tokens[i] > token_cap:
            if k > start:  # close the group [start, k)
                if v >= vision_target or t >= token_target:
                    for j in range(start, k):
                        kept[n_kept] = order[j]
                        n_kept += 1
                    sizes[n_groups] = k - start
                    n_groups += 1
                else:
                    for j in range(start, k):
                        pool[n_pool] = order[j]
                        n_pool += 1
            start = k
            v = t = 0
        if k < n:
            v += vision[i]
            t += tokens[i]
    return kept[:n_kept], sizes[:n_groups], pool[:n_pool]


# First-fit looks only at the most recently opened bins. Items come largest first, so older bins are
# nearly full; the window keeps packing O(n * window) instead of O(n * bins) with almost the same fill.
FIRST_FIT_WINDOW = 256


@numba.njit(cache=True, nogil=True)
def first_fit_decreasing(order, vision, tokens, vision_cap, token_cap, window):
    """Pack samples (given in decreasing size order) into the first of the last `window` bins they fit.

    Returns the bin of every sample (in `order` positions) and the number of bins.
    """
    n = len(order)
    bin_of = np.empty(n, dtype=np.int64)
    bin_v = np.zeros(n, dtype=np.int64)
    bin_t = np.zeros(n, dtype=np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        chosen = -1
        for b in range(max(0, n_bins - window), n_bins):
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
        members, sizes, pool = sample_and_filter(shuffled(pool, _draw_seed(rng)), vision, tokens, caps.vision_cap,
                                                 caps.token_cap, caps.vision_target, caps.token_target)
        kept_members.append(members)
        kept_sizes.append(sizes)

    if len(pool):
        # Largest first, ties broken by id so the result never depends on sort stability.
        size_key = pool_size_key(pool, vision, tokens, caps)
        order = pool[np.lexsort((pool, -size_key))]
        bin_of, n_bins = first_fit_decreasing(order, vision, tokens, caps.vision_cap, caps.token_cap,
                                              FIRST_FIT_WINDOW)
        by_bin = np.argsort(bin_of, kind="stable")
        kept_members.append(order[by_bin])
        kept_sizes.append(np.bincount(bin_of, minlength=n_bins))

    members = np.concatenate(kept_members) if kept_members else np.empty(0, dtype=np.int64)
    sizes = np.concatenate(kept_sizes) if kept_sizes else np.empty(0, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return members, offsets


def _draw_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**63 - 1))


def pool_size_key(ids: np.ndarray, vision: np.ndarray, tokens: np.ndarray, caps: Caps) -> np.ndarray:
    """A sample's size relative to the caps: the fuller of its two dimensions."""
    return np.maximum(vision[ids] / caps.vision_cap, tokens[ids] / caps.token_cap)
