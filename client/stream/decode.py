"""Decoding the packs of a `pixels: encoded` job on the trainer side.

The server sends each image as its file's bytes with the `Geometry` its image policy chose
(`packfeed.media.pixels`); here they become the tiles the server would have sent, in `pack.pixels`, so the
trainer sees the same `PackTensors` in every mode. Two backends:

- `pil`: Pillow's decoding and bicubic on a pool of CPU threads (both release the GIL), the resize computed
  by the exact path's kernels (`packfeed.media.resample`, under half of Pillow's CPU, where numba is installed).
  Pixel for pixel the server's exact path.
- `torchvision`: JPEG files decoded by `torchvision.io.decode_jpeg` on `device` (nvJPEG on a GPU, batched per
  step) and resized there by bicubic interpolation with antialiasing; other formats go through Pillow.
  Within the fast path's bounds of exact (mean absolute error < 1/255, PSNR > 40 dB); `pack.pixels` is then
  on that device.

An image that does not decode (or is not the size the index recorded) takes its sample out of the pack,
like a sample the server skips: the pack is rebuilt without it, the sample is listed in `pack.skipped`, and
the stream reports it to the server with the step's acknowledgement. `step_loss_tokens` stays the planned
count, as for server-side skips, so every rank still divides by the same number.
"""

from __future__ import annotations

import functools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors, tensor_of
from packfeed.media.pixels import GEOMETRY_COLUMNS, Geometry, ImageSizeMismatch, decode_tiles, pil_resizer

BACKENDS = ("auto", "pil", "torchvision")
_JPEG_MAGIC = b"\xff\xd8\xff"


class MalformedPack(ValueError):
    """The encoded images of a pack contradict its own tensors (a server bug, not a bad image)."""


@dataclass(frozen=True)
class DecodeOptions:
    """How a client decodes encoded images. `backend` "auto" is torchvision on CUDA when a GPU and torchvision
    are there, else Pillow on `threads` CPU threads (0: one per core, at most 8)."""

    backend: Literal["auto", "pil", "torchvision"] = "auto"
    device: str = "cuda"  # where the torchvision backend decodes and resizes
    threads: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"decode backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.threads < 0:
            raise ValueError("decode threads must be >= 0")

    def resolved(self) -> DecodeOptions:
        """The backend "auto" stands for on this machine."""
        if self.backend != "auto":
            return self
        try:
            import torchvision  # noqa: F401
            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        return DecodeOptions("torchvision" if gpu else "pil", self.device, self.threads)


