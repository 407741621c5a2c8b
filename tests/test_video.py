"""Video samples with real videos PyAV encodes: frame counts and choices as the model families sample them, seeking
decode equal to decoding everything, costs in the index, `<video>` placeholders as each family writes them, bad
videos skipped with their reason, and Qwen-VL video inputs equal to the Hugging Face processor's and model's."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("av")

from packfeed.media.video import VideoError, VideoSampling, probe_video, read_frames  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from packfeed.server.serve.index_rows import IndexRows  # noqa: E402
from packfeed.server.serve.packs import build_pack  # noqa: E402
from packfeed.server.serve.preprocess import SampleReader, SampleSkipped  # noqa: E402
from packfeed.v1.options import VisualKind  # noqa: E402
from video_data import (all_frames, conversation, encode_video, indexed_videos, jpeg, frame_picture,  # noqa: E402
                        write_shard)

INTERNVL = ("internvl", {"name": "internvl", "image_size": 56, "max_num": 4, "tokens_per_tile": 4},
            {"fps": 0, "min_frames": 1, "max_frames": 3, "sampling": "random"})
QWEN = ("qwen2vl", {"name": "qwen2vl", "min_pixels": 784, "max_pixels": 784 * 9, "video_min_pixels": 784,
                    "video_max_pixels": 784 * 4}, {"fps": 2.0, "min_frames": 2, "max_frames": 6})


@pytest.mark.parametrize("extension", ["mp4", "webm", "mkv"])
@pytest.mark.parametrize("sampling", ["uniform", "segment", "random"])
def test_seeking_decode_gives_the_frames_a_full_decode_gives(extension, sampling):
    data = encode_video(extension, frames=120, rate=24, gop=24)  # seeks: samples lie more than a GOP apart
    info = probe_video(data)
    assert (info.frames, info.rate, info.width, info.height) == (120, 24.0, 192, 128)
    reference = all_frames(data)
    indices = VideoSampling(sampling=sampling).frame_indices(info.frames, 7, seed=3, epoch=1, key="k")
    assert np.all(np.diff(indices) > 0) and indices[-1] < 120
    for got, index in zip(read_frames(data, info, indices), indices.tolist()):
        np.testing.assert_array_equal(got, reference[index])


def test_frame_counts_and_uniform_choices_match_the_hf_qwen_video_processor():
    transformers = pytest.importorskip("transformers")
    from transformers.video_utils import VideoMetadata

    processor = transformers.Qwen2VLVideoProcessor()
    policy = VideoSampling(fps=2.0, min_frames=4, max_frames=768, sampling="uniform")
    for total, rate in [(48, 12), (24, 12), (60, 12), (300, 30), (9, 30), (100, 25), (1001, 29.97), (7, 24),
                        (3000, 60), (77, 7.5)]:
        expected = processor.sample_frames(metadata=VideoMetadata(total_num_frames=total, fps=rate), fps=2).tolist()
        count = policy.frame_count(total, rate, multiple=2)
        assert count == len(expected), (total, rate)
        assert policy.frame_indices(total, count).tolist() == expected, (total, rate)


def test_qwen3_frame_counts_and_choices_match_the_hf_qwen3_video_processor():
    transformers = pytest.importorskip("transformers")
    from transformers.video_utils import VideoMetadata

    from packfeed.media.image_policy import policy_from_dict
    from packfeed.server.index.conventions import MODEL_PRESETS

    processor = transformers.Qwen3VLVideoProcessor()
    preset = MODEL_PRESETS["qwen3_vl"]
    policy = VideoSampling(**preset["video_policy"])
    multiple = policy_from_dict(preset["image_policy"]).frame_multiple
    for total, rate in [(48, 12), (25, 12), (61, 12), (300, 30), (9, 30), (3, 30), (100, 25), (1001, 29.97),
                        (7, 24), (3000, 60)]:
        expected = processor.sample_frames(metadata=VideoMetadata(total_num_frames=total, fps=rate)).tolist()
        count = policy.frame_count(total, rate, multiple)
        assert count == len(expected), (total, rate)
        assert policy.frame_indices(total, count).tolist() == expected, (total, rate)


def test_random_frames_are_a_pure_function_of_seed_epoch_and_key():
    policy = VideoSampling(sampling="random")
    first = policy.frame_indices(300, 8, seed=1, epoch=0, key="a")
    assert policy.frame_indices(300, 8, seed=1, epoch=0, key="a").tolist() == first.tolist()
    others = [policy.frame_indices(300, 8, seed=s, epoch=e, key=k).tolist()
              for s, e, k in [(2, 0, "a"), (1, 1, "a"), (1, 0, "b")]]
    assert all(other != first.tolist() for other in others)
    segments = np.floor(np.arange(9) * 300 / 8).astype(int)
    assert np.all((first >= segments[:-1]) & (first < segments[1:]))  # one frame from each segment
    assert VideoSampling(sampling="segment").frame_indices(10, 2).tolist() == [2, 7]


def test_frame_counts_follow_the_policy():
    policy = VideoSampling(fps=1.0, min_frames=2, max_frames=5)
    assert policy.frame_count(24 * 3, 24) == 3  # 3 seconds at 1 fps
    assert policy.frame_count(24, 24) == 2  # min_frames
    assert policy.frame_count(24 * 60, 24) == 5  # max_frames
    assert policy.frame_count(1, 24) == 1  # never more than the video has
    assert policy.frame_count(1, 24, multiple=2) == 0  # too short for a temporal patch
    assert VideoSampling(fps=0, max_frames=8).frame_count(1000, 30) == 8
    for bad in ({"fps": -1}, {"min_frames": 0}, {"min_frames": 5, "max_frames": 4}, {"sampling": "every"}):
        with pytest.raises(ValueError):
            VideoSampling(**bad)


@pytest.fixture(scope="module")
def internvl_videos(tmp_path_factory):
    return indexed_videos(tmp_path_factory.mktemp("internvl"), *INTERNVL)


@pytest.fixture(scope="module")
def qwen_videos(tmp_path_factory):
    return indexed_videos(tmp_path_factory.mktemp("qwen"), *QWEN)


def rows_by_key(index) -> dict:
    return {row["key"]: row for row in read_index(index)[0].to_pylist()}


def test_the_index_costs_videos_by_their_sampled_frames(internvl_videos, qwen_videos):
    internvl, qwen = rows_by_key(internvl_videos[0]), rows_by_key(qwen_videos[0])
    assert internvl_videos[2].valid == internvl_videos[2].rows == 12
    for key, row in internvl.items():
        if row["n_videos"] and not row["n_images"]:
            assert row["video_sampled"] == [3] and row["vision_units"] == 3 and row["vision_tokens"] == 12
            assert row["vit_patches"] == 3 * 16 and row["vit_attn_sq"] == 3 * 16 * 16  # three 4x4-patch tiles
    mp4 = qwen["s00001"]  # 12 fps: 1-6 s, 2 fps -> 2 frames a second, within [2, 6]
    seconds = mp4["video_frames"][0] / 12
    frames = min(max(int(seconds * 2) // 2 * 2, 2), 6)
    assert mp4["video_names"] == ["mp4"] and mp4["video_sampled"] == [frames]
    # 160x96 frames within 784..3136 px -> 56x28 (smart_resize), 2 merged tokens per temporal patch
    assert mp4["vision_units"] == mp4["vision_tokens"] == frames // 2 * 2
    assert mp4["vit_patches"] == frames // 2 * 8
    sequence = qwen["s00004"]
    assert sequence["frames_fps"] == 4.0 and sequence["n_images"] == 0 and sequence["video_names"] == ["frames"]
    assert sequence["video_frames"] == [len(sequence["image_names"])]


def test_internvl_writes_frames_as_images_with_frame_prompts(internvl_videos):
    from tokenizers import Tokenizer

    index, tokenizer_path, _ = internvl_videos
    rows = IndexRows(index)
    reader = SampleReader(rows.info, tokenizer_path)
    sample = reader.load(rows.row(1), seed=0, epoch=0)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    text = tokenizer.decode(sample.input_ids.tolist(), skip_special_tokens=False)
    run = "<img>" + "<IMG_CONTEXT>" * 4 + "</img>"
    assert f"<|im_start|>user\nFrame1: {run}\nFrame2: {run}\nFrame3: {run}\nWhat moves?<|im_end|>" in text
    assert sample.kinds == [VisualKind.VIDEO] * 3 and sample.tiles_per_image == [1, 1, 1] and sample.image_tokens == [4] * 3
    assert all(tile.shape == (3, 56, 56) for tile in sample.tiles)


def test_served_frames_are_the_sampled_frames_resized(internvl_videos):
    """The tiles are the frames (seed, epoch, key) choose, resized exactly as Pillow's bicubic; another epoch draws
    other frames."""
    from packfeed.server.index.shards import iter_samples

    index, tokenizer, _ = internvl_videos
    rows = IndexRows(index)
    reader = SampleReader(rows.info, tokenizer)
    row = rows.row(2)  # a webm
    data = next(raw for raw in iter_samples(row["shard"]) if raw.key == row["key"]).video_members()[0].data
    reference = all_frames(data)
    policy = VideoSampling(**rows.info.video_policy)
    for epoch in (0, 1):
        indices = policy.frame_indices(row["video_frames"][0], 3, seed=7, epoch=epoch, key=row["key"])
        tiles = reader.load(row, seed=7, epoch=epoch).tiles
        for tile, index in zip(tiles, indices.tolist()):
            expected = np.asarray(Image.fromarray(reference[index]).resize((56, 56), Image.BICUBIC))
            np.testing.assert_array_equal(tile.transpose(1, 2, 0), expected)
    assert [t.tobytes() for t in reader.load(row, 7, 0).tiles] != [t.tobytes() for t in reader.load(row, 7, 1).tiles]
    assert [t.tobytes() for t in reader.load(row, 7, 0).tiles] == [t.tobytes() for t in reader.load(row, 7, 0).tiles]


def test_qwen_writes_one_run_of_video_tokens_and_a_pack_carries_kinds(qwen_videos):
    from tokenizers import Tokenizer

    index, tokenizer_path, _ = qwen_videos
    rows = IndexRows(index)
    reader = SampleReader(rows.info, tokenizer_path)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    row = rows.row(1)
    sample = reader.load(row)
    start, count = sample.image_starts[0], sample.image_tokens[0]
    names = [tokenizer.id_to_token(int(i)) for i in sample.input_ids[start - 1:start + count + 1]]
    assert names == ["<|vision_start|>"] + ["<|video_pad|>"] * count + ["<|vision_end|>"]
    assert sample.tiles_per_image == row["video_sampled"] and len(sample.tiles) == row["video_sampled"][0]
    assert sample.frame_seconds == [pytest.approx(row["video_frames"][0] / 12 / row["video_sampled"][0])]
    pack = build_pack([(rows, reader, "")], np.arange(6), np.zeros(6, np.int32), np.zeros(6, np.int32), 0, 0, 0, 0)
    assert pack.tensors["visual_kind"].tolist() == [VisualKind.IMAGE] + [VisualKind.VIDEO] * 4
    assert pack.tensors["frame_seconds"][0] == 0 and (pack.tensors["frame_seconds"][1:] > 0).all()
    assert len(pack.tensors["tile_image"]) == 1 + sum(rows.row(i)["video_sampled"][0] for i in range(1, 5))


def bad_video_samples() -> list[tuple[str, dict[str, bytes]]]:
    good = encode_video("mkv", frames=48, rate=12, width=64, height=64)
    mp4 = encode_video("mp4", frames=24, rate=12, width=64, height=64)
    ask = conversation("<video>\nWhat moves?", "A bar.")
    frames = {f"{i}.jpg": jpeg(frame_picture(i, 64, 64 if i else 48)) for i in range(4)}
    return [
        ("garbage", {"mp4": b"\x00\x00\x00\x18ftypmp42" + bytes(500), "json": ask}),
        ("truncated-mp4", {"mp4": mp4[:len(mp4) // 2], "json": ask}),
        ("two-tags", {"mkv": good, "json": conversation("<video><video> twice?", "No.")}),
        ("mixed-sizes", {**frames, "json": conversation("<video>\nWhat?", "Frames.", frames={"fps": 2})}),
        ("bad-fps", {**frames, "json": conversation("<video>\nWhat?", "Frames.", frames={"fps": "fast"})}),
        ("short", {"mkv": encode_video("mkv", frames=1, rate=12, width=64, height=64), "json": ask}),
        ("late-end", {"mkv": good[:len(good) * 2 // 3], "json": ask}),
        ("fine", {"mkv": good, "json": ask}),
    ]


def test_bad_videos_are_invalid_or_skipped_with_their_reason(tmp_path):
    from packfeed.media.chat import PRESETS
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import train_tokenizer

    shard = write_shard(tmp_path / "bad.tar", bad_video_samples())
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=400,
                                special_tokens=PRESETS["qwen2vl"].special_tokens)
    config = IndexConfig(str(tokenizer), QWEN[1], PRESETS["qwen2vl"].to_dict(), {"fps": 0, "max_frames": 4},
                         verify_images="header")
    build_index([str(shard)], tmp_path / "index.parquet", config, workers=1, progress=False)
    rows = rows_by_key(tmp_path / "index.parquet")
    reasons = {key: row["reason"] for key, row in rows.items()}
    assert reasons["garbage"].startswith("undecodable video")
    assert reasons["truncated-mp4"].startswith("undecodable video")
    assert reasons["two-tags"] == "video tag mismatch: 2 <video> tags for 1 videos"
    assert reasons["mixed-sizes"].startswith("frame sequence: frames differ in size (64x48, 64x64)")
    assert reasons["bad-fps"].startswith('invalid json: "frames" must be')
    assert reasons["short"].startswith("video too short: 1 frames")
    assert reasons["late-end"] is None and reasons["fine"] is None  # the header alone looks whole
    # Served: the cut-off video is skipped with the reason, the good one next to it is not.
    mapped = IndexRows(tmp_path / "index.parquet")
    reader = SampleReader(mapped.info, tokenizer)
    ids = [k for k in range(mapped.table.num_rows) if mapped.row(k)["key"] in ("late-end", "fine")]
    pack = build_pack([(mapped, reader, "")], np.array(ids), np.zeros(2, np.int32), np.zeros(2, np.int32), 0, 0, 0, 0)
    assert pack.sample_keys == ["fine"]
    assert len(pack.skipped) == 1 and pack.skipped[0][0] == "late-end"
    assert pack.skipped[0][1].startswith("undecodable video: ends at frame") and "late-end.mkv" in pack.skipped[0][1]


def test_isf_phases_refuses_to_route_a_dataset_with_videos(qwen_videos):
    """isf+phases routes images between ranks, not videos: a job on a dataset with videos must colocate."""
    from packfeed.server.serve.config import dataset_source
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobError, JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.v1.options import PlanConfig

    index, tokenizer, _ = qwen_videos
    registry = JobRegistry({"v": Dataset.open("v", dataset_source(index, tokenizer))})
    with pytest.raises(JobError, match="dataset v: 9 samples hold videos, which are not routed between ranks.*"
                                       "set colocate_encoder"):
        registry.open_job(JobSpec("routed", "v", PlanConfig(dp=2, strategy="isf+phases"), 0))
    with pytest.raises(JobError, match="not routed between ranks.*encoder on ranks of its own.*set encoder_ranks 0"):
        registry.open_job(JobSpec("encoder-ranks", "v", PlanConfig(dp=2, encoder_ranks=1), 0))
    registry.open_job(JobSpec("colocated", "v", PlanConfig(dp=2, strategy="isf+phases", colocate_encoder=True), 0))


def test_pixels_encoded_refuses_a_dataset_with_videos_and_skips_any_with_the_reason(qwen_videos):
    from packfeed.server.serve.config import dataset_source
    from packfeed.server.serve.datasets import Dataset

    index, tokenizer, _ = qwen_videos
    with pytest.raises(ValueError, match="dataset v: 9 samples hold videos, which pixels: encoded cannot carry"):
        Dataset.open("v", dataset_source(index, tokenizer, pixels="encoded"))
    assert Dataset.open("v", dataset_source(index, tokenizer, pixels="exact")).fingerprint
    rows = IndexRows(index)
    reader = SampleReader(rows.info, tokenizer, pixels="encoded")
    assert reader.load(rows.row(0)).encoded  # an image still travels as its file
    with pytest.raises(SampleSkipped, match="pixels: encoded sends image files only"):
        reader.load(rows.row(1))


def test_a_changed_video_is_detected_by_its_checksum(tmp_path):
    from packfeed.media.chat import PRESETS
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import train_tokenizer

    video = encode_video("mkv", frames=24, rate=12, width=64, height=64)
    shard = write_shard(tmp_path / "a.tar", [("v", {"mkv": video, "json": conversation("<video>\nWhat?", "A bar.")})])
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=400,
                                special_tokens=PRESETS["internvl"].special_tokens)
    config = IndexConfig(str(tokenizer), INTERNVL[1], PRESETS["internvl"].to_dict(), INTERNVL[2])
    build_index([str(shard)], tmp_path / "index.parquet", config, workers=1, progress=False)
    changed = bytearray(video)
    changed[len(changed) // 2] ^= 0xFF
    write_shard(shard, [("v", {"mkv": bytes(changed), "json": conversation("<video>\nWhat?", "A bar.")})])
    rows = IndexRows(tmp_path / "index.parquet")
    with pytest.raises(SampleSkipped, match="shard changed: v.mkv differs from the indexed content"):
        SampleReader(rows.info, tokenizer).load(rows.row(0))


def test_probe_refuses_what_is_not_a_video():
    with pytest.raises(VideoError, match="undecodable video"):
        probe_video(jpeg(frame_picture(0, 32, 32)))
    with pytest.raises(VideoError, match="undecodable video"):
        probe_video(b"")
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PNG")
    with pytest.raises(VideoError):
        probe_video(out.getvalue())


@pytest.mark.slow
def test_a_video_dataset_served_over_grpc_delivers_every_sample_once_and_the_same_frames_on_two_servers(
        internvl_videos):
    """Real servers, real clients: each epoch every sample once; two servers send byte-identical packs (random
    frames come from seed, epoch and key, not from the process); the next epoch draws other frames."""
    import torch

    from packfeed.client import LocalServer, PackStream
    from packfeed.client.model.hf import to_hf_inputs

    index, _, _ = internvl_videos

    def epochs(target: str) -> dict[tuple[int, int], list]:
        received = {}
        for rank in range(2):
            with PackStream(target, job="video", rank=rank, dp=2, microbatches=2, seed=5, epochs=2) as stream:
                for step in stream:
                    for pack in step.packs:
                        received.setdefault((step.epoch, rank), []).append(
                            (pack.sample_keys, {name: t.clone() for name, t in pack.tensors.items()}))
                        if not pack.empty:
                            to_hf_inputs(pack, "internvl", dp=2, conventions=stream.conventions)
        return received

    with LocalServer(index, workers=2) as one, LocalServer(index, workers=1) as two:
        first, second = epochs(one.target), epochs(two.target)
    for epoch in (0, 1):
        keys = [key for rank in range(2) for keys, _ in first[(epoch, rank)] for key in keys]
        assert sorted(keys) == [f"s{k:05d}" for k in range(12)]
    for position in first:
        for (keys, tensors), (same_keys, same) in zip(first[position], second[position]):
            assert keys == same_keys and all(torch.equal(tensors[n], same[n]) for n in tensors)

    def video_pixels(epoch: int) -> dict[str, bytes]:
        out = {}
        for rank in range(2):
            for keys, tensors in first[(epoch, rank)]:
                kinds, tile_item = tensors["visual_kind"].tolist(), tensors["tile_image"].tolist()
                samples = tensors["image_sample"].tolist()
                shapes = tensors["tile_shapes"].tolist()
                offset = 0
                for (c, h, w), item in zip(shapes, tile_item):
                    if kinds[item] == 1:
                        key = keys[samples[item]]
                        out[key] = out.get(key, b"") + tensors["pixels"][offset:offset + c * h * w].numpy().tobytes()
                    offset += c * h * w
        return out

    zero, one_ = video_pixels(0), video_pixels(1)
    assert zero.keys() == one_.keys() and len(zero) == 9
    assert sum(zero[key] != one_[key] for key in zero) >= 7  # other frames drawn (a short video may repeat)


def test_video_policy_comes_from_the_preset_then_the_file_then_flags(tmp_path):
    from test_conventions import cli_args

    from packfeed.server.index.conventions import video_policy_of

    assert video_policy_of(cli_args()) == VideoSampling().to_dict()
    assert video_policy_of(cli_args("--preset", "internvl3")) == {"fps": 0.0, "min_frames": 1, "max_frames": 16,
                                                                  "sampling": "random"}
    path = tmp_path / "conventions.yaml"
    path.write_text("video_policy: {fps: 1, max_frames: 64}\n")
    assert video_policy_of(cli_args("--preset", "qwen2_vl", "--conventions", str(path), "--min-frames", "8",
                                    "--frame-sampling", "segment")) == {"fps": 1.0, "min_frames": 8, "max_frames": 64,
                                                                        "sampling": "segment"}
    with pytest.raises(ValueError, match="min_frames"):
        video_policy_of(cli_args("--min-frames", "40", "--max-frames", "8"))
    path.write_text("video_policy: {fps: 1, frames_per_clip: 3}\n")
    with pytest.raises(ValueError, match="unknown video policy field"):
        video_policy_of(cli_args("--conventions", str(path)))


def test_packfeed_index_and_info_on_videos_from_the_command_line(tmp_path):
    import json
    import subprocess
    import sys

    from packfeed.media.chat import PRESETS
    from packfeed.server.tools.demo import train_tokenizer

    shard = write_shard(tmp_path / "v.tar", [("a", {"mp4": encode_video("mp4", frames=60, rate=12, width=64,
                                                                                   height=64),
                                                    "json": conversation("<video>\nWhat?", "A bar.")})])
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=400,
                                special_tokens=PRESETS["qwen2vl"].special_tokens)
    cli = [sys.executable, "-m", "packfeed.cli"]
    done = subprocess.run([*cli, "index", str(shard), "--tokenizer", str(tokenizer), "--out",
                           str(tmp_path / "index.parquet"), "--preset", "qwen2_vl", "--video-fps", "1",
                           "--max-frames", "4", "--video-min-pixels", "3136", "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    row = read_index(tmp_path / "index.parquet")[0].to_pylist()[0]
    assert row["valid"] and row["video_sampled"] == [4]  # 5 s at 1 fps, at most 4
    assert row["vision_tokens"] == 2 * 4  # 2 temporal patches of 56x56 px frames: 2 x 2 merged tokens each
    shown = subprocess.run([*cli, "info", str(tmp_path / "index.parquet"), "--json"], capture_output=True, text=True,
                           timeout=60)
    info = json.loads(shown.stdout)
    assert info["conventions"]["video_policy"] == {"fps": 1.0, "min_frames": 4, "max_frames": 4, "sampling": "uniform"}
    assert info["distributions"]["videos_per_sample"]["max"] == 1
    report = tmp_path / "report"
    done = subprocess.run([*cli, "stats", "--index", str(tmp_path / "index.parquet"), "--out", str(report)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((report / "report.json").read_text())["distributions"]["videos_per_sample"]["mean"] == 1
    assert (report / "videos_per_sample.png").stat().st_size > 1000


def test_packfeed_convert_takes_videos_from_llava_and_sharegpt_annotations(tmp_path):
    import json
    import subprocess
    import sys
    import tarfile

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(encode_video("mp4", frames=24, rate=12, width=64, height=64))
    (tmp_path / "clips" / "b.webm").write_bytes(encode_video("webm", frames=24, rate=12, width=64, height=64))
    (tmp_path / "clips" / "broken.mkv").write_bytes(b"\x1aE\xdf\xa3" + bytes(300))
    (tmp_path / "clips" / "c.gif").write_bytes(encode_video("mkv", frames=24, rate=12, width=64, height=64))
    ask = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A bar."}]
    rows = [{"id": "a", "video": "clips/a.mp4", "conversations": ask},
            {"id": "b", "videos": ["clips/b.webm"], "conversations": ask},
            {"id": "missing", "video": "clips/none.mp4", "conversations": ask},
            {"id": "broken", "video": "clips/broken.mkv", "conversations": ask},
            {"id": "no-video", "conversations": ask},
            {"id": "odd-name", "video": "clips/c.gif", "conversations": ask}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    chat = [{"id": "m", "videos": ["clips/a.mp4"], "messages": [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "A bar."}]}]
    (tmp_path / "chat.json").write_text(json.dumps(chat))
    cli = [sys.executable, "-m", "packfeed.cli", "convert"]
    for source, out in (("llava", "data.json"), ("sharegpt", "chat.json")):
        done = subprocess.run([*cli, source, str(tmp_path / out), "--out", str(tmp_path / source), "--image-root",
                               str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 3), done.stderr
    report = json.loads((tmp_path / "llava" / "convert-report.json").read_text())
    reasons = {row["id"]: row["reason"] for row in report["rejected_rows"]}
    assert reasons["missing"] == "missing video: clips/none.mp4"
    assert reasons["broken"].startswith("undecodable video") and "broken.mkv" in reasons["broken"]
    assert reasons["no-video"].startswith("bad conversation: video tag mismatch: 1 <video> tags for 0 videos")
    assert reasons["odd-name"].startswith("unsupported video: clips/c.gif")
    members = {}
    for name in ("llava", "sharegpt"):
        for shard in (tmp_path / name).glob("shard-*.tar"):
            with tarfile.open(shard) as tar:
                members.update({m.name: tar.extractfile(m).read() for m in tar})
    assert members["a.mp4"] == (tmp_path / "clips" / "a.mp4").read_bytes() and "b.webm" in members
    assert json.loads(members["m.json"])["conversations"][0]["value"] == "<video>\nWhat moves?"


def test_packfeed_convert_reads_a_large_video_in_blocks_never_whole(tmp_path):
    """A 1 GiB file named .mp4 (junk: a sparse file of zeros) beside a real clip: convert refuses the junk
    with its reason and copies the real one, and its processes never hold either file whole (the peak resident
    memory of convert's process tree stays far below 1 GiB; read whole, it was 1.12 GB)."""
    import json
    import subprocess
    import sys
    import tarfile

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "real.mp4").write_bytes(encode_video("mp4", frames=24, rate=12, width=64, height=64))
    with open(tmp_path / "clips" / "junk.mp4", "wb") as junk:
        junk.truncate(1 << 30)
    ask = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A bar."}]
    rows = [{"id": "junk", "video": "clips/junk.mp4", "conversations": ask},
            {"id": "real", "video": "clips/real.mp4", "conversations": ask}]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    convert = [sys.executable, "-m", "packfeed.cli", "convert", "llava", str(tmp_path / "data.json"), "--out",
               str(tmp_path / "out"), "--image-root", str(tmp_path), "--workers", "2", "--quiet"]
    # a fresh parent, so the peak is convert's tree's alone (RUSAGE_CHILDREN: the largest descendant waited for)
    measure = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
               "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss >> 10)")
    done = subprocess.run([sys.executable, "-c", measure, *convert], capture_output=True, text=True, timeout=300)
    code, peak_mib = map(int, done.stdout.split()[-2:])
    assert code == 3, done.stderr
    report = json.loads((tmp_path / "out" / "convert-report.json").read_text())
    assert [row["id"] for row in report["rejected_rows"]] == ["junk"]
    assert report["rejected_rows"][0]["reason"].startswith("undecodable video")
    (shard,) = (tmp_path / "out").glob("shard-*.tar")
    with tarfile.open(shard) as tar:
        assert tar.extractfile("real.mp4").read() == (tmp_path / "clips" / "real.mp4").read_bytes()
    print(f"convert peak resident: {peak_mib} MiB")
    assert peak_mib < 700, peak_mib


