"""A live job's steps: samples arrive (`put`), a step forms once `step_samples` samples (or `step_tokens` tokens)
are pending, and each step is planned as an epoch of its own members.

Guarantees (docs/live.md):
- Every sample a put acknowledged is in exactly one step, or dropped as stale by exactly one step (counted):
  a step's membership is written to the spool before the put that formed it answers, so before any of it
  is sent, and a server that re-opens the job from its spool forms nothing twice and loses nothing.
- A step's plan is a pure function of its members (in arrival order), the job's settings and seed: any server,
  or the same one after a restart, streams a resumed trainer the very packs it would have got.
- A step holds every one of its members: dp ranks x M packs or, when its samples need more packs under the
  caps, dp x M' with the fewest M' >= M that hold them (each pack says its step's M).
- Staleness: step s is trained by the policy of version s (one update a step; producers tag a sample with the
  version that generated it); with `max_staleness` k a sample of version v is dropped from any step s > v + k.
- The end: `end` (a producer) forms one last step of what is pending, empty when nothing is; with `steps` N the
  job ends at step N - 1. A step once sent as not the last stays so.
- Faults: a sample leaves the pending queue only once the record of the step that took it is durable, so a step
  record that cannot be written (a full disk) loses nothing: the put fails, its samples stay pending (durable in
  their batch: a retry is answered duplicate, and forms the step). A server serves a live job only from state it
  read while holding the job's lease (`reload`, at every takeover), and a write that finds another server's file
  in its place (SpoolConflict) marks the state `stale`, read again before the job is served on.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import threading

import numpy as np

from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import LiveSample, Refused
from packfeed.server.live.spool import Spool, SpoolConflict, SpoolError, SpoolFull, token_digest
from packfeed.server.live.step_plan import step_plan
from packfeed.server.plan.plan_file import Plan
from packfeed.v1.options import PlanConfig

PLANS_KEPT = 4  # step plans held (ranks may be a few steps apart); one evicted is planned again, identically
# What a spooled sample takes at least (its tokens and loss mask: two tar members, a header and a block each), and
# what a put's token is counted as against the spool's bound (`check_room`)
SMALLEST_SPOOLED_SAMPLE = 4 * 512
SPOOLED_BYTES_PER_TOKEN = 5


class LiveClosed(Exception):
    """The job ended: it takes no more samples."""


class StepNotRecorded(SpoolError):
    """A put's samples are kept (durable and pending), but the step they complete could not be recorded."""


