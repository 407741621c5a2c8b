"""ISF — Iterative Sampling and Filtering (OmniBal Alg. 1), with stronger guarantees.

Sampling walks a seeded permutation and adds samples to the open group until the next one would exceed
the vision cap or the token cap (next-fit). Filtering keeps the groups that reach a target and returns
the rest to the pool. Unlike the published code, nothing is lost: samples still pooled after the last
iteration are packed with first-fit-decreasing (the fewest, fullest packs), and samples that alone
exceed a cap are handled by a stated policy and always reported.

Packs are returned in CSR form: `members[offsets[p]:offsets[p+1]]` are the sample ids of pack p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.media.jit import kernel, prange



@dataclass(frozen=True)
class Caps:
    vision_cap: int
    token_cap: int
    vision_target: int
    token_target: int

    def __post_init__(self):
        if self.vision_cap < 1 or self.token_cap < 1:
            raise ValueError(f"caps must be positive, got vision_cap={self.vision_cap} token_cap={self.token_cap}")
        if self.vision_target > self.vision_cap or self.token_target > self.token_cap:
            raise ValueError(f"targets must not exceed caps: {self}")


@dataclass(frozen=True)
class RowLayout:
    """How ISF rows hold [sample id, vision, tokens]: one int64 word when the three fit in 63 bits (always,
    at realistic sizes: half the memory traffic of the random shuffle), else two words [id, vision << 32 |
    tokens]. The walk order and the packs do not depend on the layout."""

    width: int
    id_shift: int
    token_bits: int
    vision_mask: int
    token_mask: int

    @classmethod
    def fitting(cls, max_id: int, max_vision: int, max_tokens: int) -> RowLayout:
        id_bits, vision_bits, token_bits = (max(1, int(x).bit_length()) for x in (max_id, max_vision, max_tokens))
        if id_bits + vision_bits + token_bits <= 63:
            return cls(1, vision_bits + token_bits, token_bits, (1 << vision_bits) - 1, (1 << token_bits) - 1)
        return cls(2, 0, 32, 0xFFFFFFFF, 0xFFFFFFFF)


@kernel(cache=True, nogil=True, parallel=True)
def _make_rows(ids, vision, tokens, width, id_shift, token_bits):
    """One row per candidate in the given layout: the unit ISF shuffles and walks (rows filled in parallel,
    which also spreads the first-touch page faults of a multi-GB buffer over the cores)."""
    rows = np.empty((len(ids), width), dtype=np.int64)
    for k in prange(len(ids)):
        i = ids[k]
        loads = (np.int64(vision[i]) << token_bits) | np.int64(tokens[i])
        if width == 1:
            rows[k, 0] = (np.int64(i) << id_shift) | loads
        else:
            rows[k, 0] = i
            rows[k, 1] = loads
    return rows


@kernel(cache=True, nogil=True)
def shuffle_rows(out, n, seed):
    """Shuffle the first `n` rows of `out` (n x width) in place: Fisher-Yates driven by splitmix64 from `seed`.

    Our own generator, so the order is fixed by the seed alone, whatever numpy or numba version runs it.
    """
    state = np.uint64(seed)
    for k in range(n - 1, 0, -1):
        state += np.uint64(0x9E3779B97F4A7C15)
        z = state
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        j = np.int64((z >> np.uint64(11)) % np.uint64(k + 1))  # bias < (k+1) / 2^53: negligible
        a = out[k, 0]
        out[k, 0] = out[j, 0]
        out[j, 0] = a
        if out.shape[1] == 2:
            a = out[k, 1]
            out[k, 1] = out[j, 1]
            out[j, 1] = a


@kernel(cache=True, nogil=True)
def sample_and_filter(rows, n, layout, kept, n_kept, sizes, group_v, group_t, n_groups, vision_cap, token_cap,
                      vision_target, token_target):
    """One ISF round over the first `n` rows (`layout` = RowLayout fields after width), in order: next-fit
    groups, keep those reaching a target.

    Kept ids are appended to `kept`, their group sizes and loads to `sizes`, `group_v`, `group_t`; the rest are
    compacted in place to the
    front of `rows` (the pool). Returns the new (pool size, n_kept, n_groups). The loads travel with the
    ids, so the walk reads memory in order, and nothing is allocated per round.
    """
    id_shift, token_bits, vision_mask, token_mask = layout
    last = rows.shape[1] - 1  # the word holding the loads
    n_pool = 0
    start = 0
    v = t = 0
    for k in range(n + 1):
        sv = st = 0
        if k < n:
            sv = (rows[k, last] >> token_bits) & vision_mask
            st = rows[k, last] & token_mask
        if k == n or v + sv > vision_cap or t + st > token_cap:
            if k > start:  # close the group [start, k)
                if v >= vision_target or t >= token_target:
                    for j in range(start, k):
                        kept[n_kept] = rows[j, 0] >> id_shift
                        n_kept += 1
                    sizes[n_groups] = k - start
                    group_v[n_groups] = v
                    group_t[n_groups] = t
                    n_groups += 1
                else:  # n_pool <= start: compacting forward never overwrites an unread row
                    for j in range(start, k):
                        rows[n_pool, 0] = rows[j, 0]
                        if last:
                            rows[n_pool, 1] = rows[j, 1]
                        n_pool += 1
            start = k
            v = t = 0
        v += sv
        t += st
    return n_pool, n_kept, n_groups


@dataclass
class IsfPacks:
    members: np.ndarray  # sample ids, pack after pack
    offsets: np.ndarray  # pack p is members[offsets[p]:offsets[p + 1]]
    vision: np.ndarray  # vision units per pack
    tokens: np.ndarray  # tokens per pack


# First-fit looks only at the most recently opened bins. Items come largest first, so older bins are
# nearly full; the window keeps packing O(n * window) instead of O(n * bins) with almost the same fill.
FIRST_FIT_WINDOW = 256


@kernel(cache=True, nogil=True)
def first_fit_decreasing(order, vision, tokens, vision_cap, token_cap, window):
    """Pack samples (given in decreasing size order) into the first of the last `window` bins they fit.

    Returns the bin of every sample (in `order` positions) and the number of bins.
    """
    n = len(order)
    bin_of = np.empty(n, dtype=np.int64)
    bin_v = np.zeros(n, dtype=np.int64)
    bin_t = np.zeros(n, dtype=np.int64)
    n_bins = 0
    for k in range(n):
        i = order[k]
        chosen = -1
        for b in range(max(0, n_bins - window), n_bins):
            if bin_v[b] + vision[i] <= vision_cap and bin_t[b] + tokens[i] <= token_cap:
                chosen = b
                break
        if chosen < 0:
            chosen = n_bins
            n_bins += 1
        bin_v[chosen] += vision[i]
        bin_t[chosen] += tokens[i]
        bin_of[k] = chosen
    return bin_of, n_bins, bin_v[:n_bins], bin_t[:n_bins]


def isf(
    candidates: np.ndarray,
    vision: np.ndarray,
    tokens: np.ndarray,
    caps: Caps,
    iterations: int,
    rng: np.random.Generator,
    layout: RowLayout | None = None,
) -> IsfPacks:
    """Pack every sample id in `candidates` exactly once; each must fit the caps on its own.

    Packs kept by filtering come first, in the order they were formed, then the first-fit-decreasing packs
    of the leftovers. `layout` is chosen from the data unless given (tests force the two-word one).
    """
    if iterations < 1:
        raise ValueError("ISF needs at least one iteration")
    n = len(candidates)
    v_min, v_max, t_min, t_max = _gathered_ranges(candidates, vision, tokens)
    if n and (v_max > caps.vision_cap or t_max > caps.token_cap):
        raise ValueError("ISF candidates must each fit the caps; route oversize samples through the oversize policy")
    if n and (v_min < 0 or t_min < 0 or v_max >= 2**31 or t_max >= 2**32):
        raise ValueError("vision units must be in [0, 2^31) and tokens in [0, 2^32)")
    layout = layout or RowLayout.fitting(_max_or_zero(candidates), v_max, t_max)
    rows = _make_rows(candidates, vision, tokens, layout.width, layout.id_shift, layout.token_bits)
    walk_layout = (layout.id_shift, layout.token_bits, layout.vision_mask, layout.token_mask)
    # Sample ids fit int32 up to 2^31 samples; per-pack arrays are sized for the worst case of one sample
    # per pack, so they are int32 too.
    id_type = np.int32 if n < 2**31 else np.int64
    members = np.empty(n, dtype=id_type)
    sizes = np.empty(n, dtype=np.int32)
    pack_v = np.empty(n, dtype=np.int32)
    pack_t = np.empty(n, dtype=np.int32)
    n_pool, n_kept, n_groups = len(rows), 0, 0
    for _ in range(iterations):
        if n_pool == 0:
            break
        shuffle_rows(rows, n_pool, _draw_seed(rng))
        n_pool, n_kept, n_groups = sample_and_filter(rows, n_pool, walk_layout, members, n_kept, sizes, pack_v,
                                                     pack_t, n_groups, caps.vision_cap, caps.token_cap,
                                                     caps.vision_target, caps.token_target)

    if n_pool:
        # Largest first, ties broken by id so the result never depends on sort stability.
        pool = np.sort(rows[:n_pool, 0] >> layout.id_shift)
        order = pool[np.argsort(-pool_size_key(pool, vision, tokens, caps), kind="stable")]
        bin_of, n_bins, bin_v, bin_t = first_fit_decreasing(order, vision, tokens, caps.vision_cap, caps.token_cap,
                                                            FIRST_FIT_WINDOW)
        members[n_kept:] = order[np.argsort(bin_of, kind="stable")]
        sizes[n_groups:n_groups + n_bins] = np.bincount(bin_of, minlength=n_bins)
        pack_v[n_groups:n_groups + n_bins] = bin_v
        pack_t[n_groups:n_groups + n_bins] = bin_t
        n_groups += n_bins
    del rows
    offsets = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(sizes[:n_groups], out=offsets[1:])
    return IsfPacks(members, offsets, pack_v[:n_groups].astype(np.int64), pack_t[:n_groups].astype(np.int64))


@kernel(cache=True, nogil=True)
def _gathered_ranges(ids, vision, tokens):
    """(min, max) of vision[ids] and of tokens[ids] in one pass, without gathering copies."""
    v_min = t_min = np.int64(2**62)
    v_max = t_max = np.int64(0)
    for i in ids:
        v_min = min(v_min, np.int64(vision[i]))
        v_max = max(v_max, np.int64(vision[i]))
        t_min = min(t_min, np.int64(tokens[i]))
        t_max = max(t_max, np.int64(tokens[i]))
    return v_min, v_max, t_min, t_max


def _max_or_zero(ids: np.ndarray) -> int:
    return int(ids.max()) if len(ids) else 0


def _draw_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**63 - 1))


def pool_size_key(ids: np.ndarray, vision: np.ndarray, tokens: np.ndarray, caps: Caps) -> np.ndarray:
    """A sample's size relative to the caps: the fuller of its two dimensions."""
    return np.maximum(vision[ids] / caps.vision_cap, tokens[ids] / caps.token_cap)
