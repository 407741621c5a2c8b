"""Asynchronous RL: what the synchronous loop, async + drop, async + wait and async + partial rollouts give a trainer
on a rollout-length mix with a long tail (BENCHMARKS "Asynchronous RL").

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_async_rl.py -m benchmark

Workload (the same rollouts, by seed, for every loop): rollout lengths log-uniform in 100-4,096 tokens, and 1.5% of
them 20-50x longer (agentic and long-reasoning rollouts). A step trains STEP samples; the trainer's step takes the
cost model's LLM seconds of its samples (`CostModel.from_shapes`, at TRAINER_FLOPS).

1. Simulated, in virtual time, over Packfeed's own live-job code (`LiveSteps` on a spool in /dev/shm: its
   admission, step formation, partial rollouts and claims decide, not a model of them): SLOTS generation slots
   decode DECODE tokens/s each.
   - synchronous: the slots generate a step's STEP rollouts with policy v, the trainer trains, and again (verl's
     and TRL's default loop): every step waits for its slowest rollout.
   - async + drop: the slots generate without pause; a step forms from what arrived; a rollout more than
     MAX_STALENESS versions behind its step is dropped.
   - async + wait: each rollout is reserved before it starts (staleness wait); a step waits for what is due at it.
   - async + partial: as wait, and at every weight update each rollout in flight is put unfinished and claimed
     again, continued with the new weights (docs/live.md "Partial rollouts").
2. On CPU, small: the same loops through a real server (`packfeed serve --live-spool`), producer threads with
   `Producer.reserve / put / claim` whose generation is a sleep of the rollout's decode time, and DP 2 trainer
   ranks `PackStream` threads whose training is a sleep of the step's cost: wall clock, scaled down.

Reported per loop: the trainer's idle fraction, rollouts trained per second, and of the long rollouts whose
generation ended within the run the share trained (one still pending at the end is not) and how many were dropped;
ROUNDS seeds, the median and the range.
"""

from __future__ import annotations

import heapq
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from packfeed.v1.options import CostModel, PlanConfig

pytestmark = pytest.mark.benchmark
STEP, SLOTS, DECODE, STEPS, MAX_STALENESS, ROUNDS = 64, 64, 400.0, 300, 2, 3
SCALE = 64  # real tokens per spooled token of a simulated rollout
TRAINER_FLOPS = 2.5e15  # FLOP/s the trainer sustains on the cost model's units
LONG_SHARE, LONG_FACTOR = 0.015, (20, 50)
MODES = ("synchronous", "async + drop", "async + wait", "async + partial")


def rollout_lengths(seed: int, n: int = 20000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(100), np.log(4096), n))
    long = rng.random(n) < LONG_SHARE
    lengths[long] *= rng.uniform(*LONG_FACTOR, long.sum())
    return lengths.astype(np.int64)


def long_threshold() -> int:
    return 4096 * LONG_FACTOR[0] // 2  # every long rollout is over it, no short one is


def train_seconds(tokens: np.ndarray) -> float:
    costs = CostModel.from_shapes()
    return float((costs.llm_linear * tokens + costs.llm_quadratic * tokens.astype(np.float64) ** 2).sum()
                 / TRAINER_FLOPS)


@dataclass
class Outcome:
    seconds: float
    idle: float
    trained: int
    long_generated: int
    long_trained: int
    long_dropped: int

    def figures(self) -> dict:
        return {"idle_fraction": self.idle / self.seconds, "rollouts_per_s": self.trained / self.seconds,
                "long_trained_share": self.long_trained / max(1, self.long_generated),
                "long_dropped": self.long_dropped}


# -- 1. simulated over LiveSteps -----------------------------------------------------------------------------


def synchronous(lengths: np.ndarray, decode: float, slots: int, step: int, steps: int) -> Outcome:
    """Each step: its rollouts over the slots (each slot takes the next), then the trainer; nothing overlaps."""
    now = idle = 0.0
    long = long_threshold()
    for number in range(steps):
        batch = lengths[number * step:(number + 1) * step]
        free = [0.0] * slots
        for length in batch:
            heapq.heapreplace(free, free[0] + length / decode)
        generate = max(free)
        idle += generate
        now += generate + train_seconds(batch)
    trained = lengths[:steps * step]
    return Outcome(now, idle, len(trained), int((trained > long).sum()), int((trained > long).sum()), 0)


