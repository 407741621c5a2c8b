"""Shard bytes for serving: a sample's members read at the offsets the index recorded (os.pread on a local
shard, one range request per sample on an object store, read ahead for a pack), each verified against the
checksum and object stamp the index recorded. What cannot be read, or is not what was indexed, is a
`SampleSkipped` with the reason."""

from __future__ import annotations

import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from packfeed.media.storage import ObjectError, StampCache, is_object_url, read_range, relocate
from packfeed.server.index.shards import is_compressed
from packfeed.server.index.table import member_checksum


class SampleSkipped(Exception):
    """The sample cannot be served any more (shard changed or vanished, image no longer decodes, ...)."""



# Range requests in flight per worker while a pack's samples are read from an object store (1: one at a time).
PREFETCH_THREADS = int(os.environ.get("PACKFEED_RANGE_THREADS", "16"))


def _span(row: dict[str, Any]) -> tuple[int, int]:
    """(start, end) of the bytes holding the sample's members, its JSON, images and videos (together in the tar)."""
    spans = [(row["json_offset"], row["json_size"])] + list(zip(row["image_offsets"], row["image_sizes"]))
    spans += [(offset, size) for offset, size in zip(row["video_offsets"] or [], row["video_sizes"] or []) if size]
    return min(offset for offset, _ in spans), max(offset + size for offset, size in spans)




class ShardReader:
    """Random access to the members of indexed samples. Thread-safe: reads use os.pread on shared descriptors."""

    def __init__(self, shard_root: str | os.PathLike | None = None, objects: dict[str, dict] | None = None):
        self.shard_root = str(shard_root) if shard_root else None
        self.objects = objects or {}  # object-store shards: {url: {size, etag}} as indexed
        self._stamps = StampCache()
        self._prefetched: dict[str, bytes | SampleSkipped] = {}  # key -> its members' span, read ahead
        self._fetchers: ThreadPoolExecutor | None = None
        self._descriptors: dict[str, int] = {}
        self._lock = threading.Lock()

    def prefetch(self, rows: list[dict[str, Any]]) -> None:
        """Read the spans of these samples' members concurrently where they lie in an object store (a range
        request's latency, tens of ms, would otherwise be paid once per sample in turn); `reader` takes them."""
        self._prefetched.clear()  # what an earlier pack left (a sample it never loaded) goes
        remote = [row for row in rows if row["valid"] and is_object_url(relocate(row["shard"], self.shard_root))]
        if len(remote) < 2 or PREFETCH_THREADS < 2:
            return
        if self._fetchers is None:
            self._fetchers = ThreadPoolExecutor(max_workers=PREFETCH_THREADS, thread_name_prefix="packfeed-range")

        def fetch(row: dict[str, Any]) -> bytes | SampleSkipped:
            try:
                return self._object_span(row)
            except SampleSkipped as error:
                return error

        self._prefetched.update(zip((row["key"] for row in remote), self._fetchers.map(fetch, remote)))

    def reader(self, row: dict[str, Any]):
        """read(offset, size) -> bytes for the sample's members: pread on a local shard; on an object, one range
        request for all of them (they lie together in the tar), after checking the object is the one indexed."""
        path = relocate(row["shard"], self.shard_root)
        if not is_object_url(path):
            fd = self._descriptor(path)
            return lambda offset, size: os.pread(fd, size, offset)
        start = _span(row)[0]
        data = self._prefetched.pop(row["key"], None) or self._object_span(row)
        if isinstance(data, SampleSkipped):
            raise data
        return lambda offset, size: data[offset - start:offset - start + size]

    def _object_span(self, row: dict[str, Any]) -> bytes:
        """The bytes from the sample's first member to the end of its last, in one range request, after
        checking that the object is the one indexed."""
        shard = row["shard"]
        path = relocate(shard, self.shard_root)
        self._check_object(shard, path)
        start, end = _span(row)
        try:
            return read_range(path, start, end - start, self._stamps.get(path).etag)
        except ObjectError as error:
            # a read that fails may have met an object changed since its stamp was cached: say so when it is
            self._check_object(shard, path, fresh=True)
            raise SampleSkipped(f"shard unreadable: {error}") from None

    def _check_object(self, shard: str, path: str, fresh: bool = False) -> None:
        """Skip a sample whose object is gone or is not the one indexed (its stamp looked up within the cache's
        TTL, or now with `fresh`)."""
        try:
            current = self._stamps.get(path, fresh)
        except ObjectError as error:
            raise SampleSkipped(f"shard unreadable: {error}") from None
        indexed = self.objects.get(shard)
        if path == shard and indexed and (current.size, current.etag) != (indexed["size"], indexed["etag"]):
            raise SampleSkipped(f"shard changed: {path} is now {current.size} bytes, ETag {current.etag!r} (indexed: "
                                f"{indexed['size']} bytes, ETag {indexed['etag']!r})")

    def _descriptor(self, path: str) -> int:
        """An open descriptor for the shard; a vanished shard raises, a replaced one is reopened. Only regular
        files are opened: a FIFO or device could block the worker forever, a directory cannot be read."""
        try:
            current = os.stat(path)
        except OSError as error:
            raise SampleSkipped(f"shard unreadable: {error.strerror} ({path})") from None
        with self._lock:
            fd = self._descriptors.get(path)
            if fd is not None and os.fstat(fd).st_ino != current.st_ino:
                os.close(self._descriptors.pop(path))  # replaced on disk: read the new file (checked per member)
                fd = None
            if fd is None:
                if not stat.S_ISREG(current.st_mode):
                    raise SampleSkipped(f"shard unreadable: {path} is not a regular file")
                try:
                    if is_compressed(path):
                        raise SampleSkipped(f"shard unreadable: {path} is compressed: serving needs plain .tar shards")
                    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                except OSError as error:
                    raise SampleSkipped(f"shard unreadable: {error.strerror} ({path})") from None
                self._descriptors[path] = fd
            return fd

    def member(self, read, offset: int, size: int, checksum: int | None, what: str) -> bytes:
        """A member's bytes, verified against the checksum the index recorded."""
        try:
            data = read(offset, size)
        except OSError as error:
            raise SampleSkipped(f"shard unreadable: {error.strerror} reading {what}") from None
        if len(data) != size:
            raise SampleSkipped(f"shard changed: {what} ends past the end of the file")
        if checksum is not None and member_checksum(data) != checksum:
            raise SampleSkipped(f"shard changed: {what} differs from the indexed content (checksum)")
        return data

    def close(self) -> None:
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False)
        with self._lock:
            for fd in self._descriptors.values():
                os.close(fd)
            self._descriptors.clear()
