"""An epoch's packs before they are arranged into steps: ISF packs under the caps, the oversize policy for the
samples above them, and in a collective-safe plan the merges and splits that let every tower class fill whole
columns. The plan arranges these packs (`planner`); a job's step count is their number (`planner.count_steps`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.server.plan import context_parallel as cp
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.collective import collective_safe_layout, pack_classes, sample_towers
from packfeed.server.plan.collective_packs import merge_to_whole_columns, split_to_whole_columns
from packfeed.server.plan.isf import Caps, IsfPacks, isf
from packfeed.server.plan.pack_arrays import flatnonzero, with_singletons
from packfeed.v1.options import Oversize, PlanConfig


@dataclass(frozen=True)
class FormedPacks:
    """An epoch's packs before they are arranged into steps, and what forming them decided."""

    packs: IsfPacks
    pack_class: np.ndarray  # the towers each pack calls (collective-safe plans; else zeros)
    towers: np.ndarray | None  # per sample (collective-safe plans)
    oversize: np.ndarray
    cut: np.ndarray  # samples the `truncate` policy cuts to the token cap
    tokens: np.ndarray  # every sample's tokens as planned (cut ones at the cap)
    caps: Caps


def formed_packs(loads, config: PlanConfig, caps: Caps | None, rng: np.random.Generator) -> FormedPacks:
    """ISF packs under the caps (a static CP group's, with context parallelism) and the oversize policy; in a
    collective-safe plan, merged and split so every tower class fills whole columns of dp packs."""
    caps = caps or resolve_caps(loads, config)
    if config.context_parallel > 1:  # static: every pack over the whole CP group
        packs, oversize, cut, tokens, caps = _static_cp_packs(loads, caps, config, rng)
    else:
        packs, oversize, cut, tokens = isf_packs(loads, caps, config, rng)
    if not collective_safe_layout(config):
        return FormedPacks(packs, np.zeros(len(packs.tokens), np.int64), None, oversize, cut, tokens, caps)
    towers = sample_towers(loads)
    pack_class = pack_classes(packs.members, packs.offsets, towers)
    packs, pack_class = merge_to_whole_columns(packs, pack_class, caps.vision_cap, caps.token_cap, config.dp)
    packs, pack_class = split_to_whole_columns(packs, pack_class, towers, loads.vision, tokens, config.dp, caps)
    return FormedPacks(packs, pack_class, towers, oversize, cut, tokens, caps)


def isf_packs(loads, caps: Caps, config: PlanConfig, rng):
    """ISF packs of the samples that fit, plus the oversize policy. Returns (packs, oversize, cut, tokens):
    `cut` are the samples whose tokens the `truncate` policy cuts to the token cap, `tokens` every sample's
    tokens as planned (cut ones at the cap; the index's own array when nothing is cut)."""
    vision, tokens = loads.vision, loads.tokens
    # int32 ids below 2^31 samples halve the largest arrays of planning.
    valid_ids = flatnonzero(loads.valid, np.int32 if len(loads) < 2**31 else np.int64)
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
        packs = with_singletons(packs, alone, vision, tokens)
    return packs, oversize, cut, tokens


def _static_cp_packs(loads, caps: Caps, config: PlanConfig, rng):
    """Static context parallelism: ISF packs under the whole CP group's caps (C x N tokens, C x the vision units),
    a sample within C x N tokens but above the vision cap alone, longer ones the oversize policy's. Returns
    (packs, oversize, cut, tokens, the group's caps)."""
    group = cp.CpCaps(cp.cp_caps(caps, config).scaled(config.context_parallel), 1)
    short, alone, _, oversize, cut, tokens = cp.split_by_degree(loads, group, config.oversize)
    packs, _, _, _ = isf_packs(cp.with_valid(loads, short), group.per_gpu, config, rng)
    return with_singletons(packs, alone, loads.vision, tokens), oversize, cut, tokens, group.per_gpu
