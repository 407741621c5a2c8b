"""The simulator against a real run (`packfeed simulate --run OUT`): every step a `packfeed train` run measured,
predicted from what that run wrote — its per-layer costs (OUT/cost_model.json, fitted on the partition search's
profile), its partition and boundary bandwidth (OUT/partition.json), its settings (OUT/config.json) and each
step's padded microbatches (OUT/metrics.jsonl, replica 0's) — against the step's measured pipeline time (the
slowest rank's schedule, gradient synchronisation included; the optimizer step is not simulated). A CPU run's
processes share the host's cores (OUT/host.json), and so do the simulated ranks: with more ranks than cores
a task's work drains at cores / busy ranks.

The layer profile times each layer alone; a real step also pays the runtime between layers and stages (the
schedule, point-to-point messages, autograd across stages) and the host's contention. The search measured real
pipeline steps before training (its timed candidates, on the first step's microbatches): the median ratio of
those to their simulation is the run's overhead factor, and the calibrated prediction of every later step is
the simulation times that factor. Both errors are reported, raw and calibrated; the steps compared never
include the candidates' step.

The run must have searched its partition (that profile is what the costs are fitted on): a run with
partition.mode=layers or given bounds writes no per-layer costs, so `--model` must name another run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.context_parallel import CpWorkload, simulate_cp
from packfeed.trainer.simulate.model_shape import TILES, TOKEN_SQUARE, TOKENS, load_model, measured_table
from packfeed.trainer.simulate.placement import Placement, simulate_step, step_costs


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read it ({error}); --run takes the OUT directory of a `packfeed train` "
                         "run") from error


def load_rows(microbatches: list[dict]) -> np.ndarray:
    """(1, M, terms) load rows of one replica's padded microbatches (tiles, tokens, sum of squared lengths)."""
    rows = np.zeros((1, len(microbatches), 5))
    for j, f in enumerate(microbatches):
        rows[0, j, 0], rows[0, j, TILES], rows[0, j, TOKENS], rows[0, j, TOKEN_SQUARE] = \
            1.0, f["tiles"], f["tokens"], f["square"]
    return rows


def host_cores(out: Path) -> float | None:
    """Processors the run's ranks shared (OUT/host.json): a CPU run's cores over each process's threads; None
    for GPUs (one each)."""
    path = out / "host.json"
    if not path.is_file():
        return None
    host = _read(path)
    return host["cpus"] / max(host["threads"], 1) if host["device"] == "cpu" else None


def compare_run(out: str | Path, model: str | Path | None = None, skip: int = 1) -> dict:
    """Predicted and measured pipeline seconds of every step after the first `skip` (the first builds the
    schedules), and the errors. A CPU run's ranks share the host's cores, and the simulation shares them too."""
    out = Path(out)
    config = _read(out / "config.json")
    cores = host_cores(out)
    if config["parallel"].get("cp", 1) > 1:
        if config["parallel"].get("train_cp_packs", "split") == "whole":
            raise ValueError(f"{out} trained a CP plan's packs whole on one GPU per replica (parallel.train_cp_packs="
                             "whole), a baseline the simulator does not model: compare a run of parallel.cp GPUs "
                             "per replica")
        return compare_cp_run(out, config, model, skip, cores)
    if config["parallel"].get("encoder") == "disaggregated":
        return compare_disaggregated_run(out, config, model, skip, cores)
    partition = _read(out / "partition.json")
    table = measured_table(model or out / "cost_model.json")
    parallel = config["parallel"]
    if parallel["dp"] != 1:
        raise ValueError("--run compares DP 1 runs: metrics.jsonl keeps replica 0's microbatches only")
    chunks = parallel["virtual_stages"] if parallel["schedule"] == "interleaved_1f1b" else 1
    layout = Placement(parallel.get("encoder", "stages"), 1, parallel["pp"], 1, chunks, parallel["schedule"])
    first = int(table.encoder.sum()) if layout.encoder == "bubbles" else 0
    bounds = [b - first for b in partition["bounds"]]
    bandwidth = partition.get("comm_gbps") or Cluster(1).intra_gbs
    cluster = Cluster(layout.pp, gpus_per_node=layout.pp, intra_gbs=bandwidth, inter_gbs=bandwidth)
    costs = step_costs(table, cluster, layout, bounds)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    factor = overhead_factor(table, layout, cluster, partition, config["data"]["microbatches"], cores, first)
    steps = []
    for record in records[skip:]:
        if "microbatches" not in record or "pipeline_s" not in record:
            continue
        predicted = simulate_step(costs, layout, load_rows(record["microbatches"]), cluster, cores=cores).step_s
        steps.append({"epoch": record["epoch"], "step": record["step"], "simulated_s": predicted,
                      "predicted_s": predicted * (factor or 1.0), "measured_s": record["pipeline_s"]})
    if not steps:
        raise ValueError(f"{out}/metrics.jsonl holds no measured steps after the first {skip}")
    measured = np.array([s["measured_s"] for s in steps])
    raw = np.array([s["simulated_s"] for s in steps]) / measured - 1
    calibrated = np.array([s["predicted_s"] for s in steps]) / measured - 1
    return {"run": str(out), "encoder": layout.encoder, "pp": layout.pp, "schedule": layout.schedule, "cores": cores,
            "bounds": partition["bounds"], "overhead_factor": factor, "steps": steps,
            "mean_error_raw": float(raw.mean()), "mean_abs_error_raw": float(np.abs(raw).mean()),
            "mean_error": float(calibrated.mean()), "mean_abs_error": float(np.abs(calibrated).mean())}


