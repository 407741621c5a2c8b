"""A step's loss per dataset, what a rank reports to a loss-driven mixture (docs/planning.md "Weights the loss
moves"): each target token's loss counted to the dataset of the sample it belongs to (`pack.sample_sources`),
summed over the rank's packs of the step, then `PackStream.report`ed as a mean per dataset over its tokens.

    losses = StepLosses()
    for pack in step.packs:
        logits = model(**inputs).logits                     # inputs = to_hf_inputs(pack, ...)
        losses.add(pack, *token_losses(logits[0], inputs["labels"][0]))
    losses.report(stream, step)                             # every step, {} when the rank held no samples

The framework faces (`PackfeedTrainer`, `PackfeedSFTTrainer`) do this by themselves on a loss-driven job.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from packfeed.client.model.shared_prefix import shared_tokens
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors, Step

ROWS_AT_ONCE = 512  # target tokens scored together: a chunk's float32 log-softmax is ROWS_AT_ONCE x vocabulary


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each position's next-token loss, whether it has a target), both (L,) on the CPU, without gradient: the
    target of position t is labels[t + 1]. Scored a chunk of target tokens at a time, so a large vocabulary never
    needs the row's whole log-softmax at once."""
    with torch.no_grad():
        targets = torch.roll(labels.long(), -1)
        targets[-1] = IGNORE_INDEX
        mask = targets != IGNORE_INDEX
        rows = torch.nonzero(mask).squeeze(-1)
        out = torch.zeros(labels.shape[0], dtype=torch.float64)
        for start in range(0, int(rows.numel()), ROWS_AT_ONCE):
            chunk = rows[start:start + ROWS_AT_ONCE]
            scored = F.cross_entropy(logits[chunk].float(), targets[chunk], reduction="none")
            out[chunk.cpu()] = scored.double().cpu()
        return out, mask.cpu()


def fused_token_losses(log_probs: torch.Tensor, label_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_losses` from a fused LM head's outputs (TRL's: `log_probs` and `label_mask` of the L - 1 shifted
    targets of one row), padded to the row's L positions."""
    with torch.no_grad():
        losses = torch.zeros(log_probs.shape[-1] + 1, dtype=torch.float64)
        mask = torch.zeros(log_probs.shape[-1] + 1, dtype=torch.bool)
        losses[:-1], mask[:-1] = -log_probs.detach().double().cpu(), label_mask.detach().bool().cpu()
        return losses, mask


def sums_by_dataset(pack: PackTensors, losses: torch.Tensor, mask: torch.Tensor,
                    shared_prefix: bool = False) -> dict[str, tuple[float, int]]:
    """{dataset: (summed loss, target tokens)} of one pack's row (`to_hf_inputs(pack, ...)`'s, laid out with
    `shared_prefix` as given; a guard segment past the samples holds no target). Position t's loss belongs to the
    sample of token t + 1."""
    if pack.empty or not pack.sample_sources:
        return {}
    bounds = pack.cu_seqlens.numpy().astype(np.int64)  # each sample whole: the wire's own bounds
    positions = np.flatnonzero(mask.numpy())
    targets = positions + 1
    layout = shared_tokens(pack) if shared_prefix else None
    if layout is not None:  # a shared row's token stands for the unshared token `source` names
        targets = layout.source[targets]
    if len(targets) and targets.max() >= bounds[-1]:
        raise ValueError(f"pack {pack.sample_keys}: a target past its samples' {bounds[-1]} tokens; give the losses "
                         "of its own row (to_hf_inputs of this pack)")
    names, dataset_of_sample = np.unique(pack.sample_sources, return_inverse=True)
    dataset = dataset_of_sample[np.searchsorted(bounds, targets, side="right") - 1]
    totals = np.bincount(dataset, weights=losses.numpy()[positions], minlength=len(names))
    tokens = np.bincount(dataset, minlength=len(names))
    return {str(name): (float(totals[k]), int(tokens[k])) for k, name in enumerate(names) if tokens[k]}


def means_and_counts(sums: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float]]:
    """({dataset: total / count}, {dataset: count}) of {dataset: [total, count]}, datasets of count 0 left out: what
    `PackStream.report` takes."""
    kept = {name: (total, n) for name, (total, n) in sums.items() if n}
    return {name: total / n for name, (total, n) in kept.items()}, {name: float(n) for name, (_, n) in kept.items()}


class StepLosses:
    """One rank's losses of one step, by dataset, until reported."""

    def __init__(self):
        self.sums: dict[str, list[float]] = {}

    def add(self, pack: PackTensors, losses: torch.Tensor, mask: torch.Tensor, shared_prefix: bool = False) -> None:
        for name, (total, tokens) in sums_by_dataset(pack, losses, mask, shared_prefix).items():
            entry = self.sums.setdefault(name, [0.0, 0])
            entry[0] += total
            entry[1] += tokens

    def report(self, stream, step: Step) -> None:
        """The mean loss per dataset over its target tokens, to `stream` for `step` ({} when none); then empty."""
        means, counts = means_and_counts(self.sums)
        self.sums = {}
        stream.report(means, counts, step=step)


def reward_losses(sources: list[str], rewards: list[float]) -> tuple[dict[str, float], dict[str, float]]:
    """A GRPO step's report to a loss-driven prompt mixture: per dataset (each response's prompt's), minus the mean
    reward of its responses, and their number. A response no reward function scored (NaN) is left out."""
    sums: dict[str, list[float]] = {}
    for source, reward in zip(sources, rewards):
        if reward == reward:
            entry = sums.setdefault(source, [0.0, 0])
            entry[0] -= reward
            entry[1] += 1
    return means_and_counts(sums)
