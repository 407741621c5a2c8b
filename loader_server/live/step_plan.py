"""A live step's plan: its members planned as an epoch of their own, a pure function of (its members in arrival
order, the job's settings and seed, the step), so any server, or the same one after a restart, streams a resumed
trainer the very packs it would have got (`packfeed.server.live.steps` forms the steps)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace

import numpy as np

from packfeed.server.live.rows import LiveRow
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import LIMITS, LIVE_FIELDS, PlanConfig


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
    if config.shares_prefixes(any(r.prefix_key for r in rows)):  # one group per (group, prefix)
        numbered: dict[tuple[str, str], int] = {}
        loads.group = np.array([numbered.setdefault(prefix_group(r), len(numbered)) if r.prefix_key else -1
                                for r in rows], np.int64)
        loads.prefix = np.array([r.prefix for r in rows], np.int32)
    planned = replace(config, live=False, **{name: None if name == "max_staleness" else 0 for name in LIVE_FIELDS})
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


def prefix_group(row: LiveRow) -> tuple[str, str]:
    """What a live sample shares its prefix with: the samples of its group with the same prefix (its tokens and
    images, `samples.LiveSample.prefix_key`)."""
    return row.group, row.prefix_key


def live_fingerprint(config: PlanConfig, seed: int, dataset_fingerprint: str) -> str:
    """What every step's plan is a function of besides its members: the settings, the seed, the dataset."""
    described = json.dumps({"config": config.to_dict(), "seed": seed, "dataset": dataset_fingerprint,
                            "live": 1}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:32]
