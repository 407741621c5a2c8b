"""Windowed planning: an epoch planned window by window, so planning starts at once and holds a window, not the
epoch, whatever the dataset's size.

The epoch's order is an affine permutation of the sample ids, `i -> (a*i + b) mod n` with `a` coprime to `n`,
both drawn from (seed, epoch): window `w` is the samples at positions `[w*W, (w+1)*W)` of it, computed without
materialising the permutation (a window spreads evenly over the whole dataset, so each mixes every part of
it). Each window is planned by `make_plan` on its own samples (ISF, balanced steps, LPT over ranks, 1F1B
order), with caps searched once per epoch on window 0 and randomness of its own; its steps follow the steps
of the window before.

A window's final step, the one that may be lighter, is not served with it: its samples are carried into the
next window and packed there, so only the epoch's last step is partial, as in whole-epoch planning. Nor are the
steps a collective-safe plan could not align (the few packs of a class that fill no column), nor its
least balanced steps (`CARRIED_FRACTION` of them): their samples are carried too and meet peers of their size in
the next window, which brings windowed Dist to whole-epoch planning's; those samples are served a window later.

Guarantees: every valid sample is in exactly one served step, so exactly once per epoch (as in whole-epoch
planning, save what the `skip` policy drops); window `w`'s plan is a pure function of (index, config, seed,
epoch, window size, w), so every server computes the same plan. BENCHMARKS "Windowed planning" measures the
balance against whole-epoch planning.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from packfeed.server.mixture.draws import drawn_again
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.collective import (alignment_summary, collective_safe_layout, sample_towers, tower_names,
                                             unaligned_towers)
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.groups import shares_prefixes
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mapped_loads import MappedLoads
from packfeed.server.plan.metrics import dist_terms, step_waste
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig

DEFAULT_WINDOW = 4_000_000  # samples per window: planned in a few seconds, held in a few hundred MB
# Per window, the steps whose ranks are least balanced are not served with it: their samples go to the next
# window. Imbalance sits in few steps (a window's rarest, largest packs, which have no peers of their size to share
# a step with): in a 4M-sample window the worst 512 of 116k steps hold 81% of the LLM side's waste, the worst 16
# all of the ViT side's. Carried forward, such samples meet their peers of later windows. A 16th of the steps
# brings windowed Dist to whole-epoch planning's (BENCHMARKS "Windowed planning"; a 32nd left ViT Dist 48% above
# it, over seeds 0-2 at 10M samples).
CARRIED_FRACTION = 1 / 16


def affine_order(n: int, seed: int, epoch: int) -> tuple[int, int]:
    """(a, b) of the epoch's permutation `i -> (a*i + b) mod n`, `a` coprime to n."""
    if n <= 1:
        return 1, 0
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch, 0x57A1D]))
    while True:
        a = int(rng.integers(1, n))
        if math.gcd(a, n) == 1:
            return a, int(rng.integers(0, n))


def least_balanced_steps(plan: Plan, config: PlanConfig, count: int, unaligned: np.ndarray | None = None) -> np.ndarray:
    """Mask of the window's steps to carry over: its last step (which may be lighter), the steps with a microbatch
    calling a tower on some ranks only (`unaligned`, per step: they may meet their peers later) and the `count`
    steps with the most waste (ViT + LLM, each as dist_terms counts it), ties to the earlier step."""
    steps = plan.n_steps
    carried = np.zeros(steps, dtype=bool) if unaligned is None else unaligned.copy()
    carried[-1] = True
    if count > 0 and plan.pack_vision is not None:
        vit, llm = (np.asarray(side, dtype=np.float64).reshape(steps, config.dp, config.microbatches).sum(axis=2)
                    for side in (plan.pack_vision, plan.pack_tokens))
        waste = step_waste(vit)[0] + step_waste(llm)[0]
        worst = np.argsort(-waste, kind="stable")[:min(count, steps - 1)]
        carried[worst[waste[worst] > 0]] = True
    return carried


