"""Serve-time pre-processing: one indexed sample -> token ids, labels and image tiles.

A sample is read by the byte offsets the index recorded (no streaming of its shard), decoded, resized or
tiled by the index's image policy, and tokenised with the same chat template the index counted with, so
its token and tile counts match the plan. Pixels stay uint8 (C, H, W), RGB: four times smaller than
float32 on the wire, and normalisation is one fused op on the GPU.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from packfeed.media import fast
from packfeed.media.chat import (ChatTemplate, ConversationError, attach_images, cached_encoder,
                                        parse_conversation, visual_items)
from packfeed.media.image_policy import ImagePolicy, policy_from_dict
from packfeed.media.pixels import Geometry, ImageSizeMismatch, cut_tiles, decode_tiles, to_rgb
from packfeed.media.resample import exact_resizer
from packfeed.media.samples import describe_error
from packfeed.media.storage import ObjectError, StampCache, is_object_url, read_range, relocate
from packfeed.media.video import VideoError, VideoInfo, VideoSampling, read_frames, video_placeholders
from packfeed.server.index.shards import is_compressed
from packfeed.server.index.table import IndexInfo, member_checksum
from packfeed.v1.options import PixelMode, VisualKind


class SampleSkipped(Exception):
    """The sample cannot be served any more (shard changed or vanished, image no longer decodes, ...)."""


@dataclass
class SampleTensors:
    key: str
    input_ids: np.ndarray  # int32 (L,)
    labels: np.ndarray  # int32 (L,), -100 outside assistant turns
    tiles: list[np.ndarray]  # uint8 (3, H, W) each, in order
    # Per visual item (an image; a video, or with frames as images each of its frames), in input_ids order:
    tiles_per_image: list[int]
    image_tokens: list[int]  # LLM placeholder tokens
    image_starts: list[int]  # where its placeholder run starts in input_ids
    source: str = ""  # the dataset it comes from (set by the pack builder)
    encoded: list[bytes] = field(default_factory=list)  # pixels: encoded: each image file's bytes (no tiles)
    geometry: list[Geometry] = field(default_factory=list)  # ... and how the client cuts each into tiles
    kinds: list[int] = field(default_factory=list)  # per item: IMAGE, or VIDEO (a video or one of its frames)
    frame_seconds: list[float] = field(default_factory=list)  # per item: seconds between its frames (0: an image)




# How images become tiles. exact: PIL bicubic, pixel for pixel what the Hugging Face / InternVL processors give
# (computed by packfeed.media.resample, which equals Pillow's bicubic byte for byte with under half its CPU).
# fast: within 1/255 mean absolute error and above 40 dB PSNR of exact, for a fraction of its CPU (`fast`:
# simplejpeg and pyspng decode, OpenCV's bicubic where it enlarges, the exact kernels where it
# shrinks; BENCHMARKS.md "Fast-path candidates for resizing (measure and choose)").
# encoded: the image files' own bytes and each one's `Geometry`; the client decodes and cuts them
# (packfeed.client.decode), exactly on its CPU threads or within the fast path's bounds on a GPU.
# Bytes a worker holds for a moment per pixel of an image it decodes, by mode (measured on a 9,400 x 9,400 PNG:
# exact 9.4, fast 3.5): exact keeps Pillow's RGBA-wide image (4), its RGB array (3) and the resized copies;
# fast decodes straight into RGB and shrinks it; encoded decodes nothing on the server.
DECODE_BYTES_PER_PIXEL = {PixelMode.EXACT: 10, PixelMode.FAST: 4, PixelMode.ENCODED: 0}
# Bytes the tokenizer holds per token while it encodes a sample (HF tokenizers keeps each token's string and
# offsets: 350 measured on a 3M-token text)
TOKENIZE_BYTES_PER_TOKEN = 400


def parse_pixels(pixels: str | PixelMode) -> PixelMode:
    """The mode a dataset's `pixels` names; a clear error for an unknown one, or for `fast` without its libraries
    installed (at start, not per image)."""
    mode = PixelMode.parse(pixels, "pixels")
    if mode == PixelMode.FAST:
        fast.check_available()
    return mode


def file_tiles(data: bytes, geometry: Geometry, pixels: PixelMode = PixelMode.EXACT,
               empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one image file as the server makes them in mode `pixels` (exact or fast), each array made by
    `empty(shape, dtype)`. Raises what decode_tiles raises."""
    if pixels == PixelMode.FAST:
        return fast.file_tiles(data, geometry, empty)
    return decode_tiles(data, geometry, exact_resizer, empty=empty)


