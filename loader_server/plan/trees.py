"""Trees of trajectories planned as units (docs/planning.md "Trees"): a group whose samples continue one another
(a fork holds its parent's first S tokens and its images there) is planned by what it computes once, its
unique tokens and vision units: a sample whose parent is in its unit adds its tokens after S and its own images;
one without (a root, or a fork whose parent is in another unit) adds its whole trajectory (its root path once).

A tree that fits the caps is one unit; a larger one is cut, in pre-order (a parent before its children, siblings
by id), into as few consecutive subtrees as first-fit finds, each carrying its root path once. A member over a
cap alone is a unit of its own (the oversize policy's). Units feed the planner as a group's do
(`packfeed.server.plan.groups`), with every guarantee it gives samples; a unit's loads are exact for any
membership (`tree_unit_loads`); a piece of a tree cut further for collective safety, whose forks' parents went
to another piece (they count whole there), is cut again where it exceeds the caps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.isf import Caps


def is_tree(loads: Any) -> bool:
    """The loads name parents (a live step with forks, an index of trajectories)."""
    return getattr(loads, "parent", None) is not None


def one_level(loads: SampleLoads) -> SampleLoads:
    """The trees' trajectories with one-level sharing only: each continuing its tree's first trajectory for its
    prompt (`loads.prompt` tokens and `loads.prompt_vision` units: what a group sharing one prompt shares)."""
    from dataclasses import replace

    group = np.asarray(loads.group, np.int64)
    ids = np.arange(len(group))
    first = np.full(int(group.max(initial=-1)) + 1, len(group), np.int64)
    np.minimum.at(first, group[group >= 0], ids[group >= 0])
    parent = np.where(group >= 0, first[np.maximum(group, 0)], -1)
    parent = np.where(parent == ids, -1, parent)
    shares = np.where(parent >= 0, np.asarray(loads.prompt, np.int64), 0)
    vision = np.where(parent >= 0, np.asarray(loads.prompt_vision, np.int64), 0)
    return replace(loads, parent=parent, prefix=shares.astype(np.int32), shared_vision=vision.astype(np.int32))


def tree_keys(loads: SampleLoads, ids: np.ndarray, caps: Caps | None, by: np.ndarray | None = None) -> np.ndarray:
    """Per member of `ids` (every one fits the caps alone, sorted by group then id), its unit's name: the first
    sample id of the subtree it is planned in. `by`: per member, the part of a tree it is in (sorted by it, then
    id), each part cut again only where it exceeds the caps (a piece of a tree cut for collective safety: its forks
    whose parents went to another piece count whole there); default each member's tree."""
    group = np.asarray(loads.group, np.int64)[ids] if by is None else np.asarray(by, np.int64)
    parent = np.asarray(loads.parent, np.int64)
    tokens, vision = np.asarray(loads.tokens, np.int64), np.asarray(loads.vision, np.int64)
    shares, shared_vision = np.asarray(loads.prefix, np.int64), np.asarray(loads.shared_vision, np.int64)
    key = ids.copy()
    if not len(ids):
        return key
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(ids)]):
        members = ids[a:b]
        inside = np.isin(parent[members], members)
        need_tokens = int((tokens[members] - np.where(inside, shares[members], 0)).sum())
        need_vision = int((vision[members] - np.where(inside, shared_vision[members], 0)).sum())
        if caps is None or (need_tokens <= caps.token_cap and need_vision <= caps.vision_cap):
            key[a:b] = members.min()
            continue
        key[a:b] = _subtrees(members, parent, tokens, vision, shares, shared_vision, caps)
    return key


def _subtrees(members, parent, tokens, vision, shares, shared_vision, caps: Caps) -> np.ndarray:
    """First-fit over the tree's members in pre-order: each subtree's name per member (its first sample id)."""
    member_set = set(members.tolist())
    children: dict[int, list[int]] = {}
    roots = []
    for k in sorted(member_set):
        p = int(parent[k])
        (children.setdefault(p, []) if p in member_set else roots).append(k)
    order, stack = [], roots[::-1]
    while stack:
        k = stack.pop()
        order.append(k)
        stack += children.get(k, [])[::-1]
    unit_of: dict[int, int] = {}
    current: list[int] = []
    used_tokens = used_vision = 0
    for k in order:
        inside = int(parent[k]) in unit_of and unit_of[int(parent[k])] == (current[0] if current else -1)
        add_tokens = int(tokens[k]) - (int(shares[k]) if inside else 0)
        add_vision = int(vision[k]) - (int(shared_vision[k]) if inside else 0)
        if current and (used_tokens + add_tokens > caps.token_cap or used_vision + add_vision > caps.vision_cap):
            current, used_tokens, used_vision = [], 0, 0
            add_tokens, add_vision = int(tokens[k]), int(vision[k])  # a new subtree: its root path whole
        current.append(k)
        unit_of[k] = current[0]
        used_tokens += add_tokens
        used_vision += add_vision
    first = {name: min(k for k, unit in unit_of.items() if unit == name) for name in set(unit_of.values())}
    return np.array([first[unit_of[int(k)]] for k in members], np.int64)


