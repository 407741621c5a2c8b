"""One training step on the cluster, for each place the vision encoder can run (`--encoder`):

- `stages`: encoder and LLM layers are one pipeline (the encoder in the first stages), sharing its DP.
- `bubbles` (Optimus): the pipeline holds only LLM layers; every GPU of a replica holds the encoder (its DP runs
  over all dp x pp GPUs) and encodes a balanced share of each microbatch's tiles as filler work in its idle
  time. A microbatch's encoder forwards end, and their embeddings reach the first stage, before that stage's
  forward of it; their backwards start when its gradient comes back from the first stage's backward.
- `disaggregated` (DistTrain): the encoder runs on GPUs of its own with its own DP; each LLM replica's
  microbatches are encoded by its group of encoder GPUs (or a GPU serves several replicas), embeddings and
  their gradients cross the network.
- `phases` (OrchMLLM; plan strategy isf+phases): the pipeline holds only LLM layers; each replica's first-stage
  GPUs encode the tiles the plan routes to them, and all-to-alls over the replicas join the encoder to the
  LLM (`packfeed.trainer.simulate.routed`).

Data parallelism (Megatron's distributed optimizer with overlapped gathers and reductions): each GPU
all-gathers its bf16 parameters bucket by bucket while it computes — its first operation waits for the first
bucket, its second for all of them — and reduce-scatters its fp32 gradients while its last backward runs: the
reduction ends no earlier than the whole reduction after that backward starts, nor than the last bucket's after
it ends. A collective waits for every member of its group; the LLM's and the encoder's share one GPU's network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster, megatron_rank
from packfeed.trainer.simulate.model_shape import TILES, VISION_SQUARE, LayerTable
from packfeed.trainer.simulate.routed import routed_step
from packfeed.trainer.parallel.schedules import encoder_deadlines, pipeline_order, split_tiles
from packfeed.trainer.simulate.schedule import Run, Task, run_tasks

Encoder = Literal["stages", "bubbles", "disaggregated", "phases"]
ENCODERS: tuple[str, ...] = ("stages", "bubbles", "disaggregated", "phases")
PARAM_BYTES, GRAD_BYTES = 2, 4  # bf16 weights gathered, fp32 gradients reduced
BUCKET_PARAMS = 40e6  # Megatron DDP's bucket (parameters per GPU)


@dataclass(frozen=True)
class Placement:
    """Where everything runs. `dp` counts LLM replicas; `encoder_groups` is for `disaggregated` only."""

    encoder: Encoder
    dp: int
    pp: int
    tp: int = 1
    chunks: int = 1  # virtual stages per pipeline rank (interleaved 1F1B)
    schedule: str = "1f1b"
    encoder_groups: int = 0  # disaggregated: encoder GPUs / tp (each group one encoder replica)

    @property
    def llm_gpus(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def gpus(self) -> int:
        return self.llm_gpus + self.encoder_groups * self.tp


@dataclass
class StepCosts:
    """A layer table priced for a cluster and TP degree, cut into the layout's pipeline chunks."""

    chunk_seconds: np.ndarray  # (virtual stages, 2, terms)
    chunk_out_bytes: np.ndarray  # (virtual stages, terms): what the boundary after the chunk sends
    stage_params: np.ndarray  # (pp,) parameters each pipeline GPU holds (before TP)
    encoder_seconds: np.ndarray  # (2, terms) the whole encoder (bubbles / disaggregated), zeros for stages
    embedding_bytes: np.ndarray  # (terms,) encoder output a microbatch sends to the first LLM stage
    encoder_params: float


def priced_layers(table: LayerTable, cluster: Cluster, tp: int) -> np.ndarray:
    """(layers, 2, terms) seconds on one GPU of a TP group: compute split tp ways (measured costs are taken as
    measured), plus Megatron's sequence-parallel TP collectives on each layer's activations."""
    seconds = table.seconds(cluster.flops_per_second)
    if table.measured_seconds is None:
        seconds = seconds / tp
    tp_comm = cluster.tensor_parallel_seconds_per_byte(tp) * table.output_bytes
    return seconds + tp_comm[:, None, :]


