"""Packs whose samples share a prefix (a group's members: GRPO's responses to one prompt), in the two layouts a
trainer can train them in, with the same loss and gradients.

On the wire (docs/wire.md "Shared prefixes") a pack's tensor `shared_prefix` (samples x 2, int32) gives, per
sample, the pack index of the sample that owns its prefix and the prefix's tokens S (0: it shares nothing). An
owner names itself. A sibling (another owner, S > 0) holds the same first S tokens as its owner, none of them in
the loss, and carries no images there: those are its owner's images in its first S tokens.

- `unshared(pack)`: each sample whole, after its own copy of the prefix's images: the layout every trainer
  already trains (`to_hf_inputs(..., shared_prefix=False)`, the default).
- `shared(pack)`: the prefix once. Its first S - 1 tokens are one segment; each member follows as a segment
  [its token S - 1, its response], whose positions continue from the prefix's (`source` maps every token to the
  token of the unshared pack it stands for: positions, M-RoPE rows included, are that token's). A member's
  segment attends to the prefix segment and to itself, never to a sibling; its first token, a copy of the
  prefix's last, predicts the response's first token as it would after its own prefix. The images of the prefix
  are encoded once. `segment_parents` says which segment a segment continues (-1: none).

The rule a model reads from positions alone (the reference model, `continued_segments`): a segment whose first
position p is above 0 continues the latest earlier segment that starts at position 0 and holds p tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from packfeed.client.stream.tensors import PackTensors

# Per-token tensors of a pack (L,), gathered token by token into a new layout
TOKEN_TENSORS = ("input_ids", "labels", "position_ids", "token_policy_version")
# Per visual item, re-laid with the items
ITEM_TENSORS = ("visual_kind", "frame_seconds")


def prefix_rows(pack: PackTensors) -> np.ndarray | None:
    """(samples, 2): each sample's prefix owner (its index in the pack) and shared tokens S; None when the pack
    shares nothing."""
    if "shared_prefix" not in pack.tensors:
        return None
    rows = pack.shared_prefix.view(-1, 2).numpy().astype(np.int64)
    return rows if bool((rows[:, 1] > 0).any()) else None


def _checked(pack: PackTensors, rows: np.ndarray) -> None:
    samples = int(pack.cu_seqlens.numel()) - 1
    bounds = pack.cu_seqlens.numpy().astype(np.int64)
    owner, size = rows[:, 0], rows[:, 1]
    if len(rows) != samples or (owner < 0).any() or (owner >= samples).any() or (size < 0).any() or (size == 1).any() or \
            (size > np.diff(bounds)).any() or (size[owner] != size).any() or (owner[owner] != owner).any():
        raise ValueError(f"pack {pack.sample_keys}: its shared_prefix rows {rows.tolist()} are not (owner, tokens) "
                         "per sample with each owner naming itself, every member within its tokens and tokens 0 or "
                         "at least 2")
    if pack.routed or "cp" in pack.tensors:
        raise ValueError(f"pack {pack.sample_keys}: a routed or context-parallel pack shares no prefix")


def _items(pack: PackTensors) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Each visual item's (start, length, sample) and its tiles."""
    spans = pack.image_token_spans.view(-1, 2).tolist()
    samples = pack.image_sample.tolist()
    tiles = pack.tiles() if pack.tile_shapes.numel() else []
    per_item: list[list[torch.Tensor]] = [[] for _ in spans]
    for tile, item in zip(tiles, pack.tile_image.tolist()):
        per_item[item].append(tile)
    return [[s, n, k] for (s, n), k in zip(spans, samples)], per_item


def _with_items(pack: PackTensors, tensors: dict, order: list[tuple[int, int, int, int]],
                per_item: list[list[torch.Tensor]], pixels: bool = True) -> dict:
    """`tensors` with the visual items `order` = [(new start, length, new sample, old item)]: their spans, samples,
    tiles (copied where an item appears twice; with `pixels` false, their shapes only) and per-item tensors."""
    tiles = [tile for *_, item in order for tile in per_item[item]]
    tensors["image_token_spans"] = torch.tensor([[s, n] for s, n, _, _ in order], dtype=torch.int32).view(-1, 2)
    tensors["image_sample"] = torch.tensor([k for _, _, k, _ in order], dtype=torch.int32)
    tensors["tile_image"] = torch.tensor([j for j, (*_, item) in enumerate(order) for _ in per_item[item]],
                                         dtype=torch.int32)
    tensors["tile_shapes"] = torch.tensor([list(t.shape) for t in tiles], dtype=torch.int32).view(-1, 3)
    tensors["pixels"] = torch.cat([t.reshape(-1) for t in tiles]) if tiles and pixels else \
        torch.zeros(0, dtype=torch.uint8)
    for name in ITEM_TENSORS:
        if name in pack.tensors:
            tensors[name] = pack.tensors[name][[item for *_, item in order]] if order else pack.tensors[name][:0]
    return tensors


