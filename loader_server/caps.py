"""Automatic caps and targets from the data: OmniBal's threshold search (§5.2), made fast.

OmniBal derives a tokens-per-vision-unit ratio from the dataset (mean token length, binned to 256,
over mean vision units, rounded to 16), then walks candidates (V0 + k units, T0 + k * ratio tokens)
from T0 = 4096 tokens. For each candidate it runs ISF and keeps those whose average samples per pack
lands in [B, B + 1]; among them it picks the lowest Pad + ViT Dist + LLM Dist of randomly formed steps
(which measures how uniform the packs themselves are). Targets are the vision cap and the token cap
minus 128 (its Table 6). We follow the same search; ISF is compiled, so each candidate costs
milliseconds instead of seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.server.isf import Caps, isf
from packfeed.server.metrics import dist_ratio

SEARCH_SEED = 0x5EED  # caps are a property of the data and config, never of the run's seed or epoch
TOKEN_SLACK = 128  # OmniBal Table 6: token target = token cap - 128
MAX_CANDIDATES = 64
# Candidates are scored on a seeded subsample: samples per pack and Dist are averages that a quarter
# million samples estimate well, and the search stays fast on datasets of any size.
SEARCH_SAMPLE = 1 << 18


def default_targets(vision_cap: int, token_cap: int) -> tuple[int, int]:
    return vision_cap, max(1, token_cap - min(TOKEN_SLACK, token_cap // 32))


def tokens_per_vision_unit(vision: np.ndarray, tokens: np.ndarray) -> int:
    """OmniBal's ratio: mean token length binned up to 256, over mean vision units, rounded to 16."""
    mean_vision = float(vision.mean())
    if mean_vision <= 0:
        return 0
    binned_mean = float((np.ceil(tokens / 256.0) * 256.0).mean())
    return int(((binned_mean // mean_vision + 1) // 16) * 16)


@dataclass
class CapsCandidate:
    caps: Caps
    samples_per_pack: float
    vit_dist: float
    llm_dist: float

    @property
    def score(self) -> float:
        return self.vit_dist + self.llm_dist  # packs have no padding: Pad Ratio is 0


def evaluate_caps(vision, tokens, caps: Caps, dp: int, iterations: int) -> CapsCandidate:
    rng = np.random.default_rng(SEARCH_SEED)
    fits = (vision <= caps.vision_cap) & (tokens <= caps.token_cap)
    members, offsets = isf(np.flatnonzero(fits), vision, tokens, caps, iterations, rng)
    starts = offsets[:-1]
    pack_v = np.add.reduceat(vision[members], starts) if len(starts) else np.zeros(0)
    pack_t = np.add.reduceat(tokens[members], starts) if len(starts) else np.zeros(0)
    order = rng.permutation(len(starts))
    usable = len(order) // dp * dp
    steps_v = pack_v[order[:usable]].reshape(-1, dp)
    steps_t = pack_t[order[:usable]].reshape(-1, dp)
    spp = len(members) / max(1, len(starts))
    return CapsCandidate(caps, spp, dist_ratio(steps_v), dist_ratio(steps_t))


def search_caps(vision: np.ndarray, tokens: np.ndarray, dp: int, samples_per_pack: float,
                iterations: int, start_tokens: int = 4096) -> tuple[Caps, list[CapsCandidate]]:
    """Caps and targets for valid samples' loads; returns the choice and every candidate tried."""
    vision = np.asarray(vision, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) == 0:
        raise ValueError("no valid samples to derive caps from")
    ratio = tokens_per_vision_unit(vision, tokens)
    if len(tokens) > SEARCH_SAMPLE:
        keep = np.sort(np.random.default_rng(SEARCH_SEED).choice(len(tokens), SEARCH_SAMPLE, replace=False))
        vision, tokens = vision[keep], tokens[keep]
    text_only = ratio == 0
    if text_only:
        # No vision at all: only the token cap matters; step it by one average sample.
        ratio = max(16, int(tokens.mean()) // 16 * 16)
        vision_start = 0
    else:
        vision_start = max(1, start_tokens // ratio)

    tried: dict[int, CapsCandidate] = {}
    accepted: list[CapsCandidate] = []
    k = 0
    while len(tried) < MAX_CANDIDATES and k not in tried:
        token_cap = start_tokens + k * ratio
        vision_cap = int(vision.max()) * 2 + 1 if text_only else vision_start + k
        if token_cap < 1 or vision_cap < 1:
            break
        caps = Caps(vision_cap, token_cap, *default_targets(vision_cap, token_cap))
        candidate = evaluate_caps(vision, tokens, caps, dp, iterations)
        tried[k] = candidate
        if samples_per_pack <= candidate.samples_per_pack <= samples_per_pack + 1:
            accepted.append(candidate)
        overshoot = max(c.samples_per_pack for c in tried.values()) > samples_per_pack + 1
        if overshoot and accepted:
            break
        k = k - 1 if overshoot else k + 1

    if accepted:
        best = min(accepted, key=lambda c: (c.score, c.caps.token_cap))
    else:
        # Nothing landed in the window (tiny or odd data): take the closest average pack size.
        best = min(tried.values(), key=lambda c: (abs(c.samples_per_pack - samples_per_pack), c.score))
    return best.caps, sorted(tried.values(), key=lambda c: c.caps.token_cap)
