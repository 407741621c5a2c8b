"""Every vision tower called by every pack (`to_hf_inputs(..., ensure_encoders=True)`): under FSDP or ZeRO-3
with a tower wrapped as units of its own, calling it is a set of collectives over the DP group, so a rank whose
pack would skip it (no image; a Qwen pack without a video) leaves the others waiting. A dummy item per missing
tower, as a segment of its own at the end of the packed row, keeps every rank's collectives in step."""

from __future__ import annotations

from typing import Any

import torch

from packfeed.client.stream.tensors import IGNORE_INDEX


def with_every_encoder(inputs: dict[str, Any], bounds: torch.Tensor, family: Any, conventions: Any,
                       dtype: torch.dtype) -> tuple[dict[str, Any], torch.Tensor]:
    """`inputs` of one packed row with one dummy item for each vision tower it would not call (images; Qwen's
    videos when the dataset has a video placeholder): a segment of its own appended to the row, its placeholders
    labelled IGNORE_INDEX. Earlier tokens never attend to it (causal attention, or its own varlen segment), and
    no loss token reads it, so the loss is unchanged and the tower's gradients from it are zero; only the
    tower's collectives run. Returns the inputs and the row's segment bounds. `family`: a
    `packfeed.client.model.hf_families.Family` (its image policy, and Qwen's patch, merge and temporal patch sizes)."""
    if conventions is None:
        raise ValueError("ensure_encoders needs the job's conventions (its placeholder ids, tile size and tokens per "
                         "tile): pass conventions=stream.conventions")
    dummies = []  # (pixels name, grid name or None, placeholder id, placeholders, pixel rows, token type)
    if family.image_policy == "qwen2vl":
        m, p, t = family.merge_size, family.patch_size, family.temporal_patch_size
        rows = torch.zeros(m * m, 3 * t * p * p, dtype=dtype)
        dummies.append(("pixel_values", "image_grid_thw", conventions.image_context_id, 1, rows, 1))
        if conventions.HasField("video_context_id"):
            dummies.append(("pixel_values_videos", "video_grid_thw", conventions.video_context_id, 1, rows, 2))
    else:
        policy = conventions.image_policy
        if not policy.tile_size or not policy.tokens_per_tile:
            raise ValueError(f"ensure_encoders: the dataset's image policy {policy.name!r} gives no tile size and "
                             f"tokens per tile for the {family.name} family's dummy tile")
        tile = torch.zeros(1, 3, policy.tile_size, policy.tile_size, dtype=dtype)
        dummies.append(("pixel_values", None, conventions.image_context_id, policy.tokens_per_tile, tile, 1))
    out = dict(inputs)
    for pixels_name, grid_name, token_id, count, pixels, token_type in dummies:
        if pixels_name in out:
            continue
        out[pixels_name] = pixels
        if grid_name is not None:
            out[grid_name] = torch.tensor([[1, family.merge_size, family.merge_size]], dtype=torch.long)
        length = out["input_ids"].shape[1]
        out["input_ids"] = torch.cat([out["input_ids"], torch.full((1, count), token_id, dtype=torch.long)], dim=1)
        out["labels"] = torch.cat([out["labels"], torch.full((1, count), IGNORE_INDEX, dtype=torch.long)], dim=1)
        positions = out["position_ids"]
        if positions.dim() == 3:  # Qwen: (text, t, h, w) rows; the dummy item sits at (0, 0, 0) of its segment
            out["position_ids"] = torch.cat([positions, torch.zeros(positions.shape[0], 1, count,
                                                                    dtype=positions.dtype)], dim=2)
            types = out.get("mm_token_type_ids", torch.zeros(1, length, dtype=torch.int32))
            out["mm_token_type_ids"] = torch.cat([types, torch.full((1, count), token_type, dtype=types.dtype)], dim=1)
        else:
            out["position_ids"] = torch.cat([positions, torch.arange(count, dtype=positions.dtype).unsqueeze(0)],
                                            dim=1)
        bounds = torch.cat([bounds, bounds[-1:] + count])
    return out, bounds
