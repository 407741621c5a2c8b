"""The sample index: one Parquet row per sample, plus a fingerprint in the file's metadata.

Indexing shards (`packfeed index SHARDS`) and importing OmniBal/InternVL length files
(`packfeed index --from-lengths`) both end here, so the planner and the report read one format.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from packfeed.server import __version__

INDEX_FORMAT_VERSION = 3  # 2: member checksums; 3: videos
METADATA_KEY = b"packfeed.index"

# Columns every index has. Shard-built indexes fill the member/image columns; imported length files leave
# them null because the length files carry no per-member information.
SCHEMA = pa.schema(
    [
        ("sample_id", pa.int64()),
        ("shard", pa.dictionary(pa.int32(), pa.string())),
        ("key", pa.string()),
        ("valid", pa.bool_()),
        ("reason", pa.string()),  # null when valid
        ("json_offset", pa.int64()),  # byte offset of the member's data inside the (uncompressed) tar
        ("json_size", pa.int64()),
        ("json_checksum", pa.uint64()),  # member_checksum of the JSON member's bytes
        ("image_names", pa.list_(pa.string())),  # member extension, e.g. "jpg", "0.png"
        ("image_offsets", pa.list_(pa.int64())),
        ("image_sizes", pa.list_(pa.int64())),
        ("image_checksums", pa.list_(pa.uint64())),
        ("image_widths", pa.list_(pa.int32())),
        ("image_heights", pa.list_(pa.int32())),
        ("n_images", pa.int32()),
        ("vision_units", pa.int32()),  # what the vision cap counts: tiles (InternVL), merged patches (Qwen2-VL), images
        ("vision_tokens", pa.int32()),  # image placeholder tokens in the LLM sequence
        ("vit_patches", pa.int64()),  # ViT sequence length summed over the sample's ViT sequences (cost model)
        ("vit_attn_sq", pa.int64()),  # sum of squared ViT sequence lengths (attention term of the cost model)
        ("text_tokens", pa.int32()),
        ("llm_tokens", pa.int32()),  # text + image placeholder tokens: the packed sequence length
        ("loss_tokens", pa.int32()),  # tokens with a label (assistant turns)
        # Videos, in the order of the sample's <video> tags. Costs above count their sampled frames.
        ("n_videos", pa.int32()),
        ("video_names", pa.list_(pa.string())),  # member extension, e.g. "mp4"; "frames" for a frame sequence
        ("video_offsets", pa.list_(pa.int64())),
        ("video_sizes", pa.list_(pa.int64())),
        ("video_checksums", pa.list_(pa.uint64())),
        ("video_widths", pa.list_(pa.int32())),
        ("video_heights", pa.list_(pa.int32())),
        ("video_frames", pa.list_(pa.int32())),  # frames in the video
        ("video_rates", pa.list_(pa.float64())),  # its frames per second
        ("video_sampled", pa.list_(pa.int32())),  # frames the video policy takes from it
        # Set when the sample's numbered images are the frames of one video (its JSON's "frames": {"fps": F}):
        # the image columns then list every frame, and the video columns describe the sequence.
        ("frames_fps", pa.float64()),
        ("pixel_bytes", pa.int64()),  # uint8 bytes of every tile its images and sampled frames become (C x H x W)
    ]
)


@dataclass
class IndexInfo:
    """What the index's metadata records: where it came from and how costs were computed."""

    fingerprint: str
    source: str  # "shards" or "lengths"
    inputs: list[str]
    image_policy: dict[str, Any] | None = None
    video_policy: dict[str, Any] | None = None  # VideoSampling's fields; None: the defaults
    tokenizer: dict[str, Any] | None = None
    chat_template: dict[str, Any] | None = None
    skipped_shards: list[dict[str, str]] | None = None
    invalid_by_reason: dict[str, int] | None = None
    rows_per_second: float | None = None
    objects: dict[str, dict[str, Any]] | None = None  # object-store shards: {url: {size, etag}} when indexed
    # further encoders beside the vision encoder (an audio tower, a video tower...): {name: {"padded": bool}};
    # each has the columns `encoder_columns(name)`
    encoders: dict[str, dict[str, Any]] | None = None
    # samples come in groups sharing a prefix (GRPO's responses to one prompt, preference pairs): the index has
    # GROUP_COLUMNS
    groups: bool | None = None
    trees: bool | None = None  # its groups are trees of trajectories: the index has TREE_COLUMNS too
    # samples naming a parent that are planned and served whole instead, by reason (`index.trajectories`)
    forks_alone: dict[str, int] | None = None
    format_version: int = INDEX_FORMAT_VERSION
    packfeed_version: str = __version__

    @property
    def has_shards(self) -> bool:
        """Built from shards (servable), not imported from length files (plannable only)."""
        return self.source == "shards"


