"""Video samples: which frames of a video a sample uses, and what the container says about it.

A video reaches the model as a few frames sampled from it. How many is fixed when the index is built (from the
container's frame count and frame rate), so a video's cost is known to the planner; which ones may be random,
and is then a pure function of (seed, epoch, sample key), so every server samples the same frames and a resumed
job the frames it would have. The policy (`VideoSampling`) is recorded in the index beside the image policy.

Frames are numbered by their presentation time (time x average frame rate), which is exact for constant frame
rate video and close for variable. Rotation metadata (a phone video's display matrix) is not applied: frames are
used as they are stored.

Two forms of video are indexed: a container member (`KEY.mp4`, `KEY.webm`, `KEY.mkv`, `KEY.mov`, `KEY.avi`),
probed with PyAV, and a frame sequence: the sample's numbered images (`KEY.0.jpg`, `KEY.1.jpg`, ...) when its
JSON says `"frames": {"fps": F}` (F frames per second of the original; 1 when left out).
"""

from __future__ import annotations

import bisect
import io
import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Iterator, Literal

import numpy as np
import xxhash

if TYPE_CHECKING:
    from packfeed.media.chat import ChatTemplate
    from packfeed.media.image_policy import ImageCost, ImagePolicy

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")
SAMPLINGS = ("uniform", "linspace", "segment", "random")