def tree_unit_loads(loads: SampleLoads, members: np.ndarray, starts: np.ndarray, keys: np.ndarray) -> SampleLoads:
    """One row per unit (members[starts[u]:starts[u + 1]], named by `keys`): a member whose parent is in its unit
    counts its tokens after S, its own images and the attention squares of its rows over its context; any other
    its whole trajectory. ViT work of inherited images is taken in proportion to their vision units."""
    inside = _with_parent(np.asarray(loads.parent, np.int64), members, keys)
    t = np.asarray(loads.tokens, np.int64)[members]
    v = np.asarray(loads.vision, np.int64)[members]
    s = np.where(inside, np.asarray(loads.prefix, np.int64)[members], 0)
    sv = np.where(inside, np.asarray(loads.shared_vision, np.int64)[members], 0)
    own = np.where(v > 0, 1 - sv / np.maximum(v, 1), 1.0)
    sizes = np.diff(np.r_[starts, len(members)])

    def summed(values):
        return np.add.reduceat(values, starts) if len(members) else values[:0]

    squares = summed((t * t - s * s).astype(np.float64))
    towers = np.bitwise_or.reduceat(np.asarray(loads.towers, np.uint8)[members], starts) if len(members) else \
        np.zeros(0, np.uint8)
    return SampleLoads(np.ones(len(starts), bool), summed(v - sv).astype(np.int32), summed(t - s).astype(np.int32),
                       summed(np.asarray(loads.vit_patches, np.float64)[members] * own).astype(np.float32),
                       summed(np.asarray(loads.vit_attn_sq, np.float64)[members] * own).astype(np.float32),
                       towers=towers.astype(np.uint8),
                       llm_attn_sq=np.where(sizes > 1, squares, np.nan).astype(np.float32))


def tree_savings(members: np.ndarray, offsets: np.ndarray, loads: Any) -> dict[str, Any]:
    """`packfeed.server.plan.groups.prefix_savings` of a plan of trees: per pack, the tokens, vision units and
    attention squares (S^2) every fork whose parent is in its pack does not compute again (its shared turns and
    their images); in all, the trees planned, those over more than one pack and what they save."""
    n_packs = len(offsets) - 1
    pack = np.repeat(np.arange(n_packs), np.diff(offsets))
    inside = _with_parent(np.asarray(loads.parent, np.int64), members, pack)
    shares = np.asarray(loads.prefix, np.float64)[members[inside]]
    tokens = np.bincount(pack[inside], shares, n_packs).astype(np.int64)
    vision = np.bincount(pack[inside], np.asarray(loads.shared_vision)[members[inside]], n_packs).astype(np.int64)
    group = np.asarray(loads.group)[members]
    chosen = group >= 0
    pairs = np.unique(np.stack([group[chosen], pack[chosen]]), axis=1) if chosen.any() else np.zeros((2, 0), int)
    _, per_tree = np.unique(pairs[0], return_counts=True)
    return {"vision": vision, "tokens": tokens, "squares": np.bincount(pack[inside], shares * shares, n_packs),
            "groups": int(len(per_tree)), "split_groups": int((per_tree > 1).sum()),
            "prefix_tokens_saved": int(tokens.sum()), "vision_units_saved": int(vision.sum())}


def _with_parent(parent: np.ndarray, members: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Per member, whether its parent is a member too and in the same place (`where`: each member's unit or
    pack)."""
    place = np.full(len(parent), -1, np.int64)
    place[members] = where
    theirs = parent[members]
    return (theirs >= 0) & (place[np.maximum(theirs, 0)] == where)  # a non-member's place is -1: no unit or pack
