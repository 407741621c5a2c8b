"""The long-video mix of the context-parallel tests and benchmark: short image SFT samples (InternVL-1.2M's real
lengths when ../shared has them, else a synthetic stand-in) plus videos of 8K to 128K tokens, log-uniform (each
frame's 256 tokens one vision unit), as an OmniBal length file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LENGTHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "lengths"
VIDEO_TOKENS = (8192, 131072)
TOKENS_PER_FRAME = 256


def write_long_video_mix(path: Path, videos: float = 0.05, short: int | None = None, seed: int = 0) -> Path:
    """`videos`: the share of video samples beside the short ones; `short`: how many short samples (default all
    of the real subsets, or 4000 synthetic ones)."""
    rng = np.random.default_rng(seed)
    files = sorted(LENGTHS.glob("*.json"))
    if files:
        records = [r for f in files for r in json.loads(f.read_text())]
        if short is not None:
            records = [records[k] for k in np.sort(rng.choice(len(records), short, replace=False))]
    else:
        n = short or 4000
        vision = rng.integers(1, 7, n)
        records = [{"vit_num": int(v), "token_num": int(v * 256 + rng.integers(30, 600))} for v in vision]
    n_videos = max(1, int(round(len(records) * videos / (1 - videos))))
    tokens = np.exp(rng.uniform(*np.log(VIDEO_TOKENS), n_videos)).astype(int)
    records += [{"vit_num": int(t // TOKENS_PER_FRAME), "token_num": int(t)} for t in tokens]
    order = rng.permutation(len(records))
    path.write_text(json.dumps([records[k] for k in order]))
    return path
