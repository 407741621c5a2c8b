"""The one training loop, for every model and parallel layout: `Loop` drives a step runner
(`packfeed.trainer.parallel.runner.StepRunner`) and owns what every layout shares: the optimizer, the
learning-rate schedule, checkpoints and the resume from them, and one metrics line per step.

Every step: this rank takes its next step from its source (ranks without a stream take none) -> the runner
agrees the step with every rank (or that the run stops) -> forward and backward -> the runner completes and
clips the gradients -> AdamW and the schedule step -> every `checkpoint.every` steps a sharded checkpoint ->
rank 0 writes the metrics line.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from packfeed.trainer import checkpoint
from packfeed.trainer.config import TrainConfig
from packfeed.trainer.metrics import step_record, write_record
from packfeed.trainer.parallel.profile import synchronize
from packfeed.trainer.parallel.runner import StepRunner


class Loop:
    """Trains `runner` until optim.steps or the end of the stream. `resume_from`: the checkpoint to load first
    (its weights, optimizer and schedule; the stream was opened at its position)."""

    def __init__(self, runner: StepRunner, config: TrainConfig, out: Path, resume_from: Path | None = None):
        self.runner, self.config, self.mesh, self.out = runner, config, runner.mesh, out
        self.optimizer = torch.optim.AdamW(runner.parameters(), lr=config.optim.lr,
                                           weight_decay=config.optim.weight_decay)
        warmup = max(config.optim.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.saved = runner.checkpoint_module()
        if resume_from:
            checkpoint.load_sharded(resume_from, self.saved, self.optimizer, self.scheduler)

    def run(self, steps_done: int) -> list[dict]:
        with (self.out / "metrics.jsonl").open("a") if self.mesh.rank == 0 else contextlib.nullcontext() as metrics:
            history = []
            limit, every = self.config.optim.steps or 1 << 62, self.config.checkpoint.every
            while steps_done < limit:
                record = self.step()
                if record is None:
                    break
                history.append(record)
                steps_done += 1
                if every and steps_done % every == 0:
                    self.save(steps_done)
                write_record(metrics, record, len(history), self.config.log_every, self.mesh)
        return history

    def step(self) -> dict | None:
        runner, mesh, source = self.runner, self.mesh, self.runner.source
        started = time.perf_counter()
        wait_before = source.data_wait_s if source else 0.0
        work = source.next() if source else None
        shape = runner.agree(work)
        if shape.stop:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        if mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(mesh.device)
        computing, busy_started = time.perf_counter(), time.process_time()
        tally = runner.train_step(shape, work)
        # CPU time of this process while the step ran ~ its compute (a blocked receive sleeps): the bubble fraction
        tally.busy_s = time.process_time() - busy_started if mesh.device.type == "cpu" else float("nan")
        tally.compute_s = time.perf_counter() - computing
        grad_norm = runner.clip_gradients(self.config.optim.clip_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        synchronize(mesh.device)  # step times measure work done
        elapsed = time.perf_counter() - started
        wait = (source.data_wait_s - wait_before) if source else 0.0
        peak = torch.cuda.max_memory_allocated(mesh.device) if mesh.device.type == "cuda" else 0
        return step_record(mesh, shape, tally, elapsed, wait, peak, grad_norm)

    def save(self, steps_done: int) -> None:
        source = self.runner.source
        checkpoint.save_sharded(self.out / "checkpoints", steps_done, self.mesh, self.saved, self.optimizer,
                                self.scheduler, source.state_dict() if source else None, self.runner.meta,
                                self.config.checkpoint.keep)
