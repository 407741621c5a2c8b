"""What preparing a sample costs a loader core: a linear model over what the sample is, per pixel mode.

An image file costs by its format and size as the mode handles it: the bytes read and entropy-decoded, the
pixels decoded (a JPEG in `fast` at the DCT scale `packfeed.media.fast.draft_scale` picks: a quarter or less of
them), the pixels each resize reads (one pass per target size: the tile grid, the thumbnail) and the tile pixels
written; a video by its sampled frames' pixels; a sample by its tokens (tokenising) and a fixed part. Each
feature's seconds come from measuring this machine (`packfeed calibrate`, `packfeed.server.tools.calibrate`);
the features are pure functions of the index's columns, so an index records no machine's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packfeed.media.pixels import Geometry
from packfeed.v1.options import PixelMode

# one model feature each, in this order
FEATURES = ("samples", "file_bytes", "jpeg_pixels", "png_pixels", "other_pixels", "resize_pixels", "tile_pixels",
            "video_pixels", "tokens")
JPEG, PNG = ("jpg", "jpeg"), ("png",)


def image_format(name: str) -> str:
    """'jpeg', 'png' or 'other' from an index member name (its suffix: `0.jpg`, `png`, ...)."""
    suffix = name.rsplit(".", 1)[-1].lower()
    return "jpeg" if suffix in JPEG else "png" if suffix in PNG else "other"


def image_features(fmt: str, nbytes: int, geometry: Geometry, mode: PixelMode) -> np.ndarray:
    """The features (`FEATURES`) one image file adds to its sample in `mode`."""
    out = np.zeros(len(FEATURES))
    out[1] = nbytes
    if mode == PixelMode.ENCODED:  # the file travels: read, never decoded here
        return out
    scale = _draft_scale(geometry) if fmt == "jpeg" and mode == PixelMode.FAST else 1
    decoded = -(-geometry.width // scale) * -(-geometry.height // scale)
    out[FEATURES.index(f"{fmt}_pixels")] = decoded
    targets = 1 + bool(geometry.thumbnail)
    out[5] = decoded * targets
    out[6] = sum(h * w for _, h, w in geometry.tile_shapes())
    return out


def _draft_scale(geometry: Geometry) -> int:
    from packfeed.media.fast import draft_scale

    return draft_scale(geometry)


def video_features(width: int, height: int, frames: int, frame_geometry: Geometry) -> np.ndarray:
    """The features one video adds: its sampled frames decoded and each resized into its tiles."""
    out = np.zeros(len(FEATURES))
    out[7] = width * height * frames
    out[5] = width * height * frames
    out[6] = frames * sum(h * w for _, h, w in frame_geometry.tile_shapes())
    return out


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature (`FEATURES`) for one pixel mode on one machine, as `calibrate`
    measured them; `fit` says how well the model explained what it measured."""

    mode: PixelMode
    seconds: tuple[float, ...]
    fit: dict[str, float] = field(default_factory=dict)  # r2 and spearman of the calibration set
    machine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if len(self.seconds) != len(FEATURES) or any(not np.isfinite(s) or s < 0 for s in self.seconds):
            raise ValueError(f"a cost model gives {len(FEATURES)} non-negative seconds ({', '.join(FEATURES)}), "
                             f"not {self.seconds!r}: run packfeed calibrate again")

    def seconds_of(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of each row of `features` (n x FEATURES)."""
        return np.asarray(features, np.float64) @ np.asarray(self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "seconds": dict(zip(FEATURES, self.seconds)), "fit": self.fit,
                "machine": self.machine}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostModel":
        try:
            seconds = tuple(float(data["seconds"][name]) for name in FEATURES)
            return cls(PixelMode.parse(data["mode"], "mode"), seconds, dict(data.get("fit", {})),
                       dict(data.get("machine", {})))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a cost model ({error}): run packfeed calibrate again") from None
