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
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from packfeed.server.plan.balance import assign_ranks, form_steps, permute_ranks, similar_order, split_for_last_step
from packfeed.server.plan.collective import aligned_steps, class_layout, collective_safe_layout
from packfeed.server.plan.costs import SampleLoads, encoder_costs, encoder_names, sample_costs
from packfeed.server.plan.dynamic_cp import dynamic_cp_plan, dynamic_cp_steps
from packfeed.server.plan.forming import FormedPacks, formed_packs
from packfeed.server.plan.groups import aligned_units, caps_for, expanded, group_units, shares_prefixes
from packfeed.server.plan.isf import Caps, IsfPacks
from packfeed.server.plan.pack_arrays import csr, gather, pack_costs
from packfeed.server.plan.pipeline_order import inter_reorder_many, stage_fractions, stage_times
from packfeed.server.plan.padded import padded_batches
from packfeed.server.plan.phases import Phase, phase_plan
from packfeed.server.plan.plan_file import Plan
from packfeed.v1.options import CpMode, PlanConfig, Strategy

# Independent random streams per purpose, so changing one stage never shifts another's randomness.
_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES = 1, 2, 3, 4


def make_plan(loads: SampleLoads, config: PlanConfig, seed: int, epoch: int, index_fingerprint: str = "",
              caps: Caps | None = None, window: int | None = None) -> Plan:
    """Plan one epoch. `caps` short-circuits the automatic search (e.g. reuse it across epochs). `window`: these
    loads are one window of an epoch planned window by window (`packfeed.server.plan.windows`), which draws
    randomness of its own. Groups sharing a prefix are planned as units (`packfeed.server.plan.groups`). The
    route is the first of `ROUTES` that applies."""
    started = time.perf_counter()
    plan = _route(loads, config).plan(loads, config, seed, epoch, index_fingerprint, caps, window)
    return replace(plan, seconds=time.perf_counter() - started)


def count_steps(loads: SampleLoads, config: PlanConfig, seed: int, epoch: int, caps: Caps | None = None) -> int:
    """The steps `make_plan` plans for this epoch (its `n_steps`), without arranging them: its packs are formed as
    the plan forms them and counted, `slots` to a step and the last step whatever is left (so a step count is
    the packs' count, whatever the arrangement). Dynamic context parallelism places its packs, where steps
    depend on placement, and builds nothing more. A job sizes its length from every epoch's count."""
    return _route(loads, config).count(loads, config, seed, epoch, caps)


@dataclass(frozen=True)
class PlanRoute:
    """One way an epoch is planned: when it applies, how it plans, and how it counts its steps without planning."""

    name: str
    applies: Callable[[SampleLoads, PlanConfig], bool]
    plan: Callable[..., Plan]  # (loads, config, seed, epoch, index_fingerprint, caps, window) -> Plan
    count: Callable[..., int]  # (loads, config, seed, epoch, caps) -> steps


def _route(loads: SampleLoads, config: PlanConfig) -> PlanRoute:
    return next(route for route in ROUTES if route.applies(loads, config))


def _plan_shared(loads, config, seed, epoch, index_fingerprint, caps, window) -> Plan:
    caps = caps_for(loads, config, caps)
    units, plan = aligned_units(loads, config, caps, lambda units: make_plan(
        units.loads, config, seed, epoch, index_fingerprint, caps, window))
    return expanded(plan, units, loads)


def _count_shared(loads, config, seed, epoch, caps) -> int:
    caps = caps_for(loads, config, caps)
    if config.collective_safe:  # the units `aligned_units` keeps depend on the plans it makes
        return make_plan(loads, config, seed, epoch, caps=caps).n_steps
    return count_steps(group_units(loads, caps).loads, config, seed, epoch, caps)


def _plan_dynamic_cp(loads, config, seed, epoch, index_fingerprint, caps, window) -> Plan:
    streams = _streams(seed, epoch, window)
    return dynamic_cp_plan(loads, config, seed, epoch, index_fingerprint, caps, streams[_STREAM_ISF],
                           streams[_STREAM_STEPS])


def _count_dynamic_cp(loads, config, seed, epoch, caps) -> int:
    streams = _streams(seed, epoch, None)
    return dynamic_cp_steps(loads, config, caps, streams[_STREAM_ISF], streams[_STREAM_STEPS])


def _count_padded(loads, config, seed, epoch, caps) -> int:
    sequence, _, _ = padded_batches(loads, np.flatnonzero(loads.valid), config,
                                    _streams(seed, epoch, None)[_STREAM_BATCHES])
    return len(sequence) // config.slots


