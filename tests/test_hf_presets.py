"""Model presets against the model families' own processors in `transformers`: for each preset, the tokens per
image, the tile / patch geometry and the pixel values after normalisation are those of the family's processor
(PIL backend), checked on real photographs of many sizes and aspect ratios."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")
from transformers.image_utils import (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, IMAGENET_STANDARD_MEAN,  # noqa: E402
                                      IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

from packfeed.client.model.hf_families import FAMILIES, normalised, qwen_patches  # noqa: E402
from packfeed.media.image_policy import policy_from_dict  # noqa: E402
from packfeed.server.index.conventions import MODEL_PRESETS, add_convention_options, conventions_of  # noqa: E402
from packfeed.media.pixel_modes import image_tiles  # noqa: E402

SIZES = [(1024, 768), (768, 1024), (448, 448), (300, 1800), (1600, 200), (97, 53), (2000, 1500)]
PRESET_FAMILY = {"internvl2_5": "internvl", "internvl3": "internvl", "qwen2_vl": "qwen2_vl",
                 "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "llava_1_5": "llava"}


def photo(width: int, height: int) -> Image.Image:
    from packfeed.server.tools.demo import _load_photos

    source = _load_photos()[(width * 7 + height) % 3]
    return source.resize((width, height), Image.BILINEAR)


def preset_policy(name: str):
    parser = argparse.ArgumentParser()
    add_convention_options(parser)
    policy, _ = conventions_of(parser.parse_args(["--preset", name]))
    return policy_from_dict(policy)


def ours(image: Image.Image, preset: str, n_images: int = 1) -> tuple[torch.Tensor, int]:
    """(the model's pixel values, LLM tokens) as Packfeed produces them for one image."""
    policy, family = preset_policy(preset), FAMILIES[PRESET_FAMILY[preset]]
    tiles = [torch.from_numpy(t) for t in image_tiles(image, policy, n_images)]
    pixels = normalised(tiles, policy.image_mean, policy.image_std)
    tokens = policy.cost(image.width, image.height, n_images).llm_tokens
    if family.image_policy == "qwen2vl":
        patches, _ = qwen_patches(pixels[0], family)
        return patches, tokens
    return torch.stack(pixels), tokens


def test_every_preset_has_a_family():
    assert set(PRESET_FAMILY) == set(MODEL_PRESETS)
    for preset, family in PRESET_FAMILY.items():
        assert preset_policy(preset).name == FAMILIES[family].image_policy


@pytest.mark.parametrize("preset", ["internvl2_5", "internvl3"])
def test_internvl_presets_match_the_hf_processor(preset):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil(crop_to_patches=True, size={"height": 448, "width": 448}, min_patches=1,
                                         max_patches=12, image_mean=IMAGENET_DEFAULT_MEAN,
                                         image_std=IMAGENET_DEFAULT_STD)
    for width, height in SIZES:
        image = photo(width, height)
        expected = processor.preprocess([image], return_tensors="pt")
        pixels, tokens = ours(image, preset)
        assert pixels.shape == expected["pixel_values"].shape, (width, height)
        assert tokens == int(expected["num_patches"][0]) * 256  # InternVL: 256 tokens per 448 px tile
        torch.testing.assert_close(pixels, expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("preset,patch,pixels_range,mean_std", [
    ("qwen2_vl", 14, (3136, 12845056), (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)),
    ("qwen2_5_vl", 14, (3136, 12845056), (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)),
    ("qwen3_vl", 16, (65536, 16777216), (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)),
])
def test_qwen_presets_match_the_hf_processor(preset, patch, pixels_range, mean_std):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": pixels_range[0], "longest_edge": pixels_range[1]}, patch_size=patch,
        merge_size=2, temporal_patch_size=2, image_mean=mean_std[0], image_std=mean_std[1])
    for width, height in SIZES:
        image = photo(width, height)
        expected = processor.preprocess([image], return_tensors="pt")
        pixels, tokens = ours(image, preset)
        grid = expected["image_grid_thw"][0]
        assert tokens == int(grid.prod()) // 4, (width, height)  # 2 x 2 patches merge into one token
        assert pixels.shape == expected["pixel_values"].shape
        torch.testing.assert_close(pixels, expected["pixel_values"], rtol=0, atol=1e-6)


def test_llava_preset_matches_the_hf_processor():
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    processor = LlavaImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                       image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
    for width, height in SIZES:
        image = photo(width, height)
        expected = processor.preprocess([image], return_tensors="pt")["pixel_values"]
        pixels, tokens = ours(image, "llava_1_5")
        assert tokens == (336 // 14) ** 2
        torch.testing.assert_close(pixels, expected, rtol=0, atol=1e-6)


def test_squash_and_split_remain_selectable():
    """`fixed` squashes unless told to crop; InternVL's own multi-image rule splits the tile budget, the HF
    processor's gives each image all of it."""
    image = photo(1024, 512)
    squash = policy_from_dict({"name": "fixed", "size": 336})
    crop = policy_from_dict({"name": "fixed", "size": 336, "resize": "crop"})
    assert not np.array_equal(image_tiles(image, squash, 1)[0], image_tiles(image, crop, 1)[0])
    split = policy_from_dict({"name": "internvl", "max_num": 12})
    each = policy_from_dict({"name": "internvl", "max_num": 12, "multi_image": "each"})
    assert split.cost(2000, 1000, 3).units == 2 + 1  # 12 // 3 = 4 tiles at most: a 2 x 1 grid, + thumbnail
    assert each.cost(2000, 1000, 3).units == each.cost(2000, 1000, 1).units == 8 + 1  # 4 x 2 of 12, + thumbnail
