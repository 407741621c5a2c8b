"""Inside a pre-processing worker process: its set-up (one tokenizer thread, memory kept for reuse and given back
when idle, dying with its server; what it loads and refuses was set up before the fork, by `worker_preload`)
and the step function: read, decode, tile, tokenise and assemble a rank-step's packs, serialized into the
step's shared file."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import sys
import threading
import time

import numpy as np

from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.observe import log
from packfeed.server.serve.cp_shares import cp_shares
from packfeed.server.serve.packs import build_pack
from packfeed.server.serve.preprocess import SampleReader
from packfeed.server.serve.routed import build_routed_pack
from packfeed.server.serve.step_files import TileArena, forget_mapping, write_shared
from packfeed.server.serve.step_work import DatasetSource, RankStepResult, RankStepWork
from packfeed.server.serve.wire import pack_pieces

_DATASETS: dict[str, tuple[IndexRows, SampleReader]] = {}
_WARNED: list[bool] = []  # this worker said once that shared memory is full
_SOURCES: dict[str, DatasetSource] = {}


def init_worker(sources: dict[str, DatasetSource], server_pid: int | None = None) -> None:
    """Set up a pool's worker process (`server_pid`: the server's), or this process for inline use."""
    _SOURCES.update(sources)
    keep_freed_memory(give_back_after=GIVE_BACK_AFTER_S)
    # A worker is one core. The tokenizer's own thread pool would spin between a sample's few short encodes:
    # a twentieth of a worker's CPU, seen in a one-off `perf` profile during the CPU-per-sample benchmark.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if server_pid is not None:
        _die_with(server_pid)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEEP_FREED_BYTES = 128 << 20
_ACTIVITY = {"busy": False, "since": 0.0, "given_back": True, "watched": False}  # for _give_back_when_idle
GIVE_BACK_AFTER_S = 5.0  # a worker that has prepared no step for this long gives its kept memory back


def keep_freed_memory(give_back_after: float | None = None) -> None:
    """Have glibc's malloc keep freed memory for the next allocation, up to KEEP_FREED_BYTES: a server process
    allocates and frees megabytes per step (pixels, message parts, gRPC's buffers), and by default glibc gives
    large blocks back to the kernel at once, so every step pays again for fresh pages, zeroed (seen in a one-off
    `perf` profile of the server process during the CPU-per-sample benchmark). The price: a process's resident
    memory stays up to that much above what it holds, while it is busy. With `give_back_after` (a worker), a
    thread gives the kept memory back once no step has been prepared for that many seconds, so an idle worker
    holds only what it uses. No-op without glibc (musl has no mallopt)."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, 64 << 20)  # blocks under 64 MiB come from (and go back to) the heap
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    if give_back_after is not None and hasattr(libc, "malloc_trim") and not _ACTIVITY["watched"]:
        _ACTIVITY["watched"] = True  # one thread per process, however often a worker is set up
        threading.Thread(target=_give_back_when_idle, args=(give_back_after,), daemon=True,
                         name="packfeed-give-back").start()


def give_back_freed_memory() -> None:
    """Return the memory malloc keeps free to the kernel now (glibc's malloc_trim; no-op elsewhere)."""
    libc = ctypes.CDLL(None) if sys.platform == "linux" else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _give_back_when_idle(after: float) -> None:
    """A worker's thread: give the kept memory back once `after` seconds have passed since the last step ended."""
    while True:
        time.sleep(after / 4)
        if not _ACTIVITY["busy"] and not _ACTIVITY["given_back"] and time.monotonic() - _ACTIVITY["since"] >= after:
            give_back_freed_memory()
            _ACTIVITY["given_back"] = True


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(server_pid: int) -> None:
    """Have the kernel stop this worker when its server goes (Linux): a server killed outright (SIGKILL, the OOM
    killer) cannot stop its workers, which would otherwise live on with their memory, waiting for work."""
    if sys.platform != "linux":
        return
    # The parent is the fork server, which exits once no process holds the write end of its "alive" pipe: the
    # server and, as multiprocessing hands it to every child, this worker. Let go of this copy, so that the fork
    # server follows the server, and the signal below follows the fork server.
    _close_fork_server_pipe()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    try:
        os.kill(server_pid, 0)
    except ProcessLookupError:  # the server went before the request was made
        os._exit(0)


def _close_fork_server_pipe() -> None:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # multiprocessing's own (3.10-3.14), no public handle
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def _dataset(name: str) -> tuple[IndexRows, SampleReader]:
    if name not in _DATASETS:  # opened lazily: a worker pays only for the datasets it serves
        source = _SOURCES[name]
        rows = IndexRows(source.index)
        _DATASETS[name] = rows, SampleReader(rows.info, source.tokenizer, source.shard_root,
                                             source.pixels)
    return _DATASETS[name]


def build_rank_step(work: RankStepWork, shared: str | None = None) -> RankStepResult:
    """Runs in a worker process (messages written into the shared-memory file `shared`), or inline for tests and
    embedded use (`shared` None: the messages as bytes)."""
    _ACTIVITY["busy"] = True
    try:
        return _build_rank_step(work, shared)
    finally:
        _ACTIVITY.update(busy=False, since=time.monotonic(), given_back=False)


def _build_rank_step(work: RankStepWork, shared: str | None) -> RankStepResult:
    started, cpu_started = time.perf_counter(), time.process_time()
    parts = work.reads.parts(_dataset)
    arena = TileArena.open(shared, _tile_bytes(parts, work)) if shared is not None else None
    for _, reader, _ in parts:
        reader.empty = arena.empty if arena is not None else np.empty
        reader.decode_budget = work.decode_budget
    try:
        pieces, skipped, samples, by_dataset = [], [], 0, collections.Counter()
        for microbatch in range(len(work.packs)):
            pack = _microbatch_pack(work, parts, microbatch)
            pieces.extend(_pack_messages(work, parts, pack, microbatch))
            skipped.extend(pack.skipped)
            samples += _prepared_samples(work, microbatch)
            by_dataset.update(pack.sample_sources)
        result = RankStepResult([], samples, skipped, 0.0, dict(by_dataset))
        _hand_over(result, pieces, shared, arena)
    finally:
        for _, reader, _ in parts:
            reader.empty = np.empty
        if shared is not None:  # unmapped once this step's tiles are dropped: see _writable_mapping
            forget_mapping(shared)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _microbatch_pack(work: RankStepWork, parts: list, microbatch: int):
    """A microbatch's pack as this seat gets it: whole, or (isf+phases) with the images routed to the ranks
    that encode them."""
    members, truncate_to, sources = work.packs[microbatch]
    if work.routed is None:
        pack = build_pack(parts, members, truncate_to, sources, work.epoch, work.step, work.seat.rank, microbatch,
                          work.seed, work.reads.shared_prefixes)
    else:
        encoders, encode = work.routed[microbatch]
        pack = build_routed_pack(parts, (members, truncate_to, sources), encoders, encode, work.epoch, work.step,
                                 work.seat.rank, microbatch, work.seed,
                                 encodes_as=-1 if work.layout.encoder_ranks and not work.seat.encoder else None)
        pack.encoder = work.seat.encoder
    pack.step_loss_tokens = work.step_loss_tokens
    work.reads.complete(pack)
    return pack


def _pack_messages(work: RankStepWork, parts: list, pack, microbatch: int) -> list:
    """A pack's message, or with context parallelism its cp shares' messages, one per GPU of the CP group."""
    if work.cp_spans is None:
        return [pack_pieces(pack, len(work.packs), work.last_in_epoch)]
    degree, group = (np.asarray(a)[pack.positions] for a in work.cp_spans[microbatch])
    return [pack_pieces(share, len(work.packs), work.last_in_epoch)
            for share in cp_shares(pack, degree, group, work.layout.cp, parts[0][1].policy.temporal_patch)]


def _prepared_samples(work: RankStepWork, microbatch: int) -> int:
    """The samples this seat prepared in a microbatch: an encoder rank's are those it encodes."""
    if work.seat.encoder:
        return len(work.routed[microbatch][1][0])
    return len(work.packs[microbatch][0])


def _hand_over(result: RankStepResult, pieces: list, shared: str | None, arena) -> None:
    """The messages into the step's shared file, or (none, or no room in shared memory) as bytes."""
    if shared is not None:
        try:
            result.segments = write_shared(shared, pieces, arena)
            result.shared = shared
        except OSError as error:  # no room in shared memory: the bytes travel through the pipe instead
            if not _WARNED:
                _WARNED.append(True)
                log.warning("prepared steps go through a pipe (more CPU per sample): no room in shared memory; "
                            "give the server a larger /dev/shm (docker: shm_size)",
                            extra={"file": shared, "error": str(error)})
    if result.shared is None:
        result.messages = [b"".join(message) for message in pieces]
        if shared is not None:
            _empty(shared)  # what a full /dev/shm let through, and the tiles cut into it, freed at once


def _tile_bytes(parts: list, work: RankStepWork) -> int:
    """Bytes of the step's tiles as the index counts them (none where a dataset sends encoded images)."""
    return sum(parts[k][0].pixel_bytes(ids) for k, ids in work.samples_by_source(pixels_only=True)
               if not parts[k][1].path.sends_files)


def _empty(path: str) -> None:
    forget_mapping(path)
    try:
        os.truncate(path, 0)
    except OSError:
        pass
