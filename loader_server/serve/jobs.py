"""The datasets a server serves and the jobs opened on them.

A job is (dataset, plan config, seed, epochs). Its plans are a pure function of those, so any server can
serve any rank of it; what changes is small and lives here, in one place per rank (`RankState`): what was
streamed, what the trainer acknowledged, and what of that the coordinator (`packfeed.server.cluster`, shared
by several servers through Redis) has taken; plus the samples skipped at serve time.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc

from packfeed.media.storage import ObjectError, is_object_url, missing_objects, relocate
from packfeed.server.index.table import IndexInfo
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.mapped_loads import MappedLoads, map_sample_loads
from packfeed.server.cluster.coordinator import JobRecord
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.resume import resume_plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.plan.planner import make_plan, resolve_caps
from packfeed.server.serve.conventions import conventions_of
from packfeed.server.serve.observe import log
from packfeed.server.serve.packs import IndexRows
from packfeed.server.serve.preprocess import DECODE_BYTES_PER_PIXEL, TOKENIZE_BYTES_PER_TOKEN
from packfeed.server.serve.routed import routed_encodes
from packfeed.server.serve.step_work import DatasetSource, RankStepWork
from packfeed.server.serve.workers import SharedSteps
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import PixelMode, PlanConfig, Strategy

MAX_SKIPPED_LISTED = 1000  # per job; the count keeps going


class JobError(Exception):
    """A request the job cannot honour; `code` names the gRPC status it maps to."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Resume:
    """Elastic resume (packfeed.v1 ResumeFrom): an old job with plan settings `plan` consumed the steps before
    `step` of epoch `epoch` on every rank."""

    plan: PlanConfig
    epoch: int
    step: int

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "epoch": self.epoch, "step": self.step}

    def to_proto(self) -> pb.ResumeFrom:
        return pb.ResumeFrom(plan=self.plan.to_proto(), epoch=self.epoch, step=self.step)


@dataclass(frozen=True)
class JobSpec:
    job: str
    dataset: str
    plan: PlanConfig
    seed: int
    epochs: int = 1
    resume: Resume | None = None

    def describe(self) -> str:
        plan = self.plan.to_dict()  # the cost model included: other costs, other packs
        described = {"dataset": self.dataset, "plan": plan, "seed": self.seed, "epochs": self.epochs}
        if self.resume is not None:
            described["resume"] = self.resume.to_dict()
        return json.dumps(described, sort_keys=True)


@dataclass
class RankState:
    """One rank's progress on this server: the one owner of its acknowledged position."""

    acked: tuple[int, int] = (-1, -1)  # (epoch, step) of the last acknowledged step; never moves back
    streamed: tuple[int, int] = (-1, -1)  # last step sent
    queued: int = 0  # steps prepared and waiting
    shared: tuple[int, int] = (-1, -1)  # the acknowledged position the coordinator has taken
    unacked: collections.deque = field(default_factory=collections.deque)  # steps sent, not yet acknowledged
    data_wait_s: float = 0.0  # what its trainer reports having waited for packs, in all (AckStep)

    def sent(self, epoch: int, step: int) -> None:
        self.streamed = (epoch, step)
        self.unacked.append((epoch, step))

    def acknowledge(self, epoch: int, step: int) -> None:
        """Every step up to (epoch, step) was consumed; a late or repeated acknowledgement changes nothing."""
        self.acked = max(self.acked, (epoch, step))
        while self.unacked and self.unacked[0] <= self.acked:
            self.unacked.popleft()

    @property
    def lag(self) -> int:
        """Steps sent but not acknowledged."""
        return len(self.unacked)

    @property
    def unshared(self) -> tuple[int, int] | None:
        """The acknowledged position, when the coordinator has not taken it yet."""
        return self.acked if self.acked > self.shared else None


