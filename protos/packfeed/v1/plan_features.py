"""The features a plan may have, in one table (`FEATURES`): the `PlanConfig` fields each adds and its rules. A
new feature is a row here, not a branch in `PlanConfig`.

Part of the contract (`packfeed.v1`): pure Python.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packfeed.v1.plan_kinds import CpMode, Staleness, Strategy

PlanConfig = Any  # packfeed.v1.options.PlanConfig, which imports this table (importing it here would be a circle)

LIVE_FIELDS = ("step_samples", "step_tokens", "max_staleness", "steps")  # a live job's (`live`) own settings
# asynchronous RL on a live job (docs/live.md "Asynchronous RL"), recorded only when one is set: a live job without
# them records (and fingerprints, and its spool's job.json holds) what live jobs did before they existed
ASYNC_FIELDS = ("staleness", "producer_timeout_s", "group_size", "group_timeout_s", "filter_groups")


# The features a plan may have, in one table: the fields each adds (recorded in `to_dict` only while it is on, so
# a plan without it records, and fingerprints, what plans did before it existed) and its rules (its own settings,
# and the features it does not combine with). A new feature is a row here, not a branch in `PlanConfig`.


def _no_problems(config: PlanConfig) -> list[str]:
    return []


def _window_problems(c: PlanConfig) -> list[str]:
    return ["window must be >= 0 (0: the whole epoch at once)"] if c.window < 0 else []


def _colocate_problems(c: PlanConfig) -> list[str]:
    if c.colocate_encoder and c.strategy is not Strategy.ISF_PHASES:
        return ["colocate_encoder applies to strategy isf+phases only (the others always colocate)"]
    return []


def _context_parallel_problems(c: PlanConfig) -> list[str]:
    if c.context_parallel > 1 and c.strategy not in (Strategy.ISF, Strategy.ISF_BALANCE):
        return [f"context_parallel plans ISF packs: strategy isf+balance or isf, not {c.strategy.value}"]
    if c.context_parallel > 1 and c.window:
        return ["context_parallel plans whole epochs: leave window at 0"]
    if c.max_tokens_per_gpu is not None and c.max_tokens_per_gpu < 1:
        return ["max_tokens_per_gpu must be >= 1"]
    if c.context_parallel == 1 and (c.max_tokens_per_gpu is not None or c.cp_mode is not CpMode.DYNAMIC):
        return ["max_tokens_per_gpu and cp_mode apply with context_parallel > 1"]
    return []


def _encoder_ranks_problems(c: PlanConfig) -> list[str]:
    if c.encoder_ranks <= 0:
        return []
    if c.strategy not in (Strategy.ISF, Strategy.ISF_BALANCE, Strategy.ISF_PHASES):
        return [f"encoder_ranks plans ISF packs: strategy isf+balance, isf or isf+phases, not {c.strategy.value}"]
    if c.colocate_encoder:
        return ["colocate_encoder encodes on the LLM's ranks: leave encoder_ranks at 0"]
    return []


def _live_problems(c: PlanConfig) -> list[str]:
    given = [name for name in LIVE_FIELDS if getattr(c, name) not in (None, 0)]
    if not c.live:
        return [f"{', '.join(given)} apply to live jobs only: set live"] if given else []
    problems = []
    if not (c.step_samples or c.step_tokens):
        problems.append("a live job needs step_samples or step_tokens (when a step forms)")
    if min(c.step_samples, c.step_tokens, c.steps, c.max_staleness or 0) < 0:
        problems.append("step_samples, step_tokens, steps and max_staleness must be >= 0")
    if c.window:
        problems.append("a live job plans each step as it forms: leave window at 0")
    if c.strategy.padded:
        problems.append(f"a live job plans ISF packs: strategy isf+balance or isf, not {c.strategy.value}")
    if c.strategy is Strategy.ISF_PHASES or c.encoder_ranks:
        problems.append("a live job encodes images where they train: strategy isf+balance or isf, encoder_ranks 0")
    return problems


def _asynchronous(c: PlanConfig) -> bool:
    return (c.staleness is not Staleness.DROP or c.producer_timeout_s != 0 or c.group_size != 0
            or c.group_timeout_s != 0 or c.filter_groups != "")


def _async_problems(c: PlanConfig) -> list[str]:
    if not _asynchronous(c):
        return []
    if not c.live:
        return [f"{', '.join(ASYNC_FIELDS)} apply to live jobs only: set live"]
    problems = [f"{name} must be a number >= 0" for name in ("producer_timeout_s", "group_timeout_s", "group_size")
                if not getattr(c, name) >= 0]  # NaN fails too
    if c.staleness is Staleness.WAIT and (c.max_staleness is None or not c.step_samples):
        problems.append("staleness wait admits samples by the steps they will land in: give max_staleness and "
                        "step_samples")
    if c.group_timeout_s and not c.group_size:
        problems.append("group_timeout_s is a group's deadline: give group_size too")
    if c.filter_groups and not c.group_size:
        problems.append("filter_groups judges whole groups: give group_size (G, the samples of a group)")
    if c.filter_groups and not c.filter_groups.isidentifier():
        problems.append(f"filter_groups names a per-sample value (letters, digits, _), not {c.filter_groups!r}")
    return problems


@dataclass(frozen=True)
class Feature:
    name: str
    fields: tuple[str, ...]  # what it adds to PlanConfig
    recorded: Callable[[PlanConfig], bool]  # whether `to_dict` records its fields
    problems: Callable[[PlanConfig], list[str]] = _no_problems  # empty: its settings hold, with the others'
    recorded_when_set: tuple[str, ...] = ()  # of its fields, those recorded (while it is on) only when not None


FEATURES: tuple[Feature, ...] = (
    Feature("windows", ("window",), lambda c: c.window != 0, _window_problems),
    Feature("isf+phases", ("ranks_per_node",), lambda c: c.strategy is Strategy.ISF_PHASES),
    Feature("a colocated encoder", ("colocate_encoder",), lambda c: c.colocate_encoder, _colocate_problems),
    Feature("context parallelism", ("context_parallel", "max_tokens_per_gpu", "cp_mode"),
            lambda c: c.context_parallel > 1, _context_parallel_problems),
    Feature("encoder ranks", ("encoder_ranks",), lambda c: c.encoder_ranks > 0, _encoder_ranks_problems),
    Feature("towers not aligned", ("collective_safe",), lambda c: not c.collective_safe),  # on by default
    Feature("each sample alone", ("shared_prefix",), lambda c: not c.shared_prefix),  # sharing on by default
    Feature("live", ("live", *LIVE_FIELDS), lambda c: c.live, _live_problems, recorded_when_set=("max_staleness",)),
    Feature("asynchronous RL", ASYNC_FIELDS, _asynchronous, _async_problems),
)

# What a plan sharing its groups' prefixes (`PlanConfig.shares_prefixes`) does not combine with, and why: an index
# with groups is refused when planned, a live sample sharing a prefix when put (the way out, for both: plan each
# sample alone with shared_prefix false).
PREFIX_SHARING_REFUSES: tuple[tuple[Callable[[PlanConfig], bool], str], ...] = (
    (lambda c: c.context_parallel > 1, "context parallelism (a response must see its prefix on its own GPU)"),
    (lambda c: c.strategy is Strategy.ISF_PHASES or c.encoder_ranks > 0,
     "strategy isf+phases and encoder ranks (a prefix's images are encoded where it trains)"),
)
