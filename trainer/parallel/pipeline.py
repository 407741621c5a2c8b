"""Pipeline parallelism applied to a model's layer list: P ranks per replica x D data-parallel replicas.

The model is never rewritten for parallelism: a stage is a run of consecutive layers (`StageModule`), a
partition is where the runs start, and `torch.distributed.pipelining` moves the carriers between them.
Ranks form a (dp, pp) mesh (`packfeed.trainer.parallel.mesh`). With the interleaved 1F1B schedule each rank
holds V stages (virtual stages: rank r runs stages r, r + P, ...; smaller warm-up bubbles), so a partition has
P x V runs. The rank holding stage 0 of each replica reads its rank's `PackStream`, pads the step to one shape
and tells the replica's other ranks that shape (plus the step's loss-token count) in a small broadcast; every
rank then runs the step's schedule. A schedule is built per microbatch shape and cached: pipelining sends
fixed-shape activations, whose shapes come from the model's `carrier` (static metadata), so no placeholder
forward pass runs.

The loss of each microbatch is its summed token loss / the global step's loss tokens (x D, because DP
averages gradients over replicas), so the gradient equals that of the whole global batch's mean token
loss, whatever the packing, balancing or ordering.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from packfeed.trainer.batch import HEADER_FIELDS, StepShape
from packfeed.trainer.parallel.mesh import Mesh


def schedule_class(name: str):
    """torch's schedule class for parallel.schedule `name` (imported here: torch.distributed.pipelining takes
    seconds to import, which a run that never pipelines does not pay)."""
    from torch.distributed import pipelining

    return {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe,
            "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B}[name]


def validate_partition(bounds: list[int], n_layers: int, stages: int, first: int = 0) -> list[int]:
    """`bounds` = [first, b1, ..., n_layers]: stage s runs layers bounds[s]:bounds[s+1], at least one each
    (`first` > 0: the layers before it are not in the pipeline, as the encoder with parallel.encoder=bubbles)."""
    bounds = [int(b) for b in bounds]
    if len(bounds) != stages + 1 or bounds[0] != first or bounds[-1] != n_layers or \
            any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"partition {bounds} is not {stages} non-empty runs covering layers {first}..{n_layers}: "
                         f"give {stages + 1} increasing boundaries from {first} to {n_layers}")
    return bounds


def separate_encoder_layers(model, placement: str) -> int:
    """The layers 0:e of the model's vision encoder and projector, for a placement that runs them apart from the
    LLM's layers (parallel.encoder=bubbles, phases or disaggregated)."""
    vision = getattr(model, "vision", None)
    if vision is None:
        raise ValueError(f"parallel.encoder={placement} needs a model whose vision encoder separates from its "
                         f"LLM; {model.describe()} does not: use parallel.encoder=stages")
    return vision.encoder_layers


def rank_stages(mesh: Mesh, virtual: int) -> list[int]:
    """The pipeline stages this rank runs, in order: its stage in each of the V loops over the P ranks."""
    return [mesh.stage + v * mesh.pp for v in range(virtual)]


