"""Import OmniBal/InternVL length files (`[{"vit_num", "token_num", "image_flags"}, ...]`) as an index.

`vit_num` -> vision units (448 px tiles), `token_num` -> LLM tokens; sample_id is the position, files
concatenated in argument order. The files carry no member offsets, so such an index plans and reports
but cannot be served.

Further encoders (`--encoder audio`, `--encoder speech:padded`): each record may give `<name>_tokens`, that
encoder's sequence tokens for the sample (0 or absent: none), and `<name>_items`, how many sequences they make
(default 1; each of equal length for the attention cost). A padded encoder pads every sequence of a batch to
the longest, so it takes at most one sequence per sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packfeed.media.image_policy import DEFAULT_PATCHES_PER_UNIT
from packfeed.server.index.table import (TREE_COLUMNS, IndexInfo, check_encoder_name, check_groups, empty_rows,
                                         encoder_columns, fingerprint_table, index_schema, write_index)
from packfeed.server.index.trajectory_lengths import joined_trees, record_trees

TOKENS_PER_TILE = 256
KEY_CHUNK = 1 << 25  # InternVL: pixel-shuffled 448 px tile -> 256 LLM tokens


def length_records(path: Path) -> list:
    """A length file's records, as JSON values."""
    try:
        records = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a length file ({error})") from error
    if not isinstance(records, list):
        raise ValueError(f"{path}: a length file is a JSON list of {{vit_num, token_num, image_flags}} records")
    return records


def read_length_file(path: Path, encoders: dict[str, bool] | None = None, records: list | None = None
                     ) -> tuple[np.ndarray, ...]:
    """(vit_num, token_num, image_flags) of every record, then (tokens, attention squares) of each further encoder
    in `encoders` ({name: padded}) in name order. `records`: the file's, when already read."""
    records = length_records(path) if records is None else records
    try:
        vit = np.fromiter((r["vit_num"] for r in records), dtype=np.int64, count=len(records))
        tok = np.fromiter((r["token_num"] for r in records), dtype=np.int64, count=len(records))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: every record needs integer 'vit_num' and 'token_num' ({error!r})") from error
    flags = np.fromiter((_image_flags(path, k, r) for k, r in enumerate(records)), dtype=np.int64, count=len(records))
    extra = []
    for name, padded in sorted((encoders or {}).items()):
        extra += _encoder_lengths(path, records, name, padded)
    return (vit, tok, flags, *extra)


def _image_flags(path: Path, k: int, record: dict) -> int:
    """A record's real tiles: `image_flags` as a count, or as InternVL's per-tile 0/1 flags (one per ViT tile:
    their sum); absent, every tile is real."""
    flags = record.get("image_flags", record["vit_num"])
    if isinstance(flags, list):
        if len(flags) != record["vit_num"] or any(flag not in (0, 1) for flag in flags):
            raise ValueError(f"{path}: record {k}: 'image_flags' as a list holds a 0 or 1 per ViT tile: "
                             f"{len(flags)} entries for vit_num {record['vit_num']}")
        return sum(flags)
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise ValueError(f"{path}: record {k}: 'image_flags' is {type(flags).__name__} {flags!r}: give the count of "
                         "real tiles (an integer), or a 0/1 flag per tile (a list)")
    return flags


