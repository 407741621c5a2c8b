"""Context-parallel shares on the client: joining the shares of a pack back into the whole pack, and a stream
that trains a CP plan on fewer GPUs than it plans (every lane of a rank's CP group in one process).

`PackStream(..., seat=Seat(rank, lane=r))` gives GPU r of a rank's CP group its share of every pack (docs/wire.md
"Context-parallel shares"). `join_shares` undoes the split: the d shares of a pack at degree d give exactly the
pack a job without context parallelism would send for those samples (tokens in sample order, every item's
tiles), which is what a single GPU trains when it runs the pack whole. `JoinedStream` reads all C shares of a
rank (C streams) and yields steps of whole packs: the baseline a CP run is checked against, on one GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from packfeed.client.stream.tensors import PackTensors, Step

ITEM_TENSORS = ("image_sample", "image_token_spans", "visual_kind", "frame_seconds")


def share_layout(pack: PackTensors) -> tuple[int, int, int]:
    """(degree d, cp_group g, share_rank j) of a share."""
    d, g, j = pack.cp.tolist()
    return int(d), int(g), int(j)


def join_shares(shares: list[PackTensors]) -> PackTensors:
    """The whole pack of its d shares (in share_rank order, as the seats at lane g*d + j received them)."""
    first = shares[0]
    d, g, _ = share_layout(first)
    if len(shares) != d or [share_layout(s) for s in shares] != [(d, g, j) for j in range(d)]:
        raise ValueError(f"join_shares needs the {d} shares of one pack in share_rank order, got "
                         f"{[share_layout(s) for s in shares]}")
    total = int(first.cp_seqlens[-1])
    tensors = {name: torch.empty(total, dtype=first.tensors[name].dtype)
               for name in ("input_ids", "labels", "position_ids")}
    for share in shares:
        rows = unsplit_rows(share)
        for name, target in tensors.items():
            target[rows] = share.tensors[name]
    tensors["cu_seqlens"] = first.cp_seqlens.clone()
    tensors.update({name: first.tensors[name].clone() for name in ITEM_TENSORS})
    tensors.update(_joined_tiles(shares))
    return PackTensors(first.epoch, first.step, first.rank, first.microbatch, first.empty, list(first.sample_keys),
                       sum(s.loss_tokens for s in shares), first.step_loss_tokens,
                       [skip for s in shares for skip in s.skipped], tensors, sum(s.nbytes for s in shares),
                       first.microbatches, first.last_in_epoch, list(first.sample_sources))


def unsplit_rows(share: PackTensors) -> torch.Tensor:
    """Each of the share's tokens' row in the unsplit pack (`cp_seqlens` coordinates), in the share's order."""
    bounds = share.cp_seqlens.tolist()
    parts = [torch.arange(bounds[s] + a, bounds[s] + b) for s, (a0, b0, a1, b1) in enumerate(share.cp_chunks.tolist())
             for a, b in ((a0, b0), (a1, b1))]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def share_mrope_positions(share: PackTensors, model_family, tokens_per_second: float | None = None) -> torch.Tensor:
    """(3, L) Qwen-VL M-RoPE positions of a share's tokens: the rows the unsplit pack has at those tokens (what
    `to_hf_inputs` gives the joined pack), computed from the share alone. Every share carries each item's
    geometry (`item_geometry`) and placeholder run, so a GPU knows the 3-D positions of image tokens whose
    pixels another GPU encodes. A whole pack (no `cp`) gives its own. `tokens_per_second` as `to_hf_inputs`'s
    (Qwen2.5-VL's video time positions)."""
    from packfeed.client.model.hf_families import family_of, mrope_rows, qwen_grid, time_intervals, visual_kinds

    family = family_of(model_family)
    if family.image_policy != "qwen2vl":
        raise ValueError(f"{family.name} has no M-RoPE positions: a share's position_ids are its positions")
    grids = [qwen_grid(frames, height, width, family) for frames, _, height, width in _item_geometry(share)]
    intervals = time_intervals(share, visual_kinds(share), family, tokens_per_second)
    split = "cp" in share.tensors
    rows = mrope_rows((share.cp_seqlens if split else share.cu_seqlens).tolist(),
                      share.image_token_spans.view(-1, 2).tolist(), grids, family.merge_size, intervals,
                      f"the pack of {share.sample_keys}")
    return rows[:, unsplit_rows(share)] if split else rows


