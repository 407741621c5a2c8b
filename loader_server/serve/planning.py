"""How a served dataset's epochs are planned, behind one interface (`Planning`): over its one index, as
`packfeed plan --index` plans it (`IndexPlanning`), or over the union of a mixture's indexes, each pack member
named by its dataset and its sample there (`MixturePlanning`). A `Dataset` asks its planning and never which
kind it has; each kind plans exactly as the planner does for it (the plans' fingerprints are pinned in tests)."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from packfeed.server.mixture.loads import MixtureLoads, count_mixture_steps, make_mixture_plan
from packfeed.server.plan.caps import resolve_caps
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mapped_loads import MappedLoads
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.planner import count_steps, make_plan
from packfeed.server.plan.resume import resume_plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.weight_ledger import WeightLedger
from packfeed.v1.options import PlanConfig


class Planning(Protocol):
    """`loads`, where a method takes it: what `shared_loads()` gave, so several plans in a row read them once."""

    fingerprint: str  # what the plans are a function of, beside their settings: the index's, or the mixture's

    def shared_loads(self) -> SampleLoads | None:
        """Every sample's loads in memory, for a caller planning several epochs in a row (None: each plan
        reads what it needs)."""

    def caps(self, config: PlanConfig, loads: SampleLoads | None = None) -> Caps: ...

    def plan_epoch(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                   loads: SampleLoads | None = None, ledger: WeightLedger | None = None) -> Plan | WindowedPlan:
        """`ledger`: the job's (`ledger()`), which decides a loss-driven mixture's windows."""

    def count_steps(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                    loads: SampleLoads | None = None) -> int:
        """The steps `plan_epoch` plans for a whole (not windowed) epoch, counted without planning it whole."""

    def replan(self, old: Plan | WindowedPlan, steps: int, config: PlanConfig, seed: int, epoch: int,
               caps: Caps | None, loads: SampleLoads | None = None) -> Plan:
        """What `old` left of its epoch after `steps` steps, planned with `config` (plan.resume)."""

    def planned_loads(self, plan: Plan) -> SampleLoads | MappedLoads:
        """The loads a plan's members index."""

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, sample id there) of plan members `ids`."""

    def ledger(self, ranks: int) -> WeightLedger | None:
        """A job's ledger of loss-driven mixture weights, where the mixture names a rule; else None."""


class IndexPlanning:
    def __init__(self, loads: SampleLoads | MappedLoads, fingerprint: str):
        self.loads, self.fingerprint = loads, fingerprint

    def shared_loads(self) -> SampleLoads:
        """17 bytes a sample while a whole epoch is planned (the mapped columns read into memory)."""
        if isinstance(self.loads, SampleLoads):
            return self.loads
        return self.loads.subset(np.arange(len(self.loads)))

    def caps(self, config: PlanConfig, loads: SampleLoads | None = None) -> Caps:
        return resolve_caps(self.shared_loads() if loads is None else loads, config)

    def plan_epoch(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                   loads: SampleLoads | None = None, ledger: None = None) -> Plan | WindowedPlan:
        if config.window:
            return WindowedPlan(self.loads, config, seed, epoch, config.window, self.fingerprint, caps)
        return make_plan(self.shared_loads() if loads is None else loads, config, seed, epoch, self.fingerprint,
                         caps=caps)

    def count_steps(self, config, seed, epoch, caps, loads=None) -> int:
        return count_steps(self.shared_loads() if loads is None else loads, config, seed, epoch, caps)

    def replan(self, old, steps, config, seed, epoch, caps, loads=None) -> Plan:
        return resume_plan(self.shared_loads() if loads is None else loads, old, steps, config, seed, epoch,
                           self.fingerprint, caps)

    def planned_loads(self, plan: Plan) -> SampleLoads | MappedLoads:
        return self.loads

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return np.zeros(len(ids), dtype=np.int32), ids

    def ledger(self, ranks: int) -> None:
        return None


class MixturePlanning:
    def __init__(self, mixture: MixtureLoads):
        self.mixture, self.fingerprint = mixture, mixture.fingerprint

    def shared_loads(self) -> None:
        return None  # each epoch's rows differ (repeats, subsets): every plan gathers its own

    def caps(self, config: PlanConfig, loads: SampleLoads | None = None) -> Caps:
        self._check_windowed(config)
        return resolve_caps(self.mixture.once().loads, config)  # every valid sample once: the same each epoch

    def plan_epoch(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                   loads: SampleLoads | None = None, ledger: WeightLedger | None = None) -> Plan | WindowedPlan:
        if config.window:
            return self.mixture.windowed(config, seed, epoch, caps, ledger)
        self._check_windowed(config)
        return make_mixture_plan(self.mixture, config, seed, epoch, caps)

    def count_steps(self, config, seed, epoch, caps, loads=None) -> int:
        self._check_windowed(config)
        return count_mixture_steps(self.mixture, config, seed, epoch, caps)

    def _check_windowed(self, config: PlanConfig) -> None:
        """A mixture whose weights move is planned in windows only (each draws by its own weights)."""
        if self.mixture.moving and not config.window:
            raise JobError("INVALID_ARGUMENT", f"{self.mixture.mixture.where()}: its weights move over the epoch, so "
                                               "it is planned in windows: give the job a window (PlanSpec.window, "
                                               "--window N), e.g. a twentieth of the epoch; an elastic resume, which "
                                               "plans what is left of an epoch whole, cannot continue such a job "
                                               "(resume it with its own settings)")

    def replan(self, old, steps, config, seed, epoch, caps, loads=None) -> Plan:
        """The old epoch's rows keep their positions (the same repeats and subset), so packs name the same
        datasets and samples."""
        self._check_windowed(config)
        return replace(resume_plan(old.rows.loads, old, steps, config, seed, epoch, self.fingerprint, caps),
                       rows=old.rows)

    def planned_loads(self, plan: Plan) -> SampleLoads | MappedLoads:
        return plan.rows.loads

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64)
        return plan.rows.datasets[ids], plan.rows.sample_ids[ids]

    def ledger(self, ranks: int) -> WeightLedger | None:
        mixture = self.mixture.mixture  # the file's: a rule names loss-driven weights
        if mixture.rule is None:
            return None
        return WeightLedger(mixture.rule, [e.name for e in mixture.datasets], ranks, mixture.schedule.weights)
