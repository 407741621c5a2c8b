"""Pre-processing worker processes: each turns planned rank-steps into serialized `Pack` messages.

The service sends a worker only sample ids (never file paths from a client); the worker reads the samples
by their index offsets, decodes, tiles, tokenises, assembles the packs and serializes them, so the event
loop only moves finished bytes. Workers are forks of multiprocessing's fork server, which the pool starts with
the server and which loads what they need first (`worker_preload`): forking the server itself, which runs gRPC
threads, would be unsafe, and a fresh interpreter per worker costs about 2 CPU seconds before its first sample.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from packfeed.server.serve.observe import log
from packfeed.server.serve.step_files import SharedFiles, remove_shared_files, shared_directory
from packfeed.server.serve.step_work import DatasetSource, RankStepWork
from packfeed.server.serve.worker_process import build_rank_step, init_worker

PRELOAD = "packfeed.server.serve.worker_preload"  # what the fork server imports before it forks any worker


def abandon(future: asyncio.Future) -> None:
    """Give up a step: cancel its preparation, or, if it is ready already, remove its shared file."""
    if not future.cancel() and not future.cancelled() and future.exception() is None:
        future.result().discard()


class SharedSteps:
    """A job's rank-steps in preparation or on their way out, shared by the streams that want the same one: the
    replicas of a DP rank (tensor / context parallel groups) get identical packs, so while one replica's step
    is prepared or held, another's producer takes it instead of preparing it again. Each taker gives it back
    once sent (or abandoned); the last one lets it go, so nothing is kept for a replica that lags further
    behind than the others hold their steps (that one prepares its own). Event-loop only (not thread-safe)."""

    def __init__(self):
        # (rank, epoch, step), or ("encoder", rank, epoch, step) for an encoder rank's -> [future, takers]
        self._steps: dict[tuple, list] = {}

    def take(self, key: tuple,
             start: Callable[[], asyncio.Future]) -> tuple[asyncio.Future, bool]:
        """The step's preparation, and whether this call started it (`start()`): it does unless another taker
        holds one that has not failed."""
        entry = self._steps.get(key)
        started = entry is None or (entry[0].done() and (entry[0].cancelled() or entry[0].exception() is not None))
        if started:
            entry = self._steps[key] = [start(), entry[1] if entry else 0]
        entry[1] += 1
        return entry[0], started

    def give_back(self, key: tuple) -> None:
        entry = self._steps.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._steps[key]
            abandon(entry[0])  # unfinished: cancelled; finished but never attached: its file removed


class WorkerPool:
    """The pre-processing processes. A worker that dies (the OOM killer, a crash in a decoder) breaks a
    ProcessPoolExecutor for good; here the pool is started afresh, the steps it held fail with a retryable
    error, and `healthy` tells the health service meanwhile."""

    def __init__(self, sources: dict[str, DatasetSource], workers: int, keep_shared_bytes: int = 1 << 30):
        self.sources, self.workers = sources, workers
        self.shared_dir = shared_directory()
        remove_shared_files(self.shared_dir)  # left by servers that were killed
        self.files = SharedFiles(self.shared_dir, keep_shared_bytes)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload([PRELOAD])
        self.ready = threading.Event()
        self.executor = self._start()
        self.restarts = 0

    def _start(self) -> ProcessPoolExecutor:
        """A new executor; its workers fork on demand once the fork server is ready (`ready`)."""
        self.ready.clear()
        threading.Thread(target=self._wait_for_fork_server, name="packfeed-fork-server", daemon=True).start()
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=self.context,
                                   initializer=init_worker, initargs=(self.sources, os.getpid()))

    def _wait_for_fork_server(self) -> None:
        """Start the fork server (if it is not running) and fork one process from it, which returns once it has
        loaded what the workers need: until then a fork would block the event loop for seconds."""
        started = time.perf_counter()
        try:
            probe = self.context.Process(target=os.getpid, name="packfeed-fork-server-probe")
            probe.start()
            probe.join()
            log.info("workers' fork server ready", extra={"seconds": round(time.perf_counter() - started, 2)})
        except OSError as error:  # the workers' own start reports the cause again, where a step needs them
            log.warning("the workers' fork server did not start", extra={"error": repr(error)})
        finally:
            self.ready.set()

    @property
    def healthy(self) -> bool:
        return not getattr(self.executor, "_broken", False)

    def run(self, work: RankStepWork) -> asyncio.Future:
        """build_rank_step(work) in a worker, as an asyncio future, its result attached (messages readable).
        Cancelling the future abandons the step: its shared file is removed whenever the worker finishes."""
        if not self.healthy:
            self.restart()
        if not self.ready.is_set():  # a step asked for while the fork server loads: submitted once it is ready
            return asyncio.ensure_future(self._run_when_ready(work))
        return self._submit(work)

    async def _run_when_ready(self, work: RankStepWork):
        await asyncio.to_thread(self.ready.wait)
        return await self._submit(work)

    def _submit(self, work: RankStepWork) -> asyncio.Future:
        shared, files = self.files.take(), self.files
        running = self.executor.submit(build_rank_step, work, shared)
        # The callbacks on `running` take it as their argument: one that held it would make a reference cycle,
        # and the step's mapping (so its file) would wait for the garbage collector instead of going when sent.

        def finished(done) -> None:  # before the asyncio future sees the result: how its file goes back
            if done.cancelled() or done.exception() is not None or done.result().shared is None:
                files.give_back(shared)  # nobody writes it any more (a dead worker's was removed)
            else:
                done.result().files = files

        running.add_done_callback(finished)
        future = asyncio.wrap_future(running)

        def abandon_result(done) -> None:  # the worker finished after the step was given up
            if future.cancelled() and not done.cancelled() and done.exception() is None:
                done.result().discard()

        def abandon_future(given_up) -> None:  # the step was given up after the worker finished
            if given_up.cancelled() and running.done() and not running.cancelled() and running.exception() is None:
                running.result().discard()

        running.add_done_callback(abandon_result)
        future.add_done_callback(abandon_future)
        return future

    def restart(self) -> None:
        """A new pool in place of a broken one (once: callers racing here find it healthy)."""
        if self.healthy:
            return
        broken, self.executor = self.executor, self._start()
        self.restarts += 1
        self.files.clear()
        remove_shared_files(self.shared_dir, os.getpid())  # what the dead worker left (steps in flight fail)
        log.warning("a pre-processing worker died (out of memory?): worker pool restarted",
                    extra={"restarts": self.restarts})
        broken.shutdown(wait=False, cancel_futures=True)

    def stop(self) -> None:
        """Stop the processes now, also one stuck in a read that never returns (a hung mount): waiting for it
        would keep SIGTERM from stopping the server."""
        processes = list(getattr(self.executor, "_processes", {}).values())  # no public handle on them
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=5)
        self.files.clear()
        remove_shared_files(self.shared_dir, os.getpid())
