"""`simulate_plan`: a plan's step and epoch time, bubbles and MFU on a cluster — a pure function of (workload,
model, cluster, settings), deterministic, no torch.

For `disaggregated`, the split of the GPUs between encoder and LLM is searched (DistTrain): every feasible
split (the LLM keeps pp x tp GPUs per replica and takes the step's packs in equal shares) has a lower bound on
its step time — the busiest GPU runs at least its group's mean compute — and splits are simulated in order of
that bound until the next bound cannot beat the best time found. The result is the optimum over all feasible
splits of the objective (the mean simulated step over `search_steps` sampled steps), found without simulating
most of them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import LayerTable
from packfeed.trainer.simulate.partition import partition_bounds
from packfeed.trainer.simulate.placement import Layout, StepCosts, StepResult, priced_layers, simulate_step, step_costs
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

    def to_json(self) -> dict:
        record = asdict(self)
        record.pop("step_times")
        record["step_s_median"] = float(np.median(self.step_times)) if self.step_times else 0.0
        return record


def layout_bounds(table: LayerTable, cluster: Cluster, layout: Layout, mean_load: np.ndarray,
                  partition: str) -> list[int]:
    seconds = priced_layers(table, cluster, layout.tp).sum(axis=1) @ mean_load
    in_pipeline = np.ones(len(table), bool) if layout.encoder == "stages" else ~table.encoder
    return partition_bounds(partition, seconds[in_pipeline], table.params[in_pipeline], layout.pp * layout.chunks)


def pipeline_costs(table, cluster, layout, workload, partition) -> tuple[StepCosts, list[int]]:
    mean = workload.loads.reshape(-1, workload.loads.shape[-1]).mean(axis=0)
    bounds = layout_bounds(table, cluster, layout, mean, partition)
    return step_costs(table, cluster, layout, bounds), bounds


def simulate_steps(table: LayerTable, cluster: Cluster, layout: Layout, workload: Workload, partition: str,
                   steps: list[int] | None = None) -> tuple[list[StepResult], list[int]]:
    costs, bounds = pipeline_costs(table, cluster, layout, workload, partition)
    chosen = range(workload.steps) if steps is None else steps
    routed = layout.encoder == "phases"
    if routed and workload.routing is None:
        raise ValueError("--encoder phases runs the encoder where an isf+phases plan routes it: give --strategy "
                         "isf+phases (or a plan file of that strategy)")
    cache: dict[bytes, StepResult] = {}
    results = []
    for k in chosen:
        routing = (workload.routing.encoder_loads[k], workload.routing.moved[k]) if routed else None
        key = workload.loads[k].tobytes() + (routing[1].tobytes() if routed else b"")
        if key not in cache:  # identical steps (fixed-size samples) are simulated once
            cache[key] = simulate_step(costs, layout, workload.loads[k], cluster, routing=routing)
        results.append(cache[key])
    return results, bounds


def useful_flops(table: LayerTable, workload: Workload) -> float | None:
    """Model FLOPs of the real (unpadded) samples: forward + a backward of twice the forward."""
    if table.forward_flops is None:
        return None
    return 3.0 * float((workload.useful.reshape(-1, workload.useful.shape[-1]) @ table.forward_flops.T).sum())


def simulate_plan(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings) -> Prediction:
    started = time.perf_counter()
    search = None
    dp = workload.loads.shape[1]
    if settings.encoder == "disaggregated":
        search = search_allocation(workload, table, cluster, settings)
        layout = Layout("disaggregated", search["llm_dp"], settings.pp, settings.tp, settings.virtual_stages,
                        settings.schedule, search["encoder_gpus"] // settings.tp)
        workload = workload.regrouped(layout.dp)
    else:
        if settings.encoder == "phases" and settings.pp != 1:
            raise ValueError("--encoder phases joins data-parallel ranks that each hold the whole model (as "
                             "`parallel.encoder=phases` trains): give --pp 1 (with --tp for large models)")
        layout = Layout(settings.encoder, dp, settings.pp, settings.tp, settings.virtual_stages, settings.schedule)
        if layout.gpus != cluster.gpus:
            raise ValueError(f"--encoder {settings.encoder} runs on dp x pp x tp = {layout.gpus} GPUs; --gpus is "
                             f"{cluster.gpus} (leave it out, or use --encoder disaggregated to split GPUs)")
    results, bounds = simulate_steps(table, cluster, layout, workload, settings.partition)
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
                      times, search, time.perf_counter() - started)


def allocations(workload: Workload, cluster: Cluster, settings: Settings) -> list[tuple[int, int]]:
    """Feasible (encoder TP groups, LLM replicas) splits of the cluster."""
    packs = workload.loads.shape[1] * workload.loads.shape[2]
    group = settings.pp * settings.tp
    out = []
    for encoder in range(1, cluster.gpus // settings.tp):
        rest = cluster.gpus - encoder * settings.tp
        if rest % group or rest // group < 1:
            continue
        replicas = rest // group
        if packs % replicas:
            continue
        m = packs // replicas
        if settings.schedule == "interleaved_1f1b" and m % settings.pp:
            continue
        out.append((encoder, replicas))
    return out


def lower_bound(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings,
                split: tuple[int, int], sample: list[int]) -> float:
    """No split runs faster than its busiest group's mean compute per step."""
    encoder_gpus, replicas = split
    seconds = priced_layers(table, cluster, settings.tp).sum(axis=1)  # fwd + bwd per term
    loads = workload.loads[sample].reshape(len(sample), -1, workload.loads.shape[-1]).sum(axis=1)
    encoder_work = loads @ seconds[table.encoder].sum(axis=0)
    llm_work = loads @ seconds[~table.encoder].sum(axis=0)
    return float(np.mean(np.maximum(encoder_work / encoder_gpus, llm_work / (replicas * settings.pp))))


