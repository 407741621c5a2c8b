"""This rank's part of a model (`LayerModel`) under a partition: its stage modules, their data-parallel
wrapping, the pipeline runner, the training step the loop drives (a `StepRunner`), and the trial steps that
partition search and adaptive recompute time and measure. Trials run forward and backward on buffered steps and then drop the gradients: the weights, the
optimizer state (not yet made) and the stream position stay as they were, so a run with the search trains
exactly as a run given its chosen partition."""

from __future__ import annotations

import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from packfeed.trainer.batch import Microbatches, StepShape
from packfeed.trainer.parallel.bubbles import BubbleRunner, Channel
from packfeed.trainer.parallel.data_parallel import wrap_data_parallel
from packfeed.trainer.parallel.phases import PhaseRunner
from packfeed.trainer.parallel.mesh import Mesh, max_over_world
from packfeed.trainer.parallel.pipeline import PipelineRunner, StageModule, autocast_dtype, clip_gradients, \
    rank_stages, separate_encoder_layers, share_step_shape
from packfeed.trainer.parallel.profile import SavedBytes, synchronize
from packfeed.trainer.parallel.runner import StepTally
from packfeed.trainer.parallel.tied import TiedParameters

ADAMW_BYTES_PER_PARAM = 16  # fp32 weight + gradient + two moments


