"""`packfeed index`: one pass over WebDataset shards -> a Parquet table of per-sample costs.

Shards are read in parallel (one process per shard at a time) and the rows concatenated in shard order,
so the index is the same whatever the worker count. Bad input never stops indexing and never passes
silently: a bad sample becomes an invalid row with its reason, an unreadable shard (or the unreadable
rest of one) is reported, and the CLI exits non-zero when anything was skipped.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from packfeed.media.samples import reason_category
from packfeed.media.storage import ObjectError, Stamp, is_object_url, stamp
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.parts import (ShardResult, config_digest, load_part, parts_directory, remove_stale_parts,
                                         save_part, shard_version)
from packfeed.server.index.sample_costs import cost_sample
from packfeed.server.index.shards import ShardError, expand_shards, is_compressed, iter_samples
from packfeed.server.index.table import SCHEMA, TREE_COLUMNS, IndexInfo, fingerprint_table, index_schema, write_index
from packfeed.server.index.trajectories import link_trees


# ---------------------------------------------------------------------------------------------------------------
# One shard, then all of them


COMPRESSED_REASON = "compressed shard: serving reads samples at their offsets; decompress it to a plain .tar"


def index_shard(url: str, config: IndexConfig, version: dict[str, Any] | None = None) -> ShardResult:
    """Index one shard. `version`: the object's stamp as build_index just asked it (saves asking the store
    again); the object is stamped once more after reading, and a change in between invalidates its rows."""
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    error, before = None, None
    try:
        if is_object_url(url):
            before = Stamp(**version) if version else stamp(url)
        compressed = is_compressed(url)
        for raw in iter_samples(url):
            row = cost_sample(raw, config)
            if raw.key in seen:
                row.update(valid=False, reason="duplicate key: the key appears earlier in this shard")
            elif compressed:
                row.update(valid=False, reason=COMPRESSED_REASON)
            seen.add(raw.key)
            rows.append(row)
        if before is not None and stamp(url) != before:
            error = "object changed while it was indexed: index it again"
            for row in rows:
                row.update(valid=False, reason="shard changed: the object changed while it was indexed")
    except ShardError as shard_error:
        error = str(shard_error)
    except ObjectError as object_error:
        error = f"cannot open: {object_error}"
    return ShardResult(url, rows, error, time.perf_counter() - started, before)


@dataclass
class IndexResult:
    out: str
    info: IndexInfo
    rows: int
    valid: int
    seconds: float
    core_seconds: float
    reused: int = 0  # shards whose kept part was taken as it was (unchanged since an earlier run)

    @property
    def skipped_anything(self) -> bool:
        return bool(self.info.skipped_shards) or self.valid < self.rows

    def summary(self) -> dict[str, Any]:
        return {"index": self.out, "fingerprint": self.info.fingerprint, "rows": self.rows, "valid": self.valid,
                "invalid": self.rows - self.valid, "invalid_by_reason": self.info.invalid_by_reason,
                "shard_errors": self.info.skipped_shards, "shards_reused": self.reused,
                **({"forks_alone": self.info.forks_alone} if self.info.forks_alone else {}),
                "seconds": round(self.seconds, 3),
                "rows_per_second": round(self.rows / max(self.seconds, 1e-9), 1),
                "rows_per_second_per_core": round(self.rows / max(self.core_seconds, 1e-9), 1)}


def build_index(specs: list[str], out: str | Path, config: IndexConfig, workers: int | None = None,
                progress: bool = True, ray: str | None = None) -> IndexResult:
    """Index the shards `specs` names into `out`. `ray`: run the per-shard work as tasks on the Ray cluster at
    this address ("local": a Ray instance started for this run) instead of local processes; the index is the
    same either way."""
    started = time.perf_counter()
    urls = expand_shards(specs)
    if not urls:
        raise ValueError("no shards given")
    config, tokenizer_record = config.with_tokenizer_for(out)
    parts, digest = parts_directory(out), config_digest(config.to_fingerprint_dict())
    with ThreadPoolExecutor(max_workers=16) as pool:  # a HEAD per object: many at once
        versions = dict(zip(urls, pool.map(shard_version, urls)))
    kept = {url: load_part(parts, url, versions[url], digest) for url in urls}
    pending = [url for url in urls if kept[url] is None]
    bar = tqdm(total=len(urls), initial=len(urls) - len(pending), unit="shard", desc="indexing", disable=not progress)
    pending_versions = [versions[url] for url in pending]
    fresh = (_index_shards_on_ray(pending, pending_versions, config, ray, bar) if ray
             else _index_shards(pending, pending_versions, config, workers, bar))
    bar.close()
    for url, result in fresh.items():  # kept before duplicates across shards are marked: those depend on the others
        save_part(parts, result, versions[url], digest)
    remove_stale_parts(parts, urls)
    results = [kept[url] or fresh[url] for url in urls]

    _mark_duplicates_across_shards(results)
    trees, forks_alone = link_trees([row for result in results for row in result.rows])
    table = _rows_to_table(results, trees)
    invalid = Counter(reason_category(r) for r in table.column("reason").to_pylist() if r is not None)
    config_fp = config.to_fingerprint_dict()
    info = IndexInfo(
        fingerprint=fingerprint_table(table, config_fp), source="shards", inputs=urls,
        image_policy=config.image_policy, video_policy=config.video_policy, tokenizer=tokenizer_record,
        chat_template=config.chat_template,
        skipped_shards=[{"shard": r.url, "error": r.error, "samples_read": len(r.rows)} for r in results if r.error],
        invalid_by_reason=dict(sorted(invalid.items())),
        objects={r.url: r.stamp.to_dict() for r in results if r.stamp} or None,
        groups=True if "group" in table.column_names else None, trees=True if trees else None,
        forks_alone=dict(sorted(forks_alone.items())) or None,
    )
    seconds = time.perf_counter() - started
    core_seconds = sum(r.seconds for r in fresh.values())
    info.rows_per_second = round(table.num_rows / max(seconds, 1e-9), 1)
    write_index(table, out, info)
    valid = int(np.count_nonzero(table.column("valid").to_numpy(zero_copy_only=False)))
    return IndexResult(str(out), info, table.num_rows, valid, seconds, core_seconds, len(urls) - len(pending))


def _index_shards(urls: list[str], versions: list, config: IndexConfig, workers: int | None,
                  bar) -> dict[str, ShardResult]:
    """Index these shards (at these versions), in parallel processes; {url: result}."""
    results: dict[str, ShardResult] = {}
    workers = max(1, min(workers or os.cpu_count() or 1, len(urls) or 1))
    if workers == 1:
        for url, version in zip(urls, versions):
            results[url] = index_shard(url, config, version)
            bar.update(1)
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for url, result in zip(urls, pool.map(index_shard, urls, [config] * len(urls), versions)):
            results[url] = result
            bar.update(1)
    return results


RAY_TASK_RETRIES = 3  # a task whose worker died (killed, out of memory, a crashing decoder) runs again


def _index_shards_on_ray(urls: list[str], versions: list, config: IndexConfig, address: str,
                         bar) -> dict[str, ShardResult]:
    """Index these shards as Ray tasks, one per shard; {url: result}. The cluster's workers must be able to
    import Packfeed (the same environment, or a runtime_env that installs it) and to read the shards."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'packfeed[ray]'") from None
    if not urls:
        return {}
    # "local" starts a Ray instance of our own (None would join any cluster `ray start` left on this machine)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    try:
        task = ray.remote(max_retries=RAY_TASK_RETRIES)(index_shard)
        config_ref = ray.put(config)
        running = {task.remote(url, config_ref, version): url for url, version in zip(urls, versions)}
        results: dict[str, ShardResult] = {}
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                url = running.pop(ref)
                try:
                    results[url] = ray.get(ref)
                except ray.exceptions.RayError as error:  # retries spent: report the shard, keep the others
                    results[url] = ShardResult(url, [], f"the Ray task failed: {type(error).__name__}: "
                                                         f"{str(error).splitlines()[0]}", 0.0)
                bar.update(1)
        return results
    finally:
        ray.shutdown()