class LiveSteps:
    """One live job's samples and steps, over its spool. Thread-safe."""

    def __init__(self, spool: Spool, config: PlanConfig, seed: int, fingerprint: str, max_bytes: int = 0,
                 max_samples: int = 0, load: bool = True):
        """`load` False: the spool is read by the first `reload` (a server reads it once it holds the job's lease;
        until then the job shows no samples)."""
        self.spool, self.config, self.seed, self.fingerprint = spool, config, seed, fingerprint
        self.max_bytes = max_bytes  # of spooled batches (0: no bound)
        self.max_samples = max_samples  # held (their rows live in memory, ~1.5 KB each; 0: no bound)
        self.refused = 0  # samples this server refused (bad input), in all
        self.producer = ""  # the digest of the job's producer token ("": puts need none; `Spool.claim_producer`)
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.stale = True  # the state is not (or no longer) the spool's: `reload` before serving the job
        self._reset()
        if load:
            self.reload()

    def reload(self) -> None:
        """The job as its spool holds it now (when this server takes the job's lease, and after a write found
        another server's file): every piece of state below is the spool's, read again."""
        with self._lock:
            self.stale = True  # until the spool is read whole
            self._reset()
            self._recover()
            self.stale = False
        self._wake()

    def _reset(self) -> None:
        self.rows: dict[str, LiveRow] = {}  # id -> its row, while its batch is spooled
        self.known: dict[str, str] = {}  # every id ever accepted -> its content's digest ("": not known)
        self.pending: collections.deque[str] = collections.deque()  # in no step yet, in arrival order
        self.steps: list[dict] = []  # each step's record: members, dropped, last
        self.tensor_names: tuple[str, ...] | None = None  # fixed by the job's first sample
        self.arrived = self.dropped = 0
        self._batch_ids: dict[int, list[str]] = {}  # batch -> its samples' ids, while it is spooled
        self._batch_left: dict[int, int] = {}  # batch -> its samples not yet released
        self._released = -1  # every step up to this one acknowledged by every rank
        self._plans: collections.OrderedDict[int, Plan | None] = collections.OrderedDict()
        self._next_batch = 1

    # -- state ------------------------------------------------------------------------------------------

    def _recover(self) -> None:
        """The job as its spool holds it: every durable batch's rows, every recorded step."""
        taken, released = set(), set()
        self.steps = self.spool.read_steps()
        self._released = (self.spool.read_json("released.json") or {"step": -1})["step"]
        for step, record in enumerate(self.steps):
            taken.update(record["members"] + record["dropped"])
            if step <= self._released:
                released.update(record["members"] + record["dropped"])
            self.dropped += len(record["dropped"])
        self.known.update(dict.fromkeys(taken, ""))
        for number, rows in self.spool.recover():
            self._next_batch = number + 1
            self._batch_ids[number] = [row.id for row in rows]
            self._batch_left[number] = sum(row.id not in released for row in rows)
            for row in rows:
                self._register(row)
                if row.id not in taken:
                    self.pending.append(row.id)
            if not self._batch_left[number]:  # released before a crash let it go
                self._remove_batch(number, rows[0])
        self.arrived = len(self.known)
        try:
            self._form(end=False)  # what a crash (or a failed step record) left pending after a put's batch
        except SpoolConflict:
            raise
        except SpoolError:
            pass  # they stay pending, durable in their batches: the next put or end forms their steps

    def _register(self, row: LiveRow) -> None:
        self.rows[row.id] = row
        self.known[row.id] = row.digest
        if self.tensor_names is None:
            self.tensor_names = row.tensors

    @property
    def ended(self) -> bool:
        return bool(self.steps) and self.steps[-1]["last"]

    @property
    def formed(self) -> int:
        return len(self.steps)

    def status(self) -> dict:
        with self._lock:
            return {"arrived": self.arrived, "pending": len(self.pending), "steps_formed": len(self.steps),
                    "dropped_stale": self.dropped, "spool_bytes": self.spool.bytes, "ended": self.ended,
                    "refused": self.refused}

    def waiter(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """A future of `loop` resolved when the next step forms (or the job ends)."""
        future = loop.create_future()
        with self._lock:
            self._waiters.append((loop, future))
        return future

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    # -- samples in -------------------------------------------------------------------------------------

    def put(self, samples: list[LiveSample | Refused], end: bool = False) -> list[tuple[str, str]]:
        """Keep the checked samples (durable when this returns) and form the steps they complete; per sample
        ("accepted" | "duplicate" | "refused", reason). Raises LiveClosed after the job's end, SpoolError when
        the spool cannot keep them (nothing of them kept then), StepNotRecorded when it kept them but could not
        record the step they complete (a retry is answered duplicate and forms it)."""
        with self._lock:
            if self.ended:
                raise LiveClosed(f"the job ended at step {len(self.steps) - 1}: it takes no more samples (running it "
                                 "again? a live job id is used once: give a new job id, or a fresh --live-spool)")
            outcomes, accepted, seen = [], [], {}
            for sample in samples:
                outcome = self._admit(sample, seen)
                outcomes.append(outcome)
                self.refused += outcome[0] == "refused"
                if outcome[0] == "accepted":
                    accepted.append(sample)
                    seen[sample.id] = sample.digest
            kept = False
            try:
                if accepted:
                    self._keep(accepted)
                    kept = True
                self._form(end)
            except SpoolConflict:
                self.stale = True  # another server wrote after this one read: the spool is read again first
                raise
            except SpoolError as error:
                if not kept:
                    raise
                raise StepNotRecorded(f"{error}; the put's samples are kept (a retry is answered duplicate) but the "
                                      "step they complete is not recorded yet: retry") from None
            return outcomes

    def _admit(self, sample: LiveSample | Refused, seen: dict[str, str]) -> tuple[str, str]:
        if isinstance(sample, Refused):
            return "refused", f"{sample.field}: {sample}"
        held = seen.get(sample.id, self.known.get(sample.id))
        if held is not None:
            if held and sample.digest and held != sample.digest:
                return "refused", (f"id: {sample.id!r} was accepted before with other content (tokens, mask, "
                                   "tensors, images or tags): a retry sends the same sample; give a new sample "
                                   "an id of its own")
            return "duplicate", "already accepted"
        names = tuple(sorted(sample.tensors))
        if self.tensor_names is not None and names != self.tensor_names:
            return "refused", (f"tensors: the job's samples carry {list(self.tensor_names)} (its first sample's); "
                               f"this one {list(names)}")
        if self.tensor_names is None:
            self.tensor_names = names
        return "accepted", ""

    def claim_producer(self, token: str) -> None:
        """The job's producer token, as its spool holds it (`token`'s when it has none: `Spool.claim_producer`)."""
        self.producer = self.spool.claim_producer(token)

    def check_producer(self, token: str) -> bool:
        """Whether a put bringing `token` may put into (and end) the job."""
        return not self.producer or hmac.compare_digest(self.producer, token_digest(token))

    def check_room(self, samples: int, nbytes: int) -> None:
        """SpoolFull unless the job has room for `samples` more of about `nbytes` (checked before a put's samples
        are even read, so a flooding producer costs the server next to nothing, and again when they are kept)."""
        if self.max_samples and samples > self.max_samples:
            raise ValueError(f"a put of {samples:,} samples is more than the job may hold at all "
                             f"({self.max_samples:,}, --live-max-samples): put fewer samples at once")
        if self.max_bytes and nbytes > self.max_bytes:
            raise ValueError(f"a put of {nbytes / 2**20:,.1f} MiB is larger than the job's whole spool may hold "
                             f"({self.max_bytes / 2**20:,.1f} MiB, --live-spool-max-gb): put fewer samples at once")
        if self.max_samples and len(self.rows) + samples > self.max_samples:
            raise SpoolFull(f"the job holds {len(self.rows):,} samples not yet consumed, its bound "
                            f"{self.max_samples:,} (--live-max-samples) until the trainers acknowledge the steps "
                            "that took them: retry later (the producer waits and retries by itself)")
        if self.max_bytes and self.spool.bytes + nbytes > self.max_bytes:
            raise SpoolFull(f"the live spool holds {self.spool.bytes / 2**20:,.1f} MiB of its "
                             f"{self.max_bytes / 2**20:,.1f} MiB (--live-spool-max-gb) until the trainers acknowledge "
                             "the steps that took them: retry later (the producer waits and retries by itself)")

    def _keep(self, accepted: list[LiveSample]) -> None:
        self.check_room(len(accepted), sum(s.n_tokens * SPOOLED_BYTES_PER_TOKEN + sum(len(i) for i in s.images)
                                           + 4 * s.n_tokens * len(s.tensors) for s in accepted))
        number = self._next_batch
        rows = self.spool.write_batch(number, accepted)  # durable before anything counts it
        self._next_batch += 1
        self._batch_ids[number] = [row.id for row in rows]
        self._batch_left[number] = len(rows)
        for row in rows:
            self._register(row)
            self.pending.append(row.id)
        self.arrived += len(rows)

    # -- steps ------------------------------------------------------------------------------------------

    def _form(self, end: bool) -> None:
        """Form every step the pending samples fill, and with `end` one last of what is left. A step's members
        leave the pending queue once its record is durable: a record that cannot be written (SpoolError) leaves
        every sample pending, as before the call."""
        while not self.ended:
            step = len(self.steps)
            full = self.config.steps and step + 1 >= self.config.steps
            taken = self._fill(step, whole=False)
            if taken is None and not end:
                return
            members, dropped = taken if taken is not None else self._fill(step, whole=True)
            last = bool(full) or (end and taken is None)
            record = {"members": members, "dropped": dropped, "last": last}
            self.spool.write_step(step, record)  # before any of it is sent
            for _ in range(len(members) + len(dropped)):
                self.pending.popleft()
            self.steps.append(record)
            self.dropped += len(dropped)
            self._wake()

    def _fill(self, step: int, whole: bool) -> tuple[list[str], list[str]] | None:
        """The next step's members from the pending samples in arrival order, and the stale ones met on the way
        (dropped), left pending (`_form` takes them); None when they do not fill a step yet (`whole`: take them
        all, the job's last step)."""
        limit = self.config.max_staleness
        members, dropped, tokens = [], [], 0
        for sample_id in self.pending:
            row = self.rows[sample_id]
            if limit is not None and step - row.policy_version > limit:
                dropped.append(sample_id)
                continue
            members.append(sample_id)
            tokens += row.tokens
            if not whole and ((self.config.step_samples and len(members) >= self.config.step_samples)
                              or (self.config.step_tokens and tokens >= self.config.step_tokens)):
                return members, dropped
        return (members, dropped) if whole else None

    # -- steps out --------------------------------------------------------------------------------------

    def record(self, step: int) -> dict:
        with self._lock:
            return self.steps[step]

    def has_step(self, step: int) -> bool:
        """Formed, or still to come."""
        return step < len(self.steps) or not self.ended

    def is_last(self, step: int) -> bool:
        return self.record(step)["last"]

    def plan(self, step: int) -> Plan | None:
        """Step `step`'s plan over its members (their positions in `record(step)["members"]`); None for an empty
        last step."""
        with self._lock:
            if step in self._plans:
                self._plans.move_to_end(step)
                return self._plans[step]
            record, rows = self.steps[step], self.rows
            if any(sample_id not in rows for sample_id in record["members"]):
                raise KeyError(f"step {step} was acknowledged by every rank: its samples left the spool (a trainer "
                               "starting the job again? a live job id is used once: give a new job id, or a fresh "
                               "--live-spool; a resumed trainer loads its last state)")
            member_rows = [rows[sample_id] for sample_id in record["members"]]
        plan = step_plan(member_rows, self.config, self.seed, step, self.fingerprint)
        with self._lock:
            self._plans[step] = plan
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        return plan

    def member_rows(self, step: int, positions: np.ndarray) -> list[LiveRow]:
        with self._lock:
            ids = self.steps[step]["members"]
            return [self.rows[ids[p]] for p in np.asarray(positions).tolist()]

    def release(self, step: int) -> None:
        """Every rank acknowledged every step up to `step`: the batches wholly consumed leave the spool. Each
        step is counted once, before its files go (a file that fails to go, or a `released.json` that fails to
        be written, is done again by a later server: never a batch removed twice over, or early)."""
        with self._lock:
            before = self._released
            for released in range(self._released + 1, min(step, len(self.steps) - 1) + 1):
                record = self.steps[released]
                self._released = released
                self._plans.pop(released, None)
                for sample_id in record["members"] + record["dropped"]:
                    row = self.rows.get(sample_id)
                    if row is None:
                        continue
                    self._batch_left[row.batch] -= 1
                    if not self._batch_left[row.batch]:
                        self._remove_batch(row.batch, row)
            if self._released > before:
                try:
                    self.spool.write_json("released.json", {"step": self._released})
                except SpoolError:
                    pass  # a server re-opening the spool releases those steps again as their ranks acknowledge

    def _remove_batch(self, number: int, row: LiveRow) -> None:
        for sample_id in self._batch_ids.pop(number):
            self.rows.pop(sample_id, None)
        del self._batch_left[number]
        try:
            self.spool.remove_batch(number, row)
        except (SpoolError, OSError):
            pass  # its files stay: every step that took its samples is acknowledged, so nothing reads them again


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
