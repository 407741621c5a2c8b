"""What every microbatch of every step carries, for a data strategy (`--strategy`):

- `random-padded` (OmniBal's baseline): random samples in fixed-size batches, each padded to its longest text
  (tiles are concatenated, as InternVL does: the ViT sees only real tiles);
- `random`: random samples concatenated into packs under the same caps as ISF (next fit), packs in random
  order;
- `isf`: OmniBal's ISF packs in random order; `isf+balance`: ISF packs with Packfeed's balanced steps, LPT over
  ranks and the 1F1B microbatch order; `isf+phases`: the same with the LLM's ranks balanced on its own cost and
  each step's encoder work balanced and routed apart (`Workload.routing`, for `--encoder phases`).
The planner (`packfeed.server.plan`) makes every plan but `random`'s packing; the same seed gives the same
workload. A microbatch's load row is (1, tiles, sum of squared ViT sequences, tokens, sum of squared LLM
spans); packs attend per sample (varlen attention), padded batches over each padded row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import make_plan, resolve_caps
from packfeed.trainer.simulate.model_shape import TILES, TOKEN_SQUARE, TOKENS, VISION_SQUARE, LayerTable
from packfeed.trainer.simulate.routed import Routing
from packfeed.v1.options import CostModel, PlanConfig, Strategy

STRATEGIES: tuple[str, ...] = ("random-padded", "random", "isf", "isf+balance", "isf+phases")
PLANNER_STRATEGY = {"random-padded": Strategy.RANDOM, "random": Strategy.ISF, "isf": Strategy.ISF,
                    "isf+balance": Strategy.ISF_BALANCE, "isf+phases": Strategy.ISF_PHASES}


@dataclass
class Workload:
    loads: np.ndarray  # (steps, dp, microbatches, terms), padding included
    useful: np.ndarray  # the same without padding (what MFU counts)
    samples: int
    strategy: str
    routing: Routing | None = None  # isf+phases: where each step's tiles are encoded (`--encoder phases`)

    @property
    def steps(self) -> int:
        return self.loads.shape[0]

    def regrouped(self, replicas: int) -> Workload:
        """The same global steps over another number of replicas (their packs in rank-major order, cut evenly):
        how `disaggregated` feeds an LLM with a DP of its own."""
        steps, dp, m, terms = self.loads.shape
        if (dp * m) % replicas:
            raise ValueError(f"{dp * m} packs per step do not divide over {replicas} replicas")
        shape = (steps, replicas, dp * m // replicas, terms)
        return replace(self, loads=self.loads.reshape(shape), useful=self.useful.reshape(shape), routing=None)


def planner_cost_model(table: LayerTable, patches_per_tile: int) -> CostModel:
    """The model's per-sample cost (FLOPs, or measured seconds) as the planner's balancing coefficients."""
    per_term = table.forward_flops if table.forward_flops is not None else table.measured_seconds.sum(axis=1)
    encoder = table.encoder
    vision = per_term[encoder].sum(axis=0)
    llm = per_term[~encoder].sum(axis=0)
    return CostModel(vision_linear=float(vision[TILES]) / patches_per_tile,
                     vision_quadratic=float(vision[VISION_SQUARE]), llm_linear=float(llm[TOKENS]),
                     llm_quadratic=float(llm[TOKEN_SQUARE]))


def make_workload(samples: SampleLoads, strategy: str, dp: int, microbatches: int, pipeline_stages: int,
                  patches_per_tile: int, cost_model: CostModel, seed: int = 0, epoch: int = 0,
                  samples_per_pack: float = 4.0) -> Workload:
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    config = PlanConfig(dp=dp, microbatches=microbatches, pipeline_stages=pipeline_stages,
                        strategy=PLANNER_STRATEGY[strategy], samples_per_pack=samples_per_pack,
                        cost_model=cost_model)
    if strategy == "random":
        offsets, members = random_packs(samples, config, seed, epoch)
        return workload_of(offsets, members, samples, config, patches_per_tile, strategy)
    plan = make_plan(samples, config, seed, epoch)
    return replace(workload_of(plan.offsets, plan.members, samples, config, patches_per_tile, strategy),
                   routing=routing_of(plan, samples, patches_per_tile))


def routing_of(plan: Plan, samples: SampleLoads, patches_per_tile: int) -> Routing | None:
    """isf+phases: each step's encoder work as the plan routes it (None for the other strategies)."""
    if plan.encoder_rank is None:
        return None
    return Routing.of_plan(plan.offsets, plan.members, plan.encoder_rank, samples.vision, plan.config.dp,
                           plan.config.microbatches, patches_per_tile)


