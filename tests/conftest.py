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
    from packfeed.server.lengths import index_from_lengths

    out = tmp_path_factory.mktemp("real") / "index.parquet"
    index_from_lengths(LENGTH_FILES, out)
    return out


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory):
    """60 demo samples over 3 shards, with the demo's deliberately broken samples."""
    from packfeed.server.demo import write_demo_dataset

    return write_demo_dataset(tmp_path_factory.mktemp("demo"), samples=60, shards=3, seed=1)
