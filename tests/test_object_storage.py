"""Shards in object storage: a real S3-protocol server (moto's, its own process on 127.0.0.1). Indexing streams
`s3://` shards (globs included) and records each object's size and ETag; serving reads each sample with one
range request, exactly once per epoch as from local files; a throttling, connection-dropping store is
retried through; an overwritten or deleted object is detected and its samples skipped."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from packfeed.client import LocalServer, PackStream  # noqa: E402
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from s3_server import FaultyProxy, S3Server, restore_env, running, set_env  # noqa: E402

TENSORS = ("input_ids", "labels", "cu_seqlens", "pixels", "tile_shapes", "image_token_spans")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with running(S3Server()) as server:
        yield server


def upload(s3, shards, prefix: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True)
    bucket = prefix.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    urls = []
    for shard in shards:
        url = f"s3://{prefix}/{shard.name}"
        fs.put_file(str(shard), url)
        urls.append(url)
    return urls


def index_config(paths):
    from conftest import SMALL_TILE_POLICY

    return IndexConfig(tokenizer=str(paths.tokenizer), image_policy=SMALL_TILE_POLICY)


def epoch(target: str, job: str, dp: int = 2) -> dict[str, list]:
    """{sample key: its pack tensors} over every rank of one epoch, plus the skipped samples under ''."""
    seen: dict[str, list] = {"": []}
    for rank in range(dp):
        with PackStream(target, job=job, rank=rank, dp=dp, microbatches=2) as stream:
            for step in stream:
                for pack in step.packs:
                    seen[""] += pack.skipped
                    for key in pack.sample_keys:
                        assert key not in seen, f"{key} delivered twice"
                        seen[key] = [pack.tensors[name].clone() for name in TENSORS]
    return seen


def check_changed_and_deleted(served: dict[str, list], rows: list[dict], changed: str, deleted: str) -> None:
    """The samples of the overwritten object are skipped as changed (ETag), those of the deleted one as unreadable,
    and every other valid sample is served."""
    reasons = dict(served[""])
    on_changed = {r["key"] for r in rows if r["shard"] == changed}
    on_deleted = {r["key"] for r in rows if r["shard"] == deleted}
    assert on_changed and on_deleted
    assert all(reasons[key].startswith("shard changed") and "ETag" in reasons[key] for key in on_changed)
    assert all(reasons[key].startswith("shard unreadable") and "not found" in reasons[key] for key in on_deleted)
    assert set(served) - {""} == {r["key"] for r in rows} - on_changed - on_deleted


def test_index_and_serve_from_s3_as_from_local_files(s3, demo_dataset, tmp_path):
    urls = upload(s3, demo_dataset.shards, "data/demo")
    local = tmp_path / "local.parquet"
    remote = tmp_path / "s3.parquet"
    build_index([str(p) for p in demo_dataset.shards], local, index_config(demo_dataset), workers=1, progress=False)
    result = build_index(["s3://data/demo/*.tar"], remote, index_config(demo_dataset), workers=2, progress=False)
    (local_table, _), (remote_table, remote_info) = read_index(local), read_index(remote)
    assert remote_info.inputs == urls  # the fingerprint covers shard locations, so only the rows are compared
    assert local_table.drop(["shard"]).equals(remote_table.drop(["shard"]))
    assert set(remote_info.objects) == set(urls) and all(o["etag"] and o["size"] > 0 for o in remote_info.objects.values())
    assert result.valid > 0

    with LocalServer(local, workers=1) as server:
        from_files = epoch(server.target, "local")
    with LocalServer(remote, workers=1, env=s3.env) as server:
        from_s3 = epoch(server.target, "s3")
    assert set(from_s3) == set(from_files) and len(from_s3) > 40
    for key, tensors in from_files.items():
        if key:
            assert all(torch.equal(a, b) for a, b in zip(tensors, from_s3[key])), key


def test_throttling_and_dropped_connections_are_retried(s3, demo_dataset, tmp_path):
    upload(s3, demo_dataset.shards, "flaky/demo")
    proxy = FaultyProxy(s3.endpoint, tmp_path, every=5).start()
    previous = set_env(proxy.env)
    try:
        index = tmp_path / "flaky.parquet"
        build_index(["s3://flaky/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
        with LocalServer(index, workers=1, env=proxy.env) as server:
            served = epoch(server.target, "flaky")
        faults = proxy.count()
    finally:
        restore_env(previous)
        proxy.stop()
    reference = tmp_path / "reference.parquet"
    build_index([str(p) for p in demo_dataset.shards], reference, index_config(demo_dataset), workers=1,
                progress=False)
    valid = sum(read_index(reference, ["valid"])[0].column("valid").to_pylist())
    assert served[""] == [] and len(served) - 1 == valid  # every sample, none lost to a fault
    assert read_index(index)[0].drop(["shard"]).equals(read_index(reference)[0].drop(["shard"]))
    assert faults.get("503", 0) and faults.get("429", 0) and faults.get("drop", 0), faults


def test_an_overwritten_or_deleted_object_is_detected(s3, demo_dataset, tmp_path):
    import s3fs

    urls = upload(s3, demo_dataset.shards, "changing/demo")
    index = tmp_path / "changing.parquet"
    build_index(["s3://changing/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
    table, _ = read_index(index, ["key", "shard", "valid"])
    rows = [r for r in table.to_pylist() if r["valid"]]
    fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True)
    changed = tmp_path / "changed.tar"
    shutil.copy(demo_dataset.shards[0], changed)
    with open(changed, "ab") as out:
        out.write(b"\0" * 10240)  # same members, another object: a new size and ETag
    fs.put_file(str(changed), urls[0])
    fs.rm(urls[-1])

    with LocalServer(index, workers=1, env={**s3.env, "PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as server:
        served = epoch(server.target, "changing")
    check_changed_and_deleted(served, rows, urls[0], urls[-1])


def test_an_object_cut_short_while_served_is_reported_as_changed(s3, demo_dataset, tmp_path):
    """Within the TTL of a worker's cached stamps, a read that fails (a range past the end of an object cut short)
    looks the object up again and reports the sample's shard as changed, not as unreadable; what still reads
    the same (checksums) is served."""
    import s3fs

    urls = upload(s3, demo_dataset.shards, "cut/demo")
    index = tmp_path / "cut.parquet"
    build_index(["s3://cut/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
    rows = [r for r in read_index(index, ["key", "shard", "valid"])[0].to_pylist() if r["valid"]]
    cut = tmp_path / "cut.tar"
    data = demo_dataset.shards[0].read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    with LocalServer(index, workers=1, env={**s3.env, "PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as server:
        assert epoch(server.target, "before")[""] == []  # every object's stamp is now cached by the worker
        s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True).put_file(str(cut), urls[0])
        served = epoch(server.target, "after")
    reasons = dict(served[""])
    on_cut = {r["key"] for r in rows if r["shard"] == urls[0]}
    assert reasons and set(reasons) <= on_cut
    assert all(reason.startswith("shard changed") and "ETag" in reason for reason in reasons.values()), reasons
    assert set(served) - {""} == {r["key"] for r in rows} - set(reasons)


def test_a_range_cache_serves_later_epochs_from_local_disk_within_its_limit(s3, demo_dataset, tmp_path):
    upload(s3, demo_dataset.shards, "cached/demo")
    index = tmp_path / "cached.parquet"
    build_index(["s3://cached/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
    proxy = FaultyProxy(s3.endpoint, tmp_path, every=0).start()  # counts range requests, injects nothing
    cache, small = tmp_path / "ranges", tmp_path / "small-ranges"
    try:
        with LocalServer(index, workers=1, env={**proxy.env, "PACKFEED_RANGE_CACHE_DIR": str(cache)}) as server:
            first = epoch(server.target, "first", dp=1)
            after_first = proxy.count().get("range", 0)
            second = epoch(server.target, "second", dp=1)  # the same plan: the same samples again
            after_second = proxy.count().get("range", 0)
        with LocalServer(index, workers=1, env={**proxy.env, "PACKFEED_RANGE_CACHE_DIR": str(small),
                                                "PACKFEED_RANGE_CACHE_MB": "1"}) as server:
            epoch(server.target, "limited", dp=1)
    finally:
        proxy.stop()
    assert after_first > 40 and after_second == after_first  # the second epoch made no range request
    assert set(first) == set(second) and all(
        all(torch.equal(a, b) for a, b in zip(first[key], second[key])) for key in first if key)
    assert any(cache.rglob("*"))
    held = sum(path.stat().st_size for path in small.rglob("*") if path.is_file())
    assert 0 < held <= 1.2 * (1 << 20)  # the least recently used ranges went


def test_index_and_serve_over_http_range_requests(demo_dataset, tmp_path):
    """Shards behind plain HTTP (a real server process answering byte ranges): indexed from their URLs, served
    sample by sample with range requests, the same as from local files; an overwritten file is detected by its
    ETag."""
    from http_server import HttpServer

    folder = tmp_path / "www"
    folder.mkdir()
    for shard in demo_dataset.shards:
        shutil.copy(shard, folder / shard.name)
    server = HttpServer(folder).start()
    try:
        urls = [server.url(shard.name) for shard in demo_dataset.shards]
        local, remote = tmp_path / "local.parquet", tmp_path / "http.parquet"
        build_index([str(p) for p in demo_dataset.shards], local, index_config(demo_dataset), workers=1,
                    progress=False)
        build_index(urls, remote, index_config(demo_dataset), workers=2, progress=False)
        (local_table, _), (remote_table, remote_info) = read_index(local), read_index(remote)
        assert local_table.drop(["shard"]).equals(remote_table.drop(["shard"]))
        assert set(remote_info.objects) == set(urls) and all(o["etag"] for o in remote_info.objects.values())
        with LocalServer(local, workers=1) as files:
            from_files = epoch(files.target, "local")
        with LocalServer(remote, workers=1) as http:
            from_http = epoch(http.target, "http")
        assert set(from_http) == set(from_files) and len(from_http) > 40
        assert all(torch.equal(a, b) for key, tensors in from_files.items() if key
                   for a, b in zip(tensors, from_http[key]))

        with open(folder / demo_dataset.shards[0].name, "ab") as out:
            out.write(b"\0" * 10240)  # the same members, another file: a new size and ETag
        with LocalServer(remote, workers=1, env={"PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as http:
            changed = dict(epoch(http.target, "changed")[""])
        on_first = [r["key"] for r in remote_table.to_pylist() if r["shard"] == urls[0] and r["valid"]]
        assert on_first and all(changed[key].startswith("shard changed") for key in on_first)
    finally:
        server.stop()


def test_a_stalling_store_costs_each_sample_at_most_the_deadline(s3, demo_dataset, tmp_path):
    """A store that answers metadata but lets range reads hang: each read times out
    (PACKFEED_OBJECT_TIMEOUT_S) and is retried until the range deadline (PACKFEED_RANGE_DEADLINE_S), then its
    sample is skipped and reported; every rank's stream still comes to the end of the epoch."""
    upload(s3, demo_dataset.shards[:1], "stalling/demo")
    index = tmp_path / "stalling.parquet"
    build_index(["s3://stalling/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
    keys = {r["key"] for r in read_index(index, ["key", "valid"])[0].to_pylist() if r["valid"]}
    proxy = FaultyProxy(s3.endpoint, tmp_path, every=0, delay_ms=4000, only_ranges=True).start()
    env = {**proxy.env, "PACKFEED_OBJECT_TIMEOUT_S": "0.5", "PACKFEED_RANGE_DEADLINE_S": "1.5",
           "PACKFEED_S3_ATTEMPTS": "1", "PACKFEED_MAX_SKIPPED_FRACTION": "1"}
    try:
        with LocalServer(index, workers=2, env=env) as server:
            served = epoch(server.target, "stalling")
    finally:
        proxy.stop()
    reasons = dict(served[""])
    assert set(served) == {""} and set(reasons) == keys and len(keys) > 10  # every sample reported, none lost
    assert all(reason.startswith("shard unreadable") and "past the deadline of 1.5 s" in reason
               for reason in reasons.values()), next(iter(reasons.values()))
