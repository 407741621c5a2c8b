"""Image policies: how an image of a given size becomes ViT work and LLM placeholder tokens.

Each policy answers, from width and height alone (read from the image header), what the server will
produce when it pre-processes the image, so the index can cost a sample without decoding it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from PIL import Image

from packfeed.media.pixels import Geometry


class TooManyPixels(ValueError):
    """An image over its policy's `max_image_pixels`."""


@dataclass(frozen=True)
class ImageCost:
    units: int  # what the vision cap counts
    llm_tokens: int  # placeholder tokens in the LLM sequence
    vit_sequences: tuple[int, ...]  # ViT sequence length of each independent ViT pass (tiles or whole images)

    @property
    def vit_patches(self) -> int:
        return sum(self.vit_sequences)

    @property
    def vit_attn_sq(self) -> int:
        return sum(s * s for s in self.vit_sequences)


class ImagePolicy(Protocol):
    name: str
    patch_size: int

    @property
    def tile_size(self) -> int:
        """Side of every square tile in px; 0 when images keep sizes of their own."""

    @property
    def patches_per_unit(self) -> int:
        """ViT patches per vision unit (the unit vision caps count)."""

    def cost(self, width: int, height: int, n_images: int) -> ImageCost: ...

    def geometry(self, width: int, height: int, n_images: int) -> Geometry:
        """How the server (or, for encoded images, the client) cuts an image of this upright size into tiles."""

    @property
    def temporal_patch(self) -> int:
        """Frames one ViT patch spans in time (1: frames as images)."""

    @property
    def frame_multiple(self) -> int:
        """A video's sampled frame count is rounded down to a multiple of this (1: any count)."""

    def frame_geometry(self, width: int, height: int) -> Geometry:
        """How every frame of a video of this size becomes exactly one tile."""

    def video_cost(self, width: int, height: int, frames: int) -> ImageCost:
        """The cost of `frames` frames of a video of this size; llm_tokens are the frames' placeholders alone."""

    def to_dict(self) -> dict[str, Any]: ...


# Images of more pixels than this are invalid at index time (`max_image_pixels`, `--max-image-pixels`): decoding
# one costs the server about 10 bytes a pixel for a moment (`packfeed.media.pixel_modes.PIXEL_PATHS`),
# so 50 MP (an 8,660 x 5,770 photograph) is ~500 MB; a 200 KB PNG can declare 89 MP and still pass Pillow's check.
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000

def lift_pillow_limit(pixels: int) -> None:
    """Pillow refuses an image over its own limit (a warning over 89 MP, an error over twice that) before a
    policy can judge it, so `--max-image-pixels` above it would be silently ignored. The policy's limit is the
    one that holds (checked from the header, before any decoding): Pillow's is raised to it, never lowered (a
    process may hold several policies)."""
    if Image.MAX_IMAGE_PIXELS is not None and pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = pixels


# Normalisation constants the model families publish (the same values as transformers.image_utils).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF_MEAN, HALF_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


