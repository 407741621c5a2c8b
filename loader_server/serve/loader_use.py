"""The loader CPU this server actually uses (`/status`, Prometheus): the worker CPU seconds of the rank-steps it
sent in the last minute over that minute (cores used), per GPU it fed (each stream's seat is a GPU: a DP rank, a
pipeline stage, a CP lane), and each step's preprocessing tail, the slowest of its rank-steps' CPU over their
mean, over the ranks this server prepared for it. With cost-aware sizing (`packfeed stats --gpus`) these say
whether the cores given are the cores needed."""

from __future__ import annotations

import collections
import threading
import time

WINDOW_S = 60.0  # what "now" averages over
KEPT_STEPS = 64  # steps per job whose rank-steps are still being counted


class LoaderUse:
    """Counts of one server's delivered rank-steps; thread-safe (the status page reads from its own thread)."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._sent: collections.deque = collections.deque()  # (time, cpu seconds, seat)
        self._steps: dict[str, collections.OrderedDict] = {}  # job -> (epoch, step) -> {rank: cpu seconds}
        self._ranks: dict[str, collections.Counter] = {}  # job -> rank -> its primary streams open here
        self.last_tail: dict[str, float] = {}
        self._lock = threading.Lock()

    def streaming(self, job: str, rank: int, change: int) -> None:
        """A rank's primary stream opened here (+1) or ended (-1): the ranks a step's tail waits for."""
        with self._lock:
            ranks = self._ranks.setdefault(job, collections.Counter())
            ranks[rank] += change
            if ranks[rank] <= 0:
                del ranks[rank]

    def sent(self, job: str, seat: str, rank: int, position: tuple[int, int], cpu_seconds: float,
             primary: bool) -> float | None:
        """A rank-step went out to `seat`; returns the step's tail once every rank streaming here for the job has
        sent it (else None). A replica's copy (not `primary`) feeds a GPU but costs nothing again."""
        now = self.clock()
        with self._lock:
            self._sent.append((now, cpu_seconds if primary else 0.0, (job, seat)))
            self._expire(now)
            if not primary:
                return None
            ranks = self._ranks.get(job, {})
            steps = self._steps.setdefault(job, collections.OrderedDict())
            step = steps.setdefault(position, {})
            step[rank] = cpu_seconds
            while len(steps) > KEPT_STEPS:
                steps.popitem(last=False)
            if any(other not in step for other in ranks):
                return None
            del steps[position]
            mean = sum(step.values()) / len(step)
            tail = max(step.values()) / mean if mean > 0 else 1.0
            self.last_tail[job] = tail
            return tail

    def _expire(self, now: float) -> None:
        while self._sent and self._sent[0][0] < now - self.window_s:
            self._sent.popleft()

    def forget(self, job: str) -> None:
        with self._lock:
            self._steps.pop(job, None), self._ranks.pop(job, None), self.last_tail.pop(job, None)

    def snapshot(self) -> dict[str, float | int | None]:
        """Cores used over the window, the GPUs fed in it, cores per GPU, and each job's last step tail."""
        now = self.clock()
        with self._lock:
            self._expire(now)
            seconds = sum(cpu for _, cpu, _ in self._sent)
            gpus = len({seat for _, _, seat in self._sent})
            span = min(self.window_s, max(now - self._sent[0][0], 1.0)) if self._sent else self.window_s
            tails = dict(self.last_tail)
        cores = seconds / span
        return {"cores_used": round(cores, 3), "gpus_fed": gpus,
                "cores_per_gpu": round(cores / gpus, 3) if gpus else None,
                "step_tail": {job: round(tail, 3) for job, tail in tails.items()}}
