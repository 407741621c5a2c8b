"""A context-parallel pack's shares: what each GPU of a DP rank's CP group receives (plan `context_parallel` > 1).

A slot of a CP plan holds packs on aligned GPUs (`packfeed.server.plan.context_parallel`): a pack at degree d
on cp_group g runs on GPUs [g*d, (g+1)*d) of the group. GPU `lane` of the group gets one share: the pack whose
GPUs hold it, as share_rank j = lane - g*d of that pack. Its tokens are its two zigzag chunks of every sample
(`packfeed.v1.context_parallel`), early chunk first; the tensors (docs/wire.md "Context-parallel shares"):

- input_ids, labels, position_ids (its tokens; positions as in the unsplit sample) and cu_seqlens (where each
  sample's tokens start among its tokens), as any pack;
- cp (3: degree d, cp_group g, share_rank j), cp_seqlens (samples + 1: boundaries of the unsplit samples, as the
  pack's cu_seqlens would be), cp_chunks (samples x 4: early chunk start, stop, late chunk start, stop, in the
  unsplit sample);
- every visual item of the pack's samples: image_sample, image_token_spans (start in the unsplit pack of
  cp_seqlens, length), visual_kind, frame_seconds, item_geometry (its tiles or frames and their (C, H, W): what
  M-RoPE positions need of items other GPUs encode), and cp_pieces: who encodes what. The d GPUs share the
  encoder's work as they share the tokens: the items' units (a tile, or a video's temporal patch of frames; a
  Qwen image is one) are laid out in item order and cut into d contiguous runs of about equal placeholder
  tokens, so a long video's frames are encoded by all d GPUs, not by one. A piece is one item's run on one GPU;
  pixels, tile_shapes and tile_image (its item's number) of this GPU's pieces only.

A GPU that holds nothing in this microbatch gets an empty share. Every share of a slot carries the slot's
skipped samples' reports on share 0 only (counted once).
"""

from __future__ import annotations

import numpy as np

from packfeed.media.chat import IGNORE_INDEX
from packfeed.server.serve.packs import Chunks, Pack
from packfeed.v1.context_parallel import pack_shares, rank_chunks
from packfeed.v1.options import VisualKind

ITEM_TENSORS = ("visual_kind", "frame_seconds")  # per visual item, kept for every item of the share's samples


def cp_shares(pack: Pack, degree: np.ndarray, group: np.ndarray, cp: int, temporal_patch: int = 1) -> list[Pack]:
    """The `cp` (C) shares of one slot's pack; `degree` and `group`: the plan's cp and cp_group of each of
    its samples (those that loaded, in pack order); `temporal_patch`: the frames a video's ViT patch spans in
    time (the image policy's), which a piece never cuts."""
    if "encoded" in pack.tensors:
        raise ValueError("context parallelism needs pixels cut on the server (pixels exact or fast), not encoded")
    return [_share(pack, degree, group, lane, temporal_patch) for lane in range(cp)]


def _share(pack: Pack, degree: np.ndarray, group: np.ndarray, lane: int, temporal_patch: int) -> Pack:
    mine = np.flatnonzero((group * degree <= lane) & (lane < (group + 1) * degree))
    t = pack.tensors
    d = int(degree[mine[0]]) if len(mine) else 1
    g = int(group[mine[0]]) if len(mine) else lane
    j = lane - g * d
    cu = t["cu_seqlens"].astype(np.int64)
    lengths = (cu[mine + 1] - cu[mine]).tolist()
    chunks = [rank_chunks(sample_chunks, j) for sample_chunks in pack_shares(lengths, d)]
    token_index = np.concatenate([np.arange(cu[k] + a, cu[k] + b) for k, pair in zip(mine, chunks) for a, b in pair]
                                 or [np.zeros(0, np.int64)]).astype(np.int64)
    local = np.zeros(len(mine) + 1, dtype=np.int32)
    np.cumsum([sum(b - a for a, b in pair) for pair in chunks], out=local[1:])
    unsplit = np.zeros(len(mine) + 1, dtype=np.int32)
    np.cumsum(lengths, out=unsplit[1:])
    labels = t["labels"][token_index]
    tensors = {"input_ids": t["input_ids"][token_index], "labels": labels,
               "position_ids": t["position_ids"][token_index], "cu_seqlens": local,
               "cp": np.array([d, g, j], dtype=np.int32), "cp_seqlens": unsplit,
               "cp_chunks": np.array([[a0, b0, a1, b1] for (a0, b0), (a1, b1) in chunks], dtype=np.int32)
               .reshape(-1, 4)}
    tensors.update(_items(t, mine, cu, unsplit, d, j, temporal_patch))
    tensors.update({name: t[name][token_index] for name in t  # a live job's
                    if name.startswith("token.") or name == "token_policy_version"})
    if "policy_version" in t:
        tensors["policy_version"] = t["policy_version"][mine]
    tensors.update({name: t[name][mine] for name in t if name.startswith("value.")})  # per sample
    keys = [pack.sample_keys[k] for k in mine]
    sources = [pack.sample_sources[k] for k in mine] if pack.sample_sources else []
    return Pack(pack.epoch, pack.step, pack.rank, pack.microbatch, keys, tensors,
                int((labels != IGNORE_INDEX).sum()), pack.skipped if lane == 0 else [], pack.step_loss_tokens,
                sources, sample_groups=[pack.sample_groups[k] for k in mine] if pack.sample_groups else [])