def test_fast_pixels_keep_video_frames_within_the_fast_bound(tmp_path):
    """Frames enlarged (160x96 to InternVL's 224 px tile, and Qwen's video minimum) go through OpenCV in fast mode:
    within the fast path's 1/255 mean error of exact, and not identical to it (the fast path did run)."""
    pytest.importorskip("cv2")
    internvl = ("internvl", {**INTERNVL[1], "image_size": 224, "tokens_per_tile": 64}, INTERNVL[2])
    qwen = ("qwen2vl", {**QWEN[1], "video_min_pixels": 128 * 28 * 28, "video_max_pixels": 768 * 28 * 28}, QWEN[2])
    for name, conventions in (("internvl", internvl), ("qwen", qwen)):
        index, tokenizer, _ = indexed_videos(tmp_path / name, *conventions, samples=6)
        rows = IndexRows(index)
        exact, fast = (SampleReader(rows.info, tokenizer, pixels=mode) for mode in ("exact", "fast"))
        compared = differ = 0
        for k in range(rows.table.num_rows):
            row = rows.row(k)
            if not row["n_videos"]:
                continue
            for a, b in zip(exact.load(row, 1, 0).tiles, fast.load(row, 1, 0).tiles):
                assert a.shape == b.shape
                error = np.abs(a.astype(int) - b.astype(int)).mean()
                assert error <= 1.0, (name, error)  # 1/255, the fast path's bound
                compared, differ = compared + 1, differ + (error > 0)
        assert compared >= 10 and differ > 0, (name, compared, differ)


