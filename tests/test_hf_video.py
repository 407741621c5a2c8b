"""Videos into real `transformers` VLMs (tiny random configs, built offline): Qwen-VL's video patches equal the
Hugging Face video processor's, the M-RoPE positions equal the model's own `get_rope_index` (Qwen2.5-VL's timed
ones too), and packed loss and gradients of packs with videos equal running each sample alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("av")

from hf_models import FamilyData, tiny_model  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402
from packfeed.client.model.hf_families import family_of, normalised, qwen_video_patches  # noqa: E402
from test_hf_packed import assert_packed_equals_alone  # noqa: E402
from video_data import MIXED_KINDS, indexed_videos  # noqa: E402

VIDEO_CONVENTIONS = {
    "internvl": ("internvl", {"name": "internvl", "image_size": 56, "max_num": 4, "tokens_per_tile": 4},
                 {"fps": 0, "min_frames": 1, "max_frames": 3, "sampling": "random"}),
    "qwen2_vl": ("qwen2vl", {"name": "qwen2vl", "min_pixels": 784, "max_pixels": 784 * 9, "video_min_pixels": 784,
                             "video_max_pixels": 784 * 4}, {"fps": 2.0, "min_frames": 2, "max_frames": 6}),
}
VIDEO_CONVENTIONS["qwen2_5_vl"] = VIDEO_CONVENTIONS["qwen2_vl"]
VIDEO_CONVENTIONS["qwen3_vl"] = (  # the qwen3_vl preset at tiny sizes: timestamps, odd frame counts padded
    {"preset": "qwen2vl", "system_prompt": None, "video_timestamps": "<{:.1f} seconds>"},
    {"name": "qwen2vl", "factor": 32, "patch_size": 16, "min_pixels": 1024, "max_pixels": 1024 * 9,
     "video_min_pixels": 1024, "video_max_pixels": 1024 * 4, "pad_frames": True, "image_mean": [0.5] * 3,
     "image_std": [0.5] * 3}, {"fps": 1.5, "min_frames": 2, "max_frames": 5, "sampling": "linspace"})
GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # images, videos of each container, a frame sequence, text, image + video


def video_family(root, family: str, samples: int = 8, kinds: tuple[int, ...] = MIXED_KINDS) -> FamilyData:
    from packfeed.server.index.table import read_index_info
    from packfeed.server.serve.model_conventions import model_conventions
    from tokenizers import Tokenizer

    index, tokenizer, _ = indexed_videos(root, *VIDEO_CONVENTIONS[family], samples=samples, kinds=kinds)
    conventions = model_conventions(read_index_info(index), tokenizer)
    return FamilyData(index, tokenizer, Tokenizer.from_file(str(tokenizer)).get_vocab_size(),
                      conventions.image_context_id, conventions)


def built_packs(data: FamilyData, groups: list[list[int]], seed: int = 0, epoch: int = 0):
    """The server's packs of the groups (frames drawn for this seed and epoch), one microbatch each."""
    import numpy as np

    from packfeed.server.serve.index_rows import IndexRows
    from packfeed.server.serve.packs import build_pack
    from packfeed.server.serve.preprocess import SampleReader

    rows = IndexRows(data.index)
    reader = SampleReader(rows.info, data.tokenizer)
    packs = [build_pack([(rows, reader, "")], np.array(group), np.zeros(len(group), np.int32),
                        np.zeros(len(group), np.int32), epoch, 0, 0, m, seed) for m, group in enumerate(groups)]
    step_loss = sum(p.loss_tokens for p in packs)
    for pack in packs:
        assert not pack.skipped
        pack.step_loss_tokens = step_loss
    return packs


def served_packs(data: FamilyData, groups: list[list[int]], seed: int = 0, epoch: int = 0):
    """PackTensors of the groups as the server builds and sends them (frames drawn for this seed and epoch)."""
    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.serve.wire import encode_pack

    return [pack_of(encode_pack(pack, len(groups), False)) for pack in built_packs(data, groups, seed, epoch)]


def frame_counts(data: FamilyData, samples: list[int]) -> list[int]:
    from packfeed.server.serve.index_rows import IndexRows

    rows = IndexRows(data.index)
    return [rows.row(k)["video_sampled"][0] for k in samples]


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
        videos = 3 if name != "qwen3_vl" else sum(-(-n // 2) for n in frame_counts(data, [1, 2, 3]))  # patches
        assert inputs["video_grid_thw"].shape[0] == videos and inputs["image_grid_thw"].shape[0] == 1
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


def test_qwen3_vl_videos_equal_the_hf_processor_vision_tower_and_rope_index(tmp_path):
    """Qwen3-VL: the text (timestamps and nested vision markers, as transformers 5's processor writes them), the
    video patches, the vision tower's features and the positions equal what transformers computes for the same
    frames; Packfeed sends each temporal patch as an item of its own (grid t = 1), which the model treats alike."""
    import transformers
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.video_utils import VideoMetadata

    from packfeed.media.video import VideoSampling
    from packfeed.server.serve.index_rows import IndexRows

    data = video_family(tmp_path, "qwen3_vl")
    model = tiny_model("qwen3_vl", data)
    rows = IndexRows(data.index)
    for sample in (1, 4):  # an mp4 (odd frame counts padded), a frame sequence
        row = rows.row(sample)
        (pack,) = served_packs(data, [[sample]])
        inputs = to_hf_inputs(pack, "qwen3_vl", conventions=data.conventions)
        frames = torch.stack(pack.tiles())
        total, rate, count = row["video_frames"][0], row["video_rates"][0], row["video_sampled"][0]
        assert count % 2 == 1  # the last temporal patch is filled up with the last frame
        indices = VideoSampling(**rows.info.video_policy).frame_indices(total, count).tolist()
        processor = transformers.Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(patch_size=16),
            tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(data.tokenizer)),
            video_processor=transformers.Qwen3VLVideoProcessor(size={"shortest_edge": 1024, "longest_edge": 4096},
                                                               patch_size=16))
        question = "What moves?" if sample == 1 else "What changes?"
        text = f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>\n{question}<|im_end|>\n"
        expected = processor(text=[text], videos=[frames], do_resize=False, do_sample_frames=False,
                             video_metadata=[VideoMetadata(total_num_frames=total, fps=rate, frames_indices=indices)],
                             return_tensors="pt")
        prompt = expected["input_ids"][0].tolist()
        assert inputs["input_ids"][0, :len(prompt)].tolist() == prompt  # then the answer follows
        assert "seconds>" in Tokenizer.from_file(str(data.tokenizer)).decode(prompt, skip_special_tokens=False)
        torch.testing.assert_close(inputs["pixel_values_videos"], expected["pixel_values_videos"], rtol=0, atol=1e-6)
        grid = expected["video_grid_thw"]
        assert inputs["video_grid_thw"].tolist() == [[1, *grid[0, 1:].tolist()]] * int(grid[0, 0])
        with torch.no_grad():
            theirs = model.model.get_video_features(expected["pixel_values_videos"], grid).pooler_output
            mine = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
        torch.testing.assert_close(torch.cat(list(mine)), torch.cat(list(theirs)))
        length = len(prompt)
        positions, _ = model.model.get_rope_index(inputs["input_ids"][:, :length],
                                                  inputs["mm_token_type_ids"][:, :length], None, grid)
        torch.testing.assert_close(inputs["position_ids"][1:, :, :length], positions)
