"""The shared memory budget: bytes of prepared packs held across all rank streams of a server, in one account
per stream, so that no stream waits on another's stall."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Waiter:
    order: int  # arrival, among the requests of accounts holding the same bytes
    account: Account
    nbytes: int
    granted: asyncio.Future


class MemoryBudget:
    """Bytes of prepared packs across all streams, counted from the moment a step is submitted for preparation
    (by an estimate from the index, corrected once it is ready) until its messages are handed to gRPC.

    Each stream reserves through its own `Account`. Three rules keep streams apart:
    - a stream that holds nothing is granted its next step at once, even beyond the limit: no stream ever
      waits on room another stream holds (a stalled trainer, a slow one, or one whose step is larger than the
      budget), so memory stays within the limit plus at most one step per open stream;
    - waiting requests are granted fewest-held-bytes first (arrival order among equals), each when it fits:
      a stream that already holds much waits behind one that holds little;
    - while a request waits, every stream holding more than its fair share (limit / open streams) and blocked
      writing to its client sheds what it prepared ahead (`Account(shed=...)`: its queued and in-preparation
      steps are released, and prepared again once its client reads on). A stalled stream so keeps only the
      step its client is receiving.
    """

    # What one sample's preparation (an image decoded, a text tokenised) may take even under a smaller budget,
    # so that a budget smaller than one step still prepares ordinary samples (their step alone, as above)
    WORKING_FLOOR = 64 << 20

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda held: None):
        self.limit, self.held, self._on_change = limit, 0, on_change  # on_change(held): e.g. a gauge
        self._waiters: list[_Waiter] = []
        self._accounts: set[Account] = set()
        self._arrivals = itertools.count()

    @property
    def working_limit(self) -> int:
        """Bytes preparing one sample may take: a sample needing more is skipped with its reason, not prepared."""
        return max(self.limit, self.WORKING_FLOOR)

    @property
    def fair_share(self) -> float:
        return self.limit / max(1, len(self._accounts))

    def account(self, shed: Callable[[], None] = lambda: None) -> Account:
        """A stream's account; `shed()` is asked to give back what the stream prepared ahead, when others wait
        and it holds more than its share (it may decline: a stream not blocked on its client sheds nothing)."""
        account = Account(self, shed)
        self._accounts.add(account)
        return account

    def _grantable(self, waiter: _Waiter) -> bool:
        return waiter.account.held == 0 or self.held + waiter.nbytes <= self.limit

    def _change(self, account: Account, delta: int) -> None:
        self.held += delta
        account.held += delta
        self._on_change(self.held)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            first = min(self._waiters, key=lambda waiter: (waiter.account.held, waiter.order))
            if not first.granted.done() and not self._grantable(first):
                return
            self._waiters.remove(first)
            if not first.granted.done():  # a cancelled request is dropped
                first.granted.set_result(None)
                self._change(first.account, first.nbytes)
                return  # _change granted whatever else fits

    def _reclaim(self, asking: Account) -> None:
        """A request waits: streams above their fair share shed what they prepared ahead (if they can)."""
        share = self.fair_share
        for account in sorted(self._accounts, key=lambda account: -account.held):
            if account is not asking and account.held > share:
                account.shed()


class Account:
    """One stream's bytes in the budget (`MemoryBudget.account`)."""

    def __init__(self, budget: MemoryBudget, shed: Callable[[], None]):
        self.budget, self.held, self.shed = budget, 0, shed

    def try_reserve(self, nbytes: int) -> bool:
        """Take room now if it is free and nobody is waiting in line; never blocks."""
        budget = self.budget
        if budget._waiters or budget.held + nbytes > budget.limit:
            return False
        budget._change(self, nbytes)
        return True

    async def reserve(self, nbytes: int) -> None:
        budget = self.budget
        if self.held == 0 or (not budget._waiters and budget.held + nbytes <= budget.limit):
            budget._change(self, nbytes)
            return
        waiter = _Waiter(next(budget._arrivals), self, nbytes, asyncio.get_running_loop().create_future())
        budget._waiters.append(waiter)
        budget._reclaim(self)
        budget._grant()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(nbytes)  # granted just as the stream was cancelled: give it back
            elif waiter in budget._waiters:
                budget._waiters.remove(waiter)
                budget._grant()  # a request it kept waiting may fit now
            raise

    def adjust(self, delta: int) -> None:
        """Correct a reservation to the bytes actually prepared."""
        self.budget._change(self, delta)

    def release(self, nbytes: int) -> None:
        self.budget._change(self, -nbytes)

    def close(self) -> None:
        """The stream ended: its share goes to the others (what it still holds is released by its holds)."""
        self.budget._accounts.discard(self)
        self.shed = lambda: None


class StepHold:
    """One prepared (or preparing) rank-step's claim on the server: its room in the memory budget and its place
    among the job's shared steps (`Job.steps`: replicas of a rank share a step while one of them holds it).

    The one owner of that claim: whoever is done with the step (the stream once gRPC took its last bytes, a
    stopped producer, a cancelled stream draining its queue) calls `release()`, and a second call does nothing,
    so no path releases twice or forgets to. `with hold:` releases it on the way out, whatever happens."""

    def __init__(self, account: Account, steps, key: tuple, nbytes: int):
        self.account, self.steps, self.key, self.nbytes = account, steps, key, nbytes
        self.released = False

    def resize(self, nbytes: int) -> None:
        """The step is ready: its room corrected from the estimate to the bytes it holds."""
        if not self.released:
            self.account.adjust(nbytes - self.nbytes)
            self.nbytes = nbytes

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.account.release(self.nbytes)
        self.steps.give_back(self.key)

    def __enter__(self) -> StepHold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
