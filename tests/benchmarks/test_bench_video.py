"""Video frames per second per core, decode + resize: Packfeed's seeking reader (only the sampled
frames decoded, `packfeed.media.video.read_frames`) against decoding every frame in order and keeping the
sampled ones (what a loader without seeking does: torchvision's `read_video`, a plain PyAV loop). Both decode on one
thread and resize with the server's exact path (Pillow bicubic, byte for byte), to InternVL's 448 px frame tile
and to Qwen2-VL's video frame size.

The videos are 20 s of 30 fps H.264 (x264, keyframe every 2 s or every 250 frames, x264's default) and VP9, at
640x360 and 1280x720, and 3 minutes of H.264 at 640x360, showing the scikit-image photographs panned and zoomed
(real texture, real motion).
Sampling as the presets: Qwen-VL 2 frames a second (40), InternVL 16 frames, one at random per segment.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_video.py -m benchmark
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("av")

from packfeed.media.image_policy import InternVLTiling, Qwen2VLResize  # noqa: E402
from packfeed.media.pixels import cut_tiles  # noqa: E402
from packfeed.media.resample import exact_resizer  # noqa: E402
from packfeed.media.video import VideoSampling, probe_video, read_frames  # noqa: E402

pytestmark = pytest.mark.benchmark

SECONDS, RATE = 20, 30


def panned_photographs(width: int, height: int, frames: int):
    """Frames of a slow pan and zoom over a collage of the scikit-image photographs (generated one at a time)."""
    from skimage import data

    tiles = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    collage = np.concatenate([np.asarray(Image.fromarray(t).resize((640, 480))) for t in tiles], axis=1)  # 2560x480
    collage = np.asarray(Image.fromarray(collage).resize((2560 * 2, 960)))
    for k in range(frames):
        zoom = 1 + 0.3 * np.sin(k / frames * np.pi)
        w, h = int(width * zoom), int(height * zoom)
        left = int((collage.shape[1] - w) * k / frames)
        top = int((collage.shape[0] - h) * (0.5 + 0.4 * np.sin(k / 40)))
        window = collage[max(0, top):max(0, top) + h, left:left + w]
        yield np.asarray(Image.fromarray(window).resize((width, height), Image.BILINEAR))


def encode(frames, width: int, height: int, muxer: str, codec: str, gop: int) -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=muxer) as container:
        stream = container.add_stream(codec, rate=RATE)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", gop
        stream.options = {"preset": "veryfast"} if codec == "libx264" else {"deadline": "realtime", "cpu-used": "8"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_everything(data: bytes, indices: np.ndarray) -> list[np.ndarray]:
    """The baseline: every frame decoded in order on one thread, the sampled ones kept."""
    import av

    wanted, kept = set(indices.tolist()), []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for number, frame in enumerate(container.decode(stream)):
            if number in wanted:
                kept.append(frame.to_ndarray(format="rgb24"))
    return kept


def resized(frames: list[np.ndarray], geometry) -> list[np.ndarray]:
    return [tile for frame in frames for tile in cut_tiles(exact_resizer(Image.fromarray(frame)), geometry)]


def cpu_seconds(work, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best


PRESETS = {
    "qwen2_vl": (Qwen2VLResize(), VideoSampling(fps=2.0, min_frames=4, max_frames=768, sampling="uniform")),
    "internvl": (InternVLTiling(), VideoSampling(fps=0, min_frames=1, max_frames=16, sampling="random")),
}


CLIPS = [(640, 360, 20, "mp4 H.264", "mp4", "libx264", 2 * RATE), (640, 360, 20, "mp4 H.264", "mp4", "libx264", 250),
         (640, 360, 20, "webm VP9", "webm", "libvpx-vp9", 2 * RATE),
         (1280, 720, 20, "mp4 H.264", "mp4", "libx264", 2 * RATE), (1280, 720, 20, "mp4 H.264", "mp4", "libx264", 250),
         (1280, 720, 20, "webm VP9", "webm", "libvpx-vp9", 2 * RATE),
         (640, 360, 180, "mp4 H.264", "mp4", "libx264", 2 * RATE)]


def test_video_frames_per_second_per_core():
    print("\n[video] container | size | seconds | GOP | preset | frames | seeking: frames/s/core | decode all: "
          "frames/s/core | speed-up | same frames")
    for width, height, seconds, name, muxer, codec, gop in CLIPS:
        data = encode(panned_photographs(width, height, seconds * RATE), width, height, muxer, codec, gop)
        info = probe_video(data)
        for preset, (policy, sampling) in PRESETS.items():
            count = sampling.frame_count(info.frames, info.rate, policy.temporal_patch)
            indices = sampling.frame_indices(info.frames, count, seed=0, epoch=0, key="bench")
            geometry = policy.frame_geometry(info.width, info.height)
            seeking = resized(read_frames(data, info, indices), geometry)
            baseline = resized(decode_everything(data, indices), geometry)
            same = len(seeking) == len(baseline) and all(np.array_equal(a, b) for a, b in zip(seeking, baseline))
            fast = cpu_seconds(lambda: resized(read_frames(data, info, indices), geometry))
            slow = cpu_seconds(lambda: resized(decode_everything(data, indices), geometry), repeats=1)
            print(f"[video] {name} | {width}x{height} | {seconds} | {gop} | {preset} | {count} | {count / fast:.1f} | "
                  f"{count / slow:.1f} | {slow / fast:.2f}x | {same}")
            assert same


def mixed_loads(real_index, policy: VideoSampling, videos: int, seed: int = 0):
    """The real InternVL-1.2M image samples' loads plus `videos` video samples costed as the indexer costs them
    (InternVL tiles at 448 px: one tile and 256 tokens a frame, plus the `FrameN: ` prompt's tokens). Durations
    are log-normal, median 30 s (2 s to 10 min), at 30 fps; each video's question and answer take the text
    length of a real sample drawn at random."""
    from packfeed.server.plan.costs import SampleLoads, load_sample_loads

    images, _ = load_sample_loads(real_index)
    rng = np.random.default_rng(seed)
    seconds = np.clip(rng.lognormal(np.log(30), 1.0, videos), 2, 600)
    tiling = InternVLTiling()
    frames = np.array([policy.frame_count(int(s * 30), 30.0, tiling.temporal_patch) for s in seconds])
    valid_images = np.flatnonzero(images.valid)
    text = (images.tokens - images.vision * tiling.tokens_per_tile)[rng.choice(valid_images, videos)]
    prompt = 5  # "FrameN: " and the newline between frames, in a Qwen2/InternLM2-size vocabulary
    video_tokens = frames * (tiling.tokens_per_tile + prompt) + np.maximum(text, 8)
    vision = np.concatenate([images.vision, frames]).astype(np.int32)
    tokens = np.concatenate([images.tokens, video_tokens]).astype(np.int32)
    valid = np.concatenate([images.valid, np.ones(videos, bool)])
    return SampleLoads.from_arrays(vision, tokens, valid), frames


def test_balance_on_a_mixed_image_and_video_dataset(real_index):
    from packfeed.server.plan.planner import make_plan
    from packfeed.v1.options import PlanConfig, Strategy

    print("\n[video-balance] videos | frames per video (min/median/max) | strategy | caps | packs | steps | Pad | "
          "ViT Dist | LLM Dist (DP 8, automatic caps; mean over seeds 0-2)")
    for label, policy in (("InternVL preset: 16 frames", PRESETS["internvl"][1]),
                          ("1 fps, 4-32 frames", VideoSampling(fps=1.0, min_frames=4, max_frames=32))):
        for videos in (0, 10_000):
            loads, frames = mixed_loads(real_index, policy, videos)
            spread = (f"{frames.min()}/{int(np.median(frames))}/{frames.max()}" if videos else "-")
            for strategy in Strategy:
                runs = [make_plan(loads, PlanConfig(dp=8, strategy=strategy), seed, 0) for seed in range(3)]
                s = [r.summary(loads) for r in runs]
                mean = {k: sum(x[k] for x in s) / len(s) for k in ("vit_dist", "llm_dist", "pad_ratio")}
                caps = f"{runs[0].caps.vision_cap}/{runs[0].caps.token_cap}" if runs[0].caps else "-"
                print(f"[video-balance] {label} | {videos} | {spread} | {strategy} | {caps} | {s[0]['packs']} | "
                      f"{s[0]['steps']} | {mean['pad_ratio']:.3f} | {mean['vit_dist']:.5f} | {mean['llm_dist']:.5f}")