@dataclass
class Dataset:
    """One indexed dataset as a server holds it. Nothing per sample lives in memory: the planner's columns are
    memory-mapped (MappedLoads, read into memory only while a whole epoch is planned) and the serving columns
    too (IndexRows), read per step for what a step needs (loss tokens, bytes, largest image)."""

    name: str
    source: DatasetSource
    loads: SampleLoads | MappedLoads
    info: IndexInfo
    rows: IndexRows
    conventions: pb.ModelConventions  # what a trainer's model must know of these samples
    label: str = ""  # the name packs carry for its samples (`sample_sources`); default: its name

    def __post_init__(self):
        self.label = self.label or self.name

    def in_memory_loads(self) -> SampleLoads:
        """Every sample's loads in memory, for planning a whole epoch (17 bytes a sample while it runs)."""
        if isinstance(self.loads, SampleLoads):
            return self.loads
        return self.loads.subset(np.arange(len(self.loads)))

    def sample_bytes(self, ids: np.ndarray) -> int:
        """Estimated bytes of samples `ids`' tensors in packs: their uint8 tiles (as the index computed them: a
        video's sampled frames included) and int32 input_ids, labels and position_ids."""
        ids = np.asarray(ids, dtype=np.int64)
        tokens = self.loads.tokens[ids]
        return self.rows.pixel_bytes(ids) + int((tokens.astype(np.int64) * 12 + 256).sum())

    @property
    def fingerprint(self) -> str:
        return self.info.fingerprint

    @property
    def parts(self) -> list[Dataset]:
        """The indexes a pack member's source counts in (one here; a mixture's several)."""
        return [self]

    def caps(self, config: PlanConfig, loads: SampleLoads | None = None) -> Caps | None:
        """`loads`: the loads in memory, when the caller has them already."""
        if config.strategy.padded or config.window:
            return None  # a windowed plan searches its caps on its first window
        return resolve_caps(self.in_memory_loads() if loads is None else loads, config)

    def plan(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
             loads: SampleLoads | None = None) -> Plan | WindowedPlan:
        if config.window:
            return WindowedPlan(self.loads, config, seed, epoch, config.window, self.info.fingerprint, caps)
        loads = self.in_memory_loads() if loads is None else loads
        return make_plan(loads, config, seed, epoch, self.info.fingerprint, caps=caps)

    def resume(self, resume: Resume, config: PlanConfig, seed: int, caps: Caps | None) -> Plan:
        """Epoch `resume.epoch` re-planned with `config` over what the old job left of it (plan.resume)."""
        loads = self.in_memory_loads()  # once, for the old plan, its caps and the re-plan
        old_caps = self.caps(resume.plan, loads)
        old = self.old_plan(resume, config, seed, old_caps, loads)
        return resume_plan(loads, old, resume.step, config, seed, resume.epoch, self.fingerprint, caps or old_caps)

    def old_plan(self, resume: Resume, config: PlanConfig, seed: int, caps: Caps | None,
                 loads: SampleLoads | None = None) -> Plan | WindowedPlan:
        """The resumed job's epoch as its old job planned it, checked against the resume and the new `config`."""
        if config.window:
            raise JobError("INVALID_ARGUMENT", "a resuming job plans whole epochs: give it window 0 (the job it "
                                               "resumes may be windowed)")
        old = self.plan(resume.plan, seed, resume.epoch, caps, loads)
        if resume.step > old.n_steps:
            raise JobError("OUT_OF_RANGE", f"the old job's epoch {resume.epoch} has {old.n_steps} steps; its ranks "
                                           f"cannot have consumed {resume.step}")
        return old

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source part, sample id there) of plan members `ids`."""
        return np.zeros(len(ids), dtype=np.int32), np.asarray(ids, dtype=np.int64)

    def work(self, plan: Plan, step: int, rank: int) -> RankStepWork:
        """What a worker needs to prepare one rank's packs of one step."""
        packs = []
        for microbatch in range(plan.config.microbatches):
            ids, limits = plan.pack_with_truncation(step, rank, microbatch)
            sources, sample_ids = self.members(plan, ids)
            packs.append((sample_ids, np.array(limits), sources))
        parts_, sources, sample_ids = self.parts, *self.members(plan, plan.step_members(step))
        step_loss = sum(part.rows.loss_tokens(sample_ids[sources == k]) for k, part in enumerate(parts_))
        return RankStepWork(tuple(part.name for part in parts_), tuple(part.label for part in parts_),
                            plan.epoch, step, rank, packs, step_loss, plan.is_last_step(step), plan.seed,
                            self._routing(plan, step, rank))

    def _routing(self, plan: Plan, step: int, rank: int) -> list | None:
        """isf+phases with the encoder routed: per microbatch, who encodes each member, and what `rank` encodes."""
        if plan.config.strategy is not Strategy.ISF_PHASES or plan.config.colocate_encoder:
            return None
        routed = []
        for microbatch, (ids, targets) in enumerate(routed_encodes(plan, step, rank)):
            sources, sample_ids = self.members(plan, ids)
            routed.append((plan.pack_encoders(step, rank, microbatch), (sample_ids, sources, targets)))
        return routed

    def _step_samples(self, work: RankStepWork) -> list[tuple["Dataset", np.ndarray]]:
        """Each index the step reads with its samples there (these run in the event loop, for every step)."""
        parts_ = self.parts
        return [(parts_[k], ids) for k, ids in work.samples_by_source()]

    def estimate_bytes(self, work: RankStepWork) -> int:
        """Bytes a rank-step will take once prepared, for reserving room in the memory budget up front."""
        return int(sum(part.sample_bytes(ids) for part, ids in self._step_samples(work)) + 1024 * len(work.packs))

    def working_bytes(self, work: RankStepWork) -> int:
        """Bytes a worker holds for a while preparing the rank-step, one sample at a time: its largest image decoded,
        converted and resized (in its dataset's pixel mode), or its longest sample tokenised, whichever is more.
        Reserved in the budget until the step is ready, so a 9,400 x 9,400 PNG of 200 KB cannot take a gigabyte
        behind the budget's back; never more than `work.decode_budget`, since a worker skips (does not decode or
        tokenise) a sample that needs more."""
        need = max((max(part.rows.largest_image_pixels(ids) * DECODE_BYTES_PER_PIXEL[part.source.pixels],
                        part.longest_sample(ids) * TOKENIZE_BYTES_PER_TOKEN)
                    for part, ids in self._step_samples(work)), default=0)
        return min(need, work.decode_budget) if work.decode_budget else need

    def longest_sample(self, ids: np.ndarray) -> int:
        """LLM tokens of the longest of samples `ids`."""
        return int(self.loads.tokens[np.asarray(ids, dtype=np.int64)].max(initial=0))

    @classmethod
    def open(cls, name: str, source: DatasetSource) -> "Dataset":
        loads, info = map_sample_loads(source.index)
        if not info.has_shards:
            raise ValueError(f"dataset {name}: {source.index} was imported from length files and has no shards "
                             "to serve; index the WebDataset shards with `packfeed index`")
        check_shards_reachable(name, info, source)
        rows = IndexRows(source.index)
        check_pixels_carry_videos(name, rows, source.pixels)
        return cls(name, source, loads, info, rows, conventions_of(info, source.tokenizer))


