"""What a job reads from: the one seam between a `Job` (and the step pump and status around it) and where its
samples come from. Two sources implement it: a served `Dataset` (`datasets`: one index, or a mixture's, planned
ahead a whole epoch or a window at a time) and a live job's `LiveDataset` (`live_source`: steps formed as a
producer's samples arrive). A third (multi-turn trajectories) comes in as another implementation: nothing that
uses a job branches on which source it has.

How the source's samples are read in a worker is its work's `StepReads` (`step_work`); what a source accepts from
producers, where it accepts any, is its `live_steps`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from packfeed.server.live.steps import LiveSteps
    from packfeed.server.serve.weight_ledger import WeightLedger
    from packfeed.server.serve.job_spec import Resume
    from packfeed.server.serve.step_work import RankStepWork
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1.layout import Seat
    from packfeed.v1.options import PixelMode, PlanConfig


class JobSource(Protocol):
    name: str

    @property
    def fingerprint(self) -> str:
        """What the job's plans are a function of, beside their settings (the index's, or the prompts')."""
        ...

    @property
    def conventions(self) -> pb.ModelConventions: ...

    @property
    def pixels(self) -> PixelMode: ...

    @property
    def live_steps(self) -> LiveSteps | None:
        """The steps producers feed during the run (None: a source planned ahead)."""
        ...

    def caps(self, config: PlanConfig, loads: Any = None) -> Any:
        """The job's caps, searched once at its open (None: each plan's own)."""
        ...

    def job_plan(self, config: PlanConfig, seed: int, epoch: int, resume: Resume | None, caps: Any,
                 loads: Any = None, ledger: WeightLedger | None = None) -> Any:
        """Epoch `epoch`'s plan: what the job asks it (has_step, is_last_step, steps_known, steps_estimate,
        fingerprint, packs_known, draws, caps, close). `ledger`: the job's, from `ledger()`."""
        ...

    def planned_loads(self, plan: Any) -> Any:
        """The loads a plan's members index (None where the source has none to report)."""
        ...

    def ledger(self, ranks: int) -> WeightLedger | None:
        """The job's ledger of loss-driven weights, where its source has one."""
        ...

    def work(self, plan: Any, step: int, seat: Seat, decode_budget: int = 0) -> RankStepWork:
        """What a worker needs to prepare the packs of one step for `seat`'s rank (lane and replica 0: every lane
        and replica of the rank is sent the same work); `decode_budget`: `RankStepWork.decode_budget`."""
        ...

    def estimate_bytes(self, work: RankStepWork) -> int: ...

    def working_bytes(self, work: RankStepWork) -> int: ...
