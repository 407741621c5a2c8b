"""`packfeed index --ray`: per-shard indexing as tasks on a real local Ray cluster (`ray start --head` on
127.0.0.1) writes the index local indexing writes, fingerprint included; a task whose worker dies is run
again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("ray")

from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index  # noqa: E402
from packfeed.server.index.table import read_index  # noqa: E402
from ports import free_port  # noqa: E402


def start_ray(cpus: int) -> tuple[str, str]:
    """A Ray head on 127.0.0.1 (address, its temp dir). Token auth off for this test cluster and its driver: a
    token file another Ray left in ~/.ray would otherwise make them disagree."""
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    temp = tempfile.mkdtemp(prefix="/tmp/pfray")  # Ray's socket paths must stay short
    port = free_port()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    started = subprocess.run([ray, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
                              "--num-cpus", str(cpus), "--disable-usage-stats", "--include-dashboard=false",
                              "--temp-dir", temp], capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr[-3000:]
    return f"127.0.0.1:{port}", temp


def stop_ray(temp: str) -> None:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)
    shutil.rmtree(temp, ignore_errors=True)
    os.environ.pop("RAY_AUTH_MODE", None)


@pytest.fixture(scope="module")
def ray_cluster():
    address, temp = start_ray(2)
    try:
        yield address
    finally:
        stop_ray(temp)


def test_ray_indexing_writes_the_local_index_and_reruns_killed_tasks(ray_cluster, demo_dataset, tmp_path):
    marker = tmp_path / "crashed-once"
    # The first run of this shard kills the Ray worker that reads it (the shell's parent), as an OOM kill would
    crashing = f"pipe:test -e {marker} || {{ touch {marker}; kill -9 $PPID; }}; cat {demo_dataset.shards[1]}"
    shards = [str(demo_dataset.shards[0]), crashing, str(demo_dataset.shards[2])]
    config = IndexConfig(tokenizer=str(demo_dataset.tokenizer))
    on_ray = build_index(shards, tmp_path / "ray" / "index.parquet", config, progress=False, ray=ray_cluster)
    assert marker.exists()  # the worker did die once
    local = build_index(shards, tmp_path / "local" / "index.parquet", config, workers=2, progress=False)
    (ray_table, ray_info), (local_table, local_info) = read_index(on_ray.out), read_index(local.out)
    assert ray_table.equals(local_table) and ray_info.fingerprint == local_info.fingerprint
    assert not ray_info.skipped_shards and on_ray.rows == local.rows > 50



def test_ray_local_starts_its_own_instance_and_writes_the_same_index(demo_dataset, tmp_path):
    """`packfeed index --ray local` from the command line: a Ray instance of its own on this machine (its token
    file goes to the HOME of that process, here a temporary one, so no other Ray is disturbed)."""
    home = tmp_path / "home"
    home.mkdir()
    shards = [str(shard) for shard in demo_dataset.shards[:2]]
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "index", *shards, "--out",
                           str(tmp_path / "ray" / "index.parquet"), "--tokenizer", str(demo_dataset.tokenizer),
                           "--ray", "local", "--quiet"],
                          capture_output=True, text=True, timeout=600, env={**env, "HOME": str(home)})
    assert done.returncode in (0, 3), done.stderr[-3000:]
    local = build_index(shards, tmp_path / "local" / "index.parquet", IndexConfig(tokenizer=str(demo_dataset.tokenizer)),
                        workers=2, progress=False)
    (ray_table, ray_info), (local_table, local_info) = read_index(tmp_path / "ray" / "index.parquet"), read_index(local.out)
    assert ray_table.equals(local_table) and ray_info.fingerprint == local_info.fingerprint and len(local_table) > 20
