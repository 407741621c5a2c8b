"""`packfeed train`: `torchrun --nproc-per-node N -m packfeed.trainer --config train.yaml`.

Read top to bottom: set up the (dp, cp, pp) mesh -> resume from the newest checkpoint, if any -> open this
replica's stream (the rank with stage 0 only) -> build the model (the reference VLM, or a `transformers` VLM:
`packfeed.trainer.models`) sized from the dataset's conventions the server reports -> apply its parallel
layout, a step runner (`packfeed.trainer.parallel`): a layer list cut into pipeline stages with the partition
decided (search, or the saved decision; a search also exports the measured cost model), recompute decided per
rank and the per-stage table printed; or, for a `transformers` model at parallel.pp=1, the whole model
FSDP2-sharded over the DP ranks; or, with context parallelism (parallel.cp), each pack split over the GPUs the
plan gives it; or, with encoder ranks (parallel.encoder=disaggregated), the encoder and the LLM on ranks of their
own -> the one loop (`packfeed.trainer.loop`) trains it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from packfeed.trainer import checkpoint
from packfeed.trainer.config import TrainConfig, dump_config, load_config
from packfeed.trainer.data import StepSource, job_conventions, open_stream
from packfeed.trainer.liveness import Liveness, name_the_silent
from packfeed.trainer.loop import Loop
from packfeed.trainer.models import build_model
from packfeed.trainer.decisions import (
    decide_partition,
    decide_recompute,
    decision_key,
    export_cost_model,
    llm_bounds,
    stage_table,
)
from packfeed.trainer.parallel.context_parallel import ContextParallelRunner
from packfeed.trainer.parallel.context_parallel_hf import HFContextParallelRunner
from packfeed.trainer.parallel.disaggregated import DisaggregatedRunner
from packfeed.trainer.parallel.mesh import Mesh, broadcast_object, log, make_mesh
from packfeed.trainer.parallel.stages import RankStages
from packfeed.trainer.parallel.whole import WholeModelRunner


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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=config.parallel.timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.parallel.encoder_ranks == "auto":
        raise ValueError("parallel.encoder_ranks=auto is searched by `packfeed train --nproc G` before it launches "
                         "the processes (it plans on the dataset's lengths); under torchrun give the number")
    parallel = config.parallel
    mesh = make_mesh(parallel.layout, device, datetime.timedelta(seconds=parallel.timeout_s))
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if mesh.rank == 0:
        (out / "config.json").write_text(dump_config(config))
        # what the ranks ran on: `packfeed simulate --run OUT` shares a CPU host's cores among them as they were
        host = {"device": device.type, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                "ranks": dist.get_world_size()}
        (out / "host.json").write_text(json.dumps(host))
    server, target = start_embedded_server(config, mesh)
    liveness = Liveness() if mesh.world > 1 else None
    try:
        return name_the_silent(liveness, config.parallel.timeout_s, mesh.describe_rank)(train_on)(config, mesh,
                                                                                            target, out)
    finally:
        if server is not None:
            server.stop()


def start_embedded_server(config: TrainConfig, mesh: Mesh):
    """Without `data.target`, rank 0 starts a Packfeed server on loopback for `data.index` (or `data.mixture`) and
    every first stage streams from it (all ranks must then share one machine). Returns (server or None, target)."""
    d = config.data
    if d.target:
        return None, d.target
    if not (d.index or d.mixture):
        raise ValueError("set data.target (a Packfeed server, host:port), or data.index or data.mixture (start one "
                         "here)")
    server = None
    if mesh.rank == 0:
        from packfeed.client import LocalServer

        server = LocalServer(d.index or None, workers=d.server_workers or None,
                             extra_args=["--mixture", d.mixture] if d.mixture else None).start()
    return server, broadcast_object(server.target if server else "", mesh)


def train_on(config: TrainConfig, mesh: Mesh, target: str, out: Path) -> dict:
    """One path for every model and layout: resume from the newest checkpoint -> open this rank's stream (ranks
    holding a first stage) -> the model sized from the dataset's conventions -> its parallel layout (a step
    runner) -> the loop."""
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
        runner = RUNNERS[config.parallel.plan_layout.runner](config, mesh, stream, conventions, out, resumed)
        history = Loop(runner, config, out, resume_from).run(resumed["steps_done"] if resumed else 0)
    summary = {**runner.meta, "steps": len(history), "final_loss": history[-1]["loss"] if history else None}
    return {"summary": summary, "history": history}


def whole(config: TrainConfig, mesh: Mesh, stream, conventions, out: Path, resumed: dict | None):
    """One stage per replica: a `transformers` model run whole, or the reference model as one stage."""
    if config.model.hf:
        return whole_model(config, mesh, stream, conventions)
    return model_stages(config, mesh, stream, conventions, out, resumed)


def whole_model(config: TrainConfig, mesh: Mesh, stream, conventions) -> WholeModelRunner:
    """A `transformers` model run whole at pp=1, FSDP2-sharded over the DP ranks, fed the client's packs."""
    from packfeed.trainer.models.hf.whole import HFWholeModel

    model = HFWholeModel(config.model, conventions, config.data.collate, config.parallel.precision, mesh.device)
    log(mesh, f"{model.describe()}; FSDP2 over {mesh.dp} rank(s)")
    return WholeModelRunner(model, mesh, StepSource(stream), config.parallel.precision)


