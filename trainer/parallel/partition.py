"""Balanced model partition search (OmniBal §4.2).

1. Profile every layer (forward + backward time, activations it hands on) — `packfeed.trainer.parallel.profile`.
2. Anchor: cut the layer list where the cumulative time crosses k/P of the total (greedy), so stage times
   are close.
3. Candidates: every interior boundary jittered within `radius` layers of the anchor's (valid ones only).
4. Rank by metric = std(stage time) + time to send the boundary activations. OmniBal sums VAR(fwd_time) and
   SUM(comm) without saying how the units meet; the standard deviation (seconds) and transfer seconds at
   the measured boundary bandwidth are commensurable, and order candidates the same way within one unit.
5. Time the top K in the real pipeline for a few steps and keep the fastest; the layer-count partition is
   timed too and wins if it is faster (measurements on a busy machine can favour it).

Layer-count and parameter-count partitions are computed alongside for comparison.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from packfeed.trainer.parallel.profile import LayerProfile


@dataclass
class Candidate:
    bounds: list[int]
    stage_s: list[float]
    comm_bytes: int
    metric: float
    measured_s: float | None = None
    origin: str = "search"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PartitionDecision:
    bounds: list[int]
    candidates: list[Candidate] = field(default_factory=list)
    baselines: list[Candidate] = field(default_factory=list)
    comm_gbps: float = 0.0
    profile: list[dict] = field(default_factory=list)  # the layer profile the ranking used
    profile_features: list[dict] = field(default_factory=list)  # the profiled microbatches' sizes

    def shift(self, first: int) -> None:
        """Bounds searched over the layers from `first` on, made the whole model's."""
        self.bounds = [first + b for b in self.bounds]
        for candidate in self.candidates + self.baselines:
            candidate.bounds = [first + b for b in candidate.bounds]

    def to_dict(self) -> dict:
        return {"bounds": self.bounds, "comm_gbps": self.comm_gbps,
                "candidates": [c.to_dict() for c in self.candidates],
                "baselines": [c.to_dict() for c in self.baselines], "profile": self.profile,
                "profile_features": self.profile_features}


def split_by_weight(weights: Sequence[float], stages: int) -> list[int]:
    """Cut points where the cumulative weight comes closest to k/stages of the total, each stage non-empty."""
    n = len(weights)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for a model of {n} layers: use at most {n} stages")
    total = float(sum(weights)) or 1.0
    bounds, running, layer = [0], 0.0, 0
    for k in range(1, stages):
        target = total * k / stages
        # advance while the next layer brings the running sum closer to the target, leaving room for the rest
        while layer < n - (stages - k) and (layer < bounds[-1] + 1 or
                                           abs(running + weights[layer] - target) <= abs(running - target)):
            running += weights[layer]
            layer += 1
        bounds.append(layer)
    bounds.append(n)
    return bounds


def stage_times(profile: Sequence[LayerProfile], bounds: Sequence[int]) -> list[float]:
    prefix = _prefix(profile)
    return [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]


def _prefix(profile: Sequence[LayerProfile]) -> list[float]:
    """Cumulative layer time: a stage's time is a difference, so ranking (2r+1)^(S-1) candidates stays cheap."""
    return [0.0, *itertools.accumulate(p.time_s for p in profile)]


def boundary_bytes(profile: Sequence[LayerProfile], bounds: Sequence[int]) -> int:
    """What crosses the stage boundaries: the activations of the last layer of every stage but the last."""
    return sum(profile[b - 1].output_bytes for b in bounds[1:-1])


def evaluate(profile: Sequence[LayerProfile], bounds: Sequence[int], comm_gbps: float,
             origin: str = "search") -> Candidate:
    times = stage_times(profile, bounds)
    comm = boundary_bytes(profile, bounds)
    spread = statistics.pstdev(times) if len(times) > 1 else 0.0
    transfer = comm / (comm_gbps * 1e9) if comm_gbps > 0 else 0.0
    return Candidate(list(bounds), times, comm, spread + transfer, origin=origin)


