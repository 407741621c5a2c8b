"""Pillow's bicubic resize, bit for bit, at a fraction of its CPU: the exact path's resizer.

Resizing is about two thirds of what pre-processing a photograph costs (BENCHMARKS.md "CPU per delivered
sample"), and Pillow runs it as scalar C. This module computes the same integer arithmetic as Pillow's
`Resample.c` for 8-bit RGB, so its output equals `Image.resize(size, Image.BICUBIC)` in every byte:

- the same filter weights (double precision, in the same order), normalised per output pixel and rounded to
  22-bit fixed point as Pillow rounds them; the same accumulation from a half-unit, shift and clamp;
- the same two separable passes, each rounding to uint8 in between, in the same order: horizontal first, or
  vertical first where Pillow 13+ chooses it (the height shrinks by more than twice as many pixels as the
  width does).

What differs is only how the work is laid out: the vertical pass runs along whole contiguous rows, and the
horizontal pass transposes blocks of rows first so its taps run along contiguous lanes too; LLVM vectorises
both. `matches_pillow()` checks the installed Pillow against this module once per process, on shapes that
take every branch; where they differ (a Pillow that changed its arithmetic), `exact_resizer` falls back to
Pillow itself, so `pixels: exact` stays exact whatever Pillow is installed.
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np

import PIL
from PIL import Image

from packfeed.media.chw import chw_tiles
from packfeed.media.jit import kernel
from packfeed.media.pixels import Resize, pil_resizer

log = logging.getLogger(__name__)

PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed point for 8-bit images: two bits of headroom for negative lobes
_HALF = 1 << (PRECISION_BITS - 1)  # accumulators start here, so the final shift rounds to nearest
_SUPPORT = 2.0  # bicubic's radius in source pixels, when enlarging
_BLOCK_ROWS = 64  # rows the horizontal pass transposes at once (64 x width x 3 bytes stays in cache)
_PILLOW_ORDERS_PASSES = int(PIL.__version__.split(".")[0]) >= 13


def _bicubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution with a = -0.5, operation for operation as Pillow evaluates it."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=1024)
def filter_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output pixel: the first source pixel it reads, how many it reads, and their fixed-point weights
    (int32, zero past the count). Pillow's `precompute_coeffs` and `normalize_coeffs_8bpc`, over all outputs.
    Cached (read-only): sizes repeat, a video's frames and a policy's thumbnails share them."""
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)  # shrinking widens the filter, so every source pixel contributes
    support = _SUPPORT * filter_scale
    taps = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's (int) truncates toward zero
    count = np.minimum((center + support + 0.5).astype(np.int64), in_size) - first
    tap = np.arange(taps)
    weights = _bicubic((tap[None, :] + first[:, None] - center[:, None] + 0.5) * (1.0 / filter_scale))
    weights = np.where(tap[None, :] < count[:, None], weights, 0.0)
    total = np.zeros(out_size)
    for t in range(taps):  # summed tap by tap, as Pillow does: a different order may round differently
        total = total + weights[:, t]
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    unit = float(1 << PRECISION_BITS)
    fixed = np.where(weights < 0, np.trunc(-0.5 + weights * unit), np.trunc(0.5 + weights * unit))
    arrays = first.astype(np.int32), count.astype(np.int32), fixed.astype(np.int32)
    for array in arrays:
        array.setflags(write=False)
    return arrays


