"""The gRPC loader service (`packfeed serve`): jobs, per-rank pack streams, health, reflection, metrics.

Each StreamPacks call runs a producer that keeps up to `prefetch_steps` of its rank's steps being built
in the worker pool and ready in a bounded queue. A slow consumer fills its own queue and stops its own
producer, so it never holds the pool or grows memory; every step also waits its turn for room in the
shared memory budget, reserved when the step is submitted (estimated from the index) and freed when sent. Packs are serialized in the workers and sent
as ready bytes: the event loop never touches pixels.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import re
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from packfeed.server.config import ServerConfig, describe, port_candidates
from packfeed.server.coord import (
    CoordinationError,
    CoordinationUnavailable,
    Coordinator,
    EmbeddedCoordinator,
    JobRecord,
    coordinator_from_url,
)
from packfeed.server.costs import CostModel
from packfeed.server.jobs import Dataset, Job, JobError, JobRegistry, JobSpec
from packfeed.server.plan import PlanConfig
from packfeed.server.wire import pack_parts
from packfeed.server.workers import RankStepResult, build_rank_step, start_pool
from packfeed.v1 import packfeed_pb2 as pb
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

SERVICE = "packfeed.v1.Packfeed"
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
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("packfeed")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.packs = Counter("packfeed_packs", "Packs sent", ["job"], registry=r)
        self.bytes = Counter("packfeed_bytes", "Pack payload bytes sent", ["job"], registry=r)
        self.samples = Counter("packfeed_samples", "Samples pre-processed", ["job"], registry=r)
        self.skipped = Counter("packfeed_skipped_samples", "Samples skipped at serve time", ["job", "reason"],
                               registry=r)
        self.queue_depth = Gauge("packfeed_queue_depth_steps", "Steps prepared and waiting, per rank stream",
                                 ["job", "rank"], registry=r)
        self.lag = Gauge("packfeed_rank_lag_steps", "Steps sent but not yet acknowledged, per rank",
                         ["job", "rank"], registry=r)
        self.held = Gauge("packfeed_memory_held_bytes", "Prepared pack bytes held in memory", registry=r)
        self.preprocess = Histogram("packfeed_preprocess_seconds_per_sample",
                                    "Worker time per sample (read, decode, tile, tokenize, assemble)",
                                    registry=r, buckets=(.001, .003, .01, .03, .1, .3, 1, 3))


class MemoryBudget:
    """Bytes of prepared packs across all streams, counted from the moment a step is submitted for preparation
    (by an estimate from the index, corrected once it is ready) until its messages are handed to gRPC.

    Requests are granted in arrival order, each when it fits under the limit; when nothing at all is held the
    first waiter is granted even beyond the limit, so a step larger than the budget still goes out, alone.
    Every stream therefore progresses, and memory stays within the budget plus at most one step. A stream
    whose client stops reading keeps what it holds, so size the budget for at least one step per rank stream
    if no rank may ever wait for another's room.
    """

    def __init__(self, limit: int, metrics: Metrics):
        self.limit, self.held, self.metrics = limit, 0, metrics
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        return self.held == 0 or self.held + nbytes <= self.limit

    def _change(self, delta: int) -> None:
        self.held += delta
        self.metrics.held.set(self.held)
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, granted = self._waiters.popleft()
            if not granted.done():
                self.held += nbytes
                self.metrics.held.set(self.held)
                granted.set_result(None)

    def try_reserve(self, nbytes: int) -> bool:
        """Take room now if it is free and nobody is waiting in line; never blocks."""
        if self._waiters or not self._fits(nbytes):
            return False
        self._change(nbytes)
        return True

    async def reserve(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._change(nbytes)
            return
        granted = asyncio.get_running_loop().create_future()
        entry = (nbytes, granted)
        self._waiters.append(entry)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._change(-nbytes)  # granted just as the stream was cancelled: give it back
            elif entry in self._waiters:
                self._waiters.remove(entry)
            raise

    def adjust(self, delta: int) -> None:
        """Correct a reservation to the bytes actually prepared."""
        self._change(delta)

    def release(self, nbytes: int) -> None:
        self._change(-nbytes)


def plan_config_of(spec: pb.PlanSpec) -> PlanConfig:
    """PlanSpec -> PlanConfig; zero or empty fields keep the defaults. Raises JobError on a bad config."""
    given = {"dp": spec.dp, "microbatches": spec.microbatches, "pipeline_stages": spec.pipeline_stages,
             "strategy": spec.strategy, "oversize": spec.oversize, "isf_iterations": spec.isf_iterations,
             "vision_cap": spec.vision_cap, "token_cap": spec.token_cap}
    chosen = {k: v for k, v in given.items() if v}
    if spec.HasField("cost_model"):
        chosen["cost_model"] = cost_model_of(spec.cost_model)
    try:
        return PlanConfig(**chosen)
    except ValueError as error:
        raise JobError("INVALID_ARGUMENT", str(error)) from None


def cost_model_of(message: pb.CostCoefficients) -> CostModel:
    values = {name: getattr(message, name) for name in ("vision_linear", "vision_quadratic", "llm_linear",
                                                        "llm_quadratic")}
    if any(v < 0 for v in values.values()) or not any(values.values()):
        raise JobError("INVALID_ARGUMENT", f"cost_model {values}: coefficients must be >= 0 and not all zero")
    return CostModel(**values)


def plan_spec_of(config: PlanConfig) -> pb.PlanSpec:
    spec = pb.PlanSpec(dp=config.dp, microbatches=config.microbatches, pipeline_stages=config.pipeline_stages,
                       strategy=config.strategy, oversize=config.oversize, isf_iterations=config.isf_iterations,
                       vision_cap=config.vision_cap or 0, token_cap=config.token_cap or 0)
    if config.cost_model != CostModel.from_shapes():
        spec.cost_model.CopyFrom(pb.CostCoefficients(**dataclasses.asdict(config.cost_model)))
    return spec


@dataclass
class RankStream:
    """Book-keeping of one rank: what was sent and not acknowledged (for the lag metric)."""

    unacked: collections.deque


class PackfeedService:
    def __init__(self, config: ServerConfig, registry: JobRegistry, pool: ProcessPoolExecutor, metrics: Metrics,
                 coordinator: Coordinator | None = None, server_id: str = "local"):
        self.config, self.registry, self.pool, self.metrics = config, registry, pool, metrics
        self.coordinator = coordinator or EmbeddedCoordinator()
        self.server_id = server_id
        self.budget = MemoryBudget(config.memory_budget_mb << 20, metrics)
        self.sent: dict[tuple[str, int], collections.deque] = collections.defaultdict(collections.deque)
        self.unsynced_acks: dict[tuple[str, int], tuple[int, int]] = {}  # acks Redis has not taken yet
        self.streams_per_client: collections.Counter = collections.Counter()

    # -- coordination -----------------------------------------------------------------------------------

    def _register(self, job: Job) -> None:
        """Every server serving a job must compute the same plan over the same index."""
        record = JobRecord(job.spec.describe(), job.plan(0).fingerprint(), job.dataset.info.fingerprint)
        try:
            self.coordinator.register_job(job.spec.job, record)
        except CoordinationError as error:
            self.registry.jobs.pop(job.spec.job, None)
            raise JobError(error.code, str(error)) from None
        except CoordinationUnavailable as error:
            self.registry.jobs.pop(job.spec.job, None)
            raise JobError("UNAVAILABLE", f"cannot register job {job.spec.job!r}: {error}; retry") from None

    def _hold_lease(self, job: str, rank: int) -> bool | None:
        """Take or keep this rank's lease: True held, False another server holds it, None Redis unreachable."""
        try:
            return self.coordinator.acquire_lease(job, rank, self.server_id, self.config.lease_ttl_s)
        except CoordinationUnavailable:
            return None

    def _sync_acks(self) -> None:
        for (job, rank), (epoch, step) in list(self.unsynced_acks.items()):
            try:
                self.coordinator.ack(job, rank, epoch, step)
            except CoordinationUnavailable:
                return
            if self.unsynced_acks.get((job, rank)) == (epoch, step):
                del self.unsynced_acks[(job, rank)]

    async def keep_lease(self, job: str, rank: int, lost: asyncio.Event) -> None:
        """Renew the lease at a third of its TTL; while Redis is unreachable, keep streaming and retry. If
        another server took the rank meanwhile (Redis thought this one dead), stop the stream."""
        warned = False
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            held = await asyncio.to_thread(self._hold_lease, job, rank)
            if held is False:
                lost.set()
                return
            if held is None and not warned:
                log.warning("coordinator unreachable: streaming on, retrying", extra={"job": job, "rank": rank})
            warned = held is None
            await asyncio.to_thread(self._sync_acks)

    # -- unary calls ------------------------------------------------------------------------------------

    async def open_job(self, request: pb.OpenJobRequest, context) -> pb.JobInfo:
        spec = JobSpec(request.job, request.dataset, plan_config_of(request.plan), request.seed, request.epochs or 1)
        job = await asyncio.to_thread(self.registry.open_job, spec)
        await asyncio.to_thread(self._register, job)
        log.info("job opened", extra={"job": spec.job, "spec": job.spec.describe()})
        return self.job_info(job)

    async def get_job(self, request: pb.GetJobRequest, context) -> pb.JobInfo:
        return self.job_info(self.registry.get(request.job))

    async def list_jobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[self.job_info(job) for job in list(self.registry.jobs.values())])

    async def ack_step(self, request: pb.AckStepRequest, context) -> pb.AckStepResponse:
        job = self.registry.get(request.job)
        await asyncio.to_thread(job.ack, request.rank, request.epoch, request.step)
        key = (request.job, request.rank)
        self.unsynced_acks[key] = max(self.unsynced_acks.get(key, (-1, -1)), (request.epoch, request.step))
        await asyncio.to_thread(self._sync_acks)
        unacked = self.sent[(request.job, request.rank)]
        while unacked and unacked[0] <= (request.epoch, request.step):
            unacked.popleft()
        self.metrics.lag.labels(request.job, str(request.rank)).set(len(unacked))
        return pb.AckStepResponse()

    def job_info(self, job: Job) -> pb.JobInfo:
        plan = job.plan(0)
        info = pb.JobInfo(job=job.spec.job, dataset=job.spec.dataset, plan=plan_spec_of(job.spec.plan),
                          seed=job.spec.seed, epochs=job.spec.epochs, steps_per_epoch=plan.n_steps,
                          plan_fingerprint=plan.fingerprint(), index_fingerprint=job.dataset.info.fingerprint,
                          skipped_count=job.skipped_count, vision_cap=job.caps.vision_cap if job.caps else 0,
                          token_cap=job.caps.token_cap if job.caps else 0)
        for rank, state in enumerate(job.ranks):
            info.ranks.add(rank=rank, acked_epoch=state.acked[0], acked_step=state.acked[1], queued_steps=state.queued,
                           streamed_epoch=state.streamed[0], streamed_step=state.streamed[1])
        for key, reason, epoch, step in list(job.skipped):
            info.skipped.add(key=key, reason=reason, epoch=epoch, step=step)
        return info

    # -- the stream -------------------------------------------------------------------------------------

    async def stream_packs(self, request: pb.StreamPacksRequest, context, part_bytes: int = 0):
        """StreamPacks (whole packs, part_bytes 0) and StreamPackParts (packs cut into PackPart pieces)."""
        client = client_host(context.peer())
        limit = self.config.max_streams_per_client
        if limit and self.streams_per_client[client] >= limit:
            raise JobError("RESOURCE_EXHAUSTED", f"{client} already has {limit} open pack streams "
                                                 f"(max_streams_per_client); close some or raise the limit")
        self.streams_per_client[client] += 1
        try:
            async for message in self._stream_packs(request, context, part_bytes):
                yield message
        finally:
            self.streams_per_client[client] -= 1

    async def _stream_packs(self, request: pb.StreamPacksRequest, context, part_bytes: int):
        job = self.registry.get(request.job)
        job.check_rank(request.rank)
        start = (request.first_epoch, request.first_step)
        await asyncio.to_thread(job.check_step, *start)
        labels = (job.spec.job, str(request.rank))
        if await asyncio.to_thread(self._hold_lease, job.spec.job, request.rank) is False:
            owner = await asyncio.to_thread(self.coordinator.lease_owner, job.spec.job, request.rank)
            raise JobError("UNAVAILABLE", f"rank {request.rank} of job {job.spec.job!r} is being served by {owner}; "
                                          f"if that server is gone, its lease lapses within "
                                          f"{self.config.lease_ttl_s:g} s: retry")
        lost = asyncio.Event()
        keeper = asyncio.create_task(self.keep_lease(job.spec.job, request.rank, lost))
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.config.prefetch_steps)
        producer = asyncio.create_task(self._produce(job, request.rank, start, queue))
        log.info("stream started", extra={"job": job.spec.job, "rank": request.rank, "epoch": start[0],
                                          "step": start[1], "peer": context.peer()})
        sent_steps = 0
        try:
            while True:
                item = await queue.get()
                self.metrics.queue_depth.labels(*labels).set(queue.qsize())
                job.ranks[request.rank].queued = queue.qsize()
                if item is None:
                    break
                if lost.is_set():
                    raise JobError("ABORTED", f"another server took rank {request.rank} of job "
                                              f"{job.spec.job!r}: reconnect to continue")
                (epoch, step), result = item
                for message in result.messages:
                    if part_bytes:
                        for part in pack_parts(message, part_bytes):
                            yield part
                    else:
                        yield message
                # Only now: a yield returns once gRPC has taken the message, and a message it holds for a
                # slow client is memory like any other (parts keep that to one part per stream)
                self.budget.release(result.nbytes)
                self._account(job, request.rank, epoch, step, result)
                item = result = message = part = None  # no step outlives its release while we wait for the next
                sent_steps += 1
        finally:
            keeper.cancel()
            producer.cancel()
            if not lost.is_set():
                await asyncio.to_thread(self._let_go, job.spec.job, request.rank)
            while not queue.empty():  # give back what the cancelled stream still held
                item = queue.get_nowait()
                if item is not None:
                    self.budget.release(item[1].nbytes)
            log.info("stream ended", extra={"job": job.spec.job, "rank": request.rank, "steps_sent": sent_steps})
        if producer.done() and not producer.cancelled() and producer.exception():
            await context.abort(grpc.StatusCode.INTERNAL, f"pack preparation failed: {producer.exception()!r}")

    def _let_go(self, job: str, rank: int) -> None:
        try:
            self.coordinator.release_lease(job, rank, self.server_id)
        except CoordinationUnavailable:
            pass  # it lapses by itself

    async def _produce(self, job: Job, rank: int, cursor, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        in_flight: collections.deque = collections.deque()  # (position, reserved bytes, future)
        owned = 0  # bytes of a prepared step counted in the budget but not yet in the queue
        pending = None  # (work, estimate) of the cursor's step when it could not be submitted yet
        try:
            while cursor is not None or in_flight:
                while cursor is not None and len(in_flight) < self.config.prefetch_steps:
                    if pending is None:
                        work = await asyncio.to_thread(job.work, cursor[0], cursor[1], rank)
                        pending = work, job.dataset.estimate_bytes(work)
                    work, estimate = pending
                    if not in_flight:
                        await self.budget.reserve(estimate)  # nothing of ours in preparation: wait in line
                    elif not self.budget.try_reserve(estimate):
                        break  # no room to prefetch: deliver what is in preparation first (it frees room)
                    pending = None
                    in_flight.append((cursor, estimate, loop.run_in_executor(self.pool, build_rank_step, work)))
                    cursor = await asyncio.to_thread(job.next_step, *cursor)
                position, estimate, future = in_flight[0]
                result: RankStepResult = await future
                in_flight.popleft()
                self.budget.adjust(result.nbytes - estimate)
                owned = result.nbytes  # counted in the budget, not yet in the queue
                await queue.put((position, result))
                owned, result, future = 0, None, None  # the stream frees it once sent: keep no reference here
            await queue.put(None)
        except asyncio.CancelledError:
            for _, estimate, future in in_flight:
                future.cancel()
                self.budget.release(estimate)
            self.budget.release(owned)
            raise
        except Exception:
            log.exception("pack preparation failed", extra={"job": job.spec.job, "rank": rank})
            for _, estimate, _ in in_flight:
                self.budget.release(estimate)
            await queue.put(None)
            raise

    def _account(self, job: Job, rank: int, epoch: int, step: int, result: RankStepResult) -> None:
        name = job.spec.job
        self.metrics.packs.labels(name).inc(len(result.messages))
        self.metrics.bytes.labels(name).inc(result.nbytes)
        self.metrics.samples.labels(name).inc(result.samples)
        if result.samples:
            self.metrics.preprocess.observe(result.seconds / result.samples)
        for key, reason in result.skipped:
            self.metrics.skipped.labels(name, reason.split(":")[0]).inc()
            log.warning("sample skipped", extra={"job": name, "rank": rank, "epoch": epoch, "step": step,
                                                 "key": key, "reason": reason})
        if result.skipped:
            job.record_skipped(epoch, step, result.skipped)
            asyncio.get_running_loop().run_in_executor(None, self._share_skipped, name, result.skipped)
        job.ranks[rank].streamed = (epoch, step)
        unacked = self.sent[(name, rank)]
        unacked.append((epoch, step))
        self.metrics.lag.labels(name, str(rank)).set(len(unacked))

    def _share_skipped(self, job: str, skipped: list[tuple[str, str]]) -> None:
        try:
            for key, reason in skipped:
                self.coordinator.add_skipped(job, key, reason)
        except CoordinationUnavailable:
            log.warning("coordinator unreachable: skipped samples kept in this server's job status only",
                        extra={"job": job})

    # -- wiring -----------------------------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(method, request_type, response_type):
            async def call(request, context):
                try:
                    return await method(request, context)
                except JobError as error:
                    await context.abort(grpc.StatusCode[error.code], str(error))

            return grpc.unary_unary_rpc_method_handler(call, request_deserializer=request_type.FromString,
                                                       response_serializer=response_type.SerializeToString)

        def streaming(part_bytes: int):
            async def stream(request, context):
                try:
                    async for message in self.stream_packs(request, context, part_bytes):
                        yield message
                except JobError as error:
                    await context.abort(grpc.StatusCode[error.code], str(error))
            # Packs arrive serialized from the workers: no response serializer.
            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=pb.StreamPacksRequest.FromString, response_serializer=None)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "OpenJob": unary(self.open_job, pb.OpenJobRequest, pb.JobInfo),
            "GetJob": unary(self.get_job, pb.GetJobRequest, pb.JobInfo),
            "ListJobs": unary(self.list_jobs, pb.ListJobsRequest, pb.ListJobsResponse),
            "AckStep": unary(self.ack_step, pb.AckStepRequest, pb.AckStepResponse),
            "StreamPacks": streaming(0),
            "StreamPackParts": streaming(self.config.pack_part_kb << 10),
        })


