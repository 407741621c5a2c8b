"""Collective-safe plans (PlanSpec `collective_safe`, on by default): in every step and every microbatch index,
every DP rank's pack calls the same towers (the vision tower on images, on videos, each further encoder).

Under FSDP or ZeRO-3 with a tower wrapped as units of its own, calling it is a set of collectives over the DP
group: a rank whose microbatch has no image skips them and every other rank waits forever. A pack's *class* is
the set of towers its samples call (a bit each: `TOWER_BITS`, then each further encoder in name order). The
planner lays every step out in *columns* (one microbatch index across the dp ranks) of packs of one class:

- `collective_packs`: a class r packs over a multiple of dp merges r pairs of its lightest packs (within the
  caps), or splits or empties packs, so that its packs fill whole columns;
- `aligned_steps`: the packs of each class, in the strategy's order, cut into columns of dp; the few left over
  of each class (fewer than dp) share columns of their own, which go to the epoch's last, partial step first;
  steps are M columns each.
- `packfeed.server.plan.balance.assign_ranks(..., aligned=True)`: each step's packs over the ranks class by
  class, so that balancing never mixes a column.

Where the data cannot give whole columns (fewer than dp packs of a class are left), those microbatches are
*unaligned*: `unaligned_towers` finds them in any plan, the plan summary counts them, and a trainer covers them
with `to_hf_inputs(..., ensure_encoders=True)` (a zero-contribution input that runs every tower).

Pure functions of their inputs, like the rest of the planner.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packfeed.media.jit import kernel, prange
from packfeed.server.plan.costs import encoder_names

# bit of each tower a sample may call; further encoders (`packfeed index --encoder`) follow, in name order
TOWER_BITS = {"images": 1, "videos": 2}


def collective_safe_layout(config) -> bool:
    """Whether plans of `config` are laid out collective-safe: asked for, and more than one DP rank (with dynamic
    context parallelism, in columns over every GPU: `packfeed.server.plan.cp_columns`)."""
    return layout_off_reason(config) is None


def layout_off_reason(config) -> str | None:
    """Why plans of `config` are not laid out collective-safe (None: they are)."""
    from packfeed.v1.options import CpMode

    if not config.collective_safe:
        return "turned off (collective_safe false, --no-collective-safe)"
    dynamic_cp = config.context_parallel > 1 and config.cp_mode is CpMode.DYNAMIC
    if config.dp == 1 and not dynamic_cp:  # dynamic CP: a rank's C GPUs can run packs of different classes
        return "one DP rank: nothing to align"
    return None


def tower_names(loads) -> list[str]:
    """The towers of `loads`, in the order of their bits."""
    return [*TOWER_BITS, *encoder_names(loads)]


def sample_towers(loads, ids: np.ndarray | None = None) -> np.ndarray:
    """Every sample's (or samples `ids`') class: the bits of the towers it calls, in the smallest unsigned type
    that holds them (uint8 up to six further encoders: a byte a sample, as the loads hold it)."""
    names = encoder_names(loads)
    ids = None if ids is None else np.asarray(ids, dtype=np.int64)
    dtype = np.min_scalar_type((1 << (len(TOWER_BITS) + len(names))) - 1)
    towers = loads.towers if ids is None else loads.towers[ids]
    towers = np.asarray(towers).astype(dtype, copy=bool(names))  # a copy only where encoder bits are added
    for k, name in enumerate(names):
        tokens = loads.encoders[name].tokens if ids is None else loads.encoders[name].tokens[ids]
        towers |= (np.asarray(tokens) > 0).astype(dtype) << (len(TOWER_BITS) + k)
    return towers


@kernel(cache=True, nogil=True, parallel=True)
def pack_classes(members, offsets, sample_class):
    """Per pack: the towers any of its members calls (0 for an empty pack)."""
    n = len(offsets) - 1
    out = np.zeros(n, dtype=np.int64)
    for p in prange(n):
        for k in range(offsets[p], offsets[p + 1]):
            out[p] |= sample_class[members[k]]
    return out


def class_counts(pack_class: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The classes present (ascending) and their pack counts: classes are small bit sets, so counting beats
    sorting or hashing an epoch's packs."""
    counts = np.bincount(pack_class) if len(pack_class) else np.zeros(0, dtype=np.int64)
    distinct = np.flatnonzero(counts)
    return distinct, counts[distinct]


