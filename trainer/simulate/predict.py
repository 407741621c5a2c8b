"""`simulate_plan`: a plan's step and epoch time, bubbles and MFU on a cluster — a pure function of (workload,
model, cluster, settings), deterministic, no torch.

For `disaggregated`, the split of the GPUs between encoder and LLM is searched (DistTrain): every feasible
split (E encoder ranks of tp GPUs, the LLM replicas of pp x tp GPUs each) is planned for itself (`replan`: the
planner with dp = the replicas and encoder_ranks = E, each step's items balanced over the E encoder ranks as
the trainer runs them) and has a lower bound on its epoch — each side's work shared evenly over its GPUs — and
splits are simulated in order of that bound until the next bound cannot beat the best epoch found. The result
is the optimum over all feasible splits of the objective (the epoch: the mean simulated step over
`search_steps` sampled steps times the plan's steps), found without simulating most of them. Without `replan`
the workload's packs are regrouped over the replicas, each encoded evenly by a group of the encoder GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import LayerTable
from packfeed.trainer.simulate.partition import partition_bounds
from packfeed.trainer.simulate.placement import Placement, StepCosts, StepResult, priced_layers, simulate_step, step_costs
from packfeed.trainer.simulate.sharded import SHARDED, sharded_step
from packfeed.trainer.simulate.workload import Workload


@dataclass(frozen=True)
class Settings:
    encoder: str = "stages"
    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: str = "balanced"
    encoder_gpus: int = 0  # disaggregated: 0 = searched, else this many (a multiple of tp)
    search_steps: int = 8  # disaggregated search: steps sampled for its objective
    data_parallel: str = "ddp"  # ddp, or sharded (fsdp, zero3: every layer a barrier; packfeed.trainer.simulate.sharded)


@dataclass
class Prediction:
    step_s: float
    epoch_s: float
    bubble_fraction: float
    bubble_per_stage: dict[str, float]
    mfu: float | None
    steps: int
    samples: int
    gpus: int
    layout: dict
    bounds: list[int]
    step_times: list[float] = field(repr=False)
    search: dict | None = None
    seconds: float = 0.0
    workload: Workload | None = field(default=None, repr=False)  # what was simulated (a searched split's plan)

    def to_json(self) -> dict:
        record = asdict(replace(self, workload=None))
        record.pop("step_times")
        record.pop("workload")
        record["step_s_median"] = float(np.median(self.step_times)) if self.step_times else 0.0
        return record


def layout_bounds(table: LayerTable, cluster: Cluster, layout: Placement, mean_load: np.ndarray,
                  partition: str) -> list[int]:
    seconds = priced_layers(table, cluster, layout.tp).sum(axis=1) @ mean_load
    in_pipeline = np.ones(len(table), bool) if layout.encoder == "stages" else ~table.encoder
    return partition_bounds(partition, seconds[in_pipeline], table.params[in_pipeline], layout.pp * layout.chunks)


def pipeline_costs(table, cluster, layout, workload, partition) -> tuple[StepCosts, list[int]]:
    mean = workload.loads.reshape(-1, workload.loads.shape[-1]).mean(axis=0)
    bounds = layout_bounds(table, cluster, layout, mean, partition)
    return step_costs(table, cluster, layout, bounds), bounds


def simulate_steps(table: LayerTable, cluster: Cluster, layout: Placement, workload: Workload, partition: str,
                   steps: list[int] | None = None) -> tuple[list[StepResult], list[int]]:
    costs, bounds = pipeline_costs(table, cluster, layout, workload, partition)
    chosen = range(workload.steps) if steps is None else steps
    return per_step(workload, layout, chosen, lambda k, routing, split: simulate_step(
        costs, layout, workload.loads[k], cluster, routing=routing, encoder_split=split)), bounds


def sharded_steps(table: LayerTable, cluster: Cluster, layout: Placement, workload: Workload,
                  kind: str) -> list[StepResult]:
    """Every step under sharded data parallelism (`kind`: fsdp or zero3), at pp 1."""
    if kind not in SHARDED:
        raise ValueError(f"--data-parallel {kind}: choose ddp, {' or '.join(SHARDED)}")
    if layout.pp != 1 or layout.encoder not in ("stages", "phases"):
        raise ValueError(f"--data-parallel {kind} simulates sharded data parallelism at --pp 1 with the encoder in "
                         "the model (--encoder stages) or routed (--encoder phases)")
    return per_step(workload, layout, range(workload.steps), lambda k, routing, _: sharded_step(
        table, cluster, workload.loads[k], layout.tp, routing))


def per_step(workload: Workload, layout: Placement, steps, simulate) -> list[StepResult]:
    """`simulate(k, routing, split)` for each step k (the routed encoder's routing, the encoder ranks' split
    where the layout takes them), identical steps (fixed-size samples) simulated once."""
    routed = layout.encoder == "phases"
    if routed and workload.routing is None:
        raise ValueError("--encoder phases runs the encoder where an isf+phases plan routes it: give --strategy "
                         "isf+phases (or a plan file of that strategy)")
    planned = workload.encoder_split if layout.encoder == "disaggregated" else None
    cache: dict[bytes, StepResult] = {}
    results = []
    for k in steps:
        routing = (workload.routing.encoder_loads[k], workload.routing.moved[k]) if routed else None
        split = planned[k] if planned is not None else None
        key = workload.loads[k].tobytes() + b"".join(a.tobytes() for a in (*(routing or ()), split) if a is not None)
        if key not in cache:
            cache[key] = simulate(k, routing, split)
        results.append(cache[key])
    return results


def useful_flops(table: LayerTable, workload: Workload) -> float | None:
    """Model FLOPs of the real (unpadded) samples: forward + a backward of twice the forward."""
    if table.forward_flops is None:
        return None
    return 3.0 * float((workload.useful.reshape(-1, workload.useful.shape[-1]) @ table.forward_flops.T).sum())


def simulate_plan(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings,
                  replan: Replan | None = None) -> Prediction:
    """`replan(llm_dp, encoder_ranks)`: the workload of the same data planned for that split (`disaggregated`:
    each split searched is simulated on its own plan)."""
    started = time.perf_counter()
    search = None
    dp = workload.loads.shape[1]
    if settings.encoder == "disaggregated":
        search, workload = search_allocation(workload, table, cluster, settings, replan)
        layout = Placement("disaggregated", search["llm_dp"], settings.pp, settings.tp, settings.virtual_stages,
                        settings.schedule, search["encoder_gpus"] // settings.tp)
    else:
        if settings.encoder == "phases" and settings.pp != 1:
            raise ValueError("--encoder phases joins data-parallel ranks that each hold the whole model (as "
                             "`parallel.encoder=phases` trains): give --pp 1 (with --tp for large models)")
        layout = Placement(settings.encoder, dp, settings.pp, settings.tp, settings.virtual_stages, settings.schedule)
        if layout.gpus != cluster.gpus:
            raise ValueError(f"--encoder {settings.encoder} runs on dp x pp x tp = {layout.gpus} GPUs; --gpus is "
                             f"{cluster.gpus} (leave it out, or use --encoder disaggregated to split GPUs)")
    if settings.data_parallel == "ddp":
        results, bounds = simulate_steps(table, cluster, layout, workload, settings.partition)
    else:
        results, bounds = sharded_steps(table, cluster, layout, workload, settings.data_parallel), []
    times = [r.step_s for r in results]
    epoch = float(sum(times))
    busy: dict[str, float] = {}
    for r in results:
        for role, seconds in r.busy_s.items():
            busy[role] = busy.get(role, 0.0) + float(np.mean(seconds))
    per_stage = {role: 1.0 - b / epoch if epoch else 0.0 for role, b in busy.items()}
    devices = {role: len(results[0].busy_s[role]) for role in busy} if results else {}
    total_busy = sum(busy[role] * devices[role] for role in busy)
    overall = 1.0 - total_busy / (sum(devices.values()) * epoch) if epoch else 0.0
    flops = useful_flops(table, workload)
    mfu = flops / (cluster.gpus * cluster.peak_tflops * 1e12 * epoch) if flops is not None and epoch else None
    return Prediction(epoch / len(times) if times else 0.0, epoch, overall, per_stage, mfu, workload.steps,
                      workload.samples, layout.gpus, {**asdict(layout), "partition": settings.partition}, bounds,
                      times, search, time.perf_counter() - started, workload)


Replan = Callable[[int, int], Workload]  # (LLM replicas, encoder ranks) -> the data planned for that split


def allocations(workload: Workload, cluster: Cluster, settings: Settings,
                replanned: bool = False) -> list[tuple[int, int]]:
    """Feasible (encoder TP groups, LLM replicas) splits of the cluster: each replanned for itself with the
    step's packs shared as evenly as whole microbatches allow (`microbatches_for`), or the workload's packs
    regrouped (they must then share out evenly); or the one split its plan was made for."""
    if workload.encoder_split is not None and not replanned:
        planned = (workload.encoder_split.shape[1], workload.loads.shape[1])
        return [planned] if planned[0] * settings.tp + planned[1] * settings.pp * settings.tp == cluster.gpus else []
    packs = workload.loads.shape[1] * workload.loads.shape[2]
    group = settings.pp * settings.tp
    out = []
    for encoder in range(1, cluster.gpus // settings.tp):
        rest = cluster.gpus - encoder * settings.tp
        if rest % group or rest // group < 1:
            continue
        replicas = rest // group
        m = microbatches_for(packs, replicas)
        if not replanned and packs % replicas:
            continue
        if settings.schedule == "interleaved_1f1b" and m % settings.pp:
            continue
        out.append((encoder, replicas))
    return out


def microbatches_for(packs: int, replicas: int) -> int:
    """Microbatches per LLM replica that keep a step nearest its `packs` (at least one)."""
    return max(1, round(packs / replicas))


def lower_bound(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings,
                split: tuple[int, int]) -> float:
    """No split runs a step faster than its busiest side's compute shared evenly (the encoder's work over its
    GPUs, the LLM's over its replicas' stages): the mean over the workload's steps of that bound."""
    encoder_gpus, replicas = split
    seconds = priced_layers(table, cluster, settings.tp).sum(axis=1)  # fwd + bwd per term
    loads = workload.loads.reshape(workload.steps, -1, workload.loads.shape[-1]).sum(axis=1)
    encoder_work = loads @ seconds[table.encoder].sum(axis=0)
    llm_work = loads @ seconds[~table.encoder].sum(axis=0)
    return float(np.mean(np.maximum(encoder_work / encoder_gpus, llm_work / (replicas * settings.pp))))


