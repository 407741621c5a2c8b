"""The shared memory budget: bytes of prepared packs held across all rank streams of a server."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable


class MemoryBudget:
    """Bytes of prepared packs across all streams, counted from the moment a step is submitted for preparation
    (by an estimate from the index, corrected once it is ready) until its messages are handed to gRPC.

    Requests are granted in arrival order, each when it fits under the limit; when nothing at all is held the
    first waiter is granted even beyond the limit, so a step larger than the budget still goes out, alone.
    Every stream therefore progresses, and memory stays within the budget plus at most one step. A stream
    whose client stops reading keeps what it holds, so size the budget for at least one step per rank stream
    if no rank may ever wait for another's room.
    """

    # What one sample's preparation (an image decoded, a text tokenised) may take even under a smaller budget,
    # so that a budget smaller than one step still prepares ordinary samples (their step alone, as above)
    WORKING_FLOOR = 64 << 20

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda held: None):
        self.limit, self.held, self._on_change = limit, 0, on_change  # on_change(held): e.g. a gauge
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    @property
    def working_limit(self) -> int:
        """Bytes preparing one sample may take: a sample needing more is skipped with its reason, not prepared."""
        return max(self.limit, self.WORKING_FLOOR)

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    def _change(self, delta: int) -> None:
        self.held += delta
        self._on_change(self.held)
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, granted = self._waiters.popleft()
            if not granted.done():
                self.held += nbytes
                self._on_change(self.held)
                granted.set_result(None)

    def try_reserve(self, nbytes: int) -> bool:
        """Take room now if it is free and nobody is waiting in line; never blocks."""
        if self._waiters or not self._fits(nbytes):
            return False
        self._change(nbytes)
        return True

    async def reserve(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._change(nbytes)
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (nbytes, granted)
        self._waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._change(-nbytes)  # granted just as the stream was cancelled: give it back
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise

    def adjust(self, delta: int) -> None:
        """Correct a reservation to the bytes actually prepared."""
        self._change(delta)

    def release(self, nbytes: int) -> None:
        self._change(-nbytes)


class StepHold:
    """One prepared (or preparing) rank-step's claim on the server: its room in the memory budget and its place
    among the job's shared steps (`Job.steps`: replicas of a rank share a step while one of them holds it).

    The one owner of that claim: whoever is done with the step (the stream once gRPC took its last bytes, a
    stopped producer, a cancelled stream draining its queue) calls `release()`, and a second call does nothing,
    so no path releases twice or forgets to. `with hold:` releases it on the way out, whatever happens."""

    def __init__(self, budget: MemoryBudget, steps, key: tuple, nbytes: int):
        self.budget, self.steps, self.key, self.nbytes = budget, steps, key, nbytes
        self.released = False

    def resize(self, nbytes: int) -> None:
        """The step is ready: its room corrected from the estimate to the bytes it holds."""
        if not self.released:
            self.budget.adjust(nbytes - self.nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.budget.release(self.nbytes)
        self.steps.give_back(self.key)

    def __enter__(self) -> StepHold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