def candidates_around(anchor: Sequence[int], radius: int, n_layers: int) -> list[list[int]]:
    """Every partition whose interior boundaries lie within `radius` of the anchor's (at most (2r+1)^(P-1))."""
    interior = anchor[1:-1]
    found = []
    for shifts in itertools.product(range(-radius, radius + 1), repeat=len(interior)):
        bounds = [0] + [b + s for b, s in zip(interior, shifts)] + [n_layers]
        if all(a < b for a, b in zip(bounds, bounds[1:])):
            found.append(bounds)
    return found


def baseline_partitions(profile: Sequence[LayerProfile], stages: int, comm_gbps: float) -> list[Candidate]:
    n = len(profile)
    return [evaluate(profile, split_by_weight([1.0] * n, stages), comm_gbps, "layer-count"),
            evaluate(profile, split_by_weight([float(p.params) for p in profile], stages), comm_gbps,
                     "param-count"),
            evaluate(profile, split_by_weight([p.time_s for p in profile], stages), comm_gbps, "anchor")]


def search_partition(profile: Sequence[LayerProfile], stages: int, *, radius: int = 1, top_k: int = 4,
                     comm_gbps: float = 0.0,
                     measure: Callable[[list[int]], float] | None = None) -> PartitionDecision:
    """The partition to train with. `measure(bounds)` times real pipeline steps with that partition: the top
    `top_k` candidates are timed, and the layer-count split too (the safety net: never slower than it); the
    fastest wins. Without `measure` (or with top_k 0) the best-ranked candidate wins. A pure function of the
    profile apart from `measure`, so every rank that calls it with the same profile times the same list."""
    anchor = split_by_weight([p.time_s for p in profile], stages)
    prefix, sent = _prefix(profile), [p.output_bytes for p in profile]

    def metric(bounds: list[int]) -> float:
        times = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        transfer = sum(sent[b - 1] for b in bounds[1:-1]) / (comm_gbps * 1e9) if comm_gbps > 0 else 0.0
        return (statistics.pstdev(times) if len(times) > 1 else 0.0) + transfer

    # rank every candidate by the cheap metric, then build full records only for those worth showing
    scored = sorted(((metric(b), b) for b in candidates_around(anchor, radius, len(profile))))
    ranked = [evaluate(profile, b, comm_gbps) for _, b in scored[:max(top_k, 1) + 32]]
    ranked.sort(key=lambda c: (c.metric, c.bounds))
    baselines = baseline_partitions(profile, stages, comm_gbps)
    shortlist = ranked[:max(top_k, 1)]
    if measure is not None and top_k > 0:
        layer_count = baselines[0]
        if all(c.bounds != layer_count.bounds for c in shortlist):
            shortlist = shortlist + [layer_count]
        for candidate in shortlist:
            candidate.measured_s = measure(candidate.bounds)
        best = min(shortlist, key=lambda c: (c.measured_s, c.metric))
    else:
        best = shortlist[0]
    return PartitionDecision(best.bounds, ranked, baselines, comm_gbps)


def format_table(decision: PartitionDecision, limit: int = 12) -> str:
    """The candidates (best-ranked first) and the baselines, as a text table."""
    lines = [f"{'origin':<12} {'bounds':<22} {'stage times (ms)':<28} {'comm MB':>8} {'metric':>9} {'measured':>9}"]
    for c in decision.candidates[:limit] + decision.baselines:
        times = " ".join(f"{t * 1e3:.1f}" for t in c.stage_s)
        measured = f"{c.measured_s * 1e3:.1f}ms" if c.measured_s is not None else "-"
        mark = " *" if c.bounds == decision.bounds and c.measured_s is not None else ""
        lines.append(f"{c.origin:<12} {c.bounds!s:<22} {times:<28} {c.comm_bytes / 1e6:>8.2f} "
                     f"{c.metric * 1e3:>8.2f}m {measured:>9}{mark}")
    return "\n".join(lines)
