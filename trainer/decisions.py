"""The run's OmniBal decisions: the stage partition (searched on measured layer costs, OmniBal 4.2) and each
stage's recompute plan (adaptive, 4.3), each saved under OUT/ with a key of what it depends on and reused on
restart; and the cost model the search measured, exported for the planner."""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from packfeed.trainer.batch import Microbatches
from packfeed.trainer.config import TrainConfig
from packfeed.trainer.models.layer_model import Features
from packfeed.trainer.parallel import partition as partitioning
from packfeed.trainer.parallel.mesh import Mesh, broadcast_object, log
from packfeed.trainer.parallel.pipeline import autocast_dtype, separate_encoder_layers, validate_partition
from packfeed.trainer.parallel.profile import profile_layers, synchronize
from packfeed.trainer.parallel.recompute import RecomputeDecision, adaptive_recompute
from packfeed.trainer.simulate.calibrated import VISION_KINDS, fit_layer_costs, planner_cost_model
from packfeed.v1 import packfeed_pb2 as pb

if TYPE_CHECKING:
    from packfeed.trainer.parallel.stages import RankStages


def decision_key(config: TrainConfig, model, mesh: Mesh) -> str:
    """Decisions are reused only for the same model, mesh, microbatch count, schedule and memory budget."""
    settings = {k: v for k, v in asdict(config.model).items() if k != "flavor"}  # (its sizes are in settings)
    basis = {"model": model.describe(), "settings": settings, "pp": mesh.pp, "dp": mesh.dp,
             "m": config.data.microbatches, "schedule": config.parallel.schedule,
             "virtual": config.parallel.virtual_stages, "budget": config.recompute.budget_mb,
             "precision": config.parallel.precision, "device": mesh.device.type}
    if config.parallel.encoder != "stages":  # (keys of earlier runs, all with the encoder in the stages, stay valid)
        basis["encoder"] = config.parallel.encoder
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def write_json(path: Path, record: dict) -> None:
    """Whole or not at all: other ranks read these files, and a reader must never see half of one."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(record, indent=1))
    partial.replace(path)


def load_decision(path: Path, key: str) -> dict | None:
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
    return None


def trial_batches(rank_stages: RankStages, n: int) -> list[Microbatches | None]:
    """The first stage's buffered steps for trials (others pass None and learn the shape by broadcast)."""
    if rank_stages.source is None:
        return [None] * n
    batches = rank_stages.source.peek(n)
    if len(batches) < n:
        raise RuntimeError(f"the stream ended after {len(batches)} steps; trials need {n}: lower "
                           f"partition.profile_steps / trial_steps or give the job more data")
    return batches


@dataclass
class LayerMeasurements:
    """What rank 0 measured of every layer while searching the partition, and the microbatches it timed."""

    profile: list
    features: list[Features]


def split_layers(layers, first: int, stages: int, by_parameters: bool) -> list[int]:
    """Bounds [first, ..., n] splitting layers first: into `stages` runs of even layer counts or parameters."""
    weights = [float(sum(q.numel() for q in layer.parameters())) if by_parameters else 1.0 for layer in layers]
    return [first + b for b in partitioning.split_by_weight(weights[first:], stages)]


def llm_bounds(config: TrainConfig, model, mesh: Mesh, out: Path, given: list[int] | None = None) -> list[int]:
    """The LLM's pipeline stages beside encoder ranks of their own (parallel.encoder=disaggregated): `given` (a
    checkpoint's), partition.bounds, or a split by layers or parameters. The search times candidates on the whole
    pipeline, the encoder included, which these ranks do not hold: there partition.mode=search splits by
    parameters, and says so. Pipelined, rank 0 records them in OUT/partition.json (`packfeed simulate --run`)."""
    p, first, n_layers = config.partition, separate_encoder_layers(model, "disaggregated"), len(model.kinds)
    if given or p.bounds:
        bounds = validate_partition(list(given or p.bounds), n_layers, mesh.pp, first)
    else:
        if p.mode == "search" and mesh.pp > 1:
            log(mesh, "partition.mode=search times candidates with the encoder in the pipeline; beside encoder "
                "ranks the LLM's layers are split by parameters (partition.mode=layers, or partition.bounds, to "
                "choose)")
        bounds = split_layers(model.layers, first, mesh.pp, by_parameters=p.mode != "layers")
    if mesh.pp > 1 and mesh.rank == 0:
        write_json(out / "partition.json", {"key": decision_key(config, model, mesh), "bounds": bounds,
                                            "kinds": list(model.kinds)})
    return bounds


