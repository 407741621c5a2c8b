"""Packs as arrays: pack p is `members[offsets[p]:offsets[p + 1]]` (CSR). Joining packs, summing their costs and
laying them out in a sequence, compiled where the whole epoch passes through."""

from __future__ import annotations

import numpy as np

from packfeed.media.jit import kernel, prange
from packfeed.server.plan.isf import IsfPacks


def joined(first: IsfPacks, then: IsfPacks) -> IsfPacks:
    """The packs of `first`, then those of `then`."""
    return IsfPacks(np.concatenate([first.members, then.members.astype(first.members.dtype)]),
                    np.concatenate([first.offsets, first.offsets[-1] + then.offsets[1:]]),
                    np.concatenate([first.vision, then.vision]), np.concatenate([first.tokens, then.tokens]))


def with_singletons(packs: IsfPacks, ids: np.ndarray, vision: np.ndarray, tokens: np.ndarray) -> IsfPacks:
    """`packs` followed by a pack of its own for each sample `ids`."""
    ids = ids.astype(np.int64)
    return joined(packs, IsfPacks(ids, np.arange(len(ids) + 1), vision[ids], tokens[ids]))


def csr(pieces: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(members, offsets) of packs given as a list of member arrays."""
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum([len(piece) for piece in pieces], out=offsets[1:])
    members = np.concatenate(pieces).astype(dtype) if pieces else np.empty(0, dtype=dtype)
    return members, offsets


def flatnonzero(mask: np.ndarray, dtype) -> np.ndarray:
    """np.flatnonzero straight into `dtype` (no int64 temporary of the whole index)."""
    out = np.empty(int(np.count_nonzero(mask)), dtype=dtype)
    _fill_nonzero(mask, out)
    return out


@kernel(cache=True, nogil=True)
def _fill_nonzero(mask, out):
    k = 0
    for i in range(len(mask)):
        if mask[i]:
            out[k] = i
            k += 1


@kernel(cache=True, nogil=True, parallel=True)
def pack_costs(members, offsets, costs):
    """Per pack: (every encoder's cost, LLM cost), summed in float64, packs in parallel (each sums its own members
    in order, so the sums do not depend on the thread count)."""
    n = len(offsets) - 1
    pack_cv = np.zeros(n)
    pack_cl = np.zeros(n)
    for p in prange(n):
        for k in range(offsets[p], offsets[p + 1]):
            pack_cl[p] += costs[members[k], 1]
            pack_cv[p] += costs[members[k], 0]
            for j in range(2, costs.shape[1]):  # further encoders run before the LLM too
                pack_cv[p] += costs[members[k], j]
    return pack_cv, pack_cl


@kernel(cache=True, nogil=True, parallel=True)
def gather(sequence, members, offsets, extra_members, extra_offsets):
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
    for q in prange(len(sequence)):
        p = sequence[q]
        if p >= n_base:
            out[new_offsets[q]:new_offsets[q + 1]] = extra_members[extra_offsets[p - n_base]:
                                                                   extra_offsets[p - n_base + 1]]
        elif p >= 0:
            out[new_offsets[q]:new_offsets[q + 1]] = members[offsets[p]:offsets[p + 1]]
    return new_offsets, out
