"""A live step: which pending samples it takes (`select`), and its plan (`step_plan`).

Which samples, a pure function of the pending samples, the job's settings, the versions and, for groups past
their deadline, the time; its outcome is written in the step's record before any of it is sent, so the time it
reads never makes two servers disagree on a step:

- Order: arrival order under staleness `drop`; the oldest policy version first (then arrival) under `wait`.
- Staleness `drop`: a sample that step s, trained by version t(s), would train more than `max_staleness` versions
  after its own is dropped (and recorded with the step).
- Groups (`group_size` G > 0): a group is taken whole, once G of its samples are pending, or with what arrived
  once `group_timeout_s` passed since its first (a short group, counted); a sample without a group is a group of
  its own. A step takes whole groups until it holds `step_samples` (or `step_tokens`): the group reaching it is in.
- `filter_groups` NAME: a group taken whose samples' NAME values are all equal (no signal for a group-relative
  advantage: DAPO's dynamic sampling) is dropped whole, recorded as filtered, and the step fills from the next.

Its plan: its members planned as an epoch of their own, a pure function of (its members in arrival order, the
job's settings and seed, the step), so any server, or the same one after a restart, streams a resumed trainer
the very packs it would have got (`packfeed.server.live.steps` forms the steps)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from packfeed.server.live.rows import LiveRow
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import LIMITS, LIVE_FIELDS, PlanConfig, Staleness
from packfeed.v1.plan_features import ASYNC_FIELDS


def step_plan(rows: list[LiveRow], config: PlanConfig, seed: int, step: int, fingerprint: str) -> Plan | None:
    """A step's plan: its members planned as one epoch (epoch = the step, so each step draws randomness of its
    own) into a single step of the fewest microbatches M' >= M that hold them. Caps not set are searched on the
    step's own samples, aiming at dp x M packs."""
    if not rows:
        return None
    loads = SampleLoads(np.ones(len(rows), bool), np.array([r.vision for r in rows], np.int32),
                        np.array([r.tokens for r in rows], np.int32),
                        np.array([r.vit_patches for r in rows], np.float32),
                        np.array([r.vit_attn_sq for r in rows], np.float32))
    if any(r.parent for r in rows) and config.shares_prefixes(True):  # trees of trajectories
        loads.group, loads.prefix, loads.parent, loads.shared_vision = tree_columns(rows)
    elif config.shares_prefixes(any(r.prefix_key for r in rows)):  # one group per (group, prefix)
        numbered: dict[tuple[str, str], int] = {}
        loads.group = np.array([numbered.setdefault(prefix_group(r), len(numbered)) if r.prefix_key else -1
                                for r in rows], np.int64)
        loads.prefix = np.array([r.prefix for r in rows], np.int32)
    planned = replace(config, live=False, **{name: None if name == "max_staleness" else 0 for name in LIVE_FIELDS},
                      **{name: PlanConfig.__dataclass_fields__[name].default for name in ASYNC_FIELDS})
    if config.token_cap is None:
        planned = replace(planned, samples_per_pack=max(1.0, len(rows) / config.slots))
    microbatches = config.microbatches
    while True:
        plan = make_plan(loads, replace(planned, microbatches=microbatches), seed, step, fingerprint)
        if plan.n_steps <= 1:
            return plan
        if microbatches >= LIMITS["microbatches"]:
            raise ValueError(f"step {step}'s {len(rows)} samples need over {LIMITS['microbatches']} packs per rank "
                             "under the caps: raise token_cap and vision_cap, or lower step_samples")
        microbatches = min(LIMITS["microbatches"], math.ceil(microbatches * plan.n_steps))


