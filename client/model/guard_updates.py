"""A vision tower that only the guard called keeps its weights (`PackfeedTrainer(..., skip_guard_updates=...)`).

`ensure_encoders` gives every pack a dummy item for each tower it would not call, so sharded ranks stay in step
(packfeed.client.model.towers). The dummy's gradients are zeros, not `None`: on a step where no rank held a real image
or video, AdamW would still update the tower (its momentum decays into the weights, weight decay shrinks them),
which an unguarded run never does. Dropping those zero gradients before the optimizer steps restores the unguarded
run's trajectory, for optimizers that skip a parameter without a gradient (torch's; DeepSpeed's ZeRO optimizer
updates every parameter it holds, so it cannot be asked to).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import transformers

from packfeed.client.model.hf_families import visual_kinds
from packfeed.client.stream.tensors import Step

# what the supported families (Qwen2-VL and later, InternVL, LLaVA) call the modules that only visual items reach
TOWER_MODULES = ("visual", "vision_tower", "multi_modal_projector")


def tower_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of the model's vision tower(s) and projector, found by their module names."""
    return [parameter for name, parameter in model.named_parameters()
            if any(part in TOWER_MODULES for part in name.split("."))]


def visual_items(step: Step | None) -> int:
    """The real images and videos in this rank's packs of `step` (the guard's dummies are added later)."""
    if step is None:
        return 0
    return sum(len(visual_kinds(pack)) for pack in step.packs if not pack.empty)


class SkipGuardOnlyTowerUpdates(transformers.TrainerCallback):
    """Before each optimizer step: when no rank's step held a visual item, the tower's gradients (the guard's
    zeros) become `None`, so the optimizer leaves the tower as an unguarded run would. One all-reduce of a
    count per step, on every rank alike."""

    def __init__(self, batches: Any):
        self.batches = batches  # PackBatches: `.step` is the step whose packs the Trainer is training on
        self._parameters: list[torch.nn.Parameter] | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.batches.ensure_encoders:
            return
        items = visual_items(self.batches.step)
        if dist.is_available() and dist.is_initialized():
            count = torch.tensor([items], dtype=torch.long, device=args.device)
            dist.all_reduce(count)
            items = int(count.item())
        if items:
            return
        if self._parameters is None:  # after the Trainer wrapped the model (FSDP2 swaps parameters for DTensors)
            self._parameters = tower_parameters(model)
            if not self._parameters:
                warnings.warn("skip_guard_updates: no vision tower parameters found by name (modules "
                              f"{', '.join(TOWER_MODULES)}; FSDP without use_orig_params flattens them), so a "
                              "step with no image updates the tower from the guard's zero gradients; pass "
                              "skip_guard_updates=False to silence this", RuntimeWarning, stacklevel=2)
        for parameter in self._parameters:
            parameter.grad = None
