"""Serve-time pre-processing: one indexed sample -> token ids, labels and image tiles.

A sample is read by the byte offsets the index recorded (no streaming of its shard), decoded, resized or
tiled by the index's image policy, and tokenised with the same chat template the index counted with, so
its token and tile counts match the plan. Pixels stay uint8 (C, H, W), RGB: four times smaller than
float32 on the wire, and normalisation is one fused op on the GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from packfeed.media.chat import ChatTemplate, cached_encoder, visual_items
from packfeed.media.conversation import ConversationError, attach_images, parse_conversation
from packfeed.media.image_policy import policy_from_dict
from packfeed.media.pixel_modes import PIXEL_PATHS, parse_pixels
from packfeed.media.pixels import Geometry, ImageSizeMismatch
from packfeed.media.samples import describe_error
from packfeed.media.video import VideoError, VideoInfo, VideoSampling, read_frames, video_placeholders
from packfeed.server.index.table import IndexInfo
from packfeed.server.serve.shard_reader import SampleSkipped, ShardReader
from packfeed.v1.options import PixelMode, VisualKind


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
    kinds: list[int] = field(default_factory=list)  # per item: VisualKind (VIDEO: a video or one of its frames)
    frame_seconds: list[float] = field(default_factory=list)  # per item: seconds between its frames (0: an image)
    # a live job's sample (`packfeed.server.serve.live_source`): its per-token tensors, group and policy version
    token_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    group: str = ""
    policy_version: int | None = None  # None: not a live sample
    token_versions: np.ndarray | None = None  # int64, each token's policy version (None: policy_version's)
    values: dict[str, float] = field(default_factory=dict)  # per-sample values (a reward, ...)


# Bytes the tokenizer holds per token while it encodes a sample (HF tokenizers keeps each token's string and
# offsets: 350 measured on a 3M-token text)
TOKENIZE_BYTES_PER_TOKEN = 400


@dataclass
class VisualItem:
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
    """One indexed sample -> its tensors: its members' bytes (`ShardReader`, verified), its conversation
    tokenised with the index's chat template, its images and videos made tiles by the dataset's pixel mode
    (`packfeed.media.pixel_modes`). Thread-safe."""

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
        self.shards = ShardReader(shard_root, info.objects)
        self.path = PIXEL_PATHS[self.pixels]  # how this dataset's images become tiles

    def prefetch(self, rows: list[dict[str, Any]]) -> None:
        """Read ahead the members of these samples that lie in an object store (`ShardReader.prefetch`)."""
        self.shards.prefetch(rows)

    def load(self, row: dict[str, Any], seed: int = 0, epoch: int = 0, pixels: bool = True,
             own_only: bool = False) -> SampleTensors:
        """Pre-process one index row (as a dict of its columns); `seed` and `epoch` draw a random video policy's
        frames; `pixels` False: its images are not read (no tiles; their placeholders and tile counts as the
        index recorded them: another rank encodes them). `own_only`: a fork of an index of trees without the
        images of the turns it shares (its parent's, in the same pack): its tokens whole, its own images only.
        Raises SampleSkipped with the reason."""
        if not row["valid"]:
            raise SampleSkipped(f"invalid in the index: {row['reason']}")
        need = row["llm_tokens"] * TOKENIZE_BYTES_PER_TOKEN
        if self.decode_budget and need > self.decode_budget:
            raise SampleSkipped(f"over the memory budget: {row['key']}: tokenising its {row['llm_tokens']:,} tokens "
                                f"needs ~{need >> 20:,} MiB, more than the server's memory budget allows one sample "
                                f"({self.decode_budget >> 20:,} MiB); raise memory_budget_mb")
        read = self.shards.reader(row)
        key = row["key"]
        try:
            raw = self.shards.member(read, row["json_offset"], row["json_size"], row["json_checksum"], f"{key}.json")
            turns = attach_images(parse_conversation(raw), row["n_images"], row["n_videos"] or 0)
        except ConversationError as error:
            raise SampleSkipped(f"shard changed: {error}") from None
        images = [] if row["frames_fps"] is not None else [self._image(read, row, k, pixels and not own_only)
                                                            for k in range(row["n_images"])]
        videos = [self._video(read, row, k, seed, epoch) for k in range(row["n_videos"] or 0)]
        input_ids, labels, starts = cached_encoder(self.tokenizer_path, self.template).encode(
            turns, [item.tokens for item in images], [[item.tokens for item in video] for video in videos],
            [[item.time for item in video] for video in videos])
        items = [images[number] if kind == "image" else videos[number].pop(0)
                 for kind, number in visual_items(turns, [len(video) for video in videos])]
        if len(input_ids) != row["llm_tokens"]:
            raise SampleSkipped(f"token count differs: {len(input_ids)} tokens, the index's {row['llm_tokens']}")
        if own_only:  # (a fork holds images only: `index.trajectories`) those past the tokens it shares
            first = int(np.searchsorted(starts, row["fork_tokens"]))
            items, starts = [self._image(read, row, k, pixels) for k in range(first, len(items))], starts[first:]
        return SampleTensors(key, input_ids, labels, [tile for item in items for tile in item.tiles],
                             [item.n_tiles for item in items], [item.tokens for item in items], starts,
                             encoded=[item.encoded for item in items if item.encoded is not None],
                             geometry=[item.geometry for item in items if item.encoded is not None],
                             kinds=[item.kind for item in items], frame_seconds=[item.seconds for item in items])

    def indexed_images(self, row: dict[str, Any], pixels: bool = True) -> list[VisualItem]:
        """The images of an indexed sample (a live sample's prompt), as `load` prepares them."""
        read = self.shards.reader(row)
        return [self._image(read, row, k, pixels) for k in range(row["n_images"])]

    def file_image(self, data: bytes, width: int, height: int, n_images: int, what: str) -> VisualItem:
        """An image file that came with its sample (a live one), tiled by the dataset's image policy."""
        tokens = self.policy.cost(width, height, n_images).llm_tokens
        geometry = self.policy.geometry(width, height, n_images)
        if self.path.sends_files:
            return VisualItem(VisualKind.IMAGE, [], len(geometry.tile_shapes()), tokens, encoded=data,
                              geometry=geometry)
        self._check_decodable(width, height, what)
        tiles = self._tiles(data, geometry, what)
        return VisualItem(VisualKind.IMAGE, tiles, len(tiles), tokens)

    def _image(self, read, row: dict[str, Any], k: int, pixels: bool = True) -> "VisualItem":
        """The k-th image of the sample (its file's bytes and geometry, with pixels: encoded; without `pixels`,
        only its placeholder tokens and tile count)."""
        name, n_images = row["image_names"][k], row["n_images"]
        width, height = row["image_widths"][k], row["image_heights"][k]
        tokens = self.policy.cost(width, height, n_images).llm_tokens
        geometry = self.policy.geometry(width, height, n_images)
        if not pixels:
            return VisualItem(VisualKind.IMAGE, [], len(geometry.tile_shapes()), tokens)
        data = self.shards.member(read, row["image_offsets"][k], row["image_sizes"][k], row["image_checksums"][k],
                            f"{row['key']}.{name}")
        if self.path.sends_files:  # the client decodes, and checks the size against the geometry
            return VisualItem(VisualKind.IMAGE, [], len(geometry.tile_shapes()), tokens, encoded=data, geometry=geometry)
        self._check_decodable(width, height, f"{row['key']}.{name}")
        tiles = self._tiles(data, geometry, f"{row['key']}.{name}")
        return VisualItem(VisualKind.IMAGE, tiles, len(tiles), tokens)

    def _video(self, read, row: dict[str, Any], k: int, seed: int, epoch: int) -> list["VisualItem"]:
        """The k-th video of the sample as its visual items (`video_placeholders`: one holding every sampled frame,
        one per temporal patch with timestamps, or one per frame with frames as images). Only the sampled frames are
        decoded (a container seeks to them)."""
        key, name = row["key"], row["video_names"][k]
        if self.path.sends_files:
            raise SampleSkipped(f"video not servable: {key}.{name}: pixels: encoded sends image files only; serve "
                                "a dataset with videos with pixels: exact or fast")
        info = VideoInfo(row["video_widths"][k], row["video_heights"][k], row["video_frames"][k], row["video_rates"][k])
        sampled = row["video_sampled"][k]
        indices = self.video_sampling.frame_indices(info.frames, sampled, seed, epoch, key)
        geometry = self.policy.frame_geometry(info.width, info.height)
        what = f"{key}.{name}"
        self._check_decodable(info.width, info.height, what)
        if row["frames_fps"] is not None:  # a frame sequence: read only the sampled frames' files
            frames = [self._tiles(self.shards.member(read, row["image_offsets"][i], row["image_sizes"][i],
                                                  row["image_checksums"][i], f"{key}.{row['image_names'][i]}"),
                                     geometry, f"{key}.{row['image_names'][i]}") for i in indices.tolist()]
        else:
            data = self.shards.member(read, row["video_offsets"][k], row["video_sizes"][k], row["video_checksums"][k], what)
            try:  # each frame resized as it comes: one decoded frame held at a time
                frames = [self.path.frame_tiles(frame, geometry, self.empty)
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
            return [VisualItem(VisualKind.VIDEO, patch_tiles, len(patch_tiles), n, seconds=seconds, time=t)
                    for patch_tiles, n, t in zip(patches, tokens, times)]
        if len(tokens) == 1:
            return [VisualItem(VisualKind.VIDEO, tiles, sampled, tokens[0], seconds=seconds)]
        return [VisualItem(VisualKind.VIDEO, frame, len(frame), n, seconds=seconds) for frame, n in zip(frames, tokens)]

    def _check_decodable(self, width: int, height: int, what: str) -> None:
        """Skip, before reading a pixel, an image (or video frame) whose decoding alone needs more memory than the
        server's whole budget: the budget holds whatever the images (decoding is reserved in it per step)."""
        need = width * height * self.path.decode_bytes_per_pixel
        if self.decode_budget and need > self.decode_budget:
            raise SampleSkipped(f"over the memory budget: {what}: decoding {width}x{height} needs ~{need >> 20:,} MiB, "
                                f"more than the server's memory budget allows one sample "
                                f"({self.decode_budget >> 20:,} MiB); raise memory_budget_mb")

    def _tiles(self, data: bytes, geometry: Geometry, what: str) -> list[np.ndarray]:
        try:
            return self.path.file_tiles(data, geometry, self.empty)
        except ImageSizeMismatch as error:
            raise SampleSkipped(f"shard changed: {what} is {error.found}, index says {error.expected}") from None
        except (OSError, SyntaxError, ValueError) as error:
            raise SampleSkipped(f"undecodable image ({what}): {describe_error(error)}") from None

    def close(self) -> None:
        self.shards.close()
