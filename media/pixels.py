"""How an image file becomes the tiles a pack carries: the one recipe the server (`pixels: exact | fast`) and
the client (`pixels: encoded`, where the server sends the file's bytes) both follow.

1. Decode and convert to 8-bit RGB as Hugging Face `transformers` loads images (`to_rgb`): EXIF orientation
   applied, high bit depths scaled (not clipped) to 8 bits, transparency composited on white.
2. Cut by a `Geometry`, which the server's image policy chooses from the image's size alone: resize the
   upright image to (resize_width, resize_height), crop a window of it, cut the window into square tiles of
   side `tile` (row-major; 0 keeps the window as one tile), and add a `thumbnail` square of the whole image.

Each tile is uint8 (3, H, W). With Pillow's bicubic resampling (`pil_resizer`) the tiles are pixel for pixel
what the Hugging Face / InternVL processors give; `packfeed.media.resample` computes the same with less than
half the CPU (BENCHMARKS.md), and `packfeed.media.chw` cuts the tiles channels first. Part of the contract
(`packfeed.v1`): numpy, Pillow and numba only, so servers and clients import it alike.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass, fields

import numpy as np
from PIL import Image, ImageOps

EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = {5, 6, 7, 8}  # transpose, rotate 270, transverse, rotate 90
_HIGH_DEPTH = {"I;16", "I;16L", "I;16B", "I;16N", "I"}  # 16-bit (and 32-bit integer) grey
_BACKGROUND = (255, 255, 255)  # transformers composites transparent pixels on white


def orientation(image: Image.Image, data: bytes | None = None) -> int:
    """The image's EXIF orientation (1: upright). A PNG may keep its EXIF after its pixels, where Pillow looks only
    by decoding the whole image: given the file's bytes, a PNG with no EXIF chunk (nor the older text one) is
    known to be upright without that."""
    if data is not None and image.format == "PNG" and b"eXIf" not in data and b"Raw profile type exif" not in data:
        return 1
    return image.getexif().get(EXIF_ORIENTATION, 1)


def oriented_size(image: Image.Image, data: bytes | None = None) -> tuple[int, int]:
    """(width, height) once the EXIF orientation is applied (read from the header; see `orientation`)."""
    width, height = image.size
    return (height, width) if orientation(image, data) in _SWAPS_SIDES else (width, height)


def to_rgb(image: Image.Image) -> Image.Image:
    """The image upright, in 8-bit RGB (the orientation is applied to `image` itself: no copy when upright)."""
    ImageOps.exif_transpose(image, in_place=True)
    if image.mode in _HIGH_DEPTH:
        # Pillow's own conversion clips 16-bit values at 255: scale the full range instead (v / 257, rounded)
        values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), "L")
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).round().astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _BACKGROUND + (255,)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")  # convert would copy an RGB image whole


@dataclass(frozen=True)
class Geometry:
    """What becomes of one image, as the image policy chose it from the image's upright size. On the wire one
    int32 row per image (`image_geometry`, columns in field order)."""

    width: int  # upright size of the image file, as indexed: a decoded image of another size is refused
    height: int
    resize_width: int
    resize_height: int
    crop_left: int  # the window of the resized image the tiles are cut from
    crop_top: int
    crop_width: int
    crop_height: int
    tile: int  # side of the square tiles cut from the window, row-major; 0: the window is one tile
    thumbnail: int  # side of one more square tile, the whole image resized; 0: none

    @classmethod
    def of_row(cls, row) -> Geometry:
        return cls(*(int(v) for v in row))

    def row(self) -> tuple[int, ...]:
        return astuple(self)

    def boxes(self) -> list[tuple[int, int, int, int]]:
        """(top, left, height, width) of every tile cut from the resized image, in order (the thumbnail apart)."""
        if not self.tile:
            return [(self.crop_top, self.crop_left, self.crop_height, self.crop_width)]
        return [(self.crop_top + r, self.crop_left + c, self.tile, self.tile)
                for r in range(0, self.crop_height, self.tile) for c in range(0, self.crop_width, self.tile)]

    def tile_shapes(self) -> list[tuple[int, int, int]]:
        """(C, H, W) of every tile, in order."""
        shapes = [(3, height, width) for _, _, height, width in self.boxes()]
        return shapes + ([(3, self.thumbnail, self.thumbnail)] if self.thumbnail else [])

    def check(self) -> None:
        """Refuse a geometry no image policy makes (a client must not trust the wire blindly)."""
        if min(self.row()) < 0 or min(self.width, self.height, self.resize_width, self.resize_height,
                                      self.crop_width, self.crop_height) < 1:
            raise ValueError(f"image geometry {self.row()} has an empty or negative side")
        if self.crop_left + self.crop_width > self.resize_width or self.crop_top + self.crop_height > self.resize_height:
            raise ValueError(f"image geometry {self.row()}: the window leaves the resized image")
        if self.tile and (self.crop_width % self.tile or self.crop_height % self.tile):
            raise ValueError(f"image geometry {self.row()}: the window is not a whole number of tiles")


GEOMETRY_COLUMNS = len(fields(Geometry))

Resize = Callable[[tuple[int, int]], np.ndarray]  # (width, height) -> uint8 (H, W, 3) of the image resized


def pil_resizer(image: Image.Image) -> Resize:
    """Pillow bicubic: the exact path, as the Hugging Face processors resize."""
    return lambda size: np.asarray(image.resize(size, Image.BICUBIC))


def cut_tiles(resize: Resize, geometry: Geometry, empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one upright RGB image, uint8 (3, H, W) each (made by `empty(shape, dtype)`), given how to
    resize it."""
    from packfeed.media.chw import chw_tiles  # numba: compiled on first use, not on import

    g = geometry
    tiles = chw_tiles(resize((g.resize_width, g.resize_height)), g.boxes(), empty)
    if g.thumbnail:
        tiles += chw_tiles(resize((g.thumbnail, g.thumbnail)), [(0, 0, g.thumbnail, g.thumbnail)], empty)
    return tiles


class ImageSizeMismatch(ValueError):
    """The image file is not the size its geometry was chosen for (the file changed since it was indexed)."""

    def __init__(self, found: tuple[int, int], expected: tuple[int, int]):
        super().__init__(f"image is {found}, the index says {expected}")
        self.found, self.expected = found, expected


def decode_tiles(data: bytes, geometry: Geometry, resizer: Callable[[Image.Image], Resize] = pil_resizer,
                 prepare: Callable[[Image.Image], None] | None = None, empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one image file: decoded, made upright RGB and cut by `geometry`, resized by `resizer` (Pillow
    bicubic: the exact path). `prepare` sees the opened image before it is decoded (e.g. to draft a JPEG);
    `empty(shape, dtype)` makes each tile's array.
    Raises ImageSizeMismatch, or what Pillow raises for a file that does not decode (OSError, SyntaxError,
    ValueError, DecompressionBombError)."""
    with opened(data, geometry) as image:
        if prepare is not None:
            prepare(image)
        image.load()
        return cut_tiles(resizer(to_rgb(image)), geometry, empty)


@contextmanager
def opened(data: bytes, geometry: Geometry) -> Iterator[Image.Image]:
    """The image file opened (its header read, nothing decoded), refused with ImageSizeMismatch where it is not
    the size `geometry` was chosen for."""
    with Image.open(io.BytesIO(data)) as image:
        size = oriented_size(image, data)
        if size != (geometry.width, geometry.height):
            raise ImageSizeMismatch(size, (geometry.width, geometry.height))
        yield image
