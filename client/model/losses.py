"""Per-token losses over a pack's own per-token tensors (a live job's `token.NAME`: advantages, old
log-probabilities, ...), for one packed row, whichever layout it is in (each sample whole, or its shared prefix
once: `to_hf_inputs(..., shared_prefix=True)`, `packfeed.client.model.shared_prefix`).

    inputs = to_hf_inputs(pack, "qwen2_vl", dp=world, shared_prefix=True)
    tensors = row_tensors(pack, shared_prefix=True)            # the per-token tensors in the row's layout
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0]
    logp, mask = token_logprobs(logits, inputs["labels"][0])   # each position's log-probability of its target
    loss = clipped_policy_loss(logp, tensors["old_logprobs"], tensors["advantages"], mask,
                               normalizer=pack.step_loss_tokens / world)

A position t predicts the token at t + 1 (the row's labels, shifted as the model's own loss shifts them): its
log-probability, and the per-token values of that token, line up at t. Every value is summed, then divided by
`normalizer` (the step's loss tokens over the data-parallel ranks, as `num_items_in_batch`), so a step's gradient
does not depend on how its samples were packed or laid out.
"""

from __future__ import annotations

import torch

from packfeed.client.model.shared_prefix import shared
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors


def row_tensors(pack: PackTensors, shared_prefix: bool = False) -> dict[str, torch.Tensor]:
    """The pack's per-token tensors by name, laid out as `to_hf_inputs(pack, ..., shared_prefix=...)` lays its
    row (float32, one value per token of the row)."""
    return (shared(pack) if shared_prefix else pack).token_tensors


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each position's target, whether it has one), both (L,): position t's target is
    labels[t + 1] (IGNORE_INDEX: none; the last position has none)."""
    targets = torch.roll(labels.long(), -1)
    targets[-1] = IGNORE_INDEX
    mask = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits if logits.dtype == torch.float64 else logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, picked, torch.zeros_like(picked)), mask


def shifted(values: torch.Tensor) -> torch.Tensor:
    """A per-token tensor aligned with `token_logprobs`: position t gets the value of token t + 1."""
    out = torch.roll(values, -1)
    out[-1] = 0
    return out


def weighted_token_loss(logp: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor,
                        normalizer: float) -> torch.Tensor:
    """-sum(weight x log-probability) over the targets, / normalizer: REINFORCE with per-token advantages as
    `weights` (a pack's per-token tensor, unshifted), or plain next-token loss with weights of 1."""
    return -(shifted(weights).to(logp.dtype) * logp * mask).sum() / normalizer


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        normalizer: float, epsilon: float = 0.2, epsilon_high: float | None = None) -> torch.Tensor:
    """The clipped policy-gradient loss of PPO and GRPO: per target token, -min(r A, clip(r, 1 - eps, 1 + eps_high)
    A) with r = exp(logp - old logp), summed and / normalizer. `old_logp` and `advantages` are the pack's
    per-token tensors (unshifted: the value of each token, as the producer put it); `epsilon_high`: DAPO's
    asymmetric upper clip (default epsilon)."""
    ratio = torch.exp(logp - shifted(old_logp).to(logp.dtype))
    advantage = shifted(advantages).to(logp.dtype)
    high = epsilon if epsilon_high is None else epsilon_high
    per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + high) * advantage)
    return (per_token * mask).sum() / normalizer