class _Recorded:
    """A policy records itself in the index as the dict of its fields (`policy_from_dict` reads it back).

    Every policy also names the normalisation its model expects of pixel values, `(x / 255 - mean) / std` per
    channel: the server sends uint8 pixels and the trainer side applies it (`JobInfo.conventions`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _check(self, choices: dict[str, tuple[str, ...]]) -> None:
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3 or (name == "image_std" and min(value) <= 0):
                raise ValueError(f"{name} must be three numbers (R, G, B){', each > 0' if name == 'image_std' else ''}")
            object.__setattr__(self, name, value)  # a JSON list read back from the index becomes a tuple again
        if isinstance(self.max_image_pixels, bool) or not isinstance(self.max_image_pixels, int) \
                or self.max_image_pixels < 1:
            raise ValueError(f"{self.name} policy: max_image_pixels must be a whole number >= 1, not "
                             f"{self.max_image_pixels!r}")
        lift_pillow_limit(self.max_image_pixels)
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{self.name} policy: {name} must be one of {', '.join(allowed)}, not "
                                 f"{getattr(self, name)!r}")


    def check_pixels(self, width: int, height: int, what: str = "image") -> None:
        """Refuse an image (or a video's frames) of more pixels than `max_image_pixels`, before anything decodes it."""
        if width * height > self.max_image_pixels:
            raise TooManyPixels(f"{what} of {width}x{height} has {width * height:,} pixels, over max_image_pixels "
                             f"{self.max_image_pixels:,} (decoding it would take ~{width * height * 10 >> 20:,} MiB); "
                             "raise the limit with --max-image-pixels if the server's memory budget allows it")


class _SquareTiles(_Recorded):
    """A policy whose images become square tiles of `tile_size` px, each one ViT sequence (one vision unit).
    A video's frames are images of one square tile each (InternVL's `load_video`: one tile per frame)."""

    temporal_patch = 1
    frame_multiple = 1

    @property
    def patches_per_unit(self) -> int:
        return (self.tile_size // self.patch_size) ** 2

    def frame_geometry(self, width: int, height: int) -> Geometry:
        size = self.tile_size
        return Geometry(width, height, size, size, 0, 0, size, size, 0, 0)

    def video_cost(self, width: int, height: int, frames: int) -> ImageCost:
        return ImageCost(frames, frames * self.tokens_per_tile, (self.patches_per_unit,) * frames)


@functools.lru_cache(maxsize=64)
def _grids(min_num: int, max_num: int) -> tuple[tuple[int, int], ...]:
    """Every (columns, rows) grid of min_num..max_num tiles, fewest tiles first (InternVL's `target_ratios`).
    Cached: a policy asks for the same few lists for every image."""
    return tuple(sorted({(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
                         for j in range(1, n + 1) if min_num <= i * j <= max_num}, key=lambda r: r[0] * r[1]))


@dataclass(frozen=True)
class InternVLTiling(_SquareTiles):
    """InternVL dynamic high resolution: the image is resized to a grid of `image_size` tiles whose aspect
    ratio is closest to the image's (at most `max_num` tiles), plus a thumbnail tile when the grid has
    more than one tile. With several images in a sample, `multi_image` says how the tile budget is shared:
    "split" gives each max(1, max_num // n_images) tiles (InternVL's own training code), "each" gives every
    image the whole budget (the Hugging Face processor).
    """

    image_size: int = 448
    min_num: int = 1
    max_num: int = 12
    use_thumbnail: bool = True
    tokens_per_tile: int = 256  # 1024 patches, pixel-shuffled 2x2 -> 256
    patch_size: int = 14
    multi_image: str = "split"
    image_mean: tuple[float, ...] = IMAGENET_MEAN
    image_std: tuple[float, ...] = IMAGENET_STD
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    name: str = "internvl"

    def __post_init__(self):
        self._check({"multi_image": ("split", "each")})

    def grid(self, width: int, height: int, n_images: int = 1) -> tuple[int, int]:
        """(columns, rows) of tiles, exactly as InternVL's `dynamic_preprocess` chooses them."""
        split = n_images > 1 and self.multi_image == "split"
        max_num = max(1, self.max_num // n_images) if split else self.max_num
        min_num = min(self.min_num, max_num)
        ratios = _grids(min_num, max_num)
        aspect = width / height
        area = width * height
        best, best_diff = (1, 1), float("inf")
        for ratio in ratios:
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best_diff, best = diff, ratio
            elif diff == best_diff and area > 0.5 * self.image_size * self.image_size * ratio[0] * ratio[1]:
                best = ratio
        return best

    @property
    def tile_size(self) -> int:
        return self.image_size

    def cost(self, width: int, height: int, n_images: int = 1) -> ImageCost:
        cols, rows = self.grid(width, height, n_images)
        tiles = cols * rows + (1 if self.use_thumbnail and cols * rows != 1 else 0)
        return ImageCost(tiles, tiles * self.tokens_per_tile, (self.patches_per_unit,) * tiles)

    def geometry(self, width: int, height: int, n_images: int = 1) -> Geometry:
        cols, rows = self.grid(width, height, n_images)
        size = self.image_size
        thumbnail = size if self.use_thumbnail and cols * rows != 1 else 0
        return Geometry(width, height, cols * size, rows * size, 0, 0, cols * size, rows * size, size, thumbnail)


@dataclass(frozen=True)
class Qwen2VLResize(_Recorded):
    """Qwen2-VL `smart_resize`: both sides rounded to multiples of `factor` (28 = 14 px patch x 2 merge),
    total pixels kept within [min_pixels, max_pixels]; LLM tokens = h * w / factor². Vision units are the
    merged tokens too, since ViT work grows with them, and the whole image is one ViT sequence. Qwen2.5-VL
    is the same; Qwen3-VL uses 16 px patches (factor 32) and mean = std = 0.5.
    """

    factor: int = 28
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    # Video frames: smart_resize within these bounds (the Qwen2-VL video processor's), and `temporal_patch_size`
    # frames per ViT patch in time, so a video of n frames gives n / temporal_patch_size grids of merged tokens.
    # pad_frames: any frame count, the last patch filled up with the last frame (Qwen3-VL); otherwise counts are
    # rounded down to whole patches (Qwen2-VL, Qwen2.5-VL).
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    temporal_patch_size: int = 2
    pad_frames: bool = False
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    name: str = "qwen2vl"
    tile_size = 0  # no tiles: every image keeps its own (resized) shape
    tokens_per_tile = 0

    def __post_init__(self):
        if self.factor % self.patch_size:
            raise ValueError(f"qwen2vl policy: factor {self.factor} must be a multiple of patch_size {self.patch_size}")
        if not 1 <= self.temporal_patch_size <= 16:
            raise ValueError(f"qwen2vl policy: temporal_patch_size must be 1-16, not {self.temporal_patch_size}")
        self._check({})

    @property
    def patches_per_unit(self) -> int:
        return (self.factor // self.patch_size) ** 2  # one unit = one merged token

    @property
    def temporal_patch(self) -> int:
        return self.temporal_patch_size

    @property
    def frame_multiple(self) -> int:
        return 1 if self.pad_frames else self.temporal_patch_size

    def resize(self, width: int, height: int, video: bool = False) -> tuple[int, int]:
        """(height, width) after smart_resize, exactly as the Qwen2-VL image (or `video`) processor computes it."""
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"aspect ratio of {width}x{height} exceeds 200, which Qwen2-VL rejects")
        least, most = (self.video_min_pixels, self.video_max_pixels) if video else (self.min_pixels, self.max_pixels)
        f = self.factor
        h = round(height / f) * f
        w = round(width / f) * f
        if h * w > most:
            beta = math.sqrt(height * width / most)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < least:
            beta = math.sqrt(least / (height * width))
            h = math.ceil(height * beta / f) * f
            w = math.ceil(width * beta / f) * f
        return h, w

    def cost(self, width: int, height: int, n_images: int = 1) -> ImageCost:
        h, w = self.resize(width, height)
        tokens = h * w // (self.factor * self.factor)
        return ImageCost(tokens, tokens, (h * w // (self.patch_size * self.patch_size),))

    def geometry(self, width: int, height: int, n_images: int = 1) -> Geometry:
        h, w = self.resize(width, height)
        return Geometry(width, height, w, h, 0, 0, w, h, 0, 0)

    def frame_geometry(self, width: int, height: int) -> Geometry:
        h, w = self.resize(width, height, video=True)
        return Geometry(width, height, w, h, 0, 0, w, h, 0, 0)

    def video_cost(self, width: int, height: int, frames: int) -> ImageCost:
        """One ViT sequence per temporal patch (the vision tower attends within each), its merged tokens each."""
        h, w = self.resize(width, height, video=True)
        grids = -(-frames // self.temporal_patch_size)
        tokens = grids * h * w // (self.factor * self.factor)
        return ImageCost(tokens, tokens, (h * w // (self.patch_size * self.patch_size),) * grids)


@dataclass(frozen=True)
class FixedResolution(_SquareTiles):
    """Every image made one square of `size` px (LLaVA-1.5: 336 px, 24 x 24 = 576 tokens). `resize`: "squash"
    resizes to the square whatever the aspect ratio; "crop" resizes the short side to `size` and crops the
    centre (the CLIP / LLaVA processor)."""

    size: int = 336
    tokens: int = 576
    patch_size: int = 14
    resize: str = "squash"
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    name: str = "fixed"

    def __post_init__(self):
        self._check({"resize": ("squash", "crop")})

    def crop_resize(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) before the centre crop: the short side at `size`, as transformers computes it."""
        short, long = min(width, height), max(width, height)
        new_long = int(self.size * long / short)
        return (self.size, new_long) if width <= height else (new_long, self.size)

    @property
    def tile_size(self) -> int:
        return self.size

    @property
    def tokens_per_tile(self) -> int:
        return self.tokens

    def cost(self, width: int, height: int, n_images: int = 1) -> ImageCost:
        return ImageCost(1, self.tokens, (self.patches_per_unit,))

    def geometry(self, width: int, height: int, n_images: int = 1) -> Geometry:
        size = self.size
        if self.resize == "squash":
            return Geometry(width, height, size, size, 0, 0, size, size, 0, 0)
        resize_width, resize_height = self.crop_resize(width, height)
        left, top = (resize_width - size) // 2, (resize_height - size) // 2
        return Geometry(width, height, resize_width, resize_height, left, top, size, size, 0, 0)


# How the indexer checks image data: decode every image (JPEG at 1/8 scale) or trust the header.
VERIFY_MODES = ("decode", "header")

POLICIES = {"internvl": InternVLTiling, "qwen2vl": Qwen2VLResize, "fixed": FixedResolution}


DEFAULT_POLICY = "internvl"  # an index that records no policy (imported length files) counts InternVL tiles
# ... of 448 px with 14 px patches: 32 x 32 = 1024 ViT tokens per tile.
DEFAULT_PATCHES_PER_UNIT = 1024


def policy_from_dict(raw: dict[str, Any] | None) -> ImagePolicy:
    """The policy an index records (`IndexInfo.image_policy`); None or no name means InternVL's defaults."""
    raw = dict(raw or {})
    name = raw.pop("name", DEFAULT_POLICY)
    if name not in POLICIES:
        raise ValueError(f"unknown image policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**raw)