@kernel(cache=True, nogil=True, boundscheck=False)
def _vertical(source, first, count, weights, out):  # pragma: no cover - compiled
    """out[y] = clamp(sum_t source[first[y] + t] * weights[y, t]); rows are (width x 3) bytes, contiguous. Taps go
    four at a time, so each lane's running sum is loaded and stored once per four rows read (1.1-1.4x one at a
    time); integer sums in another order are the same sums."""
    lanes = source.shape[1]
    total = np.empty(lanes, np.int32)
    for y in range(out.shape[0]):
        total[:] = _HALF
        start, taps, t = first[y], count[y], 0
        while t + 4 <= taps:
            w0, w1, w2, w3 = weights[y, t], weights[y, t + 1], weights[y, t + 2], weights[y, t + 3]
            r0, r1, r2, r3 = source[start + t], source[start + t + 1], source[start + t + 2], source[start + t + 3]
            for i in range(lanes):
                total[i] += ((np.int32(r0[i]) * w0 + np.int32(r1[i]) * w1)
                             + (np.int32(r2[i]) * w2 + np.int32(r3[i]) * w3))
            t += 4
        while t < taps:
            weight, row = weights[y, t], source[start + t]
            for i in range(lanes):
                total[i] += np.int32(row[i]) * weight
            t += 1
        target = out[y]
        for i in range(lanes):
            target[i] = min(max(total[i] >> PRECISION_BITS, 0), 255)


@kernel(cache=True, nogil=True, boundscheck=False)
def _horizontal(source, row0, first, count, weights, out):  # pragma: no cover - compiled
    """out[r, x] = clamp(sum_t source[row0 + r, first[x] + t] * weights[x, t]) per channel. Blocks of rows are
    transposed so that each tap multiplies a contiguous run of (rows x 3) lanes, and the results are gathered
    the same way before they are written back row by row: written straight into the output, one pixel of 64
    rows at a time, the stores alone cost twice the arithmetic when enlarging."""
    width = source.shape[1] // 3
    out_width = out.shape[1] // 3
    block = np.empty((width, _BLOCK_ROWS * 3), np.uint8)
    done = np.empty((out_width, _BLOCK_ROWS * 3), np.uint8)
    total = np.empty(_BLOCK_ROWS * 3, np.int32)
    for top in range(0, out.shape[0], _BLOCK_ROWS):
        rows = min(_BLOCK_ROWS, out.shape[0] - top)
        lanes = rows * 3
        for r in range(rows):
            row = source[row0 + top + r]
            for x in range(width):
                block[x, r * 3] = row[x * 3]
                block[x, r * 3 + 1] = row[x * 3 + 1]
                block[x, r * 3 + 2] = row[x * 3 + 2]
        for x in range(out_width):
            total[:lanes] = _HALF
            for t in range(count[x]):
                weight = weights[x, t]
                column = block[first[x] + t]
                for i in range(lanes):
                    total[i] += np.int32(column[i]) * weight
            result = done[x]
            for i in range(lanes):
                result[i] = min(max(total[i] >> PRECISION_BITS, 0), 255)
        for r in range(rows):
            target = out[top + r]
            for x in range(out_width):
                target[x * 3] = done[x, r * 3]
                target[x * 3 + 1] = done[x, r * 3 + 1]
                target[x * 3 + 2] = done[x, r * 3 + 2]


def vertical_first(width: int, height: int, size: tuple[int, int]) -> bool:
    """Whether Pillow runs the vertical pass first: since Pillow 13, when the height shrinks by more than twice
    as many pixels as the width does (python-pillow/Pillow#9549); before, never."""
    out_width, out_height = size
    return _PILLOW_ORDERS_PASSES and out_height < height and height - out_height > 2 * (width - out_width)


