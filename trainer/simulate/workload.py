"""What every microbatch of every step carries, for a data strategy (`--strategy`):

- `random-padded` (OmniBal's baseline): random samples in fixed-size batches, each padded to its longest text
  (tiles are concatenated, as InternVL does: the ViT sees only real tiles);
- `random`: random samples concatenated into packs under the same caps as ISF (next fit), packs in random
  order;
- `isf`: OmniBal's ISF packs in random order; `isf+balance`: ISF packs with Packfeed's balanced steps, LPT over
  ranks and the 1F1B microbatch order; `isf+phases`: the same with the LLM's ranks balanced on its own cost and
  each step's encoder work balanced and routed apart (`Workload.routing`, for `--encoder phases`).
The planner (`packfeed.server.plan`) makes every plan but `random`'s packing (`packfeed.cli.simulate`
runs it); the same seed gives the same workload. A microbatch's load row is (1, tiles, sum of squared ViT
sequences, tokens, sum of squared LLM spans); packs attend per sample (varlen attention), padded batches over
each padded row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from packfeed.trainer.simulate.model_shape import TILES, TOKEN_SQUARE, TOKENS, VISION_SQUARE, LayerTable
from packfeed.trainer.simulate.routed import Routing
from packfeed.v1.options import CostModel, PlanConfig

STRATEGIES: tuple[str, ...] = ("random-padded", "random", "isf", "isf+balance", "isf+phases")


@dataclass
class Workload:
    loads: np.ndarray  # (steps, dp, microbatches, terms), padding included
    useful: np.ndarray  # the same without padding (what MFU counts)
    samples: int
    strategy: str
    routing: Routing | None = None  # isf+phases: where each step's tiles are encoded (`--encoder phases`)
    # a plan with encoder ranks (PlanConfig.encoder_ranks E): (steps, E, dp, microbatches) tiles each encoder
    # rank encodes for each replica's microbatch (`--encoder disaggregated` simulates the plan's own split)
    encoder_split: np.ndarray | None = None
    groups: dict | None = None  # a plan sharing its groups' prefixes: its summary's `groups` entry

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
        return replace(self, loads=self.loads.reshape(shape), useful=self.useful.reshape(shape), routing=None,
                       encoder_split=None)


def encoder_split_of(offsets: np.ndarray, members: np.ndarray, encoder_rank: np.ndarray, tiles: np.ndarray,
                     dp: int, microbatches: int, encoder_ranks: int) -> np.ndarray:
    """(steps, E, dp, microbatches) tiles: what each encoder rank of a plan with encoder ranks encodes for each
    replica's microbatch."""
    sizes = np.diff(offsets)
    pack = np.repeat(np.arange(len(sizes)), sizes)
    steps = len(sizes) // (dp * microbatches)
    split = np.zeros((steps, encoder_ranks, dp, microbatches))
    np.add.at(split, (pack // (dp * microbatches), encoder_rank, (pack // microbatches) % dp, pack % microbatches),
              tiles[members].astype(np.float64))
    return split


def planner_cost_model(table: LayerTable, patches_per_tile: int) -> CostModel:
    """The model's per-sample cost (FLOPs, or measured seconds) as the planner's balancing coefficients."""
    per_term = table.forward_flops if table.forward_flops is not None else table.measured_seconds.sum(axis=1)
    encoder = table.encoder
    vision = per_term[encoder].sum(axis=0)
    llm = per_term[~encoder].sum(axis=0)
    return CostModel(vision_linear=float(vision[TILES]) / patches_per_tile,
                     vision_quadratic=float(vision[VISION_SQUARE]), llm_linear=float(llm[TOKENS]),
                     llm_quadratic=float(llm[TOKEN_SQUARE]))


def workload_of(offsets: np.ndarray, members: np.ndarray, vision: np.ndarray, tokens: np.ndarray,
                config: PlanConfig, patches_per_tile: int, strategy: str, shared: dict | None = None) -> Workload:
    """The workload of packs given as the planner gives them (pack p holds members[offsets[p]:offsets[p + 1]]),
    with each sample's vision units and tokens. `shared`: per pack, what its shared prefixes save ("vision"
    units, "tokens", attention "squares": each prefix computed once, docs/planning.md "Groups")."""
    sizes = np.diff(offsets)
    pack = np.repeat(np.arange(len(sizes)), sizes)
    tiles = np.bincount(pack, vision[members].astype(np.float64), minlength=len(sizes))
    tokens = tokens[members].astype(np.float64)
    real_tokens = np.bincount(pack, tokens, minlength=len(sizes))
    real_square = np.bincount(pack, tokens ** 2, minlength=len(sizes))
    useful = np.zeros((len(sizes), 5))
    useful[:, 0] = sizes > 0
    useful[:, TILES] = tiles
    useful[:, VISION_SQUARE] = tiles * float(patches_per_tile) ** 2
    useful[:, TOKENS] = real_tokens
    useful[:, TOKEN_SQUARE] = real_square
    if shared is not None:
        useful[:, TILES] -= shared["vision"]
        useful[:, VISION_SQUARE] = useful[:, TILES] * float(patches_per_tile) ** 2
        useful[:, TOKENS] -= shared["tokens"]
        useful[:, TOKEN_SQUARE] -= shared["squares"]
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