def pixel_tiles(image: Image.Image | np.ndarray, geometry: Geometry, pixels: PixelMode = PixelMode.EXACT,
                empty: Callable = np.empty) -> list[np.ndarray]:
    """The tiles of one upright RGB image (a Pillow image, or uint8 (H, W, 3): a video frame) in mode `pixels`."""
    if pixels == PixelMode.FAST:
        return fast.tiles(np.asarray(image), geometry, empty)
    return cut_tiles(exact_resizer(image), geometry, empty)


def image_tiles(image: Image.Image, policy: ImagePolicy, n_images: int,
                pixels: PixelMode = PixelMode.EXACT) -> list[np.ndarray]:
    """The pixel tiles the policy makes of one image, uint8 (3, H, W) RGB; `pixels` picks the resampling."""
    image = to_rgb(image)
    return pixel_tiles(image, policy.geometry(image.width, image.height, n_images), pixels)


# Range requests in flight per worker while a pack's samples are read from an object store (1: one at a time).
PREFETCH_THREADS = int(os.environ.get("PACKFEED_RANGE_THREADS", "16"))


def _span(row: dict[str, Any]) -> tuple[int, int]:
    """(start, end) of the bytes holding the sample's members, its JSON, images and videos (together in the tar)."""
    spans = [(row["json_offset"], row["json_size"])] + list(zip(row["image_offsets"], row["image_sizes"]))
    spans += [(offset, size) for offset, size in zip(row["video_offsets"] or [], row["video_sizes"] or []) if size]
    return min(offset for offset, _ in spans), max(offset + size for offset, size in spans)


@dataclass
class _Item:
    """One visual item of a sample while it is prepared."""

    kind: int
    tiles: list[np.ndarray]
    n_tiles: int
    tokens: int
    encoded: bytes | None = None
    geometry: Geometry | None = None
    seconds: float = 0.0  # between a video's sampled frames
    time: float = 0.0  # of a temporal patch, in its video (timestamps)