def overhead_factor(table, layout: Placement, cluster: Cluster, partition: dict, microbatches: int,
                    cores: float | None, first: int) -> float | None:
    """Median of measured / simulated over the partition search's timed candidates (None when none was timed)."""
    features = partition.get("profile_features", [])[:microbatches]
    timed = [c for c in partition.get("candidates", []) + partition.get("baselines", []) if c.get("measured_s")]
    if len(features) < microbatches or not timed:
        return None
    ratios = []
    for candidate in timed:
        costs = step_costs(table, cluster, layout, [b - first for b in candidate["bounds"]])
        simulated = simulate_step(costs, layout, load_rows(features), cluster, cores=cores).step_s
        ratios.append(candidate["measured_s"] / simulated)
    return float(np.median(ratios))


MIN_COMPARED_STEPS = 3  # a borrowed-cost comparison's steps: each is calibrated on the others


def compare_cp_run(out: Path, config: dict, model, skip: int, cores: float | None) -> dict:
    """A context-parallel run (parallel.cp > 1): each step's packs as its metrics line lists them (`cp_packs`),
    simulated (K/V all-gathered, as the run does) on dp x cp GPUs at the run's boundary bandwidth, against the
    measured step. The run profiles no layer, so `model` names the costs (another run's OUT/cost_model.json on
    the same host, with its partition.json beside it for the bandwidth). Calibrated leave-one-out
    (`_calibrated_comparison`)."""
    table, cluster = _borrowed_costs(model, config["parallel"]["dp"] * config["parallel"]["cp"], "context-parallel")
    parallel = config["parallel"]
    dp, cp = parallel["dp"], parallel["cp"]
    patches = ((config.get("model") or {}).get("tile_size", 448) // (config.get("model") or {}).get("patch_size", 14)) ** 2

    def simulated(record: dict) -> float | None:
        if not record.get("cp_packs"):
            return None
        return simulate_cp(cp_step(record["cp_packs"], dp, cp, patches), table, cluster)["step_s"]
    return _calibrated_comparison(out, simulated, skip, {"encoder": "stages", "pp": 1, "cores": cores,
                                                         "schedule": f"context parallel {cp}"})


def compare_disaggregated_run(out: Path, config: dict, model, skip: int, cores: float | None) -> dict:
    """A run with encoder ranks (parallel.encoder=disaggregated): each step's LLM microbatches and each encoder
    rank's work as its metrics line lists them (`llm_microbatches`, `encoder_work`), simulated on dp x pp + E devices
    sharing the host's cores, against the measured step. Costs and calibration as for a context-parallel run."""
    parallel = config["parallel"]
    dp, pp, encoders, m = parallel["dp"], parallel["pp"], parallel["encoder_ranks"], config["data"]["microbatches"]
    table, cluster = _borrowed_costs(model, dp * pp + encoders, "an encoder-ranks")
    layout = Placement("disaggregated", dp, pp, 1, 1, parallel["schedule"], encoders)
    first = int(table.encoder.sum())
    bounds = [b - first for b in _read(out / "partition.json")["bounds"]] if pp > 1 else \
        [0, int((~table.encoder).sum())]
    costs = step_costs(table, cluster, layout, bounds)

    def simulated(record: dict) -> float | None:
        if not record.get("llm_microbatches"):
            return None
        loads = np.zeros((dp, m, 5))
        for rank, k, tokens, tiles, square in record["llm_microbatches"]:
            loads[rank, k, [0, TILES, TOKENS, TOKEN_SQUARE]] = 1.0, tiles, tokens, square
        split = np.zeros((encoders, dp, m))
        for e, consumer, k, units in record.get("encoder_work", []):
            split[e, consumer, k] += units
        loads[..., TILES] = split.sum(axis=0)  # the tiles each microbatch consumes, as encoded (a measured
        # table's vision layers have no squared term: tiles are all one size)
        return simulate_step(costs, layout, loads, cluster, cores=cores, encoder_split=split).step_s
    return _calibrated_comparison(out, simulated, skip, {"encoder": "disaggregated", "pp": pp, "cores": cores,
                                                         "schedule": f"{encoders} encoder rank(s) + dp {dp}" + (
                                                             f" x pp {pp} ({parallel['schedule']})" if pp > 1
                                                             else "")})


def _borrowed_costs(model, devices: int, kind: str):
    """The layer costs of another run on the same host (`model`: its OUT/cost_model.json) and a cluster of
    `devices` at that run's boundary bandwidth (its partition.json beside it)."""
    if model is None:
        raise ValueError(f"{kind} run profiles no layer: give --model another run's OUT/cost_model.json (a run "
                         "with a partition search, on the same host)")
    table, _ = load_model(str(model))
    beside = Path(model).parent / "partition.json"
    bandwidth = (_read(beside).get("comm_gbps") if beside.is_file() else None) or Cluster(1).intra_gbs
    return table, Cluster(devices, gpus_per_node=devices, intra_gbs=bandwidth, inter_gbs=bandwidth)


def _calibrated_comparison(out: Path, simulate, skip: int, described: dict) -> dict:
    """Each measured step after `skip` that `simulate(record)` can simulate, calibrated leave-one-out: its
    prediction is its simulation times the median measured / simulated ratio of the run's other steps (one
    constant per run, for the host's overheads the borrowed costs leave out; never fitted on the step itself)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for record in records[skip:]:
        seconds = simulate(record) if "pipeline_s" in record else None
        if seconds is not None:
            steps.append({"epoch": record["epoch"], "step": record["step"], "simulated_s": seconds,
                          "measured_s": record["pipeline_s"]})
    if len(steps) < MIN_COMPARED_STEPS:
        raise ValueError(f"{out}/metrics.jsonl holds {len(steps)} measured steps with their packs after the first "
                         f"{skip}; run at least {MIN_COMPARED_STEPS} (optim.steps) to compare")
    ratios = np.array([s["measured_s"] / s["simulated_s"] for s in steps])
    for k, s in enumerate(steps):
        s["predicted_s"] = s["simulated_s"] * float(np.median(np.delete(ratios, k)))
    measured = np.array([s["measured_s"] for s in steps])
    raw = np.array([s["simulated_s"] for s in steps]) / measured - 1
    calibrated = np.array([s["predicted_s"] for s in steps]) / measured - 1
    return {"run": str(out), **described, "bounds": [], "overhead_factor": float(np.median(ratios)),
            "steps": steps, "mean_error_raw": float(raw.mean()), "mean_abs_error_raw": float(np.abs(raw).mean()),
            "mean_error": float(calibrated.mean()), "mean_abs_error": float(np.abs(calibrated).mean())}


def cp_step(packs: list[list[int]], dp: int, cp: int, patches_per_tile: int) -> CpWorkload:
    """One step of a CP run's packs (replica, microbatch, degree, cp_group, tokens, tiles, square)."""
    rows = np.array(packs, dtype=np.float64).reshape(-1, 7)
    microbatches = int(rows[:, 1].max()) + 1 if len(rows) else 1
    return CpWorkload.of_packs(np.zeros(len(rows)), rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4],
                               rows[:, 5], rows[:, 6], patches_per_tile, 1, dp, microbatches, cp, 0, "run")