def unshared(pack: PackTensors, pixels: bool = True) -> PackTensors:
    """The pack with every sibling's prefix images copied from its owner: each sample as if alone (the same
    tokens; the shared_prefix tensor dropped). `pixels` false: the images' geometry only (no tile is copied; what
    positions need)."""
    rows = prefix_rows(pack)
    if rows is None:
        return pack
    _checked(pack, rows)
    bounds = pack.cu_seqlens.tolist()
    items, per_item = _items(pack)
    order = []
    for sample in range(len(rows)):
        owner, size = rows[sample]
        if owner != sample and size > 0:  # the owner's images within its first S tokens, moved to this sample
            shift = bounds[sample] - bounds[owner]
            order += [(s + shift, n, sample, j) for j, (s, n, k) in enumerate(items)
                      if k == owner and s < bounds[owner] + size]
        order += [(s, n, k, j) for j, (s, n, k) in enumerate(items) if k == sample]
    order.sort(key=lambda item: item[0])
    tensors = {name: t for name, t in pack.tensors.items() if name != "shared_prefix"}
    return replace(pack, tensors=_with_items(pack, tensors, order, per_item, pixels))


def shared(pack: PackTensors) -> PackTensors:
    """The pack laid out with each prefix once (the module's doc): new `cu_seqlens` (segments), tokens and
    per-token tensors gathered by `source` (int64, the unshared pack's token each one stands for), the prefix's
    images once, and `segment_parents` (int32 per segment: the segment it continues, -1 none). A pack sharing
    nothing comes back as it is."""
    rows = prefix_rows(pack)
    if rows is None:
        return pack
    _checked(pack, rows)
    bounds = pack.cu_seqlens.tolist()
    source, segments, parents, segment_of_sample, prefix_segment_of = [], [0], [], {}, {}
    for sample in range(len(rows)):
        owner, size = rows[sample]
        if size < 2 or owner != sample:  # alone, or placed with its owner
            if size < 2:
                source.append(np.arange(bounds[sample], bounds[sample + 1]))
                segments.append(segments[-1] + len(source[-1]))
                parents.append(-1)
                segment_of_sample[sample] = len(parents) - 1
            continue
        source.append(np.arange(bounds[sample], bounds[sample] + size - 1))  # the prefix, but its last token
        segments.append(segments[-1] + size - 1)
        parents.append(-1)
        prefix_segment = prefix_segment_of[sample] = len(parents) - 1
        for member in np.flatnonzero((rows[:, 0] == sample) & (rows[:, 1] >= 2)):
            source.append(np.arange(bounds[member] + size - 1, bounds[member + 1]))
            segments.append(segments[-1] + len(source[-1]))
            parents.append(prefix_segment)
            segment_of_sample[int(member)] = len(parents) - 1
    index = np.concatenate(source) if source else np.zeros(0, np.int64)
    new_of_old = np.full(bounds[-1], -1, np.int64)
    new_of_old[index] = np.arange(len(index))
    source_t = torch.from_numpy(index)
    tensors = {name: t for name, t in pack.tensors.items() if name != "shared_prefix"}
    length = bounds[-1]
    for name, tensor in pack.tensors.items():
        if tensor.dim() >= 1 and tensor.shape[0] == length and (name in TOKEN_TENSORS or name.startswith("token.")):
            tensors[name] = tensor[source_t]
    items, per_item = _items(pack)
    order = []
    for j, (s, n, k) in enumerate(items):
        owner, size = rows[k]
        if owner != k and size >= 2 and s < bounds[k] + size:
            continue  # a sibling's prefix image: its owner's, encoded once
        if new_of_old[s] < 0 or new_of_old[s + n - 1] - new_of_old[s] != n - 1:
            raise ValueError(f"pack {pack.sample_keys}: image {j} of sample {k} straddles its prefix's last token; "
                             "a shared prefix ends after its images")
        in_prefix = k in prefix_segment_of and s < bounds[k] + size - 1
        order.append((int(new_of_old[s]), n, prefix_segment_of[k] if in_prefix else segment_of_sample[k], j))
    order.sort(key=lambda item: item[0])
    tensors = _with_items(pack, tensors, order, per_item)
    tensors["cu_seqlens"] = torch.tensor(segments, dtype=torch.int32)
    tensors["segment_parents"] = torch.tensor(parents, dtype=torch.int32)
    tensors["source"] = source_t
    return replace(pack, tensors=tensors)


def continued_segments(cu_seqlens: torch.Tensor, position_ids: torch.Tensor) -> list[int] | None:
    """Per segment of `cu_seqlens`, the segment it continues (-1: none), read from positions alone (the module's
    rule); None when no segment continues another (every segment starts at position 0)."""
    length = position_ids.shape[-1]
    first = cu_seqlens[:-1].long()
    # each segment's first position, in one gather (one device sync, not one a segment); 0 past the row's end
    starts = torch.where(first < length, position_ids[first.clamp(max=max(length - 1, 0))], 0).tolist()
    if not any(starts):
        return None
    bounds = cu_seqlens.tolist()
    parents, latest = [], {}
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if starts[k] == 0:
            latest = {"segment": k, "length": b - a}
            parents.append(-1)
        elif latest and latest["length"] == starts[k] and b > a:
            parents.append(latest["segment"])
        else:
            raise ValueError(f"segment {k} starts at position {starts[k]} but no earlier segment of that many tokens "
                             "starts at position 0: a continued segment follows its prefix")
    return parents
