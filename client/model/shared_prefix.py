"""Packs whose samples share prefixes, in the two layouts a trainer can train them in, with the same
log-probabilities, loss and gradients: a group's members sharing one prompt (GRPO's responses), or a tree of
trajectories (a conversation's turns, forked at several depths: docs/live.md "Trajectories").

On the wire (docs/wire.md "Shared prefixes") a pack's tensor `shared_prefix` (samples x 2, int32) gives, per
sample, its parent (the pack index of an earlier sample whose first S tokens it holds too) and those tokens S. A
sample sharing nothing, and a tree's root, names itself (its S then the most tokens a sample shares with it, 0
none). A group sharing one prompt is a tree of one level: every member names the first (its owner) with the
prompt's S. A sample carries no image in its first S tokens: they are its parent's (its ancestors'). Labels and
per-token tensors are each sample's own everywhere: a shared turn trained in three trajectories is trained three
times, with each one's advantages.

- `unshared(pack)`: each sample whole, after its own copy of its ancestors' images: the layout every trainer
  already trains (`to_hf_inputs(..., shared_prefix=False)`, the default).
- `shared(pack)`: every shared token once. A tree's root is one segment; each other sample follows as a segment
  [its token S - 1, its end], which attends to its ancestors' rows before that token and to itself, never to a
  sibling; its first token, a copy of its parent's token S - 1, predicts its token S as it would after its own
  prefix. Segments are in pre-order, a sample's children by decreasing S. Positions, M-RoPE rows included, are
  those each token has in its own sample (`source` maps a row to the unshared token it stands for), the images
  of a shared turn are encoded once, and `placement` maps every unshared token to the row that predicts what it
  predicts: log-probabilities of the row, gathered by it, are each sample's (`packfeed.client.model.losses.
  sample_logprobs`).

The rule a model reads from positions alone (the reference model, `continued_segments`): a segment whose first
position p is above 0 continues the latest earlier segment holding position p - 1 (one starting at position s
with n tokens holds s to s + n - 1), and sees that segment's context before p - 1 and its rows up to p - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from packfeed.client.stream.tensors import PackTensors

# Per-token tensors of a pack (L,), gathered token by token into a new layout
TOKEN_TENSORS = ("input_ids", "labels", "position_ids", "token_policy_version")
# Per visual item, re-laid with the items
ITEM_TENSORS = ("visual_kind", "frame_seconds")


def prefix_rows(pack: PackTensors) -> np.ndarray | None:
    """(samples, 2): each sample's parent (its index in the pack) and shared tokens S; None when the pack
    shares nothing."""
    if "shared_prefix" not in pack.tensors:
        return None
    rows = pack.shared_prefix.view(-1, 2).numpy().astype(np.int64)
    return rows if bool((rows[:, 1] > 0).any()) else None


@dataclass(frozen=True)
class Tree:
    """A pack's samples as a forest: per sample its parent (-1: a root, or alone), the tokens S it shares with
    that parent (normalised to the deepest ancestor holding its token S - 2 in its own segment) and where its own
    segment starts in it (0 for a root, S - 1 else), with its token bounds in the wire pack."""

    parent: np.ndarray
    shares: np.ndarray
    first: np.ndarray
    bounds: np.ndarray

    def order(self) -> list[int]:
        """The samples in pre-order, roots in pack order, a sample's children by decreasing S (ties by index)."""
        children: dict[int, list[int]] = {}
        for k in np.flatnonzero(self.parent >= 0).tolist():
            children.setdefault(int(self.parent[k]), []).append(k)
        out, stack = [], [int(k) for k in np.flatnonzero(self.parent < 0)][::-1]
        while stack:
            k = stack.pop()
            out.append(k)
            stack += sorted(children.get(k, []), key=lambda c: (-self.shares[c], c))[::-1]
        return out


