"""Elastic resume: the rest of an epoch re-planned for another topology.

A job ran with plan config `old` (DP a, M microbatches, ...) and every rank consumed the steps before `step` of
epoch `epoch`. The samples of that epoch not in those steps are planned again with the new config (DP b, any
M): ISF, balancing and ordering over them alone, with the old job's caps, from (seed, epoch) and a random
stream of its own. The result is a pure function of (index, old config, new config, seed, epoch, step), so
every rank and every server computes the same re-plan, and over the whole epoch each sample is delivered
exactly once: the old steps before `step`, then the re-plan's. Later epochs are planned normally. The old job
may itself be a resume: its epoch then held only what its own old job left, and so does the re-plan.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mapped_loads import valid_mask
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig

_RESUME_STREAM = 0x2E5A  # the re-plan's randomness, apart from any window's


def consumed_samples(plan, steps: int) -> np.ndarray:
    """Sample ids of the first `steps` steps of `plan` (a Plan or a WindowedPlan), every rank's."""
    if steps <= 0:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.asarray(plan.step_members(step), dtype=np.int64) for step in range(steps)])


def epoch_samples(loads, plan) -> np.ndarray:
    """Mask of the samples `plan` plans (packed, or reported oversize): every valid one, but for a re-plan, whose
    epoch began with another job's steps (so resuming a resumed job leaves out what both jobs consumed)."""
    if plan.packs_known:  # a whole epoch's plan: its members and oversize are what it plans
        planned = np.zeros(len(loads), dtype=bool)
        planned[plan.members] = True
        planned[plan.oversize] = True
        return planned
    return valid_mask(loads).copy()  # a windowed plan plans every valid sample (a re-plan is never windowed)


def resume_plan(loads, old_plan, steps: int, config: PlanConfig, seed: int, epoch: int,
                index_fingerprint: str = "", caps: Caps | None = None) -> Plan:
    """The epoch's samples left after `old_plan`'s first `steps` steps, planned with `config`. `loads`: the
    dataset's (in memory or gathered: a mixture's rows); sample ids in the result are its; steps count from 0."""
    left = epoch_samples(loads, old_plan)
    left[consumed_samples(old_plan, steps)] = False
    ids = np.flatnonzero(left)
    local = make_plan(loads.subset(ids), config, seed, epoch, index_fingerprint, caps, _RESUME_STREAM + steps)
    return replace(local, members=ids[local.members], oversize=ids[local.oversize])
