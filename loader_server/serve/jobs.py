"""The jobs a server opens on its datasets (`datasets`).

A job is (dataset, plan config, seed, epochs): its `JobSpec` (`job_spec`). Its plans are a pure function of those, so any server can
serve any rank of it; what changes is small and lives here, in one place per rank (`RankState`): what was
streamed, what the trainer acknowledged, and what of that the coordinator (`packfeed.server.cluster`, shared
by several servers through Redis) has taken; plus the samples skipped at serve time.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from packfeed.server.cluster.coordinator import JobRecord
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.plan_file import Plan
from packfeed.server.serve.job_spec import JobError, JobSpec
from packfeed.server.serve.observe import log
from packfeed.server.serve.step_work import RankStepWork
from packfeed.server.serve.weight_ledger import WeightLedger
from packfeed.server.serve.workers import SharedSteps
from packfeed.v1.layout import Seat
from packfeed.v1.options import Oversize

if TYPE_CHECKING:
    from packfeed.server.live.steps import LiveSteps
    from packfeed.server.serve.job_source import JobSource

MAX_SKIPPED_LISTED = 1000  # per job; the count keeps going


@dataclass
class RankState:
    """One rank's progress on this server: the one owner of its acknowledged position."""

    acked: tuple[int, int] = (-1, -1)  # (epoch, step) of the last acknowledged step; never moves back
    streamed: tuple[int, int] = (-1, -1)  # last step sent
    queued: int = 0  # steps prepared and waiting
    shared: tuple[int, int] = (-1, -1)  # the acknowledged position the coordinator has taken
    unacked: collections.deque = field(default_factory=collections.deque)  # steps sent, not yet acknowledged
    data_wait_s: float = 0.0  # what its trainer reports having waited for packs, in all (AckStep)
    active_at: float = field(default_factory=time.monotonic)  # its last step sent or acknowledged
    step_s: float = 0.0  # the time between its acknowledgements, smoothed

    def sent(self, epoch: int, step: int) -> None:
        self.streamed = (epoch, step)
        self.unacked.append((epoch, step))
        self.active_at = time.monotonic()

    def acknowledge(self, epoch: int, step: int) -> None:
        """Every step up to (epoch, step) was consumed; a late or repeated acknowledgement changes nothing."""
        if (epoch, step) > self.acked:
            now = time.monotonic()
            if self.acked >= (0, 0):
                self.step_s = now - self.active_at if not self.step_s else 0.8 * self.step_s + 0.2 * (now - self.active_at)
            self.active_at = now
        self.acked = max(self.acked, (epoch, step))
        while self.unacked and self.unacked[0] <= self.acked:
            self.unacked.popleft()

    def end_run(self, complete: bool = False) -> None:
        """The rank's stream ended, nothing waits in its queue. Cut short (a cancel, a failure), what it sent and
        nobody acknowledged is not in flight any more: a next run starts from its own position and is sent those
        steps again. `complete` (it sent the job's last step), its trainer still works through the steps it
        holds: they stay unacknowledged until it acknowledges them (the lag counts them)."""
        if not complete:
            self.unacked.clear()
        self.queued = 0

    def begin_run(self) -> None:
        """A stream of the rank starts: it is sent its steps from its own position (none is in flight)."""
        self.unacked.clear()

    @property
    def lag(self) -> int:
        """Steps the current run sent and its trainer has not acknowledged."""
        return len(self.unacked)

    def working(self, now: float) -> bool:
        """Its trainer still works through steps it was sent: some are unacknowledged, and acknowledgements
        still arrive (the last within a minute, or four of its steps for slower trainers; a trainer that died
        with steps in hand stops counting then)."""
        return bool(self.unacked) and now - self.active_at < max(LIVE_S, 4 * self.step_s)

    @property
    def unshared(self) -> tuple[int, int] | None:
        """The acknowledged position, when the coordinator has not taken it yet."""
        return self.acked if self.acked > self.shared else None


