"""Groups of samples that share a prefix, planned as units.

A group's members (GRPO's G responses to one prompt, a preference pair, the branches of a conversation) share
their first `prefix` tokens: the prompt, with every image of the sample in it. The planner keeps a group's
members in one pack where they fit, and a group too big for one pack in as few packs as hold it, each of them
carrying the prefix once. It does so by planning *units*, a piece of a group or a sample alone, with every
guarantee it gives samples (each unit once, caps, collective safety, pipeline order), and then putting each
unit's samples in its place (`expanded`).

A unit's loads count its prefix once: the vision units and ViT work of the prefix's images, P + sum(R_i)
LLM tokens (R_i = a member's tokens after the prefix), and P^2 + sum((P + R_i)^2 - P^2) attention squares, since
each response attends to the prefix and to itself, never to a sibling (the trainer's layout, docs/planning.md
"Groups").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from packfeed.server.index.table import check_groups
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.collective import sample_towers, unaligned_towers
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.trees import is_tree, tree_keys, tree_savings, tree_unit_loads
from packfeed.v1.options import PlanConfig


@dataclass(frozen=True)
class Units:
    """The samples of an epoch as the planner's units: unit u is samples `members[offsets[u]:offsets[u + 1]]`
    (a piece of a group, or one sample), with its loads as row u of `loads`."""

    members: np.ndarray
    offsets: np.ndarray
    loads: SampleLoads


def grouped(loads: Any) -> bool:
    """The loads name groups (an index with a group column, a live job's samples with groups)."""
    return getattr(loads, "group", None) is not None


def shares_prefixes(loads: Any, config: PlanConfig) -> bool:
    """`make_plan` plans these loads in units (`PlanConfig.shares_prefixes`, the one answer)."""
    return config.shares_prefixes(grouped(loads))


def check_shared_plan(loads: Any, config: PlanConfig) -> None:
    """Refuses, naming the way out, what a plan sharing prefixes does not cover."""
    refusal = config.prefix_sharing_refusal(further_encoders=bool(getattr(loads, "encoders", None)))
    if refusal:
        raise ValueError(refusal)


def caps_for(loads: SampleLoads, config: PlanConfig, caps: Caps | None) -> Caps:
    """The caps a plan sharing prefixes plans its units under: given, or searched on the samples each alone, as
    without sharing (caps are a memory budget: the same whether prefixes are shared or not, so a shared plan holds
    the same samples in fewer, fuller packs)."""
    check_shared_plan(loads, config)
    return caps or resolve_caps(loads, config)


def group_units(loads: SampleLoads, caps: Caps | None, halvings: int = 0) -> Units:
    """The units of `loads` under `caps` (None: no cap, every group whole). Members that fit the caps alone make
    their group's units: one where the prefix and all their responses fit, else as few as first-fit-decreasing
    on the responses finds. A member over a cap alone is a unit of its own, for the oversize policy. `halvings`:
    the units of groups calling a tower cut into 2^halvings pieces of consecutive members (each with the prefix),
    for collective safety (`aligned_units`). Units are in the order of their first sample id."""
    group, prefix = np.asarray(loads.group, np.int64), np.asarray(loads.prefix, np.int64)
    valid = np.asarray(loads.valid, bool)
    vision, tokens = np.asarray(loads.vision, np.int64), np.asarray(loads.tokens, np.int64)
    ids = np.flatnonzero(valid & (group >= 0))
    ids = ids[np.lexsort((ids, group[ids]))]  # by group, then id
    tree = is_tree(loads)
    if not tree:
        check_groups(np.where(valid, group, -1), prefix, vision, tokens)
    fits = np.ones(len(ids), bool) if caps is None else \
        (vision[ids] <= caps.vision_cap) & (tokens[ids] <= caps.token_cap)
    key = ids.copy()  # a member's unit is named by its first sample id
    together = ids[fits]
    if tree:
        key[fits] = tree_keys(loads, together, caps)
    elif len(together):
        run = np.flatnonzero(np.r_[True, group[together][1:] != group[together][:-1]])
        sizes = np.diff(np.r_[run, len(together)])
        key[fits] = np.repeat(together[run], sizes)
        if caps is not None:
            needed = np.add.reduceat(tokens[together] - prefix[together], run) + prefix[together[run]]
            for r in np.flatnonzero(needed > caps.token_cap):
                piece = slice(run[r], run[r] + sizes[r])
                key[np.flatnonzero(fits)[piece]] = _pieces(together[piece], tokens, prefix, caps.token_cap)
    if halvings:
        _halve(key, ids[fits], np.flatnonzero(fits), np.asarray(loads.towers), halvings)
        if tree and caps is not None:  # a piece whose forks lost their parents may exceed the caps: cut it again
            at = np.flatnonzero(fits)
            at = at[np.lexsort((ids[at], key[at]))]
            key[at] = tree_keys(loads, ids[at], caps, by=key[at])
    alone = np.flatnonzero(valid & (group < 0))
    members = np.concatenate([ids, alone])
    keys = np.concatenate([key, alone])
    shared = np.concatenate([fits, np.zeros(len(alone), bool)])
    order = np.lexsort((members, keys))
    members, keys, shared = members[order], keys[order], shared[order]
    unit_starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    offsets = np.r_[unit_starts, len(members)].astype(np.int64)
    unit_loads = tree_unit_loads(loads, members, unit_starts, keys) if tree else \
        _unit_loads(loads, members, unit_starts, shared, prefix, tokens)
    return Units(members, offsets, unit_loads)


def _halve(key: np.ndarray, shared_ids: np.ndarray, at: np.ndarray, towers: np.ndarray, halvings: int) -> None:
    """Cut each unit of members calling a tower into 2^halvings pieces of consecutive members (in `key`, in place,
    each piece named by its first sample id)."""
    calling = towers[shared_ids] > 0
    place = at[calling]
    by_unit = np.lexsort((shared_ids[calling], key[place]))  # by unit, then id
    order, sample = place[by_unit], shared_ids[calling][by_unit]
    if not len(order):
        return
    unit = key[order]
    starts = np.flatnonzero(np.r_[True, unit[1:] != unit[:-1]])
    size = np.diff(np.r_[starts, len(order)])
    piece = (np.arange(len(order)) - np.repeat(starts, size)) * (1 << halvings) // np.repeat(size, size)
    new = np.r_[True, (unit[1:] != unit[:-1]) | (piece[1:] != piece[:-1])]
    key[order] = np.repeat(sample[new], np.diff(np.r_[np.flatnonzero(new), len(order)]))


def aligned_units(loads: SampleLoads, config: PlanConfig, caps: Caps, plan_units) -> tuple[Units, Any]:
    """The units and their plan (`plan_units(units)`), collective-safe where the data allows: a group stays whole
    in one pack, but where that leaves a microbatch calling a tower on some ranks only (`_unaligned`), its
    tower-calling groups are cut in two, four, eight pieces (each with its prompt, in as many packs) and planned
    again; the plan with the fewest such microbatches is kept, the fewest cuts on a tie. A pure function of its
    inputs."""
    units = group_units(loads, caps)
    plan = plan_units(units)
    if not config.collective_safe:
        return units, plan
    best = (_unaligned(plan, units.loads), units, plan)
    for halvings in (1, 2, 3):
        if best[0] == 0:
            break
        split = group_units(loads, caps, halvings)
        if len(split.offsets) == len(units.offsets):  # nothing left to cut
            break
        units = split
        candidate = plan_units(units)
        if (count := _unaligned(candidate, units.loads)) < best[0]:
            best = (count, units, candidate)
    return best[1], best[2]


def _unaligned(plan: Any, loads: SampleLoads) -> int:
    """Microbatches calling a tower on some ranks only where cutting groups is worth it: in every step but the
    epoch's last, whose partial packs are laid out as well as the data allows with groups or without (cutting
    every group for them would give up the epoch's sharing), or in the one step of a one-step plan (a live step)."""
    unaligned = unaligned_towers(plan.offsets, np.arange(len(plan.members)), sample_towers(loads, plan.members),
                                 plan.config.dp, plan.config.microbatches)
    return int(np.count_nonzero(unaligned[:-1] if len(unaligned) > 1 else unaligned))


def _pieces(members: np.ndarray, tokens: np.ndarray, prefix: np.ndarray, token_cap: int) -> np.ndarray:
    """Each member's piece of a group too big for one pack, named by the piece's first sample id: first-fit-
    decreasing of the responses into pieces of token_cap - P (each response fits: its member fits the cap)."""
    room = token_cap - int(prefix[members[0]])
    responses = tokens[members] - prefix[members]
    order = np.lexsort((members, -responses))  # largest first, ties by id
    loads: list[int] = []
    piece_of = np.empty(len(members), np.int64)
    for k in order:
        piece = next((b for b, used in enumerate(loads) if used + responses[k] <= room), len(loads))
        if piece == len(loads):
            loads.append(0)
        loads[piece] += int(responses[k])
        piece_of[k] = piece
    first_ids = np.full(len(loads), np.iinfo(np.int64).max)
    np.minimum.at(first_ids, piece_of, members)
    return first_ids[piece_of]


def _unit_loads(loads: SampleLoads, members, starts, shared, prefix, tokens) -> SampleLoads:
    """One row per unit: the prefix counted once where its members share it, a sample's own loads where alone."""
    if not len(members):
        empty = np.zeros(0, np.int64)
        return SampleLoads(np.zeros(0, bool), *(empty.astype(t) for t in (np.int32, np.int32, np.float32,
                                                                          np.float32)))
    own = np.where(shared, prefix[members], 0)  # the prefix each member's unit counts once
    t = tokens[members]
    unit_tokens = np.add.reduceat(t - own, starts) + np.maximum.reduceat(own, starts)
    squares = np.add.reduceat(t * t - own * own, starts) + np.maximum.reduceat(own * own, starts)
    in_group = np.maximum.reduceat(shared.astype(np.int8), starts).astype(bool)
    lead = members[starts]  # a group's vision is its prefix's: its first member's
    return SampleLoads(np.ones(len(starts), bool), np.asarray(loads.vision)[lead].astype(np.int32),
                       unit_tokens.astype(np.int32), np.asarray(loads.vit_patches)[lead].astype(np.float32),
                       np.asarray(loads.vit_attn_sq)[lead].astype(np.float32),
                       towers=np.asarray(loads.towers)[lead].astype(np.uint8),
                       llm_attn_sq=np.where(in_group, squares, np.nan).astype(np.float32))


def expanded(plan: Any, units: Units, loads: SampleLoads) -> Any:
    """A plan of units as the plan of their samples: each unit's members in its place, in id order."""
    sizes = np.diff(units.offsets)
    per_unit = sizes[plan.members]
    before = np.r_[0, np.cumsum(per_unit)]
    within = np.arange(before[-1]) - np.repeat(before[:-1], per_unit)
    members = units.members[np.repeat(units.offsets[plan.members], per_unit) + within].astype(
        plan.members.dtype if len(units.members) < 2**31 else np.int64)
    return replace(plan, members=members, offsets=before[plan.offsets].astype(np.int64),
                   truncate_to=np.repeat(plan.truncate_to, per_unit),
                   oversize=units.members[units.offsets[plan.oversize]].astype(np.int64),
                   groups=np.asarray(loads.group)[members].astype(np.int64))


def prefix_savings(members: np.ndarray, offsets: np.ndarray, loads: Any) -> dict[str, Any]:
    """What sharing prefixes saves in packs `members` / `offsets`: per pack, the vision units, LLM tokens and LLM
    attention squares of every prefix counted once instead of once per member ("vision", "tokens", "squares");
    and in all, the groups planned, those split over more than one pack, the prefix tokens and vision units
    saved."""
    if is_tree(loads):
        return tree_savings(members, offsets, loads)
    n_packs = len(offsets) - 1
    group = np.asarray(loads.group)[members]
    pack = np.repeat(np.arange(n_packs), np.diff(offsets))
    chosen = np.flatnonzero(group >= 0)
    order = chosen[np.lexsort((group[chosen], pack[chosen]))]
    g, p = group[order], pack[order]
    new = np.r_[True, (g[1:] != g[:-1]) | (p[1:] != p[:-1])] if len(order) else np.zeros(0, bool)
    repeated = order[~new]  # members after their group's first in a pack: their prefix is not counted again
    prefix = np.asarray(loads.prefix)[members[repeated]].astype(np.float64)
    saved_tokens = np.bincount(pack[repeated], prefix, n_packs).astype(np.int64)
    saved_vision = np.bincount(pack[repeated], np.asarray(loads.vision)[members[repeated]], n_packs).astype(np.int64)
    saved_squares = np.bincount(pack[repeated], prefix * prefix, n_packs)  # a response attends to P, not P x P
    groups = np.unique(g)
    packs_per_group = np.bincount(np.searchsorted(groups, g[new]), minlength=len(groups))
    return {"vision": saved_vision, "tokens": saved_tokens, "squares": saved_squares, "groups": int(len(groups)),
            "split_groups": int((packs_per_group > 1).sum()),
            "prefix_tokens_saved": int(saved_tokens.sum()), "vision_units_saved": int(saved_vision.sum())}


def group_summary(saved: dict[str, Any], shared: bool) -> dict[str, Any]:
    """A plan's groups (its summary's `groups`) from its `prefix_savings`: how many were planned, how many over
    more than one pack, and what counting each prefix once per pack saves (0 where the plan does not share them,
    `shared_prefix` false)."""
    out = {name: saved[name] for name in ("groups", "split_groups", "prefix_tokens_saved", "vision_units_saved")}
    if not shared:
        out.update(prefix_tokens_saved=0, vision_units_saved=0)
    return {"shared_prefix": shared, **out}