def step_costs(table: LayerTable, cluster: Cluster, layout: Placement, bounds: Sequence[int]) -> StepCosts:
    """`bounds`: virtual-stage boundaries over the pipeline's layers (all layers for `stages`, the LLM's
    otherwise), len = pp * chunks + 1."""
    seconds = priced_layers(table, cluster, layout.tp)
    in_pipeline = np.ones(len(table), bool) if layout.encoder == "stages" else ~table.encoder
    pipe_seconds, pipe_out, pipe_params = seconds[in_pipeline], table.output_bytes[in_pipeline], \
        table.params[in_pipeline]
    cuts = list(zip(bounds[:-1], bounds[1:]))
    chunk_seconds = np.stack([pipe_seconds[a:b].sum(axis=0) for a, b in cuts])
    chunk_out = np.stack([pipe_out[b - 1] if b > a else np.zeros(pipe_out.shape[1]) for a, b in cuts])
    chunk_params = np.array([pipe_params[a:b].sum() for a, b in cuts])
    stage_params = chunk_params.reshape(layout.chunks, layout.pp).sum(axis=0)
    encoder = table.encoder
    if layout.encoder == "stages" or not encoder.any():
        return StepCosts(chunk_seconds, chunk_out, stage_params, np.zeros(seconds.shape[1:]),
                         np.zeros(seconds.shape[2]), 0.0)
    last_encoder = int(np.flatnonzero(encoder)[-1])
    return StepCosts(chunk_seconds, chunk_out, stage_params, seconds[encoder].sum(axis=0),
                     table.output_bytes[last_encoder], float(table.params[encoder].sum()))


@dataclass
class StepResult:
    step_s: float
    busy_s: dict[str, list[float]]  # "stage k" / "encoder": busy seconds of each GPU of that role
    run: Run | None = field(default=None, repr=False)  # replica 0's (or the whole job's) tasks, for timelines
    tasks: list[Task] | None = field(default=None, repr=False)
    device_names: dict[int, str] = field(default_factory=dict)

    def bubble_fractions(self) -> dict[str, float]:
        return {role: 1.0 - float(np.mean(busy)) / self.step_s if self.step_s else 0.0
                for role, busy in self.busy_s.items()}


def _pipeline_tasks(costs: StepCosts, layout: Placement, loads: np.ndarray, cluster: Cluster, replica: int,
                    device_of: Callable[[int, int], int], tasks: list[Task]) -> tuple[dict, dict]:
    """Forward and backward tasks of one replica's pipeline; returns ({(op, vstage, j): task}, orders)."""
    pp, chunks, m = layout.pp, layout.chunks, loads.shape[0]
    index: dict[tuple[str, int, int], int] = {}
    orders: dict[int, list[int]] = {}
    for s in range(pp):
        device = device_of(replica, s)
        orders[device] = []
        for kind, chunk, j in pipeline_order(layout.schedule, s, pp, m, chunks):
            v = chunk * pp + s
            seconds = float(costs.chunk_seconds[v, 0 if kind == "F" else 1] @ loads[j])
            index[(kind, v, j)] = len(tasks)
            orders[device].append(len(tasks))
            tasks.append(Task(device, seconds, kind, j, chunk))
    stages = pp * chunks
    rank = [megatron_rank(v % pp, replica, 0, layout.dp, layout.tp) for v in range(stages)]
    for (kind, v, j), i in index.items():
        needs = tasks[i].needs
        if kind == "F" and v > 0:
            sent = float(costs.chunk_out_bytes[v - 1] @ loads[j])
            needs.append((index[("F", v - 1, j)], cluster.send_seconds(sent, rank[v - 1], rank[v])))
        if kind == "B":
            needs.append((index[("F", v, j)], 0.0))
            if v < stages - 1:
                sent = float(costs.chunk_out_bytes[v] @ loads[j])
                needs.append((index[("B", v + 1, j)], cluster.send_seconds(sent, rank[v + 1], rank[v])))
    return index, orders


