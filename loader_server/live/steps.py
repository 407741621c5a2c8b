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
- Staleness: step s is trained by the policy of version t(s) (`versions`: s, one update a step, unless the
  trainers report their version); with `max_staleness` k a sample of version v is dropped from any step with
  t(s) > v + k (staleness drop), or never generated too early (staleness wait: `admission`).
- Asynchronous RL: which samples a step takes (`step_plan.select`: whole groups, filter_groups), rollouts put in parts
  (`partials`), and the producers heard from (`producers`).
- The end: `end` (a producer) forms one last step of what is pending, empty when nothing is; with `steps` N the
  job ends at step N - 1. A step once sent as not the last stays so.
- Faults: a sample leaves the pending queue only once the record of the step that took it is durable, so a step
  record that cannot be written (a full disk) loses nothing: the put fails, its samples stay pending (durable in
  their batch: a retry is answered duplicate, and forms the step). A server serves a live job only from state it
  read while holding the job's lease (`reload`, at every takeover), and a write that finds another server's file
  in its place (SpoolConflict) marks the state `stale`, read again before the job is served on. A batch stays
  until every sample of it, and every later one reading its images (a fork, a file stored once per job), is
  consumed.
"""
# Near the line limit: one concern, a live job's samples in and steps out, every method of which meets a sample;
# a split would lengthen each sample's path through the server (tests/test_live.py counts the files it crosses).

from __future__ import annotations

import asyncio
import collections
import threading
import time

import numpy as np

from packfeed.server.live.admission import CLAIM_PREFIX, Admission
from packfeed.server.live.partials import Partials

from packfeed.server.live.producer_side import SPOOLED_BYTES_PER_TOKEN, ProducerSide
from packfeed.server.live.producers import Producers
from packfeed.server.live.recovery import SpoolRecovery
from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import LiveSample, Refused, SampleRules
from packfeed.server.live.spool import Spool, SpoolConflict, SpoolError
from packfeed.server.live.step_plan import Selection, select, step_plan
from packfeed.server.live.versions import PolicyVersions
from packfeed.server.plan.plan_file import Plan
from packfeed.v1.options import PlanConfig, Staleness

PLANS_KEPT = 4  # step plans held (ranks may be a few steps apart); one evicted is planned again, identically


class LiveClosed(Exception):
    """The job ended: it takes no more samples."""


class StepNotRecorded(SpoolError):
    """A put's samples are kept (durable and pending), but the step they complete could not be recorded."""


