"""Balanced adaptive recompute (OmniBal §4.3, appendix A.1.1), per pipeline stage.

Step 1: trial step with every transformer block of the stage recomputed -> memory A.
Step 2: trial steps with the stage's ViT blocks kept (not recomputed), then its LLM blocks kept -> B, C.
Step 3: memory per kept block: m_vit = (B - A) / n_vit, m_llm = (C - A) / n_llm.
Step 4: keep the blocks that save the most recompute time while A + k_vit m_vit + k_llm m_llm fits the
        budget; verify with a trial step; on failure recompute one more block and try again.

Memory of a trial step: CUDA — torch.cuda.max_memory_allocated (everything the stage holds); CPU — the
stage's parameter, gradient and AdamW state bytes plus the peak of activations saved for backward
(`SavedBytes`), because torch keeps no CPU allocator statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

BLOCK_KINDS = ("vit", "llm")


@dataclass
class RecomputeDecision:
    stage: int
    layers: list[bool]  # per layer of the stage: recompute it
    budget_bytes: int
    measured: dict[str, int] = field(default_factory=dict)  # trial name -> peak bytes
    per_block_bytes: dict[str, float] = field(default_factory=dict)
    fits: bool = True

    @property
    def recomputed(self) -> int:
        return sum(self.layers)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_for(kinds: Sequence[str], keep: dict[str, int], order: dict[str, list[int]]) -> list[bool]:
    """Recompute every block except the first `keep[kind]` of `order[kind]`."""
    kept = {i for kind in BLOCK_KINDS for i in order.get(kind, [])[:keep.get(kind, 0)]}
    return [kind in BLOCK_KINDS and i not in kept for i, kind in enumerate(kinds)]


def choose_keep(counts: dict[str, int], per_block: dict[str, float], block_seconds: dict[str, float],
                headroom: float) -> dict[str, int]:
    """Blocks to keep per kind: the most recompute time saved with k_vit m_vit + k_llm m_llm <= headroom."""
    best, best_saved = {kind: 0 for kind in BLOCK_KINDS}, -1.0
    for k_vit in range(counts.get("vit", 0) + 1):
        for k_llm in range(counts.get("llm", 0) + 1):
            cost = k_vit * max(per_block.get("vit", 0.0), 0.0) + k_llm * max(per_block.get("llm", 0.0), 0.0)
            saved = k_vit * block_seconds.get("vit", 0.0) + k_llm * block_seconds.get("llm", 0.0)
            if cost <= headroom and (saved, -(k_vit + k_llm)) > (best_saved, 0):
                best, best_saved = {"vit": k_vit, "llm": k_llm}, saved
    return best


def back_off(plan: list[bool], kinds: Sequence[str], per_block: dict[str, float],
             block_seconds: dict[str, float]) -> bool:
    """Recompute one more block: the kept one whose recomputation costs least time per byte it frees.
    Returns False when every block is already recomputed."""
    kept = [i for i, again in enumerate(plan) if kinds[i] in BLOCK_KINDS and not again]
    if not kept:
        return False
    cheapest = min(kept, key=lambda i: block_seconds.get(kinds[i], 0.0) / max(per_block.get(kinds[i], 1.0), 1.0))
    plan[cheapest] = True
    return True


def adaptive_recompute(stage: int, kinds: Sequence[str], block_seconds: dict[str, float], budget_bytes: int,
                       trial: Callable[[list[bool]], int], agree: Callable[[bool], bool] = lambda ok: ok,
                       max_rounds: int = 64) -> RecomputeDecision:
    """`trial(plan)` runs one real step with that per-layer plan and returns this stage's peak bytes.
    `block_seconds[kind]`: forward time of one block of that kind (what not recomputing it saves).
    `agree(done)` is True once every stage is done: in a pipeline all stages run each trial step together,
    so a stage that fits keeps trying its plan until the others fit too (the number of trials is the same
    everywhere). Budget 0 = no limit."""
    order = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in BLOCK_KINDS}
    counts = {kind: len(ids) for kind, ids in order.items()}
    everything = plan_for(kinds, {}, order)
    measured = {"all": trial(everything)}
    per_block: dict[str, float] = {}
    for kind in BLOCK_KINDS:  # every stage probes both kinds, so all run the same trials
        measured[f"keep_{kind}"] = trial(plan_for(kinds, {kind: counts[kind]}, order))
        if counts[kind]:
            per_block[kind] = (measured[f"keep_{kind}"] - measured["all"]) / counts[kind]
    keep = dict(counts) if budget_bytes <= 0 else \
        choose_keep(counts, per_block, block_seconds, budget_bytes - measured["all"])
    plan = plan_for(kinds, keep, order)
    fits = exhausted = False
    for attempt in range(max_rounds):
        peak = trial(plan)
        measured[f"verify_{attempt}"] = peak
        fits = budget_bytes <= 0 or peak <= budget_bytes
        if agree(fits or exhausted):
            break
        if not fits:
            exhausted = not back_off(plan, kinds, per_block, block_seconds)
    return RecomputeDecision(stage, plan, budget_bytes, measured, per_block, fits)