def workload_of_plan(plan: Plan, samples: SampleLoads, patches_per_tile: int) -> Workload:
    """A plan file's packs (`packfeed plan --out`), against the index it was planned from."""
    if len(plan.members) and plan.members.max() >= len(samples):
        raise ValueError(f"the plan names sample {int(plan.members.max())}, the lengths hold {len(samples)}: give "
                         "the index (or length file) the plan was made from")
    tokens = samples.tokens.astype(np.int64)
    if plan.truncate_to.any():
        tokens = tokens.copy()
        cut = plan.truncate_to > 0
        tokens[plan.members[cut]] = plan.truncate_to[cut]
    name = {Strategy.RANDOM: "random-padded"}.get(plan.config.strategy, plan.config.strategy.value)
    return replace(workload_of(plan.offsets, plan.members, replace(samples, tokens=tokens), plan.config,
                               patches_per_tile, name), routing=routing_of(plan, samples, patches_per_tile))


def random_packs(samples: SampleLoads, config: PlanConfig, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled samples, next fit under ISF's caps; packs in step order, the last step filled with empty packs."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 5]))
    caps = resolve_caps(samples, config)
    order = np.flatnonzero(samples.valid)[rng.permutation(int(samples.valid.sum()))]
    vision, tokens = samples.vision[order], samples.tokens[order]
    starts, v_sum, t_sum = [0], 0, 0
    for k in range(len(order)):
        if k > starts[-1] and (v_sum + vision[k] > caps.vision_cap or t_sum + tokens[k] > caps.token_cap):
            starts.append(k)
            v_sum = t_sum = 0
        v_sum += int(vision[k])
        t_sum += int(tokens[k])
    offsets = np.array(starts + [len(order)], dtype=np.int64)
    packs = len(offsets) - 1
    slots = config.slots
    empty = (-packs) % slots
    offsets = np.concatenate([offsets, np.full(empty, len(order), dtype=np.int64)])
    return offsets, order


def workload_of(offsets: np.ndarray, members: np.ndarray, samples: SampleLoads, config: PlanConfig,
                patches_per_tile: int, strategy: str) -> Workload:
    sizes = np.diff(offsets)
    pack = np.repeat(np.arange(len(sizes)), sizes)
    tiles = np.bincount(pack, samples.vision[members].astype(np.float64), minlength=len(sizes))
    tokens = samples.tokens[members].astype(np.float64)
    real_tokens = np.bincount(pack, tokens, minlength=len(sizes))
    real_square = np.bincount(pack, tokens ** 2, minlength=len(sizes))
    useful = np.zeros((len(sizes), 5))
    useful[:, 0] = sizes > 0
    useful[:, TILES] = tiles
    useful[:, VISION_SQUARE] = tiles * float(patches_per_tile) ** 2
    useful[:, TOKENS] = real_tokens
    useful[:, TOKEN_SQUARE] = real_square
    loads = useful.copy()
    if config.strategy.padded:
        longest = np.zeros(len(sizes))
        np.maximum.at(longest, pack, tokens)
        loads[:, TOKENS] = sizes * longest
        loads[:, TOKEN_SQUARE] = sizes * longest ** 2
    slots = config.dp * config.microbatches
    if len(sizes) % slots:
        raise ValueError(f"{len(sizes)} packs are not whole steps of {slots}")
    shape = (len(sizes) // slots, config.dp, config.microbatches, 5)
    return Workload(loads.reshape(shape), useful.reshape(shape), len(members), strategy)
