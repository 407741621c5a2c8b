"""Which packs share a step, which rank gets which (MMScale Alg. 2), and lighter packs for the last step.

A step is D ranks x M packs. Packs of similar vision load and similar token load are put in the same
step (sort by a coarse vision bucket, then tokens), so the ranks of a step carry nearly equal work in
both modules. Within a step, packs go to ranks by greedy LPT on the combined cost, at most M per rank.
Step order across the epoch is a seeded shuffle elsewhere, so the epoch does not drift from small to
large packs. Collective-safe plans (`packfeed.server.plan.collective`) assign ranks class by class, so that
every rank's packs call the same towers in the same microbatches.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from packfeed.media.jit import kernel, prange


# Vision loads are grouped into at most this many buckets before sorting by tokens. Integral units
# (tiles, images) with fewer distinct values keep their exact values.
VISION_BUCKETS = 64


@kernel(cache=True, nogil=True)
def lpt_assign(cost, n_bins, per_bin_limit):
    """Greedy LPT: items largest first, each onto the least-loaded bin that still has room.

    `per_bin_limit` <= 0 means unlimited. Ties go to the lowest bin index, so the result is deterministic.
    Returns the bin of every item.
    """
    return lpt_assign_grouped(cost, np.zeros(len(cost), dtype=np.int64),
                              np.full(1, per_bin_limit, dtype=np.int64), n_bins)


@kernel(cache=True, nogil=True)
def lpt_assign_grouped(cost, group, group_limit, n_bins):
    """LPT where item k belongs to group `group[k]` and every bin takes at most `group_limit[g]` items of group g
    (<= 0: unlimited): the least-loaded bin with room in the item's group gets it. Returns the bin of every
    item."""
    n = len(cost)
    order = np.argsort(-cost, kind="mergesort")
    load = np.zeros(n_bins)
    count = np.zeros((len(group_limit), n_bins), dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    for k in range(n):
        i = order[k]
        g = group[i]
        limit = group_limit[g]
        best = -1
        for r in range(n_bins):
            if limit > 0 and count[g, r] >= limit:
                continue
            if best < 0 or load[r] < load[best]:
                best = r
        bin_of[i] = best
        load[best] += cost[i]
        count[g, best] += 1
    return bin_of


@kernel(cache=True, nogil=True)
def refine_by_swaps(cost, bin_of, n_bins, rounds, group):
    """In place: while one lowers the busiest bin's load, swap one of its items with one of another bin (the
    idlest that admits a swap first) whose transfer comes closest to half their gap. Only items of the same
    `group` swap, so every bin keeps its count of each group (M packs per rank; a collective-safe step's
    columns), and the makespan never rises: both bins end below the busiest's old load."""
    n = len(cost)
    load = np.zeros(n_bins)
    count = np.zeros(n_bins, dtype=np.int64)
    for k in range(n):
        load[bin_of[k]] += cost[k]
        count[bin_of[k]] += 1
    width = count.max() if n else 0
    items = np.full((n_bins, max(width, 1)), -1, dtype=np.int64)  # each bin's items, kept as swaps happen
    filled = np.zeros(n_bins, dtype=np.int64)
    for k in range(n):
        b = bin_of[k]
        items[b, filled[b]] = k
        filled[b] += 1
    floor = load.sum() / n_bins
    for _ in range(rounds):
        high = np.argmax(load)
        if load[high] <= floor * (1 + 1e-9):
            return
        best_a, best_b, target = -1, -1, -1
        for low in np.argsort(load):
            gap = load[high] - load[low]
            if low == high or gap <= 0:
                continue
            best = gap / 2
            for a in range(count[high]):
                for b in range(count[low]):
                    if group[items[high, a]] != group[items[low, b]]:
                        continue
                    transfer = cost[items[high, a]] - cost[items[low, b]]
                    shift = abs(transfer - gap / 2)
                    if 0 < transfer < gap and shift < best - 1e-12:
                        best, best_a, best_b = shift, a, b
            if best_a >= 0:
                target = low
                break
        if best_a < 0:
            return
        i, j = items[high, best_a], items[target, best_b]
        items[high, best_a], items[target, best_b] = j, i
        bin_of[i], bin_of[j] = target, high
        transfer = cost[i] - cost[j]
        load[high] -= transfer
        load[target] += transfer