def check_pixels_carry_videos(name: str, rows: IndexRows, pixels: PixelMode) -> None:
    """`pixels: encoded` sends image files for the client to decode; videos are decoded on the server only."""
    if pixels != PixelMode.ENCODED:
        return
    videos = int(pc.sum(pc.greater(rows.table.column("n_videos"), 0)).as_py() or 0)
    if videos:
        raise ValueError(f"dataset {name}: {videos} samples hold videos, which pixels: encoded cannot carry (it sends "
                         f"image files); serve this dataset with pixels: exact or fast")


def check_shards_reachable(name: str, info: IndexInfo, source: DatasetSource) -> None:
    """A dataset none of whose shards can be read is a configuration error, said when the server starts (not
    an epoch of empty packs); some missing ones are logged, and their samples skipped as they come."""
    paths = [relocate(url, source.shard_root) for url in info.inputs]
    objects = [path for path in paths if is_object_url(path)]
    missing = [path for path in paths if not is_object_url(path) and not os.path.isfile(path)]
    try:
        missing += missing_objects(objects)
    except ObjectError as error:
        raise ValueError(f"dataset {name}: its shards cannot be listed: {error}") from None
    if missing and len(missing) == len(paths):
        raise ValueError(f"dataset {name}: none of its {len(paths)} shards is readable (e.g. {missing[0]}); set "
                         "shard_root to the directory that holds them, or index them where they are")
    if missing:
        log.warning("shards missing: their samples will be skipped", extra={
            "dataset": name, "missing": len(missing), "shards": len(paths), "first": missing[0]})


PLANS_CACHED = 3