def decide_partition(rank_stages: RankStages, config: TrainConfig, mesh: Mesh, out: Path, key: str,
                     given: list[int] | None = None) -> tuple[list[int], LayerMeasurements | None]:
    """The stage bounds: `given` (a checkpoint's), partition.bounds, the saved decision, a split by layers or
    parameters, or the search (OmniBal 4.2). Also what the search measured, on rank 0 (else None)."""
    p, n_layers, stages = config.partition, len(rank_stages.kinds), rank_stages.n_stages
    first = rank_stages.first_layer  # > 0: the encoder runs in the bubbles, outside the partition
    if given or p.bounds:
        return validate_partition(list(given or p.bounds), n_layers, stages, first), None
    path = out / "partition.json"
    saved = load_decision(path, key)
    if saved:
        log(mesh, f"partition {saved['bounds']} reused from {path}")
        return validate_partition(saved["bounds"], n_layers, stages, first), None
    if p.mode != "search" or stages == 1:
        return split_layers(rank_stages.layers, first, stages, by_parameters=p.mode == "params"), None
    profiled, measured = None, None
    if mesh.rank == 0:  # profile on the first replica's data, on one device
        batches = rank_stages.source.peek(p.profile_steps)
        microbatches = [tuple(a.tensor_split(config.data.microbatches)[m] for a in b.args)
                        for b in batches for m in range(config.data.microbatches)]
        precision = autocast_dtype(config.parallel.precision)
        rank_stages.place(list(range(n_layers)))  # rank 0 profiles every layer on its device
        with torch.autocast(mesh.device.type, dtype=precision or torch.float32, enabled=precision is not None):
            profile = profile_layers(rank_stages.layers, rank_stages.kinds, microbatches, mesh.device, repeats=1)
        measured = LayerMeasurements(profile, [rank_stages.model.features(mb) for mb in microbatches])
        features = [asdict(f) for f in measured.features]
        profiled = profile, features, p.comm_gbps or measure_bandwidth_gbps(mesh)
    profile, features, comm_gbps = broadcast_object(profiled, mesh)
    batches = trial_batches(rank_stages, p.trial_steps)

    def measure(bounds: list[int]) -> float:  # every rank times every short-listed candidate together
        rank_stages.use(bounds)
        rank_stages.trial(batches[:1])  # warm-up: schedules, allocator
        # the median step (slowest rank each): one step disturbed by the machine does not decide the partition
        return statistics.median(rank_stages.trial([batch]) for batch in batches)

    decision = partitioning.search_partition(profile[first:], stages, radius=p.radius, top_k=max(p.top_k, 1),
                                             comm_gbps=comm_gbps, measure=lambda b: measure([first + x for x in b]))
    decision.shift(first)
    decision.profile = [q.to_dict() for q in profile]
    decision.profile_features = features
    log(mesh, "partition search (stage times from the layer profile; measured = real pipeline step):\n"
        + partitioning.format_table(decision))
    if mesh.rank == 0:
        record = {"key": key, **decision.to_dict(), "kinds": rank_stages.kinds}
        write_json(path, record)
    return decision.bounds, measured


