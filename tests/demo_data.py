"""Demo datasets for tests and benchmarks: real photographs written as WebDataset shards, then indexed."""

from __future__ import annotations

from pathlib import Path


def indexed_demo(root: Path, samples: int, shards: int, seed: int, image_policy: dict | None = None):
    """Write `samples` demo samples over `shards` tar files under `root` and index them (InternVL tiling at
    448 px unless `image_policy` says otherwise). Returns (DemoPaths, index path)."""
    from packfeed.server.tools.demo import write_demo_dataset
    from packfeed.server.index.indexer import IndexConfig, build_index

    paths = write_demo_dataset(root, samples=samples, shards=shards, seed=seed)
    index = root / "index.parquet"
    config = IndexConfig(tokenizer=str(paths.tokenizer), **({"image_policy": image_policy} if image_policy else {}))
    build_index([str(p) for p in paths.shards], index, config, workers=2, progress=False)
    return paths, index