def client_host(peer: str) -> str:
    """'ipv4:10.0.0.7:51234' / 'ipv6:[::1]:51234' -> the host part: limits apply per client machine."""
    address = peer.split(":", 1)[1] if ":" in peer else peer
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


class TokenAuth(grpc.aio.ServerInterceptor):
    """Calls must carry `authorization: Bearer <token>`; health checks are open (for orchestrators)."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: send metadata "
                                                                  "'authorization: Bearer <token>'")

        self.deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if dict(details.invocation_metadata or ()).get("authorization") == self.expected:
            return await continuation(details)
        return self.deny


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    size = config.max_message_mb << 20
    # so_reuseport off: a second server on a taken port must fail to bind (and move on in its range), not
    # silently share the port and have the kernel split clients between the two
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.so_reuseport", 0)]


def bind(server: grpc.aio.Server, config: ServerConfig) -> int:
    """Listen on the first free port of `config.listen` (host:port or host:first-last); returns it."""
    host, _, spec = config.listen.rpartition(":")
    credentials = None
    if config.tls_cert:
        client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
        credentials = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
            root_certificates=client_ca, require_client_auth=client_ca is not None)
    for candidate in port_candidates(spec):
        address = f"{host}:{candidate}"
        try:
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises where older versions returned 0
            port = 0
        if port:
            return port
    raise OSError(f"cannot listen on {config.listen}: every port is taken, or {host} is not an address of this "
                  "machine; free a port, give a range (host:50051-50058), or change listen")


def start_metrics(config: ServerConfig, registry) -> int:
    """Prometheus endpoint on the first free port of `metrics_port`; 0 when off."""
    host = config.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
    candidates = port_candidates(config.metrics_port)
    if candidates == [0]:
        return 0
    for candidate in candidates:
        try:
            start_http_server(candidate, addr=host, registry=registry)
            return candidate
        except OSError:
            continue
    raise OSError(f"cannot serve metrics on {host}:{config.metrics_port}: every port is taken; give a free port "
                  "or a range (metrics_port: 9400-9407), or 0 for no metrics")


def advertised_address(config: ServerConfig, port: int) -> str:
    """Where clients reach this server: `advertise` (a host alone gets the bound port), else the listen host."""
    if config.advertise:
        return config.advertise if re.search(r":\d+$", config.advertise) else f"{config.advertise}:{port}"
    host = config.listen.rpartition(":")[0].strip("[]")
    return f"{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"


async def announce(coordinator: Coordinator, address: str, ttl_s: float) -> None:
    """Keep this server in the coordinator's list of live servers (clients discover servers there)."""
    while True:
        try:
            await asyncio.to_thread(coordinator.heartbeat_server, address, ttl_s)
        except CoordinationUnavailable:
            pass
        await asyncio.sleep(ttl_s / 3)


