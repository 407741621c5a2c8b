"""Assembling a pack: the samples of one microbatch of one rank, concatenated without padding.

LLM side: `input_ids`, `labels`, `position_ids` (restarting at 0 in every sample) and `cu_seqlens` (sample
boundaries, for variable-length attention, so samples never attend to each other). Vision side: every tile
of every image as one flat uint8 buffer with per-tile (C, H, W) shapes, the tile -> image and image ->
sample maps, and each image's placeholder span in `input_ids`, where the projected vision features go.
Tensors travel as raw little-endian bytes + dtype + shape (`packfeed.server.serve.wire`), never as repeated numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packfeed.media.chat import IGNORE_INDEX
from packfeed.media.pixels import GEOMETRY_COLUMNS
from packfeed.server.serve.preprocess import IMAGE, SampleTensors


@dataclass(frozen=True)
class Chunks:
    """A 1-D tensor kept as the arrays it is made of, in order: a pack's pixels, each tile as cut. The wire writes
    them one after another into the step's shared file (`packfeed.server.serve.wire`), so the pixels are never
    joined into one array on the way. `np.asarray` joins them (for readers that want one array)."""

    arrays: tuple[np.ndarray, ...]
    dtype: np.dtype

    def __len__(self) -> int:
        return sum(array.size for array in self.arrays)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = np.concatenate([array.reshape(-1) for array in self.arrays]) if self.arrays \
            else np.zeros(0, self.dtype)
        return joined if dtype is None else joined.astype(dtype)


@dataclass
class Pack:
    epoch: int
    step: int
    rank: int
    microbatch: int
    sample_keys: list[str]
    tensors: dict[str, np.ndarray | Chunks]
    loss_tokens: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) of samples left out
    step_loss_tokens: int = 0  # filled in once every pack of the step is known
    sample_sources: list[str] = field(default_factory=list)  # the dataset of each sample (mixtures mix them)

    @property
    def empty(self) -> bool:
        return not self.sample_keys


def assemble_pack(samples: list[SampleTensors], epoch: int, step: int, rank: int, microbatch: int,
                  skipped: list[tuple[str, str]] | None = None) -> Pack:
    lengths = [len(s.input_ids) for s in samples]
    cu_seqlens = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    input_ids = np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int32)
    labels = np.concatenate([s.labels for s in samples]) if samples else np.zeros(0, np.int32)
    position_ids = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if samples \
        else np.zeros(0, np.int32)

    tiles = [tile for s in samples for tile in s.tiles]
    geometry = [g for s in samples for g in s.geometry]
    shapes = [t.shape for t in tiles] or [shape for g in geometry for shape in g.tile_shapes()]
    tile_shapes = np.array(shapes, dtype=np.int32).reshape(-1, 3)
    pixels = Chunks(tuple(tiles), np.dtype(np.uint8))
    tile_image, image_sample, spans = [], [], []
    image_no = 0
    for k, sample in enumerate(samples):
        for n_tiles, n_tokens, start in zip(sample.tiles_per_image, sample.image_tokens, sample.image_starts):
            tile_image.extend([image_no] * n_tiles)
            image_sample.append(k)
            spans.append((int(cu_seqlens[k]) + start, n_tokens))
            image_no += 1
    tensors = {
        "input_ids": input_ids.astype(np.int32),
        "labels": labels.astype(np.int32),
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "pixels": pixels,
        "tile_shapes": tile_shapes,
        "tile_image": np.asarray(tile_image, dtype=np.int32),
        "image_sample": np.asarray(image_sample, dtype=np.int32),
        "image_token_spans": np.asarray(spans, dtype=np.int32).reshape(-1, 2),
        "visual_kind": np.asarray([kind for s in samples for kind in s.kinds], dtype=np.int32),
        "frame_seconds": np.asarray([seconds for s in samples for seconds in s.frame_seconds], dtype=np.float32),
    }
    if geometry:  # pixels: encoded: the client decodes these into `pixels` (packfeed.client.decode)
        files = [data for s in samples for data in s.encoded]
        tensors["encoded"] = np.frombuffer(b"".join(files), dtype=np.uint8)
        tensors["encoded_sizes"] = np.array([len(data) for data in files], dtype=np.int64)
        tensors["image_geometry"] = np.array([g.row() for g in geometry], dtype=np.int32).reshape(-1, GEOMETRY_COLUMNS)
    return Pack(epoch, step, rank, microbatch, [s.key for s in samples], tensors,
                int((labels != IGNORE_INDEX).sum()), list(skipped or []), sample_sources=[s.source for s in samples])


def truncate_sample(sample: SampleTensors, limit: int) -> SampleTensors:
    """The sample cut to at most `limit` tokens (the `truncate` oversize policy). An image whose placeholder
    run would be cut is dropped with everything after it, so every image kept has all its tokens."""
    if len(sample.input_ids) <= limit:
        return sample
    keep_images = 0
    for start, n_tokens in zip(sample.image_starts, sample.image_tokens):
        if start + n_tokens > limit:
            limit = min(limit, start)
            break
        keep_images += 1
    n_tiles = sum(sample.tiles_per_image[:keep_images])
    n_encoded = sum(kind == IMAGE for kind in sample.kinds[:keep_images]) if sample.encoded else 0
    return SampleTensors(sample.key, sample.input_ids[:limit], sample.labels[:limit], sample.tiles[:n_tiles],
                         sample.tiles_per_image[:keep_images], sample.image_tokens[:keep_images],
                         sample.image_starts[:keep_images], sample.source, sample.encoded[:n_encoded],
                         sample.geometry[:n_encoded], sample.kinds[:keep_images], sample.frame_seconds[:keep_images])


def _mapped_columns(index: Path, fingerprint: str) -> pa.Table:
    """SERVE_COLUMNS of the index, memory-mapped from their Arrow file (made first when missing)."""
    from packfeed.server.index.table import read_index

    mapped = index.with_name(f"{index.stem}.{fingerprint[:16]}.serve.arrow")
    if not mapped.exists():
        table = read_index(index, columns=SERVE_COLUMNS)[0].combine_chunks()
        partial = mapped.with_name(f"{mapped.name}.{os.getpid()}.partial")
        try:
            with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=1 << 20)
            os.replace(partial, mapped)
        except OSError:  # a read-only folder: keep the columns in memory
            partial.unlink(missing_ok=True)
            return table
    return pa.ipc.open_file(pa.memory_map(str(mapped))).read_all()  # chunks of 1M rows, left as they lie


SERVE_COLUMNS = ["key", "shard", "valid", "reason", "json_offset", "json_size", "json_checksum", "image_names",
                 "image_offsets", "image_sizes", "image_checksums", "image_widths", "image_heights", "n_images",
                 "llm_tokens", "loss_tokens", "n_videos", "video_names", "video_offsets", "video_sizes",
                 "video_checksums", "video_widths", "video_heights", "video_frames", "video_rates", "video_sampled",
                 "frames_fps", "pixel_bytes"]


class IndexRows:
    """The index columns serving needs, as Arrow columns; rows come out as dicts.

    They are read from an uncompressed Arrow file beside the index (`INDEX.<fingerprint>.serve.arrow`, written
    once by whichever process needs it first), memory-mapped: the server and every worker share one copy in the
    page cache instead of each decompressing the Parquet columns into memory of its own. Where the index's
    folder is not writable, the columns are read into memory as before."""

    def __init__(self, index_path):
        from packfeed.server.index.table import read_index_info

        self.info = read_index_info(index_path)
        self.table = _mapped_columns(Path(index_path), self.info.fingerprint)

    def row(self, sample_id: int) -> dict:
        return self.table.slice(int(sample_id), 1).to_pylist()[0]

    def _take(self, name: str, sample_ids) -> pa.Array:
        """Column `name` at `sample_ids`, read from the mapped file: per step, never a whole column in memory
        (a per-sample array in each process would be 4-8 bytes a sample, 400-800 MB at 100M samples)."""
        return self.table.column(name).take(pa.array(np.asarray(sample_ids, dtype=np.int64)))

    def largest_image_pixels(self, sample_ids) -> int:
        """The most pixels a worker holds decoded at once for any of `sample_ids`: width x height of their largest
        image or video frame (frames are decoded and resized one at a time); 0 for text only."""
        return max(self._largest("image_widths", "image_heights", sample_ids),
                   self._largest("video_widths", "video_heights", sample_ids))

    def _largest(self, widths_name: str, heights_name: str, sample_ids) -> int:
        widths, heights = (pc.list_flatten(self._take(name, sample_ids)) for name in (widths_name, heights_name))
        if not len(widths):
            return 0
        return int(pc.max(pc.multiply(pc.cast(widths, pa.int64()), pc.cast(heights, pa.int64()))).as_py() or 0)

    def samples_with_videos(self) -> int:
        """How many samples of the index hold a video."""
        return int(pc.sum(pc.greater(self.table.column("n_videos"), 0)).as_py() or 0)

    def pixel_bytes(self, sample_ids) -> int:
        """uint8 bytes of the tiles of `sample_ids` together, as the index computed them."""
        return int(pc.sum(self._take("pixel_bytes", sample_ids)).as_py() or 0)

    def loss_tokens(self, sample_ids) -> int:
        """Loss tokens of `sample_ids` together."""
        return int(pc.sum(self._take("loss_tokens", sample_ids)).as_py() or 0)


def build_pack(parts: list[tuple[IndexRows, Any, str]], members: np.ndarray, truncate_to: np.ndarray,
               sources: np.ndarray, epoch: int, step: int, rank: int, microbatch: int, seed: int = 0) -> Pack:
    """One pack from its planned members; member k is sample `members[k]` of `parts[sources[k]]` (rows, reader,
    dataset label); `seed` is the job's (random video frames are drawn from it). A sample that fails at serve
    time is left out and reported in the pack's `skipped`; the pack still goes out, flagged empty if nothing is
    left."""
    loaded, skipped = load_members(parts, members, truncate_to, sources, epoch, seed)
    return assemble_pack([sample for _, sample in loaded], epoch, step, rank, microbatch, skipped)


def load_members(parts: list[tuple[IndexRows, Any, str]], members: np.ndarray, truncate_to: np.ndarray,
                 sources: np.ndarray, epoch: int, seed: int = 0, pixels: np.ndarray | None = None
                 ) -> tuple[list[tuple[int, SampleTensors]], list[tuple[str, str]]]:
    """(position, sample) of every member that loads, and (key, reason) of those that do not. `pixels`: per
    member, whether to read its images (False: text and placeholder counts only); all when None."""
    from packfeed.server.serve.preprocess import SampleSkipped

    loaded, skipped = [], []
    with_pixels = np.ones(len(members), dtype=bool) if pixels is None else np.asarray(pixels, dtype=bool)
    chosen = [(parts[source], parts[source][0].row(sample_id), limit) for sample_id, limit, source in
              zip(members.tolist(), np.asarray(truncate_to).tolist(), np.asarray(sources).tolist())]
    for part in {id(part): part for part, _, _ in chosen}.values():  # object stores: all ranges at once
        part[1].prefetch([row for (other, row, _), read in zip(chosen, with_pixels) if other is part and read])
    for position, ((_, reader, label), row, limit) in enumerate(chosen):
        try:
            sample = replace(reader.load(row, seed, epoch, pixels=bool(with_pixels[position])), source=label)
        except SampleSkipped as error:
            skipped.append((row["key"], str(error)))
            continue
        loaded.append((position, truncate_sample(sample, limit) if limit > 0 else sample))
    return loaded, skipped


def build_rank_step(plan, rows: IndexRows, reader, step: int, rank: int) -> list[Pack]:
    """The rank's M packs of one step, in the plan's (1F1B) order.

    `step_loss_tokens` counts the planned loss tokens of the whole global step (from the index, which used
    the same encoder), so every rank normalises by the same number without seeing the others' packs.
    """
    config = plan.config
    packs = []
    step_loss = rows.loss_tokens(plan.step_members(step))
    for microbatch in range(config.microbatches):
        members, truncate_to = plan.pack_with_truncation(step, rank, microbatch)
        pack = build_pack([(rows, reader, "")], members, truncate_to, np.zeros(len(members), np.int32), plan.epoch,
                          step, rank, microbatch, plan.seed)
        pack.step_loss_tokens = step_loss
        packs.append(pack)
    return packs
