"""The jobs a server holds, and their life: opened (planned once, off the registry lock, while ranks that join
wait for that one planning run), used, closed (`CloseJob`) or evicted when idle, and bounded in number.

Names a client sends are checked here before they are stored or repeated in a message.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import replace

from packfeed.media.pixel_modes import PIXEL_PATHS
from packfeed.server.live.spool import Spool, SpoolError
from packfeed.server.live.producer_side import SMALLEST_SPOOLED_SAMPLE, SPOOLED_BYTES_PER_TOKEN
from packfeed.server.live.steps import LiveSteps
from packfeed.server.live.step_plan import live_fingerprint
from packfeed.server.serve.datasets import Dataset
from packfeed.server.serve.job_spec import JobError, JobSpec
from packfeed.server.serve.jobs import Job, RankState
from packfeed.server.serve.live_source import LiveDataset
from packfeed.v1.options import MAX_EPOCHS, MAX_NAME, PlanConfig, Strategy


def check_name(value: str, what: str) -> str:
    """A job id or dataset name: 1-256 printable characters (never echoed back when it is not)."""
    if not value or len(value) > MAX_NAME or not value.isprintable():
        raise JobError("INVALID_ARGUMENT", f"{what} must be 1 to {MAX_NAME} printable characters")
    return value


CLOSED_LISTED = 20


class JobRegistry:
    """Datasets this server serves (from its configuration) and the jobs opened on them."""

    def __init__(self, datasets: dict[str, Dataset], max_jobs: int = 64, idle_s: float = 3600.0,
                 plan_wait_s: float = 60.0, count_at_open_s: float = 2.0, live_spool: str = "",
                 live_bounds: tuple[int, int] = (0, 0)):
        self.datasets = datasets
        self.max_jobs, self.idle_s, self.plan_wait_s = max_jobs, idle_s, plan_wait_s
        self.count_at_open_s = count_at_open_s
        self.live_spool, self.live_bounds = live_spool, live_bounds  # spool bytes and samples per job (0: none)
        self.jobs: dict[str, Job] = {}
        self.closed: collections.deque = collections.deque(maxlen=CLOSED_LISTED)  # newest first
        self._lock = threading.Lock()

    def open_job(self, spec: JobSpec, expected_plan: str = "", producer_token: str = "") -> Job:
        """Open a job, or join it when it exists with the same settings (idempotent). The first request plans
        epoch 0 outside the registry lock; others wait for that planning run (at most `plan_wait_s`, then
        UNAVAILABLE: retry), and every other job goes on meanwhile. With `expected_plan` (a client re-opening
        the job it holds) a job planned otherwise here is refused, and forgotten if this request made it.
        `producer_token`: a live job's (OpenJobRequest.producer_token)."""
        if producer_token and not spec.plan_config.live:
            raise JobError("INVALID_ARGUMENT", "a producer token is a live job's (PlanConfig live): this job's "
                                               "samples come from its dataset")
        check_name(spec.job, "a job id")
        if not 1 <= spec.epochs <= MAX_EPOCHS:
            raise JobError("INVALID_ARGUMENT", f"epochs must be 1 to {MAX_EPOCHS}")
        dataset = self.dataset(spec.dataset)
        spec = replace(spec, dataset=dataset.name)
        check_routable(spec.plan_config, dataset)
        with self._lock:
            job = self.jobs.get(spec.job)
            if job is not None and job.spec.describe() != spec.describe():
                raise JobError("FAILED_PRECONDITION",
                               f"job {spec.job!r} exists with other settings: {job.spec.describe()}; "
                               f"this request asks for {spec.describe()}. Use the same settings or a new job id")
            planner = job is None
            if planner:
                if len(self.jobs) >= self.max_jobs:
                    raise JobError("RESOURCE_EXHAUSTED", f"this server holds {self.max_jobs} jobs (max_jobs): close "
                                                         "finished ones (CloseJob) or wait for idle ones to expire")
                job = Job(spec, self._live(spec, dataset) if spec.plan_config.live else dataset,
                          [RankState() for _ in range(spec.plan_config.dp)])
                self.jobs[spec.job] = job
        job.touch()
        if planner:
            try:
                job.prepare(self.count_at_open_s)
            except JobError:
                self.forget(job)
                raise
        elif not job.ready.wait(self.plan_wait_s):
            raise JobError("UNAVAILABLE", f"job {spec.job!r} is still being planned: retry")
        if job.failure:
            raise job.failure
        try:
            job.check_plan(expected_plan)
            if job.live is not None and (planner or producer_token):
                self._claim_producer(job, producer_token)
        except JobError:
            if planner:
                self.forget(job)
            raise
        return job

    @staticmethod
    def _claim_producer(job: Job, token: str) -> None:
        """The job's producer token digest, as its spool holds it (set by `token` when it has none)."""
        try:
            job.live.claim_producer(token)
        except SpoolError as error:
            raise JobError("FAILED_PRECONDITION", str(error)) from None

    def _live(self, spec: JobSpec, dataset: Dataset):
        """A live job's source: its spool (re-opened as it was left, after a restart or on another server
        sharing the folder) and the dataset its samples reference."""
        if not self.live_spool:
            raise JobError("FAILED_PRECONDITION", "this server keeps no live spool: start it with --live-spool DIR "
                                                  "(live_spool:) to serve live jobs")
        if spec.epochs != 1 or spec.resume is not None:
            raise JobError("INVALID_ARGUMENT", "a live job has one epoch and resumes from its spool (not ResumeFrom)")
        check_live_bounds(spec.plan_config, *self.live_bounds)
        try:
            spool = Spool(self.live_spool, spec.job, spec.describe())
            steps = LiveSteps(spool, spec.plan_config, spec.seed,  # read once this server holds the job's lease
                              live_fingerprint(spec.plan_config, spec.seed, dataset.fingerprint),
                              *self.live_bounds, load=False)
        except SpoolError as error:
            raise JobError("FAILED_PRECONDITION", str(error)) from None
        return LiveDataset(dataset, steps)

    def dataset(self, name: str) -> Dataset:
        if not name and len(self.datasets) == 1:
            return next(iter(self.datasets.values()))
        if name not in self.datasets:
            check_name(name, "a dataset name")
            raise JobError("NOT_FOUND", f"no dataset {name!r} on this server; it serves: "
                                        f"{', '.join(sorted(self.datasets))}")
        return self.datasets[name]

    def get(self, name: str) -> Job:
        """A job that is open and planned."""
        job = self.jobs.get(name)
        if job is None:
            check_name(name, "a job id")
            raise JobError("NOT_FOUND", f"no job {name!r}: open it first (OpenJob)")
        if not job.ready.is_set():
            raise JobError("UNAVAILABLE", f"job {name!r} is still being planned: retry")
        job.touch()
        return job

    def close(self, name: str) -> Job:
        """End a job on this server (its plans and progress are freed); refused while ranks stream from it. The
        last `CLOSED_LISTED` closed jobs stay listed (their ids, times and final positions) for the status page."""
        job = self.get(name)
        if job.open_streams:
            raise JobError("FAILED_PRECONDITION", f"job {name!r} has {job.open_streams} open pack streams: close "
                                                  "them first")
        self.forget(job)
        self.closed.appendleft({"job": name, "dataset": job.spec.dataset, "closed_at": time.time(),
                                "acked": [list(rank.acked) for rank in job.ranks]})
        return job

    def evict_idle(self, now: float | None = None) -> list[str]:
        """Forget jobs without open streams that nobody used for `idle_s`; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [name for name, job in self.jobs.items()
                    if job.ready.is_set() and not job.open_streams and now - job.last_used > self.idle_s]
            for name in idle:
                self.jobs.pop(name).release()
        return idle

    def forget(self, job: Job) -> None:
        """Drop `job` (if it is still the one held under its id)."""
        with self._lock:
            if self.jobs.get(job.spec.job) is job:
                del self.jobs[job.spec.job]
        job.release()


def check_routable(plan: PlanConfig, dataset: Dataset) -> None:
    """Context parallelism cuts every pack's tiles among GPUs on the server. isf+phases routes images between
    ranks, and encoder ranks (encoder_ranks > 0) encode for the LLM ranks. A video's frames are sampled and
    encoded with its sample (its tiles and placeholders are decided together), and encoded image files are cut
    by the client of the pack that consumes them: datasets with either are served colocated only."""
    if plan.context_parallel > 1 and PIXEL_PATHS[dataset.pixels].sends_files:
        raise JobError("INVALID_ARGUMENT", f"dataset {dataset.name} sends image files (pixels: encoded); context "
                                           "parallelism sends each GPU the tiles it encodes, cut on the server: "
                                           "serve it with pixels: exact or fast")
    routed = plan.strategy is Strategy.ISF_PHASES and not plan.colocate_encoder
    if not (routed or plan.disaggregated):
        return
    how, fix = (("encoder_ranks puts the encoder on ranks of its own", "set encoder_ranks 0") if plan.disaggregated
                else ("isf+phases routes images to other ranks", "set colocate_encoder, or use isf+balance"))
    if PIXEL_PATHS[dataset.pixels].sends_files:
        raise JobError("INVALID_ARGUMENT", f"dataset {dataset.name} sends image files (pixels: encoded), which the "
                                           f"client decodes per consumed sample; {how}: serve it with pixels: exact "
                                           f"or fast, or {fix}")
    videos = sum(part.rows.samples_with_videos() for part in dataset.parts)
    if videos:
        raise JobError("INVALID_ARGUMENT", f"dataset {dataset.name}: {videos} samples hold videos, which are not "
                                           f"routed between ranks (images only; {how}): {fix}")


def check_live_bounds(config, max_bytes: int, max_samples: int) -> None:
    """A live job whose step cannot fit in the server's bounds would never form a step (its puts would wait
    for trainers that wait for them): refused at its open, naming both numbers."""
    if max_samples and config.step_samples > max_samples and not config.step_tokens:
        raise JobError("FAILED_PRECONDITION", f"a step of this live job holds {config.step_samples:,} samples "
                                              f"(step_samples), more than this server holds of a job "
                                              f"({max_samples:,}, --live-max-samples): lower step_samples or raise "
                                              "--live-max-samples")
    smallest = min(bound for bound in (config.step_samples * SMALLEST_SPOOLED_SAMPLE,
                                       config.step_tokens * SPOOLED_BYTES_PER_TOKEN) if bound)
    if max_bytes and smallest > max_bytes:
        raise JobError("FAILED_PRECONDITION", f"a step of this live job (step_samples {config.step_samples}, "
                                              f"step_tokens {config.step_tokens}) needs at least "
                                              f"{smallest / 2**20:,.3f} MiB of spool, more than this server keeps of "
                                              f"a job ({max_bytes / 2**20:,.3f} MiB, --live-spool-max-gb): lower the "
                                              "step or raise the bound")
