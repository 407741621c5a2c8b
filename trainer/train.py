"""The reference training loop: `torchrun --nproc-per-node N -m packfeed.trainer --config train.yaml`.

Read top to bottom: set up the (dp, pp) mesh -> open this replica's stream (first stage only) -> size
the model from the dataset's conventions the server reports -> decide the partition (search, or the saved
decision; a search also exports the measured cost model) -> decide recompute per stage (adaptive, or the
saved decision) -> train: every step the first stage pads the rank's M packs to one shape, the pipeline
runs 1F1B, the optimizer steps, rank 0 logs one line of metrics.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from packfeed.trainer import checkpoint
from packfeed.trainer.batch import Microbatches, StepShape
from packfeed.trainer.config import TrainConfig, dump_config, load_config
from packfeed.trainer.data import StepSource, job_conventions, open_stream, sized_model
from packfeed.trainer.decisions import decide_partition, decide_recompute, decision_key, export_cost_model
from packfeed.trainer.model import VLMConfig, build_layers, layer_kinds
from packfeed.trainer.pipeline import (
    Mesh,
    PipelineRunner,
    StageModule,
    autocast_dtype,
    broadcast_object,
    clip_gradients,
    log,
    make_mesh,
    max_over_world,
    share_step_shape,
    wrap_data_parallel,
)
from packfeed.trainer.profile import SavedBytes, synchronize
from packfeed.trainer.simulate import features_of_carrier

ADAMW_BYTES_PER_PARAM = 16  # fp32 weight + gradient + two moments


class Trainer:
    """Holds this rank's stage and runs trial and training steps on it."""

    def __init__(self, config: TrainConfig, mesh: Mesh, model: VLMConfig, source: StepSource | None):
        self.config, self.mesh, self.model, self.source = config, mesh, model, source
        self.kinds = layer_kinds(model)
        self.layers = build_layers(model).to(mesh.device)
        self.stage: StageModule | None = None
        self.runner: PipelineRunner | None = None

    def use(self, bounds: list[int], recompute: list[bool] | None = None) -> None:
        lo, hi = bounds[self.mesh.stage], bounds[self.mesh.stage + 1]
        precision = autocast_dtype(self.config.parallel.precision)
        self.stage = StageModule(list(self.layers[lo:hi]), recompute, precision, hi == len(self.kinds))
        self.runner = PipelineRunner(self.mesh, wrap_data_parallel(self.stage, self.mesh),
                                     self.config.data.microbatches, self.model, bounds,
                                     self.config.parallel.schedule, dtype=precision or torch.float32)

    def stage_kinds(self, bounds: list[int]) -> list[str]:
        return self.kinds[bounds[self.mesh.stage]:bounds[self.mesh.stage + 1]]

    def run_step(self, batch: Microbatches | None) -> tuple[StepShape, list[torch.Tensor]]:
        shape = share_step_shape(self.mesh, batch.shape if batch is not None else None)
        losses = self.runner.run(shape, batch.args if batch is not None else None)
        return shape, losses

    def trial(self, batches: list[Microbatches | None]) -> float:
        """Seconds for these steps (slowest rank), weights untouched."""
        dist.barrier()
        started = time.perf_counter()
        for batch in batches:
            self.run_step(batch)
        self.sync()
        elapsed = time.perf_counter() - started
        self.stage.zero_grad(set_to_none=True)
        return max_over_world(elapsed, self.mesh)

    def peak_bytes(self, batch: Microbatches | None) -> int:
        """Peak memory of one trial step on this stage (see packfeed.trainer.recompute)."""
        params = list(self.stage.parameters())
        if self.mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.mesh.device)
            self.run_step(batch)
            self.sync()
            peak = torch.cuda.max_memory_allocated(self.mesh.device) + \
                sum(p.numel() for p in params) * 8  # AdamW moments, not yet allocated during trials
        else:
            with SavedBytes(params) as saved:
                self.run_step(batch)
            peak = saved.peak + sum(p.numel() for p in params) * ADAMW_BYTES_PER_PARAM
        self.stage.zero_grad(set_to_none=True)
        return int(peak)

    def sync(self) -> None:
        synchronize(self.mesh.device)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_device(config: TrainConfig) -> torch.device:
    """CUDA: this process's own GPU (LOCAL_RANK). NCCL cannot put two ranks on one GPU, so a node must have a
    GPU per process; on one GPU the whole model runs as one stage (parallel.pp=1)."""
    device = torch.device(config.parallel.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return device
    local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= visible:
        raise ValueError(f"process {local_rank} on this node has no GPU of its own ({visible} visible): launch at "
                         f"most {visible} processes per node (dp x pp = {config.parallel.dp * config.parallel.pp} "
                         f"here; parallel.pp=1 runs all layers in one process), or train on parallel.device=cpu")
    return torch.device("cuda", local_rank)


def train(config: TrainConfig) -> dict:
    device = rank_device(config)
    if not dist.is_initialized():
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(name, value)  # a single process without torchrun
        backend = config.parallel.backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = make_mesh(config.parallel.dp, config.parallel.pp, device)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if mesh.rank == 0:
        (out / "config.json").write_text(dump_config(config))
    server, target = start_embedded_server(config, mesh)
    try:
        return train_on(config, mesh, target, out)
    finally:
        if server is not None:
            server.stop()


def start_embedded_server(config: TrainConfig, mesh: Mesh):
    """Without `data.target`, rank 0 starts a Packfeed server on loopback for `data.index` and every first
    stage streams from it (all ranks must then share one machine). Returns (server or None, target)."""
    if config.data.target:
        return None, config.data.target
    if not config.data.index:
        raise ValueError("set data.target (a Packfeed server, host:port) or data.index (start one here)")
    server = None
    if mesh.rank == 0:
        from packfeed.client import LocalServer

        server = LocalServer(config.data.index, workers=config.data.server_workers or None).start()
    return server, broadcast_object(server.target if server else "", mesh)


def train_on(config: TrainConfig, mesh: Mesh, target: str, out: Path) -> dict:
    if config.model.hf:
        from packfeed.trainer.hf_train import train_hf

        return train_hf(config, mesh, target, out)
    resume_from = checkpoint.latest(out / "checkpoints") if config.checkpoint.resume else None
    resumed = checkpoint.read_meta(resume_from) if resume_from else None
    if resumed:
        log(mesh, f"resuming from {resume_from} after {resumed['steps_done']} steps")
    stream = open_stream(config, mesh, target, resume_from) if mesh.is_first else None
    with contextlib.closing(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None and stream.info.HasField("resume"):
            log(mesh, f"the checkpoint was taken at another DP: job {stream.job!r} re-plans the rest of epoch "
                f"{stream.info.resume.epoch} for DP {mesh.dp} (elastic resume)")
        conventions = job_conventions(stream, mesh)
        model = sized_model(config.model, conventions)
        log(mesh, f"model sized for the dataset: {model.tile_size} px tiles, {model.tokens_per_tile} tokens per tile, "
            f"vocabulary {model.vocab_size} (image policy {conventions.image_policy.name})")
        source = StepSource(stream, model, config.data.token_multiple) if stream is not None else None
        trainer = Trainer(config, mesh, model, source)
        key = decision_key(config, model, mesh)

        # the checkpoint's weights belong to its partition
        bounds, measured = decide_partition(trainer, config, mesh, out, key, resumed["bounds"] if resumed else None)
        if measured is not None:
            cost_model = export_cost_model(measured, conventions, out / "cost_model.json")
            log(mesh, f"cost model measured on this hardware written to {out / 'cost_model.json'} {cost_model}: a later "
                f"run balances packs on it with data.cost_model={out / 'cost_model.json'}")
        recompute = decide_recompute(trainer, config, mesh, bounds, out, key)
        log(mesh, f"stage {mesh.stage}: layers {bounds[mesh.stage]}:{bounds[mesh.stage + 1]} "
            f"{trainer.stage_kinds(bounds)}, recompute {recompute.layers} "
            f"(budget {recompute.budget_bytes / 2**20:.0f} MiB, measured {recompute.measured})",
            everyone=mesh.replica == 0)

        if not recompute.fits:
            log(mesh, f"stage {mesh.stage} does not fit its {recompute.budget_bytes / 2**20:.0f} MiB budget even with every "
                f"block recomputed ({max(recompute.measured.values()) / 2**20:.0f} MiB measured): raise "
                f"recompute.budget_mb, use more pipeline stages or smaller packs", everyone=True)
        trainer.use(bounds, recompute.layers)
        optimizer = torch.optim.AdamW(trainer.stage.parameters(), lr=config.optim.lr,
                                      weight_decay=config.optim.weight_decay)
        warmup = max(config.optim.warmup_steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        if resume_from:
            checkpoint.load_stage(resume_from, mesh, trainer.stage, optimizer, scheduler)
        meta = {"bounds": bounds, "recompute": recompute.layers}
        history = run_training(trainer, optimizer, scheduler, config, mesh, out, meta,
                               resumed["steps_done"] if resumed else 0)
        summary = {"bounds": bounds, "recompute": recompute.layers, "steps": len(history),
                   "final_loss": history[-1]["loss"] if history else None}
        return {"summary": summary, "history": history}


def run_training(trainer: Trainer, optimizer, scheduler, config: TrainConfig, mesh: Mesh, out: Path, meta: dict,
                 steps_done: int = 0) -> list[dict]:
    with (out / "metrics.jsonl").open("a") if mesh.rank == 0 else contextlib.nullcontext() as metrics:
        return train_steps(trainer, optimizer, scheduler, config, mesh, meta, steps_done, metrics, out)


def train_steps(trainer: Trainer, optimizer, scheduler, config: TrainConfig, mesh: Mesh, meta: dict, steps_done: int,
                metrics, out: Path) -> list[dict]:
    """Train until optim.steps or the end of the stream; rank 0 writes one metrics line per step."""
    history = []
    step_limit = config.optim.steps or 1 << 62
    every = config.checkpoint.every
    while steps_done < step_limit:
        started = time.perf_counter()
        wait_before = trainer.source.data_wait_s if trainer.source else 0.0
        batch = trainer.source.next() if trainer.source else None
        if trainer.source is not None and batch is None:
            batch_shape = StepShape(0, 0, 0, 0, stop=True)
        else:
            batch_shape = batch.shape if batch is not None else None
        shape = share_step_shape(mesh, batch_shape)
        if shape.stop:
            break
        optimizer.zero_grad(set_to_none=True)
        if mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(mesh.device)
        pipeline_started, busy_started = time.perf_counter(), time.process_time()
        losses = trainer.runner.run(shape, batch.args if batch is not None else None)
        # CPU time of this process while the schedule ran ~ its compute (a blocked receive sleeps)
        busy = time.process_time() - busy_started if mesh.device.type == "cpu" else float("nan")
        pipeline_s = time.perf_counter() - pipeline_started
        grad_norm = clip_gradients(trainer.stage, mesh, config.optim.clip_grad_norm)
        optimizer.step()
        scheduler.step()
        trainer.sync()
        elapsed = time.perf_counter() - started
        wait = (trainer.source.data_wait_s - wait_before) if trainer.source else 0.0
        peak = torch.cuda.max_memory_allocated(mesh.device) if mesh.device.type == "cuda" else 0
        record = step_record(mesh, shape, batch, losses, elapsed, wait, config, busy, pipeline_s, peak)
        record["grad_norm"] = grad_norm
        history.append(record)
        steps_done += 1
        if every and steps_done % every == 0:
            checkpoint.save(out / "checkpoints", steps_done, mesh, trainer.stage, optimizer, scheduler,
                            trainer.source.state_dict() if trainer.source else None, meta, config.checkpoint.keep)
        write_record(metrics, record, len(history), config.log_every, mesh)
    return history


def write_record(metrics, record: dict, count: int, log_every: int, mesh: Mesh) -> None:
    """Rank 0: append the step's metrics line, and log it every `log_every` steps."""
    if metrics is None:
        return
    metrics.write(json.dumps(record) + "\n")
    metrics.flush()
    if count % log_every == 0:
        padding = f", padding {record['pad_fraction']:.1%}" if "pad_fraction" in record else ""
        log(mesh, f"epoch {record['epoch']} step {record['step']}: loss {record['loss']:.4f}, "
            f"{record['step_s'] * 1e3:.0f} ms, data wait {record['data_wait_s'] * 1e3:.0f} ms, "
            f"{record['tokens_per_s']:.0f} tokens/s{padding}")


def step_record(mesh: Mesh, shape: StepShape, batch: Microbatches | None, losses: list[torch.Tensor],
                elapsed: float, wait: float, config: TrainConfig, busy: float, pipeline_s: float,
                peak_bytes: int = 0) -> dict:
    """One world all-reduce of what each rank knows: loss (last stages), tokens and tiles (first stages),
    the slowest step time and data wait, the largest CUDA memory peak (0 on CPU), and each rank's busy time
    inside the schedule (CPU: process time) for the measured bubble fraction
    = 1 - sum(busy) / (ranks x slowest schedule time)."""
    first = batch is not None
    sums = torch.tensor([float(sum(loss.item() for loss in losses)),
                         float(batch.real_tokens) if first else 0.0,
                         float(shape.tokens * config.data.microbatches) if first else 0.0,
                         float(batch.real_tiles) if first else 0.0,
                         float(shape.tiles * config.data.microbatches) if first else 0.0, busy],
                        dtype=torch.float64, device=mesh.device)
    maxes = torch.tensor([elapsed, wait, pipeline_s, peak_bytes], dtype=torch.float64, device=mesh.device)
    dist.all_reduce(sums)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    loss, tokens, padded, tiles, padded_tiles, busy_sum = sums.tolist()
    step_s, wait_s, pipeline_max, peak_max = maxes.tolist()
    record = {"epoch": shape.epoch, "step": shape.step, "loss": loss, "step_s": step_s, "data_wait_s": wait_s,
              "tokens": int(tokens), "padded_tokens": int(padded), "tiles": int(tiles),
              "padded_tiles": int(padded_tiles), "tokens_per_s": tokens / step_s if step_s else 0.0,
              "pad_fraction": 1 - tokens / padded if padded else 0.0,
              "bubble_fraction": 1 - busy_sum / (mesh.dp * mesh.pp * pipeline_max) if pipeline_max else 0.0,
              "peak_memory_mib": peak_max / 2**20}
    counts = [None] * dist.get_world_size()  # samples per dataset over every replica (mixtures)
    dist.all_gather_object(counts, batch.samples_by_dataset if first else {})
    record["samples_by_dataset"] = dict(sum((collections.Counter(c) for c in counts), collections.Counter()))
    if first and mesh.rank == 0:  # replica 0's padded microbatches, for the pipeline simulator
        chunks = [a.tensor_split(config.data.microbatches) for a in batch.args]
        record["microbatches"] = [asdict(features_of_carrier(tuple(c[m] for c in chunks)))
                                  for m in range(config.data.microbatches)]
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="packfeed train", description="Reference pipeline trainer "
                                     "(launch with torchrun: one process per stage x replica).")
    parser.add_argument("--config", help="YAML/JSON TrainConfig")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=2 data.target=host:50051")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    try:
        train(config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