def _share_load(load: np.ndarray, share: float, tiles: float) -> np.ndarray:
    """An encoder task's load row: `share` of the microbatch's tiles (and of their squared lengths)."""
    row = np.zeros_like(load)
    row[0] = 1.0
    if tiles > 0:
        row[TILES] = share
        row[VISION_SQUARE] = load[VISION_SQUARE] * share / tiles
    return row


def _encoder_tasks(costs: StepCosts, loads: np.ndarray, devices: Sequence[int], ranks: Sequence[int],
                   first_rank: int, index: dict, cluster: Cluster, tasks: list[Task],
                   deadlines: dict[int, list[tuple[int, int]]] | None = None,
                   shares: np.ndarray | None = None) -> None:
    """Filler encoder tasks for one replica's microbatches on `devices` (one balanced share each, or `shares`:
    microbatches x devices tiles, as a plan with encoder ranks assigns them), wired to the replica's first
    stage (at rank `first_rank`), whose forward and backward tasks `index` holds. `deadlines` (colocated
    encoders: device k is pipeline rank k) makes each share due before the rank's own backward."""
    shares = split_tiles(loads[:, TILES], len(devices)) if shares is None else shares
    for j in range(loads.shape[0]):
        tiles = float(loads[j, TILES])
        for k, (device, rank) in enumerate(zip(devices, ranks)):
            if shares[j, k] == 0:
                continue
            row = _share_load(loads[j], float(shares[j, k]), tiles)
            embedding = float(costs.embedding_bytes @ row)
            delay = cluster.send_seconds(embedding, rank, first_rank)
            forward = len(tasks)
            tasks.append(Task(device, float(costs.encoder_seconds[0] @ row), "EF", j, filler=True, priority=j))
            tasks[index[("F", 0, j)]].needs.append((forward, delay))
            tasks.append(Task(device, float(costs.encoder_seconds[1] @ row), "EB", j, filler=True,
                              priority=j + 0.5, needs=[(forward, 0.0), (index[("B", 0, j)], delay)]))
            if deadlines is not None:  # colocated: done before this GPU's own backward that precedes F(j)
                for chunk, i in deadlines.get(j, []):
                    tasks[index[("B", chunk * len(devices) + k, i)]].needs.append((forward, 0.0))


@dataclass(frozen=True)
class Collective:
    """One GPU's data-parallel collectives: the whole gather and reduction and their first / last bucket."""

    gather_s: float = 0.0
    first_gather_s: float = 0.0
    reduce_s: float = 0.0
    last_reduce_s: float = 0.0

    @classmethod
    def of(cls, cluster: Cluster, params: float, ranks: list[int]) -> Collective:
        bucket = min(params, BUCKET_PARAMS)
        return cls(cluster.ring_seconds(PARAM_BYTES * params, ranks), cluster.ring_seconds(PARAM_BYTES * bucket, ranks),
                   cluster.ring_seconds(GRAD_BYTES * params, ranks), cluster.ring_seconds(GRAD_BYTES * bucket, ranks))

    def reduced(self, last_start: float, last_end: float) -> float:
        """When the reduction ends, its group's last backward having run from last_start to last_end."""
        return max(last_start + self.reduce_s, last_end + self.last_reduce_s)


def _collectives(costs: StepCosts, layout: Placement, cluster: Cluster) -> tuple[list[Collective], Collective]:
    """Per pipeline stage (over its DP group), and the encoder's over its own group."""
    llm = [Collective.of(cluster, p / layout.tp, [megatron_rank(s, r, 0, layout.dp, layout.tp)
                                                   for r in range(layout.dp)])
           for s, p in enumerate(costs.stage_params)]
    return llm, Collective.of(cluster, costs.encoder_params / layout.tp, _encoder_ranks(layout))


def _encoder_ranks(layout: Placement) -> list[int]:
    if layout.encoder == "bubbles":
        return list(range(0, layout.llm_gpus, layout.tp))
    if layout.encoder == "phases":  # the first stage's GPUs of every replica
        return [megatron_rank(0, r, 0, layout.dp, layout.tp) for r in range(layout.dp)]
    if layout.encoder == "disaggregated":
        return [layout.llm_gpus + e * layout.tp for e in range(layout.encoder_groups)]
    return []