@kernel(cache=True, nogil=True, parallel=True)
def assign_ranks(steps, cost, pack_class, dp, m, refine, aligned):
    """Each step's packs (`steps` rows; -1 = empty) over dp ranks, M per rank: LPT on `cost`, then (`refine`:
    isf+phases, whose LLM phase is balanced apart) swaps between ranks while they lower the busiest; each rank's
    packs by decreasing cost, -1 (empty) packs last. `aligned` (collective-safe plans): packs go by their class
    (`pack_class`: which towers a pack calls; an empty pack, class 0, calls none) in whole columns: every class
    whose count in the step is a multiple of dp gives each rank count/dp packs, in the same microbatches on every
    rank; the rest share the step's remaining microbatches. Steps are independent, so they run in parallel."""
    n_steps = steps.shape[0]
    grid = np.full((n_steps, dp, m), -1, dtype=np.int64)
    for st in prange(n_steps):
        packs = steps[st] if aligned else steps[st][steps[st] >= 0]
        c = np.zeros(len(packs))
        classes = np.zeros(len(packs), dtype=np.int64)
        for k in range(len(packs)):
            if packs[k] >= 0:
                c[k] = cost[packs[k]]
                classes[k] = pack_class[packs[k]]
        if aligned:
            group, limits = column_groups(classes, c, dp)
        else:
            group, limits = np.zeros(len(packs), dtype=np.int64), np.full(1, m, dtype=np.int64)
        bins = lpt_assign_grouped(c, group, limits, dp)
        if refine:
            refine_by_swaps(c, bins, dp, dp, group)
        by_cost = np.argsort(-c, kind="mergesort")
        filled = np.zeros(dp, dtype=np.int64)
        for k in by_cost[np.argsort(group[by_cost], kind="mergesort")]:  # by group, then decreasing cost
            r = bins[k]
            grid[st, r, filled[r]] = packs[k]
            filled[r] += 1
    return grid


@kernel(cache=True, nogil=True)
def column_groups(classes, cost, dp):
    """Group of each of a step's packs, and each group's packs per rank: one group per class with at least dp
    packs in the step (classes ascending), holding count // dp packs per rank; then one for the rest of every
    class (its count % dp cheapest packs: the step's unaligned columns, as few as its classes allow)."""
    distinct = np.unique(classes)
    counts = np.zeros(len(distinct), dtype=np.int64)
    for k in range(len(classes)):
        counts[np.searchsorted(distinct, classes[k])] += 1
    has_whole = counts >= dp
    group_of_class = np.cumsum(has_whole) - 1
    n_whole = int(has_whole.sum())
    limits = np.zeros(n_whole + 1, dtype=np.int64)
    limits[:n_whole] = counts[has_whole] // dp
    limits[n_whole] = (counts % dp).sum() // dp
    group = np.empty(len(classes), dtype=np.int64)
    left = counts % dp  # each class's packs still to put in the shared group, cheapest first
    for k in np.argsort(cost, kind="mergesort"):
        c = np.searchsorted(distinct, classes[k])
        if left[c] > 0:
            group[k] = n_whole
            left[c] -= 1
        else:
            group[k] = group_of_class[c]
    return group, limits


@kernel(cache=True, nogil=True, parallel=True)
def permute_ranks(grid, keys):
    """Each step's ranks in the order of their random keys (a per-step random permutation)."""
    out = np.empty_like(grid)
    for st in prange(grid.shape[0]):
        order = np.argsort(keys[st])
        for r in range(grid.shape[1]):
            out[st, r] = grid[st, order[r]]
    return out


