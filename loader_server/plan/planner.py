"""The plan: a pure function of (index, config, seed, epoch) that says which samples every DP rank
trains on in every microbatch of every step.

Guarantees (tested):
- every valid sample appears exactly once per epoch, except samples the `skip` oversize policy drops,
  which are reported;
- with the ISF strategies no pack of two or more samples exceeds a cap; a sample that alone exceeds a
  cap travels alone (`alone`, default), is dropped (`skip`), or has its tokens cut to the cap (`truncate`);
- every rank gets exactly M packs in every step; only the last step may hold lighter packs or empty
  packs (flagged), so no rank waits on a collective that others skip;
- same inputs give a byte-identical plan; nothing depends on process, thread count or hash seeds.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numba
import numpy as np

from packfeed.server.plan.balance import assign_ranks, form_steps, permute_ranks, similar_order, split_for_last_step
from packfeed.server.plan.collective import (aligned_steps, class_layout, collective_safe_layout, merge_to_whole_columns,
                                             pack_classes, sample_towers, split_to_whole_columns)
from packfeed.server.plan.caps import default_targets, search_caps
from packfeed.server.plan import context_parallel as cp
from packfeed.server.plan.cp_columns import CpPacks, place_in_columns
from packfeed.server.plan.costs import SampleLoads, encoder_costs, encoder_names, sample_costs
from packfeed.server.plan.isf import Caps, IsfPacks, isf
from packfeed.server.plan.pipeline_order import inter_reorder_many, stage_fractions, stage_times
from packfeed.server.plan.padded import padded_batches
from packfeed.server.plan.phases import Phase, phase_plan
from packfeed.server.plan.plan_file import Plan, segment_sum
from packfeed.v1.options import CpMode, Oversize, PlanConfig, Strategy

# Independent random streams per purpose, so changing one stage never shifts another's randomness.
_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES = 1, 2, 3, 4


def make_plan(loads: SampleLoads, config: PlanConfig, seed: int, epoch: int, index_fingerprint: str = "",
              caps: Caps | None = None, window: int | None = None) -> Plan:
    """Plan one epoch. `caps` short-circuits the automatic search (e.g. reuse it across epochs). `window`: these
    loads are one window of an epoch planned window by window (`packfeed.server.plan.windows`), which draws
    randomness of its own."""
    started = time.perf_counter()
    seeds = np.random.SeedSequence([seed, epoch] + ([] if window is None else [window]))
    streams = {k: np.random.default_rng(s) for k, s in zip(
        (_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES), seeds.spawn(4))}
    oversize = np.empty(0, dtype=np.int64)
    cut = np.empty(0, dtype=np.int64)
    pieces = []

    if config.context_parallel > 1 and config.cp_mode is CpMode.DYNAMIC:
        return _dynamic_cp_plan(loads, config, seed, epoch, index_fingerprint, caps, streams, started)
    if config.strategy.padded:
        caps = None
        sequence, packs_m, packs_o = padded_batches(loads, np.flatnonzero(loads.valid), config,
                                                     streams[_STREAM_BATCHES])
    else:
        caps = caps or resolve_caps(loads, config)
        if config.context_parallel > 1:  # static: every pack over the whole CP group
            packs, oversize, cut, tokens, caps = _static_cp_packs(loads, caps, config, streams[_STREAM_ISF])
        else:
            packs, oversize, cut, tokens = _isf_packs(loads, caps, config, streams[_STREAM_ISF])
        loads = replace(loads, tokens=tokens)  # the planner sees truncated samples at their cut length
        costs = sample_costs(config.cost_model, loads)
        sequence, packs, pieces = _arrange_packs(loads, costs, packs, config, streams, caps)
        packs_m, packs_o = packs.members, packs.offsets
        real = sequence >= 0
        pack_vision = np.where(real, packs.vision[np.where(real, sequence, 0)], 0)
        pack_tokens = np.where(real, packs.tokens[np.where(real, sequence, 0)], 0)

    offsets, members = _gather(sequence, packs_m, packs_o, *_csr(pieces, packs_m.dtype))
    truncate_to = np.zeros(len(members), dtype=np.int32)
    if len(cut):
        is_cut = np.zeros(len(loads), dtype=bool)
        is_cut[cut] = True
        truncate_to[is_cut[members]] = caps.token_cap
    plan = Plan(config, seed, epoch, caps, offsets, members, truncate_to, oversize, index_fingerprint)
    if caps is not None:
        plan.pack_vision, plan.pack_tokens = pack_vision, pack_tokens
    if config.context_parallel > 1:
        plan.cp_degree = np.full(len(members), config.context_parallel, dtype=np.int64)
        plan.cp_group = np.zeros(len(members), dtype=np.int64)
    if config.strategy is Strategy.ISF_PHASES or config.disaggregated:
        phases = [Phase("vision", 0, loads.vision)] + [
            Phase(name, 2 + k, loads.encoders[name].tokens, loads.encoders[name].padded)
            for k, name in enumerate(encoder_names(loads))]
        plan.phases = phase_plan(offsets, members, costs, phases, config.dp, config.microbatches,
                                 min(config.ranks_per_node, config.dp), config.encoder_ranks)
        # colocated: the same packs, each encoded where it trains (the phase plan still says what routing saves)
        colocated = _pack_ranks(offsets, config) if config.colocate_encoder else None
        plan.encoder_rank = plan.phases.vision.encoder_rank if colocated is None else colocated
        plan.further_encoder_ranks = {name: phase.encoder_rank if colocated is None else colocated
                                      for name, phase in plan.phases.encoders.items() if name != "vision"}
    plan.seconds = time.perf_counter() - started
    return plan


def _dynamic_cp_plan(loads, config: PlanConfig, seed, epoch, index_fingerprint, caps, streams, started) -> Plan:
    """Dynamic context parallelism (`packfeed.server.plan.context_parallel`): ISF packs of the samples one GPU
    holds at degree 1, each longer sample alone at the fewest GPUs that hold it, all placed on every step's lanes."""
    caps = caps or resolve_caps(loads, config)
    gpu_caps = cp.cp_caps(caps, config)
    short, alone, alone_degrees, oversize, cut, tokens = cp.split_by_degree(loads, gpu_caps, config.oversize)
    long_packs, short = cp.top_up(alone, alone_degrees, short, loads.vision, tokens, gpu_caps)
    packs, _, _, _ = _isf_packs(cp.with_valid(loads, short), gpu_caps.per_gpu, config, streams[_STREAM_ISF])
    packs = _joined(packs, long_packs)
    members, offsets = packs.members.astype(np.int64), packs.offsets
    degree = np.concatenate([np.ones(len(packs.tokens) - len(alone), dtype=np.int64), alone_degrees])
    loads = replace(loads, tokens=tokens)
    costs = sample_costs(config.cost_model, loads)
    pack_cv, pack_cl = _pack_costs(members, offsets, costs)
    if collective_safe_layout(config):
        towers = sample_towers(loads)
        laid = CpPacks([members[a:b] for a, b in zip(offsets[:-1], offsets[1:])], degree, pack_cv + pack_cl,
                       pack_classes(members, offsets, towers))
        (step, rank, microbatch, group), n_steps = place_in_columns(
            laid, costs.sum(axis=1, dtype=np.float64), tokens, loads.vision, gpu_caps, config.dp,
            config.microbatches, streams[_STREAM_STEPS])
        members, degree = np.concatenate([members[:0], *laid.members]).astype(np.int64), laid.degree
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in laid.members])]).astype(np.int64)
    else:
        (step, rank, microbatch, group), n_steps = cp.place(pack_cv + pack_cl, degree, config.dp,
                                                            config.microbatches, config.context_parallel,
                                                            streams[_STREAM_STEPS])
    slot = (step * config.dp + rank) * config.microbatches + microbatch
    order = np.lexsort((group * degree, slot))  # each slot's packs by their first lane
    slot_offsets, slot_members = _gather(order, members, offsets, np.empty(0, members.dtype), np.zeros(1, np.int64))
    sizes = np.diff(offsets)[order]
    n_slots = n_steps * config.slots
    counts = np.bincount(slot[order], weights=sizes, minlength=n_slots).astype(np.int64)
    plan_offsets = np.concatenate([[0], np.cumsum(counts)])
    truncate_to = np.zeros(len(slot_members), dtype=np.int32)
    if len(cut):
        truncate_to[np.isin(slot_members, cut)] = gpu_caps.max_tokens * config.context_parallel
    plan = Plan(config, seed, epoch, gpu_caps.per_gpu, plan_offsets, slot_members, truncate_to, oversize,
                index_fingerprint)
    plan.cp_degree = np.repeat(degree[order], sizes)
    plan.cp_group = np.repeat(group[order], sizes)
    plan.pack_vision = np.bincount(slot, weights=segment_sum(loads.vision[members], offsets),
                                   minlength=n_slots).astype(np.int64)
    plan.pack_tokens = np.bincount(slot, weights=segment_sum(tokens[members], offsets), minlength=n_slots).astype(np.int64)
    plan.seconds = time.perf_counter() - started
    return plan


