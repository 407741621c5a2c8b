"""What a running server tells its operators: structured JSON logs on stderr and Prometheus metrics."""

from __future__ import annotations

import json
import logging

log = logging.getLogger("packfeed.server")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, event, and the structured fields passed in `extra`."""

    _PLAIN = set(vars(logging.makeLogRecord({})))

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": round(record.created, 3), "level": record.levelname.lower(), "event": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in self._PLAIN and k != "message"})
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    """Every `packfeed.*` logger writes JSON lines to stderr at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("packfeed")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (several servers may share one process)."""

    def __init__(self):
        # imported here: the pre-processing workers import this module for `log` only (prometheus_client and
        # the http and email modules it brings cost each worker 10 MiB)
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.packs = Counter("packfeed_packs", "Packs sent", ["job"], registry=r)
        self.bytes = Counter("packfeed_bytes", "Pack payload bytes sent", ["job"], registry=r)
        self.samples = Counter("packfeed_samples", "Samples pre-processed", ["job"], registry=r)
        self.dataset_samples = Counter("packfeed_dataset_samples", "Samples delivered, per dataset of a job",
                                       ["job", "dataset"], registry=r)
        self.skipped = Counter("packfeed_skipped_samples", "Samples skipped at serve time", ["job", "reason"],
                               registry=r)
        self.queue_depth = Gauge("packfeed_queue_depth_steps", "Steps prepared and waiting, per rank stream",
                                 ["job", "rank"], registry=r)
        self.lag = Gauge("packfeed_rank_lag_steps", "Steps the current run sent and its trainer has not "
                         "acknowledged, per rank", ["job", "rank"], registry=r)
        self.held = Gauge("packfeed_memory_held_bytes", "Prepared pack bytes held in memory", registry=r)
        self.jobs = Gauge("packfeed_jobs", "Jobs this server holds", registry=r)
        self.steps_prepared = Counter("packfeed_steps_prepared", "Rank-steps prepared by the workers", ["job"],
                                      registry=r)
        self.steps_shared = Counter("packfeed_steps_shared", "Rank-steps a replica took from another replica's "
                                    "preparation instead of preparing them again", ["job"], registry=r)
        self.sheds = Counter("packfeed_stream_sheds", "Times a stream blocked on its client gave back the steps it "
                             "had prepared ahead, for streams waiting for room (prepared again once it reads on)",
                             ["job"], registry=r)
        self.reassertions = Counter("packfeed_job_reassertions", "Jobs this server registered again in the "
                                    "coordinator (restored: it had lost them; reclaimed: a server over another "
                                    "index had registered the id; gave_up: an older registration holds another "
                                    "plan)", ["job", "outcome"], registry=r)
        self.stream_refusals = Counter("packfeed_stream_refusals", "Rank streams not started for their lease "
                                       "(taken: another server streams the rank; unreachable: the coordinator "
                                       "could not be asked, so none starts)", ["job", "lease"], registry=r)
        self.unchecked_renewals = Counter("packfeed_lease_renewals_unchecked", "Lease renewals of running streams "
                                          "that could not reach the coordinator (the stream went on)", ["job"],
                                          registry=r)
        self.live_arrived = Counter("packfeed_live_samples", "Live samples accepted (durable)", ["job"], registry=r)
        self.live_refused = Counter("packfeed_live_refused_samples", "Live samples refused (bad input)", ["job"],
                                    registry=r)
        self.live_steps = Counter("packfeed_live_steps_formed", "Live steps formed", ["job"], registry=r)
        self.live_dropped = Counter("packfeed_live_stale_samples", "Live samples dropped as older than "
                                    "max_staleness allows", ["job"], registry=r)
        self.live_pending = Gauge("packfeed_live_pending_samples", "Live samples accepted and in no step yet",
                                  ["job"], registry=r)
        self.live_spool = Gauge("packfeed_live_spool_bytes", "What a live job's spool holds", ["job"], registry=r)
        self.live_version = Gauge("packfeed_live_policy_version", "A live job's policy version (what its trainers "
                                  "train now)", ["job"], registry=r)
        self.live_age = Histogram("packfeed_live_sample_age_versions", "Trained live samples' age in policy versions "
                                  "(the version their step trains at minus theirs)", ["job"], registry=r,
                                  buckets=(0, 1, 2, 3, 4, 6, 8, 16, 32))
        self.live_producers = Gauge("packfeed_live_producers_alive", "A live job's producers alive (heartbeats)",
                                    ["job"], registry=r)
        self.live_reservations = Gauge("packfeed_live_reservations", "Reservations granted and not yet put "
                                       "(staleness wait)", ["job"], registry=r)
        self.live_partials = Gauge("packfeed_live_partial_rollouts", "Unfinished rollouts waiting to be continued",
                                   ["job"], registry=r)
        self.live_groups_filtered = Counter("packfeed_live_filtered_groups", "Whole groups filter_groups dropped",
                                            ["job"], registry=r)
        self.mixture_weight = Gauge("packfeed_mixture_weight", "A mixture whose weights move: each dataset's weight "
                                    "in the window of the step last sent", ["job", "dataset"], registry=r)
        self.loss_reports = Counter("packfeed_loss_reports", "Loss reports of a loss-driven mixture's trainers, by "
                                    "outcome (taken, or why left out)", ["job", "outcome"], registry=r)
        self.evicted = Counter("packfeed_jobs_evicted", "Jobs forgotten after job_idle_s without use", registry=r)
        self.preprocess = Histogram("packfeed_preprocess_seconds_per_sample",
                                    "Worker time per sample (read, decode, tile, tokenize, assemble)",
                                    registry=r, buckets=(.001, .003, .01, .03, .1, .3, 1, 3))
        self.loader_cpu = Counter("packfeed_loader_cpu_seconds", "Worker CPU seconds of the rank-steps sent",
                                  ["job"], registry=r)
        self.cores_used = Gauge("packfeed_loader_cores_used", "Worker CPU seconds of the rank-steps sent in the last "
                                "minute, per second", registry=r)
        self.cores_per_gpu = Gauge("packfeed_loader_cores_per_gpu", "Loader cores used per GPU fed (seats streamed "
                                   "in the last minute)", registry=r)
        self.step_tail = Histogram("packfeed_step_preprocessing_tail", "Per step, its slowest rank-step's worker CPU "
                                   "over the mean of its ranks served here", ["job"], registry=r,
                                   buckets=(1.05, 1.1, 1.2, 1.5, 2, 3, 5))

    def watch_loader(self, use) -> None:
        """The loader gauges read `use` (`loader_use.LoaderUse`) when scraped."""
        self.cores_used.set_function(lambda: use.snapshot()["cores_used"])
        self.cores_per_gpu.set_function(lambda: use.snapshot()["cores_per_gpu"] or 0.0)

    def live_observe(self, job: str, now: dict, before: dict) -> None:
        """A live job's counts after a put (`LiveSteps.status()`, and as it was before)."""
        for counter, name in ((self.live_arrived, "arrived"), (self.live_refused, "refused"),
                              (self.live_steps, "steps_formed"), (self.live_dropped, "dropped_stale")):
            counter.labels(job).inc(now[name] - before[name])
        self.live_pending.labels(job).set(now["pending"])
        self.live_spool.labels(job).set(now["spool_bytes"])
        if "policy_version" not in now:
            return
        self.live_version.labels(job).set(now["policy_version"])
        for age, count in now["trained_age"].items():
            for _ in range(count - before.get("trained_age", {}).get(age, 0)):
                self.live_age.labels(job).observe(age)
        for gauge, name in ((self.live_producers, "producers_alive"), (self.live_reservations, "reservations"),
                            (self.live_partials, "partials")):
            gauge.labels(job).set(now[name])
        self.live_groups_filtered.labels(job).inc(now["groups_filtered"] - before.get("groups_filtered", 0))

    def run_ended(self, job: str, rank: int, lag: int) -> None:
        """A rank's stream ended: nothing of it is queued any more; `lag` steps are in flight (the last steps
        of a completed job, until its trainer acknowledges them)."""
        self.lag.labels(job, str(rank)).set(lag)
        self.queue_depth.labels(job, str(rank)).set(0)