ENCODER_NAME = re.compile(r"[a-z][a-z0-9]{0,31}")


def check_encoder_name(name: str) -> str:
    """A further encoder's name: 1-32 lowercase letters and digits, a letter first; not vision or llm."""
    if not ENCODER_NAME.fullmatch(name) or name in ("vision", "llm"):
        raise ValueError(f"encoder name {name!r}: use 1-32 lowercase letters and digits, a letter first, other than "
                         "vision and llm")
    return name


def encoder_columns(name: str) -> tuple[str, str]:
    """A further encoder's index columns: its tokens (what its output weighs; its linear cost) and the sum of its
    sequences' squared lengths (its attention cost)."""
    return f"encoder_{name}_tokens", f"encoder_{name}_attn_sq"


# A grouped index's columns: each sample's group (-1: none; groups numbered 0.. in order of first appearance) and
# the LLM tokens of the prefix it shares with the group's other members (the prompt; its images are among them)
GROUP_COLUMNS = {"group": pa.int64(), "prefix_tokens": pa.int32()}
# A grouped index of trajectories (length records naming a parent: `trajectory_lengths`): per sample, the sample it
# continues (-1: none), the tokens and vision units it shares with it, and its prompt's vision units
TREE_COLUMNS = {"parent": pa.int64(), "fork_tokens": pa.int32(), "fork_vision": pa.int32(),
                "prompt_vision": pa.int32()}


def check_groups(group: np.ndarray, prefix: np.ndarray, vision: np.ndarray, tokens: np.ndarray) -> None:
    """A grouped index's rule: a group's members share one prefix, the same prefix tokens and the same vision
    units (every image of a grouped sample is in its prefix), within each member's tokens."""
    ids = np.flatnonzero(group >= 0)
    ids = ids[np.argsort(group[ids], kind="stable")]
    starts = np.flatnonzero(np.r_[True, group[ids][1:] != group[ids][:-1]]) if len(ids) else np.zeros(0, np.int64)
    first = np.repeat(ids[starts], np.diff(np.r_[starts, len(ids)]))
    bad = (prefix[ids] != prefix[first]) | (vision[ids] != vision[first]) | (prefix[ids] > tokens[ids]) | \
        (prefix[ids] < 0)
    if bad.any():
        i, j = int(ids[np.argmax(bad)]), int(first[np.argmax(bad)])
        raise ValueError(f"group {group[i]}: sample {i} has {prefix[i]} prefix tokens, {vision[i]} vision units and "
                         f"{tokens[i]} tokens, its group's sample {j} {prefix[j]} prefix tokens and {vision[j]} vision "
                         "units: a group's members share one prefix (the same prefix_tokens, every image in it, "
                         "within each member's tokens)")