def _release(tasks: list[Task], orders: dict[int, list[int]], stage_of: Callable[[int], int],
             llm: list[Collective], encoder: Collective, encoder_first: float, shared: bool) -> None:
    """Start times from the gathers: a device's first scheduled task after its first bucket, the others after
    its whole gather (after the encoder's too when the two share the network); encoder tasks after the encoder's
    first bucket (microbatch 0) or whole gather, from `encoder_first` on."""
    for device, order in orders.items():
        gather = llm[stage_of(device)]
        for k, i in enumerate(order):
            tasks[i].release = gather.first_gather_s if k == 0 else \
                gather.gather_s + (encoder.gather_s if shared else 0.0)
    for task in tasks:
        if task.filler:
            task.release = encoder_first + (encoder.first_gather_s if task.microbatch == 0 else encoder.gather_s)


def simulate_step(costs: StepCosts, layout: Placement, loads: np.ndarray, cluster: Cluster,
                  keep_run: bool = False, cores: float | None = None,
                  routing: tuple[np.ndarray, np.ndarray] | None = None,
                  encoder_split: np.ndarray | None = None) -> StepResult:
    """`loads`: (replicas, microbatches, terms) load rows of one global step. `cores`: a replica's ranks share
    that many processors (a CPU run; see `run_tasks`). `routing`: `phases` only, the step's (encoder load row
    per replica, tiles moved encoder -> consumer) (`packfeed.trainer.simulate.routed`). `encoder_split`:
    `disaggregated` only, the step's tiles per (encoder GPU, replica, microbatch) as its plan assigns them
    (None: each replica's encoded by a group of the encoder GPUs, evenly)."""
    if layout.encoder == "disaggregated":
        return _simulate_disaggregated(costs, layout, loads, cluster, keep_run, encoder_split, cores)
    llm, encoder = _collectives(costs, layout, cluster)
    runs: dict[bytes, tuple[Run, list[Task]]] = {}
    per_replica = []
    for r in range(layout.dp):
        key = loads[r].tobytes()
        if key not in runs:  # replicas with the same loads run the same schedule
            runs[key] = simulate_replica(costs, layout, loads[r], cluster, llm, encoder, cores)
        per_replica.append(runs[key])
    pp = layout.pp
    first_run, first_tasks = per_replica[0]
    names = {s: f"stage {s}" for s in range(pp)}
    if layout.encoder == "phases":
        if routing is None:
            raise ValueError("--encoder phases needs the plan's routing: --strategy isf+phases (or its plan file)")
        step, busy = routed_step(per_replica, llm, encoder, costs.encoder_seconds, routing[0], routing[1],
                                 float(costs.embedding_bytes[TILES]), cluster, layout.dp, layout.tp)
        return StepResult(step, busy, first_run if keep_run else None, first_tasks if keep_run else None, names)
    step = 0.0
    encoder_last = [run.last_task(s, tasks, filler=True) for run, tasks in per_replica for s in range(pp)]
    encoder_start, encoder_end = max(s for s, _ in encoder_last), max(e for _, e in encoder_last)
    for s in range(pp):
        last = [run.last_task(s, tasks, filler=False) for run, tasks in per_replica]
        start, end = max(a for a, _ in last), max(b for _, b in last)
        step = max(step, llm[s].reduced(start, end))
        if layout.encoder == "bubbles" and encoder_end > 0:
            step = max(step, encoder.reduced(encoder_start, encoder_end),
                       min(start, encoder_start) + llm[s].reduce_s + encoder.reduce_s)
    busy = {f"stage {s}": [run.busy(s) for run, _ in per_replica] for s in range(pp)}
    return StepResult(step, busy, first_run if keep_run else None, first_tasks if keep_run else None, names)


