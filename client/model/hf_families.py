"""Each model family's view of the pixels and positions of a pack (`hf.to_hf_inputs` assembles the inputs): the
families (`FAMILIES`: which image policy, normalisation and patch geometry each reads), pixel normalisation as the
processors compute it, Qwen-VL's flattened patches of images and videos, and M-RoPE positions as the models'
`get_rope_index` gives them. The context-parallel client (`context_parallel`) uses the same pieces per share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from packfeed.client.stream.tensors import PackTensors
from packfeed.v1.options import VisualKind

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


@dataclass(frozen=True)
class Family:
    name: str
    image_policy: str  # the packfeed image policy whose pixels this model reads
    normalisation: tuple[tuple[float, ...], tuple[float, ...]]  # published (mean, std)
    patch_size: int = 14  # qwen: ViT patch side
    merge_size: int = 2  # qwen: patches merged per side into one LLM token
    temporal_patch_size: int = 2  # qwen: an image is repeated over this many frames
    tokens_per_second: float = 0.0  # qwen2.5: M-RoPE time positions per second of video; 0: one per temporal patch


FAMILIES: dict[str, Family] = {
    "internvl": Family("internvl", "internvl", IMAGENET),
    "qwen2_vl": Family("qwen2_vl", "qwen2vl", CLIP),
    "qwen2_5_vl": Family("qwen2_5_vl", "qwen2vl", CLIP, tokens_per_second=2.0),  # the released checkpoints' config
    # Qwen3-VL: each temporal patch of a video is an item of its own, after its timestamp (the qwen3_vl preset)
    "qwen3_vl": Family("qwen3_vl", "qwen2vl", HALF, patch_size=16),
    "llava": Family("llava", "fixed", CLIP),
}


def family_of(model_family: str | Family) -> Family:
    if isinstance(model_family, Family):
        return model_family
    if model_family not in FAMILIES:
        raise ValueError(f"unknown model family {model_family!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[model_family]


def normalised(tiles: list[torch.Tensor], mean: tuple[float, ...], std: tuple[float, ...],
               dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """uint8 (3, H, W) tiles -> `(x / 255 - mean) / std` per channel, as the HF image processors compute it."""
    device = tiles[0].device if tiles else None
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(3, 1, 1)
    return [((tile.to(torch.float32) * (1 / 255) - mean_t) / std_t).to(dtype) for tile in tiles]


def qwen_patches(image: torch.Tensor, family: Family) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One normalised (3, H, W) image in Qwen-VL's flattened patch layout, (patches, C * T * P * P), in 2 x 2
    merge-window order with the image repeated over T frames; and its (t, h, w) grid in patches."""
    p, m, t = family.patch_size, family.merge_size, family.temporal_patch_size
    channels, height, width = image.shape
    grid = qwen_grid(1, height, width, family)
    grid_h, grid_w = grid[1:]
    patches = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], t, p, p)
    return patches.reshape(grid_h * grid_w, channels * t * p * p), grid


