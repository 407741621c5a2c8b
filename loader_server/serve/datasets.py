"""The datasets a server serves. One shape for all of them: a `Dataset` is the indexes it reads (its parts) and how
its epochs are planned (`planning`): a plain dataset over its own index, a mixture (`packfeed.server.mixture.loads`)
over the union of its parts, each pack member read from its own part's shards and named in `sample_sources`.
Clients ask for either by name (`PackStream(dataset="sft-mix")`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from packfeed.media.pixel_modes import PIXEL_PATHS
from packfeed.media.storage import ObjectError, is_object_url, missing_objects, relocate
from packfeed.server.index.table import IndexInfo
from packfeed.server.mixture.loads import MixtureLoads
from packfeed.server.mixture.mixture_file import Mixture
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.isf import Caps
from packfeed.server.plan.mapped_loads import MappedLoads, map_sample_loads
from packfeed.server.plan.plan_file import Plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.serve.config import MixtureSource, dataset_source
from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.job_spec import JobError, Resume
from packfeed.server.serve.model_conventions import model_conventions
from packfeed.server.serve.observe import log
from packfeed.server.serve.planning import IndexPlanning, MixturePlanning, Planning
from packfeed.server.serve.preprocess import TOKENIZE_BYTES_PER_TOKEN
from packfeed.server.serve.routed import routed_encodes
from packfeed.server.serve.step_work import DatasetSource, IndexReads, RankStepWork
from packfeed.server.serve.weight_ledger import WeightLedger
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import Seat
from packfeed.v1.options import PixelMode, PlanConfig, Strategy


@dataclass
class IndexPart:
    """One index as a server holds it. Nothing per sample lives in memory: the planner's columns are memory-mapped
    (MappedLoads, read into memory only while a whole epoch is planned) and the serving columns too (IndexRows),
    read per step for what a step needs (loss tokens, bytes, largest image)."""

    name: str  # the workers' name for it (`MIXTURE/DATASET` in a mixture)
    source: DatasetSource
    loads: SampleLoads | MappedLoads
    info: IndexInfo
    rows: IndexRows
    conventions: pb.ModelConventions  # what a trainer's model must know of these samples
    label: str = ""  # the name packs carry for its samples (`sample_sources`); default: its name

    def __post_init__(self):
        self.label = self.label or self.name

    @classmethod
    def open(cls, name: str, source: DatasetSource, label: str = "") -> IndexPart:
        loads, info = map_sample_loads(source.index)
        if not info.has_shards:
            raise ValueError(f"dataset {name}: {source.index} was imported from length files and has no shards "
                             "to serve; index the WebDataset shards with `packfeed index`")
        check_shards_reachable(name, info, source)
        rows = IndexRows(source.index)
        check_pixels_carry_videos(name, rows, source.pixels)
        return cls(name, source, loads, info, rows, model_conventions(info, source.tokenizer), label)

    def sample_bytes(self, ids: np.ndarray) -> int:
        """Estimated bytes of samples `ids`' tensors in packs: their uint8 tiles (as the index computed them: a
        video's sampled frames included) and int32 input_ids, labels and position_ids."""
        ids = np.asarray(ids, dtype=np.int64)
        tokens = self.loads.tokens[ids]
        return self.rows.pixel_bytes(ids) + int((tokens.astype(np.int64) * 12 + 256).sum())

    def longest_sample(self, ids: np.ndarray) -> int:
        """LLM tokens of the longest of samples `ids`."""
        return int(self.loads.tokens[np.asarray(ids, dtype=np.int64)].max(initial=0))


