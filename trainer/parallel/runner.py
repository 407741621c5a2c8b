"""What the training loop (`packfeed.trainer.loop.Loop`) asks of a parallel layout: a step runner.

One runner per kind of layout (`packfeed.v1.layout.Layout.runner`, looked up in `packfeed.trainer.train.RUNNERS`):
`RankStages` (a layer list cut into pipeline stages, with DDP or FSDP2 within each stage and the encoder in the
stages, the bubbles or routed; `stages`), `WholeModelRunner` (a whole model on every data-parallel rank,
FSDP2-sharded over them, one pack at a time; `whole`), `ContextParallelRunner` (each pack over the GPUs its CP
plan gives it; `context_parallel`) and `DisaggregatedRunner` (the encoder on ranks of its own; `disaggregated`).
A new parallel dimension is a new runner (or a change inside one), never a second loop: the loop owns the step's
skeleton (timing, the device sync, the optimizer and the learning-rate schedule), checkpoints, resume and the
metrics line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from packfeed.trainer.batch import StepShape
from packfeed.trainer.parallel.mesh import Mesh

Work = TypeVar("Work")  # a runner's step input: the client's Step (whole, context_parallel) or Microbatches


class Source(Protocol[Work]):
    """This rank's steps as a runner trains on them (`packfeed.trainer.data.StepSource`)."""

    data_wait_s: float  # seconds spent waiting for the stream, in all

    def next(self) -> Work | None:
        """The next step, None at the end of the stream."""

    def peek(self, n: int) -> list[Work]:
        """The next `n` steps, kept for `next` (trial steps lose nothing)."""

    def state_dict(self) -> dict:
        """The stream position of the next step to train on."""


@dataclass
class StepTally:
    """What one rank measured of one training step; `packfeed.trainer.metrics.step_record` sums or maxes it
    over every rank into the step's metrics line. `loss` is this rank's share of the global step's mean token
    loss (the shares of all ranks sum to it); sizes count only what this rank fed the model (0 elsewhere)."""

    loss: float
    tokens: int = 0  # real tokens fed
    padded_tokens: int = 0  # token slots computed (real + padding)
    tiles: int = 0  # the vision tower's input units fed
    padded_tiles: int = 0
    # set by the loop around `train_step`: CPU time of this process inside it (CPU runs, for the bubble fraction)
    # and its wall time (forward and backward)
    busy_s: float = float("nan")
    compute_s: float = 0.0
    samples_by_dataset: dict[str, int] = field(default_factory=dict)
    microbatches: list[dict] | None = None  # rank 0: each microbatch's Features (the pipeline simulator reads them)
    stats: dict[str, Any] = field(default_factory=dict)  # the runner's own figures (the encoder apart, its exchange)
    # context parallelism: the packs this rank took part in (replica, microbatch, degree, cp_group, tokens, tiles,
    # square), gathered from every rank into the metrics line (`packfeed simulate --run` reads them)
    packs: list[tuple] = field(default_factory=list)
    # what the simulator needs of a layout's step, by name, each rank's rows merged (sorted) into the metrics line:
    # with encoder ranks, each LLM rank's microbatches and what each encoder rank encoded for whom
    rows: dict[str, list[tuple]] = field(default_factory=dict)


class StepRunner(Protocol[Work]):
    """A parallel layout of one model on this rank, as the loop drives it. `source`: this rank's steps, each
    prepared as the runner trains on it (`Work`), None on ranks that read no stream (pipeline stages after the
    first)."""

    mesh: Mesh
    source: Source[Work] | None
    meta: dict  # what a checkpoint records about the layout (the partition, the model family...)

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each once: what its optimizer steps."""

    def checkpoint_module(self) -> torch.nn.Module:
        """The module whose state dict a checkpoint saves (keys independent of the layout where it can)."""

    def agree(self, work: Work | None) -> StepShape:
        """Collective: the step every rank runs next (`work`: this rank's from its source, None without one),
        `stop` set on every rank when any stream ended."""

    def train_step(self, shape: StepShape, work: Work | None) -> StepTally:
        """Forward and backward of the step; gradients left in the parameters. The loop times it."""

    def clip_gradients(self, max_norm: float) -> float:
        """Collective: complete the gradients (weights tied across ranks), clip them to `max_norm` (0: no
        clipping) over the whole model and return the global norm before clipping."""



def agree_on_step(step, mesh: Mesh) -> StepShape:
    """For runners fed the client's steps unchanged: every rank has a step, or the run stops on all (a stream
    that ended on one rank ends it)."""
    flag = torch.tensor([0 if step is None else 1], device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        return StepShape(0, 0, 0, 0, stop=True)
    return StepShape(0, 0, 0, 0, epoch=step.epoch, step=step.step)
