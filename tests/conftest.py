"""Shared fixtures: real length files from ../shared, and a small real WebDataset written with webdataset."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LENGTHS_DIR = REPO.parent / "shared" / "data" / "lengths"
LENGTH_FILES = [LENGTHS_DIR / "ai2d_train_12k.json", LENGTHS_DIR / "chartqa_train_18k.json"]


def real_lengths_available() -> bool:
    return all(p.exists() for p in LENGTH_FILES)


@pytest.fixture(scope="session")
def real_index(tmp_path_factory) -> Path:
    """Both InternVL-1.2M subsets (30,730 samples) imported as an index."""
    if not real_lengths_available():
        pytest.skip(f"real length files not found under {LENGTHS_DIR}")
    from packfeed.server.index.lengths import index_from_lengths

    out = tmp_path_factory.mktemp("real") / "index.parquet"
    index_from_lengths(LENGTH_FILES, out)
    return out


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory):
    """60 demo samples over 3 shards, with the demo's deliberately broken samples."""
    from packfeed.server.tools.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), samples=60, shards=3, seed=1)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, demo_dataset) -> Path:
    """The demo shards copied into a folder of their own and indexed there with the default settings: the index
    the serving tests share (read-only: a test that breaks shards copies them first)."""
    import shutil

    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    root = tmp_path_factory.mktemp("served")
    shards = [shutil.copy(p, root / p.name) for p in demo_dataset.shards]
    index = root / "index.parquet"
    build_index([str(p) for p in shards], index, IndexConfig(tokenizer=str(demo_dataset.tokenizer)), workers=1,
                progress=False)
    return index


# Small tiles keep the reference trainer's CPU tests fast: InternVL tiling at 112 px, 16 tokens per tile.
SMALL_TILE_POLICY = {"name": "internvl", "image_size": 112, "tokens_per_tile": 16, "max_num": 4}


@pytest.fixture(scope="session")
def small_tile_index(tmp_path_factory) -> Path:
    """40 demo samples (real photographs) over 2 shards, indexed with 112 px InternVL tiles."""
    from demo_data import indexed_demo

    return indexed_demo(tmp_path_factory.mktemp("small-tiles"), 40, 2, 3, SMALL_TILE_POLICY)[1]


@pytest.fixture(scope="session")
def routed_steps(small_tile_index):
    """routed_steps(dp, colocate=False): every step of one epoch for every rank of a DP `dp`, M 2 isf+phases job
    (ranks_per_node 2), served over real gRPC by an embedded server, routed or colocated, tensors copied out of
    the messages: {rank: [Step, ...]}. Served once per (dp, colocate) in a session."""
    from packfeed.client import LocalServer, PackStream

    served = {}

    def steps_of(dp: int, colocate: bool = False) -> dict:
        if (dp, colocate) not in served:
            steps = {}
            with LocalServer(small_tile_index, workers=1) as server:
                for rank in range(dp):
                    # collective_safe off: laid out in whole columns, this small epoch needs no routing at DP 2
                    stream = PackStream(server.target, job="phases", rank=rank, dp=dp, microbatches=2, seed=0,
                                        strategy="isf+phases", ranks_per_node=2, colocate_encoder=colocate,
                                        collective_safe=False)
                    steps[rank] = list(stream)
                    for step in steps[rank]:
                        for pack in step.packs:
                            pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
            served[(dp, colocate)] = steps
        return served[(dp, colocate)]

    return steps_of


@pytest.fixture(scope="session")
def served_steps(small_tile_index):
    """Every step of one epoch for both ranks of a DP 2, M 2 job, received over real gRPC from an embedded
    server, with tensors copied out of the messages: {rank: [Step, ...]}."""
    from packfeed.client import LocalServer, PackStream

    steps = {}
    with LocalServer(small_tile_index, workers=1) as server:
        for rank in range(2):
            stream = PackStream(server.target, job="trainer-tests", rank=rank, dp=2, microbatches=2,
                                pipeline_stages=2, seed=0)
            steps[rank] = list(stream)
            for step in steps[rank]:
                for pack in step.packs:
                    pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
    return steps


# The suite runs on 2 pytest-xdist workers, each test file whole on one (`--dist loadfile`), files handed out in
# collection order. The longest files go first, so that the short ones fill in at the end and both workers finish
# together, instead of one starting a minutes-long file when the other is nearly done. Measured with
# `--durations=0` (each file's total, on 2026-12-03); a file not listed keeps its place after these. The Makefile
# passes --no-loadscope-reorder: xdist otherwise reorders files by their number of tests.
LONGEST_FILES = ["test_vllm_rollouts.py", "test_examples.py", "test_hf_train.py", "test_hf_pipeline_train.py",
                 "test_trainer_disaggregated.py", "test_object_storage.py", "test_integrations.py",
                 "test_trainer_pipeline.py", "test_trl_grpo.py", "test_demo_command.py", "test_trainer_phases.py",
                 "test_moving_mixture.py", "test_cp_trainer.py", "test_trainer_pinned.py", "test_failover.py",
                 "test_cloud_storage.py", "test_async_rl.py", "test_warmup.py", "test_elastic.py", "test_mixture.py",
                 "test_service.py", "test_live.py"]


def pytest_collection_modifyitems(session, config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
