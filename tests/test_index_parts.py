"""Per-shard parts beside the index: a re-run indexes only new or changed shards, and the merged index equals a
fresh one column for column, fingerprint included."""

from __future__ import annotations

import io
import shutil
import tarfile

from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index
from packfeed.server.index.parts import parts_directory
from packfeed.server.index.table import read_index


def renamed_shard(source, target, prefix: str, drop_first: bool = False) -> None:
    """A copy of a shard whose keys get `prefix` (so they are new samples); optionally without its first sample."""
    with tarfile.open(source) as tar, tarfile.open(target, "w") as out:
        members = list(tar)
        first_key = members[0].name.split(".", 1)[0]
        for member in members:
            if drop_first and member.name.split(".", 1)[0] == first_key:
                continue
            data = tar.extractfile(member).read()
            member.name = prefix + member.name
            out.addfile(member, io.BytesIO(data))


def fresh_equal(shards, out, config, tmp_path) -> None:
    """The index at `out` equals one built from scratch elsewhere, columns and fingerprint."""
    reference = tmp_path / "reference" / "index.parquet"
    shutil.rmtree(reference.parent, ignore_errors=True)
    build_index(shards, reference, config, workers=1, progress=False)
    (table, info), (expected, expected_info) = read_index(out), read_index(reference)
    assert table.equals(expected) and info.fingerprint == expected_info.fingerprint


def test_a_rerun_indexes_only_new_or_changed_shards(tmp_path, demo_dataset):
    shards = tmp_path / "shards"
    shards.mkdir()
    paths = []
    for shard in demo_dataset.shards:
        paths.append(shards / shard.name)
        shutil.copy(shard, paths[-1])
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer))
    out = tmp_path / "index" / "index.parquet"
    first = build_index([str(p) for p in paths], out, config, workers=2, progress=False)
    assert first.reused == 0 and len(list(parts_directory(out).glob("*.parquet"))) == len(paths)

    paths.append(shards / "added.tar")  # a new shard
    renamed_shard(paths[0], paths[-1], "added-")
    added = build_index([str(p) for p in paths], out, config, workers=2, progress=False)
    assert added.reused == len(paths) - 1
    fresh_equal([str(p) for p in paths], out, config, tmp_path)

    renamed_shard(demo_dataset.shards[1], paths[1], "", drop_first=True)  # a changed shard
    changed = build_index([str(p) for p in paths], out, config, workers=1, progress=False)
    assert changed.reused == len(paths) - 1 and changed.rows == added.rows - 1
    fresh_equal([str(p) for p in paths], out, config, tmp_path)

    other = IndexConfig(tokenizer=str(demo_dataset.tokenizer), image_policy={"name": "fixed"})  # another config
    assert build_index([str(p) for p in paths], out, other, workers=1, progress=False).reused == 0

    removed = build_index([str(p) for p in paths[:2]], out, other, workers=1, progress=False)  # a shard removed
    assert removed.reused == 2 and len(list(parts_directory(out).glob("*.parquet"))) == 2
    fresh_equal([str(p) for p in paths[:2]], out, other, tmp_path)
