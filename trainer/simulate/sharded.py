"""Sharded data parallelism (`--data-parallel fsdp|zero3`, at pp 1): every layer is a barrier over the DP group.

FSDP and DeepSpeed ZeRO-3 hold 1/dp of every layer's parameters on each GPU. Before a layer runs, forward and
again backward, its parameters are all-gathered (bf16) over the DP group; after its backward, its gradients are
reduce-scattered (fp32). Both are collectives: one starts when every rank has asked for it. Each rank asks for
layer l + 1's gather as it starts layer l (one layer of prefetch, FSDP's and ZeRO-3's default), so no rank
starts layer l + 1 before every rank has started layer l: a rank with more tokens or tiles holds every other
rank back, layer by layer, and each phase of a step waits for its own slowest rank. That is where balancing
each phase on its own (`isf+phases`) pays and a colocated sum does not.

One step: each microbatch's layers forward, then backward (gradient accumulation; reduce-scatters every
microbatch, as both frameworks do by default). With the encoder routed (`--encoder phases`, plan isf+phases),
each rank encodes its routed share of the whole step once, an all-to-all hands the outputs over, the LLM's
layers run microbatch by microbatch, and a second all-to-all returns the gradients before the encoder's
backward (as `packfeed train parallel.encoder=phases` runs it). Collectives share one communication stream per
GPU, in issue order; the optimizer step is not simulated. FSDP and ZeRO-3 are modelled alike: the same
gathers, reductions and barriers (their bucket sizes and prefetch depths differ in practice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.trainer.simulate.cluster import Cluster, megatron_rank
from packfeed.trainer.simulate.model_shape import TILES, LayerTable
from packfeed.trainer.simulate.placement import GRAD_BYTES, PARAM_BYTES, StepResult, priced_layers
from packfeed.trainer.simulate.routed import all_to_all_seconds

SHARDED = ("fsdp", "zero3")


@dataclass
class _Ranks:
    """Every rank's compute clock, the time each last started an op, and the shared communication stream."""

    clock: np.ndarray
    started: np.ndarray
    comm_free: float
    busy: np.ndarray

    @classmethod
    def of(cls, dp: int) -> _Ranks:
        return cls(np.zeros(dp), np.zeros(dp), 0.0, np.zeros(dp))

    def gathered_then_run(self, gather_s: float, seconds: np.ndarray) -> None:
        """A layer pass: its parameters gathered once every rank has started its previous op (prefetch), then
        each rank's compute."""
        ready = max(float(self.started.max()), self.comm_free) + gather_s
        self.comm_free = ready
        self.started = np.maximum(self.clock, ready)
        self.clock = self.started + seconds
        self.busy += seconds

    def reduce(self, reduce_s: float) -> None:
        """A reduce-scatter once every rank is done with the layer's backward (compute goes on meanwhile)."""
        self.comm_free = max(float(self.clock.max()), self.comm_free) + reduce_s

    def exchange(self, seconds: float) -> None:
        """An all-to-all: every rank waits for the last to arrive, then for the transfer."""
        done = max(float(self.clock.max()), self.comm_free) + seconds
        self.clock[:] = done
        self.started[:] = done
        self.comm_free = done


def sharded_step(table: LayerTable, cluster: Cluster, loads: np.ndarray, tp: int = 1,
                 routing: tuple[np.ndarray, np.ndarray] | None = None) -> StepResult:
    """One step at pp 1 under sharded data parallelism. `loads`: (dp, microbatches, terms). `routing`: the
    encoder routed (isf+phases): the step's (encoder load row per rank, tiles moved encoder -> consumer)."""
    dp = loads.shape[0]
    seconds = priced_layers(table, cluster, tp)  # (layers, 2, terms)
    group = [megatron_rank(0, r, 0, dp, tp) for r in range(dp)]
    gather = np.array([cluster.ring_seconds(PARAM_BYTES * p / tp, group) for p in table.params])
    reduce = np.array([cluster.ring_seconds(GRAD_BYTES * p / tp, group) for p in table.params])
    ranks = _Ranks.of(dp)
    layers = np.arange(len(table))
    encoder = table.encoder if routing is not None else np.zeros(len(table), bool)
    llm = layers[~encoder]
    exchange = 0.0
    if routing is not None:
        encoder_loads, moved = routing
        tile_bytes = float(table.output_bytes[int(np.flatnonzero(table.encoder)[-1]), TILES])
        exchange = all_to_all_seconds(moved, tile_bytes, cluster, dp, tp)
        for layer in layers[encoder]:
            ranks.gathered_then_run(gather[layer], encoder_loads @ seconds[layer, 0])
        ranks.exchange(exchange)
    for m in range(loads.shape[1]):
        for layer in llm:
            ranks.gathered_then_run(gather[layer], loads[:, m] @ seconds[layer, 0])
        for layer in llm[::-1]:
            ranks.gathered_then_run(gather[layer], loads[:, m] @ seconds[layer, 1])
            ranks.reduce(reduce[layer])
    if routing is not None:
        ranks.exchange(exchange)
        for layer in layers[encoder][::-1]:
            ranks.gathered_then_run(gather[layer], routing[0] @ seconds[layer, 1])
            ranks.reduce(reduce[layer])
    step = max(float(ranks.clock.max()), ranks.comm_free)
    return StepResult(step, {"stage 0": [float(b) for b in ranks.busy]}, device_names={0: "rank 0"})
