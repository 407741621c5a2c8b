"""Pre-processing worker processes: each turns planned rank-steps into serialized `Pack` messages.

The service sends a worker only sample ids (never file paths from a client); the worker reads the samples
by their index offsets, decodes, tiles, tokenises, assembles the packs and serializes them, so the event
loop only moves finished bytes. Workers start with the `spawn` method: forking a process that runs gRPC
threads is unsafe.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import glob
import importlib.abc
import mmap
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from packfeed.server.serve.packs import IndexRows, build_pack
from packfeed.server.serve.routed import build_routed_pack
from packfeed.server.serve.preprocess import SampleReader
from packfeed.server.serve.observe import log
from packfeed.server.serve.wire import SplitMessage, pack_pieces

SHARED_PREFIX = "packfeed-step-"  # + the server's pid + a random name: files of prepared steps in shared memory


@dataclass(frozen=True)
class DatasetSource:
    """What a worker needs to read one dataset (server-side configuration only)."""

    index: str
    tokenizer: str
    shard_root: str | None = None
    pixels: str = "exact"  # how images become tiles (packfeed.server.serve.preprocess.PIXEL_MODES)


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
    seed: int = 0  # the job's: random video frames are drawn from (seed, epoch, sample key)
    # isf+phases (`packfeed.server.serve.routed`), per microbatch: the rank encoding each member of the pack, and
    # what this rank encodes there (sample ids, sources, targets: consumer rank and planned position)
    routed: list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]] | None = None
    # bytes decoding one image or tokenising one sample may take (MemoryBudget.working_limit): a sample needing
    # more is skipped, with its reason, instead of prepared; 0: no limit
    decode_budget: int = 0

    def samples_by_source(self, pixels_only: bool = False) -> list[tuple[int, np.ndarray]]:
        """(source k, its sample ids) for each index the step reads, every pack's samples together: a step's
        per-index reads (budget estimates, tile bytes) read each column once per step, not once per pack.
        `pixels_only`: the samples whose images this rank reads (routed: those it encodes)."""
        groups = [(ids, sources) for ids, _, sources in self.packs] if not (pixels_only and self.routed) else []
        groups += [(ids, sources) for _, (ids, sources, _) in self.routed or ()]
        ids = np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in groups] or [np.zeros(0, np.int64)])
        sources = np.concatenate([np.asarray(sources) for _, sources in groups] or [np.zeros(0, np.int32)])
        chosen = [(k, ids[sources == k]) for k in range(len(self.datasets))]
        return [(k, source_ids) for k, source_ids in chosen if len(source_ids)]


@dataclass
class RankStepResult:
    """A prepared rank-step. From a worker process the messages travel in a file in shared memory (`shared`,
    where each lies: its `segments`), not through pickling: `attach()` maps the file, and the messages are then
    views of the mapping; once the last of them is dropped the file goes back to the server's pool (`files`)
    to carry another step (without a pool it is removed)."""

    messages: list  # serialized Pack, one per microbatch: bytes, or views of the attached mapping (SplitMessage)
    samples: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    by_dataset: dict[str, int] = field(default_factory=dict)  # samples delivered per dataset
    shared: str | None = None  # the file holding the messages, until attached
    segments: list[list[tuple[int, int]]] = field(default_factory=list)  # per message: (offset, bytes) in order
    files: "SharedFiles | None" = field(default=None, repr=False)  # the server's pool the file comes from

    def __getstate__(self) -> dict:
        return {**self.__dict__, "files": None}  # the server's pool never travels to or from a worker

    @property
    def nbytes(self) -> int:
        if self.segments:
            return sum(length for spans in self.segments for _, length in spans)
        return sum(len(m) for m in self.messages)

    def attach(self) -> "RankStepResult":
        if self.shared is None:
            return self
        path, self.shared = self.shared, None
        end = max((offset + length for spans in self.segments for offset, length in spans), default=0)
        if not end:
            _give_back(self.files, path)
            self.messages = [b"" for _ in self.segments]
            return self
        try:
            view = self.files.view(path, end) if self.files else np.frombuffer(_map_file(path), np.uint8, end)
        except OSError:
            _give_back(self.files, path)
            raise
        # once no message views it any more (the callback must not hold the result: it holds the views)
        weakref.finalize(view, _give_back, self.files, path)
        views = [[memoryview(view[offset:offset + length]) for offset, length in spans] for spans in self.segments]
        self.messages = [spans[0] if len(spans) == 1 else SplitMessage(tuple(spans)) if spans else b""
                         for spans in views]
        return self

    def discard(self) -> None:
        """Give back the file of a result nobody will attach (its step was abandoned)."""
        if self.shared is not None:
            path, self.shared = self.shared, None
            _give_back(self.files, path)


def _give_back(files: "SharedFiles | None", path: str) -> None:
    if files is not None:
        files.give_back(path)
    else:  # not from a pool (inline use): the file was this result's alone
        _unlink(path)


def _map_file(path: str) -> mmap.mmap:
    """The whole file, mapped read-only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _map(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _map(fd: int, size: int, writable: bool = False) -> mmap.mmap:
    """The first `size` bytes of an open file, mapped shared. MAP_POPULATE maps every page at once instead of
    faulting them in one by one as they are used."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))


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
        self._steps: dict[tuple[int, int, int], list] = {}  # (rank, epoch, step) -> [future, takers]

    def take(self, key: tuple[int, int, int],
             start: Callable[[], asyncio.Future]) -> tuple[asyncio.Future, bool]:
        """The step's preparation, and whether this call started it (`start()`): it does unless another taker
        holds one that has not failed."""
        entry = self._steps.get(key)
        started = entry is None or (entry[0].done() and (entry[0].cancelled() or entry[0].exception() is not None))
        if started:
            entry = self._steps[key] = [start(), entry[1] if entry else 0]
        entry[1] += 1
        return entry[0], started

    def give_back(self, key: tuple[int, int, int]) -> None:
        entry = self._steps.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._steps[key]
            abandon(entry[0])  # unfinished: cancelled; finished but never attached: its file removed


def shared_directory() -> str:
    """Where workers put prepared steps: /dev/shm (memory) when there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class SharedFiles:
    """The files in shared memory that carry prepared steps from the workers to the server, used again and again.

    Writing a step into a new file costs the kernel a fresh page for every 4 KiB (allocated, charged, copied
    into cold memory), and the server's new mapping faults them in again: 5.4 ms of CPU per 8 MB step here,
    written, mapped and copied out, against 1.3 ms into the pages of a file written before, through a mapping
    the server keeps (`view`; BENCHMARKS.md "Handing steps over"). So the server gives each step a file from
    this pool; once the step is sent (its last view dropped) the file comes back, pages and mapping and all,
    for another step. Files come back while the pool holds under `keep_bytes` (a quarter of the server's memory
    budget) of free ones; past that they are removed. A file keeps at most twice the bytes of the step it
    carries and 1 MiB (the worker cuts it), so shared memory holds at most twice the budget's steps in flight, plus
    `keep_bytes`. Files are named after the server process, so a stop (or the next start, after a kill)
    removes them all. Thread-safe: files come back from whichever thread drops a step's last view."""

    def __init__(self, directory: str, keep_bytes: int):
        self.directory, self.keep_bytes = directory, keep_bytes
        self._free: list[tuple[str, int]] = []  # (path, bytes)
        self._maps: dict[str, mmap.mmap] = {}  # the server's mapping of each file, kept from step to step
        self._lock = threading.Lock()
        self.created = 0

    def take(self) -> str:
        """A file for one step: the free one given back last (its pages the likeliest in the CPU's caches)."""
        with self._lock:
            if self._free:
                return self._free.pop()[0]
            self.created += 1
        return os.path.join(self.directory, f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")

    def view(self, path: str, nbytes: int) -> np.ndarray:
        """The first `nbytes` of the file at `path`, read-only, through a mapping kept for the file (made again
        only when the file outgrew it): the server maps and unmaps nothing per step. Raises OSError."""
        with self._lock:
            mapping = self._maps.get(path)
            if mapping is None or len(mapping) < nbytes:
                mapping = self._maps[path] = _map_file(path)  # the old one goes once nothing views it
        return np.frombuffer(mapping, np.uint8, nbytes)

    def give_back(self, path: str) -> None:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None  # never written (the worker fell back to the pipe), or removed by a pool restart
        with self._lock:
            if size is not None and sum(nbytes for _, nbytes in self._free) + size <= self.keep_bytes:
                self._free.append((path, size))
                return
            self._maps.pop(path, None)  # unmapped once nothing views it
        if size is not None:
            _unlink(path)

    def clear(self) -> None:
        """Forget the files (their owner removes them) and drop their mappings."""
        with self._lock:
            self._free.clear()
            self._maps.clear()


# A file holds at most twice the step it carries and this much (the worker cuts it): a small step's file keeps
# room for its spare.
_SLACK = 1 << 20


class _TileArena:
    """Tiles cut straight into the step's shared file: `empty` hands out the file's next bytes, through this
    worker's mapping of it, while there is room (then the worker's own memory), so a tile is written once,
    where the server reads it, instead of into the worker's memory and then copied into the file. Only a file
    that holds the step's tiles already (as the index counts them) gets an arena: its pages exist, so a write
    through the mapping cannot meet a full /dev/shm (a SIGBUS). A new or smaller file is written as before
    (pwritev allocates its pages as it copies, and meets a full /dev/shm as an OSError), and grown with a
    quarter to spare for the steps after it."""

    def __init__(self, mapping: mmap.mmap, capacity: int):
        self.mapping = mapping
        self.buffer = np.frombuffer(mapping, np.uint8, capacity)
        self.address = self.buffer.ctypes.data
        self.used = 0

    @classmethod
    def open(cls, path: str, capacity: int) -> "_TileArena | None":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None  # a new file
        try:
            size = os.fstat(fd).st_size
            if not capacity or size < capacity:
                return None
            return cls(_writable_mapping(path, fd, size), capacity)
        finally:
            os.close(fd)

    def empty(self, shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.used + nbytes > len(self.buffer):
            return np.empty(shape, dtype)
        array = self.buffer[self.used:self.used + nbytes].view(dtype).reshape(shape)
        self.used += nbytes
        return array

    def offset(self, piece) -> int | None:
        """Where `piece` (a buffer) lies in the file, if it is a tile cut here."""
        offset = np.frombuffer(piece, np.uint8).ctypes.data - self.address
        return offset if 0 <= offset and offset + len(piece) <= self.used else None


def _write_shared(path: str, messages: list[list], arena: _TileArena | None = None) -> list[list[tuple[int, int]]]:
    """Each message's pieces laid out in the file at `path` (made if missing; a longer file keeps its tail,
    unread): a piece cut in `arena` stays where it is, the others are written back to back after the arena's
    tiles. Returns each message's segments, (offset, bytes) in order. What fits in the file as it is goes
    through this worker's mapping of it (`_writable_mapping`): a plain copy into pages that are there, a third of
    the CPU of pwritev, which spends it in the kernel's work per page (BENCHMARKS.md "Handing steps over").
    What goes past its end is written with pwritev, which allocates the new pages as it copies (growing the file
    first and writing through a mapping would clear every new page before the copy, and a full /dev/shm would
    be a SIGBUS, not an error): a full /dev/shm is an OSError here (the caller sends the bytes instead, and
    empties the file). A worker whose server is gone (it is then a child of init) writes nothing."""
    if os.getppid() == 1:
        raise OSError("the server process is gone")
    start = arena.used if arena is not None else 0
    segments, loose, end = [], [], start
    for pieces in messages:
        spans: list[tuple[int, int]] = []
        for piece in pieces:
            if not len(piece):
                continue
            at = arena.offset(piece) if arena is not None else None
            if at is None:
                loose.append(piece)
                at, end = end, end + len(piece)
            if spans and sum(spans[-1]) == at:
                spans[-1] = (spans[-1][0], spans[-1][1] + len(piece))
            else:
                spans.append((at, len(piece)))
        segments.append(spans)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size > 2 * end + _SLACK:  # a file an earlier, larger step grew holds no more than twice this one
            size = 2 * end + _SLACK
            os.ftruncate(fd, size)
        fits = max(0, min(size, end) - start)
        if fits:  # the arena's mapping covers the file as it was when the step began (a cut only shortens it)
            mapping = arena.mapping if arena is not None else _writable_mapping(path, fd, size)
            _copy_into(mapping, start, loose, fits)
        if end > start + fits:
            _pwrite_all(fd, _advance(loose, fits), start + fits)
            _spare(fd, end, end // 4)
    except BaseException:
        _forget_mapping(path)
        raise
    finally:
        os.close(fd)
    return segments


def _spare(fd: int, end: int, nbytes: int) -> None:
    """Room allocated past a grown file's end, so that the next, larger steps fit it (through the mapping, tiles
    cut in place) without growing it again; none where shared memory has no room for it."""
    try:
        os.posix_fallocate(fd, end, nbytes)
    except OSError:
        pass


def _copy_into(mapping: mmap.mmap, start: int, pieces: list, nbytes: int) -> None:
    """The first `nbytes` of the pieces, back to back, copied into `mapping` from `start`."""
    offset = start
    for piece in pieces:
        count = min(len(piece), start + nbytes - offset)
        if count <= 0:
            return
        mapping[offset:offset + count] = piece if count == len(piece) else memoryview(piece)[:count]
        offset += count


def _pwrite_all(fd: int, pieces: list, offset: int = 0) -> None:
    while pieces:
        written = os.pwritev(fd, pieces[:_IOV_MAX], offset)
        offset += written
        pieces = _advance(pieces, written)


_IOV_MAX = 1024  # pieces per writev call (the Linux limit)


def _advance(pieces: list, written: int) -> list:
    """The pieces still to write after `written` bytes of them went out (writev may write fewer than asked)."""
    while pieces and written >= len(pieces[0]):
        written -= len(pieces[0])
        pieces = pieces[1:]
    if written:
        pieces = [memoryview(pieces[0])[written:], *pieces[1:]]
    return pieces


_MAPPED: dict[str, mmap.mmap] = {}  # a worker's writable mapping of the shared file of the step it prepares


def _writable_mapping(path: str, fd: int, size: int) -> mmap.mmap:
    """The whole file (`size` bytes), mapped for writing (MAP_POPULATE: its pages, there already, are mapped in
    one go), for the step being prepared: dropped when it is done, since a mapping kept between steps counts the
    file's pages in the worker's resident memory as well as in the server's (38 MiB a file with 448 px tiles;
    the steps' bytes are the budget's and the server's). Mappings of files the server has removed are dropped
    here too."""
    mapping = _MAPPED.get(path)
    if mapping is None or len(mapping) != size:
        _forget_mapping(path)
        mapping = _MAPPED[path] = _map(fd, size, writable=True)
    for gone in [other for other in _MAPPED if other != path and not os.path.exists(other)]:
        _forget_mapping(gone)
    return mapping


def _forget_mapping(path: str) -> None:
    mapping = _MAPPED.pop(path, None)
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass  # tiles cut into it are still viewed: it is unmapped when the last of them goes


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_shared_files(directory: str, server_pid: int | None = None) -> None:
    """Files workers wrote that nobody will attach: this server's (a worker killed mid-step, a stop), or with
    `server_pid` None those of every server process that no longer runs (one killed before it could clean up)."""
    for path in glob.glob(os.path.join(directory, f"{SHARED_PREFIX}*-*")):
        owner = os.path.basename(path)[len(SHARED_PREFIX):].split("-", 1)[0]
        if server_pid is not None and owner != str(server_pid):
            continue
        if server_pid is None and owner.isdigit() and _running(int(owner)):
            continue
        _unlink(path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


_DATASETS: dict[str, tuple[IndexRows, SampleReader]] = {}
_WARNED: list[bool] = []  # this worker said once that shared memory is full
_SOURCES: dict[str, DatasetSource] = {}


class _NotInWorkers(importlib.abc.MetaPathFinder):
    """Refuses to import pandas in a worker, as if it were not installed: pyarrow imports it (about 45 MiB
    resident) the first time it builds an array, only to check whether the values are pandas objects, and
    carries on without it where it is missing."""

    REFUSED = ("pandas",)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.REFUSED:
            raise ModuleNotFoundError(f"{name} is not imported in Packfeed's pre-processing workers", name=name)
        return None


def _init_worker(sources: dict[str, DatasetSource], server_pid: int | None = None) -> None:
    """Set up a pool's worker process (`server_pid`: the server's), or this process for inline use."""
    _SOURCES.update(sources)
    if server_pid is not None and not any(isinstance(finder, _NotInWorkers) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NotInWorkers())
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
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server_pid:  # the server went before the request was made
        os._exit(0)


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
    started = time.perf_counter()
    parts = [(*_dataset(name), label) for name, label in zip(work.datasets, work.labels)]
    arena = _TileArena.open(shared, _tile_bytes(parts, work)) if shared is not None else None
    for _, reader, _ in parts:
        reader.empty = arena.empty if arena is not None else np.empty
        reader.decode_budget = work.decode_budget
    try:
        pieces, skipped, samples, by_dataset = [], [], 0, collections.Counter()
        for microbatch, (members, truncate_to, sources) in enumerate(work.packs):
            if work.routed is not None:
                encoders, encode = work.routed[microbatch]
                pack = build_routed_pack(parts, (members, truncate_to, sources), encoders, encode, work.epoch,
                                         work.step, work.rank, microbatch, work.seed)
            else:
                pack = build_pack(parts, members, truncate_to, sources, work.epoch, work.step, work.rank,
                                  microbatch, work.seed)
            pack.step_loss_tokens = work.step_loss_tokens
            pieces.append(pack_pieces(pack, len(work.packs), work.last_in_epoch))
            skipped.extend(pack.skipped)
            samples += len(members)
            by_dataset.update(pack.sample_sources)
        result = RankStepResult([], samples, skipped, 0.0, dict(by_dataset))
        if shared is not None:
            try:
                result.segments = _write_shared(shared, pieces, arena)
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
    finally:
        for _, reader, _ in parts:
            reader.empty = np.empty
        if shared is not None:  # unmapped once this step's tiles are dropped: see _writable_mapping
            _forget_mapping(shared)
    result.seconds = time.perf_counter() - started
    return result


def _tile_bytes(parts: list, work: RankStepWork) -> int:
    """Bytes of the step's tiles as the index counts them (none where a dataset sends encoded images)."""
    return sum(parts[k][0].pixel_bytes(ids) for k, ids in work.samples_by_source(pixels_only=True)
               if parts[k][1].pixels != "encoded")


def _empty(path: str) -> None:
    _forget_mapping(path)
    try:
        os.truncate(path, 0)
    except OSError:
        pass


class WorkerPool:
    """The pre-processing processes. A worker that dies (the OOM killer, a crash in a decoder) breaks a
    ProcessPoolExecutor for good; here the pool is started afresh, the steps it held fail with a retryable
    error, and `healthy` tells the health service meanwhile."""

    def __init__(self, sources: dict[str, DatasetSource], workers: int, keep_shared_bytes: int = 1 << 30):
        self.sources, self.workers = sources, workers
        self.shared_dir = shared_directory()
        remove_shared_files(self.shared_dir)  # left by servers that were killed
        self.files = SharedFiles(self.shared_dir, keep_shared_bytes)
        self.executor = self._start()
        self.restarts = 0

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.sources, os.getpid()))

    @property
    def healthy(self) -> bool:
        return not getattr(self.executor, "_broken", False)

    def run(self, work: RankStepWork) -> asyncio.Future:
        """build_rank_step(work) in a worker, as an asyncio future, its result attached (messages readable).
        Cancelling the future abandons the step: its shared file is removed whenever the worker finishes."""
        if not self.healthy:
            self.restart()
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