class SampleReader:
    """Random access to indexed samples. Thread-safe: reads use os.pread on shared descriptors."""

    def __init__(self, info: IndexInfo, tokenizer_path: str | Path, shard_root: str | Path | None = None,
                 pixels: PixelMode = PixelMode.EXACT):
        self.pixels = parse_pixels(pixels)
        self.empty: Callable = np.empty  # makes each tile's array; a worker cuts tiles into the step's shared file
        self.decode_budget = 0  # bytes decoding an image or tokenising a sample may take (0: any); set per step
        if not info.has_shards:
            raise ValueError("this index was imported from length files; it has no shards to serve from")
        digest = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()[:16]
        if info.tokenizer and info.tokenizer.get("sha256") != digest:
            raise ValueError(f"tokenizer {tokenizer_path} differs from the one the index was built with "
                             f"({info.tokenizer.get('path')}); token counts would not match the plan")
        self.policy = policy_from_dict(info.image_policy)
        self.video_sampling = VideoSampling.from_dict(info.video_policy)
        self.template = ChatTemplate.from_dict(info.chat_template)
        self.tokenizer_path = str(tokenizer_path)
        self.shard_root = str(shard_root) if shard_root else None
        self.objects = info.objects or {}  # object-store shards: {url: {size, etag}} as indexed
        self._stamps = StampCache()
        self._prefetched: dict[str, bytes | SampleSkipped] = {}  # key -> its members' span, read ahead
        self._fetchers: ThreadPoolExecutor | None = None
        self._descriptors: dict[str, int] = {}
        self._lock = threading.Lock()

    def prefetch(self, rows: list[dict[str, Any]]) -> None:
        """Read the spans of these samples' members concurrently where they lie in an object store (a range
        request's latency, tens of ms, would otherwise be paid once per sample in turn); `load` takes them."""
        self._prefetched.clear()  # what an earlier pack left (a sample it never loaded) goes
        remote = [row for row in rows if row["valid"] and is_object_url(relocate(row["shard"], self.shard_root))]
        if len(remote) < 2 or PREFETCH_THREADS < 2:
            return
        if self._fetchers is None:
            self._fetchers = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="packfeed-range")

        def fetch(row: dict[str, Any]) -> bytes | SampleSkipped:
            try:
                return self._object_span(row)
            except SampleSkipped as error:
                return error

        self._prefetched.update(zip((row["key"] for row in remote), self._fetchers.map(fetch, remote)))

    def _reader(self, row: dict[str, Any]):
        """read(offset, size) -> bytes for the sample's members: pread on a local shard; on an object, one range
        request for all of them (they lie together in the tar), after checking the object is the one indexed."""
        path = relocate(row["shard"], self.shard_root)
        if not is_object_url(path):
            fd = self._descriptor(path)
            return lambda offset, size: os.pread(fd, size, offset)
        start = _span(row)[0]
        data = self._prefetched.pop(row["key"], None) or self._object_span(row)
        if isinstance(data, SampleSkipped):
            raise data
        return lambda offset, size: data[offset - start:offset - start + size]

    def _object_span(self, row: dict[str, Any]) -> bytes:
        """The bytes from the sample's first member to the end of its last, in one range request, after
        checking that the object is the one indexed."""
        shard = row["shard"]
        path = relocate(shard, self.shard_root)
        self._check_object(shard, path)
        start, end = _span(row)
        try:
            return read_range(path, start, end - start, self._stamps.get(path).etag)
        except ObjectError as error:
            # a read that fails may have met an object changed since its stamp was cached: say so when it is
            self._check_object(shard, path, fresh=True)
            raise SampleSkipped(f"shard unreadable: {error}") from None

    def _check_object(self, shard: str, path: str, fresh: bool = False) -> None:
        """Skip a sample whose object is gone or is not the one indexed (its stamp looked up within the cache's
        TTL, or now with `fresh`)."""
        try:
            current = self._stamps.get(path, fresh)
        except ObjectError as error:
            raise SampleSkipped(f"shard unreadable: {error}") from None
        indexed = self.objects.get(shard)
        if path == shard and indexed and (current.size, current.etag) != (indexed["size"], indexed["etag"]):
            raise SampleSkipped(f"shard changed: {path} is now {current.size} bytes, ETag {current.etag!r} (indexed: "
                                f"{indexed['size']} bytes, ETag {indexed['etag']!r})")

    def _descriptor(self, path: str) -> int:
        """An open descriptor for the shard; a vanished shard raises, a replaced one is reopened. Only regular
        files are opened: a FIFO or device could block the worker forever, a directory cannot be read."""
        try:
            current = os.stat(path)
        except OSError as error:
            raise SampleSkipped(f"shard unreadable: {error.strerror} ({path})") from None
        with self._lock:
            fd = self._descriptors.get(path)
            if fd is not None and os.fstat(fd).st_ino != current.st_ino:
                os.close(self._descriptors.pop(path))  # replaced on disk: read the new file (checked per member)
                fd = None
            if fd is None:
                if not stat.S_ISREG(current.st_mode):
                    raise SampleSkipped(f"shard unreadable: {path} is not a regular file")
                try:
                    if is_compressed(path):
                        raise SampleSkipped(f"shard unreadable: {path} is compressed: serving needs plain .tar shards")
                    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                except OSError as error:
                    raise SampleSkipped(f"shard unreadable: {error.strerror} ({path})") from None
                self._descriptors[path] = fd
            return fd

    def _member(self, read, offset: int, size: int, checksum: int | None, what: str) -> bytes:
        """A member's bytes, verified against the checksum the index recorded."""
        try:
            data = read(offset, size)
        except OSError as error:
            raise SampleSkipped(f"shard unreadable: {error.strerror} reading {what}") from None
        if len(data) != size:
            raise SampleSkipped(f"shard changed: {what} ends past the end of the file")
        if checksum is not None and member_checksum(data) != checksum:
            raise SampleSkipped(f"shard changed: {what} differs from the indexed content (checksum)")
        return data

    def load(self, row: dict[str, Any], seed: int = 0, epoch: int = 0, pixels: bool = True) -> SampleTensors:
        """Pre-process one index row (as a dict of its columns); `seed` and `epoch` draw a random video policy's
        frames; `pixels` False: its images are not read (no tiles; their placeholders and tile counts as the
        index recorded them: another rank encodes them). Raises SampleSkipped with the reason."""
        if not row["valid"]:
            raise SampleSkipped(f"invalid in the index: {row['reason']}")
        need = row["llm_tokens"] * TOKENIZE_BYTES_PER_TOKEN
        if self.decode_budget and need > self.decode_budget:
            raise SampleSkipped(f"over the memory budget: {row['key']}: tokenising its {row['llm_tokens']:,} tokens "
                                f"needs ~{need >> 20:,} MiB, more than the server's memory budget allows one sample "
                                f"({self.decode_budget >> 20:,} MiB); raise memory_budget_mb")
        read = self._reader(row)
        key = row["key"]
        try:
            raw = self._member(read, row["json_offset"], row["json_size"], row["json_checksum"], f"{key}.json")
            turns = attach_images(parse_conversation(raw), row["n_images"], row["n_videos"] or 0)
        except ConversationError as error:
            raise SampleSkipped(f"shard changed: {error}") from None
        images = [] if row["frames_fps"] is not None else [self._image(read, row, k, pixels)
                                                            for k in range(row["n_images"])]
        videos = [self._video(read, row, k, seed, epoch) for k in range(row["n_videos"] or 0)]
        input_ids, labels, starts = cached_encoder(self.tokenizer_path, self.template).encode(
            turns, [item.tokens for item in images], [[item.tokens for item in video] for video in videos],
            [[item.time for item in video] for video in videos])
        items = [images[number] if kind == "image" else videos[number].pop(0)
                 for kind, number in visual_items(turns, [len(video) for video in videos])]
        if len(input_ids) != row["llm_tokens"]:
            raise SampleSkipped(f"token count differs: {len(input_ids)} tokens, the index's {row['llm_tokens']}")
        return SampleTensors(key, input_ids, labels, [tile for item in items for tile in item.tiles],
                             [item.n_tiles for item in items], [item.tokens for item in items], starts,
                             encoded=[item.encoded for item in items if item.encoded is not None],
                             geometry=[item.geometry for item in items if item.encoded is not None],
                             kinds=[item.kind for item in items], frame_seconds=[item.seconds for item in items])

    def _image(self, read, row: dict[str, Any], k: int, pixels: bool = True) -> "_Item":
        """The k-th image of the sample (its file's bytes and geometry, with pixels: encoded; without `pixels`,
        only its placeholder tokens and tile count)."""
        name, n_images = row["image_names"][k], row["n_images"]
        width, height = row["image_widths"][k], row["image_heights"][k]
        tokens = self.policy.cost(width, height, n_images).llm_tokens
        geometry = self.policy.geometry(width, height, n_images)
        if not pixels:
            return _Item(VisualKind.IMAGE, [], len(geometry.tile_shapes()), tokens)
        data = self._member(read, row["image_offsets"][k], row["image_sizes"][k], row["image_checksums"][k],
                            f"{row['key']}.{name}")
        if self.pixels == PixelMode.ENCODED:  # the client decodes, and checks the size against the geometry
            return _Item(VisualKind.IMAGE, [], len(geometry.tile_shapes()), tokens, encoded=data, geometry=geometry)
        self._check_decodable(width, height, f"{row['key']}.{name}")
        tiles = self._tiles(data, geometry, f"{row['key']}.{name}")
        return _Item(VisualKind.IMAGE, tiles, len(tiles), tokens)

    def _video(self, read, row: dict[str, Any], k: int, seed: int, epoch: int) -> list["_Item"]:
        """The k-th video of the sample as its visual items (`video_placeholders`: one holding every sampled frame,
        one per temporal patch with timestamps, or one per frame with frames as images). Only the sampled frames are
        decoded (a container seeks to them)."""
        key, name = row["key"], row["video_names"][k]
        if self.pixels == PixelMode.ENCODED:
            raise SampleSkipped(f"video not servable: {key}.{name}: pixels: encoded sends image files only; serve "
                                "a dataset with videos with pixels: exact or fast")
        info = VideoInfo(row["video_widths"][k], row["video_heights"][k], row["video_frames"][k], row["video_rates"][k])
        sampled = row["video_sampled"][k]
        indices = self.video_sampling.frame_indices(info.frames, sampled, seed, epoch, key)
        geometry = self.policy.frame_geometry(info.width, info.height)
        what = f"{key}.{name}"
        self._check_decodable(info.width, info.height, what)
        if row["frames_fps"] is not None:  # a frame sequence: read only the sampled frames' files
            frames = [self._tiles(self._member(read, row["image_offsets"][i], row["image_sizes"][i],
                                                  row["image_checksums"][i], f"{key}.{row['image_names'][i]}"),
                                     geometry, f"{key}.{row['image_names'][i]}") for i in indices.tolist()]
        else:
            data = self._member(read, row["video_offsets"][k], row["video_sizes"][k], row["video_checksums"][k], what)
            try:  # each frame resized as it comes: one decoded frame held at a time
                frames = [pixel_tiles(frame, geometry, self.pixels, self.empty)
                          for frame in read_frames(data, info, indices)]
            except VideoError as error:
                raise SampleSkipped(f"{error} ({what})") from None
        cost = self.policy.video_cost(info.width, info.height, sampled)
        seconds = info.seconds / sampled
        tokens, times = video_placeholders(self.template, self.video_sampling, self.policy, info, sampled, cost)
        tiles = [tile for frame in frames for tile in frame]
        if times:  # one item per temporal patch (its last may hold fewer frames: the client fills it up)
            patch = self.policy.temporal_patch
            patches = [tiles[start:start + patch] for start in range(0, len(tiles), patch)]
            return [_Item(VisualKind.VIDEO, patch_tiles, len(patch_tiles), n, seconds=seconds, time=t)
                    for patch_tiles, n, t in zip(patches, tokens, times)]
        if len(tokens) == 1:
            return [_Item(VisualKind.VIDEO, tiles, sampled, tokens[0], seconds=seconds)]
        return [_Item(VisualKind.VIDEO, frame, len(frame), n, seconds=seconds) for frame, n in zip(frames, tokens)]

    def _check_decodable(self, width: int, height: int, what: str) -> None:
        """Skip, before reading a pixel, an image (or video frame) whose decoding alone needs more memory than the
        server's whole budget: the budget holds whatever the images (decoding is reserved in it per step)."""
        need = width * height * DECODE_BYTES_PER_PIXEL[self.pixels]
        if self.decode_budget and need > self.decode_budget:
            raise SampleSkipped(f"over the memory budget: {what}: decoding {width}x{height} needs ~{need >> 20:,} MiB, "
                                f"more than the server's memory budget allows one sample "
                                f"({self.decode_budget >> 20:,} MiB); raise memory_budget_mb")

    def _tiles(self, data: bytes, geometry: Geometry, what: str) -> list[np.ndarray]:
        try:
            return file_tiles(data, geometry, self.pixels, self.empty)
        except ImageSizeMismatch as error:
            raise SampleSkipped(f"shard changed: {what} is {error.found}, index says {error.expected}") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise SampleSkipped(f"undecodable image ({what}): {describe_error(error)}") from None

    def close(self) -> None:
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False)
        with self._lock:
            for fd in self._descriptors.values():
                os.close(fd)
            self._descriptors.clear()
