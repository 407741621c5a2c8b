"""A step's packs as the first pipeline stage's inputs for a `transformers` VLM: each pack through
`packfeed.client.model.hf.to_hf_inputs` (the one owner of the families' conventions: normalisation, Qwen's patch
layout and M-RoPE positions, labels masked at every sample start, placeholder checks), then padded to the step's
shape and concatenated (see `packfeed.trainer.batch`).

Padding never reaches a real token: padded tokens form a segment of their own after the last sample (labels
-100), padded tiles are zeros whose features go nowhere (vision position -1). Qwen's padded patches are one
dummy image of (1, merge, k x merge) patches, so the vision tower's own helpers (`transformers.vision_utils`)
compute every patch's rotary position, the per-image (Qwen2.5-VL: per-window) attention bounds and Qwen3-VL's
resampled position-table taps for the real images and the dummy alike; they are computed here, on the data
side, and ride with the pixels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packfeed.client.model.attention import VARLEN_ATTENTION
from packfeed.trainer.batch import Microbatches, StepShape, round_up


@dataclass
class PackInputs:
    """One pack before padding."""

    input_ids: torch.Tensor  # (L,)
    labels: torch.Tensor  # (L,) -100 at every sample's first token
    positions: torch.Tensor  # (R, L): the text row (and Qwen's 3 M-RoPE rows)
    bounds: torch.Tensor  # (samples + 1,)
    pixels: torch.Tensor  # Qwen: (patches, C x T x P x P); tiles: (T, 3, S, S)
    grids: torch.Tensor  # Qwen: (images + videos, 3); tiles: empty
    vision_positions: torch.Tensor  # (vision tokens,) where each feature goes in input_ids


class InputBuilder:
    def __init__(self, model):
        self.model = model
        self.family = model.family
        self.qwen = model.merge_unit > 1
        vision = model.vision_config
        if self.qwen:
            self.merge = vision.spatial_merge_size
            self.patch_features = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
            self.tile_size = self.tile_tokens = 0
        else:
            size = vision.image_size
            self.tile_size = size[0] if isinstance(size, (list, tuple)) else size
            patch = vision.patch_size
            patch = patch[0] if isinstance(patch, (list, tuple)) else patch
            self.tile_tokens = (self.tile_size // patch) ** 2 + 1  # patches and the class token
            self.patch_features = 0
        config = model.hf.config
        self.image_token = config.image_token_id
        self.video_token = getattr(config, "video_token_id", None)

    def pack(self, pack, dp: int) -> PackInputs:
        from packfeed.client.model.hf import to_hf_inputs

        tokens_per_second = getattr(self.model.vision_config, "tokens_per_second", None)
        # a group's prompt computed once where the layers' attention reads the segments (Packfeed's kernel)
        share = self.model.hf.config._attn_implementation == VARLEN_ATTENTION
        kwargs = to_hf_inputs(pack, self.family, dp=dp, conventions=self.model.conventions,
                              tokens_per_second=tokens_per_second if self.family == "qwen2_5_vl" else None,
                              shared_prefix=share, attention="varlen" if share else "sdpa")
        ids = kwargs["input_ids"][0]
        positions = kwargs["position_ids"].reshape(-1, ids.shape[0])
        places = [torch.nonzero(ids == self.image_token).flatten()]
        if self.qwen:
            pixels = [kwargs[k] for k in ("pixel_values", "pixel_values_videos") if k in kwargs]
            grids = [kwargs[k] for k in ("image_grid_thw", "video_grid_thw") if k in kwargs]
            if self.video_token is not None:
                places.append(torch.nonzero(ids == self.video_token).flatten())
            pixels = torch.cat(pixels) if pixels else torch.zeros(0, self.patch_features)
            grids = torch.cat(grids).long() if grids else torch.zeros(0, 3, dtype=torch.long)
        else:
            pixels = kwargs.get("pixel_values", torch.zeros(0, 3, self.tile_size, self.tile_size))
            grids = torch.zeros(0, 3, dtype=torch.long)
        bounds = kwargs["cu_seq_lens_q"].long() if share else pack.cu_seqlens.long()  # the row's segments
        return PackInputs(ids, kwargs["labels"][0], positions, bounds, pixels, grids, torch.cat(places))

    def microbatches(self, step, token_multiple: int = 64, dp: int = 1, collate: str = "packed") -> Microbatches:
        """`step`: a `packfeed.client.Step` (its M packs). `collate="padded"`: each pack's samples laid out as a
        padded batch (see `padded_batch`)."""
        packs = [self.pack(p, dp) for p in step.packs]
        if collate == "padded":
            packs = [padded_batch(p) for p in packs]
        tokens = round_up(max([int(p.input_ids.numel()) for p in packs] + [1]), token_multiple)
        samples = max([int(p.bounds.numel()) - 1 for p in packs] + [1])
        unit = self.model.merge_unit
        tiles = max([int(p.pixels.shape[0]) for p in packs] + [unit])  # at least one dummy image / tile
        geometry = [self.patch_geometry(p, tiles) for p in packs] if self.qwen else [{} for _ in packs]
        vision_segments = max([int(g["vision_bounds"].numel()) for g in geometry if g] + [0])
        window_segments = max([int(g["window_bounds"].numel()) for g in geometry if "window_bounds" in g] + [0])
        shape = StepShape(tokens, tiles, samples, int(step.packs[0].step_loss_tokens), step.epoch, step.step,
                          step.last_in_epoch, vision_tokens=tiles // unit if self.qwen else
                          tiles * self.tokens_per_tile, vision_segments=vision_segments,
                          window_segments=window_segments)
        padded = [self.pad(p, g, shape) for p, g in zip(packs, geometry)]
        names = self.model.names[0]
        args = tuple(torch.cat([item[name] for item in padded]) for name in names)
        return Microbatches(shape, args, sum(int(p.input_ids.numel()) for p in packs),
                            sum(int(p.pixels.shape[0]) for p in packs), dict(Counter(step.sample_sources)))

    @property
    def tokens_per_tile(self) -> int:
        return int(self.model.conventions.image_policy.tokens_per_tile)

    def patch_geometry(self, pack: PackInputs, patches: int) -> dict[str, torch.Tensor]:
        """Qwen: the real images' grids plus the dummy one filling the step's patches, and what the vision tower
        derives from them (as its `forward` would)."""
        from transformers import vision_utils as vu

        m, vision = self.merge, self.model.vision_config
        missing = patches - int(pack.pixels.shape[0])
        grids = pack.grids
        if missing:
            grids = torch.cat([grids, torch.tensor([[1, m, missing // m]], dtype=torch.long)])
        geometry = {"grids": grids, "patch_positions": vu.get_vision_position_ids(grids, m),
                    "vision_bounds": vu.get_vision_cu_seqlens(grids)}
        if self.family == "qwen2_5_vl":
            index, bounds = vu.get_vision_window_index(grids, m, vision.window_size, vision.patch_size)
            unit = m * m
            positions = geometry["patch_positions"]
            geometry["patch_positions"] = positions.reshape(-1, unit, 2)[index].reshape(-1, 2)
            geometry.update(window_index=index, window_bounds=bounds)
        if self.family == "qwen3_vl":
            visual = self.model.hf.model.visual
            indices, weights = vu.get_vision_interpolation_indices_and_weights(
                grids, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=m)
            geometry.update(interp_indices=indices, interp_weights=weights.to(torch.float32))
        return geometry

    def pad(self, pack: PackInputs, geometry: dict, shape: StepShape) -> dict[str, torch.Tensor]:
        """One pack padded to the step's shape, every tensor with a leading 1."""
        length = int(pack.input_ids.numel())
        extra = shape.tokens - length
        bounds = torch.cat([pack.bounds, torch.full((shape.samples + 2 - pack.bounds.numel(),), shape.tokens)])
        places = torch.full((shape.vision_tokens,), -1, dtype=torch.long)
        places[:pack.vision_positions.numel()] = pack.vision_positions
        out = {"input_ids": F.pad(pack.input_ids, (0, extra)), "labels": F.pad(pack.labels, (0, extra), value=-100),
               "positions": F.pad(pack.positions, (0, extra)), "bounds": bounds.to(torch.int32),
               "vision_positions": places}
        missing = shape.tiles - int(pack.pixels.shape[0])
        pixels = pack.pixels.to(torch.float32)
        out["pixels"] = torch.cat([pixels, pixels.new_zeros(missing, *pixels.shape[1:])])
        for name, tensor in geometry.items():
            if name.endswith("_bounds"):
                size = shape.vision_segments if name == "vision_bounds" else shape.window_segments
                tensor = torch.cat([tensor, tensor[-1:].expand(size - tensor.numel())]).to(torch.int32)
            out[name] = tensor
        return {name: tensor.unsqueeze(0) for name, tensor in out.items()}


def padded_batch(pack: PackInputs) -> PackInputs:
    """The pack's samples as a padded batch in one row: each sample padded to the longest (labels -100, a segment
    of its own), as HF's usual collation computes them; the same loss and gradients as the pack, more tokens."""
    bounds = pack.bounds.tolist()
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    longest = max(lengths + [1])
    where = torch.cat([torch.arange(n) + k * longest for k, n in enumerate(lengths)]) if lengths else \
        torch.zeros(0, dtype=torch.long)  # new place of every token
    size = longest * len(lengths)
    ids = torch.zeros(size, dtype=pack.input_ids.dtype)
    ids[where] = pack.input_ids
    labels = torch.full((size,), -100, dtype=pack.labels.dtype)
    labels[where] = pack.labels
    positions = torch.zeros(pack.positions.shape[0], size, dtype=pack.positions.dtype)
    positions[:, where] = pack.positions
    ends = sorted({0, *(k * longest + n for k, n in enumerate(lengths)), *(k * longest for k in range(1, len(lengths) + 1))})
    return PackInputs(ids, labels, positions, torch.tensor(ends, dtype=torch.long), pack.pixels, pack.grids,
                      where[pack.vision_positions])
