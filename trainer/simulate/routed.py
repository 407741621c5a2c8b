"""The encoder routed (`--encoder phases`, plan strategy isf+phases; OrchMLLM): every replica's first-stage GPUs
encode the tiles the plan assigns them, whichever replica's packs consume them; an all-to-all over the replicas
hands each output to its consumer, the LLM pipeline (its layers only) runs the step, and a second all-to-all
returns the outputs' gradients for the encoder's backward.

The two all-to-alls synchronise every replica, so a step is: the encoder's forward (the slowest replica's
share), the all-to-all, the LLM pipeline with its data-parallel reductions overlapped bucket by bucket, and,
once every replica's backward has reached its first stage, the returning all-to-all, the encoder's backward and
its gradient reduction. An all-to-all takes each GPU's bytes out or in (the larger) over its intra-node and its
inter-node link, the two at once; the slowest GPU sets it. The LLM's parameter gathers are not overlapped with
the encoder's forward (a conservative choice: at most the gathers' time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster, megatron_rank
from packfeed.trainer.simulate.model_shape import TILES, VISION_SQUARE
from packfeed.trainer.simulate.schedule import Run, Task


@dataclass(frozen=True)
class Routing:
    """Per step of a workload: each replica's encoder load row (its encoded tiles), and the tiles moved from
    encoding replica to consuming replica (the diagonal: kept where they were encoded)."""

    encoder_loads: np.ndarray  # (steps, dp, terms)
    moved: np.ndarray  # (steps, dp, dp): [step, encoder, consumer]

    @classmethod
    def of_plan(cls, offsets: np.ndarray, members: np.ndarray, encoder_rank: np.ndarray, tiles: np.ndarray, dp: int,
                microbatches: int, patches_per_tile: float) -> Routing:
        sizes = np.diff(offsets)
        pack = np.repeat(np.arange(len(sizes)), sizes)
        step = pack // (dp * microbatches)
        consumer = (pack // microbatches) % dp
        steps = len(sizes) // (dp * microbatches)
        weight = tiles[members].astype(np.float64)
        moved = np.zeros((steps, dp, dp))
        np.add.at(moved, (step, encoder_rank, consumer), weight)
        encoded = moved.sum(axis=2)
        rows = np.zeros((steps, dp, 5))
        rows[..., 0] = encoded > 0
        rows[..., TILES] = encoded
        rows[..., VISION_SQUARE] = encoded * float(patches_per_tile) ** 2
        return cls(rows, moved)


def all_to_all_seconds(moved: np.ndarray, tile_bytes: float, cluster: Cluster, dp: int, tp: int) -> float:
    """One all-to-all of a step's `moved` (dp x dp tiles) between the replicas' first-stage GPUs (each holds
    1/tp of every tile's output under sequence parallelism)."""
    if dp <= 1:
        return 0.0
    ranks = np.array([megatron_rank(0, r, 0, dp, tp) for r in range(dp)])
    same_node = np.equal.outer(ranks // cluster.gpus_per_node, ranks // cluster.gpus_per_node)
    sent = moved * (tile_bytes / tp)
    np.fill_diagonal(sent, 0.0)
    seconds = 0.0
    for within, gbs in ((same_node, cluster.intra_gbs), (~same_node, cluster.inter_gbs)):
        part = np.where(within, sent, 0.0)
        per_gpu = np.maximum(part.sum(axis=1), part.sum(axis=0))
        seconds = max(seconds, float(per_gpu.max()) / (gbs * 1e9))
    return seconds + (dp - 1) * cluster.latency_s if sent.any() else 0.0


def routed_step(pipeline: list[tuple[Run, list[Task]]], llm: list, encoder, encoder_seconds: np.ndarray,
                encoder_loads: np.ndarray, moved: np.ndarray, tile_bytes: float, cluster: Cluster, dp: int,
                tp: int) -> tuple[float, dict[str, list[float]]]:
    """(step seconds, busy seconds of each GPU per stage) of one step. `pipeline`: each replica's LLM pipeline
    run; `llm`/`encoder`: their DP collectives (`Collective`); `encoder_seconds`: (2, terms) of the whole
    encoder; `encoder_loads`: each replica's encoder load row; `moved`: tiles, encoder -> consumer."""
    forward = encoder_loads @ encoder_seconds[0]
    backward = encoder_loads @ encoder_seconds[1]
    exchange = all_to_all_seconds(moved, tile_bytes, cluster, dp, tp)
    start = encoder.first_gather_s + float(forward.max()) + exchange  # the LLM pipeline begins
    stages = len(llm)
    step = 0.0
    for s in range(stages):
        ends = [run.last_task(s, tasks) for run, tasks in pipeline]
        step = max(step, start + llm[s].reduced(max(a for a, _ in ends), max(b for _, b in ends)))
    first_stage_done = start + max(run.last_task(0, tasks)[1] for run, tasks in pipeline)
    encoder_backward = first_stage_done + exchange
    step = max(step, encoder.reduced(encoder_backward, encoder_backward + float(backward.max())))
    busy = {f"stage {s}": [run.busy(s) for run, _ in pipeline] for s in range(stages)}
    busy["stage 0"] = [b + float(f + g) for b, f, g in zip(busy["stage 0"], forward, backward)]  # same GPUs
    return step, busy