@dataclass(frozen=True)
class VideoSampling:
    """How many frames of a video a sample uses, and which.

    Count, from a video of `total` frames at `rate` frames per second: `fps` frames per second of video (0: always
    `max_frames`), kept within [min_frames, max_frames] and the video's own frames, then rounded down to a
    multiple of the model's temporal patch (2 for Qwen-VL: `multiple`), as the Qwen-VL video processors count.

    Which (`sampling`): uniform: frame floor(k * total / n), as the Hugging Face Qwen2-VL video processor samples;
    linspace: n frames evenly from the first to the last, rounded (the Qwen3-VL video processor); segment: the
    middle frame of each of n equal segments (InternVL's evaluation); random: a random frame within each segment
    (InternVL's training), drawn from (seed, epoch, sample key)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    sampling: Literal["uniform", "linspace", "segment", "random"] = "uniform"

    def __post_init__(self):
        object.__setattr__(self, "fps", float(self.fps))
        if not (math.isfinite(self.fps) and self.fps >= 0):
            raise ValueError(f"video fps must be a number >= 0 (0: always max_frames), not {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames <= 100_000:
            raise ValueError(f"video frames: need 1 <= min_frames ({self.min_frames}) <= max_frames "
                             f"({self.max_frames}) <= 100000")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"video sampling must be one of {', '.join(SAMPLINGS)}, not {self.sampling!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "VideoSampling":
        raw = dict(raw or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown video policy field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**raw)

    @property
    def is_random(self) -> bool:
        return self.sampling == "random"

    def frame_count(self, total: int, rate: float, multiple: int = 1) -> int:
        """Frames sampled from a video of `total` frames at `rate` per second; 0 when it has too few."""
        most = min(self.max_frames, total) // multiple * multiple
        wanted = total / rate * self.fps if self.fps and rate > 0 else self.max_frames
        count = min(max(wanted, self.min_frames), most)
        return int(count // multiple * multiple)

    def frame_indices(self, total: int, count: int, seed: int = 0, epoch: int = 0, key: str = "") -> np.ndarray:
        """Which `count` of the video's `total` frames, ascending (int64; linspace may repeat one when `count` is
        close to `total`, as the Qwen3-VL processor does)."""
        if not 1 <= count <= total:
            raise ValueError(f"cannot sample {count} of {total} frames")
        k = np.arange(count, dtype=np.float64)
        if self.sampling == "uniform":
            return np.floor(k * total / count).astype(np.int64)
        if self.sampling == "linspace":
            return np.linspace(0, total - 1, count).round().astype(np.int64)
        starts = np.floor(k * total / count).astype(np.int64)
        ends = np.maximum(np.floor((k + 1) * total / count).astype(np.int64), starts + 1)
        if self.sampling == "segment":
            return (starts + ends - 1) // 2
        rng = np.random.default_rng([seed, epoch, xxhash.xxh64_intdigest(key.encode())])
        return starts + (rng.random(count) * (ends - starts)).astype(np.int64)


@dataclass(frozen=True)
class VideoInfo:
    """What the container says of its first video stream."""

    width: int
    height: int
    frames: int  # frames in the stream (counted from the duration where the container does not say)
    rate: float  # average frames per second

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


class VideoError(ValueError):
    """A video that cannot be used; the message is the reason (recorded in the index, or a skip's reason)."""


def _open(data: bytes | str):
    """A container over a video's bytes, or over a file by its path (read as it is demuxed, never whole)."""
    try:
        import av
    except ImportError:
        raise VideoError("undecodable video: reading videos needs PyAV: pip install 'packfeed[video]'") from None

    try:
        container = av.open(data if isinstance(data, str) else io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as error:
        raise VideoError(f"undecodable video: {_message(error)}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("undecodable video: no video stream")
    return container


def _message(error: BaseException) -> str:
    return (getattr(error, "strerror", None) or str(error) or type(error).__name__).strip()


def probe_video(data: bytes | str, decode: bool = True) -> VideoInfo:
    """Size, frame count and rate of the first video stream (of its bytes, or of a file by its path). With
    `decode`, its first frame is decoded too, so a stream of garbage behind a good header is caught when
    indexing rather than when serving."""
    container = _open(data)
    import av  # installed: _open has opened the container with it

    try:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        frames = int(stream.frames or 0)
        if not frames and rate:
            duration = (float(stream.duration * stream.time_base) if stream.duration is not None
                        else (container.duration or 0) / av.time_base)
            frames = int(round(duration * rate))
        width, height = stream.codec_context.width, stream.codec_context.height
        if decode:
            first = next(container.decode(stream), None)
            if first is None:
                raise VideoError("undecodable video: no frame decodes")
            width, height = first.width, first.height
    except av.error.FFmpegError as error:
        raise VideoError(f"undecodable video: {_message(error)}") from None
    finally:
        container.close()
    if width < 1 or height < 1 or frames < 1 or rate <= 0:
        raise VideoError(f"undecodable video: {width}x{height} px, {frames} frames at {rate:g} fps")
    return VideoInfo(width, height, frames, rate)


class FrameReader:
    """Decodes chosen frames of one video file. The container's packets are scanned first (no decoding) for its
    keyframes; a frame is then reached by decoding on from where the reader is, unless a keyframe lies between
    the two: then the reader seeks to the keyframe before the frame, skipping whole groups of pictures."""

    def __init__(self, data: bytes, info: VideoInfo):
        self.container = _open(data)
        self.stream = self.container.streams.video[0]
        self.stream.codec_context.thread_count = 1  # one worker is one core (FFmpeg would start a thread per core)
        self.info = info
        base = self.stream.time_base or Fraction(1, 1_000_000)
        self.ticks_per_frame = 1 / (float(base) * info.rate)
        self.start = self.stream.start_time or 0
        self.keyframes = self._keyframes()
        self.position = -1  # index of the last frame decoded
        self._frames = None

    def _keyframes(self) -> list[int]:
        """Frame indices of the keyframes, from the packets alone (ascending; [0] when the container marks none)."""
        found = {self._index_of_pts(packet.pts) for packet in self.container.demux(self.stream)
                 if packet.is_keyframe and packet.pts is not None}
        return sorted(found) or [0]

    def _index_of_pts(self, pts: int) -> int:
        return int(round((pts - self.start) / self.ticks_per_frame))

    def _index_of(self, frame) -> int:
        pts = frame.pts if frame.pts is not None else frame.dts
        return self.position + 1 if pts is None else self._index_of_pts(pts)

    def _must_seek(self, target: int) -> bool:
        if self._frames is None or target <= self.position - 1:
            return True
        keyframe = self.keyframes[max(0, bisect.bisect_right(self.keyframes, target) - 1)]
        return keyframe > self.position + 1  # decoding on would decode a whole group of pictures for nothing

    def frames(self, indices: np.ndarray) -> Iterator[np.ndarray]:
        """uint8 (H, W, 3) RGB of each frame in `indices` (ascending), one at a time: a caller that resizes each
        before taking the next holds one decoded frame, not all of them."""
        import av

        last = None
        try:
            for target in indices.tolist():
                if self._must_seek(target):
                    self.container.seek(self.start + int(target * self.ticks_per_frame), stream=self.stream,
                                        backward=True, any_frame=False)
                    self._frames = self.container.decode(self.stream)
                    self.position = -1
                while self.position < target:
                    frame = next(self._frames, None)
                    if frame is None:
                        break
                    self.position = self._index_of(frame)
                    last = frame
                if last is None or target - self.position > 1:  # the stream ended well before the frame
                    raise VideoError(f"undecodable video: ends at frame {self.position}, before sampled frame "
                                     f"{target} of {self.info.frames}")
                yield last.to_ndarray(format="rgb24")
        except av.error.FFmpegError as error:
            raise VideoError(f"undecodable video: {_message(error)}") from None

    def close(self) -> None:
        self.container.close()


def read_frames(data: bytes, info: VideoInfo, indices: np.ndarray) -> Iterator[np.ndarray]:
    """uint8 (H, W, 3) RGB frames `indices` of a video file, decoded one at a time as they are taken; raises
    VideoError (the reason) when it fails."""
    reader = FrameReader(data, info)
    try:
        for frame in reader.frames(indices):
            if frame.shape[:2] != (info.height, info.width):
                raise VideoError(f"shard changed: a frame is {frame.shape[1]}x{frame.shape[0]} px, the index says "
                                 f"{info.width}x{info.height}")
            yield frame
    finally:
        reader.close()


def patch_times(indices: np.ndarray, rate: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame, the last patch filled up with
    the last frame (the Qwen3-VL processor's timestamps)."""
    padded = list(indices.tolist()) + [int(indices[-1])] * (-len(indices) % temporal_patch)
    return [(padded[i] + padded[i + temporal_patch - 1]) / 2 / rate for i in range(0, len(padded), temporal_patch)]


def video_placeholders(template: ChatTemplate, sampling: VideoSampling, policy: ImagePolicy, info: VideoInfo,
                       frames: int, cost: ImageCost) -> tuple[list[int], list[float]]:
    """A video's placeholder runs (LLM tokens of each visual item) and, with timestamps, each run's seconds: one
    run with a video_context token, one per temporal patch with video_timestamps, one per frame otherwise."""
    if template.video_timestamps:  # needs the frames, so sampling is not random (IndexConfig checks it)
        times = patch_times(sampling.frame_indices(info.frames, frames), info.rate, policy.temporal_patch)
        return [cost.llm_tokens // len(times)] * len(times), times
    if template.video_context:
        return [cost.llm_tokens], []
    return [cost.llm_tokens // frames] * frames, []


def frames_fps(doc: Any) -> float | None:
    """F when a sample's JSON says its numbered images are a video's frames (`"frames": {"fps": F}`), else None."""
    spec = doc.get("frames") if isinstance(doc, dict) else None
    if spec is None:
        return None
    if spec is True:
        return 1.0
    rate = spec.get("fps", 1.0) if isinstance(spec, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise VideoError('invalid json: "frames" must be {"fps": a number > 0} (or true)')
    return float(rate)