def tree_of(pack: PackTensors, rows: np.ndarray) -> Tree:
    """The pack's forest, its rows checked: a parent earlier in the pack, S of 0 or at least 2 and within both
    samples, the shared tokens equal, no image of a sample in its first S tokens."""
    samples = int(pack.cu_seqlens.numel()) - 1
    bounds = pack.cu_seqlens.numpy().astype(np.int64)
    lengths = np.diff(bounds)
    index = np.arange(len(rows))
    parent, size = rows[:, 0], rows[:, 1]
    child = (parent != index) & (size > 0)
    if len(rows) != samples or (parent < 0).any() or (parent > index).any() or (size < 0).any() or \
            (size == 1).any() or (size > lengths).any() or (size[child] > lengths[parent[child]]).any():
        raise ValueError(f"pack {pack.sample_keys}: its shared_prefix rows {rows.tolist()} are not (parent, tokens) "
                         "per sample with each parent earlier in the pack (a root naming itself), every sample "
                         "within its own and its parent's tokens and tokens 0 or at least 2")
    if pack.routed or "cp" in pack.tensors:
        raise ValueError(f"pack {pack.sample_keys}: a routed or context-parallel pack shares no prefix")
    ids = pack.input_ids
    starts = pack.image_token_spans.view(-1, 2)[:, 0].numpy().astype(np.int64)
    of_sample = pack.image_sample.numpy().astype(np.int64)
    shares = np.where(child, size, 0)
    normal = np.where(child, parent, -1)
    for k in np.flatnonzero(child).tolist():
        p, s = int(normal[k]), int(shares[k])
        if not torch.equal(ids[bounds[k]:bounds[k] + s], ids[bounds[p]:bounds[p] + s]):
            raise ValueError(f"pack {pack.sample_keys}: sample {k} does not start with the {s} tokens of sample {p} "
                             "it names as its parent")
        if ((of_sample == k) & (starts < bounds[k] + s)).any():
            raise ValueError(f"pack {pack.sample_keys}: sample {k} carries an image in its first {s} tokens, which "
                             f"are its parent's (sample {p}): its images there are its parent's, sent once")
        while normal[p] >= 0 and s <= shares[p]:  # forks within its parent's own shared tokens: a grandparent's
            p = int(normal[p])
        normal[k] = p
    return Tree(normal, shares, np.where(normal >= 0, shares - 1, 0), bounds)


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


def _whole_items(pack: PackTensors, tree: Tree) -> list[tuple[int, int, int, int]]:
    """Every sample's visual items as if it were alone, [(start in the wire pack, length, sample, wire item)]: its
    ancestors' within its first S tokens (an item straddling S refused), then its own."""
    items, _ = _items(pack)
    bounds = tree.bounds
    whole: dict[int, list[tuple[int, int, int]]] = {}  # sample -> [(offset in it, length, wire item)]
    for k in range(len(bounds) - 1):
        inherited = []
        if tree.parent[k] >= 0:
            s = int(tree.shares[k])
            for offset, n, item in whole[int(tree.parent[k])]:
                if offset < s < offset + n:
                    raise ValueError(f"pack {pack.sample_keys}: sample {k} shares {s} tokens with its parent, "
                                     f"within image {item}'s placeholders: a sample forks after an image, not in it")
                if offset + n <= s:
                    inherited.append((offset, n, item))
        whole[k] = inherited + [(s - int(bounds[k]), n, j) for j, (s, n, owner) in enumerate(items) if owner == k]
    return [(int(bounds[k]) + offset, n, k, item) for k, found in whole.items() for offset, n, item in found]


def unshared(pack: PackTensors, pixels: bool = True) -> PackTensors:
    """The pack with every sample's ancestors' images copied into it: each sample as if alone (the same tokens;
    the shared_prefix tensor dropped). `pixels` false: the images' geometry only (no tile is copied; what
    positions need)."""
    rows = prefix_rows(pack)
    if rows is None:
        return pack
    tree = tree_of(pack, rows)
    _, per_item = _items(pack)
    order = sorted(_whole_items(pack, tree), key=lambda item: item[0])
    tensors = {name: t for name, t in pack.tensors.items() if name != "shared_prefix"}
    return replace(pack, tensors=_with_items(pack, tensors, order, per_item, pixels))


