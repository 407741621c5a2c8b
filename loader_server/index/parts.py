"""Per-shard parts beside an index: a re-run re-indexes only new or changed shards.

`packfeed index ... --out DIR/index.parquet` keeps each shard's rows in `DIR/index.parts/` (one Parquet file
per shard, named by a digest of its URL), with what identifies the shard's version (size and modification
time of a file, size and ETag of an object) and the digest of the indexing configuration. A later run with the
same configuration takes a part as it is when its shard is unchanged, indexes the rest, and merges all of them
in shard order: the index is the one a fresh run writes, column for column, with the same fingerprint.
`pipe:` and other streamed sources have no version to compare and are indexed every time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from packfeed.media.storage import ObjectError, Stamp, is_object_url, stamp
from packfeed.server.index.table import SCHEMA
from packfeed.server.index.trajectories import TURN_FIELDS

# every index column of a sample but its id and shard, what names its group (`sample_costs._group_of`) and its
# turns (`trajectories.turn_record`)
_PART_SCHEMA = pa.schema([field for field in SCHEMA if field.name not in ("sample_id", "shard")]
                         + [("group_key", pa.string()), ("prefix_tokens", pa.int32()), *TURN_FIELDS.items()])
_PART_KEY = b"packfeed.part"
_PART_FORMAT = 3  # 2: groups, 3: turns; a part of another format is indexed again


@dataclass
class ShardResult:
    """One shard's index rows (or why it could not be read), as indexed now or kept in its part."""

    url: str
    rows: list[dict[str, Any]]
    error: str | None
    seconds: float
    stamp: Stamp | None = None  # an object's size and ETag as indexed


def parts_directory(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".parts")


def shard_version(url: str) -> dict[str, Any] | None:
    """What changes when the shard does; None when there is no way to tell (streamed sources, unreadable)."""
    if is_object_url(url):
        try:
            return stamp(url).to_dict()
        except ObjectError:
            return None
    if url.startswith(("pipe:", "ais://")):
        return None
    try:
        status = os.stat(url[5:] if url.startswith("file:") else url)
    except OSError:
        return None
    return {"size": status.st_size, "mtime_ns": status.st_mtime_ns}


def config_digest(config_fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config_fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _part_path(directory: Path, url: str) -> Path:
    return directory / f"{hashlib.sha256(url.encode()).hexdigest()[:24]}.parquet"


def load_part(directory: Path, url: str, version: dict[str, Any] | None, digest: str):
    """The ShardResult kept for `url`, or None when there is none, or its shard or the configuration changed."""
    path = _part_path(directory, url)
    if version is None or not path.exists():
        return None
    try:
        table = pq.read_table(path)
        meta = json.loads((table.schema.metadata or {})[_PART_KEY])
    except (OSError, KeyError, ValueError, pa.ArrowException):
        return None  # unreadable or foreign: index the shard again
    if meta.get("url") != url or meta.get("version") != version or meta.get("config") != digest or \
            meta.get("format") != _PART_FORMAT:
        return None
    return ShardResult(url, table.cast(_PART_SCHEMA).to_pylist(), meta.get("error"), float(meta.get("seconds", 0.0)),
                       _stamp_of(meta.get("stamp")))


def save_part(directory: Path, result, version: dict[str, Any] | None, digest: str) -> None:
    """Keep a shard's result (written to a temporary name, then renamed: a killed run leaves no torn part)."""
    if version is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"url": result.url, "version": version, "config": digest, "error": result.error, "format": _PART_FORMAT,
            "seconds": result.seconds, "stamp": result.stamp.to_dict() if result.stamp else None}
    table = pa.Table.from_pylist(result.rows, schema=_PART_SCHEMA).replace_schema_metadata(
        {_PART_KEY: json.dumps(meta).encode()})
    path = _part_path(directory, result.url)
    partial = path.with_suffix(".partial")
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, path)


def remove_stale_parts(directory: Path, urls: list[str]) -> None:
    """Parts of shards no longer in the index (removed from the shard list) go."""
    if not directory.is_dir():
        return
    keep = {_part_path(directory, url).name for url in urls}
    for path in directory.glob("*.parquet"):
        if path.name not in keep:
            path.unlink(missing_ok=True)


def _stamp_of(raw: dict[str, Any] | None):
    from packfeed.media.storage import Stamp

    return Stamp(**raw) if raw else None