class PackDecoder:
    """Fills `pixels` of encoded packs, in place; one per stream (it owns a thread pool)."""

    def __init__(self, options: DecodeOptions | None = None, pin_memory: bool = False):
        self.options = (options or DecodeOptions()).resolved()
        self.pin_memory = pin_memory
        threads = self.options.threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="packfeed-decode")
        if self.options.backend == "torchvision":
            from torchvision.io import ImageReadMode, decode_jpeg  # noqa: F401  (fail here, not per image)

            # torchvision 0.29 warns on every call that TorchCodec will take its image decoders over
            warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                    category=DeprecationWarning)

    def decode(self, packs: list[PackTensors]) -> list[tuple[str, str]]:
        """Decode the images of a step's packs into each one's `pixels`, all of them at once (one pool map, one
        batched nvJPEG call); returns the (key, reason) of samples taken out."""
        packs = [pack for pack in packs if "encoded" in pack.tensors]
        files, geometry, bounds = [], [], [0]
        for pack in packs:
            pack_files, pack_geometry = _files_and_geometry(pack)
            files += pack_files
            geometry += pack_geometry
            bounds.append(len(files))
        results = (self._torchvision(files, geometry) if self.options.backend == "torchvision"
                   else list(self._pool.map(_pil_tiles, files, geometry)))
        return [skip for pack, start, end in zip(packs, bounds, bounds[1:])
                for skip in self._fill(pack, results[start:end], geometry[start:end])]

    def _fill(self, pack: PackTensors, results: list, geometry: list[Geometry]) -> list[tuple[str, str]]:
        failed: dict[int, str] = {}
        image_sample = pack.image_sample.tolist()
        for image, result in enumerate(results):
            if isinstance(result, str):
                sample = image_sample[image]
                failed.setdefault(sample, f"undecodable image on the client ({pack.sample_keys[sample]}, image "
                                          f"{image - image_sample.index(sample)}): {result}")
        pack.tensors["pixels"] = self._join([  # a failed image's tiles hold zeros until its sample is dropped below
            tiles if isinstance(tiles, list) else [torch.zeros(shape, dtype=torch.uint8) for shape in g.tile_shapes()]
            for tiles, g in zip(results, geometry)])
        for name in ("encoded", "encoded_sizes", "image_geometry"):
            del pack.tensors[name]
        return drop_samples(pack, failed) if failed else []

    def _join(self, tiles_per_image: list[list[torch.Tensor]]) -> torch.Tensor:
        flat = [tile.reshape(-1) for tiles in tiles_per_image for tile in tiles]
        if not flat:
            return torch.zeros(0, dtype=torch.uint8)
        if flat[0].device.type != "cpu":
            return torch.cat(flat)
        out = torch.empty(sum(t.numel() for t in flat), dtype=torch.uint8, pin_memory=self.pin_memory)
        torch.cat(flat, out=out)
        return out

    def _torchvision(self, files: list[np.ndarray], geometry: list[Geometry]) -> list[list[torch.Tensor] | str]:
        """JPEGs decoded together on the device (one batched nvJPEG call on a GPU), the rest by Pillow."""
        from torchvision.io import ImageReadMode, decode_jpeg

        results: list = [None] * len(files)
        jpegs = [i for i, data in enumerate(files) if bytes(data[:3]) == _JPEG_MAGIC]
        others = sorted(set(range(len(files))) - set(jpegs))
        device = torch.device(self.options.device)
        for i, tiles in zip(others, self._pool.map(_pil_tiles, [files[i] for i in others], [geometry[i] for i in others])):
            results[i] = tiles if isinstance(tiles, str) else [t.to(device) for t in tiles]
        inputs = [tensor_of(files[i]) for i in jpegs]
        try:
            decoded = decode_jpeg(inputs, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True) \
                if inputs else []
        except RuntimeError:  # one bad file fails the batch: decode one by one to find it
            decoded = [_one_jpeg(data, device) for data in inputs]
        for i, image in zip(jpegs, decoded):
            results[i] = image if isinstance(image, str) else torch_tiles(image, geometry[i])
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _files_and_geometry(pack: PackTensors) -> tuple[list[np.ndarray], list[Geometry]]:
    """Each image's file bytes and geometry, checked against the pack's own tile list."""
    data = pack.encoded.numpy()
    sizes = pack.encoded_sizes.tolist()
    rows = pack.image_geometry.reshape(-1, GEOMETRY_COLUMNS).tolist()
    if len(sizes) != len(rows) or len(rows) != len(pack.image_sample) or sum(sizes) != len(data) or min(sizes, default=1) < 1:
        raise MalformedPack(f"pack {pack.epoch}:{pack.step}:{pack.microbatch}: encoded images and their sizes, "
                            f"geometry and samples do not agree")
    geometry = [Geometry.of_row(row) for row in rows]
    for g in geometry:
        g.check()
    shapes = [shape for g in geometry for shape in g.tile_shapes()]
    if shapes != [tuple(s) for s in pack.tile_shapes.tolist()]:
        raise MalformedPack(f"pack {pack.epoch}:{pack.step}:{pack.microbatch}: the images' geometry makes other "
                            f"tiles than tile_shapes lists")
    offsets = np.cumsum([0] + sizes)
    return [data[offsets[i]:offsets[i + 1]] for i in range(len(sizes))], geometry


@functools.cache
def _exact_resizer():
    """The server's exact kernels (packfeed.media.resample) where numba is installed, else Pillow itself: the same
    pixels, at about twice the CPU. Imported on first use: a trainer that never decodes does not load numba."""
    try:
        from packfeed.media.resample import exact_resizer
    except ImportError:
        return pil_resizer
    return exact_resizer


def _pil_tiles(data: np.ndarray, geometry: Geometry) -> list[torch.Tensor] | str:
    try:
        return [torch.from_numpy(tile) for tile in decode_tiles(data.tobytes(), geometry, _exact_resizer())]
    except ImageSizeMismatch as error:
        return str(error)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        return f"{type(error).__name__}: {error}"


