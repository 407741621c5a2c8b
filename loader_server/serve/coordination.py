"""What one server shares with the others serving its jobs, through the coordinator (`packfeed.server.cluster`):
each job's registration (and its re-assertion when the coordinator lost it), each rank stream's lease, each
rank's acknowledged position and the skipped samples. Redis being unreachable never stops a running stream:
these calls keep what they have and try again; but no new stream starts without its lease (the service)."""

from __future__ import annotations

import asyncio
import time

from packfeed.server.cluster.coordinator import (CoordinationError, CoordinationUnavailable, Coordinator,
                                                 EmbeddedCoordinator, JobRecord, LeaseOutcome, Reassertion)
from packfeed.server.live.spool import SpoolError
from packfeed.server.serve.config import ServerConfig
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.observe import Metrics, log
from packfeed.server.serve.registry import JobRegistry


LIVE_LEASE = "live"  # a live job's: the one server that takes its samples and serves its steps


class Coordination:
    """The one owner of a server's coordinator calls; `server_id` is its advertised address once it serves."""

    def __init__(self, config: ServerConfig, registry: JobRegistry, metrics: Metrics,
                 coordinator: Coordinator | None = None, server_id: str = "local"):
        self.config, self.registry, self.metrics = config, registry, metrics
        self.coordinator = coordinator or EmbeddedCoordinator()
        self.server_id = server_id

    def register(self, job: Job) -> None:
        """Every server serving a job must compute the same plan over the same index. A job this server holds
        already is re-asserted instead (the coordinator may have lost it meanwhile)."""
        if job.record is not None:
            self.reassert(job)
            if job.revoked:
                raise job.revoked
            return
        record = JobRecord(job.spec.describe(), job.epoch_plan(0).fingerprint(), job.dataset.fingerprint,
                           registered_ms=int(time.time() * 1000))
        try:
            job.registered(self.coordinator.register_job(job.spec.job, record))
        except CoordinationError as error:
            self.registry.jobs.pop(job.spec.job, None)
            raise JobError(error.code, str(error)) from None
        except CoordinationUnavailable as error:
            self.registry.jobs.pop(job.spec.job, None)
            raise JobError("UNAVAILABLE", f"cannot register job {job.spec.job!r}: {error}; retry") from None

    def reassert_jobs(self) -> None:
        """Re-register every job this server serves, every `REASSERT_EVERY_S`: a Redis restarted empty, or a
        replica promoted before it had the latest writes, learns them again (the streams renew their leases;
        acknowledged positions and skipped samples are sent again), and a server over another index that
        registered the id meanwhile loses it to the older registration."""
        for job in list(self.registry.jobs.values()):
            if job.record is not None and not job.revoked:
                if not self.reassert(job):
                    return  # the coordinator is unreachable: next time

    def reassert(self, job: Job) -> bool:
        """Re-register `job`; False when the coordinator cannot be reached."""
        name = job.spec.job
        try:
            outcome, found = self.coordinator.reassert_job(name, job.record)
        except CoordinationUnavailable:
            return False
        except CoordinationError as error:  # another, older registration: this server must give the job up
            self.metrics.reassertions.labels(name, "gave_up").inc()
            log.error("job registration conflict: an older registration of this job id holds another plan or "
                      "index; this server stops serving it", extra={"job": name, "error": str(error)})
            job.revoke(JobError(error.code, str(error)))
            self.registry.forget(job)
            self.metrics.jobs.set(len(self.registry.jobs))
            return True
        if outcome is Reassertion.HELD:
            return True
        self.metrics.reassertions.labels(name, outcome.value).inc()
        if outcome is Reassertion.RECLAIMED:
            log.warning("job registration conflict: a server over another index registered this job id after "
                        "the coordinator lost it; the older registration (this server's) is restored",
                        extra={"job": name, "other": found.to_json() if found else ""})
        else:
            log.warning("the coordinator had lost this job (Redis restarted empty or failed over): registered "
                        "again", extra={"job": name})
        for state in job.ranks:
            state.shared = (-1, -1)  # what it had taken may be lost too: acknowledged positions are sent again
        for rank in range(len(job.ranks)):
            self.share_ack(job, rank)
        self.share_skipped(name, [(key, reason) for key, reason, _, _ in list(job.skipped)])
        return True

    def hold_lease(self, job: str, lease: str) -> LeaseOutcome:
        """Take or keep a seat's lease (`Seat.lease_name`)."""
        try:
            held = self.coordinator.acquire_lease(job, lease, self.server_id, self.config.lease_ttl_s)
        except CoordinationUnavailable:
            return LeaseOutcome.UNREACHABLE
        return LeaseOutcome.HELD if held else LeaseOutcome.TAKEN

    async def hold_live(self, job: Job) -> None:
        """A live job is served by one server at a time, the holder of its `live` lease: a put, stream or
        acknowledgement reaching another is refused (UNAVAILABLE, naming the holder) and its client goes on to
        the next server it knows. The holder renews the lease while it holds the job. A server serves the job
        only from state it read while holding the lease: it reads the spool whenever it takes the lease (at its
        first request, and at a takeover, whatever it read when it opened the job) and after one of its writes
        found another server's file (`LiveSteps.stale`)."""
        if job.live is None:
            return
        async with job.live_hold.lock:  # one request takes the lease and reads the spool; the others wait for it
            outcome = await asyncio.to_thread(self.hold_lease, job.spec.job, LIVE_LEASE)
            if outcome is LeaseOutcome.HELD:
                taken = not job.live_hold.renewing
                if taken or job.live.stale:
                    try:
                        await asyncio.to_thread(job.live.reload)
                    except SpoolError as error:
                        raise JobError("UNAVAILABLE", f"live job {job.spec.job!r}: this server cannot read the "
                                                      f"job's spool: {error}: retry") from None
                if taken:
                    job.live_hold.renew_with(self._keep_live(job))
                return
        if outcome is LeaseOutcome.UNREACHABLE:
            raise JobError("UNAVAILABLE", f"live job {job.spec.job!r}: this server cannot reach the coordinator "
                                          "(Redis) to check which server holds the job: retry")
        owner = await asyncio.to_thread(self.coordinator.lease_owner, job.spec.job, LIVE_LEASE)
        raise JobError("UNAVAILABLE", f"live job {job.spec.job!r} is served by {owner}: its producers and trainers "
                                      f"go there; if that server is gone, its lease lapses within "
                                      f"{self.config.lease_ttl_s:g} s: retry")

    async def _keep_live(self, job: Job) -> None:
        """Renew a live job's lease while this server holds the job; if another server took it (this one was
        thought dead), stop serving it here: its streams end and a later request opens it again."""
        while not job.released:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            if await asyncio.to_thread(self.hold_lease, job.spec.job, LIVE_LEASE) is LeaseOutcome.TAKEN:
                log.error("another server took this live job over: it is no longer served here",
                          extra={"job": job.spec.job})
                job.revoke(JobError("ABORTED", f"live job {job.spec.job!r} was taken over by another server: "
                                               "reconnect to continue"))
                self.registry.forget(job)
                return

    def share_ack(self, job: Job, rank: int) -> None:
        """Hand the coordinator the rank's acknowledged position if it has not taken it yet (it may have missed
        it while away): on every acknowledgement, lease renewal and stream end of that rank."""
        position = job.ranks[rank].unshared
        if position is None:
            return
        try:
            self.coordinator.ack(job.spec.job, rank, *position)
        except CoordinationUnavailable:
            return
        job.ranks[rank].shared = max(job.ranks[rank].shared, position)

    async def keep_lease(self, job: Job, rank: int | None, lease: str, lost: asyncio.Event) -> None:
        """Renew the lease at a third of its TTL; while Redis is unreachable, keep streaming and retry. If
        another server took the rank meanwhile (Redis thought this one dead), stop the stream. `rank` None: an
        encoder rank's lease (it has no position of the job's to share)."""
        warned = False
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            held = await asyncio.to_thread(self.hold_lease, job.spec.job, lease)
            if held is LeaseOutcome.TAKEN:
                lost.set()
                return
            if held is LeaseOutcome.UNREACHABLE:
                self.metrics.unchecked_renewals.labels(job.spec.job).inc()
                if not warned:
                    log.warning("coordinator unreachable: streaming on, retrying",
                                extra={"job": job.spec.job, "rank": rank})
            warned = held is LeaseOutcome.UNREACHABLE
            if rank is not None:
                await asyncio.to_thread(self.share_ack, job, rank)

    def let_go(self, job: Job, rank: int | None, lease: str) -> None:
        if rank is not None:
            self.share_ack(job, rank)
        try:
            self.coordinator.release_lease(job.spec.job, lease, self.server_id)
        except CoordinationUnavailable:
            pass  # it lapses by itself

    def share_skipped(self, job: str, skipped: list[tuple[str, str]]) -> None:
        try:
            for key, reason in skipped:
                self.coordinator.add_skipped(job, key, reason)
        except CoordinationUnavailable:
            log.warning("coordinator unreachable: skipped samples kept in this server's job status only",
                        extra={"job": job})
