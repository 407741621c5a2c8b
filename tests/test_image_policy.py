"""Worked examples of every image policy, checked against the published preprocessing rules."""

import pytest

from packfeed.media.image_policy import FixedResolution, InternVLTiling, Qwen2VLResize, policy_from_dict


def test_internvl_1024x768_at_12_tiles_is_4x3_plus_thumbnail():
    cost = InternVLTiling(max_num=12).cost(1024, 768)
    assert InternVLTiling(max_num=12).grid(1024, 768) == (4, 3)
    assert cost.units == 13
    assert cost.llm_tokens == 3328
    assert cost.vit_sequences == (1024,) * 13


def test_internvl_single_tile_has_no_thumbnail():
    cost = InternVLTiling().cost(448, 448)
    assert cost.units == 1 and cost.llm_tokens == 256


def test_internvl_several_images_share_the_tile_budget():
    policy = InternVLTiling(max_num=12)
    # 3 images: each gets max(1, 12 // 3) = 4 tiles -> a 2x2 grid for a square image, + thumbnail.
    assert policy.grid(900, 900, n_images=3) == (2, 2)
    assert policy.cost(900, 900, n_images=3).units == 5
    # 20 images: max(1, 12 // 20) = 1 tile each, no thumbnail.
    assert policy.cost(2000, 500, n_images=20).units == 1


def test_internvl_tie_prefers_larger_grid_for_large_images():
    policy = InternVLTiling(max_num=12)
    # Aspect 1.0: (1,1), (2,2), (3,3) tie; a large image takes the larger grid when its area allows.
    assert policy.grid(448, 448) == (1, 1)
    assert policy.grid(1344, 1344) == (3, 3)


def test_internvl_wide_image():
    assert InternVLTiling(max_num=6).grid(2000, 400) == (5, 1)  # aspect 5 -> 5x1 within 6 tiles


def test_qwen2vl_smart_resize_worked_example():
    policy = Qwen2VLResize()
    assert policy.resize(1024, 768) == (756, 1036)  # (height, width)
    cost = policy.cost(1024, 768)
    assert cost.llm_tokens == 999 == 756 * 1036 // 784
    assert cost.vit_sequences == (756 * 1036 // 196,)


def test_qwen2vl_respects_pixel_bounds():
    policy = Qwen2VLResize()
    h, w = policy.resize(8000, 6000)
    assert h * w <= policy.max_pixels and h % 28 == 0 and w % 28 == 0
    h, w = policy.resize(20, 20)
    assert h * w >= policy.min_pixels


def test_qwen2vl_rejects_extreme_aspect():
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLResize().resize(10000, 20)


def test_fixed_resolution_is_llava_15():
    cost = FixedResolution().cost(1024, 768)
    assert (cost.units, cost.llm_tokens, cost.vit_sequences) == (1, 576, (576,))


def test_policy_round_trip_and_unknown_name():
    assert policy_from_dict(InternVLTiling(max_num=6).to_dict()) == InternVLTiling(max_num=6)
    with pytest.raises(ValueError, match="unknown image policy"):
        policy_from_dict({"name": "nope"})


def png_header(width: int, height: int) -> bytes:
    """A PNG declaring a size, with no pixels: what Pillow reads to know an image's size."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_max_image_pixels_lifts_pillows_own_limit_and_the_policy_refuses_past_it():
    """Pillow refuses images over 89 MP (a warning, errors over 179 MP) before a policy could judge them:
    `--max-image-pixels` above that is honoured, and an image over the policy's limit is refused by name."""
    from packfeed.media.samples import SampleError, image_size

    huge = png_header(14_000, 14_000)  # 196 MP: over both of Pillow's defaults
    assert image_size(huge, "header", InternVLTiling(max_image_pixels=300_000_000)) == (14_000, 14_000)
    with pytest.raises(SampleError, match="image rejected by policy: .*over max_image_pixels 50,000,000"):
        image_size(huge, "header", InternVLTiling())
    with pytest.raises(SampleError, match="image rejected by policy: .*over max_image_pixels 100,000,000"):
        image_size(png_header(20_000, 20_000), "header", InternVLTiling(max_image_pixels=100_000_000))