def _mark_duplicates_across_shards(results: list[ShardResult]) -> None:
    """A key seen in an earlier shard makes the later sample invalid (keys name samples in packs and reports)."""
    first_shard: dict[str, str] = {}
    for result in results:
        for row in result.rows:
            earlier = first_shard.setdefault(row["key"], result.url)
            if earlier != result.url and row["valid"]:
                row.update(valid=False, reason=f"duplicate key: the key appears earlier in shard {earlier}")


def _rows_to_table(results: list[ShardResult], trees: dict[str, np.ndarray] | None = None) -> pa.Table:
    rows = [row for result in results for row in result.rows]
    shard_index = np.concatenate([np.full(len(r.rows), k, dtype=np.int32) for k, r in enumerate(results)]) \
        if results else np.zeros(0, np.int32)
    columns: dict[str, Any] = {"sample_id": pa.array(np.arange(len(rows), dtype=np.int64))}
    columns["shard"] = pa.DictionaryArray.from_arrays(pa.array(shard_index, type=pa.int32()),
                                                      pa.array([r.url for r in results], type=pa.string()))
    for field_ in SCHEMA:
        if field_.name not in columns:
            columns[field_.name] = pa.array([row[field_.name] for row in rows], type=field_.type)
    schema = SCHEMA
    keys = [row.get("group_key") for row in rows]
    if any(keys):  # samples naming groups: each (group, prefix) numbered in order of first appearance
        numbered: dict[str, int] = {}
        columns["group"] = pa.array([numbered.setdefault(key, len(numbered)) if key else -1 for key in keys],
                                    type=pa.int64())
        columns["prefix_tokens"] = pa.array([row.get("prefix_tokens") or 0 if key else 0
                                             for row, key in zip(rows, keys)], type=pa.int32())
        schema = index_schema(IndexInfo("", "shards", [], groups=True, trees=True if trees else None))
    for name, kind in TREE_COLUMNS.items() if trees else ():
        columns[name] = pa.array(trees[name]).cast(kind)
    return pa.table(columns, schema=schema)