def _count_packed(loads, config, seed, epoch, caps) -> int:
    return -(-len(formed_packs(loads, config, caps, _streams(seed, epoch, None)[_STREAM_ISF]).packs.tokens)
             // config.slots)


def _plan_packs(loads, config, seed, epoch, index_fingerprint, caps, window) -> Plan:
    """The padded baselines' batches, or the ISF strategies' packs arranged into steps: the plan's packs as
    members and offsets, with what each strategy adds (truncations, CP degrees, the encoders' phase plan)."""
    streams = _streams(seed, epoch, window)
    oversize = cut = np.empty(0, dtype=np.int64)
    pieces = []
    if config.strategy.padded:
        caps = None
        sequence, packs_m, packs_o = padded_batches(loads, np.flatnonzero(loads.valid), config,
                                                     streams[_STREAM_BATCHES])
    else:
        formed = formed_packs(loads, config, caps, streams[_STREAM_ISF])
        caps, oversize, cut = formed.caps, formed.oversize, formed.cut
        loads = replace(loads, tokens=formed.tokens)  # the planner sees truncated samples at their cut length
        costs = sample_costs(config.cost_model, loads)
        sequence, packs, pieces = _arrange_packs(loads, costs, formed, config, streams)
        packs_m, packs_o = packs.members, packs.offsets
        real = sequence >= 0
        pack_vision = np.where(real, packs.vision[np.where(real, sequence, 0)], 0)
        pack_tokens = np.where(real, packs.tokens[np.where(real, sequence, 0)], 0)

    offsets, members = gather(sequence, packs_m, packs_o, *csr(pieces, packs_m.dtype))
    truncate_to = np.zeros(len(members), dtype=np.int32)
    if len(cut):
        is_cut = np.zeros(len(loads), dtype=bool)
        is_cut[cut] = True
        truncate_to[is_cut[members]] = caps.token_cap
    extra: dict = {}
    if caps is not None:
        extra.update(pack_vision=pack_vision, pack_tokens=pack_tokens)
    if config.context_parallel > 1:
        extra.update(cp_degree=np.full(len(members), config.context_parallel, dtype=np.int64),
                     cp_group=np.zeros(len(members), dtype=np.int64))
    if config.strategy is Strategy.ISF_PHASES or config.disaggregated:
        encoders = [Phase("vision", 0, loads.vision)] + [
            Phase(name, 2 + k, loads.encoders[name].tokens, loads.encoders[name].padded)
            for k, name in enumerate(encoder_names(loads))]
        phases = phase_plan(offsets, members, costs, encoders, config.dp, config.microbatches,
                            min(config.ranks_per_node, config.dp), config.encoder_ranks)
        # colocated: the same packs, each encoded where it trains (the phase plan still says what routing saves)
        colocated = _pack_ranks(offsets, config) if config.colocate_encoder else None
        extra.update(phases=phases, encoder_rank=phases.vision.encoder_rank if colocated is None else colocated,
                     further_encoder_ranks={name: phase.encoder_rank if colocated is None else colocated
                                            for name, phase in phases.encoders.items() if name != "vision"})
    return Plan(config, seed, epoch, caps, offsets, members, truncate_to, oversize, index_fingerprint, **extra)


# The routes in the order they are tried: groups sharing a prefix are planned as units by the routes below; dynamic
# CP places its own packs; every other plan forms packs (or padded batches) and arranges them.
ROUTES = (
    PlanRoute("shared prefixes", shares_prefixes, _plan_shared, _count_shared),
    PlanRoute("dynamic context parallelism",
              lambda loads, config: config.context_parallel > 1 and config.cp_mode is CpMode.DYNAMIC,
              _plan_dynamic_cp, _count_dynamic_cp),
    PlanRoute("padded batches", lambda loads, config: config.strategy.padded, _plan_packs, _count_padded),
    PlanRoute("packs", lambda loads, config: True, _plan_packs, _count_packed),
)


def _streams(seed: int, epoch: int, window: int | None) -> dict[int, np.random.Generator]:
    seeds = np.random.SeedSequence([seed, epoch] + ([] if window is None else [window]))
    return {k: np.random.default_rng(s) for k, s in zip(
        (_STREAM_ISF, _STREAM_STEPS, _STREAM_RANKS, _STREAM_BATCHES), seeds.spawn(4))}


def _pack_ranks(offsets: np.ndarray, config: PlanConfig) -> np.ndarray:
    """Per member, the rank whose pack holds it (packs are in step-major (step, rank, microbatch) order)."""
    pack_rank = (np.arange(len(offsets) - 1) // config.microbatches) % config.dp
    return np.repeat(pack_rank, np.diff(offsets)).astype(np.int64)


def _arrange_packs(loads, costs, formed: FormedPacks, config: PlanConfig, streams):
    """Order packs into steps x ranks x microbatches (`costs`: every sample's, `sample_costs`). Returns the pack
    sequence (-1 = empty pack), the packs' loads extended by those of the pieces the last step was split into,
    and the pieces' members (pack `len(packs) + k` is piece k: the members array is not copied for a handful of
    pieces)."""
    slots, dp, m = config.slots, config.dp, config.microbatches
    safe = collective_safe_layout(config)
    packs, pack_class, towers = formed.packs, formed.pack_class, formed.towers
    pack_cv, pack_cl = pack_costs(packs.members, packs.offsets, costs)
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
