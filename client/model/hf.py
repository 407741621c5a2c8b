"""Packs as Hugging Face VLM inputs: `to_hf_inputs(pack, model_family, dp=...)` returns the keyword arguments of
the model's `forward` for one pack, so a `transformers` VLM trains on packs with the loss and gradients of running
each sample alone.

    for step in stream:
        for pack in step.packs:
            loss = model(**to_hf_inputs(pack, "qwen2_vl", dp=world_size, conventions=stream.conventions)).loss
            loss.backward()
        optimizer.step(); optimizer.zero_grad()

A model that fits the dataset: `model_config(family, stream.conventions, text={...}, vision={...})` is the
family's `transformers` config with the dataset's vocabulary, placeholder ids and vision geometry
(`packfeed.client.model.hf_config`); `check_model(model, conventions)` refuses one that disagrees, naming the field.

Families (`hf_families.FAMILIES`): internvl (InternVLForConditionalGeneration: InternVL 2.5 / 3 "-hf"), qwen2_vl, qwen2_5_vl,
qwen3_vl (Qwen*VLForConditionalGeneration), llava (LlavaForConditionalGeneration). The traps it handles, each of
which leaves the loss slightly wrong without an error:

- `use_cache=False`: with a cache, HF does not build the packed (block-diagonal) mask from `position_ids`.
- Positions restart at every sample and no `attention_mask` is passed: HF derives the packed mask from them.
  Qwen's M-RoPE positions go as 4 rows, the text row first: with 3 rows HF builds no packed mask. They are
  computed per sample exactly as the model's `get_rope_index` does (3-D positions for image tokens).
- Labels are int64 and -100 at every sample's first token: HF shifts labels inside the loss, so the last token
  of one sample would otherwise be trained to predict the first token of the next.
- `num_items_in_batch` = the step's loss tokens (all ranks, all microbatches) / `dp`: DDP and FSDP average
  gradients over the DP ranks, so dividing by the global count alone would make the gradient `dp` times too small.
- `pixel_values` is left out of text-only packs (InternVL fails on an empty tensor).
- Videos: InternVL's frames are images; Qwen's go as `pixel_values_videos` / `video_grid_thw` with
  `mm_token_type_ids` 2, and their M-RoPE time positions as the model's own (Qwen2.5-VL spaces them by
  `tokens_per_second` x the seconds a temporal patch spans; Qwen3-VL sends each temporal patch as a row of its
  own, grid t = 1, as its `get_rope_index` splits them).
- Placeholder tokens are counted against the image features each image will give; a mismatch is an error here,
  not a shape error deep in the model.
- `attention="varlen"` adds the variable-length kwargs (`cu_seq_lens_q/k`, `max_length_q/k`): flash-attention
  kernels read them on CUDA (`attn_implementation="flash_attention_2"`), and so does Packfeed's CPU kernel
  (`attn_implementation=register_varlen_attention()`), which runs sdpa per sample instead of building HF's dense
  L x L packed mask (BENCHMARKS.md "Packed attention on CPU"). sdpa and eager ignore them: there the packed mask
  from positions isolates the samples (`attention="sdpa"`, the default).

Pixels travel as uint8; they are normalised here as the family's processor does: `(x / 255 - mean) / std`, with
the mean and std of the dataset's conventions (`JobInfo.conventions.image_policy`), or the family's published
values when no conventions are given.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from packfeed.client.model.attention import register_varlen_attention  # noqa: F401  (re-exported: HF users import both from here)
from packfeed.client.model.attention import segment_context
from packfeed.client.model.hf_config import check_model, model_config  # noqa: F401  (re-exported, as above)
from packfeed.client.model.hf_families import (Family, family_of, mrope_positions, normalisation_of, normalised,
                                         qwen_grid, qwen_item_patches, time_intervals, visual_kinds)
from packfeed.client.model.shared_prefix import shared, unshared
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors
from packfeed.client.model.towers import with_every_encoder
from packfeed.v1.options import VisualKind

def to_hf_inputs(pack: PackTensors, model_family: str | Family, dp: int = 1, *,
                 conventions: Any = None, dtype: torch.dtype = torch.float32,
                 attention: Literal["sdpa", "varlen"] = "sdpa", device: torch.device | str | None = None,
                 image_token_id: int | None = None, tokens_per_second: float | None = None,
                 layout: Literal["packed", "padded"] = "packed", ensure_encoders: bool = False,
                 model: Any = None, shared_prefix: bool = False) -> dict[str, Any]:
    """The keyword arguments of the family's `ForConditionalGeneration.forward` for one pack (batch of one
    packed row). `dp`: the data-parallel world size the gradients are averaged over. `conventions`: the job's
    `ModelConventions` (normalisation and the placeholder id come from it). `dtype`: the pixels' dtype (the
    vision tower's). `image_token_id`: the placeholder's id when no conventions are given, to check counts.
    `tokens_per_second`: Qwen2.5-VL's `config.vision_config.tokens_per_second` (the family's default: 2, as the
    released checkpoints), which spaces a video's temporal positions by its frames' time. `layout="padded"`:
    the pack's samples as HF's usual padded batch instead (one row each, right-padded to the longest, with an
    `attention_mask`; sdpa or eager attention), the same loss: what packing saves is measured against it.
    `ensure_encoders`: every pack calls each of the family's vision towers (images, and Qwen's videos) the same
    number of times, whatever it holds: a tower the pack would not call gets one dummy item, a segment of its
    own at the end of the row whose tokens are outside the loss (`packfeed.client.model.towers`). Under FSDP or ZeRO-3
    with the vision tower wrapped apart, a rank that skips the tower leaves the others waiting in its
    all-gathers forever; this keeps every rank's collectives in step (needs `conventions`). `model`: the model
    these inputs are for, refused (`check_model`) where its vocabulary or placeholder ids are not the dataset's.
    `shared_prefix`: a pack whose samples share a prefix (a group's members, `packfeed.client.model.shared_prefix`) is
    laid out with the prefix once, its images encoded once, each member's response after it with the positions it
    would have after its own copy (M-RoPE rows included), and an `attention_mask` (1, 1, L, L) under which a
    response sees the prefix and itself, never a sibling (sdpa or eager attention; `attention="varlen"` passes
    the segments to Packfeed's varlen kernel instead): the same loss and gradients as each sample alone. False
    (the default): every member whole, after its own copy of the prefix's images."""
    family = family_of(model_family)
    if model is not None:
        if conventions is None:
            raise ValueError("to_hf_inputs(..., model=...) checks the model against the dataset: give conventions=")
        check_model(model, conventions)
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', not {layout!r}")
    if layout == "padded" and attention != "sdpa":
        raise ValueError("a padded batch is masked by its attention_mask: use attention='sdpa' with layout='padded'")
    if dp < 1:
        raise ValueError("dp must be at least 1")
    if "cp" in pack.tensors:
        raise ValueError("this is one GPU's context-parallel share of a pack (PackStream(seat=Seat(rank, "
                         "lane=...))): a model's forward needs K and V of the whole pack; join a pack's shares with "
                         "packfeed.client.model.context_parallel.join_shares and train it whole, or train with "
                         "packfeed train parallel.cp (the reference model or model.hf=qwen2_vl)")
    if pack.empty:  # a rank with no samples in this microbatch still joins the step's collectives
        return empty_hf_inputs(pack, dp, device, model_family=family if ensure_encoders else None,
                               conventions=conventions, dtype=dtype)
    # each sample as if alone (a sibling's prefix images copied from its owner): what is trained without sharing;
    # with it, only the positions its tokens would have (no pixels copied)
    whole = unshared(pack, pixels=not shared_prefix)
    laid = shared(pack) if shared_prefix else whole
    if shared_prefix and layout == "padded":
        raise ValueError("shared_prefix lays the pack out as one packed row: use layout='packed'")
    return _inputs(laid, whole, family, dp, conventions, dtype, attention, device, image_token_id, tokens_per_second,
                   layout, ensure_encoders)


def _inputs(pack: PackTensors, whole: PackTensors, family: Family, dp: int, conventions: Any, dtype: torch.dtype,
            attention: str, device: Any, image_token_id: int | None, tokens_per_second: float | None, layout: str,
            ensure_encoders: bool) -> dict[str, Any]:
    """`to_hf_inputs` of `pack` (laid out as it is: `whole` when no prefix is shared, else its shared layout, whose
    M-RoPE positions are those of `whole`'s tokens)."""
    parents = pack.segment_parents.tolist() if "segment_parents" in pack.tensors else None
    starts = pack.segment_starts.tolist() if "segment_starts" in pack.tensors else None
    mean, std = normalisation_of(family, conventions)
    if conventions is not None:
        image_token_id = conventions.image_context_id
    input_ids = pack.input_ids.to(torch.long)
    labels = pack.labels.to(torch.long).clone()
    labels[pack.cu_seqlens[:-1].to(torch.long)] = IGNORE_INDEX  # no sample learns from the one before it
    inputs: dict[str, Any] = {"input_ids": input_ids.unsqueeze(0), "labels": labels.unsqueeze(0),
                              "use_cache": False,
                              "num_items_in_batch": torch.tensor(pack.step_loss_tokens / dp, dtype=torch.float32)}
    tiles = pack.tiles() if pack.tile_shapes.shape[0] else []
    if device is not None:  # uint8 to the device, normalised there: a quarter of the bytes, none of the host's CPU
        tiles = [tile.to(device, non_blocking=True) for tile in tiles]
    features = normalised(tiles, mean, std, dtype)
    kinds = visual_kinds(pack)
    text_positions = pack.position_ids.to(torch.long)
    if family.image_policy == "qwen2vl":
        flattened = qwen_item_patches(pack, features, kinds, family)
        grids = [grid for _, grid in flattened]
        intervals = time_intervals(pack, kinds, family, tokens_per_second)
        if parents is None:
            positions = mrope_positions(pack, grids, family.merge_size, intervals)
        else:  # the positions each token has in the unshared layout
            positions = whole_mrope(whole, family, tokens_per_second)[:, pack.source]
        inputs["position_ids"] = torch.cat([text_positions.unsqueeze(0), positions]).unsqueeze(1)  # (4, 1, L)
        for kind, pixels_name, grid_name in ((VisualKind.IMAGE, "pixel_values", "image_grid_thw"),
                                             (VisualKind.VIDEO, "pixel_values_videos", "video_grid_thw")):
            chosen = [k for k, item_kind in enumerate(kinds) if item_kind == kind]
            if chosen:
                inputs[pixels_name] = torch.cat([flattened[k][0] for k in chosen])
                inputs[grid_name] = torch.tensor([grids[k] for k in chosen], dtype=torch.long)
        if flattened:
            inputs["mm_token_type_ids"] = _token_types(pack, kinds).unsqueeze(0)
        expected = {kind: sum(t * h * w for (t, h, w), item_kind in zip(grids, kinds) if item_kind == kind)
                    // family.merge_size ** 2 for kind in (VisualKind.IMAGE, VisualKind.VIDEO)}
    else:  # a video's frames are images
        inputs["position_ids"] = text_positions.unsqueeze(0)
        if features:
            inputs["pixel_values"] = torch.stack(features)
        expected = {VisualKind.IMAGE: int(pack.image_token_spans[:, 1].sum()) if len(features) else 0,
                    VisualKind.VIDEO: 0}
    video_token_id = None
    if conventions is not None and conventions.HasField("video_context_id"):
        video_token_id = conventions.video_context_id
    for kind, token_id, name in ((VisualKind.IMAGE, image_token_id, "image_token_id"),
                                 (VisualKind.VIDEO, video_token_id, "video_token_id")):
        if token_id is None:
            continue
        placeholders = int((input_ids == token_id).sum())
        if placeholders != expected[kind]:
            what = "image" if kind == VisualKind.IMAGE else "video"
            raise ValueError(f"pack {pack.sample_keys}: {placeholders} {what} placeholder tokens for {expected[kind]} "
                             f"{what} features; the model's {name} must be the dataset's {what} context token")
    if attention not in ("sdpa", "varlen"):
        raise ValueError(f"attention must be 'sdpa' or 'varlen', not {attention!r}")
    bounds = pack.cu_seqlens.to(torch.int32)
    if ensure_encoders:
        if layout == "padded":
            raise ValueError("ensure_encoders adds a segment to a packed row: use layout='packed'")
        inputs, bounds = with_every_encoder(inputs, bounds, family, conventions, dtype)
    if parents is not None:
        extra = len(bounds) - 1 - len(parents)  # ensure_encoders' segment continues nothing
        parents = parents + [-1] * extra
        starts = None if starts is None else starts + [0] * extra
        if attention == "sdpa":
            inputs["attention_mask"] = segment_mask(bounds.tolist(), parents, starts)
        else:
            inputs["segment_parents"] = parents
            if starts is not None:
                inputs["segment_starts"] = starts
    if attention == "varlen":
        longest = int((bounds[1:] - bounds[:-1]).max()) if len(bounds) > 1 else 0
        inputs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    if layout == "padded":
        inputs = padded_rows(inputs, pack.cu_seqlens.tolist())
    if device is not None:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return inputs


def whole_mrope(pack: PackTensors, family: Family, tokens_per_second: float | None) -> torch.Tensor:
    """(3, L) M-RoPE positions of a pack laid out whole (each sample with its own images)."""
    kinds = visual_kinds(pack)
    frames = [[] for _ in kinds]  # each item's frames' (C, H, W): the grids need no pixel values
    for shape, item in zip(pack.tile_shapes.view(-1, 3).tolist(), pack.tile_image.tolist()):
        frames[item].append(shape)
    grids = [qwen_grid(len(shapes), shapes[0][1], shapes[0][2], family) for shapes in frames]
    return mrope_positions(pack, grids, family.merge_size, time_intervals(pack, kinds, family, tokens_per_second))


def segment_mask(bounds: list[int], parents: list[int], starts: list[int] | None = None) -> torch.Tensor:
    """(1, 1, L, L) bool: token i sees token j of its own segment at or before it, and every row of its segment's
    context (`segment_context`: its ancestors' rows before it, `parents` and `starts`), as
    `packfeed.client.model.attention.segment_attention` computes without a mask."""
    length = bounds[-1]
    mask = torch.zeros(length, length, dtype=torch.bool)
    for (a, b), context in zip(zip(bounds[:-1], bounds[1:]), segment_context(bounds, parents, starts)):
        mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        mask[a:b, context] = True
    return mask[None, None]


def empty_hf_inputs(pack: PackTensors, dp: int = 1, device: torch.device | str | None = None, *,
                    model_family: str | Family | None = None, conventions: Any = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A model's inputs for an empty pack (a rank with no samples in this microbatch, which must still join the
    step's collectives): one ignored token, a loss of 0 that adds nothing to the gradients. It carries the step's
    `num_items_in_batch` like any pack (a Trainer reads it from a step's first batch); 1 where that is 0, since a
    mean over no token is NaN. With `model_family` and `conventions`, it also calls every vision tower once, as
    `to_hf_inputs(..., ensure_encoders=True)` does."""
    share = pack.step_loss_tokens / dp
    inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "labels": torch.full((1, 1), IGNORE_INDEX),
              "use_cache": False,
              "num_items_in_batch": torch.tensor(share if share > 0 else 1.0, dtype=torch.float32)}
    if model_family is not None:
        family = family_of(model_family)
        qwen = family.image_policy == "qwen2vl"
        inputs["position_ids"] = torch.zeros((4, 1, 1) if qwen else (1, 1), dtype=torch.long)
        inputs, _ = with_every_encoder(inputs, torch.tensor([0, 1], dtype=torch.int32), family, conventions, dtype)
    return {k: v.to(device) if isinstance(v, torch.Tensor) and device is not None else v for k, v in inputs.items()}


ROW_TENSORS = {"input_ids": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}  # per-token tensors, padding value


def padded_rows(inputs: dict[str, Any], bounds: list[int]) -> dict[str, Any]:
    """One packed row's inputs as a padded batch: each sample a row, right-padded to the longest. Padding sits
    outside the loss (labels -100) and outside attention (`attention_mask` 0); its positions are 1, as the
    families' own `get_rope_index` gives padding. Pixels stay as they are: images keep their order."""
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    longest = max(b - a for a, b in spans)
    out = dict(inputs)

    def rows(row: torch.Tensor, fill: int) -> torch.Tensor:  # (..., L) -> (..., samples, longest)
        padded = row.new_full((*row.shape[:-1], len(spans), longest), fill)
        for k, (a, b) in enumerate(spans):
            padded[..., k, : b - a] = row[..., a:b]
        return padded

    for name, fill in ROW_TENSORS.items():
        if name in inputs:
            out[name] = rows(inputs[name][0], fill)
    positions = inputs["position_ids"]
    out["position_ids"] = rows(positions[:, 0], 1) if positions.dim() == 3 else rows(positions[0], 1)
    out["attention_mask"] = rows(torch.ones(bounds[-1], dtype=torch.long), 0)
    return out


def _token_types(pack: PackTensors, kinds: list[int]) -> torch.Tensor:
    """0 for text, 1 for image and 2 for video placeholder tokens (Qwen's `mm_token_type_ids`)."""
    types = torch.zeros(pack.input_ids.shape[0], dtype=torch.int32)
    for (start, count), kind in zip(pack.image_token_spans.tolist(), kinds):
        types[start:start + count] = 2 if kind == VisualKind.VIDEO else 1
    return types
