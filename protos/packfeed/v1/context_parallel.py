"""How a context-parallel pack is split among its GPUs: part of the contract, so a client in any language
(or a trainer that receives whole packs) computes exactly the shares the server sends.

A pack at degree d runs on d GPUs (its CP ranks 0..d-1). Each of its samples, in pack order, is cut into 2d
contiguous chunks; CP rank j holds chunks j and 2d-1-j, in that order (the zigzag order of ring attention: with
causal attention, a rank's early chunk and its late chunk together cost what every other rank's two cost).
A sample of t tokens has chunks of t // 2d tokens; its t % 2d remaining tokens go one each to the ranks in
turn, starting where the pack's previous sample stopped (first to each rank's early chunk, then to its late
one). So every rank of a pack holds ceil(T/d) or floor(T/d) of its T tokens: a pack of at most d x N tokens
puts at most N on any GPU. Tokens keep their positions in the unsplit sample (M-RoPE rows included).

Pure Python and no dependencies (as the rest of `packfeed.v1`); `zigzag_chunks` is the whole rule.
"""

from __future__ import annotations


def zigzag_chunks(length: int, degree: int, turn: int = 0) -> tuple[list[tuple[int, int]], int]:
    """The 2*degree chunks of a sample of `length` tokens, as (start, stop) in sample order, and the turn the
    pack's next sample starts at. `turn` (0 <= turn < degree): the CP rank that gets this sample's first
    remaining token (0 for a pack's first sample)."""
    if degree < 1 or not 0 <= turn < degree or length < 0:
        raise ValueError(f"zigzag_chunks: need degree >= 1, 0 <= turn < degree and length >= 0; got "
                         f"length {length}, degree {degree}, turn {turn}")
    base, extra = divmod(length, 2 * degree)
    sizes = [base] * (2 * degree)
    for k in range(extra):
        rank = (turn + k) % degree
        sizes[rank if k < degree else 2 * degree - 1 - rank] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds, (turn + extra) % degree


def rank_chunks(chunks: list[tuple[int, int]], cp_rank: int) -> list[tuple[int, int]]:
    """The two chunks of `zigzag_chunks` that CP rank `cp_rank` holds, early one first."""
    return [chunks[cp_rank], chunks[len(chunks) - 1 - cp_rank]]


def pack_shares(lengths: list[int], degree: int) -> list[list[tuple[int, int]]]:
    """Per sample of a pack (its token lengths, in pack order): the 2*degree chunks, the turn carried over."""
    shares, turn = [], 0
    for length in lengths:
        chunks, turn = zigzag_chunks(length, degree, turn)
        shares.append(chunks)
    return shares


def degree_for(tokens: int, max_tokens: int) -> int:
    """The fewest GPUs, a power of 2, that hold a sample of `tokens` at `max_tokens` each (1 when one does):
    the degree a dynamic CP plan gives a long sample before the oversize policy caps it at C."""
    need = max(1, -(-int(tokens) // int(max_tokens)))
    return 1 << (need - 1).bit_length()
