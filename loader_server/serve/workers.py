"""Pre-processing worker processes: each turns planned rank-steps into serialized `Pack` messages.

The service sends a worker only sample ids (never file paths from a client); the worker reads the samples
by their index offsets, decodes, tiles, tokenises, assembles the packs and serializes them, so the event
loop only moves finished bytes. Workers start with the `spawn` method: forking a process that runs gRPC
threads is unsafe.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from packfeed.server.serve.packs import IndexRows, build_pack
from packfeed.server.serve.preprocess import SampleReader
from packfeed.server.serve.wire import encode_pack


@dataclass(frozen=True)
class DatasetSource:
    """What a worker needs to read one dataset (server-side configuration only)."""

    index: str
    tokenizer: str
    shard_root: str | None = None


@dataclass
class RankStepWork:
    dataset: str
    epoch: int
    step: int
    rank: int
    packs: list[tuple[np.ndarray, np.ndarray]]  # per microbatch: (sample ids, token limits)
    step_loss_tokens: int
    last_in_epoch: bool


@dataclass
class RankStepResult:
    messages: list[bytes]  # serialized Pack, one per microbatch
    samples: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

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
    rows, reader = _dataset(work.dataset)
    messages, skipped, samples = [], [], 0
    for microbatch, (members, truncate_to) in enumerate(work.packs):
        pack = build_pack(rows, reader, members, truncate_to, work.epoch, work.step, work.rank, microbatch)
        pack.step_loss_tokens = work.step_loss_tokens
        messages.append(encode_pack(pack, len(work.packs), work.last_in_epoch))
        skipped.extend(pack.skipped)
        samples += len(members)
    return RankStepResult(messages, samples, skipped, time.perf_counter() - started)


def start_pool(sources: dict[str, DatasetSource], workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(sources,))
