"""Import OmniBal/InternVL length files (`[{"vit_num", "token_num", "image_flags"}, ...]`) as an index.

`vit_num` -> vision units (448 px tiles), `token_num` -> LLM tokens; sample_id is the position, files
concatenated in argument order. The files carry no member offsets, so such an index plans and reports
but cannot be served.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packfeed.server.plan.costs import DEFAULT_PATCHES_PER_UNIT
from packfeed.server.index.table import SCHEMA, IndexInfo, empty_rows, fingerprint_table, write_index

TOKENS_PER_TILE = 256
KEY_CHUNK = 1 << 25  # InternVL: pixel-shuffled 448 px tile -> 256 LLM tokens


def read_length_file(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        records = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a length file ({error})") from error
    if not isinstance(records, list):
        raise ValueError(f"{path}: a length file is a JSON list of {{vit_num, token_num, image_flags}} records")
    try:
        vit = np.fromiter((r["vit_num"] for r in records), dtype=np.int64, count=len(records))
        tok = np.fromiter((r["token_num"] for r in records), dtype=np.int64, count=len(records))
        flags = np.fromiter((r.get("image_flags", r["vit_num"]) for r in records), dtype=np.int64,
                            count=len(records))
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: every record needs integer 'vit_num' and 'token_num' ({error!r})") from error
    return vit, tok, flags


def index_from_lengths(files: list[str | Path], out: str | Path) -> IndexInfo:
    parts = [read_length_file(Path(f)) for f in files]
    names = [Path(f).name for f in files]
    source = np.concatenate([np.full(len(p[0]), k, dtype=np.int32) for k, p in enumerate(parts)]) \
        if parts else np.zeros(0, np.int32)
    vit, tok, flags = (np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64) for k in range(3))
    return write_lengths_index(vit, tok, flags, out, names, source, inputs=[str(f) for f in files])


def write_lengths_index(vit: np.ndarray, tok: np.ndarray, flags: np.ndarray, out: str | Path,
                        source_names: list[str], source: np.ndarray, inputs: list[str] | None = None) -> IndexInfo:
    """An index from per-sample (vit_num, token_num, image_flags); `source[i]` names row i's file."""
    n = len(vit)
    bad = (vit < 0) | (tok <= 0)
    reason = "bad length record (vit_num < 0 or token_num <= 0)"
    starts = np.searchsorted(source, np.arange(len(source_names)))
    position = np.arange(n) - starts[source] if n else np.zeros(0, np.int64)
    columns = empty_rows(n)
    columns.update({
        "sample_id": pa.array(np.arange(n, dtype=np.int64)),
        "shard": pa.DictionaryArray.from_arrays(pa.array(source, type=pa.int32()),
                                                pa.array(source_names, type=pa.string())),
        # The record's position in its file, in chunks that each stay under Arrow's 2 GB string limit.
        "key": pa.chunked_array([pc.cast(pa.array(position[i:i + KEY_CHUNK]), pa.string())
                                 for i in range(0, n, KEY_CHUNK)], type=pa.string()),
        "valid": pa.array(~bad),
        # Only invalid rows carry the string: a per-row copy would overflow Arrow's 2 GB limit at 100M rows.
        "reason": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32), mask=~bad),
                                                 pa.array([reason])).cast(pa.string()),
        "vision_units": pa.array(vit.astype(np.int32)),
        "vision_tokens": pa.array((flags * TOKENS_PER_TILE).astype(np.int32)),
        "vit_patches": pa.array(vit * DEFAULT_PATCHES_PER_UNIT),
        "vit_attn_sq": pa.array(vit * DEFAULT_PATCHES_PER_UNIT * DEFAULT_PATCHES_PER_UNIT),
        "llm_tokens": pa.array(tok.astype(np.int32)),
    })
    table = pa.table(columns, schema=SCHEMA)
    invalid = int(bad.sum())
    info = IndexInfo(
        fingerprint=fingerprint_table(table, {"source": "lengths", "files": source_names}), source="lengths",
        inputs=inputs or source_names, invalid_by_reason={reason: invalid} if invalid else {}, skipped_shards=[],
    )
    write_index(table, out, info)
    return info
