"""Shards in Azure Blob Storage (`az://`): a real Azure-protocol server (Azurite, its own process on 127.0.0.1).
Indexing lists and streams the shards and records each blob's size and ETag; serving reads each sample with one
range request and delivers what local files give; an overwritten or deleted blob is detected and its samples
skipped with the reason."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("adlfs")

from azurite_server import AzuriteServer, install  # noqa: E402
from packfeed.client import LocalServer  # noqa: E402
from packfeed.server.index.indexer import build_index  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from s3_server import restore_env, set_env  # noqa: E402
from test_object_storage import epoch, index_config  # noqa: E402


@pytest.fixture(scope="module")
def azure():
    missing = install()
    if missing:
        pytest.skip(missing)
    server = AzuriteServer().start()
    previous = set_env(server.env)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()


def blob_store():
    import adlfs

    return adlfs.AzureBlobFileSystem(skip_instance_cache=True)  # the connection string from the environment


def upload(shards, container: str) -> list[str]:
    fs = blob_store()
    if not fs.exists(container):
        fs.mkdir(container)
    urls = [f"az://{container}/demo/{shard.name}" for shard in shards]
    for shard, url in zip(shards, urls):
        fs.put_file(str(shard), url)
    return urls


def test_index_and_serve_from_azure_blobs_as_from_local_files(azure, demo_dataset, tmp_path):
    urls = upload(demo_dataset.shards, "data")
    local, remote = tmp_path / "local.parquet", tmp_path / "azure.parquet"
    build_index([str(p) for p in demo_dataset.shards], local, index_config(demo_dataset), workers=1, progress=False)
    result = build_index(["az://data/demo/*.tar"], remote, index_config(demo_dataset), workers=2, progress=False)
    (local_table, _), (remote_table, info) = read_index(local), read_index(remote)
    assert info.inputs == urls and result.valid > 40
    assert local_table.drop(["shard"]).equals(remote_table.drop(["shard"]))
    assert set(info.objects) == set(urls) and all(o["etag"] and o["size"] > 0 for o in info.objects.values())

    with LocalServer(local, workers=1) as server:
        from_files = epoch(server.target, "local")
    with LocalServer(remote, workers=1, env=azure.env) as server:
        from_azure = epoch(server.target, "azure")
    assert set(from_azure) == set(from_files) and from_azure[""] == from_files[""]
    for key, tensors in from_files.items():
        if key:
            assert all(torch.equal(a, b) for a, b in zip(tensors, from_azure[key])), key


def test_an_overwritten_or_deleted_blob_is_detected(azure, demo_dataset, tmp_path):
    urls = upload(demo_dataset.shards, "changing")
    index = tmp_path / "changing.parquet"
    build_index(["az://changing/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
    rows = [r for r in read_index(index, ["key", "shard", "valid"])[0].to_pylist() if r["valid"]]
    changed = tmp_path / "changed.tar"
    shutil.copy(demo_dataset.shards[0], changed)
    with open(changed, "ab") as out:
        out.write(b"\0" * 10240)  # same members, another blob: a new size and ETag
    fs = blob_store()
    fs.put_file(str(changed), urls[0], overwrite=True)
    fs.rm(urls[-1])

    with LocalServer(index, workers=1, env={**azure.env, "PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as server:
        served = epoch(server.target, "changing")
    reasons = dict(served[""])
    on_first = {r["key"] for r in rows if r["shard"] == urls[0]}
    on_last = {r["key"] for r in rows if r["shard"] == urls[-1]}
    assert on_first and on_last
    assert all(reasons[key].startswith("shard changed") and "ETag" in reasons[key] for key in on_first)
    assert all(reasons[key].startswith("shard unreadable") for key in on_last), reasons
    assert set(served) - {""} == {r["key"] for r in rows} - on_first - on_last