def test_memory_estimates_count_every_sampled_frame(qwen_videos):
    """A Qwen video item carries twice the frames its ViT patches count (2 frames per temporal patch): the budget's
    reservation comes from the index's pixel bytes, so it matches what the workers make."""
    from packfeed.server.index.table import read_index_info
    from test_memory_budget import estimate_ratios

    index, tokenizer, _ = qwen_videos
    ratios = estimate_ratios(index, tokenizer, microbatches=1)
    assert ratios and 0.9 < min(ratios) and max(ratios) < 1.15, ratios
    assert read_index_info(index).video_policy == QWEN[2] | {"sampling": "uniform"}


def test_timestamps_need_frames_known_when_indexing(tmp_path):
    from packfeed.media.chat import ChatTemplate
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.tools.demo import train_tokenizer

    template = ChatTemplate.from_dict({"preset": "qwen2vl", "video_timestamps": "<{:.1f} seconds>"})
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=300, special_tokens=template.special_tokens)
    with pytest.raises(ValueError, match="not random"):
        IndexConfig(str(tokenizer), QWEN[1], template.to_dict(), {"sampling": "random"})
    assert IndexConfig(str(tokenizer), QWEN[1], template.to_dict(), {"sampling": "segment"}).video_policy
    with pytest.raises(ValueError, match="must format one number"):
        ChatTemplate.from_dict({"preset": "qwen2vl", "video_timestamps": "<{1} seconds>"})
    with pytest.raises(ValueError, match="needs a video_context token"):
        ChatTemplate.from_dict({"preset": "internvl", "video_timestamps": "<{:.1f} s>"})


