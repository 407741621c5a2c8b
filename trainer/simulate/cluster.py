"""The cluster the simulator places a plan on: GPUs, their speed, and the links between them.

Ranks are laid out as Megatron lays them out: tensor-parallel ranks innermost, then data-parallel, then
pipeline stages (rank = (stage * dp + replica) * tp + t), nodes of `gpus_per_node` consecutive ranks. A
transfer between two ranks of one node runs at the intra-node bandwidth, otherwise at the inter-node one
(per GPU). Collectives are rings: a reduce-scatter or an all-gather of B bytes over n ranks sends
(n - 1) / n * B per rank, over the slowest link of the ring.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    peak_tflops: float = 989.0  # H100/H800 SXM dense bf16 (Optimus's testbed)
    achievable: float = 0.55  # fraction of peak a transformer layer's kernels reach
    intra_gbs: float = 450.0  # GB/s per GPU within a node (NVLink 4, one direction)
    inter_gbs: float = 50.0  # GB/s per GPU across nodes (one 400 Gb/s NIC per GPU)
    latency_s: float = 10e-6  # per message / per ring step

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} must be >= 1")
        if not 0 < self.achievable <= 1:
            raise ValueError(f"--achievable {self.achievable} is a fraction of peak: in (0, 1]")
        for name in ("peak_tflops", "intra_gbs", "inter_gbs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")

    @property
    def flops_per_second(self) -> float:
        """What one GPU sustains on a layer's matmuls."""
        return self.peak_tflops * 1e12 * self.achievable

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def send_seconds(self, nbytes: float, source: int, target: int) -> float:
        """Point-to-point transfer (0 on the same GPU)."""
        if source == target or nbytes <= 0:
            return 0.0
        bandwidth = self.intra_gbs if self.node(source) == self.node(target) else self.inter_gbs
        return self.latency_s + nbytes / (bandwidth * 1e9)

    def ring_seconds(self, nbytes: float, ranks: list[int]) -> float:
        """A reduce-scatter or all-gather of `nbytes` (the full buffer) over `ranks`."""
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        spans_nodes = len({self.node(r) for r in ranks}) > 1
        bandwidth = self.inter_gbs if spans_nodes else self.intra_gbs
        return (n - 1) * self.latency_s + (n - 1) / n * nbytes / (bandwidth * 1e9)

    def tensor_parallel_seconds_per_byte(self, tp: int) -> float:
        """Seconds per activation byte of one layer pass under Megatron's sequence-parallel TP: two all-gathers
        and two reduce-scatters of the layer's activations, within a node."""
        if tp <= 1:
            return 0.0
        return 4 * (tp - 1) / tp / (self.intra_gbs * 1e9)


def megatron_rank(stage: int, replica: int, t: int, dp: int, tp: int) -> int:
    return (stage * dp + replica) * tp + t