def resize_bicubic(pixels: np.ndarray, size: tuple[int, int], pillow_order: bool = True) -> np.ndarray:
    """`pixels` (uint8 (H, W, 3), C-contiguous) resized to size = (width, height), equal to Pillow's bicubic.
    With `pillow_order` False (the fast path) the height is shrunk first wherever it shrinks, so the costlier
    horizontal pass reads fewer rows; rounding between the passes then differs from Pillow's by a unit here
    and there."""
    height, width, _ = pixels.shape
    out_width, out_height = size
    if (out_width, out_height) == (width, height):
        return pixels.copy()
    rows = pixels.reshape(height, width * 3)
    if out_height == height:
        return _horizontal_pass(rows, 0, height, out_width).reshape(height, out_width, 3)
    first, count, weights = filter_weights(height, out_height)
    if out_width == width:
        return vertical_pass(rows, first, count, weights).reshape(out_height, out_width, 3)
    if vertical_first(width, height, size) if pillow_order else out_height < height:
        shrunk = vertical_pass(rows, first, count, weights)
        return _horizontal_pass(shrunk, 0, out_height, out_width).reshape(out_height, out_width, 3)
    top, bottom = int(first[0]), int(first[-1] + count[-1])  # only the source rows the vertical pass reads
    widened = _horizontal_pass(rows, top, bottom - top, out_width)
    return vertical_pass(widened, first - top, count, weights).reshape(out_height, out_width, 3)


def _horizontal_pass(rows: np.ndarray, row0: int, n_rows: int, out_width: int) -> np.ndarray:
    first, count, weights = filter_weights(rows.shape[1] // 3, out_width)
    out = np.empty((n_rows, out_width * 3), np.uint8)
    _horizontal(rows, row0, first, count, weights, out)
    return out


def vertical_pass(rows: np.ndarray, first: np.ndarray, count: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`rows` (uint8 (H, lanes), C-contiguous: an image's rows of interleaved pixels, or one colour plane)
    resampled along H by `filter_weights`: uint8 (len(first), lanes)."""
    out = np.empty((len(first), rows.shape[1]), np.uint8)
    _vertical(rows, first, count, weights, out)
    return out


# (source width, height) -> (width, height): enlarging, shrinking, each pass alone, both orders, 1-pixel sides
_PROBES = [((37, 23), (90, 61)), ((64, 48), (20, 17)), ((50, 80), (30, 30)), ((80, 50), (100, 30)),
           ((40, 30), (40, 71)), ((40, 30), (13, 30)), ((9, 200), (7, 11)), ((1, 5), (6, 1)), ((300, 2), (3, 9))]


@functools.cache
def matches_pillow() -> bool:
    """Whether this module reproduces the installed Pillow on the probe shapes (checked once per process)."""
    rng = np.random.default_rng(0)
    for (width, height), size in _PROBES:
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        expected = np.asarray(Image.fromarray(pixels).resize(size, Image.BICUBIC))
        if not np.array_equal(resize_bicubic(pixels, size), expected):
            log.warning("Pillow %s resizes differently from packfeed's bicubic at %s -> %s: pixels: exact uses "
                        "Pillow itself (slower)", PIL.__version__, (width, height), size)
            return False
    return True


def compile_kernels() -> bool:
    """Compile (and cache on disk) both kernels for every array they meet: Pillow's read-only pixels, writable
    ones (OpenCV's, a video frame's) and this module's own buffers; and packfeed.media.chw's. Returns
    matches_pillow()."""
    writable = np.zeros((8, 8, 3), np.uint8)
    read_only = writable.copy()
    read_only.setflags(write=False)  # np.asarray of a Pillow image is read-only: numba compiles it apart
    for pixels in (read_only, writable):
        for size in ((12, 5), (5, 12), (8, 5), (5, 8)):  # both orders, and each pass alone, from the source
            resize_bicubic(pixels, size)
        chw_tiles(pixels, [(1, 1, 2, 2)])  # tiles are cut channels first from any resizer's output
    return matches_pillow()


def exact_resizer(image: Image.Image | np.ndarray) -> Resize:
    """The exact path's resizer for one upright RGB image (a Pillow image, or its pixels uint8 (H, W, 3)): this
    module where it matches Pillow, else Pillow."""
    if not matches_pillow():
        return pil_resizer(image if isinstance(image, Image.Image) else Image.fromarray(image))
    pixels = functools.cache(lambda: np.ascontiguousarray(np.asarray(image)))  # copied out of Pillow once, if used
    return lambda size: resize_bicubic(pixels(), size)