def test_timestamped_videos_render_as_the_reference_and_old_indexes_as_they_were_built(tmp_path):
    """Qwen3-VL's reference writes each temporal patch as <t seconds><|vision_start|>pads<|vision_end|> with no
    outer pair; wrap_video adds the pair transformers 5.19-5.24 left, and a template an index recorded whole before
    the field existed reads back wrapped, so that its recorded lengths still hold. A config section is not a record."""
    from packfeed.media.chat import ChatEncoder, ChatTemplate, load_tokenizer
    from packfeed.server.tools.demo import train_tokenizer

    template = ChatTemplate.from_dict({"preset": "qwen2vl", "video_timestamps": "<{:.1f} seconds>"})
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", vocab_size=300, special_tokens=template.special_tokens)
    loaded = load_tokenizer(tokenizer, template)
    turns = [{"role": "user", "value": "<video>"}]

    def vision_marks(encoder_template):
        ids, _, starts = ChatEncoder(loaded, encoder_template).encode(turns, [], [[2, 3]], [[0.5, 1.5]])
        names = [loaded.id_to_token(int(i)) for i in ids]
        return [n for n in names if n.startswith("<|vision")], [names[s - 1] for s in starts]

    marks, before_runs = vision_marks(template)
    assert marks == ["<|vision_start|>", "<|vision_end|>"] * 2 and before_runs == ["<|vision_start|>"] * 2
    wrapped = ChatTemplate.from_dict({**template.to_dict(), "wrap_video": True})
    assert vision_marks(wrapped)[0] == ["<|vision_start|>"] * 2 + ["<|vision_end|>", "<|vision_start|>"] + \
        ["<|vision_end|>"] * 2
    recorded_before = {k: v for k, v in template.to_dict().items() if k != "wrap_video"}
    assert ChatTemplate.from_dict(recorded_before).wrap_video is True
    assert ChatTemplate.from_dict({"preset": "qwen2vl", "video_timestamps": "<{:.1f} seconds>"}).wrap_video is False
    with pytest.raises(ValueError, match="wrap_video must be true or false"):
        ChatTemplate.from_dict({"preset": "qwen2vl", "wrap_video": "yes"})