def export_cost_model(measured: LayerMeasurements, conventions: pb.ModelConventions, path: Path) -> dict:
    """The measured per-layer costs as the planner's per-sample cost model, written to `path`, so the loader
    balances on what this model costs on this hardware (data.cost_model=OUT/cost_model.json)."""
    costs = fit_layer_costs(measured.profile, measured.features)
    model = planner_cost_model(costs, conventions.image_policy.patches_per_unit)
    path.write_text(json.dumps({**model, "layers": layer_records(measured, costs)}, indent=1))
    return model


def layer_records(measured: LayerMeasurements, costs) -> list[dict]:
    """Every layer's fitted seconds, parameters and boundary bytes per unit (tiles for vision layers, tokens for
    the others): what `packfeed simulate --model OUT/cost_model.json` and `--run OUT` simulate with."""
    tiles = max(statistics.mean(f.tiles for f in measured.features), 1e-9)
    tokens = max(statistics.mean(f.tokens for f in measured.features), 1e-9)
    return [{"kind": cost.kind, "forward": list(cost.forward), "backward": list(cost.backward), "params": q.params,
             "output_bytes_per_unit": q.output_bytes / (tiles if cost.kind in VISION_KINDS else tokens)}
            for q, cost in zip(measured.profile, costs)]


def measure_bandwidth_gbps(mesh: Mesh) -> float:
    """Stage-boundary bandwidth for the ranking metric; CPU gloo on loopback or NVLink/IB both differ by orders
    of magnitude, so it is measured rather than assumed (rank 0 only: a local copy as the upper bound)."""
    data = torch.empty(16 << 20, dtype=torch.uint8, device=mesh.device)
    started = time.perf_counter()
    for _ in range(4):
        data.clone()
    synchronize(mesh.device)
    return 4 * data.numel() / (time.perf_counter() - started) / 1e9


def decide_recompute(rank_stages: RankStages, config: TrainConfig, mesh: Mesh, bounds: list[int], out: Path,
                     key: str) -> RecomputeDecision:
    """This rank's recompute plan (per layer it runs): recompute.layers, none / all, the saved decision, or
    adaptive (OmniBal 4.3) on trial steps. Leaves the rank's stages built for `bounds` with that plan."""
    r, kinds, ids = config.recompute, rank_stages.rank_kinds(bounds), rank_stages.layer_ids(bounds)
    budget = int(r.budget_mb * 2**20)
    rank_stages.use(bounds, final=True)
    decision = None
    if r.layers:
        decision = RecomputeDecision(mesh.stage, [bool(r.layers[i]) for i in ids], budget)
    elif r.mode == "adaptive" and budget <= 0 and mesh.device.type != "cuda":
        decision = RecomputeDecision(mesh.stage, [False] * len(ids), budget)  # no budget on a CPU: keep everything
    elif r.mode != "adaptive":
        decision = RecomputeDecision(mesh.stage, [r.mode == "all" and k in ("vit", "llm") for k in kinds], budget)
    path = out / f"recompute-stage{mesh.stage}.json"
    saved = load_decision(path, key + str(bounds)) if decision is None else None
    if saved:
        decision = RecomputeDecision(**{k: v for k, v in saved.items() if k != "key"})
    if decision is None:
        decision = search_recompute(rank_stages, mesh, kinds, budget, out)
        if mesh.dp == 1 or mesh.replica == 0:
            write_json(path, {"key": key + str(bounds), **decision.to_dict()})
    rank_stages.set_recompute(decision.layers)
    return decision


def search_recompute(rank_stages: RankStages, mesh: Mesh, kinds: list[str], budget: int,
                     out: Path) -> RecomputeDecision:
    if budget <= 0 and mesh.device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(mesh.device)[1] * 0.9)
    batch = trial_batches(rank_stages, 1)[0]
    block_seconds = broadcast_object(profiled_block_seconds(out) if mesh.rank == 0 else None, mesh)

    def trial(plan: list[bool]) -> int:
        rank_stages.set_recompute(plan)
        return rank_stages.peak_bytes(batch)

    def agree(done: bool) -> bool:
        flag = torch.tensor([0 if done else 1], device=mesh.device)
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    return adaptive_recompute(mesh.stage, kinds, block_seconds, budget, trial, agree)