def _one_jpeg(data: torch.Tensor, device: torch.device) -> torch.Tensor | str:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True)
    except RuntimeError as error:  # "decode_jpeg, .../decode_jpeg.cpp:171, Image is incomplete or truncated"
        return str(error).splitlines()[0].rsplit(", ", 1)[-1]


def torch_tiles(image: torch.Tensor, g: Geometry) -> list[torch.Tensor] | str:
    """The tiles of one decoded (3, H, W) uint8 image by its geometry, resized where it lies."""
    if tuple(image.shape[1:]) != (g.height, g.width):
        return str(ImageSizeMismatch((image.shape[2], image.shape[1]), (g.width, g.height)))

    def resize(size: tuple[int, int]) -> torch.Tensor:
        if size == (g.width, g.height):
            return image
        scaled = torch.nn.functional.interpolate(image[None].float(), size=(size[1], size[0]), mode="bicubic",
                                                 antialias=True, align_corners=False)
        return scaled[0].round_().clamp_(0, 255).to(torch.uint8)

    resized = resize((g.resize_width, g.resize_height))
    tiles = [resized[:, top:top + height, left:left + width] for top, left, height, width in g.boxes()]
    if g.thumbnail:
        tiles.append(resize((g.thumbnail, g.thumbnail)))
    return tiles


def drop_samples(pack: PackTensors, failed: dict[int, str]) -> list[tuple[str, str]]:
    """Take samples (by position: reason) out of a pack, in place: their tokens, images and tiles. Returns their
    (key, reason), which are also added to `pack.skipped`."""
    t = pack.tensors
    keep = [k for k in range(len(pack.sample_keys)) if k not in failed]
    bounds = t["cu_seqlens"].tolist()
    token_ranges = [torch.arange(bounds[k], bounds[k + 1]) for k in keep]
    tokens = torch.cat(token_ranges) if token_ranges else torch.zeros(0, dtype=torch.long)
    lengths = torch.tensor([bounds[k + 1] - bounds[k] for k in keep], dtype=torch.int32)
    new_start = {k: int(start) for k, start in zip(keep, torch.cumsum(lengths, 0) - lengths)}

    image_sample = t["image_sample"].tolist()
    kept_images = [i for i, k in enumerate(image_sample) if k not in failed]
    tile_image = t["tile_image"].tolist()
    kept_tiles = [j for j, i in enumerate(tile_image) if image_sample[i] not in failed]
    tile_bytes = t["tile_shapes"].prod(dim=1).tolist()
    tile_offsets = np.cumsum([0] + tile_bytes)
    image_number = {i: n for n, i in enumerate(kept_images)}
    spans = t["image_token_spans"]
    pixels = t["pixels"]
    kept_pixels = [pixels[tile_offsets[j]:tile_offsets[j + 1]] for j in kept_tiles]

    for name in ("input_ids", "labels", "position_ids"):
        t[name] = t[name][tokens].contiguous()
    t["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lengths, 0).to(torch.int32)])
    t["pixels"] = torch.cat(kept_pixels) if kept_pixels else pixels[:0]
    t["tile_shapes"] = t["tile_shapes"][kept_tiles].contiguous()
    t["tile_image"] = torch.tensor([image_number[tile_image[j]] for j in kept_tiles], dtype=torch.int32)
    t["image_sample"] = torch.tensor([keep.index(image_sample[i]) for i in kept_images], dtype=torch.int32)
    t["image_token_spans"] = torch.tensor(
        [[new_start[image_sample[i]] + int(spans[i, 0]) - bounds[image_sample[i]], int(spans[i, 1])]
         for i in kept_images], dtype=torch.int32).reshape(-1, 2)
    skipped = [(pack.sample_keys[k], reason) for k, reason in sorted(failed.items())]
    pack.skipped = pack.skipped + skipped
    pack.sample_keys = [pack.sample_keys[k] for k in keep]
    pack.sample_sources = [pack.sample_sources[k] for k in keep] if pack.sample_sources else []
    pack.loss_tokens = int((t["labels"] != IGNORE_INDEX).sum())
    pack.empty = not keep
    return skipped