def test_frames_are_decoded_and_resized_one_at_a_time(qwen_videos):
    """A worker holds one decoded frame, not a video's every sampled frame: frames come from a generator, and the
    decode budget counts one frame's pixels (the resized tiles count in the pack's estimate)."""
    import inspect

    index, _, _ = qwen_videos
    rows = IndexRows(index)
    data = encode_video("mkv", frames=24, rate=12, width=64, height=48)
    frames = read_frames(data, probe_video(data), np.array([0, 5, 11]))
    assert inspect.isgenerator(frames) and next(frames).shape == (48, 64, 3)
    frames.close()
    each = [rows.largest_image_pixels([sample]) for sample in range(7)]
    assert each == [320 * 240, 160 * 96, 160 * 96, 160 * 96, 160 * 96, 0, 320 * 240]
    assert rows.largest_image_pixels(np.arange(1, 6)) == 160 * 96


def test_the_planner_knows_which_towers_each_sample_calls(qwen_videos):
    """Collective-safe plans read, per sample, whether it calls the image tower and the video tower: a frame
    sequence is a video, not images; text only calls neither. In memory and memory-mapped alike."""
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.mapped_loads import map_sample_loads

    rows = read_index(qwen_videos[0])[0].to_pylist()
    expected = {0: 1, 1: 2, 2: 2, 3: 2, 4: 2, 5: 0, 6: 3}  # mixed_samples' kinds: image, videos, frames, text, both
    towers = load_sample_loads(qwen_videos[0])[0].towers
    mapped = map_sample_loads(qwen_videos[0])[0]
    for row in rows:
        kind = int(row["key"][1:]) % 7
        assert towers[row["sample_id"]] == expected[kind], row["key"]
    assert np.array_equal(mapped.towers[np.arange(len(rows))], towers)