def vision_bucket(pack_vision: np.ndarray) -> np.ndarray:
    """Coarse vision load used as the primary step-formation key."""
    small_integers = pack_vision.dtype.kind in "iu" and len(pack_vision) and 0 <= pack_vision.min() \
        and pack_vision.max() < 1 << 20
    if small_integers:  # linear: which values occur, without sorting
        present = np.flatnonzero(np.bincount(pack_vision))
        if len(present) <= VISION_BUCKETS:
            rank = np.zeros(int(present[-1]) + 1, dtype=np.int64)
            rank[present] = np.arange(len(present))
            return rank[pack_vision]
    distinct = np.unique(pack_vision)
    if len(distinct) <= VISION_BUCKETS:
        return np.searchsorted(distinct, pack_vision)
    edges = np.quantile(pack_vision, np.linspace(0, 1, VISION_BUCKETS + 1)[1:-1])
    return np.searchsorted(edges, pack_vision, side="right")


def lightest(cost: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k lowest costs, ties broken by lower id, in linear time (sorted ids)."""
    if k == 0:
        return np.empty(0, dtype=np.int64)
    threshold = np.partition(cost, k - 1)[k - 1]
    below = np.flatnonzero(cost < threshold)
    at = np.flatnonzero(cost == threshold)[: k - len(below)]
    return np.sort(np.concatenate([below, at]))


def form_steps(pack_vision: np.ndarray, pack_tokens: np.ndarray, pack_cost: np.ndarray,
               slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Split packs into full steps of `slots` similar packs, and the rest.

    Returns (full, rest): `full` is a (n_steps, slots) array of pack ids; `rest` holds the N mod slots
    lightest packs, which form the epoch's last, partial step.
    """
    rest = lightest(pack_cost, len(pack_cost) % slots)
    in_body = np.ones(len(pack_cost), dtype=bool)
    in_body[rest] = False
    body = np.flatnonzero(in_body)
    return body[similar_order(pack_vision[body], pack_tokens[body])].reshape(-1, slots), rest


def similar_order(pack_vision: np.ndarray, pack_tokens: np.ndarray) -> np.ndarray:
    """Packs by (coarse vision bucket, tokens): neighbours in it carry similar work in both modules. One
    composite key; the stable sort breaks ties by pack id."""
    key = (vision_bucket(pack_vision).astype(np.uint64) << np.uint64(40)) | pack_tokens.astype(np.uint64)
    return radix_argsort(key)


@kernel(cache=True, nogil=True)
def radix_argsort(keys):
    """Stable argsort of uint64 keys: LSD radix sort on 16-bit digits, skipping digits no key uses.

    Linear time (packs' keys use two or three digits), and stable, so ties keep their order on every CPU.
    """
    n = len(keys)
    order = np.arange(n)
    scratch = np.empty(n, dtype=np.int64)
    used = np.uint64(0)
    for i in range(n):
        used |= keys[i]
    for shift in range(0, 64, 16):
        if (used >> np.uint64(shift)) & np.uint64(0xFFFF) == 0:
            continue
        count = np.zeros((1 << 16) + 1, dtype=np.int64)
        for i in range(n):
            count[((keys[order[i]] >> np.uint64(shift)) & np.uint64(0xFFFF)) + 1] += 1
        for d in range(1 << 16):
            count[d + 1] += count[d]
        for i in range(n):
            d = (keys[order[i]] >> np.uint64(shift)) & np.uint64(0xFFFF)
            scratch[count[d]] = order[i]
            count[d] += 1
        order, scratch = scratch, order
    return order


def split_for_last_step(members: list[np.ndarray], sample_cost: Callable[[np.ndarray], np.ndarray],
                        slots: int) -> list[np.ndarray]:
    """Split the last step's packs into up to `slots` lighter packs, so every rank still gets work.

    Repeatedly halves the pack holding the most samples (LPT into two), which keeps every piece within
    the caps its parent respected. Stops when there are `slots` packs or every pack is a single sample.
    """
    packs = [np.asarray(m, dtype=np.int64) for m in members if len(m)]
    while len(packs) < slots:
        biggest = max(range(len(packs)), key=lambda k: (len(packs[k]), -k)) if packs else None
        if biggest is None or len(packs[biggest]) < 2:
            break
        pack = packs.pop(biggest)
        halves = lpt_assign(sample_cost(pack), 2, 0)
        packs[biggest:biggest] = [pack[halves == 0], pack[halves == 1]]
    return packs
