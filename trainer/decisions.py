"""The run's OmniBal decisions: the stage partition (searched on measured layer costs, OmniBal 4.2) and each
stage's recompute plan (adaptive, 4.3), each saved under OUT/ with a key of what it depends on and reused on
restart; and the cost model the search measured, exported for the planner."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from packfeed.trainer import partition as partitioning
from packfeed.trainer.batch import Microbatches
from packfeed.trainer.config import TrainConfig
from packfeed.trainer.model import VLMConfig
from packfeed.trainer.pipeline import Mesh, autocast_dtype, broadcast_object, log, validate_partition
from packfeed.trainer.profile import profile_layers, synchronize
from packfeed.trainer.recompute import RecomputeDecision, adaptive_recompute
from packfeed.trainer.simulate import Features, features_of_carrier, fit_layer_costs, planner_cost_model
from packfeed.v1 import packfeed_pb2 as pb

if TYPE_CHECKING:
    from packfeed.trainer.train import Trainer


def decision_key(config: TrainConfig, model: VLMConfig, mesh: Mesh) -> str:
    """Decisions are reused only for the same model, mesh, microbatch count, schedule and memory budget."""
    basis = {"model": model.__dict__, "pp": mesh.pp, "dp": mesh.dp, "m": config.data.microbatches,
             "schedule": config.parallel.schedule, "budget": config.recompute.budget_mb,
             "device": mesh.device.type}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def load_decision(path: Path, key: str) -> dict | None:
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
    return None


def trial_batches(trainer: Trainer, n: int) -> list[Microbatches | None]:
    """The first stage's buffered steps for trials (others pass None and learn the shape by broadcast)."""
    if trainer.source is None:
        return [None] * n
    batches = trainer.source.peek(n)
    if len(batches) < n:
        raise RuntimeError(f"the stream ended after {len(batches)} steps; trials need {n}: lower "
                           f"partition.profile_steps / trial_steps or give the job more data")
    return batches


@dataclass
class LayerMeasurements:
    """What rank 0 measured of every layer while searching the partition, and the microbatches it timed."""

    profile: list
    features: list[Features]


def decide_partition(trainer: Trainer, config: TrainConfig, mesh: Mesh, out: Path, key: str,
                     given: list[int] | None = None) -> tuple[list[int], LayerMeasurements | None]:
    """The stage bounds: `given` (a checkpoint's), partition.bounds, the saved decision, a split by layers or
    parameters, or the search (OmniBal 4.2). Also what the search measured, on rank 0 (else None)."""
    p, n_layers = config.partition, len(trainer.kinds)
    if given or p.bounds:
        return validate_partition(list(given or p.bounds), n_layers, mesh.pp), None
    path = out / "partition.json"
    saved = load_decision(path, key)
    if saved:
        log(mesh, f"partition {saved['bounds']} reused from {path}")
        return validate_partition(saved["bounds"], n_layers, mesh.pp), None
    if p.mode != "search" or mesh.pp == 1:
        weights = [1.0] * n_layers if p.mode != "params" else \
            [float(sum(q.numel() for q in layer.parameters())) for layer in trainer.layers]
        return partitioning.split_by_weight(weights, mesh.pp), None
    profiled, measured = None, None
    if mesh.rank == 0:  # profile on the first replica's data, on one device
        batches = trainer.source.peek(p.profile_steps)
        microbatches = [tuple(a.tensor_split(config.data.microbatches)[m] for a in b.args)
                        for b in batches for m in range(config.data.microbatches)]
        precision = autocast_dtype(config.parallel.precision)
        with torch.autocast(mesh.device.type, dtype=precision or torch.float32, enabled=precision is not None):
            profile = profile_layers(trainer.layers, trainer.kinds, microbatches, mesh.device, repeats=1)
        measured = LayerMeasurements(profile, [features_of_carrier(mb) for mb in microbatches])
        features = [asdict(f) for f in measured.features]
        profiled = profile, features, p.comm_gbps or measure_bandwidth_gbps(mesh)
    profile, features, comm_gbps = broadcast_object(profiled, mesh)
    batches = trial_batches(trainer, p.trial_steps)

    def measure(bounds: list[int]) -> float:  # every rank times every short-listed candidate together
        trainer.use(bounds)
        trainer.trial(batches[:1])  # warm-up: schedules, allocator
        return trainer.trial(batches) / len(batches)

    decision = partitioning.search_partition(profile, mesh.pp, radius=p.radius, top_k=max(p.top_k, 1),
                                             comm_gbps=comm_gbps, measure=measure)
    decision.profile = [q.to_dict() for q in profile]
    decision.profile_features = features
    log(mesh, "partition search (stage times from the layer profile; measured = real pipeline step):\n"
        + partitioning.format_table(decision))
    if mesh.rank == 0:
        record = {"key": key, **decision.to_dict(), "kinds": trainer.kinds}
        path.write_text(json.dumps(record, indent=1))
    return decision.bounds, measured


