"""The event-driven engine that runs a step's operations on GPUs, in the orders of the pipeline schedules
(`packfeed.trainer.parallel.schedules`: each rank's ("F" | "B", chunk, microbatch) in turn).

The engine runs two kinds of tasks:
- scheduled tasks, in their device's order, each as soon as its inputs have arrived;
- filler tasks (encoder work placed by `bubbles` or run by encoder GPUs), preemptible at any instant (Optimus
  splits them into kernels): a device runs the ready filler of lowest priority whenever its next scheduled
  task is not ready, and yields the moment it is. A filler becomes urgent when a device's next scheduled task has
  everything else it needs and waits only on fillers: urgent fillers run before the device's own scheduled work (the
  encoder is then on the critical path, as it must be when the bubbles are too small or come too late).
A dependency carries a delay (the transfer after the producer ends). No device runs two tasks at once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

@dataclass
class Task:
    device: int
    seconds: float
    label: str  # what the timeline shows: "F", "B", "EF" (encoder forward), "EB", ...
    microbatch: int = 0
    chunk: int = 0
    filler: bool = False
    priority: float = 0.0  # fillers: lowest first
    release: float = 0.0  # not before this time
    needs: list[tuple[int, float]] = field(default_factory=list)  # (task, delay after it ends)


@dataclass
class Run:
    end: list[float]
    intervals: dict[int, list[tuple[float, float, int]]]  # device -> (start, end, task), in time order

    def busy(self, device: int) -> float:
        return sum(e - s for s, e, _ in self.intervals.get(device, []))

    def last_task(self, device: int, tasks: Sequence[Task], filler: bool | None = None) -> tuple[float, float]:
        """(start, end) of the device's task that ended last (of one kind when `filler` is given)."""
        kept = [(e, i) for _, e, i in self.intervals.get(device, []) if filler is None or tasks[i].filler == filler]
        if not kept:
            return 0.0, 0.0
        end, i = max(kept)
        return min(s for s, _, k in self.intervals[device] if k == i), end


_EPSILON = 1e-12


