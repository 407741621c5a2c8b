"""Prepared steps from the workers to the server through files in shared memory: the server's pool of files used
again and again (`SharedFiles`), a worker writing a step's messages into one (tiles cut in place through a
`TileArena`), and the clean-up of files nobody will read. A step's bytes are copied once, never pickled."""

from __future__ import annotations

import glob
import mmap
import os
import tempfile
import threading
import uuid

import numpy as np

SHARED_PREFIX = "packfeed-step-"  # + the server's pid + a random name: files of prepared steps in shared memory


def give_back_file(files: "SharedFiles | None", path: str) -> None:
    if files is not None:
        files.give_back(path)
    else:  # not from a pool (inline use): the file was this result's alone
        unlink(path)


def map_file(path: str) -> mmap.mmap:
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
                mapping = self._maps[path] = map_file(path)  # the old one goes once nothing views it
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
            unlink(path)

    def clear(self) -> None:
        """Forget the files (their owner removes them) and drop their mappings."""
        with self._lock:
            self._free.clear()
            self._maps.clear()


# A file holds at most twice the step it carries and this much (the worker cuts it): a small step's file keeps
# room for its spare.
_SLACK = 1 << 20


class TileArena:
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
    def open(cls, path: str, capacity: int) -> "TileArena | None":
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


def write_shared(path: str, messages: list[list], arena: TileArena | None = None) -> list[list[tuple[int, int]]]:
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
        forget_mapping(path)
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
        forget_mapping(path)
        mapping = _MAPPED[path] = _map(fd, size, writable=True)
    for gone in [other for other in _MAPPED if other != path and not os.path.exists(other)]:
        forget_mapping(gone)
    return mapping


def forget_mapping(path: str) -> None:
    mapping = _MAPPED.pop(path, None)
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass  # tiles cut into it are still viewed: it is unmapped when the last of them goes


def unlink(path: str) -> None:
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
        unlink(path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
