"""Context-parallel shares on the client: joining the shares of a pack back into the whole pack, and a stream
that trains a CP plan on fewer GPUs than it plans (every lane of a rank's CP group in one process).

`PackStream(..., cp_rank=r)` gives GPU r of a rank's CP group its share of every pack (docs/wire.md
"Context-parallel shares"). `join_shares` undoes the split: the d shares of a pack at degree d give exactly the
pack a job without context parallelism would send for those samples (tokens in sample order, every item's
tiles), which is what a single GPU trains when it runs the pack whole. `JoinedStream` reads all C shares of a
rank (C streams) and yields steps of whole packs: the baseline a CP run is checked against, on one GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from packfeed.client.tensors import PackTensors, Step

ITEM_TENSORS = ("image_sample", "image_token_spans", "visual_kind", "frame_seconds")


def share_layout(pack: PackTensors) -> tuple[int, int, int]:
    """(degree d, cp_group g, CP rank j) of a share."""
    d, g, j = pack.cp.tolist()
    return int(d), int(g), int(j)


def join_shares(shares: list[PackTensors]) -> PackTensors:
    """The whole pack of its d shares (in CP rank order, as `PackStream(cp_rank=g*d + j)` received them)."""
    first = shares[0]
    d, g, _ = share_layout(first)
    if len(shares) != d or [share_layout(s) for s in shares] != [(d, g, j) for j in range(d)]:
        raise ValueError(f"join_shares needs the {d} shares of one pack in CP rank order, got "
                         f"{[share_layout(s) for s in shares]}")
    bounds = first.cp_seqlens.long()
    total = int(bounds[-1])
    tensors = {name: torch.empty(total, dtype=first.tensors[name].dtype)
               for name in ("input_ids", "labels", "position_ids")}
    for share in shares:
        local = share.cu_seqlens.long().tolist()
        for s, (a0, b0, a1, b1) in enumerate(share.cp_chunks.tolist()):
            start, held = int(bounds[s]), local[s]
            for name, target in tensors.items():
                source = share.tensors[name]
                target[start + a0:start + b0] = source[held:held + b0 - a0]
                target[start + a1:start + b1] = source[held + b0 - a0:local[s + 1]]
    tensors["cu_seqlens"] = first.cp_seqlens.clone()
    tensors.update({name: first.tensors[name].clone() for name in ITEM_TENSORS})
    tensors.update(_joined_tiles(shares))
    return PackTensors(first.epoch, first.step, first.rank, first.microbatch, first.empty, list(first.sample_keys),
                       sum(s.loss_tokens for s in shares), first.step_loss_tokens,
                       [skip for s in shares for skip in s.skipped], tensors, sum(s.nbytes for s in shares),
                       first.microbatches, first.last_in_epoch, list(first.sample_sources))


def _joined_tiles(shares: list[PackTensors]) -> dict[str, torch.Tensor]:
    """Every share's tiles (each of the items its rank encodes) in item order, as one pack's."""
    tiles = [(int(item), k, tile, shape) for share in shares
             for k, (item, tile, shape) in enumerate(zip(share.tile_image.tolist(), share.tiles(),
                                                         share.tile_shapes.view(-1, 3)))]
    tiles.sort(key=lambda t: (t[0], t[1]))  # an item's tiles come from one share, in their order
    return {"pixels": torch.cat([t[2].reshape(-1) for t in tiles]) if tiles else torch.zeros(0, dtype=torch.uint8),
            "tile_shapes": torch.stack([t[3] for t in tiles]) if tiles else torch.zeros(0, 3, dtype=torch.int32),
            "tile_image": torch.tensor([t[0] for t in tiles], dtype=torch.int32)}


def whole_packs(lanes: list[PackTensors]) -> list[PackTensors]:
    """The whole packs of one microbatch of a rank, from its C lanes' shares (lane order): each pack once,
    in lane order; lanes with nothing in this microbatch give nothing."""
    packs, lane = [], 0
    while lane < len(lanes):
        share = lanes[lane]
        if share.empty:
            lane += 1
            continue
        d, _, _ = share_layout(share)
        packs.append(join_shares(lanes[lane:lane + d]))
        lane += d
    return packs


class JoinedStream:
    """All C shares of one rank of a CP job (`streams`: its C `PackStream`s, cp_rank 0..C-1), as steps of whole
    packs: the rank's CP group trained on one GPU. State and conventions are the cp_rank 0 stream's."""

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
