"""What `packfeed simulate` feeds the simulator: the samples of length files or an index, and the workload of the
plan the planner makes of them (or of a plan file), with where it encodes and what its shared prefixes save."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from packfeed.trainer.simulate.context_parallel import CpWorkload
from packfeed.trainer.simulate.routed import Routing
from packfeed.trainer.simulate.workload import STRATEGIES, Workload, encoder_split_of, workload_of
from packfeed.v1.options import CostModel, PlanConfig, Strategy

if TYPE_CHECKING:  # the planner loads (numba) when a command runs, not when the parser is built
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.server.plan.plan_file import Plan


PLANNER_STRATEGY = {"random-padded": Strategy.RANDOM, "random": Strategy.ISF, "isf": Strategy.ISF,
                    "isf+balance": Strategy.ISF_BALANCE, "isf+phases": Strategy.ISF_PHASES}


def make_workload(samples: SampleLoads, strategy: str, dp: int, microbatches: int, pipeline_stages: int,
                  patches_per_tile: int, cost_model: CostModel, seed: int = 0, epoch: int = 0,
                  samples_per_pack: float = 4.0, encoder_ranks: int = 0, shared_prefix: bool = True) -> Workload:
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    config = PlanConfig(dp=dp, microbatches=microbatches, pipeline_stages=pipeline_stages,
                        strategy=PLANNER_STRATEGY[strategy], samples_per_pack=samples_per_pack,
                        cost_model=cost_model, encoder_ranks=encoder_ranks, shared_prefix=shared_prefix)
    if strategy == "random":
        offsets, members = random_packs(samples, config, seed, epoch)
        return workload_of(offsets, members, samples.vision, samples.tokens, config, patches_per_tile, strategy)
    from packfeed.server.plan.planner import make_plan

    plan = make_plan(samples, config, seed, epoch)
    saved, groups = shared_of(plan, samples)
    return replace(workload_of(plan.offsets, plan.members, samples.vision, samples.tokens, config, patches_per_tile,
                               strategy, saved), **placement_of(plan, samples, patches_per_tile), groups=groups)


def shared_of(plan: Plan, samples: SampleLoads) -> tuple[dict | None, dict | None]:
    """(per pack, what its shared prefixes save, for the simulator; the plan's `groups` summary), or (None, None)
    for a plan that shares no prefix."""
    if plan.groups is None:
        return None, None
    from packfeed.server.plan.groups import group_summary, prefix_savings

    saved = prefix_savings(plan.members, plan.offsets, samples)
    return saved, group_summary(saved, True)


def placement_of(plan: Plan, samples: SampleLoads, patches_per_tile: int) -> dict:
    """Where the plan encodes each step's items: routed between the ranks (isf+phases: `routing`), or on encoder
    ranks of its own (`encoder_split`); nothing for the other plans."""
    config = plan.config
    if plan.encoder_rank is None:
        return {}
    if config.disaggregated:
        return {"encoder_split": encoder_split_of(plan.offsets, plan.members, plan.encoder_rank, samples.vision,
                                                  config.dp, config.microbatches, config.encoder_ranks)}
    return {"routing": Routing.of_plan(plan.offsets, plan.members, plan.encoder_rank, samples.vision, config.dp,
                                       config.microbatches, patches_per_tile)}


def workload_of_plan(plan: Plan, samples: SampleLoads, patches_per_tile: int) -> Workload:
    """A plan file's packs (`packfeed plan --out`), against the index it was planned from."""
    if len(plan.members) and plan.members.max() >= len(samples):
        raise ValueError(f"the plan names sample {int(plan.members.max())}, the lengths hold {len(samples)}: give "
                         "the index (or length file) the plan was made from")
    tokens = samples.tokens.astype(np.int64)  # a copy: truncations are written into it
    if plan.truncate_to.any():
        cut = plan.truncate_to > 0
        tokens[plan.members[cut]] = plan.truncate_to[cut]
    name = {Strategy.RANDOM: "random-padded"}.get(plan.config.strategy, plan.config.strategy.value)
    saved, groups = shared_of(plan, samples)
    return replace(workload_of(plan.offsets, plan.members, samples.vision, tokens, plan.config, patches_per_tile,
                               name, saved), **placement_of(plan, samples, patches_per_tile), groups=groups)


def cp_workload(plan, vision: np.ndarray, tokens: np.ndarray, patches_per_tile: int) -> CpWorkload:
    """The CP plan's packs (each run of one (degree, cp_group) within a slot) as load rows."""
    from packfeed.server.plan.context_parallel import subpacks

    config = plan.config
    slot, starts, _ = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    ids = plan.members
    lengths = np.where(plan.truncate_to > 0, np.minimum(tokens[ids], plan.truncate_to), tokens[ids]).astype(float)

    def per_pack(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values, starts) if len(starts) else np.zeros(0)

    return CpWorkload.of_packs(slot // config.slots, slot // config.microbatches % config.dp, slot % config.microbatches,
                               plan.cp_degree[starts], plan.cp_group[starts], per_pack(lengths),
                               per_pack(vision[ids].astype(float)), per_pack(lengths ** 2), patches_per_tile,
                               plan.n_steps, config.dp, config.microbatches, config.context_parallel, len(ids),
                               config.cp_mode.value, np.split(lengths.astype(np.int64), starts[1:]))


def random_packs(samples: SampleLoads, config: PlanConfig, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled samples, next fit under ISF's caps; packs in step order, the last step filled with empty packs."""
    from packfeed.server.plan.caps import resolve_caps

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


def samples_of(args: argparse.Namespace):
    """The samples `--lengths` or `--index` give (with their groups and trees, where length records name them)."""
    from packfeed.server.plan.costs import SampleLoads, load_sample_loads

    if bool(args.lengths) == bool(args.index):
        raise ValueError("give --lengths FILE.json ... or --index INDEX (with --plan: the one it was planned from)")
    if args.index:
        return load_sample_loads(args.index)[0]
    from packfeed.server.index.lengths import read_length_file

    from packfeed.server.index.lengths import length_records, record_groups

    from packfeed.server.index.trajectory_lengths import joined_trees, record_trees, with_trees

    parts, groups, labels, trees = [], [], {}, []
    for f in args.lengths:
        records = length_records(Path(f))
        parts.append(read_length_file(Path(f), records=records))
        found = record_groups(Path(f), records, labels)
        trees.append(record_trees(Path(f), records, found[0]) if found else None)
        groups.append(found or (np.full(len(records), -1, np.int64), np.zeros(len(records), np.int64)))
    vit = np.concatenate([p[0] for p in parts])
    tokens = np.concatenate([p[1] for p in parts])
    samples = SampleLoads.from_arrays(np.maximum(vit, 0), np.maximum(tokens, 0), valid=(vit >= 0) & (tokens > 0))
    if labels:  # length records naming groups (docs/planning.md "Groups"), or trees ("Trees")
        samples.group = np.concatenate([g for g, _ in groups])
        samples.prefix = np.concatenate([p for _, p in groups]).astype(np.int32)
        with_trees(samples, joined_trees(trees, [len(p[0]) for p in parts]), samples.prefix)
    return samples