class StageModule(nn.Module):
    """Layers lo:hi of the model, named by their index in the whole model (so parameter names, and a
    checkpoint's keys, do not depend on the partition). `recompute[i]` recomputes the stage's i-th layer's
    activations in backward instead of keeping them (chosen per layer by `packfeed.trainer.parallel.recompute`)."""

    def __init__(self, layers: nn.ModuleList, lo: int, hi: int, recompute: list[bool] | None = None,
                 autocast: torch.dtype | None = None, ends_model: bool = False):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(lo, hi)})
        self.lo, self.hi = lo, hi
        self.recompute = list(recompute or [False] * (hi - lo))
        self.autocast, self.ends_model = autocast, ends_model

    def forward(self, *carrier: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = next((t.device.type for t in carrier), "cpu")
        with torch.autocast(device, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            for layer, again in zip(self.layers.values(), self.recompute):
                if again and torch.is_grad_enabled():
                    carrier = checkpoint(layer, *carrier, use_reentrant=False)
                else:
                    carrier = layer(*carrier)
        if self.autocast is not None and not self.ends_model:  # one boundary dtype: half the bytes to send
            carrier = tuple(t.to(self.autocast) if t.is_floating_point() else t for t in carrier)
        return tuple(t.contiguous() for t in carrier)  # point-to-point sends need contiguous tensors


def share_step_shape(mesh: Mesh, shape: StepShape | None) -> StepShape:
    """The rank with stage 0 tells the replica's other ranks the step's shape; returns it on every rank."""
    header = shape.header() if shape is not None else torch.zeros(len(HEADER_FIELDS), dtype=torch.int64)
    if mesh.pp > 1:
        header = header.to(mesh.device)
        dist.broadcast(header, src=mesh.first_stage_rank, group=mesh.pp_group)
    return StepShape.of_header(header.cpu())


@dataclass
class PipelineRunner:
    """Runs one step of this rank's schedule; caches one schedule per microbatch shape."""

    mesh: Mesh
    modules: list[nn.Module]  # this rank's StageModules in stage order, each wrapped for data parallelism
    stages: list[int]  # their stage indexes
    microbatches: int
    model: object  # the LayerModel (its `carrier` gives every boundary's shapes)
    bounds: list[int]
    schedule: str = "1f1b"
    cache_size: int = 8
    dtype: torch.dtype = torch.float32  # of the float activations crossing stage boundaries
    _schedules: OrderedDict = field(default_factory=OrderedDict)

    def _example(self, layer: int, shape: StepShape) -> tuple[torch.Tensor, ...]:
        """Activations that carry gradients say so; the first layer's inputs and the loss are fp32."""
        inner = 0 < layer < self.model.n_layers
        carrier = self.model.carrier(layer, shape, self.mesh.device, self.dtype if inner else torch.float32)
        return tuple(t.requires_grad_(t.is_floating_point() and layer > 0) for t in carrier)

    def _schedule_for(self, shape: StepShape):
        key = shape.key
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining import PipelineStage

        total = len(self.bounds) - 1
        stages = [PipelineStage(module, index, total, self.mesh.device,
                                input_args=self._example(self.bounds[index], shape),
                                output_args=self._example(self.bounds[index + 1], shape), group=self.mesh.pp_group)
                  for module, index in zip(self.modules, self.stages)]
        kind = schedule_class(self.schedule)
        schedule = kind(stages if self.schedule == "interleaved_1f1b" else stages[0],
                        n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedules[key] = schedule
        if len(self._schedules) > self.cache_size:
            self._schedules.popitem(last=False)
        return schedule

    def _loss(self, output, normaliser: torch.Tensor) -> torch.Tensor:
        # output: the head's (summed token loss,); normaliser: the global step's loss tokens / D, handed to
        # each microbatch by the schedule as its target
        loss_sum = output[0] if isinstance(output, (tuple, list)) else output
        return loss_sum.sum() / normaliser.sum()

    def run(self, shape: StepShape, args: tuple[torch.Tensor, ...] | None) -> list[torch.Tensor]:
        """One step; `args` (the padded microbatches) only on the rank with stage 0. Returns the microbatch
        losses (each summed token loss / global loss tokens, before the x D) on the rank with the last stage."""
        schedule = self._schedule_for(shape)
        losses: list[torch.Tensor] = []
        has_first, has_last = 0 in self.stages, len(self.bounds) - 2 in self.stages
        target = None
        if has_last:
            tokens = max(shape.step_loss_tokens, 1) / self.mesh.dp
            target = torch.full((self.microbatches,), float(tokens), device=self.mesh.device)
        inputs = tuple(a.to(self.mesh.device, non_blocking=True) for a in args) if args is not None else ()
        if has_first and has_last:
            schedule.step(*inputs, target=target, losses=losses)
        elif has_first:
            schedule.step(*inputs)
        elif has_last:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        return [loss.detach() / self.mesh.dp for loss in losses]


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    if precision not in PRECISIONS:
        raise ValueError(f"parallel.precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def clip_gradients(parameters: list[torch.Tensor], mesh: Mesh, max_norm: float) -> float:
    """Global gradient norm over the whole model (every stage's parameters once; DP replicas already hold the
    same averaged gradients), and clipping to `max_norm` when it is > 0. Returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=mesh.device)
    shards = torch.zeros((), dtype=torch.float64, device=mesh.device)  # FSDP2: this replica's shard of each
    for grad in grads:
        if hasattr(grad, "to_local"):
            shards += grad.to_local().detach().double().pow(2).sum()
        else:
            squares += grad.detach().double().pow(2).sum()
    if mesh.dp > 1:
        dist.all_reduce(shards, group=mesh.dp_group)
    squares += shards
    if mesh.pp > 1:
        dist.all_reduce(squares, group=mesh.pp_group)
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for kind in (True, False):  # DTensors and whole tensors apart: foreach ops take one kind at a time
            group = [g for g in grads if hasattr(g, "to_local") == kind]
            if group:
                torch._foreach_mul_(group, scale)
    return norm
