"""Each indexed sample's preprocessing features (`packfeed.media.cpu_cost.FEATURES`) in a pixel mode, from the
columns the index already has: its images' names (format), bytes, sizes and tiling by the index's image policy,
its videos' sampled frames, its text tokens. Times a machine's `CostModel`, the seconds a loader core spends
preparing it (`packfeed info`, `packfeed stats`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from packfeed.media.cpu_cost import FEATURES, image_features, image_format, video_features
from packfeed.media.image_policy import policy_from_dict
from packfeed.v1.options import PixelMode

COLUMNS = ["valid", "n_images", "image_names", "image_sizes", "image_widths", "image_heights", "video_widths",
           "video_heights", "video_sampled", "frames_fps", "text_tokens"]


def sample_features(index: str | Path, modes: list[PixelMode]) -> dict[PixelMode, np.ndarray]:
    """Per mode of `modes`, (samples x FEATURES) of every row of the index (invalid ones: zeros); the index read
    and each image's geometry computed once for all of them."""
    from packfeed.server.index.table import read_index

    table, info = read_index(index, columns=COLUMNS)
    if not info.has_shards:
        raise ValueError(f"{index} was imported from length files: it has no images to cost; index the shards")
    policy = policy_from_dict(info.image_policy)
    rows = table.to_pydict()
    out = {mode: np.zeros((table.num_rows, len(FEATURES))) for mode in modes}
    geometries: dict[tuple, object] = {}  # a dataset repeats few (width, height, images) triples

    def geometry(width: int, height: int, n: int, frame: bool = False):
        key = (width, height, n, frame)
        if key not in geometries:
            geometries[key] = policy.frame_geometry(width, height) if frame else policy.geometry(width, height, n)
        return geometries[key]

    for k in range(table.num_rows):
        if not rows["valid"][k]:
            continue
        shared = np.zeros(len(FEATURES))  # what is the same in every mode: the sample, its text, its videos
        shared[0], shared[-1] = 1, rows["text_tokens"][k]
        widths, heights = rows["image_widths"][k], rows["image_heights"][k]
        images = []
        if rows["frames_fps"][k] is not None:  # one video given as its frames: each sampled one decoded
            sampled = rows["video_sampled"][k][0] if rows["video_sampled"][k] else len(widths)
            shared += video_features(widths[0], heights[0], sampled, geometry(widths[0], heights[0], 1, True))
        else:
            n = rows["n_images"][k]
            images = [(image_format(name), size, geometry(width, height, n)) for name, size, width, height in
                      zip(rows["image_names"][k], rows["image_sizes"][k], widths, heights)]
            for width, height, sampled in zip(rows["video_widths"][k], rows["video_heights"][k],
                                              rows["video_sampled"][k]):
                shared += video_features(width, height, sampled, geometry(width, height, 1, True))
        for mode, features in out.items():
            features[k] = shared
            for fmt, size, shape in images:
                features[k] += image_features(fmt, size, shape, mode)
    return out
