"""`packfeed serve`: open the datasets, start the worker pool, the gRPC server (Packfeed service, health,
reflection), the metrics endpoint and the coordinator, and run until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from packfeed.server.cluster.connect import coordinator_from_url
from packfeed.server.cluster.coordinator import CoordinationUnavailable, Coordinator
from packfeed.server.plan.warmup import warm_up_in_background
from packfeed.server.serve.config import ServerConfig, describe
from packfeed.server.serve.datasets import Dataset
from packfeed.server.serve.network import TokenAuth, advertised_address, bind, grpc_options, start_metrics
from packfeed.server.serve.observe import Metrics, log
from packfeed.server.serve.registry import JobRegistry
from packfeed.server.serve.service import SERVICE, PackfeedService
from packfeed.server.serve.status import StatusReport
from packfeed.server.serve.step_work import DatasetSource
from packfeed.server.serve.worker_process import keep_freed_memory
from packfeed.server.serve.workers import WorkerPool


async def announce(coordinator: Coordinator, address: str, ttl_s: float) -> None:
    """Keep this server in the coordinator's list of live servers (clients discover servers there)."""
    while True:
        try:
            await asyncio.to_thread(coordinator.heartbeat_server, address, ttl_s)
        except CoordinationUnavailable:
            pass
        await asyncio.sleep(ttl_s / 3)


IO_THREADS = 64  # asyncio.to_thread's pool: plan lookups, step preparation hand-offs, coordinator calls
REASSERT_EVERY_S = 1.0
LIVE_TICK_S = 1.0  # how soon a Redis restarted empty learns again the jobs its servers serve


async def reassert_jobs(service: PackfeedService, every_s: float) -> None:
    """Keep the coordinator knowing the jobs this server serves (`Coordination.reassert_jobs`)."""
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(service.coordination.reassert_jobs)


def worker_sources(datasets: dict[str, Dataset]) -> dict[str, DatasetSource]:
    """What the workers read: every index by the name its packs ask for (a mixture's datasets one by one)."""
    return {part.name: part.source for dataset in datasets.values() for part in dataset.parts}


async def report_health(health_servicer, pool: WorkerPool) -> None:
    """NOT_SERVING while the worker pool is broken (a worker died) and until it is started again."""
    serving = True
    while True:
        await asyncio.sleep(0.5)
        if pool.healthy != serving:
            serving = pool.healthy
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE):
                await health_servicer.set(name, status)
            log.warning("worker pool " + ("restarted: serving" if serving else "broken: not serving"))


PARENT_ENV = "PACKFEED_EXIT_WITH_PARENT"  # a pid: the server stops when that process is gone (LocalServer sets it)


async def exit_with_parent(parent: int, stop: asyncio.Event) -> None:
    """An embedded server (`LocalServer`) ends with the trainer that started it, however that ends (a kill -9
    of the rank runs no cleanup): once its parent is gone the server is re-parented, and it stops."""
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    log.warning("the process that started this server is gone: stopping", extra={"parent_pid": parent})
    stop.set()


async def tick_live_jobs(service: PackfeedService) -> None:
    """Live jobs' time-driven part: producers whose lease lapsed, groups past their deadline (`LiveSteps.tick`)."""
    while True:
        await asyncio.sleep(LIVE_TICK_S)
        await asyncio.to_thread(service.tick_live_jobs)


async def evict_idle_jobs(service: PackfeedService, idle_s: float) -> None:
    while True:
        await asyncio.sleep(min(60.0, idle_s / 4))
        service.evict_idle_jobs()


async def serve(config: ServerConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Run the server until SIGTERM/SIGINT (or `stop` is set)."""
    started = time.perf_counter()
    keep_freed_memory()
    # The planner's kernels compile into numba's cache (a child process) while the datasets open and clients connect.
    warm_up_in_background(lambda seconds: log.info("planner ready", extra={"warmup_seconds": round(seconds, 2)}),
                          lambda said: log.warning("the planner's warm-up failed: the first plan compiles what it "
                                                   "needs", extra={"error": said}))
    if config.range_cache_dir:  # read by the storage layer of this process and of the workers it starts
        os.environ.update(PACKFEED_RANGE_CACHE_DIR=config.range_cache_dir, PACKFEED_RANGE_CACHE_MB=str(config.range_cache_mb))
    datasets = {name: await asyncio.to_thread(Dataset.open, name, source) for name, source in config.datasets.items()}
    pool = WorkerPool(worker_sources(datasets), config.workers, config.memory_budget_mb << 18)
    metrics = Metrics()
    coordinator = coordinator_from_url(config.redis_url, config.redis_password)
    registry = JobRegistry(datasets, max_jobs=config.max_jobs, idle_s=config.job_idle_s,
                           count_at_open_s=config.count_at_open_s, live_spool=config.live_spool,
                           live_bounds=(int(config.live_spool_max_gb * 2**30), config.live_max_samples))
    service = PackfeedService(config, registry, pool, metrics, coordinator)
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
    evictor = asyncio.create_task(evict_idle_jobs(service, config.job_idle_s))
    reasserter = asyncio.create_task(reassert_jobs(service, min(REASSERT_EVERY_S, config.lease_ttl_s / 3)))
    watcher = asyncio.create_task(report_health(health_servicer, pool))
    ticker = asyncio.create_task(tick_live_jobs(service))
    metrics_port = start_metrics(config, metrics.registry, StatusReport(service))
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
    # the threads of asyncio.to_thread: a loss-driven mixture's stream may wait in one for a window's weights (for
    # its trainers' reports), which must not leave other jobs without threads (the default is cores + 4)
    loop.set_default_executor(ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="packfeed-io"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (ValueError, RuntimeError):  # not the main thread (in-process use)
            pass
    orphaned = asyncio.create_task(exit_with_parent(int(os.environ[PARENT_ENV]), stop)) \
        if os.environ.get(PARENT_ENV, "").isdigit() else None
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("stopping")
    if orphaned is not None:
        orphaned.cancel()
    announcer.cancel()
    evictor.cancel()
    reasserter.cancel()
    watcher.cancel()
    ticker.cancel()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    for job in list(registry.jobs.values()):  # nothing waits on them any more (a window on loss reports)
        job.release()
    pool.stop()
    service.planning.shutdown(wait=False, cancel_futures=True)  # a plan still running dies with the process