def _items(t: dict, mine: np.ndarray, cu: np.ndarray, unsplit: np.ndarray, d: int, j: int,
           temporal_patch: int) -> dict:
    """The share's visual items: all of its samples', the tiles only of the pieces share rank `j` encodes."""
    image_sample = t["image_sample"].astype(np.int64)
    position = np.full(len(cu) - 1, -1, dtype=np.int64)
    position[mine] = np.arange(len(mine))
    items = np.flatnonzero(position[image_sample] >= 0)
    tile_image = t["tile_image"].astype(np.int64)
    tiles_per_item = np.bincount(tile_image, minlength=len(image_sample))[items]
    first_tile = np.searchsorted(tile_image, items)  # tiles are in item order
    shapes = t["tile_shapes"].reshape(-1, 3)[np.minimum(first_tile, max(0, len(tile_image) - 1))] \
        if len(tile_image) else np.zeros((len(items), 3), np.int64)
    number = np.full(len(image_sample), -1, dtype=np.int64)
    number[items] = np.arange(len(items))
    spans = t["image_token_spans"][items].astype(np.int64)
    owner = position[image_sample[items]]
    pieces = encoder_pieces(tiles_per_item, spans[:, 1], t["visual_kind"][items], d, temporal_patch)
    spans[:, 0] += unsplit[owner] - cu[image_sample[items]]  # from the whole pack to the unsplit share
    tile_rank = np.full(len(tile_image), -1, dtype=np.int64)  # per tile of the whole pack: -1 not this share's
    tile_rank[number[tile_image] >= 0] = np.repeat(pieces[:, 4], pieces[:, 2])  # pieces: the items' tiles in order
    tiles = np.flatnonzero(tile_rank == j)
    pixels = t["pixels"]
    offsets = np.concatenate([[0], np.cumsum(np.prod(t["tile_shapes"], axis=1))]).astype(np.int64)
    whole_tiles = isinstance(pixels, Chunks) and len(pixels.arrays) == len(offsets) - 1
    arrays = pixels.arrays if whole_tiles else tuple(
        np.asarray(pixels)[offsets[k]:offsets[k + 1]] for k in range(len(offsets) - 1))
    return {"image_sample": owner.astype(np.int32), "image_token_spans": spans.astype(np.int32).reshape(-1, 2),
            "cp_pieces": pieces.astype(np.int32).reshape(-1, 5),
            "item_geometry": np.column_stack([tiles_per_item, shapes]).astype(np.int32).reshape(-1, 4),
            **{name: t[name][items] for name in ITEM_TENSORS},
            "pixels": Chunks(tuple(arrays[k] for k in tiles), np.dtype(np.uint8)),
            "tile_shapes": t["tile_shapes"][tiles].reshape(-1, 3), "tile_image": number[tile_image[tiles]]
            .astype(np.int32)}


def encoder_pieces(tiles: np.ndarray, tokens: np.ndarray, kinds: np.ndarray, ranks: int,
                   temporal_patch: int = 1) -> np.ndarray:
    """(pieces, 5): item, its first tile, tiles, placeholder tokens and the share rank encoding them, in item then
    tile order. Each item's units (a tile; a video's `temporal_patch` frames; an item whose tokens its units do
    not divide evenly is one unit) are laid out in item order and cut into `ranks` contiguous runs of about equal
    tokens (a unit goes to the run its middle falls in), so each rank encodes within one unit of its share and
    an item is cut only where its encoder's attention is (tiles and temporal patches are encoded apart)."""
    tiles, tokens = np.asarray(tiles, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
    frames = np.where(np.asarray(kinds) == VisualKind.VIDEO, max(1, temporal_patch), 1)
    units = np.maximum(-(-tiles // frames), 1)
    whole = (tokens % units != 0) | (tiles == 0)
    frames, units = np.where(whole, np.maximum(tiles, 1), frames), np.where(whole, 1, units)
    item = np.repeat(np.arange(len(tiles)), units)
    first_of_item = np.cumsum(units) - units
    index = np.arange(len(item)) - first_of_item[item]  # the unit's number within its item
    unit_first = index * frames[item]
    unit_tiles = np.minimum(frames[item], tiles[item] - unit_first)
    unit_tokens = tokens[item] // units[item]
    before = np.cumsum(unit_tokens) - unit_tokens
    total = max(int(unit_tokens.sum()), 1)
    rank = np.minimum((2 * before + unit_tokens) * ranks // (2 * total), ranks - 1)
    new = np.ones(len(item), dtype=bool)
    new[1:] = (item[1:] != item[:-1]) | (rank[1:] != rank[:-1])
    starts = np.flatnonzero(new)
    return np.column_stack([item[starts], unit_first[starts], np.add.reduceat(unit_tiles, starts),
                            np.add.reduceat(unit_tokens, starts), rank[starts]]) if len(starts) else \
        np.zeros((0, 5), dtype=np.int64)
