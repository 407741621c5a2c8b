"""Every phase balanced on its own (OrchMLLM's batch post-balancing; the `isf+phases` strategy): each step's
encoder work is assigned to ranks apart from the LLM's packs, and each encoder output is routed to the rank
whose pack consumes it.

- `assign_phase`: items of one encoder phase to ranks by greedy LPT, largest first onto the least-loaded rank
  (OrchMLLM Alg. 1, a 4/3-approximation of the best makespan, for encoders that do not pad), then narrowed by
  moves and swaps between the busiest and the idlest rank.
- `assign_padded_phase`: for encoders that pad a rank's items to the longest (cost = items x longest length),
  the smallest makespan found by bisection with an exact greedy feasibility test (OrchMLLM Alg. 2).
- `route` (`phase_routing`): the balanced bins are interchangeable, so which rank runs which bin is free: choose it to move as
  few bytes between nodes as possible, then as few between ranks (OrchMLLM's node-wise rearrangement, Alg. 3).
  Up to `EXACT_RANKS` ranks this is one linear assignment, exact for the total inter-node bytes; beyond, bins
  go to nodes greedily by bytes kept, and the gap to a lower bound (every bin on its best node, capacity
  ignored) is reported.
- `balance_from`: an assignment narrowed from where each item's pack trains (so nothing moves without cause),
  or LPT's when that is better.
- `phase_plan`: all of it over a plan's steps: per step, its samples' encoder work over the ranks, routed;
  each phase's Dist on its own assignment, and the all-to-all's volume.

Pure functions of their inputs: the plan stays a function of (index, config, seed, epoch).

The planner runs `phase_plan` for `isf+phases` (the vision encoder, and every further encoder an index names,
each a phase of its own); the plan file records each `encoder_rank`; servers send each rank the images it
encodes (`packfeed.server.serve.routed`), and `parallel.encoder=phases` runs the all-to-all
(`packfeed.trainer.parallel.phases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.media.jit import kernel
from packfeed.server.plan.balance import lpt_assign
from packfeed.server.plan.metrics import dist_ratio
from packfeed.server.plan.phase_routing import route


def assign_phase(costs: np.ndarray, ranks: int, rounds: int = 256) -> np.ndarray:
    """The rank of every item: LPT without a per-rank limit (deterministic: ties to the lowest rank), then
    moves and swaps between the busiest and the idlest rank while they narrow the gap (never raising the
    makespan, so LPT's 4/3 bound holds)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    costs = np.asarray(costs, dtype=np.float64)
    rank_of = lpt_assign(costs, ranks, 0)
    _refine(costs, rank_of, ranks, rounds)
    return rank_of


def assign_in_rounds(costs: np.ndarray, round_of: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of every item, round after round (the microbatches of a step, in the order they are encoded):
    each round's items largest first, each onto the rank with the least work so far, this round's and the
    earlier rounds' (ties to the lowest rank). Every prefix of rounds, the whole step included, is within list
    scheduling's bound: at most its mean per rank plus its largest item."""
    order = np.lexsort((np.arange(len(costs)), -costs, round_of))
    return _greedy(costs.astype(np.float64), order, ranks)


@kernel(cache=True, nogil=True)
def _greedy(costs, order, ranks):
    loads = np.zeros(ranks)
    rank_of = np.zeros(len(costs), dtype=np.int64)
    for i in order:
        best = 0
        for r in range(1, ranks):
            if loads[r] < loads[best]:
                best = r
        rank_of[i] = best
        loads[best] += costs[i]
    return rank_of


@kernel(cache=True, nogil=True)
def _refine(costs, rank_of, ranks, rounds):
    """In place: the move (an item of the busiest rank to the idlest) or swap (one item each way) whose transfer
    comes closest to half their gap, while one narrows it."""
    load = np.zeros(ranks)
    for i in range(len(costs)):
        load[rank_of[i]] += costs[i]
    for _ in range(rounds):
        high, low = np.argmax(load), np.argmin(load)
        gap = load[high] - load[low]
        if gap <= 0:
            return
        on_high = np.flatnonzero(rank_of == high)
        on_low = np.flatnonzero(rank_of == low)
        best, best_i, best_j = gap / 2, -1, -1  # |transfer - gap / 2| to beat: any transfer in (0, gap) narrows
        for i in on_high:
            shift = abs(costs[i] - gap / 2)
            if 0 < costs[i] < gap and shift < best - 1e-12:
                best, best_i, best_j = shift, i, -1
            for j in on_low:
                transfer = costs[i] - costs[j]
                shift = abs(transfer - gap / 2)
                if 0 < transfer < gap and shift < best - 1e-12:
                    best, best_i, best_j = shift, i, j
        if best_i < 0:
            return
        rank_of[best_i] = low
        load[high] -= costs[best_i]
        load[low] += costs[best_i]
        if best_j >= 0:
            rank_of[best_j] = high
            load[low] -= costs[best_j]
            load[high] += costs[best_j]


def balance_from(start: np.ndarray, costs: np.ndarray, ranks: int, rounds: int = 256) -> np.ndarray:
    """The better (smaller makespan; on a tie, the start) of two: the start narrowed by moves and swaps, and LPT
    narrowed the same way. Starting from where each item's pack trains, no item moves unless it helps."""
    costs = np.asarray(costs, dtype=np.float64)
    kept = np.asarray(start, dtype=np.int64).copy()
    if not len(costs):
        return kept
    _refine(costs, kept, ranks, rounds)
    makespan = np.bincount(kept, costs, minlength=ranks).max()
    if makespan <= max(costs.sum() / ranks, costs.max()) * (1 + 1e-9):  # no assignment does better
        return kept
    fresh = assign_phase(costs, ranks, rounds)
    return fresh if np.bincount(fresh, costs, minlength=ranks).max() < makespan - 1e-9 * max(makespan, 1.0) else kept


def padded_cost(lengths: np.ndarray) -> float:
    return float(len(lengths) * lengths.max()) if len(lengths) else 0.0


def assign_padded_phase(lengths: np.ndarray, ranks: int) -> np.ndarray:
    """The rank of every item minimising the largest (items x longest length) over ranks. `lengths` may be any
    cost that grows with the length (an encoder's cost of one padded sequence): the argument below holds.

    Items sorted longest first can be cut into consecutive runs without loss (moving a shorter item into a run
    of longer ones never raises its cost), and filling each run as far as a limit allows needs the fewest
    runs: so a limit is feasible exactly when that greedy needs at most `ranks` runs. The smallest feasible
    limit is one of the values n x length, found by bisection over them."""
    lengths = np.asarray(lengths, dtype=np.float64)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    order = np.argsort(-lengths, kind="stable")
    ordered = lengths[order]
    candidates = np.unique((np.arange(1, len(lengths) + 1)[None, :] * ordered[:, None]).ravel()) \
        if len(lengths) else np.zeros(1)
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        if len(_runs(ordered, candidates[middle])) <= ranks:
            high = middle
        else:
            low = middle + 1
    runs = _runs(ordered, candidates[low])
    rank_of = np.empty(len(lengths), dtype=np.int64)
    for r, (start, stop) in enumerate(runs):
        rank_of[order[start:stop]] = r
    return rank_of


def _runs(ordered: np.ndarray, limit: float) -> list[tuple[int, int]]:
    runs, start = [], 0
    while start < len(ordered):
        size = max(1, int(limit * (1 + 1e-12) // ordered[start])) if ordered[start] > 0 else len(ordered)
        runs.append((start, min(start + size, len(ordered))))
        start = runs[-1][1]
    return runs


@dataclass(frozen=True)
class Phase:
    """One encoder of the plan: its column of `sample_costs`, the units its output weighs per sample (what the
    all-to-all moves), and whether it pads each batch to its longest sequence (one per sample)."""

    name: str
    column: int
    units: np.ndarray
    padded: bool = False


@dataclass
class EncoderPhase:
    """One encoder's phase of a plan: the rank that encodes each member (in member order), its Dist, and the
    all-to-all of its outputs in its units."""

    encoder_rank: np.ndarray
    dist: float  # on its own assignment
    colocated_dist: float  # had each rank encoded its own packs' samples
    moved_units: float  # units whose output leaves the rank that encoded them
    inter_node_units: float  # ... and leaves its node
    inter_node_bound: float  # no routing of the same bins moves fewer between nodes
    unrouted_inter_node_units: float  # bins left on the ranks LPT numbered them: what routing saves
    exact: bool
    padded: bool
    unrouted_moved_units: float = 0.0  # ... and what those bins move in all

    def summary(self) -> dict:
        return {"cost_dist": round(self.dist, 6), "cost_dist_colocated": round(self.colocated_dist, 6),
                "padded": self.padded, "all_to_all_units": self.moved_units, "inter_node_units": self.inter_node_units,
                "inter_node_bound": self.inter_node_bound, "inter_node_units_unrouted": self.unrouted_inter_node_units,
                "all_to_all_units_unrouted": self.unrouted_moved_units, "routing_exact": self.exact}


@dataclass
class PhasePlan:
    """A plan's phases: each encoder's own assignment (vision first, then further encoders by name), and the
    LLM's Dist on the packs' ranks."""

    encoders: dict[str, EncoderPhase]
    llm_dist: float

    @property
    def vision(self) -> EncoderPhase:
        return self.encoders["vision"]


def phase_plan(offsets: np.ndarray, members: np.ndarray, costs: np.ndarray, phases: list[Phase], dp: int,
               microbatches: int, ranks_per_node: int, encoder_ranks: int = 0) -> PhasePlan:
    """`offsets`/`members`: packs in step-major order (step, rank, microbatch), as a Plan holds them;
    `costs`: `sample_costs`' rows; `phases`: the encoders. Each step's samples are encoded apart from their
    packs, each encoder's work balanced over the ranks on its own and routed: a rank encodes its share of every
    microbatch of the step, and one all-to-all per step hands each output to its consumer. (Balancing each
    microbatch apart leaves too few, too coarse items: a document of many tiles alone would set a microbatch's
    makespan.) `encoder_ranks` E > 0: the encoders run on E ranks of their own (disaggregated), balanced over
    those; every output then travels to its consumer, so the bins keep LPT's numbering (no routing to choose)."""
    slots = dp * microbatches
    n_packs = len(offsets) - 1
    sizes = np.diff(offsets)
    consumer = np.repeat((np.arange(n_packs) // microbatches) % dp, sizes)
    step_of = np.repeat(np.arange(n_packs) // slots, sizes)
    microbatch_of = np.repeat(np.arange(n_packs) % microbatches, sizes)
    steps = n_packs // slots
    cuts = np.flatnonzero(np.diff(step_of)) + 1  # members are in step order already
    groups = np.split(np.arange(len(members)), cuts) if len(members) else []
    llm_loads = np.zeros((steps, dp))
    np.add.at(llm_loads, (step_of, consumer), costs[members, 1].astype(np.float64))
    encoders = {phase.name: _encoder_phase(phase, groups, consumer, step_of, costs[members, phase.column]
                                           .astype(np.float64), phase.units[members].astype(np.float64), dp, steps,
                                           ranks_per_node, encoder_ranks, microbatch_of) for phase in phases}
    return PhasePlan(encoders, dist_ratio(llm_loads))


def _encoder_phase(phase: Phase, groups: list[np.ndarray], consumer: np.ndarray, step_of: np.ndarray,
                   cost: np.ndarray, weight: np.ndarray, dp: int, steps: int, ranks_per_node: int,
                   encoder_ranks: int = 0, microbatch_of: np.ndarray | None = None) -> EncoderPhase:
    """One encoder over every step: balanced (LPT and moves, or the padded assignment), then routed."""
    if encoder_ranks:
        return _disaggregated_phase(phase, groups, consumer, step_of, cost, weight, dp, steps, encoder_ranks,
                                    microbatch_of)
    encoder_rank = consumer.copy()
    bins = consumer.copy()
    moved = inter = bound = 0.0
    exact = True
    for group in groups:
        if phase.padded:  # only samples with a sequence for this encoder enter its batches
            active = group[weight[group] > 0]
            bins[active] = assign_padded_phase(cost[active], dp)
        else:
            bins[group] = balance_from(consumer[group], cost[group], dp)
        routing = route(bins[group], consumer[group], weight[group], dp, ranks_per_node)
        encoder_rank[group] = routing.rank_of_bin[bins[group]]
        moved += routing.total_bytes
        inter += routing.inter_node_bytes
        bound += routing.inter_node_bound
        exact = exact and routing.exact
    unrouted = float(weight[bins // ranks_per_node != consumer // ranks_per_node].sum())
    unrouted_moved = float(weight[bins != consumer].sum())
    loads = _rank_costs(step_of, encoder_rank, cost, weight, dp, steps, phase.padded)
    colocated = _rank_costs(step_of, consumer, cost, weight, dp, steps, phase.padded)
    return EncoderPhase(encoder_rank, dist_ratio(loads), dist_ratio(colocated), moved, inter, bound, unrouted, exact,
                        phase.padded, unrouted_moved)


def _disaggregated_phase(phase: Phase, groups: list[np.ndarray], consumer: np.ndarray, step_of: np.ndarray,
                         cost: np.ndarray, weight: np.ndarray, dp: int, steps: int, ranks: int,
                         microbatch_of: np.ndarray) -> EncoderPhase:
    """One encoder on `ranks` encoder ranks of its own: each step's items balanced over them microbatch after
    microbatch (`assign_in_rounds`: an encoder rank encodes microbatch m + 1 while the LLM trains on m, so every
    prefix of the step's microbatches is balanced, not only the whole step), or the padded assignment per step;
    every output moves to its LLM rank."""
    encoder_rank = np.zeros(len(consumer), dtype=np.int64)
    for group in groups:
        if phase.padded:
            active = group[weight[group] > 0]
            encoder_rank[active] = assign_padded_phase(cost[active], ranks)
        else:
            encoder_rank[group] = assign_in_rounds(cost[group], microbatch_of[group], ranks)
    moved = float(weight.sum())
    loads = _rank_costs(step_of, encoder_rank, cost, weight, ranks, steps, phase.padded)
    colocated = _rank_costs(step_of, consumer, cost, weight, dp, steps, phase.padded)
    return EncoderPhase(encoder_rank, dist_ratio(loads), dist_ratio(colocated), moved, moved, moved, moved, True,
                        phase.padded, moved)


def _rank_costs(step_of: np.ndarray, rank_of: np.ndarray, cost: np.ndarray, weight: np.ndarray, dp: int,
                steps: int, padded: bool) -> np.ndarray:
    """(steps, dp): each rank's cost per step: the sum of its items', or padded, (its items with a sequence)
    x the costliest."""
    slot = step_of * dp + rank_of
    if not padded:
        return np.bincount(slot, cost, minlength=steps * dp).reshape(steps, dp)
    active = weight > 0
    counts = np.bincount(slot[active], minlength=steps * dp)
    longest = np.zeros(steps * dp)
    np.maximum.at(longest, slot[active], cost[active])
    return (counts * longest).reshape(steps, dp)


def phase_summary(p: PhasePlan, config) -> dict:
    """isf+phases: each phase's Dist of its cost model's costs on its own assignment (each encoder's also as it
    would be colocated), and the all-to-all of encoder outputs in their units (vision units, a further encoder's
    tokens): in all, between nodes, its bound, and without the routing. The vision encoder's figures also stand
    at the top level; every encoder's under "encoders"."""
    vision = p.vision
    if config.disaggregated:  # every output leaves its encoder rank: no routing to report
        return {"encoder_ranks": config.encoder_ranks, "vit_cost_dist": round(vision.dist, 6),
                "llm_cost_dist": round(p.llm_dist, 6), "vit_cost_dist_colocated": round(vision.colocated_dist, 6),
                "all_to_all_units": vision.moved_units,
                "encoders": {name: {"cost_dist": round(phase.dist, 6), "all_to_all_units": phase.moved_units}
                             for name, phase in p.encoders.items()}}
    return {"vit_cost_dist": round(vision.dist, 6), "llm_cost_dist": round(p.llm_dist, 6),
            "vit_cost_dist_colocated": round(vision.colocated_dist, 6), "ranks_per_node": config.ranks_per_node,
            "all_to_all_units": vision.moved_units, "inter_node_units": vision.inter_node_units,
            "inter_node_bound": vision.inter_node_bound,
            "inter_node_units_unrouted": vision.unrouted_inter_node_units, "routing_exact": vision.exact,
            "encoders": {name: phase.summary() for name, phase in p.encoders.items()}}