def search_allocation(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings,
                      replan: Replan | None = None, exhaustive: bool = False,
                      splits: list[tuple[int, int]] | None = None) -> tuple[dict, Workload]:
    """The split of the cluster minimising the epoch: each split's data (planned for it by `replan`, or the
    workload's packs regrouped, or the workload's own plan) sampled at `search_steps` steps, its epoch the mean
    simulated step times its steps; splits simulated in order of their lower bound until the next bound cannot
    beat the best epoch found (`exhaustive` simulates every split, for checking; `splits`: the (encoder TP
    groups, LLM replicas) to choose from, instead of every split that keeps the step's packs). Returns the
    search's record and the chosen split's workload."""
    started = time.perf_counter()
    candidates = splits if splits is not None else allocations(workload, cluster, settings, replan is not None)
    if settings.encoder_gpus:
        candidates = [c for c in candidates if c[0] * settings.tp == settings.encoder_gpus]
    if not candidates:
        raise ValueError(f"no split of {cluster.gpus} GPUs gives the LLM whole replicas of pp x tp = "
                         f"{settings.pp * settings.tp} GPUs" + (
                             f" that share a step's {workload.loads.shape[1] * workload.loads.shape[2]} packs "
                             "evenly" if replan is None and workload.encoder_split is None else
                             " beside the plan's encoder ranks" if replan is None else "")
                         + (f" with --encoder-gpus {settings.encoder_gpus}" if settings.encoder_gpus else ""))
    ranked = []
    for encoder_groups, replicas in candidates:
        planned = replan(replicas, encoder_groups) if replan is not None else \
            workload if workload.encoder_split is not None else workload.regrouped(replicas)
        sampled = sample_steps(planned, settings.search_steps)
        bound = lower_bound(sampled, table, cluster, settings, (encoder_groups, replicas)) * planned.steps
        ranked.append((bound, encoder_groups, replicas, planned, sampled))
    ranked.sort(key=lambda entry: entry[:3])
    best, best_time, best_workload, simulated = None, float("inf"), workload, []
    for bound, encoder_groups, replicas, planned, sampled in ranked:
        if bound >= best_time and not exhaustive:
            break
        layout = Placement("disaggregated", replicas, settings.pp, settings.tp, settings.virtual_stages,
                        settings.schedule, encoder_groups)
        results, _ = simulate_steps(table, cluster, layout, sampled, settings.partition)
        mean = float(np.mean([r.step_s for r in results]))
        epoch = mean * planned.steps
        simulated.append({"encoder_gpus": encoder_groups * settings.tp, "llm_dp": replicas, "step_s": mean,
                          "steps": planned.steps, "epoch_s": epoch, "bound_s": bound})
        if epoch < best_time:
            best, best_time, best_workload = (encoder_groups, replicas), epoch, planned
    record = {"encoder_gpus": best[0] * settings.tp, "llm_dp": best[1], "objective_s": best_time,
              "candidates": len(candidates), "simulated": len(simulated), "replanned": replan is not None,
              "solve_s": time.perf_counter() - started, "trials": simulated}
    return record, best_workload


def sample_steps(workload: Workload, count: int) -> Workload:
    """`count` steps spread evenly over the workload (its first and last included)."""
    sample = sorted(set(np.linspace(0, workload.steps - 1, min(count, workload.steps)).astype(int)))
    return replace(workload, loads=workload.loads[sample], useful=workload.useful[sample],
                   encoder_split=workload.encoder_split[sample] if workload.encoder_split is not None else None,
                   routing=None)
