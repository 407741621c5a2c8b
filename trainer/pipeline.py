"""Pipeline parallelism applied to the layer list: P stages x D data-parallel replicas.

The model is never rewritten for parallelism: a stage is a run of consecutive layers (`StageModule`), a
partition is where the runs start, and `torch.distributed.pipelining` moves the carriers between them.
Ranks form a (dp, pp) mesh: global rank = replica * P + stage. Stage 0 of each replica reads its rank's
`PackStream`, pads the step to one shape and tells the other stages of its replica that shape (plus the
step's loss-token count) in a small broadcast; every stage then runs the step's schedule. A schedule is
built per microbatch shape and cached: pipelining sends fixed-shape activations.

The loss of each microbatch is its summed token loss / the global step's loss tokens (x D, because DDP
averages gradients over replicas), so the gradient equals that of the whole global batch's mean token
loss, whatever the packing, balancing or ordering.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from packfeed.trainer.batch import HEADER_FIELDS, StepShape
from packfeed.trainer.model import VLMConfig, example_carrier
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def validate_partition(bounds: list[int], n_layers: int, stages: int) -> list[int]:
    """`bounds` = [0, b1, ..., n_layers]: stage s runs layers bounds[s]:bounds[s+1], at least one each."""
    bounds = [int(b) for b in bounds]
    if len(bounds) != stages + 1 or bounds[0] != 0 or bounds[-1] != n_layers or \
            any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"partition {bounds} is not {stages} non-empty runs covering layers 0..{n_layers}: "
                         f"give {stages + 1} increasing boundaries from 0 to {n_layers}")
    return bounds


class StageModule(nn.Module):
    """Layers bounds[s]:bounds[s+1] of the model; `recompute[i]` recomputes layer i's activations in backward
    instead of keeping them (activation checkpointing, chosen per layer by `packfeed.trainer.recompute`)."""

    def __init__(self, layers: list[nn.Module], recompute: list[bool] | None = None,
                 autocast: torch.dtype | None = None, ends_model: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.recompute = list(recompute or [False] * len(layers))
        self.autocast, self.ends_model = autocast, ends_model

    def forward(self, *carrier: torch.Tensor) -> tuple[torch.Tensor, ...]:
        device = next((t.device.type for t in carrier), "cpu")
        with torch.autocast(device, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            for layer, again in zip(self.layers, self.recompute):
                if again and torch.is_grad_enabled():
                    carrier = checkpoint(layer, *carrier, use_reentrant=False)
                else:
                    carrier = layer(*carrier)
        if self.autocast is not None and not self.ends_model:  # one boundary dtype: half the bytes to send
            carrier = tuple(t.to(self.autocast) if t.is_floating_point() else t for t in carrier)
        return tuple(t.contiguous() for t in carrier)  # point-to-point sends need contiguous tensors


@dataclass
class Mesh:
    """This process's place in the (dp, pp) grid and the process groups that go with it."""

    dp: int
    pp: int
    rank: int
    device: torch.device
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None

    @property
    def replica(self) -> int:
        return self.rank // self.pp

    @property
    def stage(self) -> int:
        return self.rank % self.pp

    @property
    def first_stage_rank(self) -> int:
        return self.replica * self.pp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1


def make_mesh(dp: int, pp: int, device: torch.device) -> Mesh:
    """Groups for an initialised default process group of dp * pp ranks (every rank creates every group,
    in the same order, as torch.distributed requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dp * pp:
        raise ValueError(f"world size {world} != dp {dp} x pp {pp}: launch dp * pp processes")
    mesh = Mesh(dp, pp, rank, device)
    for replica in range(dp):
        group = dist.new_group([replica * pp + s for s in range(pp)])
        if replica == mesh.replica:
            mesh.pp_group = group
    for stage in range(pp):
        group = dist.new_group([r * pp + stage for r in range(dp)])
        if stage == mesh.stage:
            mesh.dp_group = group
    return mesh


def share_step_shape(mesh: Mesh, shape: StepShape | None) -> StepShape:
    """Stage 0 of a replica tells its other stages the step's shape; returns it on every stage."""
    header = shape.header() if shape is not None else torch.zeros(len(HEADER_FIELDS), dtype=torch.int64)
    if mesh.pp > 1:
        header = header.to(mesh.device)
        dist.broadcast(header, src=mesh.first_stage_rank, group=mesh.pp_group)
    return StepShape.of_header(header.cpu())