def context_parallel(config: TrainConfig, mesh: Mesh, stream, conventions, out: Path,
                     resumed: dict | None) -> ContextParallelRunner:
    """The model (the reference VLM or a Qwen2-VL) on every GPU, each pack of the CP plan split over the GPUs the
    plan gives it."""
    model = build_model(config.model, conventions, mesh.device)
    planned = config.parallel.cp
    log(mesh, f"{model.describe()}; context parallelism: {mesh.cp} GPU(s) per replica for a plan of {planned}"
        + ("" if mesh.cp == planned else " (its packs joined and trained whole: parallel.train_cp_packs=whole)"))
    runner = HFContextParallelRunner if config.model.hf else ContextParallelRunner
    return runner(model, mesh, StepSource(stream), config.parallel.precision)


def disaggregated(config: TrainConfig, mesh: Mesh, stream, conventions, out: Path,
                  resumed: dict | None) -> DisaggregatedRunner:
    """The reference model's encoder on the E encoder ranks, its LLM on the dp x pp LLM ranks, each first stage
    and encoder rank fed its own stream of the same plan."""
    model = build_model(config.model, conventions, mesh.device)
    llm_ranks = mesh.dp * mesh.pp
    bounds = llm_bounds(config, model, mesh, out, resumed.get("bounds") if resumed else None)
    log(mesh, f"{model.describe()}; the encoder on {mesh.encoder_ranks} rank(s) of its own (global ranks "
        f"{llm_ranks}..{mesh.world - 1}), the LLM on {llm_ranks}" + (f" (dp {mesh.dp} x pp {mesh.pp}, stages "
        f"{bounds})" if mesh.pp > 1 else "") + "; an all-to-all hands each output to its LLM rank")
    d = config.data
    source = StepSource(stream, functools.partial(model.inputs, token_multiple=d.token_multiple, dp=mesh.dp,
                                                  collate=d.collate)) if stream is not None else None
    if config.recompute.mode == "adaptive":
        log(mesh, "recompute.mode=adaptive measures trial steps with the encoder on the LLM's ranks; beside encoder "
            "ranks no layer recomputes (recompute.mode=all recomputes every layer)")
    return DisaggregatedRunner(mesh, model, source, d.microbatches, config.parallel.precision, bounds,
                               config.parallel.schedule, config.recompute.mode == "all")


def model_stages(config: TrainConfig, mesh: Mesh, stream, conventions, out: Path, resumed: dict | None) -> RankStages:
    """The model as a layer list cut into pipeline stages, with OmniBal's decisions: the partition (searched, or
    the checkpoint's: its weights belong to it) and each rank's recompute plan."""
    model = build_model(config.model, conventions, mesh.device)
    log(mesh, f"model for the dataset (image policy {conventions.image_policy.name}, vocabulary "
        f"{conventions.vocab_size}): {model.describe()}")
    d = config.data
    source = StepSource(stream, functools.partial(model.inputs, token_multiple=d.token_multiple, dp=mesh.dp,
                                                  collate=d.collate)) if stream is not None else None
    stages = RankStages(config, mesh, model, source)
    key = decision_key(config, model, mesh)
    bounds, measured = decide_partition(stages, config, mesh, out, key, resumed["bounds"] if resumed else None)
    if measured is not None:
        cost_model = export_cost_model(measured, conventions, out / "cost_model.json")
        log(mesh, f"cost model measured on this hardware written to {out / 'cost_model.json'} {cost_model}: a later "
            f"run balances packs on it with data.cost_model={out / 'cost_model.json'}")
    recompute = decide_recompute(stages, config, mesh, bounds, out, key)
    log(mesh, f"rank {mesh.stage}: stages {stages.stage_ids}, layers {stages.layer_ids(bounds)} "
        f"{stages.rank_kinds(bounds)}, recompute {recompute.layers} "
        f"(budget {recompute.budget_bytes / 2**20:.0f} MiB, measured {recompute.measured})",
        everyone=mesh.replica == 0)
    if not recompute.fits:
        log(mesh, f"rank {mesh.stage} does not fit its {recompute.budget_bytes / 2**20:.0f} MiB budget even with "
            f"every block recomputed ({max(recompute.measured.values()) / 2**20:.0f} MiB measured): raise "
            f"recompute.budget_mb, use more pipeline stages or smaller packs", everyone=True)
    stage_table(stages, mesh, bounds, recompute, out)
    if stages.phases:
        log(mesh, f"the encoder (layers 0:{stages.first_layer}) runs on every rank over the images the plan "
            "routes to it; an all-to-all hands each output to the rank whose pack consumes it")
    if stages.bubbles:
        log(mesh, f"the encoder (layers 0:{stages.first_layer}) runs on every pipeline rank in the bubbles of "
            f"the {config.parallel.schedule} schedule; the stages hold layers {bounds[0]}:{bounds[-1]}")
    stages.meta = {"bounds": bounds, "recompute": recompute.layers}
    return stages


# the runner each kind of layout needs (`Layout.runner`; `Layout.problems()` says which layouts exist)
RUNNERS = {"whole": whole, "pipeline": model_stages, "context_parallel": context_parallel,
           "disaggregated": disaggregated}


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
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        exit_without_finalizing()
    return 0


def exit_without_finalizing() -> None:
    """A torchrun worker whose run completed ends here, its output flushed, without the interpreter's teardown:
    that teardown destroys C++ objects (process groups' transports, their worker threads) in no set order, and
    under load one of them sometimes aborts the process ('terminate called without an active exception') after
    the run is complete, which torchrun then reports as a failed run. Every file the run writes is closed by now;
    torchrun reads only the exit code."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