async def serve(config: ServerConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run the server until SIGTERM/SIGINT (or `stop` is set)."""
    started = time.perf_counter()
    datasets = {name: await asyncio.to_thread(Dataset.open, name, source) for name, source in config.datasets.items()}
    pool = start_pool(config.datasets, config.workers)
    metrics = Metrics()
    coordinator = coordinator_from_url(config.redis_url, config.redis_password)
    service = PackfeedService(config, JobRegistry(datasets), pool, metrics, coordinator)
    interceptors = [TokenAuth(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(config))
    server.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = bind(server, config)
    await server.start()
    service.server_id = advertised_address(config, port)
    announcer = asyncio.create_task(announce(coordinator, service.server_id, config.lease_ttl_s))
    metrics_port = start_metrics(config, metrics.registry)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.address_file:
        Path(config.address_file).write_text(f"127.0.0.1:{port}\n")  # for a health probe on this machine
    log.info("serving", extra={"listen": config.listen, "port": port, "metrics_port": metrics_port,
                               "datasets": sorted(datasets), "startup_seconds": round(time.perf_counter() - started, 2),
                               "server_id": service.server_id,
                               "config": describe(config)})
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (ValueError, RuntimeError):  # not the main thread (in-process use)
            pass
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("stopping")
    announcer.cancel()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    pool.shutdown(cancel_futures=True)