def _static_cp_packs(loads, caps: Caps, config: PlanConfig, rng):
    """Static context parallelism: ISF packs under the whole CP group's caps (C x N tokens, C x the vision units),
    a sample within C x N tokens but above the vision cap alone, longer ones the oversize policy's. Returns
    (packs, oversize, cut, tokens, the group's caps)."""
    group = cp.CpCaps(cp.cp_caps(caps, config).scaled(config.context_parallel), 1)
    short, alone, _, oversize, cut, tokens = cp.split_by_degree(loads, group, config.oversize)
    packs, _, _, _ = _isf_packs(cp.with_valid(loads, short), group.per_gpu, config, rng)
    return _with_singletons(packs, alone, loads.vision, tokens), oversize, cut, tokens, group.per_gpu


def _with_singletons(packs: IsfPacks, ids: np.ndarray, vision: np.ndarray, tokens: np.ndarray) -> IsfPacks:
    """`packs` followed by a pack of its own for each sample `ids`."""
    ids = ids.astype(np.int64)
    return _joined(packs, IsfPacks(ids, np.arange(len(ids) + 1), vision[ids], tokens[ids]))


def _joined(first: IsfPacks, then: IsfPacks) -> IsfPacks:
    """The packs of `first`, then those of `then`."""
    return IsfPacks(np.concatenate([first.members, then.members.astype(first.members.dtype)]),
                    np.concatenate([first.offsets, first.offsets[-1] + then.offsets[1:]]),
                    np.concatenate([first.vision, then.vision]), np.concatenate([first.tokens, then.tokens]))


