"""Process bodies for the distributed trainer tests (spawned: they must live in an importable module)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from packfeed.trainer.models.reference_inputs import microbatches_of
from packfeed.trainer.models.reference import VLMConfig
from packfeed.trainer.models import ReferenceModel
from packfeed.trainer.parallel.data_parallel import wrap_data_parallel
from packfeed.trainer.parallel.mesh import make_mesh
from packfeed.v1.layout import Layout
from packfeed.trainer.parallel.pipeline import PipelineRunner, StageModule, autocast_dtype, share_step_shape

SMALL_MODEL = dict(vocab_size=1024, tile_size=112, tokens_per_tile=16, vit_dim=32, llm_dim=64, vit_layers=2,
                   llm_layers=2)


def packfeed_train(nproc: int, overrides: list[str], out: Path, timeout: float = 400) -> tuple[str, list[dict]]:
    """`packfeed train --nproc N OVERRIDES` (writing to `out`) in a subprocess that must succeed; returns its
    log and the records of out/metrics.jsonl."""
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "train", "--nproc", str(nproc), *overrides,
                           f"out={out}"], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def restart_from(straight: Path, out: Path, steps_done: int) -> None:
    """`out` as a run that stopped after `steps_done` steps would have left it, made from a longer run's output
    (one run instead of two): its checkpoint after `steps_done` steps the latest, later ones and their metrics
    lines gone. A run on `out` then resumes from that checkpoint, as a restarted job does."""
    import shutil

    shutil.copytree(straight, out)
    kept = f"step-{steps_done:06d}"
    checkpoints = out / "checkpoints"
    assert (checkpoints / kept / "meta.json").is_file(), f"{straight} kept no checkpoint after {steps_done} steps"
    for directory in checkpoints.glob("step-*"):
        if directory.name > kept:
            shutil.rmtree(directory)
    (checkpoints / "latest").write_text(kept)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:steps_done]))


def pipeline_step(rank: int, world: int, dp: int, pp: int, init_file: str, steps_file: str, out_dir: str,
                  bounds: list[int], schedule: str, recompute: bool, precision: str = "fp32") -> None:
    """One training step's forward + backward through a (dp, pp) pipeline; saves this rank's gradients
    (named by global layer index) and the microbatch losses."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        mesh = make_mesh(Layout(dp, pp), torch.device("cpu"))
        model = ReferenceModel(VLMConfig(**SMALL_MODEL))
        layers = model.layers
        lo, hi = bounds[mesh.stage], bounds[mesh.stage + 1]
        dtype = autocast_dtype(precision)
        stage = StageModule(layers, lo, hi, [recompute] * (hi - lo), dtype, hi == model.n_layers)
        runner = PipelineRunner(mesh, [wrap_data_parallel(stage, mesh)], [mesh.stage], 2, model, bounds, schedule,
                                dtype=dtype or torch.float32)
        batch = None
        if mesh.is_first:
            batch = microbatches_of(torch.load(steps_file, weights_only=False)[mesh.replica], model.config)
        shape = share_step_shape(mesh, batch.shape if batch is not None else None)
        losses = runner.run(shape, batch.args if batch is not None else None)
        grads = {name.split(".", 1)[1]: p.grad.clone()  # layers.<index in the model>.<name>
                 for name, p in stage.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "losses": [float(x) for x in losses]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def bubble_step(rank: int, world: int, dp: int, pp: int, init_file: str, steps_file: str, out_dir: str,
                schedule: str = "1f1b", control: bool = False) -> None:
    """One step with the encoder in the bubbles (parallel.encoder=bubbles): the LLM layers split evenly over
    the pipeline, the encoder on every rank. Saves every gradient this rank holds and the microbatch losses.
    `control`: the first stage puts the encoder's features one tile off (the test must see the difference)."""
    from packfeed.trainer.parallel.bubbles import BubbleRunner

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = make_mesh(Layout(dp, pp), torch.device("cpu"))
        model = ReferenceModel(VLMConfig(**SMALL_MODEL))
        first = model.vision.encoder_layers
        share = (model.n_layers - first) // pp
        bounds = [first + k * share for k in range(pp)] + [model.n_layers]
        lo, hi = bounds[mesh.stage], bounds[mesh.stage + 1]
        if control:
            join = model.llm_carrier
            model.llm_carrier = lambda mb, features, shape: join(mb, features.roll(1, dims=0), shape)
        encoder = StageModule(model.layers, 0, first)
        stage = StageModule(model.layers, lo, hi, ends_model=hi == model.n_layers)
        runner = BubbleRunner(mesh, encoder, stage, model, bounds, 2, schedule)
        batch = None
        if mesh.is_first:
            batch = microbatches_of(torch.load(steps_file, weights_only=False)[mesh.replica], model.config)
        shape = share_step_shape(mesh, batch.shape if batch is not None else None)
        losses = runner.run(shape, batch.args if batch is not None else None)
        grads = {name.split(".", 1)[1]: p.grad.clone() for module in (encoder, stage)
                 for name, p in module.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "losses": [float(x) for x in losses]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def phase_step(rank: int, world: int, init_file: str, steps_file: str, out_dir: str, control: bool = False) -> None:
    """One step with the encoder's work routed (parallel.encoder=phases) at DP `world`, pp 1. Saves every
    gradient and the microbatch losses. `control`: each rank sends its encoder outputs under one another's names
    (rotated among images of the same size), a wrong route the test must see."""
    from dataclasses import replace

    from packfeed.trainer.parallel.phases import PhaseRunner

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = make_mesh(Layout(world), torch.device("cpu"))
        model = ReferenceModel(VLMConfig(**SMALL_MODEL))
        first = model.vision.encoder_layers
        encoder = StageModule(model.layers, 0, first)
        stage = StageModule(model.layers, first, model.n_layers, ends_model=True)
        runner = PhaseRunner(mesh, encoder, stage, model, 2)
        batch = microbatches_of(torch.load(steps_file, weights_only=False)[rank], model.config)
        if control:
            batch.routed = [replace(images, encoded=misrouted(images.encoded)) for images in batch.routed]
        shape = share_step_shape(mesh, batch.shape)
        losses = runner.run(shape, batch)
        grads = {name.split(".", 1)[1]: p.grad.clone() for module in (encoder, stage)
                 for name, p in module.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "losses": [float(x) for x in losses], "stats": runner.last_stats},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def disaggregated_step(rank: int, world: int, dp: int, init_file: str, steps_file: str, out_dir: str,
                       control: bool = False, pp: int = 1, schedule: str = "1f1b", recompute: bool = False) -> None:
    """One step with the encoder on ranks of its own (parallel.encoder=disaggregated): global ranks 0..dp x pp - 1
    the LLM ranks (the LLM's layers split evenly over pp stages), the rest encoder ranks; each first stage and
    encoder rank fed its own served step (`steps`: the dp LLM replicas', then the encoder ranks'). Saves this
    rank's gradients and losses. `control`: encoder rank outputs sent under one another's names (`misrouted`)."""
    from dataclasses import replace

    from packfeed.trainer.parallel.disaggregated import DisaggregatedRunner
    from packfeed.trainer.parallel.partition import split_by_weight

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = make_mesh(Layout(dp, pp, encoder_ranks=world - dp * pp), torch.device("cpu"))
        model = ReferenceModel(VLMConfig(**SMALL_MODEL))
        first = model.vision.encoder_layers
        bounds = [first + b for b in split_by_weight([1.0] * (model.n_layers - first), pp)]
        runner = DisaggregatedRunner(mesh, model, None, 2, bounds=bounds, schedule=schedule, recompute=recompute)
        steps = torch.load(steps_file, weights_only=False)
        mine = dp + mesh.encoder_rank if mesh.is_encoder else mesh.replica if mesh.is_first else None
        batch = microbatches_of(steps[mine], model.config) if mine is not None else None
        if control and mesh.is_encoder:
            batch.routed = [replace(images, encoded=misrouted(images.encoded)) for images in batch.routed]
        losses = runner.step.run(runner.agree(batch), batch)
        grads = {name.split(".", 1)[1]: p.grad.clone() for name, p in runner.module.named_parameters()
                 if p.grad is not None}
        torch.save({"grads": grads, "losses": [float(x) for x in losses], "stats": runner.step.last_stats},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def misrouted(encoded: list[tuple]) -> list[tuple]:
    """Each image's name given to the next image of the same size (a route that delivers every output, wrongly)."""
    out = list(encoded)
    by_units: dict[int, list[int]] = {}
    for i, row in enumerate(encoded):
        by_units.setdefault(row[3], []).append(i)
    for members in by_units.values():
        for i, j in zip(members, members[1:] + members[:1]):
            out[j] = encoded[i]
    return out


def hf_step_grads(rank: int, world: int, family: str, data_file: str, init_file: str, out_dir: str,
                  wrap: str = "fsdp") -> None:
    """One global step of a Hugging Face model over `world` ranks, sharded with FSDP2 (`wrap="fsdp"`) or
    replicated with DDP (`"ddp"`): rank r trains on its share of the step's packs (to_hf_inputs with dp=world);
    saves the full gradients and the summed loss."""
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.trainer.models.hf.whole import language_layers
    from packfeed.trainer.parallel.mesh import make_mesh  # noqa: F811 (workers run in their own processes)
    from packfeed.trainer.parallel.data_parallel import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from hf_models import tiny_model

        saved = torch.load(data_file, weights_only=False)
        model = tiny_model(family, saved["data"])
        mesh = make_mesh(Layout(world), torch.device("cpu"))
        if wrap == "fsdp":
            model = shard(model, language_layers(model), mesh, "fp32")
        else:
            model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        share = len(saved["packs"]) // world
        loss_sum = 0.0
        for pack in saved["packs"][rank * share:(rank + 1) * share]:
            loss = model(**to_hf_inputs(pack, family, dp=world)).loss
            loss.backward()
            loss_sum += float(loss.detach())
        named = model.module.named_parameters() if wrap == "ddp" else model.named_parameters()
        grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for name, p in named if p.grad is not None}
        torch.save({"grads": grads, "loss": loss_sum}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def sharded_tower_step(rank: int, world: int, family: str, data_file: str, init_file: str, out_dir: str,
                       ensure: bool) -> None:
    """One step of a user's own FSDP2 loop as big runs wrap it: every vision block and every decoder layer a unit
    of its own, then the root; rank r trains on pack r (`ensure`: to_hf_inputs(..., ensure_encoders=True)).
    Saves the loss once the step is done."""
    from packfeed.client.model.hf import to_hf_inputs
    from packfeed.trainer.models.hf.whole import language_layers
    from packfeed.trainer.parallel.mesh import make_mesh  # noqa: F811 (workers run in their own processes)
    from packfeed.trainer.parallel.data_parallel import shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from hf_models import tiny_model

        saved = torch.load(data_file, weights_only=False)
        model = tiny_model(family, saved["data"])
        units = list(model.model.visual.blocks) + language_layers(model)
        model = shard(model, units, make_mesh(Layout(world), torch.device("cpu")), "fp32")
        inputs = to_hf_inputs(saved["packs"][rank], family, dp=world, conventions=saved["data"].conventions,
                              ensure_encoders=ensure)
        loss = model(**inputs).loss
        loss.backward()
        torch.save({"loss": float(loss.detach())}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def hf_pipeline_step(rank: int, world: int, dp: int, pp: int, family: str, data_file: str, init_file: str,
                     out_dir: str, bounds: list[int], schedule: str = "1f1b", virtual: int = 1,
                     break_positions: bool = False, data_parallel: str = "ddp", encoder: str = "stages") -> None:
    """One global step of a `transformers` VLM cut into pipeline stages (`packfeed train`'s own RankStages,
    TiedParameters): replica r trains on its M packs of the saved step; saves the gradients of this rank's layers
    under the model's own parameter names (weights tied across stages summed first) and the losses.
    `break_positions`: the control: ranks after the first receive zeroed positions. `encoder="bubbles"`: the
    vision encoder on every rank in the schedule's idle time (bounds then cover the LLM's layers only)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from hf_models import tiny_model
        from packfeed.client.model.hf import register_varlen_attention
        from packfeed.client.stream.tensors import Step
        from packfeed.trainer.config import load_config
        from packfeed.trainer.models.hf.model import HFLayerModel
        from packfeed.trainer.parallel.stages import RankStages

        saved = torch.load(data_file, weights_only=False)
        data, packs = saved["data"], saved["packs"]
        m = len(packs) // dp
        mesh = make_mesh(Layout(dp, pp), torch.device("cpu"))
        model = HFLayerModel(family, data.conventions,
                             model=tiny_model(family, data, register_varlen_attention(), deep=True))
        config = load_config(None, [f"model.hf={family}", f"data.microbatches={m}", f"parallel.pp={pp}",
                                    f"parallel.dp={dp}", f"parallel.schedule={schedule}",
                                    f"parallel.virtual_stages={max(virtual, 2)}",
                                    f"parallel.data_parallel={data_parallel}", f"parallel.encoder={encoder}"])
        stages = RankStages(config, mesh, model, None)
        stages.use(bounds, final=True)
        if break_positions and mesh.stage > 0:
            for module, stage in zip(stages.runner.modules, stages.stage_ids):
                names = model.names[bounds[stage]]
                if "positions" in names:
                    at = names.index("positions")
                    module.forward = lambda *c, f=module.forward, at=at: f(*[torch.zeros_like(t) if i == at else t
                                                                           for i, t in enumerate(c)])
        batch = None
        if 0 in stages.stage_ids:
            batch = model.inputs(Step(0, 0, mesh.replica, packs[mesh.replica * m:(mesh.replica + 1) * m]), 64, dp)
        _, losses = stages.run_step(batch)
        stages.tied.sync_gradients()
        grads = {model.parameter_names[i][local]: full(p.grad) for i in stages.held_layer_ids(bounds)
                 for local, p in model.layers[i].named_parameters(remove_duplicate=False) if p.grad is not None}
        torch.save({"grads": grads, "losses": [float(x) for x in losses]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def fsdp_output_views(rank: int, world: int, family: str, data_file: str, init_file: str, out_dir: str) -> None:
    """The FSDP2-wrapped model's forward on one pack: which of its outputs are views (FSDP2's warning)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from hf_models import tiny_model
        from packfeed.client.model.hf import to_hf_inputs
        from packfeed.trainer.models.hf.whole import language_layers, output_views
        from packfeed.trainer.parallel.data_parallel import shard

        saved = torch.load(data_file, weights_only=False)
        model = tiny_model(family, saved["data"])
        model = shard(model, language_layers(model), make_mesh(Layout(world), torch.device("cpu")), "fp32")
        output = model(**to_hf_inputs(saved["packs"][0], family, dp=world))
        torch.save({"views": output_views(output)}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor (an FSDP2 DTensor gathered over its shards)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()


def cp_step(rank: int, world: int, dp: int, cp: int, init_file: str, steps_file: str, out_dir: str,
            control: bool = False, qwen_conventions: bytes | None = None) -> None:
    """One step's forward + backward under context parallelism (dp x cp ranks, each fed its lane's shares) of the
    reference model, or with `qwen_conventions` (a dataset's ModelConventions) of a tiny Qwen2-VL (hf_models'
    sizes, seed 0); rank 0 saves the summed gradients (by the model's parameter names) and the step's loss.
    `control`: rank 1 gets its shares' late chunks before their early ones (a wrong chunk order)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = make_mesh(Layout(dp, cp=cp), torch.device("cpu"))
        runner, module = _cp_runner(mesh, qwen_conventions)
        step = torch.load(steps_file, weights_only=False)[mesh.replica, mesh.lane]
        if control and rank == 1:
            step.packs = [late_chunks_first(pack) for pack in step.packs]
        tally = runner.train_step(runner.agree(step), step)
        loss = torch.tensor([tally.loss], dtype=torch.float64)
        dist.all_reduce(loss)
        if rank == 0:
            grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
            torch.save({"loss": float(loss), "grads": grads}, Path(out_dir) / "cp.pt")
    finally:
        dist.destroy_process_group()


def _cp_runner(mesh, qwen_conventions: bytes | None):
    """The CP runner and the module whose parameters it trains: the reference model's layers, or the Qwen's."""
    if qwen_conventions is None:
        from packfeed.trainer.parallel.context_parallel import ContextParallelRunner

        runner = ContextParallelRunner(ReferenceModel(VLMConfig(**SMALL_MODEL)), mesh, None)
        return runner, runner.layers
    from hf_models import tiny_sizes

    from packfeed.trainer.models.hf.build import attention_implementation
    from packfeed.trainer.models.hf.model import HFLayerModel
    from packfeed.trainer.parallel.context_parallel_hf import HFContextParallelRunner
    from packfeed.v1 import packfeed_pb2 as pb

    attention = attention_implementation("varlen", mesh.device, packed=True)
    model = HFLayerModel("qwen2_vl", pb.ModelConventions.FromString(qwen_conventions), tiny_sizes("qwen2_vl"),
                         attention, 0)
    model.hf.eval()  # no dropout, as the unsplit reference
    return HFContextParallelRunner(model, mesh, None), model.hf


def late_chunks_first(pack):
    """The share with each sample's late chunk sent before its early one (the metadata unchanged)."""
    if pack.empty:
        return pack
    order, local = [], pack.cu_seqlens.tolist()
    for s, (a0, b0, a1, b1) in enumerate(pack.cp_chunks.tolist()):
        early = list(range(local[s], local[s] + b0 - a0))
        order += list(range(local[s] + b0 - a0, local[s + 1])) + early
    index = torch.tensor(order, dtype=torch.int64)
    for name in ("input_ids", "labels", "position_ids"):
        pack.tensors[name] = pack.tensors[name][index]
    return pack
