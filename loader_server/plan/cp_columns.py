"""Collective-safe dynamic context parallelism: every GPU of a microbatch index runs a pack of one class.

In a dynamic CP plan a pack spans d of a rank's C GPUs (`packfeed.server.plan.context_parallel`). With FSDP or
ZeRO-3 sharding over all dp x C GPUs and a vision tower wrapped apart, the tower's collectives need every GPU of
a microbatch index to call it, or none. So each step is laid out in *columns*: microbatch index j of a step
holds packs of one class (the towers their samples call) on all dp x C GPUs.

A column is dp *slots* (one per rank), each filling its rank's C GPUs exactly. Per class:

1. The class needs G = dp x ceil(ceil(W / C) / dp) slots, W its packs' degrees summed (their width), and at least
   one pack per slot. With fewer packs, packs of several samples are split (a pack at degree 1 in halves; the
   long sample of a larger pack keeps its degree and its fillers become a pack of their own).
2. Packs fill slots one after another, largest degree and largest share of a GPU (work / degree) first, so a
   slot's GPUs get similar shares (powers of 2 into slots of C GPUs, largest first, always fit). The slots
   beyond what the width fills each take one of the heaviest packs, alone.
3. Each slot's packs are widened until they fill its C GPUs: the smallest degree doubles (the heaviest pack of
   that degree first), which spreads its work over more GPUs and never puts more tokens on one.
4. Slots sorted by work make the class's columns, dp at a time.

Columns of every class, heaviest first, fill steps M at a time; within a step each column's slots go to the
ranks heaviest to lightest so far. A class whose samples cannot fill its last column (fewer than one per slot
left) keeps that column partial: some ranks' GPUs hold nothing at that index. The plan's `collective_safe`
summary counts it, and it goes to the last step.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from packfeed.server.plan.context_parallel import CpCaps, degrees


@dataclass
class CpPacks:
    """Packs of a dynamic CP plan: members per pack, and each pack's degree, cost and class."""

    members: list[np.ndarray]
    degree: np.ndarray
    cost: np.ndarray
    pack_class: np.ndarray


