"""The exact path's bicubic resize (packfeed.media.resample) equals Pillow's byte for byte: on random
shapes that take every branch (enlarging, shrinking, one pass, both passes in either order, 1-pixel sides), on
every demo photograph and document scan under every preset policy, and it gives way to Pillow itself where
the installed Pillow computes otherwise."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from demo_data import PRESET_POLICIES, demo_image_files, document_scan
from packfeed.media import resample
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixels import cut_tiles, decode_tiles, pil_resizer, to_rgb


def pillow(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize(size, Image.BICUBIC))


def test_random_shapes_resize_exactly_as_pillow():
    rng = np.random.default_rng(7)
    orders = set()
    for case in range(160):
        width, height = (int(v) for v in rng.integers(1, 400, 2))
        size = tuple(int(v) for v in rng.integers(1, 900, 2))
        if case % 4 == 0:  # one side kept: one pass only
            size = (width, size[1]) if case % 8 == 0 else (size[0], height)
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        if case % 2:  # smooth gradients as well as noise: other rounding cases
            pixels = np.cumsum(pixels, axis=case % 3 % 2, dtype=np.uint8)
        assert np.array_equal(resample.resize_bicubic(pixels, size), pillow(pixels, size)), ((width, height), size)
        orders.add(resample.vertical_first(width, height, size))
    assert orders == {True, False} or not resample._PILLOW_ORDERS_PASSES  # both pass orders were exercised


@pytest.mark.parametrize("size", [(30, 30), (100, 30), (30, 70), (120, 200), (13, 79)])
def test_the_pass_order_is_the_one_pillow_takes(size):
    """Pillow's two passes round to uint8 in between, so the order shows in the pixels: the one-call resize
    equals the two one-pass resizes in the order vertical_first() names, and not in the other order."""
    pixels = np.random.default_rng(1).integers(0, 256, (80, 50, 3), dtype=np.uint8)
    horizontal_then_vertical = pillow(pillow(pixels, (size[0], 80)), size)
    vertical_then_horizontal = pillow(pillow(pixels, (50, size[1])), size)
    assert not np.array_equal(horizontal_then_vertical, vertical_then_horizontal)  # the order matters here
    expected = vertical_then_horizontal if resample.vertical_first(50, 80, size) else horizontal_then_vertical
    assert np.array_equal(pillow(pixels, size), expected)


@pytest.mark.parametrize("policy", PRESET_POLICIES, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_every_demo_image_tiles_exactly_as_with_pillow(demo_dataset, policy):
    image_policy = policy_from_dict(policy)
    files = demo_image_files(demo_dataset) + [document_scan(seed) for seed in range(2)]
    assert resample.matches_pillow()
    for data in files:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            upright = to_rgb(image)
        geometry = image_policy.geometry(upright.width, upright.height, 1)
        expected = cut_tiles(pil_resizer(upright), geometry)
        tiles = decode_tiles(data, geometry, resample.exact_resizer)
        assert len(tiles) == len(expected)
        assert all(np.array_equal(got, want) for got, want in zip(tiles, expected))


def test_a_pillow_that_computes_otherwise_is_used_itself(monkeypatch):
    """The self-check decides: where this module and the installed Pillow disagree, the exact path is Pillow."""
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    assert resample.exact_resizer(image)((17, 60)).tobytes() == pil_resizer(image)((17, 60)).tobytes()
    monkeypatch.setattr(resample, "_PILLOW_ORDERS_PASSES", not resample._PILLOW_ORDERS_PASSES)
    resample.matches_pillow.cache_clear()
    try:
        assert not resample.matches_pillow()  # the probes catch a pass order Pillow does not take
        resizer = resample.exact_resizer(image)
        assert np.array_equal(resizer((17, 60)), pil_resizer(image)((17, 60)))
    finally:
        resample.matches_pillow.cache_clear()
