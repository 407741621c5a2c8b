"""Which ranks stopped responding: when a collective times out, every rank still running reaches its own
timeout within moments of the others and says so in the process group's store; a rank that stopped (a SIGSTOP,
a hung kernel or driver, a dead host) never does. The ranks that time out so name the ones that stay silent,
instead of reporting only their own wait; so does a rank whose peer's connection broke (the first rank to time
out tears its connections down, and the others must not leave before the silent one is named). No thread of its
own: nothing beats in the background, and nothing can be caught half-way through a store call when the process
group is torn down."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

WAIT_S = 5.0  # how long the ranks that time out wait for each other's word before naming the silent
_FAILING = "packfeed/failing/{rank}"


class Liveness:
    def __init__(self, wait_s: float = WAIT_S):
        from torch.distributed.distributed_c10d import _get_default_store

        self.store, self.wait_s = _get_default_store(), wait_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def failing(self) -> None:
        """This rank is failing (a timeout, or a peer's failure seen as a broken connection): say so."""
        try:
            self.store.set(_FAILING.format(rank=self.rank), "1")
        except Exception:  # the store's host is gone: nobody is asking
            pass

    def silent_ranks(self) -> list[int]:
        """The ranks that have not said they are failing once `wait_s` has passed (or none, sooner)."""
        self.failing()
        deadline = time.monotonic() + self.wait_s
        while True:
            silent = [rank for rank in range(self.world) if not self.store.check([_FAILING.format(rank=rank)])]
            if not silent or time.monotonic() > deadline:
                return silent
            time.sleep(0.2)


def timed_out(error: BaseException) -> bool:
    """A collective's timeout, as gloo and NCCL word it."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def connection_lost(error: BaseException) -> bool:
    """A peer's connection broke: it died, or it timed out first and tore its connections down. Either way some
    rank may be silent, and a rank that stops here before the others name it would leave the run unexplained."""
    text = str(error).lower()
    return any(words in text for words in ("connection closed", "connection reset", "broken pipe"))


def name_the_silent(liveness: Liveness | None, timeout_s: float, describe: Callable[[int], str]):
    """Run the wrapped call; a collective timing out becomes an error naming the ranks that stopped."""
    def wrap(call):
        def run(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except Exception as error:
                if liveness is None:
                    raise
                lost = connection_lost(error)
                if not (timed_out(error) or lost):
                    liveness.failing()
                    raise
                silent = liveness.silent_ranks()
                if lost and not silent:  # the peer failed and said so: its own error says why
                    raise
                who = ", ".join(describe(rank) for rank in silent) or "no rank (all still answer: a slow collective?)"
                what = ("a peer closed its connection during a collective" if lost else
                        f"a collective waited over parallel.timeout_s = {timeout_s:g} s")
                raise RuntimeError(f"rank {liveness.rank}: {what}. Not responding: {who} (a stopped or hung "
                                   "process, or a dead host). The run stops; the newest checkpoint resumes it "
                                   "exactly") from error
        return run
    return wrap
