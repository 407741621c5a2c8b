"""The server's pixel modes as a table: `PIXEL_PATHS[mode]` says how that mode makes an image file or a decoded
frame into tiles, what decoding holds in memory per pixel, and whether the files travel instead (the client
decodes them). Code that serves pixels looks a mode up here rather than comparing modes.

exact: Pillow's bicubic, pixel for pixel what the Hugging Face / InternVL processors give (computed by
`packfeed.media.resample`, byte for byte Pillow's with under half its CPU). fast: within 1/255 mean absolute
error and above 40 dB PSNR of exact for a fraction of its CPU (`packfeed.media.fast`: simplejpeg and pyspng
decode, OpenCV's bicubic where it enlarges, the exact kernels where it shrinks; BENCHMARKS.md "Fast-path
candidates for resizing (measure and choose)"). encoded: the image files' own bytes and each one's `Geometry`;
the client decodes and cuts them (`packfeed.client.stream.decode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from packfeed.media import fast
from packfeed.media.image_policy import ImagePolicy
from packfeed.media.pixels import Geometry, cut_tiles, decode_tiles, to_rgb
from packfeed.media.resample import exact_resizer
from packfeed.v1.options import PixelMode

Tiles = list[np.ndarray]


def _exact_file(data: bytes, geometry: Geometry, empty: Callable) -> Tiles:
    return decode_tiles(data, geometry, exact_resizer, empty=empty)


def _exact_frame(image: Image.Image | np.ndarray, geometry: Geometry, empty: Callable) -> Tiles:
    return cut_tiles(exact_resizer(image), geometry, empty)


def _fast_frame(image: Image.Image | np.ndarray, geometry: Geometry, empty: Callable) -> Tiles:
    return fast.tiles(np.asarray(image), geometry, empty)


def _always_available() -> None:
    return None


def _files_travel(*_) -> Tiles:
    raise ValueError("pixels: encoded makes no tiles on the server: the files travel and the client decodes them")


@dataclass(frozen=True)
class PixelPath:
    """How one pixel mode turns images into tiles on the server."""

    file_tiles: Callable[[bytes, Geometry, Callable], Tiles]  # an image file's bytes -> its tiles
    frame_tiles: Callable[[Image.Image | np.ndarray, Geometry, Callable], Tiles]  # a decoded upright RGB frame
    # Bytes a worker holds for a moment per pixel of an image it decodes (measured on a 9,400 x 9,400 PNG:
    # exact 9.4, fast 3.5): exact keeps Pillow's RGBA-wide image (4), its RGB array (3) and the resized copies;
    # fast decodes straight into RGB and shrinks it; encoded decodes nothing on the server.
    decode_bytes_per_pixel: int
    sends_files: bool = False  # the image files travel; the server decodes none
    check_available: Callable[[], None] = _always_available  # its libraries, checked once at start


PIXEL_PATHS: dict[PixelMode, PixelPath] = {
    PixelMode.EXACT: PixelPath(_exact_file, _exact_frame, 10),
    PixelMode.FAST: PixelPath(fast.file_tiles, _fast_frame, 4, check_available=fast.check_available),
    PixelMode.ENCODED: PixelPath(_files_travel, _files_travel, 0, sends_files=True),
}


def parse_pixels(pixels: str | PixelMode) -> PixelMode:
    """The mode a dataset's `pixels` names; a clear error for an unknown one, or for one whose libraries are not
    installed (at start, not per image)."""
    mode = PixelMode.parse(pixels, "pixels")
    PIXEL_PATHS[mode].check_available()
    return mode


def file_tiles(data: bytes, geometry: Geometry, pixels: PixelMode = PixelMode.EXACT,
               empty: Callable = np.empty) -> Tiles:
    """The tiles of one image file as the server makes them in mode `pixels`, each array made by
    `empty(shape, dtype)`. Raises what decode_tiles raises."""
    return PIXEL_PATHS[pixels].file_tiles(data, geometry, empty)


def pixel_tiles(image: Image.Image | np.ndarray, geometry: Geometry, pixels: PixelMode = PixelMode.EXACT,
                empty: Callable = np.empty) -> Tiles:
    """The tiles of one upright RGB image (a Pillow image, or uint8 (H, W, 3): a video frame) in mode `pixels`."""
    return PIXEL_PATHS[pixels].frame_tiles(image, geometry, empty)


def image_tiles(image: Image.Image, policy: ImagePolicy, n_images: int,
                pixels: PixelMode = PixelMode.EXACT) -> Tiles:
    """The pixel tiles the policy makes of one image, uint8 (3, H, W) RGB; `pixels` picks the resampling."""
    image = to_rgb(image)
    return pixel_tiles(image, policy.geometry(image.width, image.height, n_images), pixels)
