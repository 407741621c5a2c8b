"""One RL step's rollouts over the data-parallel ranks: the same number on each rank (an RL framework splits its
batch into equal chunks), balanced on Packfeed's cost of their vision and LLM work, each group of responses to one
prompt kept on one rank where the trainer computes their prompt once (its cost then counted once).

A pure function of the rollouts' sizes, groups and the cost model: the same step partitions the same way on every
run. RL frameworks call it where they balance a step's batch (`packfeed.cli.verl_batches` for verl's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.server.plan.balance import lpt_assign, refine_by_swaps
from packfeed.v1.options import CostModel

REFINE_ROUNDS = 256  # swap rounds after LPT: each lowers the busiest rank's load or stops


@dataclass(frozen=True)
class Rollouts:
    """A step's rollouts, one entry each: `tokens` its LLM tokens (prompt and response), `prompt` its prompt's
    (what a group shares), `vit_patches` and `vit_attn_sq` its prompt's images' ViT patches and attention squares,
    `group` its prompt's group (None: no groups)."""

    tokens: np.ndarray
    prompt: np.ndarray
    vit_patches: np.ndarray
    vit_attn_sq: np.ndarray
    group: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Partition:
    """Each rank's rollouts (indices into the step, its groups contiguous), and their costs."""

    ranks: list[np.ndarray]
    rank_costs: np.ndarray  # per rank: the vision and LLM cost it trains
    groups_whole: bool  # every group on one rank (False: groups of unequal sizes, partitioned by rollout)

    @property
    def order(self) -> np.ndarray:
        """The step's rollouts rank after rank: what an equal split into chunks hands each rank."""
        return np.concatenate(self.ranks)

    @property
    def dist(self) -> float:
        """The busiest rank's cost over the mean, minus 1 (0: perfectly balanced)."""
        mean = self.rank_costs.mean()
        return float(self.rank_costs.max() / mean - 1) if mean > 0 else 0.0


def rollout_costs(rollouts: Rollouts, model: CostModel, shared: bool) -> tuple[np.ndarray, np.ndarray]:
    """(unit of every rollout, cost of every unit). A unit is a group whole when `rollouts.group` is given (its
    prompt's images and its prompt's tokens counted once when `shared`: P + sum R tokens, P^2 + sum((P + R)^2 -
    P^2) attention squares), else one rollout."""
    tokens = rollouts.tokens.astype(np.float64)
    vision = model.vision_linear * rollouts.vit_patches + model.vision_quadratic * rollouts.vit_attn_sq
    if rollouts.group is None:
        return np.arange(len(rollouts)), vision + model.llm_linear * tokens + model.llm_quadratic * tokens ** 2
    _, unit = np.unique(rollouts.group, return_inverse=True)
    units = unit.max() + 1 if len(unit) else 0
    if not shared:
        alone = vision + model.llm_linear * tokens + model.llm_quadratic * tokens ** 2
        return unit, np.bincount(unit, alone, units)
    prompt = rollouts.prompt.astype(np.float64)
    first = np.full(units, len(unit))
    np.minimum.at(first, unit, np.arange(len(unit)))  # a unit's prompt: its first member's
    linear = np.bincount(unit, tokens - prompt, units) + prompt[first]
    squares = np.bincount(unit, tokens ** 2 - prompt ** 2, units) + prompt[first] ** 2
    return unit, vision[first] + model.llm_linear * linear + model.llm_quadratic * squares


def partition_rollouts(rollouts: Rollouts, dp: int, model: CostModel | None = None,
                       shared_prefix: bool = False) -> Partition:
    """The step's rollouts over `dp` ranks, len / dp each, balanced on their cost (greedy LPT on whole groups,
    then swaps that lower the busiest rank). Groups stay whole where they all hold the same number of rollouts and
    the ranks take whole groups; otherwise rollouts are placed one by one. `shared_prefix`: the trainer computes a
    group's prompt once (its cost counted once)."""
    n = len(rollouts)
    if dp < 1 or n % dp:
        raise ValueError(f"{n} rollouts do not split into {dp} equal shares: give a step a multiple of dp rollouts")
    model = model or CostModel.from_shapes()
    unit, cost = rollout_costs(rollouts, model, shared_prefix)
    sizes = np.bincount(unit, minlength=len(cost))
    whole = rollouts.group is not None and len(set(sizes.tolist())) == 1 and (len(cost) % dp == 0)
    if rollouts.group is not None and not whole:  # place rollouts one by one, each at its own cost
        unit, cost = rollout_costs(Rollouts(rollouts.tokens, rollouts.prompt, rollouts.vit_patches,
                                            rollouts.vit_attn_sq), model, False)
    per_rank = len(cost) // dp
    bin_of = lpt_assign(cost, dp, per_rank)
    refine_by_swaps(cost, bin_of, dp, REFINE_ROUNDS, np.zeros(len(cost), dtype=np.int64))
    members = np.split(np.argsort(unit, kind="stable"), np.cumsum(np.bincount(unit, minlength=len(cost)))[:-1])
    ranks, rank_costs = [], np.zeros(dp)
    for rank in range(dp):
        units = np.flatnonzero(bin_of == rank)
        units = units[np.argsort(-cost[units], kind="stable")]
        rank_costs[rank] = cost[units].sum()
        ranks.append(np.concatenate([members[u] for u in units]) if len(units) else np.zeros(0, dtype=np.int64))
    return Partition(ranks, rank_costs, whole)
