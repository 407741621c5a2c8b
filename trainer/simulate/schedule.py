"""Pipeline schedules and the event-driven engine that runs a step's operations on GPUs.

Schedules give each pipeline rank its operations in order: ("F" | "B", chunk, microbatch). Chunk c of rank s
is virtual stage c * P + s (Megatron's interleaving); 1F1B and GPipe have one chunk.

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
from typing import Literal

Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")
Op = tuple[str, int, int]  # ("F" | "B", chunk, microbatch)


def one_f_one_b(stage: int, stages: int, m: int) -> list[Op]:
    warmup = min(stages - stage - 1, m)
    order: list[Op] = [("F", 0, j) for j in range(warmup)]
    for j in range(m):
        if warmup + j < m:
            order.append(("F", 0, warmup + j))
        order.append(("B", 0, j))
    return order


def gpipe(stage: int, stages: int, m: int) -> list[Op]:
    return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]


def interleaved_1f1b(stage: int, stages: int, m: int, chunks: int) -> list[Op]:
    """Megatron's interleaved 1F1B: microbatches in groups of P, each group through every chunk in turn."""
    if m % stages:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the stages ({stages})")
    total = m * chunks

    def op(kind: str, k: int) -> Op:
        chunk = (k // stages) % chunks
        return kind, chunk if kind == "F" else chunks - 1 - chunk, (k // (stages * chunks)) * stages + k % stages

    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def pipeline_order(schedule: str, stage: int, stages: int, m: int, chunks: int = 1) -> list[Op]:
    if schedule == "interleaved_1f1b":
        return interleaved_1f1b(stage, stages, m, chunks)
    if chunks != 1:
        raise ValueError(f"{schedule} runs one chunk per stage; virtual stages need interleaved_1f1b")
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, m)
    if schedule == "gpipe":
        return gpipe(stage, stages, m)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")


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

    def last_end(self, device: int, tasks: Sequence[Task], filler: bool | None = None) -> float:
        return self.last_task(device, tasks, filler)[1]

    def last_task(self, device: int, tasks: Sequence[Task], filler: bool | None = None) -> tuple[float, float]:
        """(start, end) of the device's task that ended last (of one kind when `filler` is given)."""
        kept = [(e, i) for _, e, i in self.intervals.get(device, []) if filler is None or tasks[i].filler == filler]
        if not kept:
            return 0.0, 0.0
        end, i = max(kept)
        return min(s for s, _, k in self.intervals[device] if k == i), end


_EPSILON = 1e-12


def run_tasks(tasks: Sequence[Task], orders: dict[int, list[int]]) -> Run:
    """Run every task; `orders[device]` lists that device's scheduled tasks in order (fillers are not listed)."""
    n = len(tasks)
    pending = [len(t.needs) for t in tasks]
    scheduled_pending = [sum(not tasks[j].filler for j, _ in t.needs) for t in tasks]
    urgent = [False] * n
    ready_at = [t.release for t in tasks]
    consumers: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for i, task in enumerate(tasks):
        for j, delay in task.needs:
            consumers[j].append((i, delay))
    end = [math.nan] * n
    remaining = [t.seconds for t in tasks]
    devices = sorted({t.device for t in tasks} | set(orders))
    position = dict.fromkeys(devices, 0)
    running: dict[int, tuple[int, float] | None] = dict.fromkeys(devices, None)
    pool: dict[int, list[int]] = {d: [] for d in devices}
    intervals: dict[int, list[tuple[float, float, int]]] = {d: [] for d in devices}
    events: list[tuple[float, int, int]] = []
    sequence = 0

    def wake(time: float, device: int) -> None:
        nonlocal sequence
        heapq.heappush(events, (time, sequence, device))
        sequence += 1

    def make_urgent(i: int, time: float) -> None:
        """Scheduled task i waits only on fillers: they go first on their devices."""
        for j, _ in tasks[i].needs:
            if tasks[j].filler and math.isnan(end[j]) and not urgent[j]:
                urgent[j] = True
                wake(max(time, ready_at[j]), tasks[j].device)

    def finish(i: int, time: float) -> None:
        end[i] = time
        for c, delay in consumers[i]:
            ready_at[c] = max(ready_at[c], time + delay)
            pending[c] -= 1
            if not tasks[i].filler:
                scheduled_pending[c] -= 1
                if scheduled_pending[c] == 0 and pending[c] > 0 and not tasks[c].filler:
                    wake(time, tasks[c].device)  # if it is that device's next task, its fillers become urgent
            if pending[c] == 0:
                if tasks[c].filler:
                    pool[tasks[c].device].append(c)
                wake(ready_at[c], tasks[c].device)

    for i, task in enumerate(tasks):
        if pending[i] == 0 and task.filler:
            pool[task.device].append(i)
    for d in devices:
        wake(0.0, d)
    for i, task in enumerate(tasks):
        if pending[i] == 0 and task.release > 0:
            wake(task.release, task.device)

    while events:
        time, _, d = heapq.heappop(events)
        current = running[d]
        if current is not None:
            i, start = current
            if not tasks[i].filler:
                if time < start + tasks[i].seconds - _EPSILON:
                    continue  # busy with a scheduled task until its end event
                finish(i, start + tasks[i].seconds)
                time = max(time, start + tasks[i].seconds)
            else:
                done = min(time - start, remaining[i])
                remaining[i] -= done
                if done > 0:
                    intervals[d].append((start, start + done, i))
                if remaining[i] <= _EPSILON:
                    pool[d].remove(i)
                    finish(i, start + done)
            running[d] = None
        order = orders.get(d, [])
        if position[d] < len(order):
            nxt = order[position[d]]
            if scheduled_pending[nxt] == 0 and pending[nxt] > 0:
                make_urgent(nxt, time)
        ready = [i for i in pool[d] if ready_at[i] <= time + _EPSILON]
        pressing = [i for i in ready if urgent[i]]
        if pressing:
            i = min(pressing, key=lambda k: (tasks[k].priority, k))
            running[d] = (i, time)
            wake(time + remaining[i], d)
            continue
        if position[d] < len(order):
            nxt = order[position[d]]
            if pending[nxt] == 0 and ready_at[nxt] <= time + _EPSILON:
                running[d] = (nxt, time)
                intervals[d].append((time, time + tasks[nxt].seconds, nxt))
                position[d] += 1
                wake(time + tasks[nxt].seconds, d)
                continue
        if ready:
            i = min(ready, key=lambda k: (tasks[k].priority, k))
            running[d] = (i, time)
            wake(time + remaining[i], d)

    unfinished = [i for i in range(n) if math.isnan(end[i])]
    if unfinished:
        raise RuntimeError(f"{len(unfinished)} task(s) never ran (first: {tasks[unfinished[0]]}): the schedule's "
                           "dependencies form a cycle")
    for d in devices:
        intervals[d].sort()
    return Run(end, intervals)