def _item_geometry(pack: PackTensors) -> list[list[int]]:
    """Per visual item: its tiles (a video's frames) and their (C, H, W); a share carries them, a whole pack's
    come from its tiles."""
    if "item_geometry" in pack.tensors:
        return pack.item_geometry.view(-1, 4).tolist()
    shapes, items = pack.tile_shapes.view(-1, 3).tolist(), pack.tile_image.tolist()
    geometry = [[0, 0, 0, 0] for _ in range(int(pack.image_token_spans.view(-1, 2).shape[0]))]
    for shape, item in zip(shapes, items):
        if not geometry[item][0]:
            geometry[item][1:] = shape
        geometry[item][0] += 1
    return geometry


def share_qwen_pixels(share: PackTensors, model_family, conventions=None, dtype: torch.dtype = torch.float32,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The Qwen-VL vision tower's input for the items a share's GPU encodes: their patches (concatenated in item
    order, as `to_hf_inputs` lays out a pack's), their (t, h, w) grids and their item numbers in the share."""
    from packfeed.client.model.hf_families import family_of, normalisation_of, normalised, qwen_item_patches, visual_kinds

    family = family_of(model_family)
    mean, std = normalisation_of(family, conventions)
    tiles = share.tiles() if share.tile_shapes.numel() else []
    if device is not None:
        tiles = [tile.to(device, non_blocking=True) for tile in tiles]
    items = qwen_item_patches(share, normalised(tiles, mean, std, dtype), visual_kinds(share), family)
    mine = [k for k, item in enumerate(items) if item is not None]
    if not mine:
        return torch.zeros(0, 0, dtype=dtype), torch.zeros(0, 3, dtype=torch.long), []
    return (torch.cat([items[k][0] for k in mine]), torch.tensor([items[k][1] for k in mine], dtype=torch.long),
            mine)


def _joined_tiles(shares: list[PackTensors]) -> dict[str, torch.Tensor]:
    """Every share's tiles (the pieces of items its rank encodes) in item order, as one pack's."""
    tiles = [(int(item), j, k, tile, shape) for j, share in enumerate(shares)
             for k, (item, tile, shape) in enumerate(zip(share.tile_image.tolist(), share.tiles(),
                                                         share.tile_shapes.view(-1, 3)))]
    tiles.sort(key=lambda t: t[:3])  # an item's pieces lie on ascending share ranks, each piece's tiles in order
    return {"pixels": torch.cat([t[3].reshape(-1) for t in tiles]) if tiles else torch.zeros(0, dtype=torch.uint8),
            "tile_shapes": torch.stack([t[4] for t in tiles]) if tiles else torch.zeros(0, 3, dtype=torch.int32),
            "tile_image": torch.tensor([t[0] for t in tiles], dtype=torch.int32)}


def whole_packs(shares: list[PackTensors]) -> list[PackTensors]:
    """The whole packs of one microbatch of a rank, from its C GPUs' shares (lane order): each pack once,
    in lane order; a lane with nothing in this microbatch gives nothing."""
    packs, lane = [], 0
    while lane < len(shares):
        share = shares[lane]
        if share.empty:
            lane += 1
            continue
        d, _, _ = share_layout(share)
        packs.append(join_shares(shares[lane:lane + d]))
        lane += d
    return packs


class JoinedStream:
    """All C shares of one rank of a CP job (`streams`: its C `PackStream`s, one a lane, in lane order), as
    steps of whole packs: the rank's CP group trained on one GPU. State and conventions are lane 0's stream's."""

    def __init__(self, streams: list):
        self.streams = streams
        self.info, self.job = streams[0].info, streams[0].job

    @property
    def conventions(self):
        return self.streams[0].conventions

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        steps = [next(stream) for stream in self.streams]
        first = steps[0]
        packs = [pack for m in range(len(first.packs)) for pack in whole_packs([s.packs[m] for s in steps])]
        return Step(first.epoch, first.step, first.rank, packs, first.last_in_epoch,
                    [skip for s in steps for skip in s.client_skipped])

    def state_dict(self) -> dict:
        return self.streams[0].state_dict()

    def load_state_dict(self, state: dict) -> None:
        for stream in self.streams:
            stream.load_state_dict(state)

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
