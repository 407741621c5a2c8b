"""`pixels: fast`: an image file's tiles within a stated bound of the exact path (mean absolute error under
1/255 and PSNR above 40 dB per preset, BENCHMARKS.md "Fast-path candidates for resizing (measure and choose)"),
for a fraction of its CPU.

- Decoding: simplejpeg (libjpeg-turbo) and pyspng (libspng) decode what they decode as Pillow does (8-bit RGB
  and grey JPEGs and PNGs, upright, whole), straight into 3-byte pixels; Pillow decodes the rest. A JPEG at
  least 4x every target is decoded at 1/2..1/8 scale in the DCT domain (Pillow's `draft` rule), stopping at
  twice the targets.
- Enlarging (both sides): OpenCV's SIMD bicubic on the interleaved pixels. Its kernel is not Pillow's
  (a = -0.75), which shows little when enlarging.
- Shrinking (either side): Pillow's own bicubic arithmetic (`packfeed.media.resample`'s kernels, which widen the
  filter as Pillow does: OpenCV's does not, which blurs text out of the bound), the height first, on the
  interleaved pixels. The horizontal pass is the vertical kernel between two OpenCV transposes of the 3-byte
  pixels, so its lanes run along contiguous bytes too. (Before, it ran on the three colour planes apart: the
  split and the restacking of every tile cost more than the narrower transposes saved, 0.6-0.7 ms per
  sample of the demo photographs in the worker.) A target at most a quarter of the image is box-averaged
  first (Pillow's reducing_gap=2).

The tiles are the same bytes however the work is laid out: tests/test_pixels.py holds both layouts equal.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable

import numpy as np

from packfeed.media.chw import chw_tiles
from packfeed.media.pixels import Geometry, opened, orientation, to_rgb
from packfeed.media.resample import filter_weights, vertical_pass


def check_available() -> None:
    """A clear error, at start, where a library of the fast path is missing, or OpenCV too old for it. Without
    importing them where their packages' metadata say enough: the server's main process decodes nothing, and
    OpenCV alone would cost it about 30 MiB."""
    missing = next((name for name in ("cv2", "pyspng", "simplejpeg") if importlib.util.find_spec(name) is None), None)
    if missing is not None:
        raise ValueError(f"pixels: fast needs {missing}: pip install 'packfeed[fast]'")
    version = _opencv_version()
    if version < (4, 10):
        raise ValueError(f"pixels: fast needs OpenCV 4.10 or later (installed: {'.'.join(map(str, version))}): "
                         "pip install -U 'packfeed[fast]'")


def _opencv_version() -> tuple[int, ...]:
    """(major, minor) of the installed OpenCV: from the distribution that provides `cv2` (opencv-python,
    -headless, -contrib...), else from cv2 itself (one built from source has no metadata)."""
    for distribution in importlib.metadata.packages_distributions().get("cv2", []):
        try:
            return tuple(int(part) for part in importlib.metadata.version(distribution).split(".")[:2])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    import cv2

    return tuple(int(part) for part in cv2.__version__.split(".")[:2])


def file_tiles(data: bytes, geometry: Geometry, empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one image file, uint8 (3, H, W) each (made by `empty(shape, dtype)`). Raises what
    `packfeed.media.pixels.decode_tiles` raises."""
    return tiles(decode(data, geometry), geometry, empty)


