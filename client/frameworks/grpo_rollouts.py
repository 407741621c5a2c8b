"""A TRL GRPO batch's scored rollouts as live samples, and their per-token tensors at the loss's positions
(`packfeed.client.frameworks.trl` puts the one and trains on the other)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from packfeed.client.model.losses import shifted
from packfeed.client.rollouts.prompts import Prompt


def scored_rollouts(batch: dict[str, Any], prompts: list[Prompt], loss_type: str, total: int,
                    max_completion_length: int, pad: int | None) -> list[dict[str, Any]]:
    """This rank's rollouts (the rows of TRL's scored `batch`, one per entry of `prompts`) as live samples: the
    prompt's tokens then the completion's, the completion in the loss (where TRL's mask keeps it), per-token
    advantages and loss weights (each token's share of the global step's normalisation under `loss_type`; `total`:
    the step's completions over every rank), and, where TRL corrects vLLM's sampling, its importance ratios."""
    prompt_ids, prompt_mask = batch["prompt_ids"].cpu(), batch["prompt_mask"].cpu().bool()
    completion_ids, completion_mask = batch["completion_ids"].cpu(), batch["completion_mask"].cpu()
    mask = completion_mask * batch["tool_mask"].cpu() if "tool_mask" in batch else completion_mask
    advantages = batch["advantages"].cpu().float()
    ratios = batch.get("importance_sampling_ratio")
    if ratios is not None:  # (B, T) per token, or (B, 1) per sequence
        ratios = ratios.detach().cpu().float().expand(completion_ids.shape)
    items = float(batch["num_items_in_batch"].clamp(min=1.0).item())
    out = []
    for i, prompt in enumerate(prompts):
        kept = mask[i].bool()
        length = completion_length(completion_ids[i], kept, pad)
        loss = kept[:length].to(torch.uint8)
        weight = {"dapo": 1.0 / items,
                  "grpo": 1.0 / (max(int(loss.sum()), 1) * total),
                  "dr_grpo": 1.0 / (total * max_completion_length)}[loss_type]
        tokens = torch.cat([prompt_ids[i][prompt_mask[i]], completion_ids[i][:length]])
        prompt_length = len(tokens) - length
        per_token = torch.zeros(len(tokens))
        per_token[prompt_length:] = 1.0
        tensors = {"advantages": (per_token * advantages[i]).numpy(), "loss_weight": (per_token * weight).numpy()}
        if ratios is not None:
            ratio = torch.ones(len(tokens))
            ratio[prompt_length:] = ratios[i][:length]
            tensors["importance_ratio"] = ratio.numpy()
        out.append({"tokens": tokens.numpy().astype(np.int32),
                    "loss_mask": np.concatenate([np.zeros(prompt_length, np.uint8), loss.numpy()]),
                    "group": prompt.key, "prompt": prompt.key, "tensors": tensors})
    return out


def completion_length(ids: torch.Tensor, kept: torch.Tensor, pad: int | None) -> int:
    """A completion's tokens in TRL's right-padded row: through its last kept token, or, when TRL masked it whole
    (a truncated completion under `mask_truncated_completions`), through its last token that is not padding."""
    if kept.any():
        return int(kept.nonzero().max()) + 1
    real = (ids != pad).nonzero() if pad is not None else torch.arange(len(ids)).unsqueeze(1)
    return int(real.max()) + 1 if len(real) else 0


def aligned(values: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
    """A per-token tensor at the positions of `token_logprobs`. The row may be longer than the pack's tokens (the
    dummy items `ensure_encoders` appends, an empty pack's ignored token): those positions get 0."""
    out = torch.zeros_like(logp)
    if values is not None:
        count = min(len(values), len(logp))
        out[:count] = values[:count].to(device=logp.device, dtype=logp.dtype)
    return shifted(out)