def search_allocation(workload: Workload, table: LayerTable, cluster: Cluster, settings: Settings,
                      exhaustive: bool = False) -> dict:
    """The split of the cluster minimising the mean simulated step (branch and bound; `exhaustive` simulates
    every split, for checking)."""
    started = time.perf_counter()
    candidates = allocations(workload, cluster, settings)
    if settings.encoder_gpus:
        candidates = [c for c in candidates if c[0] * settings.tp == settings.encoder_gpus]
    if not candidates:
        raise ValueError(f"no split of {cluster.gpus} GPUs gives the LLM whole replicas of pp x tp = "
                         f"{settings.pp * settings.tp} GPUs that share a step's "
                         f"{workload.loads.shape[1] * workload.loads.shape[2]} packs evenly"
                         + (f" with --encoder-gpus {settings.encoder_gpus}" if settings.encoder_gpus else ""))
    sample = sorted(set(np.linspace(0, workload.steps - 1, min(settings.search_steps, workload.steps)).astype(int)))
    bounds = sorted((lower_bound(workload, table, cluster, settings, c, sample), c) for c in candidates)
    best, best_time, simulated = None, float("inf"), []
    for bound, (encoder_gpus, replicas) in bounds:
        if bound >= best_time and not exhaustive:
            break
        layout = Layout("disaggregated", replicas, settings.pp, settings.tp, settings.virtual_stages,
                        settings.schedule, encoder_gpus)
        regrouped = workload.regrouped(replicas)
        sampled = replace(regrouped, loads=regrouped.loads[sample])
        results, _ = simulate_steps(table, cluster, layout, sampled, settings.partition)
        mean = float(np.mean([r.step_s for r in results]))
        simulated.append({"encoder_gpus": encoder_gpus * settings.tp, "llm_dp": replicas, "step_s": mean,
                          "bound_s": bound})
        if mean < best_time:
            best, best_time = (encoder_gpus, replicas), mean
    return {"encoder_gpus": best[0] * settings.tp, "llm_dp": best[1], "objective_s": best_time, "candidates": len(candidates),
            "simulated": len(simulated), "solve_s": time.perf_counter() - started, "trials": simulated}