@dataclass
class Job:
    spec: JobSpec
    dataset: Dataset
    ranks: list[RankState]
    caps: Caps | None = None
    skipped: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_SKIPPED_LISTED))
    skipped_count: int = 0
    _plans: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # epoch -> Plan, LRU
    _lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)  # epoch 0 planned (or planning failed)
    failure: JobError | None = None  # why planning failed
    open_streams: int = 0
    last_used: float = field(default_factory=time.monotonic)  # for idle eviction
    delivered: collections.Counter = field(default_factory=collections.Counter)  # samples sent, per dataset
    steps: SharedSteps = field(default_factory=SharedSteps)  # steps in preparation or held, shared by replicas
    record: JobRecord | None = None  # as the coordinator holds it (its first registration's time included)
    revoked: JobError | None = None  # set when an older registration of the id holds another plan: streams stop

    def prepare(self) -> None:
        """Plan epoch 0 (caps included) now, so a bad config fails the open, not the first stream."""
        try:
            self.caps = self.dataset.caps(self.spec.plan)
            self.caps = self.caps or getattr(self.plan(0), "caps", None)  # a windowed plan's, searched on window 0
        except JobError as error:
            self.failure = error
        except (ValueError, MemoryError) as error:
            self.failure = JobError("INVALID_ARGUMENT", f"job {self.spec.job!r} cannot be planned: {error}")
        finally:
            self.ready.set()
        if self.failure:
            raise self.failure

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def plan(self, epoch: int) -> Plan:
        """The epoch's plan, computed once (thread-safe). The three most recently used epochs stay cached:
        ranks may be an epoch apart, and a plan is recomputed (identically) if one was evicted."""
        if not 0 <= epoch < self.spec.epochs:
            raise JobError("OUT_OF_RANGE", f"epoch {epoch} is outside job {self.spec.job!r} "
                                           f"(epochs 0..{self.spec.epochs - 1})")
        with self._lock:
            if epoch not in self._plans:
                resume = self.spec.resume
                self._plans[epoch] = (self.dataset.resume(resume, self.spec.plan, self.spec.seed, self.caps)
                                      if resume is not None and resume.epoch == epoch else
                                      self.dataset.plan(self.spec.plan, self.spec.seed, epoch, self.caps))
            self._plans.move_to_end(epoch)
            while len(self._plans) > PLANS_CACHED:
                _, evicted = self._plans.popitem(last=False)  # never the one just asked for: it is the newest
                if isinstance(evicted, WindowedPlan):
                    evicted.close()
            return self._plans[epoch]

    def check_plan(self, expected: str) -> None:
        """A client holding another plan of this job id must not be served this one."""
        if expected and expected != self.plan(0).fingerprint():
            raise JobError("FAILED_PRECONDITION", f"job {self.spec.job!r} plans to {self.plan(0).fingerprint()} on "
                                                  f"this server (dataset {self.dataset.fingerprint}); the client "
                                                  f"holds plan {expected}: this server serves another dataset or "
                                                  "settings; use one of the job's own servers")

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.spec.plan.dp:
            raise JobError("OUT_OF_RANGE", f"rank {rank} is outside job {self.spec.job!r} (dp = {self.spec.plan.dp})")

    def check_step(self, epoch: int, step: int) -> Plan:
        plan = self.plan(epoch)
        if not plan.has_step(step):
            known = f"{plan.steps_known} steps" if plan.steps_known else "past its last window"
            raise JobError("OUT_OF_RANGE", f"step {step} is past the plan of epoch {epoch} ({known})")
        return plan

    def work(self, epoch: int, step: int, rank: int) -> RankStepWork:
        return self.dataset.work(self.plan(epoch), step, rank)

    def next_step(self, epoch: int, step: int) -> tuple[int, int] | None:
        """The step after (epoch, step), or None at the end of the job."""
        if not self.plan(epoch).is_last_step(step):
            return epoch, step + 1
        return (epoch + 1, 0) if epoch + 1 < self.spec.epochs else None

    def record_skipped(self, epoch: int, step: int, skipped: list[tuple[str, str]]) -> None:
        with self._lock:
            for key, reason in skipped:
                self.skipped.append((key, reason, epoch, step))
            self.skipped_count += len(skipped)

    def ack(self, rank: int, epoch: int, step: int) -> None:
        self.check_rank(rank)
        self.check_step(epoch, step)
        self.ranks[rank].acknowledge(epoch, step)