class _Engine:
    """The event loop of `run_tasks`. Each device runs one task at a time; a task's `remaining` work drains at
    the engine's rate (1, or cores / busy devices when devices share `cores` processors)."""

    def __init__(self, tasks: Sequence[Task], orders: dict[int, list[int]], cores: float | None):
        n = len(tasks)
        self.tasks, self.orders, self.cores = tasks, orders, cores
        self.pending = [len(t.needs) for t in tasks]
        self.scheduled_pending = [sum(not tasks[j].filler for j, _ in t.needs) for t in tasks]
        self.urgent = [False] * n
        self.ready_at = [t.release for t in tasks]
        self.consumers: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for i, task in enumerate(tasks):
            for j, delay in task.needs:
                self.consumers[j].append((i, delay))
        self.end = [math.nan] * n
        self.remaining = [t.seconds for t in tasks]
        self.devices = sorted({t.device for t in tasks} | set(orders))
        self.position = dict.fromkeys(self.devices, 0)
        self.running: dict[int, tuple[int, float]] = {}  # device -> (task, running since)
        self.pool: dict[int, list[int]] = {d: [] for d in self.devices}
        self.intervals: dict[int, list[tuple[float, float, int]]] = {d: [] for d in self.devices}
        self.events: list[tuple[float, int, int]] = []
        self.sequence = 0
        self.rate = 1.0
        self.due: dict[int, float] = {}  # shared processors: the end queued for each device's running task

    def wake(self, time: float, device: int) -> None:
        heapq.heappush(self.events, (time, self.sequence, device))
        self.sequence += 1

    def make_urgent(self, i: int, time: float) -> None:
        """Scheduled task i waits only on fillers: they go first on their devices."""
        for j, _ in self.tasks[i].needs:
            if self.tasks[j].filler and math.isnan(self.end[j]) and not self.urgent[j]:
                self.urgent[j] = True
                self.wake(max(time, self.ready_at[j]), self.tasks[j].device)

    def finish(self, i: int, time: float) -> None:
        self.end[i] = time
        for c, delay in self.consumers[i]:
            self.ready_at[c] = max(self.ready_at[c], time + delay)
            self.pending[c] -= 1
            if not self.tasks[i].filler:
                self.scheduled_pending[c] -= 1
                if self.scheduled_pending[c] == 0 and self.pending[c] > 0 and not self.tasks[c].filler:
                    self.wake(time, self.tasks[c].device)  # if it is that device's next task, its fillers become urgent
            if self.pending[c] == 0:
                if self.tasks[c].filler:
                    self.pool[self.tasks[c].device].append(c)
                self.wake(self.ready_at[c], self.tasks[c].device)

    def settle(self, d: int, time: float) -> None:
        """Account the work device d's task did up to `time`; finish it if that was all."""
        i, since = self.running[d]
        done = min((time - since) * self.rate, self.remaining[i])
        self.remaining[i] -= done
        if time > since:
            self.intervals[d].append((since, time, i))
        self.running[d] = (i, time)
        if self.remaining[i] <= _EPSILON:
            del self.running[d]
            if self.tasks[i].filler:
                self.pool[d].remove(i)
            self.finish(i, time)

    def choose(self, d: int, time: float) -> int | None:
        """What device d runs from `time`: an urgent filler, its next scheduled task, another filler, or None."""
        order = self.orders.get(d, [])
        nxt = order[self.position[d]] if self.position[d] < len(order) else None
        if nxt is not None and self.scheduled_pending[nxt] == 0 and self.pending[nxt] > 0:
            self.make_urgent(nxt, time)
        ready = [i for i in self.pool[d] if self.ready_at[i] <= time + _EPSILON]
        pressing = [i for i in ready if self.urgent[i]]
        if pressing:
            return min(pressing, key=lambda k: (self.tasks[k].priority, k))
        if nxt is not None and self.pending[nxt] == 0 and self.ready_at[nxt] <= time + _EPSILON:
            self.position[d] += 1
            return nxt
        return min(ready, key=lambda k: (self.tasks[k].priority, k)) if ready else None

    def step(self, time: float, d: int) -> bool:
        """Device d at `time`: account its running task, and choose again unless a scheduled task runs on.
        True when it starts a task now."""
        current = self.running.get(d)
        if current is not None:
            i, since = current
            if not self.tasks[i].filler and self.cores is None and time < since + self.remaining[i] - _EPSILON:
                return False  # a scheduled task runs to its end, whose event is queued
            self.settle(d, time)
            if d in self.running:
                if not self.tasks[i].filler:
                    return False
                del self.running[d]  # a filler yields: the choice is made again
        chosen = self.choose(d, time)
        if chosen is None:
            return False
        self.running[d] = (chosen, time)
        return True

    def run(self) -> Run:
        for i, task in enumerate(self.tasks):
            if self.pending[i] == 0 and task.filler:
                self.pool[task.device].append(i)
        for d in self.devices:
            self.wake(0.0, d)
        for i, task in enumerate(self.tasks):
            if self.pending[i] == 0 and task.release > 0:
                self.wake(task.release, task.device)
        while self.events:
            time, _, d = heapq.heappop(self.events)
            shared = self.cores is not None
            if shared:  # every running task drains at the old rate until now
                for other in list(self.running):
                    if other != d:
                        self.settle(other, time)
            started = self.step(time, d)
            if shared:  # the rate changes with the busy devices: ends move (each queued once per change)
                self.rate = min(1.0, self.cores / max(len(self.running), 1))
                for other, (i, _) in self.running.items():
                    due = time + self.remaining[i] / self.rate
                    if abs(self.due.get(other, -1.0) - due) > _EPSILON:
                        self.due[other] = due
                        self.wake(due, other)
            elif started:
                self.wake(time + self.remaining[self.running[d][0]], d)
        unfinished = [i for i in range(len(self.tasks)) if math.isnan(self.end[i])]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} task(s) never ran (first: {self.tasks[unfinished[0]]}): the "
                               "schedule's dependencies form a cycle")
        for d in self.devices:
            self.intervals[d].sort()
        return Run(self.end, self.intervals)


def run_tasks(tasks: Sequence[Task], orders: dict[int, list[int]], cores: float | None = None) -> Run:
    """Run every task; `orders[device]` lists that device's scheduled tasks in order (fillers are not listed).
    `cores`: the devices share that many processors (CPU processes on one host): a task's work then drains at
    min(1, cores / busy devices) — how the simulator is checked against a CPU run with more ranks than cores."""
    return _Engine(tasks, orders, cores).run()
