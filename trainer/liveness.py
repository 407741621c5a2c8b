"""Which ranks are alive: each rank counts up a key of its own in the process group's store from a thread of
its own, so a rank whose collective timed out can name the ranks that stopped (a SIGSTOP, a hung kernel or
driver, a dead host) instead of reporting only its own wait. A stopped process stops all its threads, so its
count stands still; counts, not clocks, so hosts need not agree on the time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

BEAT_S = 1.0
_KEY = "packfeed/alive/{rank}"
_FAILING = "packfeed/failing/{rank}"  # a rank that fails stops beating as it exits: it is not the silent one


class Liveness:
    def __init__(self, every_s: float = BEAT_S):
        from torch.distributed.distributed_c10d import _get_default_store

        self.store, self.every_s = _get_default_store(), every_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._stop = threading.Event()
        self.store.add(_KEY.format(rank=self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="packfeed-liveness", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.store.add(_KEY.format(rank=self.rank), 1)
            except Exception:  # the store's host is gone: the run is failing anyway
                return

    def _counts(self) -> dict[int, int]:
        keys = [_KEY.format(rank=rank) for rank in range(self.world)]
        return {rank: self.store.add(key, 0) if self.store.check([key]) else 0 for rank, key in enumerate(keys)}

    def failing(self) -> None:
        """This rank is failing (a timeout, or a peer's failure seen as a broken connection): it will stop
        beating as it exits, and the others must not take it for the silent one."""
        try:
            self.store.set(_FAILING.format(rank=self.rank), "1")
        except Exception:  # the store's host is gone: nobody is asking
            pass

    def silent_ranks(self) -> list[int]:
        """The ranks whose count stood still over three beats, but for those failing themselves and this one."""
        self.failing()
        before = self._counts()
        time.sleep(3 * self.every_s)
        after = self._counts()
        reported = {rank for rank in range(self.world) if self.store.check([_FAILING.format(rank=rank)])}
        return [rank for rank in range(self.world) if rank not in reported and after[rank] == before[rank]]

    def stop(self) -> None:
        """Before the process group goes: a beat still in the store when the store is torn down aborts the
        process ("terminate called without an active exception")."""
        self._stop.set()
        self._thread.join(timeout=10)


def timed_out(error: BaseException) -> bool:
    """A collective's timeout, as gloo and NCCL word it."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def name_the_silent(liveness: Liveness | None, timeout_s: float, describe: Callable[[int], str]):
    """Run the wrapped call; a collective timing out becomes an error naming the ranks that stopped."""
    def wrap(call):
        def run(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except Exception as error:
                if liveness is None:
                    raise
                if not timed_out(error):
                    liveness.failing()
                    raise
                silent = liveness.silent_ranks()
                who = ", ".join(describe(rank) for rank in silent) or "no rank (all still beat: a slow collective?)"
                raise RuntimeError(f"rank {liveness.rank}: a collective waited over parallel.timeout_s = "
                                   f"{timeout_s:g} s. Not responding: {who} (a stopped or hung process, or a dead "
                                   "host). The run stops; the newest checkpoint resumes it exactly") from error
        return run
    return wrap