class RankStages:
    """Holds this rank's stages of the model and runs trial and training steps on them (a `StepRunner` once
    `use(..., final=True)` has fixed the partition)."""

    def __init__(self, config, mesh: Mesh, model, source):
        self.config, self.mesh, self.model, self.source = config, mesh, model, source
        self.kinds: list[str] = list(model.kinds)
        self.layers = model.layers  # on the CPU until a partition places this rank's layers on its device
        parallel = config.parallel
        self.virtual = parallel.virtual_stages if parallel.schedule == "interleaved_1f1b" else 1
        self.stage_ids = rank_stages(mesh, self.virtual)
        self.modules: list[StageModule] = []
        self.runner: PipelineRunner | None = None
        self.bounds: list[int] = []
        self.sharded = False
        self.tied: TiedParameters | None = None  # made with the final partition
        # parallel.encoder=bubbles or phases: the encoder (layers 0:first_layer) on every rank, apart from the
        # partition, which covers the rest
        self.bubbles = parallel.encoder == "bubbles"
        self.phases = parallel.encoder == "phases"
        self.first_layer = separate_encoder_layers(model, parallel.encoder) if self.bubbles or self.phases else 0
        self.encoder: StageModule | None = None
        self.channel = Channel(mesh) if self.bubbles else None  # collective on CUDA: made once, here
        self.meta: dict = {}  # the partition and recompute plan a checkpoint records (set by the trainer)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all: P, or P x V with virtual stages."""
        return self.mesh.pp * self.virtual

    def layer_ids(self, bounds: list[int]) -> list[int]:
        """The model's layers this rank's pipeline stages run under `bounds`, in stage order."""
        return [i for s in self.stage_ids for i in range(bounds[s], bounds[s + 1])]

    def held_layer_ids(self, bounds: list[int]) -> list[int]:
        """Every layer this rank holds: its stages', and the encoder's with parallel.encoder=bubbles."""
        return list(range(self.first_layer)) + self.layer_ids(bounds)

    def rank_kinds(self, bounds: list[int]) -> list[str]:
        return [self.kinds[i] for i in self.layer_ids(bounds)]

    def use(self, bounds: list[int], recompute: list[bool] | None = None, final: bool = False) -> None:
        """Build this rank's stages for `bounds` (recompute: per layer of `layer_ids(bounds)`). `final`: the
        partition to train with, wrapped as `parallel.data_parallel` says (FSDP2 shards the layers in place, so
        trials of other partitions run with DDP before it)."""
        if self.sharded:
            raise RuntimeError("the stages are sharded with FSDP2 already: a partition is final once chosen")
        precision = autocast_dtype(self.config.parallel.precision)
        plan = list(recompute) if recompute is not None else [False] * len(self.layer_ids(bounds))
        self.place(self.held_layer_ids(bounds))
        self.modules, offset = [], 0
        for s in self.stage_ids:
            lo, hi = bounds[s], bounds[s + 1]
            self.modules.append(StageModule(self.layers, lo, hi, plan[offset:offset + hi - lo], precision,
                                            hi == len(self.kinds)))
            offset += hi - lo
        self.bounds = list(bounds)
        kind = self.config.parallel.data_parallel if final else "ddp"
        if final:  # collective: the groups that sum the gradients of weights tied across ranks
            self.tied = TiedParameters(self.layers, self.layer_ranks(bounds), self.mesh, kind == "fsdp")
        if self.bubbles or self.phases:
            self._use_separate_encoder(precision)
            return
        ignored = self.tied.parameters if final else set()
        wrapped = [wrap_data_parallel(m, self.mesh, kind, self.kinds[m.lo:m.hi], self.config.parallel.precision,
                                      ignored) for m in self.modules]
        self.sharded = kind == "fsdp" and self.mesh.dp > 1
        self.runner = PipelineRunner(self.mesh, wrapped, self.stage_ids, self.config.data.microbatches, self.model,
                                     self.bounds, self.config.parallel.schedule, dtype=precision or torch.float32)

    def _use_separate_encoder(self, precision) -> None:
        """The encoder on this rank and a runner that schedules it into the bubbles, or routes its work (gradients
        synchronised by the runner, so the modules are not wrapped for data parallelism)."""
        self.encoder = StageModule(self.layers, 0, self.first_layer, None, precision)
        (stage,) = self.modules
        if self.phases:
            self.runner = PhaseRunner(self.mesh, self.encoder, stage, self.model, self.config.data.microbatches,
                                      precision or torch.float32)
            return
        self.runner = BubbleRunner(self.mesh, self.encoder, stage, self.model, self.bounds,
                                   self.config.data.microbatches, self.config.parallel.schedule,
                                   precision or torch.float32, self.channel)

    def layer_ranks(self, bounds: list[int]) -> list[int]:
        """The pipeline rank running each layer (stage s runs on rank s mod P; with the encoder in the bubbles,
        every rank runs the encoder: counted as the first stage's)."""
        return [0 if i < bounds[0] else
                next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1]) % self.mesh.pp
                for i in range(len(self.kinds))]

    def place(self, layer_ids: list[int]) -> None:
        """This rank's layers on its device, the others on the CPU (a weight two layers share follows the
        layer this rank runs: moved last)."""
        mine = set(layer_ids)
        for i, layer in enumerate(self.layers):
            if i not in mine:
                layer.to("cpu")
        for i in layer_ids:
            self.layers[i].to(self.mesh.device)

    def set_recompute(self, plan: list[bool]) -> None:
        """Change which layers recompute without rebuilding the stages (the schedules hold the same modules)."""
        offset = 0
        for module in self.modules:
            module.recompute = list(plan[offset:offset + len(module.recompute)])
            offset += len(module.recompute)

    @property
    def recompute(self) -> list[bool]:
        return [again for module in self.modules for again in module.recompute]

    def parameters(self) -> list[torch.nn.Parameter]:
        seen, out = set(), []
        for module in self.modules + ([self.encoder] if self.encoder is not None else []):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def norm_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients this rank adds to the global norm: each weight counted once (a tied
        copy by one rank; the encoder in the bubbles, which every rank holds, by the first stage)."""
        counted = self.tied.counted(self.parameters()) if self.tied is not None else self.parameters()
        if self.encoder is not None and not self.mesh.is_first:
            encoder = {id(p) for p in self.encoder.parameters()}
            counted = [p for p in counted if id(p) not in encoder]
        return counted

    def zero_grad(self) -> None:
        for module in self.modules + ([self.encoder] if self.encoder is not None else []):
            module.zero_grad(set_to_none=True)

    def checkpoint_module(self) -> torch.nn.Module:
        """This rank's layers under their index in the model: a checkpoint's keys whatever the partition."""
        holder = torch.nn.Module()
        holder.layers = torch.nn.ModuleDict({str(i): self.layers[i] for i in self.held_layer_ids(self.bounds)})
        return holder

    def agree(self, batch: Microbatches | None) -> StepShape:
        """The step's shape from the rank with stage 0 (`stop` when its stream ended)."""
        if self.source is not None and batch is None:
            return share_step_shape(self.mesh, StepShape(0, 0, 0, 0, stop=True))
        return share_step_shape(self.mesh, batch.shape if batch is not None else None)

    def train_step(self, shape: StepShape, batch: Microbatches | None) -> StepTally:
        """One step of the schedule: the loss on the last stages, the sizes fed on the first."""
        losses = self.run_schedule(shape, batch)
        tally = StepTally(float(sum(loss.item() for loss in losses)), stats=dict(getattr(self.runner, "last_stats", {})))
        if batch is not None:
            m = self.config.data.microbatches
            tally.tokens, tally.padded_tokens = batch.real_tokens, shape.tokens * m
            tally.tiles, tally.padded_tiles = batch.real_tiles, shape.tiles * m
            tally.samples_by_dataset = batch.samples_by_dataset
            if self.mesh.rank == 0:  # replica 0's padded microbatches, for the pipeline simulator
                tally.microbatches = [asdict(self.model.features(batch.microbatch(k, m))) for k in range(m)]
        return tally

    def clip_gradients(self, max_norm: float) -> float:
        self.tied.sync_gradients()
        return clip_gradients(self.norm_parameters(), self.mesh, max_norm)

    def run_step(self, batch: Microbatches | None) -> tuple[StepShape, list[torch.Tensor]]:
        shape = self.agree(batch)
        return shape, self.run_schedule(shape, batch)

    def run_schedule(self, shape: StepShape, batch: Microbatches | None) -> list[torch.Tensor]:
        """One step of the runner on this rank's part of `batch` (the step's shape agreed by every rank)."""
        if self.phases:
            return self.runner.run(shape, batch)
        return self.runner.run(shape, batch.args if batch is not None else None)

    def trial(self, batches: list[Microbatches | None]) -> float:
        """Seconds for these steps (slowest rank), weights untouched."""
        dist.barrier()
        started = time.perf_counter()
        for batch in batches:
            self.run_step(batch)
        synchronize(self.mesh.device)
        elapsed = time.perf_counter() - started
        self.zero_grad()
        return max_over_world(elapsed, self.mesh)

    def timed_trial(self, batch: Microbatches | None) -> tuple[float, int]:
        """One trial step: this rank's seconds (not the slowest rank's) and its peak bytes (see `peak_bytes`)."""
        started = time.perf_counter()
        peak = self.peak_bytes(batch)
        return time.perf_counter() - started, peak

    def peak_bytes(self, batch: Microbatches | None) -> int:
        """Peak memory of one trial step on this rank. CUDA: the allocator's peak plus AdamW's moments, not yet
        allocated during trials. CPU: the weights, gradients and AdamW state plus the peak bytes autograd keeps
        for backward (counted by saved-tensor hooks), because torch keeps no CPU allocator statistics."""
        params = self.parameters()
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        if self.mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.mesh.device)
            self.run_step(batch)
            synchronize(self.mesh.device)
            peak = torch.cuda.max_memory_allocated(self.mesh.device) + local * 8
        else:
            with SavedBytes(params) as saved:
                self.run_step(batch)
            peak = saved.peak + local * ADAMW_BYTES_PER_PARAM
        self.zero_grad()
        return int(peak)

