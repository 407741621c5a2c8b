"""What a GPU's share of a context-parallel pack costs beyond its FLOPs, for `packfeed simulate --context-parallel`.

Splitting a pack costs a GPU more than 1/d of its work, in two ways measured on an H200 (BENCHMARKS.md,
"Where a split share's time goes"), both pure functions of the pack's sample lengths and its degree:

- **Attention in tiles.** Flash-attention computes whole tiles: queries in blocks of 128 by keys in blocks of 64
  forward, 64 by 128 backward, and the backward pays a fixed cost per block of keys besides. A sample cut into
  2d chunks of a few dozen tokens fills few rows of each tile, so the same causal FLOPs cost more tiles. Fitted
  on the attention kernels of split and whole short-sample shares (forward within 4%, backward 2%), and
  predicting one long sample's share at degrees 1-8 within 5% mean error (32K and 128K tokens), unfitted.
- **The gathered K and V** (`allgather`, what `packfeed train parallel.cp` runs): each layer assembles every GPU's
  rows (d x the most any GPU holds) and picks, for each of its chunks, the keys from its sample's start, forward,
  recomputed and backward: `GATHERED_KV_SECONDS_PER_BYTE` of those rows' K and V. Ring attention streams blocks
  instead and pays only the tiles.

The zigzag split is the contract's (`packfeed.v1.context_parallel`), computed here on arrays: the same chunk sizes.
"""

from __future__ import annotations

import numpy as np

FORWARD_TILE = (128, 64)  # query rows x keys of flash-attention 2's forward tile (head dim 128)
BACKWARD_TILE = (64, 128)  # and of its backward
KEY_BLOCK_ELEMENTS = 11_600.0  # a backward key block's fixed cost, in tile elements (fitted: 1.90 ms/M, 0.022 ms)
GATHERED_KV_SECONDS_PER_BYTE = 4.25e-12  # forward + recompute + backward, per byte of the gathered rows' K and V


def zigzag_spans(lengths: np.ndarray, degree: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each (sample, CP rank)'s query spans in sample positions, as (starts, stops, used): (samples, d, 2)
    arrays of its early and late chunk; a rank whose two chunks touch (the middle one) has one span, its late
    slot unused (`used` False). Chunk sizes follow `zigzag_chunks`, the remainder turn carried across the pack."""
    lengths = np.asarray(lengths, dtype=np.int64)
    d = degree
    base, extra = np.divmod(lengths, 2 * d)
    turn = np.concatenate([[0], np.cumsum(extra)[:-1]]) % d
    offset = (np.arange(d)[None, :] - turn[:, None]) % d  # this rank's place in the remainder's order
    early = base[:, None] + (offset < extra[:, None])
    late = base[:, None] + (offset + d < extra[:, None])
    sizes = np.concatenate([early, late[:, ::-1]], axis=1)  # chunk k of 2d in sample order
    bounds = np.concatenate([np.zeros((len(lengths), 1), dtype=np.int64), np.cumsum(sizes, axis=1)], axis=1)
    ranks = np.arange(d)
    starts = np.stack([bounds[:, ranks], bounds[:, 2 * d - 1 - ranks]], axis=2)
    stops = np.stack([bounds[:, ranks + 1], bounds[:, 2 * d - ranks]], axis=2)
    touching = stops[:, :, 0] == starts[:, :, 1]
    stops[:, :, 0] = np.where(touching, stops[:, :, 1], stops[:, :, 0])
    used = np.ones(starts.shape, dtype=bool)
    used[:, :, 1] = ~touching
    used &= stops > starts
    return starts, stops, used


def tile_elements(starts: np.ndarray, stops: np.ndarray, tile: tuple[int, int]) -> np.ndarray:
    """(q, k) elements of the tiles a causal kernel computes for queries [start, stop) of a sample, keys from
    its first token up to each query (aligned to the span's last key), per span."""
    rows, cols = tile
    blocks = -(-(stops - starts) // rows)
    span = np.repeat(np.arange(len(starts)), blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    last_key = np.minimum(starts[span] + (np.arange(len(span)) - first + 1) * rows, stops[span])
    per_block = -(-last_key // cols) * (rows * cols)
    return np.bincount(span, weights=per_block, minlength=len(starts))


def share_costs(lengths: np.ndarray, degree: int) -> tuple[float, float]:
    """A pack's attention, the mean over its d GPUs as the causal squared length it costs in tiles (what the
    simulator's TOKEN_SQUARE term counts; a whole sample of L tokens costs about L^2 exactly), and the rows of
    K and V its busiest GPU assembles per layer (0 at degree 1)."""
    spans = zigzag_spans(lengths, degree)
    used = spans[2]
    starts, stops = spans[0][used], spans[1][used]
    forward = tile_elements(starts, stops, FORWARD_TILE).sum()
    backward = tile_elements(starts, stops, BACKWARD_TILE).sum() + KEY_BLOCK_ELEMENTS * (-(-stops // BACKWARD_TILE[1])).sum()
    attention = 2.0 * (forward + 2.0 * backward) / 3.0 / degree  # a backward is two forwards' FLOPs
    if degree == 1:
        return float(attention), 0.0
    most = -(-int(np.sum(lengths)) // degree)
    ranks = np.broadcast_to(np.arange(degree)[None, :, None], used.shape)[used]
    return float(attention), float(degree * most + np.bincount(ranks, weights=stops, minlength=degree).max())