def place_in_columns(packs: CpPacks, sample_cost: np.ndarray, tokens: np.ndarray, vision: np.ndarray,
                     caps: CpCaps, dp: int, m: int, rng: np.random.Generator):
    """Per pack of the returned packs (some split, degrees widened): (step, rank, microbatch, cp_group), and the
    number of steps. Steps come in a seeded random order with partial columns in the last one; each step's
    ranks are permuted."""
    if not packs.members:
        return (np.empty(0, dtype=np.int64),) * 4, 0
    columns = _columns(packs, sample_cost, tokens, vision, caps, dp)
    n_pack = len(packs.members)
    step, rank, microbatch, group = (np.full(n_pack, -1, dtype=np.int64) for _ in range(4))
    n_steps = -(-len(columns) // m)
    first_partial = next((k for k, (partial, *_) in enumerate(columns) if partial), len(columns))
    shuffled = np.arange(n_steps)  # steps of whole columns in a seeded order, then the rest in place
    whole_steps = min(first_partial // m, n_steps - 1)
    shuffled[:whole_steps] = rng.permutation(whole_steps)
    for s in range(n_steps):
        for r, j, slot in _step_slots(columns[s * m:(s + 1) * m], packs.cost, dp, caps.groups):
            for p, d, g in slot:
                step[p], rank[p], microbatch[p], group[p] = shuffled[s], r, j, g
                packs.degree[p] = d
    rank_order = np.argsort(rng.random((n_steps, dp)), axis=1)
    return (step, rank_order[step, rank], microbatch, group), n_steps


def steps_in_columns(packs: CpPacks, sample_cost: np.ndarray, tokens: np.ndarray, vision: np.ndarray,
                     caps: CpCaps, dp: int, m: int) -> int:
    """The steps `place_in_columns` places these packs in, without placing them (it splits `packs` as
    `place_in_columns` does)."""
    return -(-len(_columns(packs, sample_cost, tokens, vision, caps, dp)) // m) if packs.members else 0


def _columns(packs: CpPacks, sample_cost, tokens, vision, caps: CpCaps, dp: int) -> list:
    """Every class's packs in slots, dp slots to a column: (partial, -work, class, its slots: each a list of
    (pack, degree)), whole columns first, heaviest first; partial ones last."""
    columns = []
    for klass in np.unique(packs.pack_class):
        ids = _enough_packs(packs, np.flatnonzero(packs.pack_class == klass), sample_cost, tokens, vision, caps, dp)
        slots = _fill_slots(ids, packs, dp, caps.groups)
        slots.sort(key=lambda slot: -_work(slot, packs.cost))
        for first in range(0, len(slots), dp):
            column = slots[first:first + dp]
            work = sum(_work(slot, packs.cost) for slot in column)
            columns.append((len(column) < dp, -work, int(klass), column))
    columns.sort(key=lambda column: column[:3])
    return columns


def _step_slots(columns: list, cost: np.ndarray, dp: int, c: int):
    """One step's columns on its ranks: (rank, microbatch, [(pack, degree, cp_group)]) per slot. The slots of
    a class's whole columns are interchangeable within the step: each rank takes as many of them as the class
    has columns here, heaviest slot first to the rank whose busiest GPU would carry the least; a partial column
    keeps to one slot a rank. Each slot's packs then go to the GPUs with the least work (`_lanes`)."""
    load = np.zeros((dp, c))  # every GPU's work in the step so far
    # (class, partial, the index of a partial column) -> the microbatch indexes of its columns here, their slots
    groups: dict = {}
    for j, (partial, _, klass, column) in enumerate(columns):
        indexes, slots = groups.setdefault((klass, partial, j if partial else -1), ([], []))
        indexes.append(j)
        slots.extend(column)
    placed = []
    for indexes, slots in groups.values():
        taken = np.zeros(dp, dtype=np.int64)
        for slot in sorted(slots, key=lambda slot: -_work(slot, cost)):
            work = _work(slot, cost) / c
            r = min((r for r in range(dp) if taken[r] < len(indexes)),
                    key=lambda r: (load[r].max() + work, load[r].sum(), r))
            placed.append((r, indexes[taken[r]], _lanes(slot, load[r], cost)))
            taken[r] += 1
    return placed


def _work(slot: list[tuple[int, int]], cost: np.ndarray) -> float:
    return sum(float(cost[p]) for p, _ in slot)


def _slots_needed(width: int, dp: int, c: int) -> int:
    """Slots for packs of `width` GPUs in all, in whole columns: dp x ceil(width / (dp x C))."""
    return dp * -(-width // (dp * c))


def _enough_packs(packs: CpPacks, ids: np.ndarray, sample_cost, tokens, vision, caps: CpCaps, dp: int) -> list[int]:
    """The class's packs, split until there is one for each slot its width needs (or nothing splits further)."""
    ids = [int(p) for p in ids]
    width = int(packs.degree[ids].sum())
    splittable = [(-len(packs.members[p]), -packs.cost[p], p) for p in ids if len(packs.members[p]) > 1]
    heapq.heapify(splittable)
    while len(ids) < _slots_needed(width, dp, caps.groups) and splittable:
        _, _, p = heapq.heappop(splittable)
        parts = _split(packs.members[p], int(packs.degree[p]), tokens, vision, caps)
        if parts is None:
            continue
        (kept, kept_degree), (rest, rest_degree) = parts
        packs.members[p], packs.cost[p] = kept, float(sample_cost[kept].sum())
        packs.members.append(rest)
        packs.degree = np.append(packs.degree, rest_degree)
        packs.cost = np.append(packs.cost, float(sample_cost[rest].sum()))
        packs.pack_class = np.append(packs.pack_class, packs.pack_class[p])
        new = len(packs.members) - 1
        ids.append(new)
        width += rest_degree + kept_degree - int(packs.degree[p])
        packs.degree[p] = kept_degree
        for q in (p, new):
            if len(packs.members[q]) > 1:
                heapq.heappush(splittable, (-len(packs.members[q]), -packs.cost[q], q))
    return ids


def _split(members: np.ndarray, degree: int, tokens, vision, caps: CpCaps):
    """Two packs of `members` with their degrees, or None when the second would need more than C GPUs."""
    if degree == 1:  # alternate members: halves of similar size, each within one GPU's caps
        return (members[0::2], 1), (members[1::2], 1)
    rest = members[1:]  # the long sample keeps its degree; its fillers become a pack of their own
    need = max(int(degrees(np.array([tokens[rest].sum()]), caps.max_tokens)[0]),
               int(degrees(np.array([vision[rest].sum()]), caps.per_gpu.vision_cap)[0]))
    return None if need > caps.groups else ((members[:1], degree), (rest, need))


def _fill_slots(ids: list[int], packs: CpPacks, dp: int, c: int) -> list[list[tuple[int, int]]]:
    """The class's packs in slots of C GPUs (see the module's docstring, 2-3): per slot, (pack, degree) of
    each of its packs, widened to fill it."""
    degree, cost = packs.degree, packs.cost
    width = int(degree[ids].sum())
    n_slots = max(min(_slots_needed(width, dp, c), len(ids)), -(-width // c))
    # slots beyond what the width fills take one pack each, the heaviest of those narrower than C (widened over
    # the slot, its GPUs' shares come nearest the others')
    candidates = sorted((p for p in ids if degree[p] < c), key=lambda p: (-cost[p], p))
    alone: list[int] = []
    while len(alone) + -(-(width - int(degree[alone].sum())) // c) < n_slots and len(alone) < len(candidates):
        alone.append(candidates[len(alone)])
    rest = sorted(set(ids) - set(alone), key=lambda p: (-degree[p], -cost[p] / degree[p], p))
    slots, room = [[p] for p in alone], [c - int(degree[p]) for p in alone]
    for p in rest:  # next fit, largest degree and share first: a slot's GPUs get similar shares
        if not slots or len(slots) == len(alone) or room[-1] < degree[p]:
            slots.append([])
            room.append(c)
        slots[-1].append(p)
        room[-1] -= int(degree[p])
    return [_widened(slot, room[s], packs) for s, slot in enumerate(slots)]


def _widened(slot: list[int], room: int, packs: CpPacks) -> list[tuple[int, int]]:
    """The slot's packs with degrees doubled (smallest first, the heaviest of them first) until they fill its C
    GPUs: (pack, degree), largest degree first."""
    degree = {p: int(packs.degree[p]) for p in slot}
    while room > 0:
        p = min(slot, key=lambda q: (degree[q], -packs.cost[q], q))
        room -= degree[p]
        degree[p] *= 2
    return [(p, degree[p]) for p in sorted(slot, key=lambda q: (-degree[q], -packs.cost[q], q))]


def _lanes(slot: list[tuple[int, int]], load: np.ndarray, cost: np.ndarray) -> list[tuple[int, int, int]]:
    """The slot's packs (largest degree first) on the rank's C GPUs: each to the free aligned group whose GPUs
    carry the least work so far (`load`, updated); powers of 2 that sum to C always find room. Returns (pack,
    degree, cp_group)."""
    free = np.ones(len(load), dtype=bool)
    placed = []
    for p, d in slot:
        starts = [g for g in range(len(load) // d) if free[g * d:(g + 1) * d].all()]
        g = min(starts, key=lambda g: (load[g * d:(g + 1) * d].max(), g))
        free[g * d:(g + 1) * d] = False
        load[g * d:(g + 1) * d] += cost[p] / d
        placed.append((p, d, g))
    return placed
