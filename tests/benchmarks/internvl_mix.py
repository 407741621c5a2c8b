"""An InternVL-1.2M-like mix of per-sample lengths, shaped by the real subsets in ../shared/data/lengths.

InternVL-Chat-1.2's 1.2M SFT set is mostly single-image instruction data (ShareGPT4V / LLaVA mix:
COCO, GQA, OCR-VQA, TextVQA, VG), chart and document QA (DVQA, ChartQA, DocVQA, AI2D, SynthDoG) and some
text-only chat. The generator draws each sample from one family:

| family                  | share | vision units (448 px tiles, max 4 + thumbnail)   | LLM tokens                       |
|-------------------------|-------|--------------------------------------------------|----------------------------------|
| chart / diagram QA      | 35%   | resampled from the real ai2d + chartqa pairs     | the real pair's tokens, +-10%    |
| natural-image chat      | 45%   | 1, 3, 4 or 5 tiles (weights .25/.15/.15/.45)     | 256 x tiles + lognormal text     |
|                         |       |                                                  | (median 120, sigma 0.9)          |
| documents / OCR         | 12%   | 5 tiles                                          | 1280 + lognormal (median 300)    |
| text-only chat          | 8%    | 1 dummy tile (as the length files record it)     | lognormal (median 350, sigma 1)  |

Token lengths are clipped to [16, 8192]. Seeded: the same (n, seed) gives the same arrays.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LENGTHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "lengths"


def real_pairs() -> tuple[np.ndarray, np.ndarray]:
    import json

    vit, tok = [], []
    for name in ("ai2d_train_12k.json", "chartqa_train_18k.json"):
        for record in json.loads((LENGTHS / name).read_text()):
            vit.append(record["vit_num"])
            tok.append(record["token_num"])
    return np.asarray(vit, np.int64), np.asarray(tok, np.int64)


def internvl_like_mix(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    real_vit, real_tok = real_pairs()
    family = rng.choice(4, size=n, p=[0.35, 0.45, 0.12, 0.08])
    vision = np.empty(n, np.int64)
    tokens = np.empty(n, np.int64)

    chart = family == 0
    pick = rng.integers(0, len(real_vit), size=int(chart.sum()))
    vision[chart] = real_vit[pick]
    tokens[chart] = (real_tok[pick] * rng.uniform(0.9, 1.1, size=len(pick))).astype(np.int64)

    natural = family == 1
    tiles = rng.choice([1, 3, 4, 5], size=int(natural.sum()), p=[0.25, 0.15, 0.15, 0.45])
    vision[natural] = tiles
    tokens[natural] = 256 * tiles + rng.lognormal(np.log(120), 0.9, size=len(tiles)).astype(np.int64)

    docs = family == 2
    vision[docs] = 5
    tokens[docs] = 1280 + rng.lognormal(np.log(300), 0.8, size=int(docs.sum())).astype(np.int64)

    text = family == 3
    vision[text] = 1
    tokens[text] = rng.lognormal(np.log(350), 1.0, size=int(text.sum())).astype(np.int64)
    return vision, np.clip(tokens, 16, 8192)


def write_mix_index(n: int, out: Path, seed: int = 0) -> Path:
    from packfeed.server.index.lengths import write_lengths_index

    vision, tokens = internvl_like_mix(n, seed)
    write_lengths_index(vision, tokens, vision, out, [f"internvl-like-mix-{n}"], np.zeros(n, np.int32))
    return out
