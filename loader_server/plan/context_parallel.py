"""Context-parallel plans (`context_parallel` C > 1): each pack's degree, and which GPUs of its rank run it.

A job runs on dp x C GPUs. Each DP rank's microbatch is a CP group of C GPUs, each a lane (0..C-1). A pack at degree d
(1, 2, 4, ..., C) runs on the d aligned GPUs [g*d, (g+1)*d) of one rank's microbatch: `cp_group` g. Its
samples are split among those d GPUs by the contract's zigzag rule (`packfeed.v1.context_parallel`), so each
holds at most ceil(T/d) of the pack's T tokens, and each does 1/d of its linear and of its causal attention work.

- dynamic (default): samples that fit one GPU (at most N = `max_tokens_per_gpu` tokens, and the vision cap) are
  ISF-packed under those caps and run at d = 1; a longer sample starts a pack at the smallest d that puts at
  most N tokens on each GPU (one within N tokens but above the vision cap: at d = 1), topped up with short
  samples to what its d GPUs hold (`top_up`). Packs then fill every step's dp x M x C GPUs:
  steps get packs largest degree first, each to the step with the least work so far that has room, and within
  a step each pack goes to the free aligned GPUs that carry the least work (buddy placement, so largest
  first always finds room). Every GPU's work (linear + attention, each pack's divided by its degree) is what
  is balanced, across all dp x C GPUs of a step.
- static: every pack runs over all C GPUs: ISF packs under C x N tokens (and C x the vision cap), placed as
  without CP. The baseline.

A sample whose tokens do not fit even at d = C is the oversize policy's: `alone` runs it at d = C above N,
`skip` drops it, `truncate` cuts its tokens to C x N; all are reported. Guarantees (tested): every sample once;
no GPU above N tokens but the oversize policy's reported ones; the same inputs give the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from packfeed.media.jit import kernel
from packfeed.server.plan.costs import sample_costs
from packfeed.server.plan.isf import Caps, IsfPacks
from packfeed.server.plan.metrics import dist_ratio
from packfeed.v1.options import CpMode, Oversize, PlanConfig


@dataclass(frozen=True)
class CpCaps:
    """What one GPU may hold (`per_gpu`: the caps of a pack at d = 1) and the group's size C."""

    per_gpu: Caps
    groups: int  # C

    @property
    def max_tokens(self) -> int:
        return self.per_gpu.token_cap

    def scaled(self, degree: int) -> Caps:
        """The caps of a pack over `degree` GPUs."""
        c = self.per_gpu
        return Caps(c.vision_cap * degree, c.token_cap * degree, c.vision_target * degree,
                    c.token_cap * degree - (c.token_cap - c.token_target))