PLANS_CACHED = 3
LIVE_S = 60.0  # a rank with unacknowledged steps is working while it acknowledged one this recently


@dataclass
class LiveHold:
    """A live job's lease as this server holds it (`Coordination.hold_live`): one request at a time takes the lease
    and reads the spool (`lock`), and a task renews it while it is held."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _renewal: asyncio.Task | None = None

    @property
    def renewing(self) -> bool:
        return self._renewal is not None and not self._renewal.done()

    def renew_with(self, renewal) -> None:
        """Renew the lease with `renewal` (a coroutine), from now until it returns."""
        self._renewal = asyncio.create_task(renewal)


@dataclass
class Job:
    spec: JobSpec
    dataset: JobSource  # where its samples come from: an index's (or mixture's), a live job's
    ranks: list[RankState]
    caps: Caps | None = None
    skipped: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_SKIPPED_LISTED))
    skipped_count: int = 0
    _plans: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # epoch -> Plan, LRU
    _lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)  # epoch 0 planned (or planning failed)
    failure: JobError | None = None  # why planning failed
    open_streams: int = 0
    last_used: float = field(default_factory=time.monotonic)  # for idle eviction
    delivered: collections.Counter = field(default_factory=collections.Counter)  # samples sent, per dataset
    packs_sent: int = 0  # by every replica (this Job's: a re-opened id starts again, unlike the metrics)
    opened: float = field(default_factory=time.monotonic)  # the status page's throughput counts from here
    steps: SharedSteps = field(default_factory=SharedSteps)  # steps in preparation or held, shared by replicas
    record: JobRecord | None = None  # as the coordinator holds it (its first registration's time included)
    revoked: JobError | None = None  # set when an older registration of the id holds another plan: streams stop
    # PlanSpec.encoder_ranks E > 0: each encoder rank's progress (reported; the LLM ranks' is the job's position)
    encoders: list[RankState] = field(default_factory=list)
    _steps: dict = field(default_factory=dict)  # epoch -> its steps, once known exactly (the plan itself may go)
    _released: threading.Event = field(default_factory=threading.Event)  # closed or forgotten: stop counting
    live_hold: LiveHold = field(default_factory=LiveHold)  # a live job's lease on this server
    ledger: WeightLedger | None = None  # a loss-driven mixture's: its trainers' losses and each window's weights

    def __post_init__(self) -> None:
        if not self.encoders:
            self.encoders = [RankState() for _ in range(self.spec.plan_config.encoder_ranks)]
        self.ledger = self.dataset.ledger(self.spec.plan_config.dp)

    def prepare(self, count_for_s: float) -> None:
        """Plan epoch 0 (caps included) now, so a bad config fails the open, not the first stream; count the
        epochs' steps for at most `count_for_s`, the rest in the background."""
        try:
            self.caps = self.dataset.caps(self.spec.plan_config)
            self.caps = self.caps or self.epoch_plan(0).caps  # a windowed plan's, searched on window 0
            if self.spec.resume is not None:  # checked at open: a resume of another job than it claims is refused
                self.epoch_plan(self.spec.resume.epoch)
            if not self._count_epochs(time.monotonic() + count_for_s):
                threading.Thread(target=self._count_in_background, name=f"count {self.spec.job}", daemon=True).start()
            self._check_not_empty()
        except JobError as error:
            self.failure = error
        except (ValueError, MemoryError) as error:
            self.failure = JobError("INVALID_ARGUMENT", f"job {self.spec.job!r} cannot be planned: {error}")
        finally:
            self.ready.set()
        if self.failure:
            raise self.failure

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def stream_opened(self) -> None:
        """A pack stream of the job opened on this server (a job with open streams is not evicted)."""
        self.open_streams += 1

    def stream_closed(self) -> None:
        self.open_streams -= 1
        self.touch()

    def count_sent(self, packs: int) -> None:
        self.packs_sent += packs

    def revoke(self, error: JobError) -> None:
        """This server stops serving the job (another holds it, or holds its id with another plan): its streams
        end with `error`."""
        self.revoked = error

    def epoch_plan(self, epoch: int) -> Plan:
        """The epoch's plan, computed once (thread-safe). The three most recently used epochs stay cached:
        ranks may be an epoch apart, and a plan is recomputed (identically) if one was evicted."""
        if not 0 <= epoch < self.spec.epochs:
            raise JobError("OUT_OF_RANGE", f"epoch {epoch} is outside job {self.spec.job!r} "
                                           f"(epochs 0..{self.spec.epochs - 1})")
        with self._lock:
            if epoch not in self._plans:
                self._plans[epoch] = self.dataset.job_plan(self.spec.plan_config, self.spec.seed, epoch,
                                                           self.spec.resume, self.caps, ledger=self.ledger)
            self._plans.move_to_end(epoch)
            while len(self._plans) > PLANS_CACHED:
                _, evicted = self._plans.popitem(last=False)  # never the one just asked for: it is the newest
                evicted.close()
            return self._plans[epoch]

    def planned(self, epoch: int) -> Plan | None:
        """The epoch's plan if it is planned already, else None: without planning, and without the lock (which
        planning holds), for the event loop."""
        return self._plans.get(epoch)

    def _count_epochs(self, deadline: float = float("inf")) -> bool:
        """Every epoch's steps: epochs plan different step counts (each shuffles its samples into other packs,
        and aligns them anew), and a trainer sizes its schedule from the job's length. An epoch is counted, not
        planned whole (`planner.count_steps`), unless its plan is at hand. Counts epochs 0, 1, ... until `deadline`
        (at least epoch 0); True when every epoch is counted. A windowed job's epochs are counted as their
        windows are planned (`step_counts` estimates meanwhile)."""
        if self.spec.plan_config.window or self.spec.plan_config.live:
            return True
        loads = None
        for epoch in range(self.spec.epochs):
            if epoch in self._steps:
                continue
            if self._released.is_set() or (epoch and time.monotonic() > deadline):
                return False
            with self._lock:
                cached = self._plans.get(epoch)
            if cached is not None:
                self._steps[epoch] = cached.n_steps
                continue
            if loads is None:  # read once for every epoch counted here
                loads = self.dataset.planning.shared_loads()
            self._steps[epoch] = self.dataset.count_steps(self.spec.plan_config, self.spec.seed, epoch,
                                                          self.spec.resume, self.caps, loads)
        return True

    def _count_in_background(self) -> None:
        try:
            self._count_epochs()
        except Exception:  # the epochs stay estimated; streaming plans each epoch itself and reports any error
            log.exception("counting a job's epochs failed", extra={"job": self.spec.job})

    def release(self) -> None:
        """The job was closed or forgotten, or its server is stopping: background counting stops (and a live job's
        lease renewal), and a window waiting for loss reports stops waiting."""
        self._released.set()
        if self.ledger is not None:
            self.ledger.close()

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def _check_not_empty(self) -> None:
        """A job with no step in any epoch has nothing to stream: say why at its open, not as "step 0 is past
        the plan" at its first stream."""
        if self.spec.plan_config.window or self.spec.plan_config.live or any(self._steps.values()):
            return
        plan = self.epoch_plan(0)
        left_out = len(plan.oversize) if plan.config.oversize is Oversize.SKIP else 0
        why = (f"the plan left out all {left_out} of its samples as over a cap (oversize: skip): raise the caps or "
               "choose oversize alone or truncate") if left_out else \
            "it holds no valid sample (every row of its index is invalid: `packfeed info INDEX` says why)"
        raise JobError("FAILED_PRECONDITION", f"job {self.spec.job!r} has no step to stream: dataset "
                                              f"{self.spec.dataset or self.dataset.name!r} is empty for it: {why}")

    def step_counts(self) -> tuple[list[int], bool]:
        """Each epoch's steps, and whether any of them is an estimate: a windowed epoch not yet planned whole is
        its planned windows extrapolated, an epoch not yet begun the last estimate's."""
        with self._lock:
            for epoch, plan in self._plans.items():
                if plan.steps_known:
                    self._steps[epoch] = plan.steps_known
            estimates = {epoch: plan.steps_estimate for epoch, plan in self._plans.items()}
        counts, estimated = [], False
        for epoch in range(self.spec.epochs):
            if epoch in self._steps:
                counts.append(self._steps[epoch])
                continue
            estimated = True
            counts.append(estimates.get(epoch, counts[-1] if counts else 0))
        return counts, estimated

    def check_plan(self, expected: str) -> None:
        """A client holding another plan of this job id must not be served this one."""
        if expected and expected != self.epoch_plan(0).fingerprint():
            raise JobError("FAILED_PRECONDITION", f"job {self.spec.job!r} plans to {self.epoch_plan(0).fingerprint()} on "
                                                  f"this server (dataset {self.dataset.fingerprint}); the client "
                                                  f"holds plan {expected}: this server serves another dataset or "
                                                  "settings; use one of the job's own servers")

    def progress(self, seat: Seat) -> RankState:
        """The progress of the seat's rank (an encoder rank's own)."""
        return (self.encoders if seat.encoder else self.ranks)[seat.rank]

    @property
    def live(self) -> LiveSteps | None:
        """A live job's steps, which its producers feed (PlanConfig.live); None for a job planned ahead."""
        return self.dataset.live_steps

    async def wait_formed(self, epoch: int, step: int) -> None:
        """Until the step exists: at once for indexed data, once it forms for a live job (or the job ends)."""
        live = self.live
        loop = asyncio.get_running_loop()
        while live is not None:
            formed = live.waiter(loop)  # registered before the check: a step formed in between wakes it
            if step < live.formed or live.ended:
                return
            await formed

    def check_step(self, epoch: int, step: int) -> Plan:
        plan = self.epoch_plan(epoch)
        if not plan.has_step(step):
            known = f"{plan.steps_known} steps" if plan.steps_known else "past its last window"
            raise JobError("OUT_OF_RANGE", f"step {step} is past the plan of epoch {epoch} ({known})")
        return plan

    def work(self, epoch: int, step: int, seat: Seat, decode_budget: int = 0) -> RankStepWork:
        """What the seat's rank is sent of the step (every lane's share: each lane's stream takes its own);
        `decode_budget`: what decoding one image may take (`RankStepWork.decode_budget`)."""
        return self.dataset.work(self.epoch_plan(epoch), step, replace(seat, lane=0, replica=0), decode_budget)

    def next_step(self, epoch: int, step: int) -> tuple[int, int] | None:
        """The step after (epoch, step), or None at the end of the job."""
        if not self.epoch_plan(epoch).is_last_step(step):
            return epoch, step + 1
        return (epoch + 1, 0) if epoch + 1 < self.spec.epochs else None

    def registered(self, record: JobRecord) -> None:
        """The job as the coordinator holds it, the first registration's time included."""
        self.record = record

    def record_skipped(self, epoch: int, step: int, skipped: list[tuple[str, str]]) -> None:
        with self._lock:
            for key, reason in skipped:
                self.skipped.append((key, reason, epoch, step))
            self.skipped_count += len(skipped)

    def ack(self, rank: int, epoch: int, step: int) -> None:
        """Rank `rank`'s acknowledgement (its seat checked by `requests.seat_of`)."""
        self.check_step(epoch, step)
        self.ranks[rank].acknowledge(epoch, step)
        if self.live is not None:  # what every rank consumed leaves the spool
            self.live.release(min(state.acked for state in self.ranks)[1])
