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

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.isf import Caps, isf
from packfeed.server.plan.metrics import dist_ratio
from packfeed.v1.options import PlanConfig

SEARCH_SEED = 0x5EED  # caps are a property of the data and config, never of the run's seed or epoch
TOKEN_SLACK = 128  # OmniBal Table 6: token target = token cap - 128
MAX_CANDIDATES = 64
# Candidates are scored on a seeded subsample: samples per pack and Dist are averages that 65k samples
# (about 15k packs, 1.9k steps at DP 8) estimate well — on 1.2M- and 10M-sample mixes it picks the same
# caps as a 131k subsample — and the search stays fast on datasets of any size.
SEARCH_SAMPLE = 1 << 16


def default_targets(vision_cap: int, token_cap: int) -> tuple[int, int]:
    return vision_cap, max(1, token_cap - min(TOKEN_SLACK, token_cap // 32))


def tokens_per_vision_unit(vision: np.ndarray, tokens: np.ndarray) -> int:
    """OmniBal's ratio: mean token length binned up to 256, over mean vision units, rounded to 16."""
    mean_vision = float(vision.mean())
    if mean_vision <= 0:
        return 0
    binned_mean = float(((tokens.astype(np.int64) + 255) // 256).mean() * 256.0)
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
    packs = isf(np.flatnonzero(fits), vision, tokens, caps, iterations, rng)
    order = rng.permutation(len(packs.vision))
    usable = len(order) // dp * dp
    steps_v = packs.vision[order[:usable]].reshape(-1, dp)
    steps_t = packs.tokens[order[:usable]].reshape(-1, dp)
    spp = len(packs.members) / max(1, len(packs.vision))
    return CapsCandidate(caps, spp, dist_ratio(steps_v), dist_ratio(steps_t))


def search_caps(vision: np.ndarray, tokens: np.ndarray, dp: int, samples_per_pack: float,
                iterations: int, start_tokens: int = 4096) -> tuple[Caps, list[CapsCandidate]]:
    """Caps and targets for valid samples' loads; returns the choice and every candidate tried."""
    if len(tokens) == 0:
        raise ValueError("no valid samples to derive caps from")
    ratio = tokens_per_vision_unit(vision, tokens)
    if len(tokens) > SEARCH_SAMPLE:
        keep = np.sort(np.random.default_rng(SEARCH_SEED).choice(len(tokens), SEARCH_SAMPLE, replace=False))
        vision, tokens = vision[keep], tokens[keep]
    vision = np.asarray(vision, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    text_only = ratio == 0
    if text_only:
        # No vision at all: only the token cap matters; step it by one average sample.
        ratio = max(16, int(tokens.mean()) // 16 * 16)
        vision_start = 0
    else:
        vision_start = max(1, start_tokens // ratio)

    tried: dict[int, CapsCandidate] = {}

    def evaluate(k: int) -> CapsCandidate:
        if k not in tried:
            token_cap = start_tokens + k * ratio
            vision_cap = int(vision.max()) * 2 + 1 if text_only else vision_start + k
            tried[k] = evaluate_caps(vision, tokens, Caps(vision_cap, token_cap,
                                                          *default_targets(vision_cap, token_cap)), dp, iterations)
        return tried[k]

    # Candidate k has (vision_start + k) units and (start_tokens + k * ratio) tokens. Samples per pack grow
    # with k, so the accepted window [B, B + 1] is one run of k: jump near it from the first candidate's
    # fill, step down to just below it, then up through it. OmniBal walks up from k = 0 instead; both end
    # with the same accepted candidates, ours after fewer ISF runs.
    lowest = max(0 if text_only else 1 - vision_start, -((start_tokens - 1) // ratio))
    first = evaluate(0)
    guess = int(round(((samples_per_pack + 0.5) / max(first.samples_per_pack, 1e-9) - 1) * start_tokens / ratio))
    # Past caps that hold every sample at once nothing changes: a first candidate that packs nothing (a few, very
    # long samples) must not send the guess to caps no wire field holds
    every_sample = max(-(-(int(tokens.sum()) - start_tokens) // ratio), int(vision.sum()) - vision_start)
    k = min(max(lowest, guess), max(every_sample, lowest + MAX_CANDIDATES))
    while len(tried) < MAX_CANDIDATES and k > lowest and evaluate(k).samples_per_pack >= samples_per_pack:
        k -= 1
    while len(tried) < MAX_CANDIDATES and evaluate(k).samples_per_pack <= samples_per_pack + 1:
        k += 1
    accepted = [c for c in tried.values() if samples_per_pack <= c.samples_per_pack <= samples_per_pack + 1]

    if accepted:
        best = min(accepted, key=lambda c: (c.score, c.caps.token_cap))
    else:
        # Nothing landed in the window (tiny or odd data): take the closest average pack size.
        best = min(tried.values(), key=lambda c: (abs(c.samples_per_pack - samples_per_pack), c.score))
    return best.caps, sorted(tried.values(), key=lambda c: c.caps.token_cap)


def resolve_caps(loads: SampleLoads, config: PlanConfig) -> Caps:
    """Caps from the config, completed with default targets, or searched from the data."""
    if config.vision_cap is not None:
        vt, tt = default_targets(config.vision_cap, config.token_cap)
        return Caps(config.vision_cap, config.token_cap,
                    config.vision_target if config.vision_target is not None else vt,
                    config.token_target if config.token_target is not None else tt)
    valid = loads.valid
    if not valid.any():
        return Caps(1, 1, 1, 1)  # nothing to pack: the plan is empty whatever the caps
    everything = valid.all()
    caps, _ = search_caps(loads.vision if everything else loads.vision[valid],
                          loads.tokens if everything else loads.tokens[valid], config.dp, config.samples_per_pack,
                          config.isf_iterations)
    if config.vision_target is not None or config.token_target is not None:
        caps = Caps(caps.vision_cap, caps.token_cap,
                    config.vision_target if config.vision_target is not None else caps.vision_target,
                    config.token_target if config.token_target is not None else caps.token_target)
    return caps
