"""The gRPC servicer of `packfeed.v1.Packfeed`: open, describe and list jobs, stream packs, take acknowledgements.

Each pack stream has a feed (`packfeed.server.serve.feed`) whose producer prepares the rank's next steps in
the worker pool within the stream's account of the shared memory budget; the stream sends finished bytes, so the event loop never
touches pixels. A rank is streamed by one server at a time: the stream holds the rank's lease in the
coordinator and renews it; acknowledgements go to the job's `RankState` and on to the coordinator.
"""
# Near the line limit: one concern, the RPCs and what each sent step counts; what they lean on (coordination,
# feeds, status, loader use, memory budget) lives in modules of its own already.

from __future__ import annotations

import asyncio
import collections
import math
from concurrent.futures import ThreadPoolExecutor

import grpc

from packfeed.media.samples import skip_metric_label
from packfeed.server.cluster.coordinator import Coordinator, LeaseOutcome
from packfeed.server.serve.budget import MemoryBudget
from packfeed.server.serve.config import ServerConfig
from packfeed.server.serve.coordination import Coordination
from packfeed.server.serve.job_spec import JobError, JobSpec
from packfeed.server.serve.jobs import Job
from packfeed.server.live.put_request import PutRequest
from packfeed.server.serve.job_info import job_info
from packfeed.server.serve.live_control import LIVE_CHECK_S, LiveWait, claim_rollout, reserve
from packfeed.server.serve.live_control import heartbeat as producer_heartbeat
from packfeed.server.serve.live_put import put_samples
from packfeed.server.serve.mixture_weights import (decided_answer, report_losses,
                                                   restore_decided, step_weights)
from packfeed.server.serve.network import client_host
from packfeed.server.serve.loader_use import LoaderUse
from packfeed.server.serve.observe import Metrics, log
from packfeed.server.serve.feed import RankFeed
from packfeed.server.serve.feed import HEARTBEAT
from packfeed.server.serve.step_pump import END
from packfeed.server.serve.registry import JobRegistry
from packfeed.server.serve.requests import client_skipped, parse, resume_of, seat_of
from packfeed.server.serve.step_work import RankStepResult
from packfeed.server.serve.wire import pack_parts
from packfeed.server.serve.workers import WorkerPool
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import Seat
from packfeed.v1.options import PlanConfig

SERVICE = pb.DESCRIPTOR.services_by_name["Packfeed"].full_name
LIVE_HEARTBEAT_S = 10.0  # a stream waiting for its next step (a loss-driven window) sends an empty PackPart this often