@dataclass(order=True)
class Event:
    at: float
    order: int
    kind: str = field(compare=False)
    slot: int = field(compare=False, default=-1)


class Simulation:
    """SLOTS producers and one trainer in virtual time, over a real `LiveSteps` (what it grants, forms, drops and
    hands out is the product's own decision)."""

    def __init__(self, mode: str, lengths: np.ndarray, folder: Path, decode: float, slots: int, step: int,
                 steps: int):
        from packfeed.server.live.spool import Spool
        from packfeed.server.live.step_plan import live_fingerprint
        from packfeed.server.live.steps import LiveSteps

        config = PlanConfig(dp=1, live=True, step_samples=step, max_staleness=MAX_STALENESS,
                            staleness="drop" if mode == "async + drop" else "wait", token_cap=1 << 20,
                            vision_cap=1 << 20)
        self.steps = LiveSteps(Spool(folder, mode, json.dumps(config.to_dict())), config, 0,
                               live_fingerprint(config, 0, "bench"), load=True)
        self.mode, self.lengths, self.decode, self.slots, self.target = mode, lengths, decode, slots, steps
        self.events: list[Event] = []
        self.now, self.next_rollout, self.order = 0.0, 0, 0
        self.running: dict[int, dict] = {}  # slot -> its rollout: id, length, done tokens, version, since
        self.waiting: set[int] = set()  # slots waiting for a grant (retried at the next version)
        self.length_of: dict[str, int] = {}
        self.finished: set[str] = set()  # rollouts whose generation ended (put finished)
        self.trainer_busy_until, self.trained_steps, self.idle, self.idle_since = 0.0, 0, 0.0, 0.0
        self.partial = mode == "async + partial"

    def push(self, at: float, kind: str, slot: int = -1) -> None:
        self.order += 1
        heapq.heappush(self.events, Event(at, self.order, kind, slot))

    def run(self) -> Outcome:
        for slot in range(self.slots):
            self.start(slot)
        self.idle_since = 0.0
        while self.trained_steps < self.target and self.events:
            event = heapq.heappop(self.events)
            self.now = event.at
            if event.kind == "done":
                self.finish(event.slot, event.at)
            elif event.kind == "trained":
                self.trained()
            self.train_if_ready()
        return self.outcome()

    # producers (a rollout is spooled at 1/SCALE of its tokens, each spooled token standing for SCALE real ones:
    # its cost is its real length, kept beside)

    def start(self, slot: int) -> None:
        """The slot's next rollout, reserved first under wait (or a claimed unfinished one, partial rollouts)."""
        version = self.steps.versions.current
        if self.partial and self.claim(slot, version):
            return
        rollout_id = f"r{self.next_rollout}"
        if self.mode != "async + drop":
            granted, _, _ = self.steps.reserve(f"s{slot}", rollout_id, 1, version)
            if not granted:
                self.waiting.add(slot)
                return
        length = int(self.lengths[self.next_rollout % len(self.lengths)])
        self.next_rollout += 1
        self.length_of[rollout_id] = length
        self.running[slot] = {"id": rollout_id, "done": 0, "prefix": np.zeros(0, np.int64), "part": -1,
                              "version": version, "since": self.now, "ends": self.now + length / self.decode}
        self.push(self.running[slot]["ends"], "done", slot)

    def claim(self, slot: int, version: int) -> bool:
        row, arrays, _ = self.steps.claim_rollout(f"s{slot}", version)
        if row is None:
            return False
        prefix = arrays["token_versions"]
        done = len(prefix) * SCALE
        ends = self.now + max(0, self.length_of[row.id] - done) / self.decode
        self.running[slot] = {"id": row.id, "done": done, "prefix": prefix, "part": row.part, "version": version,
                              "since": self.now, "ends": ends}
        self.push(ends, "done", slot)
        return True

    def finish(self, slot: int, at: float) -> None:
        rollout = self.running.get(slot)
        if rollout is None or rollout["ends"] != at:
            return  # the rollout it ended was interrupted and put unfinished: this completion was cancelled
        del self.running[slot]
        self.put(slot, rollout, self.length_of[rollout["id"]], unfinished=False)
        self.finished.add(rollout["id"])
        self.start(slot)

    def put(self, slot: int, rollout: dict, real_tokens: int, unfinished: bool) -> None:
        """The rollout's next part as spooled: the claimed prefix exactly, then its new tokens at its version."""
        from packfeed.server.live.samples import LiveSample

        n = max(len(rollout["prefix"]) + (not unfinished), real_tokens // SCALE, 1)
        versions = np.concatenate([rollout["prefix"], np.full(n - len(rollout["prefix"]), rollout["version"])])
        sample = LiveSample(rollout["id"], np.full(n, 5, np.int32), np.ones(n, np.uint8), {}, rollout["id"],
                            int(versions.max()), "", [], [], loss_tokens=n, unfinished=unfinished,
                            part=rollout["part"] + 1, token_versions=versions.astype(np.int64))
        sample.digest = sample.content_digest()
        if unfinished:
            sample.covers = sample.prefix_digest(n)
        outcome = self.steps.put([sample], producer=f"s{slot}")[0]
        assert outcome[0] == "accepted", outcome

    # the trainer

    def train_if_ready(self) -> None:
        if self.now < self.trainer_busy_until or self.steps.formed <= self.trained_steps:
            return
        self.idle += self.now - self.idle_since
        members = self.steps.record(self.trained_steps)["members"]
        tokens = np.array([self.length_of[m] for m in members], np.int64)
        self.trainer_busy_until = self.now + train_seconds(tokens)
        self.push(self.trainer_busy_until, "trained")

    def trained(self) -> None:
        self.steps.release(self.trained_steps)
        self.trained_steps += 1
        self.idle_since = self.now
        if self.partial:  # the new weights interrupt every rollout in flight: each is put unfinished, claimed again
            for slot, rollout in list(self.running.items()):
                done = rollout["done"] + int((self.now - rollout["since"]) * self.decode)
                if done // SCALE <= len(rollout["prefix"]) or done >= self.length_of[rollout["id"]]:
                    continue  # nothing new to keep yet (or done at this instant)
                del self.running[slot]
                self.put(slot, rollout, done, unfinished=True)
        for slot in sorted(self.waiting | set(range(self.slots)) - set(self.running)):
            self.waiting.discard(slot)
            if slot not in self.running:
                self.start(slot)

    def outcome(self) -> Outcome:
        long = long_threshold()
        trained = [m for s in range(self.trained_steps) for m in self.steps.record(s)["members"]]
        dropped = [m for s in range(self.steps.formed) for m in self.steps.record(s)["dropped"]]
        generated = [r for r in self.finished if self.length_of[r] > long]
        return Outcome(self.now, self.idle, len(trained), len(generated),
                       sum(self.length_of[m] > long for m in trained), sum(self.length_of[m] > long for m in dropped))


def simulate(mode: str, seed: int) -> Outcome:
    lengths = rollout_lengths(seed)
    if mode == "synchronous":
        return synchronous(lengths, DECODE, SLOTS, STEP, STEPS)
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        return Simulation(mode, lengths, folder, DECODE, SLOTS, STEP, STEPS).run()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary(rounds: list[dict]) -> dict:
    return {name: (float(np.median([r[name] for r in rounds])), float(min(r[name] for r in rounds)),
                   float(max(r[name] for r in rounds))) for name in rounds[0]}


def show(title: str, results: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"{'loop':<18}{'trainer idle':>22}{'rollouts/s':>26}{'long trained':>22}{'long dropped':>16}")
    for mode, figures in results.items():
        idle, rate, share, dropped = (figures[k] for k in ("idle_fraction", "rollouts_per_s", "long_trained_share",
                                                           "long_dropped"))
        print(f"{mode:<18}{idle[0]:>9.1%} ({idle[1]:.1%}-{idle[2]:.1%}){rate[0]:>12.3f} ({rate[1]:.3f}-{rate[2]:.3f})"
              f"{share[0]:>10.0%} ({share[1]:.0%}-{share[2]:.0%}){dropped[0]:>8.0f} ({dropped[1]:.0f}-{dropped[2]:.0f})")
    base = results["synchronous"]["rollouts_per_s"][0]
    print("throughput over the synchronous loop: " + ", ".join(
        f"{mode} {figures['rollouts_per_s'][0] / base:.2f}x" for mode, figures in results.items()))


def test_asynchronous_rl_simulated_over_live_steps():
    results = {mode: summary([simulate(mode, seed).figures() for seed in range(ROUNDS)]) for mode in MODES}
    show(f"simulated: {SLOTS} slots x {DECODE:g} tokens/s, steps of {STEP}, {STEPS} steps, max_staleness "
         f"{MAX_STALENESS}, {ROUNDS} seeds (median (range))", results)
    partial, sync = results["async + partial"], results["synchronous"]
    assert partial["long_dropped"][2] == 0 and results["async + wait"]["long_dropped"][2] == 0
    assert partial["rollouts_per_s"][0] >= 2 * sync["rollouts_per_s"][0]


# -- 2. on CPU, small, through a real server -----------------------------------------------------------------

CPU_SLOTS, CPU_STEP, CPU_STALENESS, TIME_SCALE, CPU_SECONDS = 16, 16, 2, 40.0, 20.0


class Served:
    """One loop through `packfeed serve`: CPU_SLOTS producer threads (each a `Producer`), DP 2 trainer threads (each
    a `PackStream` rank), for CPU_SECONDS of wall clock; time runs TIME_SCALE times faster than the simulation's."""

    def __init__(self, mode: str, seed: int, target: str, spool: Path):
        self.mode, self.target, self.spool = mode, target, spool
        self.job = f"bench-{mode.replace(' ', '').replace('+', '-')}-{seed}"
        self.plan = PlanConfig(dp=2, microbatches=1, live=True, step_samples=CPU_STEP, token_cap=1 << 20,
                               vision_cap=1 << 20, max_staleness=None if mode == "synchronous" else CPU_STALENESS,
                               staleness="wait" if mode in ("async + wait", "async + partial") else "drop")
        self.lengths, self.next, self.lock = rollout_lengths(seed), 0, threading.Lock()
        self.length_of: dict[str, int] = {}
        self.finished: set[str] = set()
        self.stop = threading.Event()
        self.version = 0  # the trainers' (the synchronous loop's producers wait for it)
        self.trained: list[str] = []

    def take(self, within: int | None = None) -> tuple[str, int] | None:
        """The next rollout (None: `within` given and the next is not below it: the synchronous loop's batch)."""
        with self.lock:
            if within is not None and self.next >= within:
                return None
            number, self.next = self.next, self.next + 1
        rollout_id = f"r{number}"
        self.length_of[rollout_id] = int(self.lengths[number % len(self.lengths)])
        return rollout_id, self.length_of[rollout_id]

    @staticmethod
    def sample(rollout_id: str, real: int, version: int, **fields) -> dict:
        n = max(1, real // SCALE)
        return {"id": rollout_id, "tokens": np.full(n, 300, np.int32), "group": rollout_id, "policy_version": version,
                **fields}

    def generate(self, producer, seconds: float, version: int) -> float:
        """Sleep the decode time; with partial rollouts, stop when the trainers publish new weights: the seconds
        generated."""
        started = time.monotonic()
        while not self.stop.is_set():
            left = seconds - (time.monotonic() - started)
            if left <= 0:
                return seconds
            if self.mode == "async + partial" and producer.policy_version != version:
                return time.monotonic() - started
            time.sleep(min(left, 0.01))
        return time.monotonic() - started

    def produce(self, slot: int) -> None:
        from packfeed.client import Producer
        from packfeed.client.stream.channel import PackfeedError

        decode = DECODE * TIME_SCALE
        producer = Producer(self.target, job=self.job, name=f"slot-{slot}", heartbeat_s=0.25, open_wait_s=60,
                            full_wait_s=5)
        try:
            while not self.stop.is_set():
                if self.mode == "synchronous":  # a step's rollouts with policy v, then wait for v + 1
                    version = self.version
                    taken = self.take(within=(version + 1) * CPU_STEP)
                    if taken is None:
                        time.sleep(0.002)
                        continue
                    rollout_id, real = taken
                    self.generate(producer, real / decode, version)
                    producer.put(self.sample(rollout_id, real, version))
                    self.finished.add(rollout_id)
                    continue
                rollout = producer.claim(wait_s=0) if self.mode == "async + partial" else None
                if rollout is None:
                    rollout_id, real = self.take()
                    if self.mode != "async + drop":
                        while not self.stop.is_set():
                            try:
                                version = producer.reserve(group=rollout_id, samples=1, wait_s=0.3).policy_version
                                break
                            except PackfeedError:
                                continue
                    version = producer.policy_version
                    done_tokens, prefix = 0, None
                else:
                    rollout_id, real, version = rollout.id, self.length_of[rollout.id], producer.policy_version
                    done_tokens, prefix = len(rollout.tokens) * SCALE, rollout
                spent = self.generate(producer, (real - done_tokens) / decode, version)
                if self.stop.is_set():
                    return
                now_tokens = min(real, done_tokens + int(spent * decode))
                finished = now_tokens >= real or self.mode != "async + partial"
                n_new = max(0, max(1, now_tokens // SCALE) - (0 if prefix is None else len(prefix.tokens)))
                if not finished and n_new == 0:
                    continue  # nothing new to keep: claimed again and continued
                if prefix is None:
                    fields = {"unfinished": True, "token_versions": np.full(max(1, now_tokens // SCALE), version)} \
                        if not finished else {}
                    producer.put(self.sample(rollout_id, now_tokens if not finished else real, version, **fields))
                else:
                    n_new = max(n_new, 1 if finished else 0)
                    producer.put(prefix.continued(np.full(n_new, 300), version, finished=finished))
                if finished:
                    self.finished.add(rollout_id)
        except PackfeedError:
            pass  # the job ended while this producer waited
        finally:
            producer.close()

    def train(self, rank: int, out: dict) -> None:
        from packfeed.client import PackStream

        stream = PackStream(self.target, job=self.job, rank=rank, plan=self.plan)
        started = time.monotonic()
        for step in stream:
            keys = [k for pack in step.packs for k in pack.sample_keys]
            with self.lock:
                self.trained += keys
            time.sleep(train_seconds(np.array([self.length_of[k] for k in keys], np.int64)) / TIME_SCALE)  # its half
            stream.policy_version = step.step + 1
            if rank == 0:
                self.version = step.step + 1
            if time.monotonic() - started > CPU_SECONDS or self.stop.is_set():
                break
        out[rank] = (time.monotonic() - started, stream.wait_seconds)
        if not self.stop.is_set():
            self.stop.set()
            self.end()  # what is pending forms the last step: the other rank's iteration ends there
        stream.close()

    def end(self) -> None:
        from packfeed.client import Producer
        from packfeed.client.stream.channel import PackfeedError

        try:
            with Producer(self.target, job=self.job, heartbeat_s=0) as ender:
                ender.end()
        except PackfeedError:
            pass  # ended already

    def run(self) -> Outcome:
        out: dict[int, tuple[float, float]] = {}
        threads = [threading.Thread(target=self.train, args=(rank, out)) for rank in range(2)]
        threads += [threading.Thread(target=self.produce, args=(slot,)) for slot in range(CPU_SLOTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(CPU_SECONDS * 10)
        seconds, waited = out[0]
        long = long_threshold()
        dropped = [m for path in sorted(self.spool.glob("*/steps/*.json")) if self.job[:20] in str(path)
                   for m in json.loads(path.read_text())["dropped"]]
        generated = [r for r in self.finished if self.length_of[r] > long]
        return Outcome(seconds, waited, len(self.trained), len(generated),
                       sum(self.length_of[m] > long for m in self.trained),
                       sum(self.length_of[m] > long for m in dropped))


def test_asynchronous_rl_on_cpu_through_a_server(small_tile_index, tmp_path):
    from packfeed.client import LocalServer

    spool = tmp_path / "spool"
    with LocalServer(small_tile_index, workers=1, extra_args=["--live-spool", str(spool)]) as server:
        results = {mode: summary([Served(mode, seed, server.target, spool).run().figures() for seed in range(ROUNDS)])
                   for mode in MODES}
    show(f"on CPU through a server: {CPU_SLOTS} producer threads, DP 2 trainer ranks, steps of {CPU_STEP}, "
         f"{CPU_SECONDS:g} s a loop, time x{TIME_SCALE:g}, max_staleness {CPU_STALENESS}, {ROUNDS} seeds "
         "(median (range))", results)
    partial, sync = results["async + partial"], results["synchronous"]
    assert partial["long_dropped"][2] == 0 and results["async + wait"]["long_dropped"][2] == 0
    assert partial["rollouts_per_s"][0] >= 2 * sync["rollouts_per_s"][0]