@dataclass
class Dataset:
    """A served dataset: its parts, and how its epochs are planned over them (`planning`: over its one index, or
    over a mixture's union; the same calls either way). A `JobSource` planned ahead."""

    name: str
    parts: list[IndexPart]
    planning: Planning

    @classmethod
    def open(cls, name: str, source: DatasetSource | MixtureSource) -> Dataset:
        """A dataset entry of the server's config. A mixture's parts are opened as the workers will name them
        (`MIXTURE/DATASET`, read with the tokenizer each index records); the mixture is planned on their loads."""
        if isinstance(source, DatasetSource):
            part = IndexPart.open(name, source)
            return cls(name, [part], IndexPlanning(part.loads, part.info.fingerprint))
        mixture = Mixture.load(source.mixture)
        parts = [IndexPart.open(f"{name}/{entry.name}", dataset_source(entry.index, pixels=source.pixels),
                                label=entry.name) for entry in mixture.datasets]
        return cls(name, parts, MixturePlanning(MixtureLoads(mixture, [(part.loads, part.info) for part in parts])))

    @property
    def fingerprint(self) -> str:
        return self.planning.fingerprint

    @property
    def conventions(self) -> pb.ModelConventions:
        return self.parts[0].conventions  # a mixture checked that its parts agree

    @property
    def pixels(self) -> PixelMode:
        return self.parts[0].source.pixels  # a mixture's parts share its own

    live_steps = None  # planned ahead: nothing is fed to it during the run (`JobSource`)

    # -- planning ------------------------------------------------------------------------------------------

    def caps(self, config: PlanConfig, loads: SampleLoads | None = None) -> Caps | None:
        """The plan's caps, searched once per job (`loads`: the planning's shared loads, when the caller has
        them already). None for padded strategies, and for a windowed plan, which searches its caps on its first
        window."""
        if config.strategy.padded or config.window:
            return None
        return self.planning.caps(config, loads)

    def plan_epoch(self, config: PlanConfig, seed: int, epoch: int, caps: Caps | None,
                   loads: SampleLoads | None = None, ledger: WeightLedger | None = None) -> Plan | WindowedPlan:
        """One epoch's plan (`loads`: as for `caps`; `ledger`: the job's, deciding a loss-driven mixture's
        windows)."""
        return self.planning.plan_epoch(config, seed, epoch, caps, loads, ledger)

    def job_plan(self, config: PlanConfig, seed: int, epoch: int, resume: Resume | None, caps: Caps | None,
                 loads: SampleLoads | None = None, ledger: WeightLedger | None = None) -> Plan | WindowedPlan:
        """Epoch `epoch` of a job planned with (`config`, `seed`, `caps`) that may itself resume another."""
        if resume is not None and resume.epoch == epoch:
            return self.resume(resume, config, seed, caps)
        return self.plan_epoch(config, seed, epoch, caps, loads, ledger)

    def count_steps(self, config: PlanConfig, seed: int, epoch: int, resume: Resume | None, caps: Caps | None,
                    loads: SampleLoads | None = None) -> int:
        """The steps of `job_plan(...)` for a whole epoch, counted without planning it whole (a resumed epoch is
        re-planned: what is left of it depends on the old plan)."""
        if resume is not None and resume.epoch == epoch:
            return self.job_plan(config, seed, epoch, resume, caps, loads).n_steps
        return self.planning.count_steps(config, seed, epoch, caps, loads)

    def resume(self, resume: Resume, config: PlanConfig, seed: int, caps: Caps | None) -> Plan:
        """Epoch `resume.epoch` re-planned with `config` over what the old job left of it (plan.resume). The old
        job's plan is re-computed as that job computed it (its caps, its own resume) and must be the one its
        states name. A mixture's rows keep their positions (the same repeats and subset), so packs name the same
        datasets and samples."""
        if config.window:
            raise JobError("INVALID_ARGUMENT", "a resuming job plans whole epochs: give it window 0 (the job it "
                                               "resumes may be windowed)")
        loads = self.planning.shared_loads()  # once, for the old plans and the new
        old_caps = self.caps(resume.plan_config, loads)
        first = self.job_plan(resume.plan_config, resume.seed, 0, resume.previous, old_caps, loads)
        self.check_resumed_plan(resume, first.fingerprint())
        old_caps = old_caps or first.caps  # a windowed job's, searched on its epoch 0 (as Job)
        old = first if resume.epoch == 0 else \
            self.job_plan(resume.plan_config, resume.seed, resume.epoch, resume.previous, old_caps, loads)
        if resume.step > old.n_steps:
            raise JobError("OUT_OF_RANGE", f"the old job's epoch {resume.epoch} has {old.n_steps} steps; its ranks "
                                           f"cannot have consumed {resume.step}")
        return self.planning.replan(old, resume.step, config, seed, resume.epoch, caps or old_caps, loads)

    def check_resumed_plan(self, resume: Resume, replanned: str) -> None:
        """A resume continues only the job it claims to: the old job's settings, re-planned over this server's
        index, must give the plan its states name. Otherwise "what the old job consumed" would be computed over
        another index or edited settings, and samples repeated and lost without a word."""
        if replanned == resume.plan_fingerprint:
            return
        if resume.index_fingerprint and resume.index_fingerprint != self.fingerprint:
            differs = (f"the index: the old job planned over {resume.index_fingerprint}, dataset {self.name!r} here "
                       f"is {self.fingerprint} (shards added, removed or re-indexed since)")
        else:
            differs = (f"the plan settings or seed in the states (dp {resume.plan_config.dp}, microbatches "
                       f"{resume.plan_config.microbatches}, strategy {resume.plan_config.strategy.value}, seed "
                       f"{resume.seed}, ...) do not give the plan they name: edited, or saved by another Packfeed "
                       "version" + ("" if resume.index_fingerprint else "; the states do not name their index, "
                                    "which may differ too"))
        raise JobError("FAILED_PRECONDITION", f"resume refused: the old job's plan was {resume.plan_fingerprint}, "
                                              f"its settings re-planned here give {replanned}; what differs: "
                                              f"{differs}. Resume from the old job's own states on a server of its "
                                              "index, or start a new job")

    def ledger(self, ranks: int) -> WeightLedger | None:
        """A job's ledger of loss-driven weights (a mixture naming a rule), else None."""
        return self.planning.ledger(ranks)

    def planned_loads(self, plan: Plan) -> SampleLoads | MappedLoads:
        """The loads a plan's members index (a mixture plan's rows, else the one index's)."""
        return self.planning.planned_loads(plan)

    # -- steps ---------------------------------------------------------------------------------------------

    def members(self, plan: Plan, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part, sample id there) of plan members `ids`."""
        return self.planning.members(plan, ids)

    def work(self, plan: Plan, step: int, seat: Seat, decode_budget: int = 0) -> RankStepWork:
        """What a worker needs to prepare one rank's packs of one step (`JobSource.work`)."""
        config, rank, encoder = plan.config, seat.rank, seat.encoder
        packs = []
        for microbatch in range(config.microbatches):
            ids, limits = plan.pack_with_truncation(step, rank, microbatch) if not encoder else ([], [])
            sources, sample_ids = self.members(plan, np.asarray(ids, dtype=np.int64))
            packs.append((sample_ids, np.array(limits, dtype=np.int64), sources))
        parts_, sources, sample_ids = self.parts, *self.members(plan, plan.step_members(step))
        step_loss = sum(part.rows.loss_tokens(sample_ids[sources == k]) for k, part in enumerate(parts_))
        spans = [plan.pack_cp(step, rank, microbatch) for microbatch in range(config.microbatches)] \
            if config.context_parallel > 1 else None
        reads = IndexReads(tuple(part.name for part in parts_), tuple(part.label for part in parts_),
                           config.shares_prefixes(any(part.info.groups for part in parts_)))
        return RankStepWork(reads, plan.epoch, step, seat, config.layout, packs, step_loss, plan.is_last_step(step),
                            plan.seed, self._routing(plan, step, rank, encoder), decode_budget, spans)

    def _routing(self, plan: Plan, step: int, rank: int, encoder: bool) -> list | None:
        """isf+phases with the encoder routed, or on ranks of its own: per microbatch, who encodes each member of
        `rank`'s pack, and what `rank` encodes (an LLM rank of its own encoders: nothing; an encoder rank: no pack
        of its own)."""
        config = plan.config
        if not config.disaggregated and (config.strategy is not Strategy.ISF_PHASES or config.colocate_encoder):
            return None
        nothing = (np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros((0, 2), np.int32))
        routed = []
        for microbatch in range(config.microbatches):
            encoders = plan.pack_encoders(step, rank, microbatch) if not encoder else np.zeros(0, np.int32)
            routed.append((encoders, nothing))
        if config.disaggregated and not encoder:
            return routed
        for microbatch, (ids, targets) in enumerate(routed_encodes(plan, step, rank)):
            sources, sample_ids = self.members(plan, ids)
            routed[microbatch] = (routed[microbatch][0], (sample_ids, sources, targets))
        return routed

    def _step_samples(self, work: RankStepWork) -> list[tuple[IndexPart, np.ndarray]]:
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
        need = max((max(part.rows.largest_image_pixels(ids) * PIXEL_PATHS[part.source.pixels].decode_bytes_per_pixel,
                        part.longest_sample(ids) * TOKENIZE_BYTES_PER_TOKEN)
                    for part, ids in self._step_samples(work)), default=0)
        return min(need, work.decode_budget) if work.decode_budget else need


def check_pixels_carry_videos(name: str, rows: IndexRows, pixels: PixelMode) -> None:
    """`pixels: encoded` sends image files for the client to decode; videos are decoded on the server only."""
    if not PIXEL_PATHS[pixels].sends_files:
        return
    videos = rows.samples_with_videos()
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