def _encoder_lengths(path: Path, records: list, name: str, padded: bool) -> list[np.ndarray]:
    """(tokens, sum of squared sequence lengths) of encoder `name` per record."""
    try:
        tokens = np.fromiter((r.get(f"{name}_tokens", 0) for r in records), dtype=np.int64, count=len(records))
        items = np.fromiter((r.get(f"{name}_items", 1 if r.get(f"{name}_tokens", 0) else 0) for r in records),
                            dtype=np.int64, count=len(records))
    except (TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}: '{name}_tokens' and '{name}_items' must be integers ({error})") from None
    bad = (tokens < 0) | (items < 0) | ((tokens > 0) & (items == 0)) | (padded & (items > 1))
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        rule = "at most 1 sequence (a padded encoder pads each to the batch's longest)" if padded else \
            "tokens >= 0 in >= 1 sequence"
        raise ValueError(f"{path}: record {k}: encoder {name}: {tokens[k]} tokens in {items[k]} sequences; each "
                         f"record needs {rule}")
    return [tokens, (tokens * tokens) // np.maximum(items, 1)]


def record_groups(path: Path, records: list, labels: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """Each record's group (-1: none) and prefix tokens, or None when no record names a group. A record's `group`
    is any JSON string or integer, numbered in `labels` (shared by the files of one index) in order of first
    appearance; a grouped record gives `prefix_tokens`, the tokens its group's members share (the prompt; its
    images, `vit_num`, are in them)."""
    if not any(isinstance(r, dict) and "group" in r for r in records):
        return None
    group = np.full(len(records), -1, np.int64)
    prefix = np.zeros(len(records), np.int64)
    for k, record in enumerate(records):
        label = record.get("group")
        if label is None:
            continue
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            raise ValueError(f"{path}: record {k}: 'group' is {type(label).__name__} {label!r}: name a group with a "
                             "string or an integer")
        given = record.get("prefix_tokens")
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= record["token_num"]:
            raise ValueError(f"{path}: record {k} of group {label!r}: 'prefix_tokens' is {given!r}: give the tokens "
                             f"its group shares, an integer from 0 to its token_num ({record['token_num']})")
        group[k] = labels.setdefault((type(label).__name__, label), len(labels))
        prefix[k] = given
    return group, prefix


def index_from_lengths(files: list[str | Path], out: str | Path, encoders: dict[str, bool] | None = None
                       ) -> IndexInfo:
    """An index of the length files; `encoders`: further encoders ({name: padded}) their records describe.
    Records naming a `group` make a grouped index (`record_groups`)."""
    encoders = {check_encoder_name(name): padded for name, padded in (encoders or {}).items()}
    parts, grouping, labels, found = [], [], {}, []
    for f in files:
        records = length_records(Path(f))
        parts.append(read_length_file(Path(f), encoders, records))
        grouping.append(record_groups(Path(f), records, labels))
        found.append(record_trees(Path(f), records, grouping[-1][0]) if grouping[-1] is not None else None)
        del records
    groups = None
    if any(g is not None for g in grouping):
        groups = tuple(np.concatenate([g[k] if g is not None else np.full(len(p[0]), -1 if k == 0 else 0, np.int64)
                                       for g, p in zip(grouping, parts)]) for k in (0, 1))
    trees = joined_trees(found, [len(p[0]) for p in parts])
    names = [Path(f).name for f in files]
    source = np.concatenate([np.full(len(p[0]), k, dtype=np.int32) for k, p in enumerate(parts)]) \
        if parts else np.zeros(0, np.int32)
    columns = [np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64)
               for k in range(3 + 2 * len(encoders))]
    extra = {name: (columns[3 + 2 * k], columns[4 + 2 * k]) for k, name in enumerate(sorted(encoders))}
    return write_lengths_index(*columns[:3], out, names, source, inputs=[str(f) for f in files],
                               encoders={name: (*extra[name], encoders[name]) for name in encoders}, groups=groups,
                               trees=trees)


def write_lengths_index(vit: np.ndarray, tok: np.ndarray, flags: np.ndarray, out: str | Path,
                        source_names: list[str], source: np.ndarray, inputs: list[str] | None = None,
                        encoders: dict[str, tuple[np.ndarray, np.ndarray, bool]] | None = None,
                        groups: tuple[np.ndarray, np.ndarray] | None = None,
                        trees: tuple[np.ndarray, ...] | None = None) -> IndexInfo:
    """An index from per-sample (vit_num, token_num, image_flags); `source[i]` names row i's file; `encoders`:
    {name: (tokens, attention squares, padded)} of further encoders; `groups`: (group, prefix tokens) per sample,
    a grouped index (each group's members checked to share one prefix); `trees`: (parent, fork tokens, fork vision,
    prompt vision) per sample, its groups trees of trajectories (`trajectory_lengths`)."""
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
    described = {name: {"padded": bool(padded)} for name, (_, _, padded) in sorted((encoders or {}).items())}
    for name, (tokens, squares, _) in sorted((encoders or {}).items()):
        for column, values in zip(encoder_columns(name), (tokens, squares)):
            columns[column] = pa.array(np.asarray(values, dtype=np.int64))
    if groups is not None:
        group, prefix = (np.asarray(g, np.int64) for g in groups)
        if trees is None:  # a tree's trajectories share their prompt, not every image in it
            check_groups(group, prefix, vit, tok)
        columns["group"], columns["prefix_tokens"] = pa.array(group), pa.array(prefix.astype(np.int32))
    for (name, kind), values in zip(TREE_COLUMNS.items(), trees or ()):
        columns[name] = pa.array(np.asarray(values, np.int64)).cast(kind)
    info = IndexInfo(fingerprint="", source="lengths", inputs=inputs or source_names,
                     invalid_by_reason={}, skipped_shards=[], encoders=described or None,
                     groups=True if groups is not None else None, trees=True if trees is not None else None)
    table = pa.table(columns, schema=index_schema(info))
    invalid = int(bad.sum())
    config = {"source": "lengths", "files": source_names, **({"encoders": described} if described else {}),
              **({"groups": True} if groups is not None else {}), **({"trees": True} if trees is not None else {})}
    info.fingerprint = fingerprint_table(table, config)
    info.invalid_by_reason = {reason: invalid} if invalid else {}
    write_index(table, out, info)
    return info