class PackfeedService:
    def __init__(self, config: ServerConfig, registry: JobRegistry, pool: WorkerPool, metrics: Metrics,
                 coordinator: Coordinator | None = None, server_id: str = "local"):
        self.config, self.registry, self.pool, self.metrics = config, registry, pool, metrics
        self.coordination = Coordination(config, registry, metrics, coordinator, server_id)
        self.budget = MemoryBudget(config.memory_budget_mb << 20, metrics.held.set)
        self.loader_use = LoaderUse()  # the worker CPU the sent steps took (/status, Prometheus)
        metrics.watch_loader(self.loader_use)
        self.streams_per_client: collections.Counter = collections.Counter()
        # Planning runs here, off the event loop and off the default executor (which shutdown waits for)
        self.planning = ThreadPoolExecutor(max_workers=4, thread_name_prefix="packfeed-plan")

    @property
    def server_id(self) -> str:
        """The address this server advertises (its leases' owner)."""
        return self.coordination.server_id

    @server_id.setter
    def server_id(self, address: str) -> None:
        self.coordination.server_id = address

    # -- unary calls ------------------------------------------------------------------------------------

    async def open_job(self, request: pb.OpenJobRequest, context) -> pb.JobInfo:
        try:
            plan = PlanConfig.from_proto(request.plan)
            resume = resume_of(request) if request.HasField("resume") else None
        except ValueError as error:
            raise JobError("INVALID_ARGUMENT", str(error)) from None
        spec = JobSpec(request.job, request.dataset, plan, request.seed, request.epochs or 1, resume)
        job = await asyncio.get_running_loop().run_in_executor(self.planning, self.registry.open_job, spec,
                                                               request.plan_fingerprint, request.producer_token)
        restore_decided(job, request.mixture_decided)
        await asyncio.to_thread(self.coordination.register, job)
        self.metrics.jobs.set(len(self.registry.jobs))
        log.info("job opened", extra={"job": spec.job, "spec": job.spec.describe()})
        return job_info(job)

    async def close_job(self, request: pb.CloseJobRequest, context) -> pb.CloseJobResponse:
        job = self.registry.close(request.job)
        self.loader_use.forget(job.spec.job)
        self.metrics.jobs.set(len(self.registry.jobs))
        log.info("job closed", extra={"job": job.spec.job})
        return pb.CloseJobResponse()

    def evict_idle_jobs(self) -> None:
        for name in self.registry.evict_idle():
            self.metrics.evicted.inc()
            self.loader_use.forget(name)
            log.info("idle job forgotten", extra={"job": name, "idle_s": self.config.job_idle_s})
        self.metrics.jobs.set(len(self.registry.jobs))

    async def put_samples(self, request: PutRequest, context) -> pb.PutSamplesResponse:
        job = self.registry.get(request.job)
        await self.coordination.hold_live(job)
        return await put_samples(job, request, self.metrics, self.budget.working_limit)

    def producer_call(self, answer):
        """Heartbeat, Reserve and ClaimRollout (`live_control`): answered by the live job's holder."""
        async def call(request, context):
            job = self.registry.get(request.job)
            await self.coordination.hold_live(job)
            return await answer(job, request)
        return call

    def tick_live_jobs(self) -> None:
        """The time-driven part of every live job this server holds (`LiveSteps.tick`)."""
        for job in list(self.registry.jobs.values()):
            if job.live is not None and job.live_hold.renewing:
                before = job.live.status()
                job.live.tick()
                self.metrics.live_observe(job.spec.job, job.live.status(), before)

    async def get_job(self, request: pb.GetJobRequest, context) -> pb.JobInfo:
        return job_info(self.registry.get(request.job))

    async def list_jobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_info(job) for job in list(self.registry.jobs.values())
                                         if job.ready.is_set() and not job.failure])

    async def ack_step(self, request: pb.AckStepRequest, context) -> pb.AckStepResponse:
        if not (math.isfinite(request.data_wait_s) and request.data_wait_s >= 0):
            raise JobError("INVALID_ARGUMENT", f"data_wait_s is {request.data_wait_s}: give the seconds the rank "
                                               "waited for packs, a finite number >= 0")
        job = self.registry.get(request.job)
        seat = seat_of(request, job.spec.job, job.spec.plan_config.layout)
        await self.coordination.hold_live(job)  # a live job's acknowledgements release its spool
        if request.reports_losses and seat.primary:
            # here, not in a thread: a window's decision waits for reports while planning holds pool threads; and
            # taken for a step another server streamed too (re-sent after a restart or a failover)
            outcome = report_losses(job, seat.rank, request)
            self.metrics.loss_reports.labels(request.job, outcome).inc()
            if (request.epoch, request.step) > job.progress(seat).streamed:
                return decided_answer(job)
        await asyncio.to_thread(job.check_step, request.epoch, request.step)
        if not seat.primary:  # the rank's first GPU acknowledges for it: counted once per DP rank
            return pb.AckStepResponse()
        progress = job.progress(seat)
        if (request.epoch, request.step) > progress.streamed:
            raise JobError("FAILED_PRECONDITION", f"step {request.epoch}:{request.step} was not sent to {seat.name} "
                                                  "by this server: acknowledge only steps received")
        skipped = client_skipped(request)
        progress.data_wait_s = request.data_wait_s  # a report, for the status page
        if seat.encoder:  # the job's position is the LLM ranks'
            progress.acknowledge(request.epoch, request.step)
            self._record_skipped(job, seat.rank, request.epoch, request.step, skipped, "client")
            return pb.AckStepResponse()
        if request.HasField("policy_version") and job.live is not None:
            await asyncio.to_thread(job.live.report_version, request.step, request.policy_version)
        await asyncio.to_thread(job.ack, seat.rank, request.epoch, request.step)
        if request.closing:  # the trainer stopped here: what it was sent beyond is not its lag
            progress.end_run()
        await asyncio.to_thread(self.coordination.share_ack, job, seat.rank)
        self._record_skipped(job, seat.rank, request.epoch, request.step, skipped, "client")
        self.metrics.lag.labels(request.job, str(seat.rank)).set(job.ranks[seat.rank].lag)
        return decided_answer(job) if request.reports_losses else pb.AckStepResponse()

    # -- the stream -------------------------------------------------------------------------------------

    async def stream_packs(self, request: pb.StreamPacksRequest, context, part_bytes: int = 0) -> None:
        """StreamPacks (whole packs, part_bytes 0) and StreamPackParts (packs cut into PackPart pieces).

        Messages go out with `context.write`, so a client that cancels or disconnects interrupts this coroutine
        where it waits, and everything it holds is released on the spot (an abandoned generator would keep
        its step's room in the budget until garbage collection)."""
        client = client_host(context.peer())
        limit = self.config.max_streams_per_client
        if limit and self.streams_per_client[client] >= limit:
            raise JobError("RESOURCE_EXHAUSTED", f"{client} already has {limit} open pack streams "
                                                 f"(max_streams_per_client); close some or raise the limit")
        self.streams_per_client[client] += 1
        try:
            await self._stream_packs(request, context, part_bytes)
        finally:
            self.streams_per_client[client] -= 1

    async def _stream_packs(self, request: pb.StreamPacksRequest, context, part_bytes: int) -> None:
        job = self.registry.get(request.job)
        job.check_plan(request.plan_fingerprint)
        config = job.spec.plan_config
        seat = seat_of(request, job.spec.job, config.layout, request.replicas)
        rank, encoder = seat.rank, seat.encoder
        # the rank's first GPU acknowledges for the rank (an encoder rank's acknowledgements are reports only)
        primary = seat.primary and not encoder
        start = (request.first_epoch, request.first_step)
        await self.coordination.hold_live(job)
        await asyncio.to_thread(job.check_step, *start)
        if primary and start == (0, 0) and job.ranks[rank].acked >= (0, 0):  # a restart that forgot its state?
            log.warning("job id re-used without its saved state: a rank restarts at step 0", extra={
                "job": job.spec.job, "rank": rank, "acked": list(job.ranks[rank].acked)})
        await self._take_lease(job, seat)
        lost = asyncio.Event()
        job.stream_opened()
        use_key = -1 - rank if encoder else rank
        if seat.primary:
            self.loader_use.streaming(job.spec.job, use_key, +1)
        keeper = asyncio.create_task(self.coordination.keep_lease(job, None if encoder else rank, seat.lease_name,
                                                                  lost))
        feed = RankFeed(job, seat, start, self.pool, self.budget, self.config, self.metrics)
        log.info("stream started", extra={"job": job.spec.job, "rank": rank, "encoder": encoder, "epoch": start[0],
                                          "step": start[1], "peer": context.peer()})
        sent_steps, complete = 0, False
        if seat.primary:
            job.progress(seat).begin_run()
        # a live job waiting for samples, or a loss-driven window for its reports: empty pieces keep the stream alive
        heartbeat = (LIVE_CHECK_S if config.live else LIVE_HEARTBEAT_S) \
            if (config.live or job.ledger is not None) and part_bytes else None  # a live stream: LiveWait says what
        waiting = LiveWait(job)
        try:
            while (item := await feed.next(heartbeat)) is not END:
                if item is HEARTBEAT:  # nothing to send yet: an empty piece keeps the client's stall watch
                    part = await asyncio.to_thread(waiting.part)  # it takes the live job's lock
                    if part is not None:
                        await context.write(part)
                    if waiting.gone:
                        raise JobError("FAILED_PRECONDITION", f"job {job.spec.job!r}: {waiting.gone}")
                    continue
                if primary:
                    self.metrics.queue_depth.labels(job.spec.job, str(rank)).set(feed.queue.qsize())
                if seat.primary:
                    job.progress(seat).queued = feed.queue.qsize()
                (epoch, step), sending, hold = item
                item = None
                # Released once gRPC has taken the step's last piece (a write returns then, and a message it
                # holds for a slow client is memory like any other: parts keep that to one part per stream), or
                # on the way out of a failed or cancelled send
                with feed.sending(hold):
                    if lost.is_set():
                        raise JobError("ABORTED", f"another server took {seat.name} of job {job.spec.job!r}: "
                                                  "reconnect to continue")
                    if job.revoked:  # an older registration of the job id holds another plan
                        raise job.revoked
                    for piece, last in with_last(pieces_of(sending.for_lane(seat.lane, config.context_parallel),
                                                           part_bytes)):
                        if last:  # counted as sent when its final piece is handed over: a client that has all
                            # of it may close before the write returns
                            self._account(job, seat, epoch, step, sending)
                        await context.write(piece)
                sending = hold = piece = None  # no step outlives its release while we wait for the next
                sent_steps += 1
            complete = feed.failure() is None
        finally:
            job.stream_closed()
            if seat.primary:
                self.loader_use.streaming(job.spec.job, use_key, -1)
                job.progress(seat).end_run(complete)
            if primary:
                self.metrics.run_ended(job.spec.job, rank, job.ranks[rank].lag)
            keeper.cancel()
            feed.close()  # gives back what the stream still held
            if not lost.is_set():
                await asyncio.shield(asyncio.to_thread(self.coordination.let_go, job, None if encoder else rank,
                                                       seat.lease_name))
            log.info("stream ended", extra={"job": job.spec.job, "rank": rank, "encoder": encoder,
                                            "steps_sent": sent_steps})
        failure = feed.failure()
        if isinstance(failure, JobError):
            raise failure
        if failure is not None:
            await context.abort(grpc.StatusCode.INTERNAL, f"pack preparation failed: {failure!r}")

    async def _take_lease(self, job: Job, seat: Seat) -> None:
        """Start a stream only with the seat's lease in hand. Fail-closed: while the coordinator cannot be asked,
        no new stream of a rank starts here (another server may be streaming it: two trainers would get the
        same samples without either knowing); the client retries. Streams already running go on."""
        outcome = await asyncio.to_thread(self.coordination.hold_lease, job.spec.job, seat.lease_name)
        if outcome is LeaseOutcome.HELD:
            return
        self.metrics.stream_refusals.labels(job.spec.job, outcome.value).inc()
        if outcome is LeaseOutcome.UNREACHABLE:
            log.warning("stream refused: the rank's lease cannot be checked", extra={"job": job.spec.job,
                                                                                    "seat": seat.name})
            raise JobError("UNAVAILABLE", f"{seat.name} of job {job.spec.job!r}: this server cannot reach the coordinator "
                                          "(Redis) to check the rank's lease, and starts no stream that another "
                                          "server may be serving; streams already running go on. Retry: it "
                                          "starts once the coordinator answers")
        owner = await asyncio.to_thread(self.coordination.coordinator.lease_owner, job.spec.job, seat.lease_name)
        raise JobError("UNAVAILABLE", f"{seat.name} of job {job.spec.job!r} is being served by {owner}; if that server is "
                                      f"gone, its lease lapses within {self.config.lease_ttl_s:g} s: retry")

    def _account(self, job: Job, seat: Seat, epoch: int, step: int, result: RankStepResult) -> None:
        """Metrics, the job's own counts and the rank's progress for a step sent; a seat other than its rank's first
        counts packs and bytes only (its samples are the rank's); an encoder rank's first its skips and position
        too."""
        name, rank = job.spec.job, seat.rank
        tail = self.loader_use.sent(name, seat.name, -1 - rank if seat.encoder else rank, (epoch, step),
                                    result.cpu_seconds, seat.primary)
        if tail is not None:
            self.metrics.step_tail.labels(name).observe(tail)
        job.count_sent(len(result.messages))
        self.metrics.packs.labels(name).inc(len(result.messages))
        self.metrics.bytes.labels(name).inc(result.nbytes)
        if not seat.primary:
            return
        if seat.encoder:
            self._record_skipped(job, rank, epoch, step, result.skipped, "server")
            job.encoders[rank].sent(epoch, step)
            return
        self.metrics.samples.labels(name).inc(result.samples)
        self.metrics.loader_cpu.labels(name).inc(result.cpu_seconds)
        for dataset, count in result.by_dataset.items():
            self.metrics.dataset_samples.labels(name, dataset).inc(count)
        job.delivered.update(result.by_dataset)
        for dataset, weight in (step_weights(job, epoch, step) or {}).items():
            self.metrics.mixture_weight.labels(name, dataset).set(weight)
        if result.samples:
            self.metrics.preprocess.observe(result.seconds / result.samples)
        self._record_skipped(job, rank, epoch, step, result.skipped, "server")
        job.ranks[rank].sent(epoch, step)
        self.metrics.lag.labels(name, str(rank)).set(job.ranks[rank].lag)

    # -- wiring -----------------------------------------------------------------------------------------

    def _record_skipped(self, job: Job, rank: int, epoch: int, step: int, skipped: list[tuple[str, str]],
                        where: str) -> None:
        """Samples left out (by this server's workers, or by the client that decoded a pack): metrics, a log line
        each, the job's list and the coordinator's, alike for both."""
        name = job.spec.job
        for key, reason in skipped:
            # labels from a fixed set (a reason names files and keys): the series never grow with the data
            category = skip_metric_label(reason) if where == "server" else "left out by the client"
            self.metrics.skipped.labels(name, category).inc()
            log.warning("sample skipped", extra={"job": name, "rank": rank, "epoch": epoch, "step": step,
                                                 "key": key, "reason": reason, "where": where})
        if skipped:
            job.record_skipped(epoch, step, skipped)
            asyncio.get_running_loop().run_in_executor(None, self.coordination.share_skipped, name, skipped)

    def handler(self) -> grpc.GenericRpcHandler:
        # Requests arrive as bytes and are parsed here, so a malformed message or invalid UTF-8 gets
        # INVALID_ARGUMENT rather than gRPC's UNKNOWN with a Python exception in it.
        def unary(method, request_type, response_type):
            async def call(raw, context):
                try:
                    return await method(parse(request_type, raw), context)
                except JobError as error:
                    await context.abort(grpc.StatusCode[error.code], str(error))

            return grpc.unary_unary_rpc_method_handler(call, request_deserializer=None,
                                                       response_serializer=response_type.SerializeToString)

        def streaming(part_bytes: int):
            async def stream(raw, context):
                try:
                    await self.stream_packs(parse(pb.StreamPacksRequest, raw), context, part_bytes)
                except JobError as error:
                    await context.abort(grpc.StatusCode[error.code], str(error))
            # Packs arrive serialized from the workers: no response serializer.
            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "OpenJob": unary(self.open_job, pb.OpenJobRequest, pb.JobInfo),
            "GetJob": unary(self.get_job, pb.GetJobRequest, pb.JobInfo),
            "ListJobs": unary(self.list_jobs, pb.ListJobsRequest, pb.ListJobsResponse),
            "AckStep": unary(self.ack_step, pb.AckStepRequest, pb.AckStepResponse),
            "CloseJob": unary(self.close_job, pb.CloseJobRequest, pb.CloseJobResponse),
            "PutSamples": unary(self.put_samples, PutRequest, pb.PutSamplesResponse),  # its payload read in place
            "Heartbeat": unary(self.producer_call(producer_heartbeat), pb.ProducerHeartbeat, pb.ProducerState),
            "Reserve": unary(self.producer_call(reserve), pb.ReserveRequest, pb.ReserveResponse),
            "ClaimRollout": unary(self.producer_call(claim_rollout), pb.ClaimRolloutRequest, pb.ClaimRolloutResponse),
            "StreamPacks": streaming(0),
            "StreamPackParts": streaming(self.config.pack_part_kb << 10),
        })


def pieces_of(messages: list[bytes], part_bytes: int):
    """The messages as written: whole, or cut into PackPart pieces of `part_bytes` (made one at a time)."""
    for message in messages:
        yield from (pack_parts(message, part_bytes) if part_bytes else (bytes(message),))  # gRPC takes bytes


def with_last(items):
    """(item, is it the last one) of an iterator, looking one ahead."""
    iterator = iter(items)
    current = next(iterator, None)
    while current is not None:
        following = next(iterator, None)
        yield current, following is None
        current = following