def tiles(pixels: np.ndarray, geometry: Geometry, empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one upright RGB image (uint8 (H, W, 3)) cut by `geometry`, uint8 (3, H, W) each (made by
    `empty(shape, dtype)`)."""
    source = _Source(pixels, empty)
    out = source.tiles((geometry.resize_width, geometry.resize_height), geometry.boxes())
    if geometry.thumbnail:
        side = geometry.thumbnail
        out += source.tiles((side, side), [(0, 0, side, side)])
    return out


class _Source:
    """One image, resized to each size its tiles need."""

    def __init__(self, pixels: np.ndarray, empty: Callable):
        import cv2  # the fast path's dependency (pip install 'packfeed[fast]')

        cv2.setNumThreads(1)  # one worker is one core
        self.cv2, self.pixels, self.empty = cv2, np.ascontiguousarray(pixels), empty

    def tiles(self, size: tuple[int, int], boxes: list[tuple[int, int, int, int]]) -> list[np.ndarray]:
        cv2, pixels = self.cv2, self.pixels
        height, width = pixels.shape[:2]
        if size[0] >= width and size[1] >= height:
            return chw_tiles(cv2.resize(pixels, size, interpolation=cv2.INTER_CUBIC), boxes, self.empty)
        factor = min(width // size[0], height // size[1]) // 2
        if factor >= 2:  # the bicubic after it still shrinks 2x or more, over a fraction of the pixels
            pixels = cv2.resize(pixels, (-(-width // factor), -(-height // factor)), interpolation=cv2.INTER_AREA)
        return chw_tiles(self.shrink(pixels, size), boxes, self.empty)

    def shrink(self, pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """`pixels` resized to size = (width, height) with Pillow's bicubic arithmetic, the height first where it
        shrinks (rounding between the passes then differs from Pillow's by a unit here and there)."""
        height, width = pixels.shape[:2]
        out_width, out_height = size
        if out_height == height:
            return self.columns(pixels, out_width)
        first, count, weights = filter_weights(height, out_height)
        if out_height < height:
            rows = vertical_pass(pixels.reshape(height, width * 3), first, count, weights)
            shrunk = rows.reshape(out_height, width, 3)
            return shrunk if out_width == width else self.columns(shrunk, out_width)
        top, bottom = int(first[0]), int(first[-1] + count[-1])  # only the rows the vertical pass reads
        widened = self.columns(pixels[top:bottom], out_width)
        return vertical_pass(widened.reshape(bottom - top, out_width * 3), first - top, count,
                             weights).reshape(out_height, out_width, 3)

    def columns(self, pixels: np.ndarray, out_width: int) -> np.ndarray:
        """The horizontal pass: the vertical one between two transposes of the 3-byte pixels (OpenCV's; a
        transposed row is a column of pixels, so the vertical kernel's lanes run along contiguous bytes)."""
        height, width = pixels.shape[:2]
        turned = self.cv2.transpose(np.ascontiguousarray(pixels))
        shrunk = vertical_pass(turned.reshape(width, height * 3), *filter_weights(width, out_width))
        return self.cv2.transpose(shrunk.reshape(out_width, height, 3))


# -- decoding --------------------------------------------------------------------------------------------------

def draft_scale(geometry: Geometry) -> int:
    """The fast path's JPEG DCT-domain downscaling: when every size the image is resized to is at most a quarter
    of the image's, it is decoded at 1/2, 1/4 or 1/8 scale, the smallest that stays at least twice every target
    (Pillow's `draft` rule). The resize after it still shrinks 2x or more (as Pillow's reducing_gap=2), which
    keeps text within the fast bound; decoding at the target's own scale blurs it (2.2/255 mean error on
    document scans). 1: decode at full size."""
    widest = max(geometry.resize_width, geometry.thumbnail)
    tallest = max(geometry.resize_height, geometry.thumbnail)
    if geometry.width < 4 * widest or geometry.height < 4 * tallest:
        return 1
    fits = min(geometry.width // (2 * widest), geometry.height // (2 * tallest))
    return next(scale for scale in (8, 4, 2) if fits >= scale)


def _draft(image, scale: int) -> None:
    """Pillow's JPEG decoder set to decode at 1/scale (the upright sides mapped back to the file's)."""
    if scale > 1 and image.format == "JPEG":
        image.draft("RGB", (image.width // scale, image.height // scale))


def decodes_as_pillow(image, data: bytes) -> bool:
    """Whether the fast decoders give the pixels Pillow and `to_rgb` give: an 8-bit RGB or grey JPEG or PNG, upright
    (no EXIF turn), without transparency, and whole (its end marker present: a truncated file is left to Pillow,
    which reports it). libjpeg-turbo decodes JPEGs for both; tests/test_pixels.py checks they agree."""
    if image.mode not in ("RGB", "L") or "transparency" in image.info or len(image.tile) != 1:
        return False
    if image.format == "JPEG":
        whole = data[-2:] == b"\xff\xd9"
    else:  # a PNG's raw mode names its depth: 8 bits per sample are "RGB" or "L"
        whole = image.format == "PNG" and image.tile[0].args == image.mode and data[-8:-4] == b"IEND"
    return whole and orientation(image, data) == 1


def decode(data: bytes, geometry: Geometry) -> np.ndarray:
    """uint8 (H, W, 3) upright RGB, drafted where `draft_scale` allows. simplejpeg (libjpeg-turbo's TurboJPEG
    API) and pyspng (libspng) decode what they decode as Pillow does, straight into arrays of 3-byte pixels
    (Pillow holds 4 and repacks them when copied out), for less CPU than OpenCV's decoders too (BENCHMARKS.md
    "Decoding"); Pillow decodes the rest. Raises what `decode_tiles` raises."""
    with opened(data, geometry) as image:
        scale = draft_scale(geometry) if image.format == "JPEG" else 1
        if decodes_as_pillow(image, data):
            pixels = _decode_plain(data, image.format, image.size, scale)
            if pixels is not None:
                return pixels
        _draft(image, scale)  # what the fast decoders did not decode, Pillow does (and raises what is wrong)
        image.load()
        return np.asarray(to_rgb(image))


def _decode_plain(data: bytes, format: str, size: tuple[int, int], scale: int) -> np.ndarray | None:
    """A JPEG (at 1/scale: TurboJPEG picks the scale that keeps these sides, Pillow's draft sizes) or a PNG, as
    uint8 (H, W, 3) RGB; None where the decoder refuses the file (Pillow then says what is wrong with it)."""
    import pyspng
    import simplejpeg

    width, height = -(-size[0] // scale), -(-size[1] // scale)
    try:
        if format == "JPEG":
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=width, min_height=height)
        else:
            pixels = pyspng.load(data, format="RGB")
    except (ValueError, RuntimeError):
        return None
    return pixels if pixels.shape == (height, width, 3) else None