def index_schema(info: IndexInfo) -> pa.Schema:
    """SCHEMA, then the columns of the index's further encoders, then a grouped index's GROUP_COLUMNS (and an
    index of trees' TREE_COLUMNS)."""
    extra = [pa.field(column, pa.int64()) for name in sorted(info.encoders or {}) for column in encoder_columns(name)]
    groups = [pa.field(name, kind) for name, kind in GROUP_COLUMNS.items()] if info.groups else []
    trees = [pa.field(name, kind) for name, kind in TREE_COLUMNS.items()] if info.trees else []
    return pa.schema(list(SCHEMA) + extra + groups + trees)


def member_checksum(data: bytes) -> int:
    """The content checksum the index records for every member and the server verifies on every read: XXH3
    (64 bit): 20.9 GB/s on the demo photographs, 0.023% of serving a sample (BENCHMARKS.md), so every read
    can be checked."""
    return xxhash.xxh3_64_intdigest(data)


def fingerprint_table(table: pa.Table, config: dict[str, Any]) -> str:
    """A stable digest of the rows that matter for planning and serving, plus the indexing config.

    Hashes column buffers in a fixed order, so it is independent of Parquet encoding, compression and
    row-group layout, and equal for equal content.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(config, sort_keys=True).encode())
    encoders = [column for column in table.column_names if column.startswith("encoder_")]
    groups = [column for column in (*GROUP_COLUMNS, *TREE_COLUMNS) if column in table.column_names]
    for name in ("sample_id", "valid", "vision_units", "vision_tokens", "llm_tokens", "vit_patches", "vit_attn_sq",
                 *encoders, *groups):
        column = table.column(name).combine_chunks()
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(column.to_numpy(zero_copy_only=False)).tobytes())
    for name in ("json_checksum", "image_checksums", "video_checksums"):  # content: a rewritten dataset is another dataset
        column = table.column(name).combine_chunks()
        values = column.flatten() if pa.types.is_list(column.type) else column
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(values.fill_null(0).to_numpy(zero_copy_only=False)).tobytes())
    for name in ("shard", "key"):
        digest.update(name.encode())
        # Chunk by chunk, dictionaries as indices + values: never materialise 100M copies of a shard name.
        for chunk in table.column(name).chunks:
            parts = [chunk.indices, chunk.dictionary] if pa.types.is_dictionary(chunk.type) else [chunk]
            for part in parts:
                for buffer in part.buffers():
                    if buffer is not None:
                        digest.update(buffer)
    return digest.hexdigest()[:32]


def write_index(table: pa.Table, path: str | Path, info: IndexInfo) -> None:
    schema = index_schema(info)
    table = table.cast(schema) if table.schema != schema else table
    metadata = {METADATA_KEY: json.dumps(info.__dict__, sort_keys=True).encode()}
    table = table.replace_schema_metadata(metadata)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", row_group_size=1 << 20)


def read_index_info(path: str | Path) -> IndexInfo:
    """The index's metadata, checked: a file that is not a Parquet index Packfeed wrote is refused naming it."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path} is not a Packfeed index: not a Parquet file ({error}); build one with "
                         "`packfeed index`") from None
    if METADATA_KEY not in metadata:
        raise ValueError(f"{path} is not a Packfeed index (no '{METADATA_KEY.decode()}' metadata); "
                         "build one with `packfeed index`")
    info = IndexInfo(**json.loads(metadata[METADATA_KEY]))
    if info.format_version != INDEX_FORMAT_VERSION:
        raise ValueError(f"{path} has index format {info.format_version}; this Packfeed reads "
                         f"{INDEX_FORMAT_VERSION}. Rebuild it with `packfeed index`.")
    return info


def read_index(path: str | Path, columns: list[str] | None = None) -> tuple[pa.Table, IndexInfo]:
    info = read_index_info(path)  # first: it names the file when it is not an index
    return pq.read_table(path, columns=columns, memory_map=True), info


def empty_rows(n: int) -> dict[str, Any]:
    """Null-filled columns for `n` rows, to be overwritten by the builder."""
    return {field.name: pa.nulls(n, field.type) for field in SCHEMA}