def qwen_grid(frames: int, height: int, width: int, family: Family) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of an item of `frames` (H, W) frames (an image: 1): t temporal patches (frames
    padded to a multiple of T, an image's one frame repeated), h x w spatial ones."""
    p, m, t = family.patch_size, family.merge_size, family.temporal_patch_size
    grid_h, grid_w = height // p, width // p
    if grid_h * p != height or grid_w * p != width or grid_h % m or grid_w % m:
        raise ValueError(f"{'video frames' if frames > 1 else 'image'} of {width}x{height} px do not fall into "
                         f"{p * m} px merge windows; index the dataset with the {family.name} preset (image policy "
                         f"qwen2vl, factor {p * m})")
    return max(1, -(-frames // t)), grid_h, grid_w


def qwen_video_patches(frames: list[torch.Tensor], family: Family) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A video's normalised (3, H, W) frames in Qwen-VL's flattened patch layout, (patches, C * T * P * P), each
    patch spanning T consecutive frames (the last frame repeated to a multiple of T), as the Hugging Face video
    processor's `patchify`; and its (t, h, w) grid."""
    p, m, t = family.patch_size, family.merge_size, family.temporal_patch_size
    video = torch.stack(frames)
    if video.shape[0] % t:
        video = torch.cat([video, video[-1:].expand(t - video.shape[0] % t, -1, -1, -1)])
    count, channels, height, width = video.shape
    grid = qwen_grid(count, height, width, family)
    grid_t, grid_h, grid_w = grid
    patches = video.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * t * p * p), grid


def mrope_positions(pack: PackTensors, grids: list[tuple[int, int, int]], merge_size: int,
                    intervals: list[float] | None = None) -> torch.Tensor:
    """(3, L) M-RoPE positions, per sample as the model's `get_rope_index`: text tokens count up; an image's
    tokens take (start, start + row, start + column), a video's (start + frame time, start + row, start +
    column) with frame time = (temporal patch number x `intervals[k]`) rounded down; text after either resumes
    at start + max(rows, columns)."""
    spans = pack.image_token_spans.tolist() if len(grids) else []
    return mrope_rows(pack.cu_seqlens.tolist(), spans, grids, merge_size, intervals, str(pack.sample_keys))


def mrope_rows(bounds: list[int], spans: list[list[int]], grids: list[tuple[int, int, int]], merge_size: int,
               intervals: list[float] | None = None, where: str = "the pack") -> torch.Tensor:
    """`mrope_positions` of the samples ending at `bounds` whose items' placeholder runs are `spans` (start,
    length) with patch `grids`."""
    positions = torch.empty(3, bounds[-1], dtype=torch.long)
    image_no = 0
    for sample in range(len(bounds) - 1):
        cursor, current = bounds[sample], 0
        end = bounds[sample + 1]
        while image_no < len(spans) and spans[image_no][0] < end:
            start, count = spans[image_no]
            text = start - cursor
            positions[:, cursor:start] = torch.arange(current, current + text)
            current += text
            grid_t, grid_h, grid_w = grids[image_no]
            rows, cols = grid_h // merge_size, grid_w // merge_size
            if grid_t * rows * cols != count:
                raise ValueError(f"image {image_no} of {where}: {count} placeholder tokens for a "
                                 f"{grid_t} x {rows} x {cols} grid of merged patches")
            interval = intervals[image_no] if intervals else 1
            times = (torch.arange(grid_t) * interval).long() + current
            positions[0, start:start + count] = times.repeat_interleave(rows * cols)
            positions[1, start:start + count] = (torch.arange(rows) + current).repeat_interleave(cols).repeat(grid_t)
            positions[2, start:start + count] = (torch.arange(cols) + current).repeat(rows * grid_t)
            current += max(rows, cols)
            cursor = start + count
            image_no += 1
        positions[:, cursor:end] = torch.arange(current, current + end - cursor)
    return positions


def normalisation_of(family: Family, conventions: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The pixel mean and std the family's model reads (the dataset's, when its conventions give them); refuses
    a dataset indexed for another image policy or patch size."""
    mean, std = family.normalisation
    if conventions is None:
        return mean, std
    policy = conventions.image_policy
    if policy.name and policy.name != family.image_policy:
        raise ValueError(f"the dataset was indexed with image policy {policy.name!r}; the {family.name} family "
                         f"reads {family.image_policy!r} pixels: index it with the matching --preset")
    if family.image_policy == "qwen2vl" and policy.patch_size and policy.patch_size != family.patch_size:
        raise ValueError(f"the dataset's patches are {policy.patch_size} px, {family.name} uses "
                         f"{family.patch_size} px: index it with the {family.name} preset")
    if len(policy.image_mean) == 3:
        return tuple(policy.image_mean), tuple(policy.image_std)
    return mean, std


def qwen_item_patches(pack: PackTensors, features: list[torch.Tensor], kinds: list[int],
                      family: Family) -> list[tuple[torch.Tensor, tuple[int, int, int]] | None]:
    """Per visual item of the pack, its Qwen patches and grid from its normalised tiles (`features`, in tile
    order); None for an item whose tiles the pack does not hold (a context-parallel share's other GPUs')."""
    items = tiles_per_item(pack, features)
    return [None if not frames else qwen_video_patches(frames, family) if kind == VisualKind.VIDEO
            else qwen_patches(frames[0], family) for frames, kind in zip(items, kinds)]


def visual_kinds(pack: PackTensors) -> list[int]:
    """Each visual item's kind (servers before videos send no `visual_kind`: every item is an image)."""
    if "visual_kind" in pack.tensors:
        return pack.visual_kind.tolist()
    return [VisualKind.IMAGE] * int(pack.image_token_spans.shape[0])


def tiles_per_item(pack: PackTensors, tiles: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    items: list[list[torch.Tensor]] = [[] for _ in range(int(pack.image_token_spans.shape[0]))]
    for tile, item in zip(tiles, pack.tile_image.tolist()):
        items[item].append(tile)
    return items


def time_intervals(pack: PackTensors, kinds: list[int], family: Family,
                    tokens_per_second: float | None) -> list[float]:
    """Per item, M-RoPE time positions per temporal patch: Qwen2.5-VL's tokens_per_second x seconds a temporal
    patch spans (`second_per_grid_ts`); 1 for images and for Qwen2-VL."""
    rate = family.tokens_per_second if tokens_per_second is None else tokens_per_second
    if not rate or "frame_seconds" not in pack.tensors:
        return [1.0] * len(kinds)
    seconds = pack.frame_seconds.tolist()
    return [rate * family.temporal_patch_size * seconds[k] if kind == VisualKind.VIDEO else 1.0
            for k, kind in enumerate(kinds)]
