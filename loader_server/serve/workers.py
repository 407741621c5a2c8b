"""Pre-processing worker processes: each turns planned rank-steps into serialized `Pack` messages.

The service sends a worker only sample ids (never file paths from a client); the worker reads the samples
by their index offsets, decodes, tiles, tokenises, assembles the packs and serializes them, so the event
loop only moves finished bytes. Workers start with the `spawn` method: forking a process that runs gRPC
threads is unsafe.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from packfeed.server.serve.packs import IndexRows, build_pack
from packfeed.server.serve.preprocess import SampleReader
from packfeed.server.serve.observe import log
from packfeed.server.serve.wire import encode_pack


@dataclass(frozen=True)
class DatasetSource:
    """What a worker needs to read one dataset (server-side configuration only)."""

    index: str
    tokenizer: str
    shard_root: str | None = None


@dataclass
class RankStepWork:
    datasets: tuple[str, ...]  # the worker's names of the indexes a member's source counts in
    labels: tuple[str, ...]  # the dataset names the packs carry (`sample_sources`), one per index
    epoch: int
    step: int
    rank: int
    packs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per microbatch: (sample ids, token limits, sources)
    step_loss_tokens: int
    last_in_epoch: bool


@dataclass
class RankStepResult:
    messages: list[bytes]  # serialized Pack, one per microbatch
    samples: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    by_dataset: dict[str, int] = field(default_factory=dict)  # samples delivered per dataset

    @property
    def nbytes(self) -> int:
        return sum(len(m) for m in self.messages)


_DATASETS: dict[str, tuple[IndexRows, SampleReader]] = {}
_SOURCES: dict[str, DatasetSource] = {}


def _init_worker(sources: dict[str, DatasetSource]) -> None:
    _SOURCES.update(sources)


def _dataset(name: str) -> tuple[IndexRows, SampleReader]:
    if name not in _DATASETS:  # opened lazily: a worker pays only for the datasets it serves
        source = _SOURCES[name]
        rows = IndexRows(source.index)
        _DATASETS[name] = rows, SampleReader(rows.info, source.tokenizer, source.shard_root)
    return _DATASETS[name]


def build_rank_step(work: RankStepWork) -> RankStepResult:
    """Runs in a worker process (or inline, for tests and embedded use)."""
    started = time.perf_counter()
    parts = [(*_dataset(name), label) for name, label in zip(work.datasets, work.labels)]
    messages, skipped, samples, by_dataset = [], [], 0, collections.Counter()
    for microbatch, (members, truncate_to, sources) in enumerate(work.packs):
        pack = build_pack(parts, members, truncate_to, sources, work.epoch, work.step, work.rank, microbatch)
        pack.step_loss_tokens = work.step_loss_tokens
        messages.append(encode_pack(pack, len(work.packs), work.last_in_epoch))
        skipped.extend(pack.skipped)
        samples += len(members)
        by_dataset.update(pack.sample_sources)
    return RankStepResult(messages, samples, skipped, time.perf_counter() - started, dict(by_dataset))


class WorkerPool:
    """The pre-processing processes. A worker that dies (the OOM killer, a crash in a decoder) breaks a
    ProcessPoolExecutor for good; here the pool is started afresh, the steps it held fail with a retryable
    error, and `healthy` tells the health service meanwhile."""

    def __init__(self, sources: dict[str, DatasetSource], workers: int):
        self.sources, self.workers = sources, workers
        self.executor = self._start()
        self.restarts = 0

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.sources,))

    @property
    def healthy(self) -> bool:
        return not getattr(self.executor, "_broken", False)

    def run(self, work: RankStepWork) -> asyncio.Future:
        """build_rank_step(work) in a worker, as an asyncio future."""
        if not self.healthy:
            self.restart()
        return asyncio.get_running_loop().run_in_executor(self.executor, build_rank_step, work)

    def restart(self) -> None:
        """A new pool in place of a broken one (once: callers racing here find it healthy)."""
        if self.healthy:
            return
        broken, self.executor = self.executor, self._start()
        self.restarts += 1
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