def _pack_ranks(offsets: np.ndarray, config: PlanConfig) -> np.ndarray:
    """Per member, the rank whose pack holds it (packs are in step-major (step, rank, microbatch) order)."""
    pack_rank = (np.arange(len(offsets) - 1) // config.microbatches) % config.dp
    return np.repeat(pack_rank, np.diff(offsets)).astype(np.int64)


def resolve_caps(loads: SampleLoads, config: PlanConfig) -> Caps:
    """Caps from the config, completed with default targets, or searched from the data."""
    if config.vision_cap is not None:
        vt, tt = default_targets(config.vision_cap, config.token_cap)
        return Caps(config.vision_cap, config.token_cap,
                    config.vision_target if config.vision_target is not None else vt,
                    config.token_target if config.token_target is not None else tt)
    valid = loads.valid
    if not valid.any():
        return Caps(1, 1, 1, 1)  # nothing to pack: the plan is empty whatever the caps
    everything = valid.all()
    caps, _ = search_caps(loads.vision if everything else loads.vision[valid],
                          loads.tokens if everything else loads.tokens[valid], config.dp, config.samples_per_pack,
                          config.isf_iterations)
    if config.vision_target is not None or config.token_target is not None:
        caps = Caps(caps.vision_cap, caps.token_cap,
                    config.vision_target if config.vision_target is not None else caps.vision_target,
                    config.token_target if config.token_target is not None else caps.token_target)
    return caps


def _isf_packs(loads, caps: Caps, config: PlanConfig, rng):
    """ISF packs of the samples that fit, plus the oversize policy. Returns (packs, oversize, cut, tokens):
    `cut` are the samples whose tokens the `truncate` policy cuts to the token cap, `tokens` every sample's
    tokens as planned (cut ones at the cap; the index's own array when nothing is cut)."""
    vision, tokens = loads.vision, loads.tokens
    # int32 ids below 2^31 samples halve the largest arrays of planning.
    valid_ids = _flatnonzero(loads.valid, np.int32 if len(loads) < 2**31 else np.int64)
    vision_over = vision[valid_ids] > caps.vision_cap
    token_over = tokens[valid_ids] > caps.token_cap
    over = vision_over | token_over
    oversize = valid_ids[over].astype(np.int64)
    alone = oversize if config.oversize is Oversize.ALONE else np.empty(0, dtype=np.int64)
    cut = np.empty(0, dtype=np.int64)
    if config.oversize is Oversize.TRUNCATE:
        # Text can be cut to the token cap; too many vision units cannot, so those travel alone.
        cut = valid_ids[token_over & ~vision_over].astype(np.int64)
        alone = valid_ids[vision_over].astype(np.int64)
        over = vision_over
        if len(cut):
            tokens = tokens.copy()
            tokens[cut] = caps.token_cap
    fits = valid_ids[~over]
    del valid_ids, vision_over, token_over, over
    packs = isf(fits, vision, tokens, caps, config.isf_iterations, rng)
    if len(alone):
        packs = _with_singletons(packs, alone, vision, tokens)
    return packs, oversize, cut, tokens


def _arrange_packs(loads, costs, packs: IsfPacks, config: PlanConfig, streams, caps: Caps):
    """Order packs into steps x ranks x microbatches (`costs`: every sample's, `sample_costs`). Returns the pack
    sequence (-1 = empty pack), the packs' loads extended by those of the pieces the last step was split into,
    and the pieces' members (pack `len(packs) + k` is piece k: the members array is not copied for a handful of
    pieces)."""
    slots, dp, m = config.slots, config.dp, config.microbatches
    safe = collective_safe_layout(config)
    towers = sample_towers(loads) if safe else None
    pack_class = pack_classes(packs.members, packs.offsets, towers) if safe else np.zeros(len(packs.tokens), np.int64)
    if safe:
        packs, pack_class = merge_to_whole_columns(packs, pack_class, caps.vision_cap, caps.token_cap, dp)
        packs, pack_class = split_to_whole_columns(packs, pack_class, towers, loads.vision, loads.tokens, dp, caps)
    pack_cv, pack_cl = _pack_costs(packs.members, packs.offsets, costs)
    pack_cost = pack_cv + pack_cl
    members, offsets, pack_v, pack_t = packs.members, packs.offsets, packs.vision, packs.tokens

    if config.strategy is Strategy.ISF:
        # OmniBal's published behaviour: packs go to steps and ranks in random order.
        shuffled = streams[_STREAM_STEPS].permutation(len(pack_cost))
        if safe:
            full, rest = aligned_steps(shuffled, pack_class, pack_cost, dp, m)
        else:
            n_rest = len(shuffled) % slots
            full, rest = shuffled[:len(shuffled) - n_rest].reshape(-1, slots), shuffled[len(shuffled) - n_rest:]
    else:
        if safe:
            full, rest = aligned_steps(similar_order(pack_v, pack_t), pack_class, pack_cost, dp, m)
        else:
            full, rest = form_steps(pack_v, pack_t, pack_cost, slots)
        full = full[streams[_STREAM_STEPS].permutation(len(full))]

    # The last, partial step: split its packs so every rank still gets work where samples allow. Collective-safe,
    # only its packs that call no tower where that feeds as many slots (pieces of a pack with images could land
    # on some ranks' microbatch only): the others stay whole, in the whole columns their classes fill.
    pieces = []
    if len(rest):
        def cost(ids):
            return costs[ids].sum(axis=1, dtype=np.float64)

        pieces = split_for_last_step([members[offsets[p]:offsets[p + 1]] for p in rest], cost, slots)
        if safe:
            kept = rest[pack_class[rest] != 0]
            aligned = [members[offsets[p]:offsets[p + 1]] for p in kept] + split_for_last_step(
                [members[offsets[p]:offsets[p + 1]] for p in rest[pack_class[rest] == 0]], cost, slots - len(kept))
            pieces = aligned if len(aligned) >= len(pieces) else pieces
        first_new = len(pack_cost)
        pack_v = np.concatenate([pack_v, [loads.vision[piece].sum() for piece in pieces]])
        pack_t = np.concatenate([pack_t, [loads.tokens[piece].sum() for piece in pieces]])
        pack_cv = np.concatenate([pack_cv, [encoder_costs(costs[piece]).sum(dtype=np.float64) for piece in pieces]])
        pack_cl = np.concatenate([pack_cl, [costs[piece, 1].sum(dtype=np.float64) for piece in pieces]])
        pack_cost = pack_cv + pack_cl
        pack_class = np.concatenate([pack_class, [np.bitwise_or.reduce(towers[piece]) if safe else 0
                                                  for piece in pieces]]).astype(np.int64)
        last = np.full(slots, -1, dtype=np.int64)
        last[:len(pieces)] = first_new + np.arange(len(pieces))
        full = np.vstack([full, last[None, :]])

    if config.strategy is Strategy.ISF:
        if safe and len(rest):
            full[-1] = class_layout(full[-1], pack_class, dp, m)
        grid = full.reshape(-1, dp, m)
    else:
        # isf+phases and encoder ranks of its own encode apart from the packs: the LLM's ranks are balanced on
        # its cost alone
        phases = config.strategy is Strategy.ISF_PHASES or config.disaggregated
        grid = assign_ranks(full, pack_cl if phases else pack_cost, pack_class, dp, m, phases, safe)
        # Which rank gets the heaviest pack is arbitrary; rotate it so no rank is systematically heavier.
        grid = permute_ranks(grid, streams[_STREAM_RANKS].random((len(grid), dp)))
        if config.pipeline_stages > 1 and m > 1:
            grid = _order_for_pipeline(grid, pack_cv, pack_cl, config.pipeline_stages, safe)
    return grid.reshape(-1), IsfPacks(members, offsets, pack_v, pack_t), pieces


def _order_for_pipeline(grid, pack_cv, pack_cl, stages, columns):
    """MMScale inter-microbatch reordering of every rank's M packs for 1F1B; `columns` (collective-safe plans):
    one order of the microbatch indices for every rank of a step, from each index's mean over the ranks, so
    columns stay whole."""
    if grid.size == 0:
        return grid
    real = grid >= 0
    safe = np.where(real, grid, 0)
    cv = np.where(real, pack_cv[safe], 0.0)
    cl = np.where(real, pack_cl[safe], 0.0)
    if columns:
        cv, cl = cv.mean(axis=1, keepdims=True), cl.mean(axis=1, keepdims=True)
    fv, fl = stage_fractions(float(pack_cv.mean()), float(pack_cl.mean()), stages)
    forward, backward = stage_times(cv.reshape(-1), cl.reshape(-1), fv, fl)
    shape = (cv.shape[0] * cv.shape[1], grid.shape[2], stages)
    order = inter_reorder_many(forward.reshape(shape), backward.reshape(shape))
    if columns:
        order = np.repeat(order, grid.shape[1], axis=0)
    flat = grid.reshape(-1, grid.shape[2])
    return np.take_along_axis(flat, order, axis=1).reshape(grid.shape)


def _flatnonzero(mask: np.ndarray, dtype) -> np.ndarray:
    """np.flatnonzero straight into `dtype` (no int64 temporary of the whole index)."""
    out = np.empty(int(np.count_nonzero(mask)), dtype=dtype)
    _fill_nonzero(mask, out)
    return out


@numba.njit(cache=True, nogil=True)
def _fill_nonzero(mask, out):
    k = 0
    for i in range(len(mask)):
        if mask[i]:
            out[k] = i
            k += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def _pack_costs(members, offsets, costs):
    """Per pack: (every encoder's cost, LLM cost), summed in float64, packs in parallel (each sums its own members
    in order, so the sums do not depend on the thread count)."""
    n = len(offsets) - 1
    pack_cv = np.zeros(n)
    pack_cl = np.zeros(n)
    for p in numba.prange(n):
        for k in range(offsets[p], offsets[p + 1]):
            pack_cl[p] += costs[members[k], 1]
            pack_cv[p] += costs[members[k], 0]
            for j in range(2, costs.shape[1]):  # further encoders run before the LLM too
                pack_cv[p] += costs[members[k], j]
    return pack_cv, pack_cl


def _csr(pieces: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(piece) for piece in pieces], out=offsets[1:])
    members = np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype=dtype)
    return members, offsets


@numba.njit(cache=True, nogil=True, parallel=True)
def _gather(sequence, members, offsets, extra_members, extra_offsets):
    """Re-lay packs out in `sequence` order (-1 = empty pack; p >= len(offsets) - 1 = extra pack
    p - (len(offsets) - 1)); returns (offsets, members)."""
    n_base = len(offsets) - 1
    new_offsets = np.zeros(len(sequence) + 1, dtype=np.int64)
    for q in range(len(sequence)):
        p = sequence[q]
        size = 0
        if p >= n_base:
            size = extra_offsets[p - n_base + 1] - extra_offsets[p - n_base]
        elif p >= 0:
            size = offsets[p + 1] - offsets[p]
        new_offsets[q + 1] = new_offsets[q] + size
    out = np.empty(new_offsets[-1], dtype=members.dtype)
    for q in numba.prange(len(sequence)):
        p = sequence[q]
        if p >= n_base:
            out[new_offsets[q]:new_offsets[q + 1]] = extra_members[extra_offsets[p - n_base]:
                                                                   extra_offsets[p - n_base + 1]]
        elif p >= 0:
            out[new_offsets[q]:new_offsets[q + 1]] = members[offsets[p]:offsets[p + 1]]
    return new_offsets, out