def shared(pack: PackTensors) -> PackTensors:
    """The pack laid out with every shared token once (the module's doc): new `cu_seqlens` (segments), tokens and
    per-token tensors gathered by `source` (int64, the unshared token each row stands for), each image once,
    `segment_parents` (int32 per segment: the segment it continues, -1 none), `segment_starts` (int32: where in its
    sample each segment starts) and `placement` (int64 per unshared token: the row predicting its next token). A
    pack sharing nothing comes back as it is."""
    rows = prefix_rows(pack)
    if rows is None:
        return pack
    tree = tree_of(pack, rows)
    layout = token_layout(tree)
    bounds, order, index = tree.bounds, layout.order, layout.source
    segment_of = {k: s for s, k in enumerate(order)}
    new_of_old = np.full(bounds[-1], -1, np.int64)
    new_of_old[index] = np.arange(len(index))
    source_t = torch.from_numpy(index)
    tensors = {name: t for name, t in pack.tensors.items() if name != "shared_prefix"}
    for name, tensor in pack.tensors.items():
        if tensor.dim() >= 1 and tensor.shape[0] == bounds[-1] and (name in TOKEN_TENSORS or name.startswith("token.")):
            tensors[name] = tensor[source_t]
    _, per_item = _items(pack)
    items = []
    for start, n, k, item in _whole_items(pack, tree):
        first = bounds[k] + tree.first[k]
        if start + n <= first:
            continue  # an ancestor's image, encoded once where its own segment holds it
        if start < first:
            raise ValueError(f"pack {pack.sample_keys}: sample {k}'s image {item} ends at its token S - 1, which its "
                             "segment repeats: a sample forks after a text token")
        items.append((int(new_of_old[start]), n, segment_of[k], item))
    tensors = _with_items(pack, tensors, sorted(items), per_item)
    tensors["cu_seqlens"] = torch.from_numpy(layout.bounds.astype(np.int32))
    tensors["segment_parents"] = torch.tensor([segment_of[int(tree.parent[k])] if tree.parent[k] >= 0 else -1
                                               for k in order], dtype=torch.int32)
    tensors["segment_starts"] = torch.tensor([int(tree.first[k]) for k in order], dtype=torch.int32)
    tensors["source"] = source_t
    tensors["placement"] = torch.from_numpy(layout.placement)
    return replace(pack, tensors=tensors)


@dataclass(frozen=True)
class TokenLayout:
    """The rows of a pack's shared layout, without its images: the samples in segment order, each row's unshared
    token (`source`), the segments' bounds, and each unshared token's predicting row (`placement`)."""

    order: list[int]
    source: np.ndarray
    bounds: np.ndarray
    placement: np.ndarray


def token_layout(tree: Tree) -> TokenLayout:
    """`shared`'s rows for a pack's forest (`tree_of`), computed from token counts alone."""
    bounds, order = tree.bounds, tree.order()
    source = [np.arange(bounds[k] + tree.first[k], bounds[k + 1]) for k in order]
    index = np.concatenate(source) if source else np.zeros(0, np.int64)
    placement = np.full(bounds[-1], -1, np.int64)
    placement[index] = np.arange(len(index))
    for k in range(len(bounds) - 1):  # a parent is earlier in the pack: its tokens are placed before its child's
        if tree.parent[k] >= 0:
            p, head = int(tree.parent[k]), int(tree.first[k])  # its tokens before S - 1 predict what its parent's do
            placement[bounds[k]:bounds[k] + head] = placement[bounds[p]:bounds[p] + head]
    return TokenLayout(order, index, np.r_[0, np.cumsum([len(x) for x in source])].astype(np.int64), placement)


def shared_tokens(pack: PackTensors) -> TokenLayout | None:
    """The token rows `shared(pack)` lays out (no image is copied), or None for a pack sharing nothing."""
    rows = prefix_rows(pack)
    return None if rows is None else token_layout(tree_of(pack, rows))


def continued_segments(cu_seqlens: torch.Tensor, position_ids: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """Per segment of `cu_seqlens`, (the segment it continues (-1: none), its first position), read from
    positions alone (the module's rule); None when no segment continues another (every segment starts at
    position 0)."""
    length = position_ids.shape[-1]
    first = cu_seqlens[:-1].long()
    # each segment's first position, in one gather (one device sync, not one a segment); 0 past the row's end
    starts = torch.where(first < length, position_ids[first.clamp(max=max(length - 1, 0))], 0).tolist()
    if not any(starts):
        return None
    bounds = cu_seqlens.tolist()
    parents: list[int] = []
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if starts[k] == 0 or b <= a:
            parents.append(-1)
            continue
        held = next((s for s in range(k - 1, -1, -1)
                     if starts[s] <= starts[k] - 1 < starts[s] + bounds[s + 1] - bounds[s]), None)
        if held is None:
            raise ValueError(f"segment {k} starts at position {starts[k]} but no earlier segment holds position "
                             f"{starts[k] - 1}: a continued segment follows its prefix")
        parents.append(held)
    return parents, [int(s) if p >= 0 else 0 for s, p in zip(starts, parents)]