class LiveSteps(SpoolRecovery, ProducerSide):
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
        self.value_names: tuple[str, ...] | None = None  # per-sample values, fixed by the job's first sample
        self.versions = PolicyVersions()
        self.producers = Producers()  # this server's observations: a server taking the job hears them anew
        waits = self.config.staleness is Staleness.WAIT
        self.admission = Admission(self.config.max_staleness or 0, self.config.step_samples) if waits else None
        self.partials = Partials()
        self.group_first: dict[str, float] = {}  # a pending group -> when its first sample arrived (its deadline)
        self.ages: collections.Counter = collections.Counter()  # trained samples by age in versions
        self.filtered_groups = self.short_groups = 0

    # -- state ------------------------------------------------------------------------------------------

    def _register(self, row: LiveRow) -> None:
        self.rows[row.id] = row
        self.known[row.id] = row.digest
        if self.tensor_names is None:
            self.tensor_names = row.tensors
        if self.value_names is None and row.values:
            self.value_names = tuple(row.values)

    def _pend(self, row: LiveRow) -> None:
        self.pending.append(row.id)
        self.group_first.setdefault(row.group, time.monotonic())

    @property
    def ended(self) -> bool:
        return bool(self.steps) and self.steps[-1]["last"]

    @property
    def formed(self) -> int:
        return len(self.steps)

    def status(self) -> dict:
        """The job's counts (`LiveStatus` on the wire)."""
        with self._lock:
            status = {"arrived": self.arrived, "pending": len(self.pending), "steps_formed": len(self.steps),
                      "dropped_stale": self.dropped, "spool_bytes": self.spool.bytes, "ended": self.ended,
                      "refused": self.refused}
            if self.config.live and (self.steps or self.producers.seen or self.partials.rows):
                status.update(self._async_status())
            return status

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

    def put(self, samples: list[LiveSample | Refused], end: bool = False, producer: str = "",
            rules: SampleRules | None = None) -> list[tuple[str, str]]:
        """Keep the checked samples (durable when this returns) and form the steps they complete; per sample
        ("accepted" | "duplicate" | "refused", reason). Raises LiveClosed after the job's end, SpoolError when
        the spool cannot keep them (nothing of them kept then), StepNotRecorded when it kept them but could not
        record the step they complete (a retry is answered duplicate and forms it). `producer`: who put them;
        `rules`: the job's (a fork's inherited images are costed by them once its parent is found)."""
        with self._lock:
            if self.ended:
                raise LiveClosed(f"the job ended at step {len(self.steps) - 1}: it takes no more samples (running it "
                                 "again? a live job id is used once: give a new job id, or a fresh --live-spool)")
            outcomes, accepted, seen, earlier = [], [], {}, {}
            for sample in samples:
                outcome = self._admit(sample, seen)
                if outcome[0] == "accepted" and sample.parent:
                    outcome = self._fork(sample, earlier, rules)
                outcomes.append(outcome)
                self.refused += outcome[0] == "refused"
                if outcome[0] == "accepted":
                    sample.producer = producer
                    accepted.append(sample)
                    seen[sample.id] = sample.digest
                    earlier[sample.id] = sample
            kept = False
            try:
                if accepted:
                    self._keep(accepted)
                    kept = True
                self.producers.put(producer, len(accepted))
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
        parted = self.partials.admit(sample, held)
        if parted is not None and parted[0] != "accepted":
            return parted
        if parted is None and held is not None:
            if held and sample.digest and held != sample.digest:
                return "refused", (f"id: {sample.id!r} was accepted before with other content (tokens, mask, "
                                   "tensors, images or tags): a retry sends the same sample; give a new sample "
                                   "an id of its own")
            return "duplicate", "already accepted"
        names, values = tuple(sorted(sample.tensors)), tuple(sample.values)
        if self.tensor_names is not None and names != self.tensor_names:
            return "refused", (f"tensors: the job's samples carry {list(self.tensor_names)} (its first sample's); "
                               f"this one {list(names)}")
        if self.value_names is not None and values and values != self.value_names:
            return "refused", (f"values: the job's samples carry {list(self.value_names)} (its first sample's); "
                               f"this one {list(values)}")
        wanted = self.config.filter_groups
        if wanted and not sample.unfinished and wanted not in sample.values:
            return "refused", f"values: the job filters its groups on {wanted!r} (filter_groups): give it"
        if self.tensor_names is None:
            self.tensor_names = names
        if self.value_names is None and values:
            self.value_names = values
        return "accepted", ""

    def _keep(self, accepted: list[LiveSample]) -> None:
        self.check_room(len(accepted), sum(s.n_tokens * SPOOLED_BYTES_PER_TOKEN + sum(len(i) for i in s.images)
                                           + 4 * s.n_tokens * len(s.tensors) for s in accepted))
        number = self._next_batch
        rows = self.spool.write_batch(number, accepted, self.rows.get)  # durable before anything counts it
        self._next_batch += 1
        self._batch_ids[number] = [row.id for row in rows]
        self._batch_left[number] = len(rows)
        for row in rows:
            for batch in row.inherited_batches():  # its parent's images stay until it is consumed too
                self._batch_left[batch] += 1
            claimed = self.partials.claims.get(row.id)
            before = self.partials.kept(row) if row.unfinished or row.part else None
            if self.admission is not None:  # what it reserved: its group's slot, or the claim that continued it
                self.admission.arrived(CLAIM_PREFIX + row.id if claimed else row.group)
            if before is not None:
                self._supersede(before)
            if row.unfinished:
                continue
            self._register(row)
            self._pend(row)
            self.arrived += 1

    def _supersede(self, row: LiveRow) -> None:
        """An unfinished part a later part of its rollout replaced: consumed, as far as its batch (and the batches
        whose images it reads) are concerned."""
        for batch, file in row.batches().items():
            self._consumed(batch, file)

    # -- steps ------------------------------------------------------------------------------------------

    def _form(self, end: bool) -> None:
        """Form every step the pending samples fill, and with `end` one last of what is left. A step's members
        leave the pending queue once its record is durable: a record that cannot be written (SpoolError) leaves
        every sample pending, as before the call. Under staleness wait a step waits while a reservation whose
        last chance it is is outstanding (`Admission.due_at`)."""
        while not self.ended:
            step = len(self.steps)
            if not end and self._awaited(step):
                return
            full = self.config.steps and step + 1 >= self.config.steps
            trained_by = self.versions.trained_at(step)
            pending = [self.rows[sample_id] for sample_id in self.pending]
            chosen = select(pending, self.config, trained_by, False, self._group_due)
            if chosen is None and not end:
                return
            last = bool(full) or (end and chosen is None)
            chosen = chosen or select(pending, self.config, trained_by, True)
            record = self._record_of(chosen, trained_by, last)
            self.spool.write_step(step, record)  # before any of it is sent
            taken = set(chosen.taken)
            self.pending = collections.deque(sample_id for sample_id in self.pending if sample_id not in taken)
            waiting = {self.rows[sample_id].group for sample_id in self.pending}
            self.group_first = {group: t for group, t in self.group_first.items() if group in waiting}
            self.steps.append(record)
            self._count_step(record)
            self._wake()

    def _record_of(self, chosen: Selection, trained_by: int, last: bool) -> dict:
        """A step's record: its members, the samples it dropped (stale) or filtered, whether it is the job's last,
        the version it is trained by and its members' ages in versions."""
        ages = collections.Counter(trained_by - self.rows[sample_id].policy_version for sample_id in chosen.members)
        record = {"members": chosen.members, "dropped": chosen.dropped, "last": last, "version": trained_by,
                  "ages": {str(age): n for age, n in sorted(ages.items())}}
        if chosen.filtered or chosen.short_groups:
            record.update(filtered=chosen.filtered, filtered_groups=chosen.filtered_groups,
                          short_groups=chosen.short_groups)
        return record

    def _count_step(self, record: dict) -> None:
        self.dropped += len(record["dropped"])
        self.filtered_groups += record.get("filtered_groups", 0)
        self.short_groups += record.get("short_groups", 0)
        self.ages.update({int(age): n for age, n in record.get("ages", {}).items()})

    def _group_due(self, group: str) -> bool:
        timeout = self.config.group_timeout_s
        return bool(timeout) and time.monotonic() - self.group_first.get(group, time.monotonic()) >= timeout

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
                for sample_id in self.spool.taken_by(record):
                    row = self.rows.get(sample_id)
                    if row is None:
                        continue
                    for batch, file in row.batches().items():
                        self._consumed(batch, file)
            if self._released > before:
                self.versions.released(self._released)
                try:
                    self.spool.write_json("released.json", {"step": self._released})
                except SpoolError:
                    pass  # a server re-opening the spool releases those steps again as their ranks acknowledge

    def _consumed(self, batch: int, file: str) -> None:
        """One reader of `batch` (its tar `file`) consumed: a sample of it, or one reading its images."""
        if batch not in self._batch_left:
            return
        self._batch_left[batch] -= 1
        if not self._batch_left[batch]:
            self._remove_batch(batch, file)

    def _remove_batch(self, number: int, file: str) -> None:
        """Batch `number`'s files go (`file`: its tar's name, as its rows give it)."""
        ids = self._batch_ids.pop(number)
        for sample_id in ids:
            if sample_id in self.rows and self.rows[sample_id].batch == number:  # not a later part's row
                self.rows.pop(sample_id)
        del self._batch_left[number]
        try:
            self.spool.remove_batch(number, file)
        except (SpoolError, OSError):
            pass  # its files stay: every step that took its samples is acknowledged, so nothing reads them again


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
