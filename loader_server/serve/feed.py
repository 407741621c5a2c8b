"""One rank stream's supply of prepared steps: its step pump (`step_pump`), the bounded queue it fills, and the
stream's account in the memory budget (`budget`), which may ask it to shed what it prepared ahead.

Shedding is how a stalled client holds only what it needs: while the stream is blocked writing a step to its
client and others wait for room, its queued and in-preparation steps are released and its pump stopped;
once the client has taken the step, the pump starts again from the step after it. The steps are then
prepared again (the same bytes: a step is a pure function of the plan), so shedding costs CPU, never data.
"""

from __future__ import annotations

import asyncio
import contextlib

from packfeed.server.serve.budget import MemoryBudget, StepHold
from packfeed.server.serve.config import ServerConfig
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.observe import Metrics, log
from packfeed.server.serve.step_pump import END, produce
from packfeed.server.serve.workers import WorkerPool
from packfeed.v1.layout import Seat


HEARTBEAT = object()  # `RankFeed.next`: nothing yet, the stream is alive


class RankFeed:
    def __init__(self, job: Job, seat: Seat, start: tuple[int, int], pool: WorkerPool, budget: MemoryBudget,
                 config: ServerConfig, metrics: Metrics):
        self.job, self.seat, self.start = job, seat, start
        self._pool, self._config, self._metrics = pool, config, metrics
        self.account = budget.account(self._shed)
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=config.prefetch_steps)
        self._writing: StepHold | None = None  # the step its client is being sent
        self._last: tuple[int, int] | None = None  # the last step taken from the queue
        self._shed_pending = False
        self.pump = self._produce(start)

    def _produce(self, cursor: tuple[int, int]) -> asyncio.Task:
        return asyncio.create_task(produce(self.job, self.seat, cursor, self.queue, self._pool, self.account,
                                           self._config, self._metrics))

    async def next(self, heartbeat_s: float | None = None):
        """The next prepared ((epoch, step), RankStepResult, StepHold), or END after the job's last step (or a
        failure of the pump: `failure()`); HEARTBEAT when `heartbeat_s` passed without either."""
        if self._shed_pending:
            await asyncio.gather(self.pump, return_exceptions=True)  # cancelled: its holds released
            self._shed_pending = False
            cursor = await asyncio.to_thread(self.job.next_step, *self._last) if self._last else self.start
            if cursor is None:
                return END
            self.pump = self._produce(cursor)
        try:
            item = await asyncio.wait_for(self.queue.get(), heartbeat_s)
        except asyncio.TimeoutError:
            return HEARTBEAT
        if item is not END:
            self._last = item[0]
        return item

    @contextlib.contextmanager
    def sending(self, hold: StepHold):
        """While the step is written to the client (its hold released on the way out, whatever happens)."""
        self._writing = hold
        try:
            with hold:
                yield
        finally:
            self._writing = None

    def _shed(self) -> None:
        """Asked by the budget while others wait: give back what was prepared ahead, if blocked on the client."""
        if self._writing is None or self._shed_pending or self.account.held <= self._writing.nbytes:
            return
        if self.pump.done():  # finished (everything it made is queued) or failed: its END must stay
            return
        self._shed_pending = True
        held = self.account.held
        self.pump.cancel()  # its steps in preparation are released as the cancellation reaches it
        queued = self._drain()
        self._metrics.sheds.labels(self.job.spec.job).inc()
        log.info("a stream blocked on its client shed the steps it prepared ahead, for streams waiting for room",
                 extra={"job": self.job.spec.job, "seat": self.seat.name, "held_bytes": held,
                        "queued_steps": queued})

    def _drain(self) -> int:
        """Release every step waiting in the queue; how many there were."""
        count = 0
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not END:
                item[2].release()
                count += 1
        return count

    def failure(self) -> BaseException | None:
        pump = self.pump
        return pump.exception() if pump.done() and not pump.cancelled() else None

    def close(self) -> None:
        """The stream ended: stop preparing, and give back what waits in the queue."""
        self.pump.cancel()
        self._drain()
        self.account.close()
