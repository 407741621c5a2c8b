"""Shards in Azure Blob Storage (`az://`) and Google Cloud Storage (`gs://`), each against a real server of its
protocol (Azurite; gcp-storage-emulator), in its own process on 127.0.0.1. Indexing lists and streams the shards
and records each object's size and ETag; serving reads each sample with one range request and delivers what
local files give; an overwritten or deleted object is detected and its samples skipped with the reason."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# gcsfs reads this when imported; see cloud_servers.GcsServer
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from cloud_servers import AzuriteServer, GcsServer, install_azurite  # noqa: E402
from packfeed.client import LocalServer  # noqa: E402
from packfeed.server.index.indexer import build_index  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from s3_server import running  # noqa: E402
from test_object_storage import check_changed_and_deleted, epoch, index_config  # noqa: E402


@pytest.fixture(scope="module", params=["az", "gs"])
def store(request):
    if request.param == "az":
        pytest.importorskip("adlfs")
        missing = install_azurite()
        if missing:
            pytest.skip(missing)
        server = AzuriteServer()
    else:
        pytest.importorskip("gcsfs")
        pytest.importorskip("gcp_storage_emulator")
        server = GcsServer()
    with running(server):
        yield server


def upload(store, shards, bucket: str) -> list[str]:
    fs = store.filesystem()
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    urls = [f"{store.scheme}://{bucket}/demo/{shard.name}" for shard in shards]
    for shard, url in zip(shards, urls):
        fs.put_file(str(shard), url)
    return urls


def test_index_and_serve_from_a_cloud_store_as_from_local_files(store, demo_dataset, tmp_path):
    urls = upload(store, demo_dataset.shards, "data")
    local, remote = tmp_path / "local.parquet", tmp_path / "remote.parquet"
    build_index([str(p) for p in demo_dataset.shards], local, index_config(demo_dataset), workers=1, progress=False)
    result = build_index([f"{store.scheme}://data/demo/*.tar"], remote, index_config(demo_dataset), workers=2,
                         progress=False)
    (local_table, _), (remote_table, info) = read_index(local), read_index(remote)
    assert info.inputs == urls and result.valid > 40
    assert local_table.drop(["shard"]).equals(remote_table.drop(["shard"]))
    assert set(info.objects) == set(urls) and all(o["etag"] and o["size"] > 0 for o in info.objects.values())

    with LocalServer(local, workers=1) as server:
        from_files = epoch(server.target, "local")
    with LocalServer(remote, workers=1, env=store.env) as server:
        from_store = epoch(server.target, "remote")
    assert set(from_store) == set(from_files) and from_store[""] == from_files[""]
    for key, tensors in from_files.items():
        if key:
            assert all(torch.equal(a, b) for a, b in zip(tensors, from_store[key])), key


def test_an_overwritten_or_deleted_object_is_detected(store, demo_dataset, tmp_path):
    urls = upload(store, demo_dataset.shards, "changing")
    index = tmp_path / "changing.parquet"
    build_index([f"{store.scheme}://changing/demo/*.tar"], index, index_config(demo_dataset), workers=1,
                progress=False)
    rows = [r for r in read_index(index, ["key", "shard", "valid"])[0].to_pylist() if r["valid"]]
    changed = tmp_path / "changed.tar"
    shutil.copy(demo_dataset.shards[0], changed)
    with open(changed, "ab") as out:
        out.write(b"\0" * 10240)  # same members, another object: a new size and ETag
    fs = store.filesystem()
    fs.rm(urls[0])
    fs.put_file(str(changed), urls[0])
    fs.rm(urls[-1])

    with LocalServer(index, workers=1, env={**store.env, "PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as server:
        served = epoch(server.target, "changing")
    check_changed_and_deleted(served, rows, urls[0], urls[-1])