def window_members(valid, seed: int, epoch: int, window: int, size: int) -> np.ndarray:
    """The valid sample ids of one window, in the epoch's order (int64). `valid`: a bool column, in memory or
    gathered (GatheredColumn)."""
    n = len(valid)
    a, b = affine_order(n, seed, epoch)
    positions = np.arange(window * size, min((window + 1) * size, n), dtype=np.int64)
    ids = (positions * a + b) % n  # a * position < 2^63 for n below about 3e9
    return ids[valid[ids]]


class WindowedPlan:
    """An epoch's plan, window by window: steps are global (window 0's first, then window 1's, ...). A window
    is planned when a step of it is first asked for, and the next one in the background meanwhile; at most
    `keep` windows are held."""

    packs_known = False  # its windows are planned as they are reached (Plan.packs_known)

    def __init__(self, loads: SampleLoads | MappedLoads, config: PlanConfig, seed: int, epoch: int, size: int = DEFAULT_WINDOW,
                 index_fingerprint: str = "", caps: Caps | None = None, keep: int = 2, drawn: bool = False,
                 rows=None, draws=None, ledger=None):
        """`drawn`: the rows are in window order already (a moving mixture draws each window's rows,
        `packfeed.server.mixture.draws`): window w is rows [w*size, (w+1)*size), not a stretch of the epoch's
        permutation. A mixture's: `rows` (its MixtureRows: the dataset and sample id of each row); one whose
        weights move, its `draws` (MixtureDraws: each window's weights and counts), and where they are loss-driven
        its job's `ledger` (WeightLedger: the draws' weight source, deciding windows 2 on), told each window's
        steps as they are planned."""
        if size < 1:
            raise ValueError("window size must be at least one sample")
        self.loads, self.config, self.seed, self.epoch, self.size = loads, config, seed, epoch, size
        self.index_fingerprint, self.keep, self.drawn = index_fingerprint, max(2, keep), drawn
        self.rows, self.draws, self.ledger = rows, draws, ledger
        self.n_windows = max(1, math.ceil(len(loads) / size))
        self._caps = caps
        self._plans: dict[int, Plan] = {}
        self._carried: dict[int, np.ndarray] = {0: np.empty(0, dtype=np.int64)}  # samples a window takes over
        self._passed_on: dict[int, np.ndarray] = {}  # drawn rows carried through a window that drew their sample
        self._first_steps = [0]  # first global step of each window planned so far, then where the next starts
        self._lock = threading.RLock()
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packfeed-window")
        self._next: tuple[int, Future] | None = None
        self._fingerprint: str | None = None
        self._groups: tuple | None = None  # grouped loads: each group's members and leader (`_whole_groups`)

    @property
    def caps(self) -> Caps | None:
        """Searched once per epoch, on window 0's samples (padded strategies: none)."""
        if self._caps is None and not self.config.strategy.padded:
            first = self._subset(0)[1]
            self._caps = resolve_caps(first, self.config)
        return self._caps

    def _subset(self, window: int) -> tuple[np.ndarray, SampleLoads]:
        if self.drawn:
            ids = np.arange(window * self.size, min((window + 1) * self.size, len(self.loads)), dtype=np.int64)
        else:
            ids = window_members(self.loads.valid, self.seed, self.epoch, window, self.size)
        if shares_prefixes(self.loads, self.config):
            ids = self._whole_groups(ids)
        if window in self._carried:
            carried = self._carried[window]
            if self.drawn and window + 1 < self.n_windows:
                twins = drawn_again(self.loads, carried, ids)
                self._passed_on[window + 1] = carried[twins]
                carried = carried[~twins]
            ids = np.concatenate([carried, ids])
        return ids, self.loads.subset(ids)

    def _whole_groups(self, ids: np.ndarray) -> np.ndarray:
        """A window's samples with every group whole: a group is planned in the window of its lowest sample id
        (its leader), so its members share their prefix wherever the epoch's order scatters them."""
        if self._groups is None:  # once: each group's members (CSR, by id) and its leader
            group = np.asarray(self.loads.group)
            grouped = np.flatnonzero((group >= 0) & np.asarray(self.loads.valid))
            grouped = grouped[np.argsort(group[grouped], kind="stable")]
            starts = np.flatnonzero(np.r_[True, group[grouped][1:] != group[grouped][:-1]]) if len(grouped) \
                else np.zeros(0, np.int64)
            leader = np.full(int(group.max()) + 1 if len(grouped) else 0, -1, np.int64)
            leader[group[grouped[starts]]] = grouped[starts]
            self._groups = (group, grouped, np.r_[starts, len(grouped)], leader)
        group, members, bounds, leader = self._groups
        own = group[ids]
        leads = ids[(own >= 0) & (leader[np.maximum(own, 0)] == ids)] if len(leader) else ids[:0]
        number = np.searchsorted(group[members[bounds[:-1]]], group[leads])  # each leader's group's place
        taken = [members[bounds[k]:bounds[k + 1]] for k in number.tolist()]
        whole = np.concatenate(taken) if taken else np.zeros(0, np.int64)
        return np.concatenate([ids[own < 0], whole]).astype(np.int64)

    def _plan_window(self, window: int) -> Plan:
        """The window's plan, over its own samples and those the window before carried over. Except in the last
        window, its final step (the one that may be lighter) and its least balanced steps are not served here:
        their samples go to the next window (`least_balanced_steps`)."""
        ids, subset = self._subset(window)
        local = make_plan(subset, self.config, self.seed, self.epoch, self.index_fingerprint, self.caps, window)
        plan = replace(local, members=ids[local.members], oversize=ids[local.oversize])
        if window + 1 == self.n_windows or plan.n_steps == 0:
            if window + 1 < self.n_windows:
                self._carried[window + 1] = self._passed_on.get(window + 1, np.empty(0, dtype=np.int64))
            return plan
        unaligned = None
        if collective_safe_layout(self.config):
            unaligned = unaligned_towers(local.offsets, local.members, sample_towers(subset), self.config.dp,
                                         self.config.microbatches).any(axis=1)
        carried = least_balanced_steps(plan, self.config, int(plan.n_steps * CARRIED_FRACTION), unaligned)
        served_packs = np.repeat(~carried, self.config.slots)
        sizes = np.diff(plan.offsets)
        served = np.repeat(served_packs, sizes)
        # a copy (fancy indexing): a view would keep this window's whole members array alive for the epoch
        self._carried[window + 1] = np.concatenate([self._passed_on.get(window + 1, np.empty(0, np.int64)),
                                                    plan.members[~served]])
        sizes = sizes[served_packs]
        return replace(plan, offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(plan.offsets.dtype),
                       members=plan.members[served], truncate_to=plan.truncate_to[served],
                       encoder_rank=None if plan.encoder_rank is None else plan.encoder_rank[served],
                       pack_vision=None if plan.pack_vision is None else plan.pack_vision[served_packs],
                       pack_tokens=None if plan.pack_tokens is None else plan.pack_tokens[served_packs])

    def window(self, window: int) -> Plan:
        """Window `window`'s plan (sample ids global, steps local). Windows are first planned in order (a
        window's first step is where the one before ends); one dropped from memory is planned again."""
        if self.ledger is not None and self.draws is not None:
            self._decide_through(window)
        with self._lock:
            while len(self._first_steps) - 1 <= window:
                planned = len(self._first_steps) - 1
                plan = self._take_ahead(planned) or self._plan_window(planned)
                self._first_steps.append(self._first_steps[-1] + plan.n_steps)
                if self.ledger is not None:  # the steps a later window's decision reads the losses of
                    self.ledger.window_planned(self.epoch, planned, range(*self._first_steps[-2:]))
                self._remember(planned, plan)
            if window not in self._plans:
                self._remember(window, self._take_ahead(window) or self._plan_window(window))
            plan = self._plans.pop(window)
            self._plans[window] = plan  # most recently used last
            following = window + 1
            if following < self.n_windows and following not in self._plans and self._next is None:
                self._next = (following, self._ahead.submit(self._plan_window, following))
            return plan

    def _decide_through(self, window: int) -> None:
        """A loss-driven mixture's weights of the windows up to `window`, decided before the lock is taken: deciding
        waits for trainers' reports, which come with acknowledgements that ask this plan for their steps."""
        for later in range(max(2, self.draws.decided), min(window, self.n_windows - 1) + 1):
            self.window(later - 1)  # the window before is planned: the steps the decision reads are known
            self.draws.weights(later)

    def _remember(self, window: int, plan: Plan) -> None:
        self._plans[window] = plan
        while len(self._plans) > self.keep:
            del self._plans[next(iter(self._plans))]  # the least recently used

    def _take_ahead(self, window: int) -> Plan | None:
        if self._next is not None and self._next[0] == window:
            future, self._next = self._next[1], None
            return future.result()
        return None

    def locate(self, step: int) -> tuple[int, Plan, int]:
        """(window, its plan, step within it) of a global step; IndexError past the epoch's last step."""
        if step < 0:
            raise IndexError(f"step {step} is negative")
        # no lock held across windows: `window` takes it for each, after a loss-driven window is decided
        for window in range(self.n_windows):
            if window + 1 >= len(self._first_steps):
                self.window(window)
            if step < self._first_steps[window + 1]:
                return window, self.window(window), step - self._first_steps[window]
        raise IndexError(f"step {step} is past the epoch's last step")

    def is_last_step(self, step: int) -> bool:
        window, plan, local = self.locate(step)
        if local != plan.n_steps - 1:
            return False
        if self.ledger is not None:  # drawn windows each hold samples, so the last has steps: asking for the next
            return window + 1 == self.n_windows  # would wait for the reports of the very step asked about
        return all(self.window(later).n_steps == 0 for later in range(window + 1, self.n_windows))

    def pack_with_truncation(self, step: int, rank: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
        _, plan, local = self.locate(step)
        return plan.pack_with_truncation(local, rank, microbatch)

    def step_members(self, step: int) -> np.ndarray:
        _, plan, local = self.locate(step)
        return plan.step_members(local)

    def pack_encoders(self, step: int, rank: int, microbatch: int) -> np.ndarray:
        _, plan, local = self.locate(step)
        return plan.pack_encoders(local, rank, microbatch)

    def has_step(self, step: int) -> bool:
        try:
            self.locate(step)
        except IndexError:
            return False
        return True

    @property
    def planned_windows(self) -> int:
        """Windows planned so far (in order: each after the one before)."""
        return len(self._first_steps) - 1

    def window_of(self, step: int) -> int | None:
        """The window holding global step `step` among those planned so far (None past them), without planning or
        the lock: for callers that must never wait, such as the server's event loop (a loss-driven window may wait
        for reports that arrive through it)."""
        starts = self._first_steps  # appended to only
        window = bisect.bisect_right(starts, step) - 1
        return window if 0 <= window < len(starts) - 1 else None

    def first_step(self, window: int) -> int:
        """The first global step of a planned window."""
        return self._first_steps[window]

    @property
    def steps_known(self) -> int:
        """Steps of the epoch once every window is planned; 0 before."""
        return self._first_steps[-1] if len(self._first_steps) - 1 == self.n_windows else 0

    @property
    def steps_estimate(self) -> int:
        """Steps of the epoch: exact once every window is planned, before that the windows planned so far
        extrapolated to all of them (window 0 is planned with the plan's fingerprint, so there is always one)."""
        planned = len(self._first_steps) - 1
        if planned == self.n_windows or planned == 0:
            return self._first_steps[-1]
        return round(self._first_steps[-1] * self.n_windows / planned)

    def fingerprint(self) -> str:
        """Digest of what the plan is a function of, and of window 0's packs (which a different planner would
        change): every server of a job gets the same without planning the whole epoch. Computed once (window 0
        may have left memory by the time a stream asks again)."""
        if self._fingerprint is None:
            digest = hashlib.sha256(json.dumps({"config": self.config.to_dict(), "seed": self.seed,
                                                "epoch": self.epoch, "index": self.index_fingerprint,
                                                "windows": self.n_windows}, sort_keys=True).encode())
            digest.update(self.window(0).fingerprint().encode())
            self._fingerprint = digest.hexdigest()[:32]
        return self._fingerprint

    @property
    def n_steps(self) -> int:
        """Steps of the whole epoch: known once every window is planned (this plans them)."""
        for window in range(self.n_windows):
            self.window(window)
        return self._first_steps[-1]

    def epoch_balance(self) -> dict[str, float | int]:
        """ViT and LLM Dist over every step of the epoch, the samples planned and the microbatches a collective-safe
        plan could not align (`packfeed.server.plan.collective`), planning every window once
        and holding one window's per-step loads at a time (the epoch's would be 50 bytes a step)."""
        shape = (-1, self.config.dp, self.config.microbatches)
        totals = {"vit": [0.0, 0], "llm": [0.0, 0]}
        samples, unaligned = 0, []
        for window in range(self.n_windows):
            plan = self.window(window)
            unaligned.append(unaligned_towers(plan.offsets, np.arange(len(plan.members)),
                                              sample_towers(self.loads, plan.members), self.config.dp,
                                              self.config.microbatches))
            for side, loads in zip(("vit", "llm"), plan.pack_loads(self.loads)):
                waste, busy = dist_terms(loads.reshape(shape).sum(axis=2))
                totals[side][0] += waste
                totals[side][1] += busy
            samples += len(plan.members)
        dist = {f"{side}_dist": waste / busy if busy else 0.0 for side, (waste, busy) in totals.items()}
        alignment = alignment_summary(np.concatenate(unaligned), tower_names(self.loads), self.config)
        return {**dist, "samples": samples, "steps": self.steps_known, "collective_safe": alignment}

    def whole(self) -> Plan:
        """The epoch as one Plan, every window planned and its steps global (to write a plan file). Its
        fingerprint is this plan's, the one a server serving it reports."""
        plans = [self.window(window) for window in range(self.n_windows)]
        first = plans[0]
        shifts = np.cumsum([0] + [int(plan.offsets[-1]) for plan in plans[:-1]])
        offsets = np.concatenate([[0]] + [plan.offsets[1:] + shift for plan, shift in zip(plans, shifts)])

        def joined(name: str):
            parts = [getattr(plan, name) for plan in plans]
            return None if any(part is None for part in parts) else np.concatenate(parts)

        further = {name: np.concatenate([plan.further_encoder_ranks[name] for plan in plans])
                   for name in first.further_encoder_ranks}
        plan = replace(first, caps=self.caps, offsets=offsets.astype(first.offsets.dtype), members=joined("members"),
                       truncate_to=joined("truncate_to"), oversize=joined("oversize"),
                       pack_vision=joined("pack_vision"), pack_tokens=joined("pack_tokens"),
                       encoder_rank=joined("encoder_rank"), further_encoder_ranks=further, phases=None,
                       cp_degree=joined("cp_degree"), cp_group=joined("cp_group"), groups=joined("groups"),
                       window_starts=np.cumsum([0] + [plan.n_steps for plan in plans[:-1]]).astype(np.int64),
                       rows=self.rows, _fingerprint=self.fingerprint())
        return plan

    def close(self) -> None:
        self._ahead.shutdown(wait=False, cancel_futures=True)
