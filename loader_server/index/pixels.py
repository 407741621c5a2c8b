"""How an image file becomes 8-bit RGB, as Hugging Face `transformers` loads images: EXIF orientation
applied, high bit depths scaled (not clipped) to 8 bits, transparency composited on white.

The indexer costs an image by its size after orientation (`oriented_size`, read from the header, no decoding)
and the server converts its pixels with `to_rgb`, so the grid the index planned is the grid served.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps

EXIF_ORIENTATION = 0x0112
_SWAPS_SIDES = {5, 6, 7, 8}  # transpose, rotate 270, transverse, rotate 90
_HIGH_DEPTH = {"I;16", "I;16L", "I;16B", "I;16N", "I"}  # 16-bit (and 32-bit integer) grey
_BACKGROUND = (255, 255, 255)  # transformers composites transparent pixels on white


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) once the EXIF orientation is applied."""
    width, height = image.size
    orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    return (height, width) if orientation in _SWAPS_SIDES else (width, height)


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
    return image.convert("RGB")
