"""Videos into real `transformers` VLMs (tiny random configs, built offline): Qwen-VL's video patches equal the
Hugging Face video processor's, the M-RoPE positions equal the model's own `get_rope_index` (Qwen2.5-VL's timed
ones too), and packed loss and gradients of packs with videos equal running each sample alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("av")

from hf_models import FamilyData, tiny_model  # noqa: E402
from packfeed.client.hf import normalised, qwen_video_patches, to_hf_inputs, family_of  # noqa: E402
from test_hf_packed import assert_packed_equals_alone  # noqa: E402
from video_data import indexed_videos  # noqa: E402

VIDEO_CONVENTIONS = {
    "internvl": ("internvl", {"name": "internvl", "image_size": 56, "max_num": 4, "tokens_per_tile": 4},
                 {"fps": 0, "min_frames": 1, "max_frames": 3, "sampling": "random"}),
    "qwen2_vl": ("qwen2vl", {"name": "qwen2vl", "min_pixels": 784, "max_pixels": 784 * 9, "video_min_pixels": 784,
                             "video_max_pixels": 784 * 4}, {"fps": 2.0, "min_frames": 2, "max_frames": 6}),
}
VIDEO_CONVENTIONS["qwen2_5_vl"] = VIDEO_CONVENTIONS["qwen2_vl"]
GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # images, videos of each container, a frame sequence, text, image + video


def video_family(root, family: str) -> FamilyData:
    from packfeed.server.index.table import read_index_info
    from packfeed.server.serve.conventions import conventions_of
    from tokenizers import Tokenizer

    index, tokenizer, _ = indexed_videos(root, *VIDEO_CONVENTIONS[family], samples=8)
    conventions = conventions_of(read_index_info(index), tokenizer)
    return FamilyData(index, tokenizer, Tokenizer.from_file(str(tokenizer)).get_vocab_size(),
                      conventions.image_context_id, conventions)


def served_packs(data: FamilyData, groups: list[list[int]], seed: int = 0, epoch: int = 0):
    """PackTensors of the groups as the server builds and sends them (frames drawn for this seed and epoch)."""
    import numpy as np

    from packfeed.client.tensors import pack_of
    from packfeed.server.serve.packs import IndexRows, build_pack
    from packfeed.server.serve.preprocess import SampleReader
    from packfeed.server.serve.wire import encode_pack

    rows = IndexRows(data.index)
    reader = SampleReader(rows.info, data.tokenizer)
    packs = [build_pack([(rows, reader, "")], np.array(group), np.zeros(len(group), np.int32),
                        np.zeros(len(group), np.int32), epoch, 0, 0, m, seed) for m, group in enumerate(groups)]
    step_loss = sum(p.loss_tokens for p in packs)
    for pack in packs:
        assert not pack.skipped
        pack.step_loss_tokens = step_loss
    return [pack_of(encode_pack(pack, len(packs), False)) for pack in packs]


@pytest.mark.parametrize("name", sorted(VIDEO_CONVENTIONS))
def test_packed_videos_train_as_each_sample_alone(tmp_path, name):
    data = video_family(tmp_path, name)
    model = tiny_model(name, data)
    packs = served_packs(data, GROUPS)
    alone = served_packs(data, [[i] for group in GROUPS for i in group])
    for single in alone:
        single.step_loss_tokens = packs[0].step_loss_tokens
    kwargs = dict(conventions=data.conventions)
    if name == "qwen2_5_vl":
        kwargs["tokens_per_second"] = model.config.vision_config.tokens_per_second
    assert_packed_equals_alone(model, name, packs, alone, **kwargs)
    inputs = to_hf_inputs(packs[0], name, **kwargs)  # an image, then an mp4, a webm and an mkv
    if name.startswith("qwen"):
        assert inputs["video_grid_thw"].shape[0] == 3 and inputs["image_grid_thw"].shape[0] == 1
        assert set(inputs["mm_token_type_ids"].unique().tolist()) == {0, 1, 2}
    else:  # every frame an image of one tile: 3 frames of each video
        assert packs[0].visual_kind.tolist().count(1) == 9
        assert inputs["pixel_values"].shape[0] == len(packs[0].tiles()) > 9


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_video_inputs_equal_the_hf_processor_and_rope_index(tmp_path, name):
    import transformers

    data = video_family(tmp_path, name)
    model = tiny_model(name, data)
    (pack,) = served_packs(data, [[6]])  # an image, then a video, in one sample
    inputs = to_hf_inputs(pack, name, conventions=data.conventions,
                          tokens_per_second=getattr(model.config.vision_config, "tokens_per_second", None))
    # The processor, given the frames the server resized, patches them as we do.
    frames = [tile for tile, item in zip(pack.tiles(), pack.tile_image.tolist()) if item == 1]
    processor = transformers.Qwen2VLVideoProcessor(min_pixels=784, max_pixels=784 * 4)
    expected = processor(videos=[torch.stack(frames)], do_resize=False, do_sample_frames=False, return_tensors="pt")
    torch.testing.assert_close(inputs["pixel_values_videos"], expected["pixel_values_videos"], rtol=0, atol=1e-6)
    assert inputs["video_grid_thw"].tolist() == expected["video_grid_thw"].tolist()
    family = family_of(name)
    mine, _ = qwen_video_patches(normalised(frames, *family.normalisation), family)
    torch.testing.assert_close(mine, expected["pixel_values_videos"], rtol=0, atol=1e-6)
    # The model computes the same positions from the same inputs.
    extra = {}
    if name == "qwen2_5_vl":
        seconds = float(pack.frame_seconds[1])
        extra["second_per_grid_ts"] = torch.tensor([2 * seconds])
        assert seconds > 0
    positions, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              inputs["image_grid_thw"], inputs["video_grid_thw"], **extra)
    torch.testing.assert_close(inputs["position_ids"][1:], positions)
    assert len(set(positions[0, 0].tolist())) < positions.shape[-1]  # vision tokens share positions: a real check


def test_qwen3_vl_refuses_videos_clearly(tmp_path):
    data = video_family(tmp_path, "qwen2_vl")
    (pack,) = served_packs(data, [[1]])
    with pytest.raises(ValueError, match="holds videos, which Packfeed cannot give the qwen3_vl family"):
        to_hf_inputs(pack, "qwen3_vl")