def aligned_steps(order: np.ndarray, pack_class: np.ndarray, pack_cost: np.ndarray, dp: int,
                  m: int) -> tuple[np.ndarray, np.ndarray]:
    """Split packs into full steps of M whole columns and the rest, as `balance.form_steps` does: `order` is
    the packs in the strategy's order (similar packs together, or random), which each class's columns keep.
    Returns (full, rest): `full` is (n_steps, dp*M), each row rank-major (rank r's M packs, one per column); the
    rest (fewer than dp*M packs) holds the columns no class could fill, then the lightest whole columns."""
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    whole, left = [], []
    for cls in class_counts(pack_class)[0]:
        ids = order[pack_class[order] == cls]
        spare = len(ids) % dp
        left.append(ids[:spare])  # the first in order: in a balanced order, the class's lightest
        whole.append(ids[spare:].reshape(-1, dp))
    left_over = np.concatenate(left) if left else np.empty(0, dtype=np.int64)
    left_over = left_over[np.argsort(position[left_over], kind="stable")]
    spare = len(left_over) % dp
    mixed = left_over[spare:].reshape(-1, dp)
    homogeneous = np.concatenate(whole) if whole else np.empty((0, dp), dtype=np.int64)
    # the rest: the partial column, the mixed ones, then the lightest homogeneous ones (ties: earlier in order)
    n_rest_columns = (len(homogeneous) + len(mixed)) % m
    by_lightness = np.lexsort((position[homogeneous[:, 0]], pack_cost[homogeneous].sum(axis=1)))
    candidates = np.concatenate([mixed, homogeneous[by_lightness]])
    rest = np.concatenate([left_over[:spare], candidates[:n_rest_columns].reshape(-1)])
    body = candidates[n_rest_columns:]
    body = body[np.argsort(position[body].mean(axis=1), kind="stable")] if len(body) else body
    full = body.reshape(-1, m, dp).transpose(0, 2, 1).reshape(-1, dp * m)
    return full.astype(np.int64), rest.astype(np.int64)


def class_layout(row: np.ndarray, pack_class: np.ndarray, dp: int, m: int) -> np.ndarray:
    """One step's packs (`row`, -1 = empty) laid out rank-major in whole columns where classes allow: packs
    by class (stable), column j = the next dp of them. No balancing: the random and padded strategies' layout."""
    classes = np.where(row >= 0, pack_class[np.maximum(row, 0)], 0)
    counts = np.bincount(np.unique(classes, return_inverse=True)[1])
    whole_class = np.isin(classes, np.unique(classes)[counts % dp == 0])
    by_class = np.lexsort((np.arange(len(row)), classes, ~whole_class))  # whole columns first, then the rest
    return row[by_class].reshape(m, dp).T.reshape(-1)


def unaligned_towers(offsets: np.ndarray, members: np.ndarray, sample_class: np.ndarray, dp: int,
                     m: int) -> np.ndarray:
    """(steps, M): the towers each microbatch index calls on some ranks but not all (0: collective-safe).
    `sample_class` is indexed by the plan's member ids (`sample_towers`)."""
    packs = pack_classes(members, offsets, sample_class).reshape(-1, dp, m)
    some = np.bitwise_or.reduce(packs, axis=1)
    every = np.bitwise_and.reduce(packs, axis=1)
    return some & ~every


def unaligned_lanes(offsets: np.ndarray, member_class: np.ndarray, cp_degree: np.ndarray, cp_group: np.ndarray,
                    dp: int, m: int, c: int) -> np.ndarray:
    """(steps, M) as `unaligned_towers`, for a context-parallel plan: over every GPU (dp x C) of each
    microbatch index, a lane's towers those of the pack it runs a share of. `member_class`: each plan member's."""
    slot = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    per_gpu = np.zeros((len(offsets) - 1, c), dtype=np.int64)
    for d in np.unique(cp_degree):
        of_degree = cp_degree == d
        for j in range(int(d)):
            np.bitwise_or.at(per_gpu, (slot[of_degree], cp_group[of_degree] * d + j), member_class[of_degree])
    by_index = per_gpu.reshape(-1, dp, m, c).transpose(0, 2, 1, 3).reshape(-1, m, dp * c)
    return np.bitwise_or.reduce(by_index, axis=2) & ~np.bitwise_and.reduce(by_index, axis=2)


def alignment_summary(unaligned: np.ndarray, names: list[str], config) -> dict[str, Any]:
    """The plan summary's `collective_safe` entry: whether the plan was laid out collective-safe (and if not,
    why), and the microbatch indices (one per step and M) that call a tower on some ranks only, in all and per
    tower."""
    reason = layout_off_reason(config)
    return {"on": reason is None, **({"off_because": reason} if reason else {}), "microbatches": int(unaligned.size),
            "unaligned_microbatches": int(np.count_nonzero(unaligned)),
            "unaligned_steps": int(np.count_nonzero(unaligned.any(axis=1))) if unaligned.size else 0,
            "unaligned_by_tower": {name: int(np.count_nonzero(unaligned & (1 << k))) for k, name in enumerate(names)
                                   if np.any(unaligned & (1 << k))}}