@dataclass
class PipelineRunner:
    """Runs one step of this stage's schedule; caches one schedule per microbatch shape. Stages get their
    activation shapes from `example_carrier` (static metadata), so no placeholder forward pass runs."""

    mesh: Mesh
    module: nn.Module  # the StageModule, wrapped in DDP when dp > 1
    microbatches: int
    model: VLMConfig
    bounds: list[int]
    schedule: str = "1f1b"
    cache_size: int = 8
    dtype: torch.dtype = torch.float32  # of the float activations crossing stage boundaries
    _schedules: OrderedDict = field(default_factory=OrderedDict)

    def _schedule_for(self, shape: StepShape):
        key = shape.key
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        first, last = self.bounds[self.mesh.stage], self.bounds[self.mesh.stage + 1]
        def example(layer: int) -> tuple[torch.Tensor, ...]:  # activations that carry gradients say so
            carrier = example_carrier(self.model, layer, shape.tokens, shape.tiles, shape.samples,
                                      self.mesh.device, self.dtype if 0 < layer < self.model.n_layers else
                                      torch.float32)
            return tuple(t.requires_grad_(t.is_floating_point() and layer > 0) for t in carrier)
        stage = PipelineStage(self.module, self.mesh.stage, self.mesh.pp, self.mesh.device,
                              input_args=example(first), output_args=example(last), group=self.mesh.pp_group)
        schedule = SCHEDULES[self.schedule](stage, n_microbatches=self.microbatches, loss_fn=self._loss,
                                            scale_grads=False)
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
        """One step; `args` (the padded microbatches) only on the first stage. Returns the microbatch losses
        (each summed token loss / global loss tokens, before the x D) on the last stage, else []."""
        schedule = self._schedule_for(shape)
        losses: list[torch.Tensor] = []
        normaliser = None
        if self.mesh.is_last:
            tokens = max(shape.step_loss_tokens, 1) / self.mesh.dp
            normaliser = torch.full((self.microbatches,), float(tokens), device=self.mesh.device)
        inputs = tuple(a.to(self.mesh.device, non_blocking=True) for a in args) if args is not None else ()
        if self.mesh.pp == 1:
            schedule.step(*inputs, target=normaliser, losses=losses)
        elif self.mesh.is_first:
            schedule.step(*inputs)
        elif self.mesh.is_last:
            schedule.step(target=normaliser, losses=losses)
        else:
            schedule.step()
        return [loss.detach() / self.mesh.dp for loss in losses]


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    if precision not in PRECISIONS:
        raise ValueError(f"parallel.precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def clip_gradients(stage: nn.Module, mesh: Mesh, max_norm: float) -> float:
    """Global gradient norm over the whole model (the pipeline's stages; DP replicas already hold the same
    averaged gradients), and clipping to `max_norm` when it is > 0. Returns the norm before clipping."""
    grads = [p.grad for p in stage.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=mesh.device)
    for grad in grads:
        squares += grad.detach().double().pow(2).sum()
    if mesh.pp > 1:
        dist.all_reduce(squares, group=mesh.pp_group)
    norm = float(squares.sqrt())
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm


def wrap_data_parallel(module: nn.Module, mesh: Mesh) -> nn.Module:
    if mesh.dp == 1:
        return module
    device_ids = [mesh.device.index] if mesh.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=mesh.dp_group)


def log(mesh: Mesh | None, message: str, everyone: bool = False) -> None:
    if mesh is None or everyone or mesh.rank == 0:
        print(f"[packfeed train{'' if mesh is None else f' r{mesh.rank}'}] {message}", file=sys.stderr, flush=True)


def broadcast_object(value, mesh: Mesh, src: int = 0):
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_over_world(value: float, mesh: Mesh) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())