def tree_columns(rows: list[LiveRow]) -> tuple[np.ndarray, ...]:
    """(group, shared tokens, parent, shared vision) per row of a step holding forks (`packfeed.server.plan.trees`):
    a group with forks is one tree, each fork continuing its parent (where the step holds it); samples sharing a
    prompt (a group's, or a tree's roots) continue the first of them, with the prompt's tokens and every image."""
    place = {row.id: k for k, row in enumerate(rows)}
    trees = {row.group for row in rows if row.parent}
    numbered: dict[tuple[str, str], int] = {}
    group = np.full(len(rows), -1, np.int64)
    shares, vision = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
    parent = np.full(len(rows), -1, np.int64)
    first: dict[tuple[str, str], int] = {}
    for k, row in enumerate(rows):
        if row.group in trees:
            group[k] = numbered.setdefault((row.group, "\0tree"), len(numbered))
        elif row.prefix_key:
            group[k] = numbered.setdefault(prefix_group(row), len(numbered))
        if row.parent and row.parent in place and row.fork_tokens >= 2:  # (a pack shares 2 tokens or more)
            parent[k], shares[k], vision[k] = place[row.parent], row.fork_tokens, row.inherited_vision
        elif row.prefix_key and not row.parent:
            owner = first.setdefault(prefix_group(row), k)
            if owner != k:
                parent[k], shares[k], vision[k] = owner, row.prefix, row.vision
    return group, shares.astype(np.int32), parent, vision.astype(np.int32)


def prefix_group(row: LiveRow) -> tuple[str, str]:
    """What a live sample shares its prefix with: the samples of its group with the same prefix (its tokens and
    images, `samples.LiveSample.prefix_key`)."""
    return row.group, row.prefix_key


def live_fingerprint(config: PlanConfig, seed: int, dataset_fingerprint: str) -> str:
    """What every step's plan is a function of besides its members: the settings, the seed, the dataset."""
    described = json.dumps({"config": config.to_dict(), "seed": seed, "dataset": dataset_fingerprint,
                            "live": 1}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:32]


@dataclass
class Selection:
    members: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # stale (staleness drop)
    filtered: list[str] = field(default_factory=list)  # in groups filter_groups dropped
    short_groups: int = 0  # taken at their deadline with fewer than G samples
    filtered_groups: int = 0
    tokens: int = 0

    @property
    def taken(self) -> list[str]:
        """Every id the step takes off the pending queue."""
        return self.members + self.dropped + self.filtered


def select(pending: list[LiveRow], config: PlanConfig, trained_by: int, whole: bool,
           group_due: Callable[[str], bool] = lambda group: False) -> Selection | None:
    """The next step's samples from `pending` (arrival order); None while they do not fill a step yet (`whole`:
    take every group, complete or not: the job's last step). `trained_by`: the version the step is trained by;
    `group_due(group)`: whether that group's deadline passed."""
    order = pending if config.staleness is Staleness.DROP else \
        sorted(pending, key=lambda row: row.policy_version)  # stable: arrival order within a version
    chosen = Selection()
    for group, rows in _groups(order, config.group_size):
        short = config.group_size and group and len(rows) < config.group_size
        if short and not (whole or group_due(group)):
            continue  # not whole yet: it stays pending
        kept = _drop_stale(rows, config, trained_by, chosen)
        if config.filter_groups and kept and _all_equal(kept, config.filter_groups):
            chosen.filtered += [row.id for row in kept]
            chosen.filtered_groups += 1
            continue
        chosen.short_groups += bool(short)
        chosen.members += [row.id for row in kept]
        chosen.tokens += sum(row.tokens for row in kept)
        if not whole and _full(chosen, config):
            return chosen
    return chosen if whole else None


def _groups(order: list[LiveRow], group_size: int) -> list[tuple[str, list[LiveRow]]]:
    """The pending samples as the units a step takes: each sample alone without `group_size`, else each group
    (in the order of its first sample), a sample without a group alone."""
    if not group_size:
        return [("", [row]) for row in order]
    units: dict[str, list[LiveRow]] = {}
    for number, row in enumerate(order):
        units.setdefault(row.group or f"\0{number}", []).append(row)
    return [("" if group.startswith("\0") else group, rows) for group, rows in units.items()]


def _drop_stale(rows: list[LiveRow], config: PlanConfig, trained_by: int, chosen: Selection) -> list[LiveRow]:
    limit = config.max_staleness
    if config.staleness is not Staleness.DROP or limit is None:
        return rows
    stale = [row for row in rows if trained_by - row.policy_version > limit]
    chosen.dropped += [row.id for row in stale]
    return [row for row in rows if trained_by - row.policy_version <= limit]


def _all_equal(rows: list[LiveRow], name: str) -> bool:
    return len({row.values.get(name) for row in rows}) == 1


def _full(chosen: Selection, config: PlanConfig) -> bool:
    return bool((config.step_samples and len(chosen.members) >= config.step_samples)
                or (config.step_tokens and chosen.tokens >= config.step_tokens))
