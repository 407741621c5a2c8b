"""Dynamic context-parallel plans (`context_parallel` holds the degrees and caps): ISF packs of the samples one
GPU holds at degree 1, each longer sample alone at the fewest GPUs that hold it, all placed on every step's GPUs:
filling them in turn (`context_parallel.place`) or, in a collective-safe plan, in whole columns of one tower
class over every GPU (`cp_columns`). A job's step count needs the placement's steps, not the plan built from it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from packfeed.server.plan import context_parallel as cp
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.collective import collective_safe_layout, pack_classes, sample_towers
from packfeed.server.plan.costs import SampleLoads, sample_costs
from packfeed.server.plan.cp_columns import CpPacks, place_in_columns, steps_in_columns
from packfeed.server.plan.forming import isf_packs
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.pack_arrays import gather, joined, pack_costs
from packfeed.server.plan.plan_file import Plan, segment_sum
from packfeed.v1.options import PlanConfig


@dataclass(frozen=True)
class _DegreePacks:
    """Packs before placement: pack p is members[offsets[p]:offsets[p + 1]] over degree[p] GPUs."""

    members: np.ndarray
    offsets: np.ndarray
    degree: np.ndarray
    pack_cost: np.ndarray
    sample_cost: np.ndarray  # every sample's whole work (all towers and the LLM)
    pack_class: np.ndarray | None  # the towers each pack calls, in a collective-safe plan
    tokens: np.ndarray  # every sample's tokens as planned (cut ones at the cap)
    gpu_caps: cp.CpCaps
    oversize: np.ndarray
    cut: np.ndarray

    def laid(self) -> CpPacks:
        """The packs as `cp_columns` splits and widens them (its own copy)."""
        return CpPacks([self.members[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])],
                       self.degree.copy(), self.pack_cost.copy(), self.pack_class)


def dynamic_cp_steps(loads: SampleLoads, config: PlanConfig, caps: Caps | None, isf_rng: np.random.Generator,
                     steps_rng: np.random.Generator) -> int:
    """The steps `dynamic_cp_plan` plans with the same arguments, without placing the packs in them."""
    packs = _degree_packs(loads, config, caps, isf_rng)
    if packs.pack_class is not None:
        return steps_in_columns(packs.laid(), packs.sample_cost, packs.tokens, loads.vision, packs.gpu_caps,
                                config.dp, config.microbatches)
    return cp.placed_steps(packs.pack_cost, packs.degree, config.dp, config.microbatches, config.context_parallel,
                           steps_rng)


def dynamic_cp_plan(loads: SampleLoads, config: PlanConfig, seed: int, epoch: int, index_fingerprint: str,
                    caps: Caps | None, isf_rng: np.random.Generator, steps_rng: np.random.Generator) -> Plan:
    """The epoch's plan: each slot's packs by their first lane."""
    packs = _degree_packs(loads, config, caps, isf_rng)
    members, offsets, degree = packs.members, packs.offsets, packs.degree
    if packs.pack_class is not None:
        laid = packs.laid()
        (step, rank, microbatch, group), n_steps = place_in_columns(
            laid, packs.sample_cost, packs.tokens, loads.vision, packs.gpu_caps, config.dp, config.microbatches,
            steps_rng)
        members, degree = np.concatenate([members[:0], *laid.members]).astype(np.int64), laid.degree
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in laid.members])]).astype(np.int64)
    else:
        (step, rank, microbatch, group), n_steps = cp.place(packs.pack_cost, degree, config.dp, config.microbatches,
                                                            config.context_parallel, steps_rng)
    slot = (step * config.dp + rank) * config.microbatches + microbatch
    order = np.lexsort((group * degree, slot))
    _, slot_members = gather(order, members, offsets, np.empty(0, members.dtype), np.zeros(1, np.int64))
    sizes = np.diff(offsets)[order]
    n_slots = n_steps * config.slots
    counts = np.bincount(slot[order], weights=sizes, minlength=n_slots).astype(np.int64)
    truncate_to = np.zeros(len(slot_members), dtype=np.int32)
    if len(packs.cut):
        truncate_to[np.isin(slot_members, packs.cut)] = packs.gpu_caps.max_tokens * config.context_parallel
    return Plan(config, seed, epoch, packs.gpu_caps.per_gpu, np.concatenate([[0], np.cumsum(counts)]), slot_members,
                truncate_to, packs.oversize, index_fingerprint, cp_degree=np.repeat(degree[order], sizes),
                cp_group=np.repeat(group[order], sizes),
                pack_vision=np.bincount(slot, weights=segment_sum(loads.vision[members], offsets),
                                        minlength=n_slots).astype(np.int64),
                pack_tokens=np.bincount(slot, weights=segment_sum(packs.tokens[members], offsets),
                                        minlength=n_slots).astype(np.int64))


def _degree_packs(loads: SampleLoads, config: PlanConfig, caps: Caps | None, rng: np.random.Generator) -> _DegreePacks:
    caps = caps or resolve_caps(loads, config)
    gpu_caps = cp.cp_caps(caps, config)
    short, alone, alone_degrees, oversize, cut, tokens = cp.split_by_degree(loads, gpu_caps, config.oversize)
    long_packs, short = cp.top_up(alone, alone_degrees, short, loads.vision, tokens, gpu_caps)
    packs, _, _, _ = isf_packs(cp.with_valid(loads, short), gpu_caps.per_gpu, config, rng)
    packs = joined(packs, long_packs)
    members, offsets = packs.members.astype(np.int64), packs.offsets
    degree = np.concatenate([np.ones(len(packs.tokens) - len(alone), dtype=np.int64), alone_degrees])
    costs = sample_costs(config.cost_model, replace(loads, tokens=tokens))
    pack_cv, pack_cl = pack_costs(members, offsets, costs)
    pack_class = pack_classes(members, offsets, sample_towers(loads)) if collective_safe_layout(config) else None
    return _DegreePacks(members, offsets, degree, pack_cv + pack_cl, costs.sum(axis=1, dtype=np.float64), pack_class,
                        tokens, gpu_caps, oversize, cut)