def simulate_replica(costs: StepCosts, layout: Placement, loads: np.ndarray, cluster: Cluster,
                     llm: list[Collective] | None = None, encoder: Collective = Collective(),
                     cores: float | None = None) -> tuple[Run, list[Task]]:
    """One replica's step (stages / bubbles), devices numbered by stage, started by the DP gathers."""
    tasks: list[Task] = []
    index, orders = _pipeline_tasks(costs, layout, loads, cluster, 0, lambda r, s: s, tasks)
    if layout.encoder == "bubbles" and costs.encoder_seconds.any():
        ranks = [megatron_rank(s, 0, 0, layout.dp, layout.tp) for s in range(layout.pp)]
        _encoder_tasks(costs, loads, list(range(layout.pp)), ranks, ranks[0], index, cluster, tasks,
                       encoder_deadlines(layout.schedule, layout.pp, loads.shape[0], layout.chunks))
    llm = llm or [Collective()] * layout.pp
    _release(tasks, orders, lambda d: d, llm, encoder, llm[0].first_gather_s, layout.encoder == "bubbles")
    return run_tasks(tasks, orders, cores), tasks


def encoder_groups(replicas: int, encoder_gpus: int) -> list[list[int]]:
    """Which encoder GPUs serve each LLM replica: a group of GPUs each when there are more encoder GPUs than
    replicas (the first groups one larger when they do not divide), else each GPU serves several replicas."""
    if encoder_gpus >= replicas:
        base, extra = divmod(encoder_gpus, replicas)
        groups, first = [], 0
        for r in range(replicas):
            size = base + (1 if r < extra else 0)
            groups.append(list(range(first, first + size)))
            first += size
        return groups
    return [[r % encoder_gpus] for r in range(replicas)]


def _simulate_disaggregated(costs: StepCosts, layout: Placement, loads: np.ndarray, cluster: Cluster,
                            keep_run: bool, split: np.ndarray | None = None,
                            cores: float | None = None) -> StepResult:
    """The whole job in one run: encoder GPUs are shared by replicas; with the plan's `split` (encoder GPU,
    replica, microbatch) each encoder GPU encodes what its plan assigns it, microbatch after microbatch."""
    pp, dp = layout.pp, layout.dp
    llm, encoder = _collectives(costs, layout, cluster)
    tasks: list[Task] = []
    orders: dict[int, list[int]] = {}
    indexes = []
    for r in range(dp):
        index, replica_orders = _pipeline_tasks(costs, layout, loads[r], cluster, r, lambda q, s: q * pp + s,
                                                tasks)
        indexes.append(index)
        orders.update(replica_orders)
    first_encoder = dp * pp
    encoder_rank = [layout.llm_gpus + e * layout.tp for e in range(layout.encoder_groups)]
    if split is not None and split.shape[0] != layout.encoder_groups:
        raise ValueError(f"the plan splits the encoder over {split.shape[0]} ranks, the layout has "
                         f"{layout.encoder_groups} encoder groups")
    groups = [list(range(layout.encoder_groups))] * dp if split is not None else \
        encoder_groups(dp, layout.encoder_groups)
    for r, group in enumerate(groups):
        _encoder_tasks(costs, loads[r], [first_encoder + e for e in group], [encoder_rank[e] for e in group],
                       megatron_rank(0, r, 0, dp, layout.tp), indexes[r], cluster, tasks,
                       shares=split[:, r, :].T if split is not None else None)
    _release(tasks, orders, lambda d: d % pp, llm, encoder, 0.0, False)
    run = run_tasks(tasks, orders, cores)
    step = 0.0
    for s in range(pp):
        last = [run.last_task(r * pp + s, tasks) for r in range(dp)]
        step = max(step, llm[s].reduced(max(a for a, _ in last), max(b for _, b in last)))
    encoder_devices = range(first_encoder, first_encoder + layout.encoder_groups)
    last = [run.last_task(d, tasks) for d in encoder_devices]
    step = max(step, encoder.reduced(max(a for a, _ in last), max(b for _, b in last)))
    busy = {f"stage {s}": [run.busy(r * pp + s) for r in range(dp)] for s in range(pp)}
    busy["encoder"] = [run.busy(d) for d in encoder_devices]
    names = {r * pp + s: f"replica {r} stage {s}" for r in range(dp) for s in range(pp)}
    names.update({d: f"encoder {d - first_encoder}" for d in encoder_devices})
    return StepResult(step, busy, run if keep_run else None, tasks if keep_run else None, names)
