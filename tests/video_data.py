"""Short real videos for tests and benchmarks, encoded by PyAV, and WebDataset shards that mix them with images."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from demo_data import write_shard  # noqa: F401  (the tests write their shards with it)

# container format -> (PyAV muxer, codec)
FORMATS = {"mp4": ("mp4", "libx264"), "webm": ("webm", "libvpx"), "mkv": ("matroska", "libx264")}


def frame_picture(number: int, width: int, height: int) -> np.ndarray:
    """Frame `number` of the test videos: a moving bar and a colour that changes every frame, so frames differ."""
    picture = np.zeros((height, width, 3), np.uint8)
    picture[..., 0] = (number * 7) % 256
    picture[..., 2] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    bar = (number * 5) % max(1, width - 8)
    picture[:, bar:bar + 8, 1] = 230
    return picture


def encode_video(extension: str = "mp4", frames: int = 48, rate: int = 24, width: int = 192, height: int = 128,
                 gop: int = 12) -> bytes:
    """A video file of `frames` frames at `rate` fps, a keyframe every `gop` frames."""
    import av

    muxer, codec = FORMATS[extension]
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", gop
        if codec == "libx264":
            stream.options = {"preset": "ultrafast"}
        for number in range(frames):
            picture = av.VideoFrame.from_ndarray(frame_picture(number, width, height), format="rgb24")
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def all_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of a video, decoded from the start (the reference a seeking reader must equal)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def jpeg(picture: np.ndarray, quality: int = 95) -> bytes:
    out = io.BytesIO()
    Image.fromarray(picture).save(out, "JPEG", quality=quality)
    return out.getvalue()


def conversation(question: str, answer: str, **extra) -> bytes:
    return json.dumps({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
                       **extra}).encode()


MIXED_KINDS = tuple(range(7))  # an image, an mp4, a webm, an mkv, a frame sequence, text only, an image and an mp4


def mixed_samples(n: int, seed: int = 0, image: bytes | None = None,
                  kinds: tuple[int, ...] = MIXED_KINDS) -> list[tuple[str, dict[str, bytes]]]:
    """`n` samples cycling through `kinds` (MIXED_KINDS: an image, an mp4, a webm, an mkv, a frame sequence, text
    only, an image and an mp4). Video lengths vary (1 to 6 seconds), so frame counts and costs differ."""
    rng = np.random.default_rng(seed)
    picture = image or jpeg(frame_picture(3, 320, 240))
    samples = []
    for k in range(n):
        key = f"s{k:05d}"
        seconds = int(rng.integers(1, 7))
        kind = kinds[k % len(kinds)]
        if kind == 0:
            samples.append((key, {"jpg": picture, "json": conversation("<image>\nWhat is shown?", "A test card.")}))
        elif kind in (1, 2, 3):
            extension = ("mp4", "webm", "mkv")[kind - 1]
            video = encode_video(extension, frames=12 * seconds, rate=12, width=160, height=96)
            samples.append((key, {extension: video, "json": conversation("<video>\nWhat moves?", "A green bar.")}))
        elif kind == 4:
            frames = {f"{i}.jpg": jpeg(frame_picture(i, 160, 96)) for i in range(4 * seconds)}
            samples.append((key, {**frames, "json": conversation("<video>\nWhat changes?", "The colour.",
                                                                  frames={"fps": 4})}))
        elif kind == 5:
            samples.append((key, {"json": conversation("Say hi.", "Hi " * int(rng.integers(2, 40)))}))
        else:
            video = encode_video("mp4", frames=12 * seconds, rate=12, width=160, height=96)
            samples.append((key, {"jpg": picture, "mp4": video,
                                  "json": conversation("<image>\nFirst this.\n<video>\nThen?", "A bar moves.")}))
    return samples


def indexed_videos(root: Path, template: str | dict, image_policy: dict, video_policy: dict, samples: int = 12,
                   seed: int = 0, verify: str = "decode", kinds: tuple[int, ...] = MIXED_KINDS):
    """`mixed_samples` in one shard, indexed with these conventions (`template`: a chat template preset's name,
    or a chat_template section). Returns (index, tokenizer, IndexResult)."""
    from packfeed.media.chat import ChatTemplate
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import train_tokenizer

    template = ChatTemplate.from_dict({"preset": template} if isinstance(template, str) else template)
    root.mkdir(parents=True, exist_ok=True)
    shard = write_shard(root / "videos.tar", mixed_samples(samples, seed, kinds=kinds))
    tokenizer = train_tokenizer(root / "tokenizer.json", vocab_size=400, special_tokens=template.special_tokens)
    config = IndexConfig(str(tokenizer), image_policy, template.to_dict(), video_policy, verify_images=verify)
    result = build_index([str(shard)], root / "index.parquet", config, workers=1, progress=False)
    return root / "index.parquet", tokenizer, result
