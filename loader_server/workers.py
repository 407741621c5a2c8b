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

from packfeed.server.packs import IndexRows, Pack, build_pack
from packfeed.server.preprocess import SampleReader
from packfeed.v1 import packfeed_pb2 as pb


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


def pack_message(pack: Pack, microbatches: int, last_in_epoch: bool) -> pb.Pack:
    message = pb.Pack(epoch=pack.epoch, step=pack.step, rank=pack.rank, microbatch=pack.microbatch,
                      microbatches=microbatches, empty=pack.empty, last_in_epoch=last_in_epoch,
                      sample_keys=pack.sample_keys, loss_tokens=pack.loss_tokens,
                      step_loss_tokens=pack.step_loss_tokens)
    for name, tensor in pack.wire().items():
        message.tensors[name].CopyFrom(pb.Tensor(dtype=tensor.dtype, shape=tensor.shape, data=tensor.data))
    for key, reason in pack.skipped:
        message.skipped.add(key=key, reason=reason, epoch=pack.epoch, step=pack.step)
    return message


def build_rank_step(work: RankStepWork) -> RankStepResult:
    """Runs in a worker process (or inline, for tests and embedded use)."""
    started = time.perf_counter()
    rows, reader = _dataset(work.dataset)
    messages, skipped, samples = [], [], 0
    for microbatch, (members, truncate_to) in enumerate(work.packs):
        pack = build_pack(rows, reader, members, truncate_to, work.epoch, work.step, work.rank, microbatch)
        pack.step_loss_tokens = work.step_loss_tokens
        messages.append(pack_message(pack, len(work.packs), work.last_in_epoch).SerializeToString())
        skipped.extend(pack.skipped)
        samples += len(members)
    return RankStepResult(messages, samples, skipped, time.perf_counter() - started)


def start_pool(sources: dict[str, DatasetSource], workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(sources,))