def profiled_block_seconds(out: Path) -> dict[str, float]:
    """Forward time per block kind from the partition profile rank 0 saved (1 s each when there is none): what
    keeping a block of that kind saves. Read on rank 0 and sent, so ranks on other machines need no shared OUT."""
    block_seconds = {"vit": 1.0, "llm": 1.0}
    path = out / "partition.json"
    if path.is_file():
        profile = json.loads(path.read_text()).get("profile", [])
        for kind in block_seconds:
            times = [q["forward_s"] for q in profile if q["kind"] == kind]
            block_seconds[kind] = sum(times) / len(times) if times else block_seconds[kind]
    return block_seconds


def stage_table(rank_stages: RankStages, mesh: Mesh, bounds: list[int], decision: RecomputeDecision,
                out: Path) -> list[dict]:
    """OmniBal's appendix Table 1 for this run: per stage, its layers (vision / LLM), recomputed blocks, and the
    peak memory and seconds (median of 3) of a trial step with the chosen plan, measured on each rank (replica
    0's).
    Printed and added to OUT/partition.json by rank 0."""
    batch = trial_batches(rank_stages, 1)[0]
    rank_stages.trial([batch])  # warm-up: the schedule for this shape, the allocator
    trials = []
    for _ in range(3):  # the median of three: one trial step on a busy machine can be far off
        dist.barrier()
        trials.append(rank_stages.timed_trial(batch))
    seconds, peak = statistics.median(t for t, _ in trials), max(p for _, p in trials)
    rows = []
    for s in rank_stages.stage_ids:
        lo, hi = bounds[s], bounds[s + 1]
        kinds = rank_stages.kinds[lo:hi]
        plan = decision.layers[rank_stages.layer_ids(bounds).index(lo):][:hi - lo]
        rows.append({"stage": s, "rank": mesh.stage, "layers": [lo, hi],
                     "vision_layers": sum(k in ("vision_embed", "vit", "projector") for k in kinds),
                     "llm_layers": sum(k in ("text_embed", "llm", "head") for k in kinds),
                     "recomputed_vision": sum(a and k == "vit" for a, k in zip(plan, kinds)),
                     "recomputed_llm": sum(a and k == "llm" for a, k in zip(plan, kinds)),
                     "rank_peak_mib": peak / 2**20, "rank_step_ms": seconds * 1e3})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows if mesh.replica == 0 else [])
    table = sorted((row for rank_rows in gathered for row in rank_rows), key=lambda row: row["stage"])
    if mesh.rank == 0:
        path = out / "partition.json"
        record = json.loads(path.read_text()) if path.is_file() else {"bounds": bounds}
        record["stages"] = table
        write_json(path, record)
        log(mesh, "stages (layers vision/LLM, recomputed blocks vision/LLM, peak memory and one trial step, "
            "measured on each rank):\n" + format_stage_table(table))
    return table


def format_stage_table(table: list[dict]) -> str:
    lines = [f"{'stage':>5} {'rank':>4} {'layers':>9} {'vision':>6} {'LLM':>4} {'rc vis':>6} {'rc LLM':>6} "
             f"{'peak MiB':>9} {'step ms':>8}"]
    for row in table:
        lines.append(f"{row['stage']:>5} {row['rank']:>4} {row['layers'][0]:>4}:{row['layers'][1]:<4} "
                     f"{row['vision_layers']:>6} {row['llm_layers']:>4} {row['recomputed_vision']:>6} "
                     f"{row['recomputed_llm']:>6} {row['rank_peak_mib']:>9.1f} {row['rank_step_ms']:>8.1f}")
    return "\n".join(lines)