def export_cost_model(measured: LayerMeasurements, conventions: pb.ModelConventions, path: Path) -> dict:
    """The measured per-layer costs as the planner's per-sample cost model, written to `path`, so the loader
    balances on what this model costs on this hardware (data.cost_model=OUT/cost_model.json)."""
    costs = fit_layer_costs(measured.profile, measured.features)
    model = planner_cost_model(costs, conventions.image_policy.patches_per_unit)
    path.write_text(json.dumps(model, indent=1))
    return model


def measure_bandwidth_gbps(mesh: Mesh) -> float:
    """Stage-boundary bandwidth for the ranking metric; CPU gloo on loopback or NVLink/IB both differ by orders
    of magnitude, so it is measured rather than assumed (rank 0 only: a local copy as the upper bound)."""
    data = torch.empty(16 << 20, dtype=torch.uint8, device=mesh.device)
    started = time.perf_counter()
    for _ in range(4):
        data.clone()
    synchronize(mesh.device)
    return 4 * data.numel() / (time.perf_counter() - started) / 1e9


def decide_recompute(trainer: Trainer, config: TrainConfig, mesh: Mesh, bounds: list[int], out: Path,
                     key: str) -> RecomputeDecision:
    r, kinds = config.recompute, trainer.stage_kinds(bounds)
    budget = int(r.budget_mb * 2**20)
    if r.layers:
        plan = list(r.layers[bounds[mesh.stage]:bounds[mesh.stage + 1]])
        return RecomputeDecision(mesh.stage, plan, budget)
    if r.mode != "adaptive":
        return RecomputeDecision(mesh.stage, [r.mode == "all" and k in ("vit", "llm") for k in kinds], budget)
    path = out / f"recompute-stage{mesh.stage}.json"
    saved = load_decision(path, key + str(bounds))
    if saved:
        return RecomputeDecision(**{k: v for k, v in saved.items() if k != "key"})
    if budget <= 0 and mesh.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(mesh.device)[1] * 0.9)
    batch = trial_batches(trainer, 1)[0]
    profile_path = out / "partition.json"
    block_seconds = {"vit": 1.0, "llm": 1.0}
    if profile_path.is_file():  # forward time per block kind from the partition profile
        profile = json.loads(profile_path.read_text()).get("profile", [])
        for kind in block_seconds:
            times = [q["forward_s"] for q in profile if q["kind"] == kind]
            block_seconds[kind] = sum(times) / len(times) if times else 0.0

    def trial(plan: list[bool]) -> int:
        trainer.use(bounds, plan)
        return trainer.peak_bytes(batch)

    def agree(done: bool) -> bool:
        flag = torch.tensor([0 if done else 1], device=mesh.device)
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    decision = adaptive_recompute(mesh.stage, kinds, block_seconds, budget, trial, agree)
    if mesh.dp == 1 or mesh.replica == 0:
        path.write_text(json.dumps({"key": key + str(bounds), **decision.to_dict()}, indent=1))
    return decision
