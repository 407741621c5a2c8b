"""Demo datasets for tests and benchmarks: real photographs written as WebDataset shards, then indexed."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


# The presets' image policies (tests hold the fast path and the GPU decoder to their bound at these sizes).
PRESET_POLICIES = [{"name": "internvl"}, {"name": "qwen2vl"}, {"name": "qwen2vl", "factor": 32, "patch_size": 16},
                   {"name": "fixed"}, {"name": "fixed", "resize": "crop"}]


def demo_image_files(demo_dataset, suffixes: tuple[str, ...] = ("jpg", "jpeg", "png")) -> list[bytes]:
    """Every demo image file with one of these suffixes that decodes (the demo breaks a few on purpose)."""
    files = []
    for shard in demo_dataset.shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.rsplit(".", 1)[-1] in suffixes:
                    data = tar.extractfile(member).read()
                    try:
                        Image.open(io.BytesIO(data)).load()
                    except OSError:
                        continue
                    files.append(data)
    return files


def indexed_demo(root: Path, samples: int, shards: int, seed: int, image_policy: dict | None = None):
    """Write `samples` demo samples over `shards` tar files under `root` and index them (InternVL tiling at
    448 px unless `image_policy` says otherwise). Returns (DemoPaths, index path)."""
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import write_demo_dataset

    paths = write_demo_dataset(root, samples=samples, shards=shards, seed=seed)
    index = root / "index.parquet"
    config = IndexConfig(tokenizer=str(paths.tokenizer), **({"image_policy": image_policy} if image_policy else {}))
    build_index([str(p) for p in paths.shards], index, config, workers=2, progress=False)
    return paths, index


def document_scan(seed: int, size: tuple[int, int] = (1700, 2200)) -> bytes:
    """A page of text at scanning resolution (a 1700 x 2200 letter page at 200 dpi), as a JPEG."""
    from PIL import ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    page = Image.new("RGB", size, (250, 250, 246))
    draw = ImageDraw.Draw(page)
    font = ImageFont.load_default(size=28)
    words = ["packing", "balanced", "vision", "language", "model", "training", "pipeline", "tokens", "tiles"]
    y = 120
    while y < size[1] - 150:
        line = " ".join(rng.choice(words, size=int(rng.integers(6, 11))))
        draw.text((130, y), line, fill=(20, 20, 20), font=font)
        y += 44
    buffer = io.BytesIO()
    page.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A plain tar of samples: (key, {suffix: bytes}), members in that order."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def indexed_scans(root: Path, pages: int, tokenizer: Path, image_policy: dict | None = None) -> tuple[list[Path], Path]:
    """`pages` document scans, each asked about in a short conversation, in one shard, indexed (InternVL tiling
    at 448 px unless `image_policy` says otherwise). Returns (shards, index path)."""
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    root.mkdir(parents=True, exist_ok=True)
    conversation = json.dumps({"conversations": [
        {"from": "human", "value": "<image>\nTranscribe the first line of this page."},
        {"from": "gpt", "value": "The page is about balanced vision language model training."}]}).encode()
    shard = write_shard(root / "scans-0.tar", [(f"scan{page:05d}", {"jpg": document_scan(page), "json": conversation})
                                               for page in range(pages)])
    index = root / "index.parquet"
    config = IndexConfig(tokenizer=str(tokenizer), **({"image_policy": image_policy} if image_policy else {}))
    build_index([str(shard)], index, config, workers=2, progress=False)
    return [shard], index