def cp_caps(caps: Caps, config: PlanConfig) -> CpCaps:
    """What one GPU holds in a CP job: N = `max_tokens_per_gpu` tokens (default: the token cap) and the vision
    units of the caps' own ratio at N tokens. Packs at degree 1 are ISF packs under these caps."""
    n = config.max_tokens_per_gpu or caps.token_cap
    if n == caps.token_cap:
        return CpCaps(caps, config.context_parallel)
    scale = n / caps.token_cap
    vision_cap = max(1, int(np.ceil(caps.vision_cap * scale)))
    return CpCaps(Caps(vision_cap, n, max(1, min(vision_cap, int(np.ceil(caps.vision_target * scale)))),
                       max(1, n - min(caps.token_cap - caps.token_target, n // 32))), config.context_parallel)


def degrees(tokens: np.ndarray, max_tokens: int) -> np.ndarray:
    """Per sample: the smallest power of 2 d with ceil(tokens / d) <= `max_tokens` (a sample one GPU holds: 1)."""
    need = np.maximum(-(-np.asarray(tokens, dtype=np.int64) // max_tokens), 1)
    return (1 << np.ceil(np.log2(need)).astype(np.int64)).astype(np.int64)


def split_by_degree(loads, caps: CpCaps, oversize: Oversize):
    """Valid samples by how many GPUs their tokens need: (ids ISF packs for one GPU, ids that run alone (one GPU
    holds their tokens but not under the vision cap, or they need more GPUs), their degrees, ids of the oversize
    policy, ids it truncates, every sample's tokens as planned). Degrees above C are the oversize policy's:
    `alone` runs them at C (above N, reported), `skip` drops them, `truncate` cuts their tokens to C x N."""
    tokens, vision = loads.tokens, loads.vision
    valid_ids = np.flatnonzero(loads.valid)
    d = degrees(tokens[valid_ids], caps.max_tokens)
    packable = (d == 1) & (vision[valid_ids] <= caps.per_gpu.vision_cap)
    short_ids, alone_ids, d = valid_ids[packable], valid_ids[~packable], d[~packable]
    c = caps.groups
    over = d > c
    oversize_ids = alone_ids[over]
    cut = np.empty(0, dtype=np.int64)
    if oversize is Oversize.SKIP:
        alone_ids, d = alone_ids[~over], d[~over]
    elif oversize is Oversize.TRUNCATE and len(oversize_ids):
        cut = oversize_ids
        tokens = tokens.copy()
        tokens[cut] = caps.max_tokens * c
    return short_ids, alone_ids, np.minimum(d, c), oversize_ids, cut, tokens


def top_up(alone: np.ndarray, alone_degrees: np.ndarray, short: np.ndarray, vision: np.ndarray, tokens: np.ndarray,
           caps: CpCaps) -> tuple[IsfPacks, np.ndarray]:
    """The packs of the samples that run alone (one each, at its degree d), each topped up with short samples
    to what its d GPUs hold (d x N tokens, d x the vision cap): the packs with the most room first, each taking
    the largest short sample that still fits until none does. Returns those packs and the short samples left
    for ISF packs at degree 1. Without it a 40K-token video at d = 2 would leave a quarter of its GPUs' tokens
    empty (and the epoch longer by as many steps as such slack adds up to)."""
    alone, short = alone.astype(np.int64), short.astype(np.int64)
    room_tokens = caps.max_tokens * alone_degrees - tokens[alone]
    room_vision = caps.per_gpu.vision_cap * alone_degrees - vision[alone]
    pack_order = np.lexsort((alone, -room_tokens))
    short_order = np.lexsort((short, -tokens[short]))  # largest first, ties by id
    owner = _top_up(room_tokens[pack_order], room_vision[pack_order], tokens[short][short_order],
                    vision[short][short_order])
    taken = short[short_order][owner >= 0]
    filler_pack = pack_order[owner[owner >= 0]]  # index into `alone` of the pack each filler joins
    by_pack = np.lexsort((np.arange(len(taken)), filler_pack))
    counts = np.bincount(filler_pack, minlength=len(alone)) + 1
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    members = np.empty(int(offsets[-1]), dtype=np.int64)
    members[offsets[:-1]] = alone  # each pack's long sample first, then its fillers in the order taken
    filler_slots = np.delete(np.arange(len(members)), offsets[:-1])
    members[filler_slots] = taken[by_pack]
    packs = IsfPacks(members, offsets, np.add.reduceat(vision[members], offsets[:-1]) if len(alone) else
                     np.zeros(0, np.int64), np.add.reduceat(tokens[members], offsets[:-1]) if len(alone) else
                     np.zeros(0, np.int64))
    return packs, short[~np.isin(short, taken)]


@kernel(cache=True, nogil=True)
def _top_up(room_tokens, room_vision, short_tokens, short_vision):
    """Per short sample (in descending tokens), the pack (in the given order) it tops up, or -1. `after[i]`: the
    first short sample at or after i not yet taken (path-compressed)."""
    n = len(short_tokens)
    owner = np.full(n, -1, dtype=np.int64)
    after = np.arange(n + 1)
    ascending = -short_tokens  # for searchsorted: the first sample with tokens <= room
    for p in range(len(room_tokens)):
        room, room_v = room_tokens[p], room_vision[p]
        if room <= 0 or room_v < 0:
            continue
        i = _next_free(after, np.searchsorted(ascending, -room))
        while i < n:
            if short_vision[i] <= room_v:
                owner[i] = p
                room -= short_tokens[i]
                room_v -= short_vision[i]
                after[i] = i + 1
                i = _next_free(after, max(i + 1, np.searchsorted(ascending, -room)))
            else:
                i = _next_free(after, i + 1)
    return owner


@kernel(cache=True, nogil=True)
def _next_free(after, i):
    root = i
    while after[root] != root:
        root = after[root]
    while after[i] != root:  # path compression
        after[i], i = root, after[i]
    return root


def place(cost: np.ndarray, degree: np.ndarray, dp: int, m: int, c: int, rng: np.random.Generator):
    """Per pack (its work and degree): (step, rank, microbatch, cp_group), filling every step's dp x m x c GPUs
    but the last's. Steps come in a seeded random order, the partial one last; each step's ranks are permuted."""
    if len(cost) == 0:
        return (np.empty(0, dtype=np.int64),) * 4, 0
    step = _steps(cost, degree, dp * m * c, rng)
    n_steps = int(step.max()) + 1
    by_step = np.lexsort((-cost, -degree, step))  # within a step: largest degree, then heaviest, first
    rank, microbatch, group = _place_in_steps(by_step, step, cost, degree, dp, m, c)
    shuffled = np.concatenate([rng.permutation(n_steps - 1), [n_steps - 1]])
    rank_order = np.argsort(rng.random((n_steps, dp)), axis=1)  # step s's rank r becomes rank_order[s, r]
    return (shuffled[step], rank_order[step, rank], microbatch, group), n_steps


def placed_steps(cost: np.ndarray, degree: np.ndarray, dp: int, m: int, c: int, rng: np.random.Generator) -> int:
    """The steps `place` fills, without placing the packs in them."""
    return int(_steps(cost, degree, dp * m * c, rng).max()) + 1 if len(cost) else 0


def _steps(cost: np.ndarray, degree: np.ndarray, width: int, rng: np.random.Generator) -> np.ndarray:
    """Per pack, its step. A GPU's share of a pack is its work / d: steps of packs with similar shares keep their
    GPUs equally busy (as balance.form_steps does without CP); seeded ties."""
    order = np.lexsort((rng.permutation(len(cost)), -(cost / degree)))
    return _fill_steps(order, degree, width)


@kernel(cache=True, nogil=True)
def _fill_steps(order, degree, width):
    """Packs in `order` fill steps of `width` GPUs one after another; a pack with no room left in its step
    waits for the next one, which takes the waiting packs first. Only the last step can have free GPUs."""
    step = np.full(len(order), -1, dtype=np.int64)
    waiting = np.empty(len(order), dtype=np.int64)
    n_waiting, current, free = 0, 0, width
    for k in range(len(order)):
        p = order[k]
        if degree[p] <= free:
            step[p] = current
            free -= degree[p]
        else:
            waiting[n_waiting] = p
            n_waiting += 1
        while free == 0:
            current += 1
            n_waiting, free = _take_waiting(waiting, n_waiting, degree, step, current, width)
    if n_waiting > 0:
        # The rest did not fit the current step's free GPUs: lay the current step's packs and theirs out again,
        # largest degree first (powers of 2 into steps of widths divisible by each fill every step exactly), so
        # only the very last step keeps free GPUs.
        rest = np.concatenate((np.flatnonzero(step == current), waiting[:n_waiting]))
        rest = rest[np.argsort(-degree[rest], kind="mergesort")]
        free = width
        for q in rest:
            if degree[q] > free:
                current, free = current + 1, width
            step[q] = current
            free -= degree[q]
    return step


@kernel(cache=True, nogil=True)
def _take_waiting(waiting, n_waiting, degree, step, current, free):
    """Waiting packs, in line, into step `current` while they fit; returns (packs still waiting, free GPUs)."""
    kept = 0
    for w in range(n_waiting):
        q = waiting[w]
        if degree[q] <= free:
            step[q] = current
            free -= degree[q]
        else:
            waiting[kept] = q
            kept += 1
    return kept, free


@kernel(cache=True, nogil=True)
def _place_in_steps(by_step, step, cost, degree, dp, m, c):
    """Within each step, packs (in `by_step`: by step, then largest degree and heaviest first) to the free
    aligned GPUs whose busiest carries the least work; ties to the lowest (rank, group, microbatch). Largest
    degree first, powers of 2 in groups of C: a step's packs always find room (buddy placement)."""
    n = len(cost)
    rank = np.empty(n, dtype=np.int64)
    microbatch = np.empty(n, dtype=np.int64)
    group = np.empty(n, dtype=np.int64)
    load = np.zeros((dp, c))
    rank_load = np.zeros(dp)  # second key: a lighter rank first, so a partial last step reaches every rank
    used = np.zeros((dp, m, c), dtype=np.bool_)
    current = -1
    for i in range(n):
        p = by_step[i]
        if step[p] != current:
            current = step[p]
            load[:] = 0.0
            rank_load[:] = 0.0
            used[:] = False
        d = degree[p]
        best, best_rank_load, best_r, best_mb, best_g = np.inf, np.inf, -1, -1, -1
        for r in range(dp):
            for g in range(c // d):
                score = load[r, g * d:(g + 1) * d].max()
                if score > best or (score == best and rank_load[r] >= best_rank_load):
                    continue
                for mb in range(m):
                    if not used[r, mb, g * d:(g + 1) * d].any():
                        best, best_rank_load, best_r, best_mb, best_g = score, rank_load[r], r, mb, g
                        break
        rank[p], microbatch[p], group[p] = best_r, best_mb, best_g
        used[best_r, best_mb, best_g * d:(best_g + 1) * d] = True
        load[best_r, best_g * d:(best_g + 1) * d] += cost[p] / d
        rank_load[best_r] += cost[p]
    return rank, microbatch, group


def gpu_work(plan_step, plan_rank, pack_group, pack_degree, pack_cost, n_steps: int, dp: int, c: int) -> np.ndarray:
    """(steps, dp * c): every GPU's work in every step, each pack's divided among its degree's GPUs."""
    out = np.zeros((n_steps, dp, c))
    _add_lanes(out, plan_step, plan_rank, pack_group, pack_degree, pack_cost)
    return out.reshape(n_steps, dp * c)


@kernel(cache=True, nogil=True)
def _add_lanes(out, step, rank, group, degree, value):
    for p in range(len(step)):
        d = degree[p]
        for lane in range(group[p] * d, (group[p] + 1) * d):
            out[step[p], rank[p], lane] += value[p] / d


def with_valid(loads, keep: np.ndarray):
    """`loads` with only `keep` valid (the samples ISF packs for one GPU)."""
    valid = np.zeros(len(loads), dtype=bool)
    valid[keep] = True
    return replace(loads, valid=valid)


def subpacks(offsets: np.ndarray, cp_degree: np.ndarray, cp_group: np.ndarray) -> tuple[np.ndarray, ...]:
    """The packs of a CP plan's slots: (slot, first member, stop) of each run of one (degree, cp_group) within a
    slot (a slot's packs are in the order of their first lane)."""
    sizes = np.diff(offsets)
    slot_of = np.repeat(np.arange(len(sizes)), sizes)
    new = np.ones(len(slot_of), dtype=bool)
    new[1:] = (slot_of[1:] != slot_of[:-1]) | (cp_group[1:] != cp_group[:-1]) | (cp_degree[1:] != cp_degree[:-1])
    starts = np.flatnonzero(new)
    return slot_of[starts], starts, np.append(starts[1:], len(slot_of)).astype(np.int64)


def max_tokens_per_gpu(plan) -> int:
    """N of a CP plan (a static plan keeps the caps of its whole-group packs)."""
    static = plan.config.cp_mode is CpMode.STATIC
    return plan.caps.token_cap // (plan.config.context_parallel if static else 1)


def cp_summary(plan, loads) -> dict:
    """`packfeed plan`'s context-parallel figures: packs per degree, the Dist of every GPU's work per step (all
    dp x C of them), the most tokens any GPU holds in a microbatch, and the GPUs above N (oversize only)."""
    config = plan.config
    slot, starts, stops = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    tokens = np.where(plan.truncate_to > 0, np.minimum(loads.tokens[plan.members], plan.truncate_to),
                      loads.tokens[plan.members]).astype(np.int64)
    costs = sample_costs(config.cost_model, loads)[plan.members].sum(axis=1, dtype=np.float64)
    degree, group = plan.cp_degree[starts], plan.cp_group[starts]
    per_gpu = -(-np.add.reduceat(tokens, starts) // degree) if len(starts) else np.zeros(0, np.int64)
    work = gpu_work(slot // config.slots, slot // config.microbatches % config.dp, group, degree,
                    np.add.reduceat(costs, starts) if len(starts) else np.zeros(0), plan.n_steps, config.dp,
                    config.context_parallel)
    n = max_tokens_per_gpu(plan)
    values, counts = np.unique(degree, return_counts=True)
    return {"mode": config.cp_mode.value, "groups": config.context_parallel, "max_tokens_per_gpu": n,
            "gpus": config.dp * config.context_parallel, "gpu_dist": round(dist_ratio(work), 6),
            "peak_tokens_per_gpu": int(per_gpu.max()) if len(per_gpu) else 0,
            "packs_over_max_tokens": int((per_gpu > n).sum()),
            "degrees": {str(int(d)): int(k) for d, k in zip(values, counts)}}


def default_budget_note(config: PlanConfig, loads, n: int) -> str | None:
    """A CP plan without `max_tokens_per_gpu` takes the token cap as what one GPU holds: say so where samples
    are above it (they then span several GPUs, or beyond C GPUs fall to the oversize policy), naming the flag."""
    if config.context_parallel <= 1 or config.max_tokens_per_gpu:
        return None
    over = loads.valid & (loads.tokens > n)
    if not over.any():
        return None
    beyond = int((loads.valid & (loads.tokens > n * config.context_parallel)).sum())
    return (f"note: no --max-tokens-per-gpu: each GPU holds at most N = {n:,} tokens (the token cap), and "
            f"{int(over.sum()):,} samples hold more (split over several GPUs; {beyond:,} beyond "
            f"{config.context_parallel} GPUs, the oversize policy's: {config.oversize.value}). Give "
            "--max-tokens-per-gpu (max_tokens_per_gpu): the tokens one GPU's memory holds for the model")
