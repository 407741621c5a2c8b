"""Where shards live: local files, or objects in S3, Google Cloud Storage, Azure or behind HTTP(S), read
through fsspec (`pip install 'packfeed[s3]'`, `[gcs]`, `[azure]`; http(s) needs only aiohttp).

Indexing streams each object once (`open_object`); serving reads each sample with one HTTP range request at
the offsets the index recorded (`read_range`), never whole shards. The object's size and ETag are recorded at
indexing (`Stamp`) and checked when serving, so a changed or vanished object is detected and its samples
skipped, as for local shards.

Credentials come from each cloud's standard environment and configuration (AWS_* variables and
~/.aws, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); `AWS_ENDPOINT_URL` points S3 at an S3-compatible
store. Every request is retried with exponential backoff and full jitter (0.1 s doubling, at most 5 s) on
throttling (429, 503 SlowDown), timeouts and dropped connections, `PACKFEED_OBJECT_ATTEMPTS` times (default 6);
S3 requests also go through botocore's standard retries (`PACKFEED_S3_ATTEMPTS`, default 3) over a pool of
`PACKFEED_S3_CONNECTIONS` connections (default 64). A request that gets no answer within
`PACKFEED_OBJECT_TIMEOUT_S` (default 60) counts as failed, and a sample's range stops being retried after
`PACKFEED_RANGE_DEADLINE_S` (default 120): the sample is skipped and reported ("shard unreadable ... past the
deadline"), so a store that stalls holds a worker, and the ranks waiting on it, for a bounded time. With
`PACKFEED_RANGE_CACHE_DIR` set, ranges read are kept on local disk (`RangeCache`, at most
`PACKFEED_RANGE_CACHE_MB`) for later epochs.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

OBJECT_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "http://", "https://")
_EXTRAS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "http": "http", "https": "http"}


class ObjectError(OSError):
    """An object cannot be read (missing, forbidden, unreachable after retries); the message says which."""


class ObjectNotFound(ObjectError):
    """The store says there is no such object."""


def is_object_url(url: str) -> bool:
    return url.startswith(OBJECT_SCHEMES)


def _scheme(url: str) -> str:
    return url.split("://", 1)[0]


@functools.lru_cache(maxsize=None)
def _filesystem(scheme: str, settings: tuple):
    try:
        import fsspec

        timeout = float(settings[0])
        if scheme == "s3":
            _, endpoint, attempts, connections = settings
            fs = fsspec.filesystem("s3", skip_instance_cache=True, endpoint_url=endpoint or None, config_kwargs={
                "retries": {"max_attempts": int(attempts), "mode": "standard"},
                "connect_timeout": min(10.0, timeout), "read_timeout": timeout,
                "max_pool_connections": int(connections)})
            fs.retries = 1  # s3fs's own loop (5 tries, on timeouts too) would hide time from the deadline: `retried` retries
            return fs
        if scheme in ("http", "https"):
            import aiohttp

            return fsspec.filesystem(scheme, skip_instance_cache=True,
                                     client_kwargs={"timeout": aiohttp.ClientTimeout(sock_read=timeout,
                                                                                     sock_connect=min(10.0, timeout))})
        return fsspec.filesystem(scheme, skip_instance_cache=True)
    except ImportError as error:
        raise ObjectError(f"reading {scheme}:// needs its fsspec backend: pip install 'packfeed[{_EXTRAS[scheme]}]' "
                          f"({error})") from None


# A forked process (the indexer's pool) must not use its parent's clients: their event loop and connections
# stayed with the parent (s3fs refuses: "This class is not fork-safe").
os.register_at_fork(after_in_child=_filesystem.cache_clear)


def filesystem(url: str):
    """The fsspec filesystem of an object URL (one per scheme and settings in a process: its connection pool is
    shared)."""
    scheme = _scheme(url)
    settings = (os.environ.get("PACKFEED_OBJECT_TIMEOUT_S", "60"),)
    if scheme == "s3":
        settings += (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", ""),
                     os.environ.get("PACKFEED_S3_ATTEMPTS", "3"), os.environ.get("PACKFEED_S3_CONNECTIONS", "64"))
    return _filesystem(scheme, settings)


def retried(url: str, what: str, function, *args, deadline_s: float | None = None, **kwargs):
    """function(*args, **kwargs), retried with exponential backoff and full jitter on any failure but a missing
    or forbidden object: throttling (429, 503 SlowDown), timeouts and dropped connections of every backend
    (botocore's own retries classify a 429 without an error body, as on a HEAD, as final). With `deadline_s`,
    no attempt starts after that many seconds."""
    attempts = max(1, int(os.environ.get("PACKFEED_OBJECT_ATTEMPTS", "6")))
    started = time.monotonic()
    for attempt in range(attempts):
        try:
            return function(*args, **kwargs)
        except FileNotFoundError:
            raise ObjectNotFound(f"object not found: {url}") from None
        except PermissionError as error:
            raise ObjectError(f"access denied to {url}: {error}") from None
        except Exception as error:  # botocore, aiohttp and fsspec raise many types
            pause = random.uniform(0, min(_BACKOFF_CAP_S, _BACKOFF_S * 2 ** attempt))
            late = deadline_s is not None and time.monotonic() + pause - started > deadline_s
            if attempt + 1 == attempts or late:
                spent = f"{attempt + 1} attempts" + (f" in {time.monotonic() - started:.1f} s, past the deadline "
                                                     f"of {deadline_s:g} s" if late else "")
                raise ObjectError(f"{what} {url} failed after {spent}: {type(error).__name__}: {error}") from None
            time.sleep(pause)


_BACKOFF_S, _BACKOFF_CAP_S = 0.1, 5.0


def expand_object_glob(pattern: str) -> list[str]:
    """The object URLs a glob over a bucket or container matches, sorted; an error when none does."""
    scheme = _scheme(pattern)
    fs = filesystem(pattern)
    matches = sorted(retried(pattern, "listing", fs.glob, pattern))
    if not matches:
        raise FileNotFoundError(f"no shard matches {pattern!r}")
    return [match if "://" in match else f"{scheme}://{match}" for match in matches]


@dataclass(frozen=True)
class Stamp:
    """What identifies one version of an object: its size and ETag (empty where the store gives none)."""

    size: int
    etag: str

    def to_dict(self) -> dict:
        return asdict(self)


def stamp(url: str) -> Stamp:
    """The object's current size and ETag, asked of the store (never a listing cached earlier)."""
    fs = filesystem(url)
    fs.invalidate_cache(url)
    info = retried(url, "reading the metadata of", fs.info, url)
    etag = info.get("ETag") or info.get("etag") or info.get("md5Hash") or ""
    return Stamp(int(info.get("size") or 0), str(etag).strip('"'))


def open_object(url: str, block_size: int = 8 << 20):
    """A binary stream of the whole object, read ahead in `block_size` requests (indexing reads it once)."""
    return retried(url, "opening", filesystem(url).open, url, "rb", block_size=block_size, cache_type="readahead")


def read_range(url: str, offset: int, size: int, version: str = "") -> bytes:
    """`size` bytes at `offset`: one range request, or the local range cache when one is configured and holds
    them for this `version` (the object's ETag) of the object."""
    cache = range_cache()
    if cache is not None and version:
        cached = cache.get(url, version, offset, size)
        if cached is not None:
            return cached
    data = retried(url, "reading", filesystem(url).cat_file, url, start=offset, end=offset + size,
                 deadline_s=float(os.environ.get("PACKFEED_RANGE_DEADLINE_S", "120")))
    if cache is not None and version and len(data) == size:
        cache.put(url, version, offset, data)
    return data


class RangeCache:
    """Byte ranges of objects kept on local disk, at most `max_bytes` (the least recently used go first), for
    the epochs after the first. Shared by the processes of a server (files written under a temporary name, then
    renamed); keyed by the object's version, so a changed object is read afresh."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.directory, self.max_bytes = Path(directory), max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written = 0  # bytes this process added since it last counted the directory
        self._lock = threading.Lock()

    def _path(self, url: str, version: str, offset: int, size: int) -> Path:
        key = hashlib.sha256(f"{url}\0{version}\0{offset}\0{size}".encode()).hexdigest()[:40]
        return self.directory / key[:2] / key

    def get(self, url: str, version: str, offset: int, size: int) -> bytes | None:
        path = self._path(url, version, offset, size)
        try:
            data = path.read_bytes()
            os.utime(path)  # recently used
        except OSError:
            return None
        return data if len(data) == size else None

    def put(self, url: str, version: str, offset: int, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        path = self._path(url, version, offset, len(data))
        try:
            path.parent.mkdir(exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
            partial.write_bytes(data)
            os.replace(partial, path)
        except OSError:
            return  # a full or read-only disk: the cache is an optimisation, reading goes on without it
        with self._lock:
            self._written += len(data)
            if self._written < self.max_bytes // 10:
                return
            self._written = 0
        self.trim()

    def trim(self) -> None:
        """Remove the least recently used ranges until the cache holds at most 90% of its limit."""
        entries = []
        for path in self.directory.glob("*/*"):
            try:
                status = path.stat()
            except OSError:
                continue
            entries.append((status.st_mtime_ns, status.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes * 0.9:
                break
            path.unlink(missing_ok=True)
            total -= size


@functools.lru_cache(maxsize=None)
def _range_cache(directory: str, megabytes: str) -> RangeCache | None:
    return RangeCache(directory, int(megabytes) << 20) if directory else None


def range_cache() -> RangeCache | None:
    """The cache `PACKFEED_RANGE_CACHE_DIR` names (limit `PACKFEED_RANGE_CACHE_MB`, default 10240), or None."""
    return _range_cache(os.environ.get("PACKFEED_RANGE_CACHE_DIR", ""), os.environ.get("PACKFEED_RANGE_CACHE_MB", "10240"))


def relocate(shard: str, root: str | None) -> str:
    """Where a shard is read from: as indexed, or its file name under `root` (a folder or an object URL
    prefix: shards copied or moved since indexing)."""
    if not root:
        return shard
    name = shard.rstrip("/").rsplit("/", 1)[-1]
    return f"{root.rstrip('/')}/{name}" if is_object_url(root) else os.path.join(root, name)


def missing_objects(urls: list[str]) -> list[str]:
    """The URLs that name no object, found with one listing per folder (not a request per object); over plain
    HTTP, which lists nothing, with a HEAD per object, many at once."""
    web = [url for url in urls if _scheme(url) in ("http", "https")]
    missing = _missing_on_the_web(web) if web else []
    by_folder: dict[str, list[str]] = {}
    for url in set(urls).difference(web):
        by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
    for folder, members in by_folder.items():
        scheme = _scheme(folder)
        try:
            listed = {entry if "://" in entry else f"{scheme}://{entry}"
                      for entry in filesystem(folder).ls(folder, detail=False)}
        except (FileNotFoundError, ObjectError):
            listed = set()
        except Exception as error:  # unreachable or forbidden after retries: name the folder
            raise ObjectError(f"listing {folder} failed: {type(error).__name__}: {error}") from None
        missing += [url for url in members if url.rstrip("/") not in listed]
    position = {url: i for i, url in enumerate(urls)}
    return sorted(missing, key=position.__getitem__)


def _missing_on_the_web(urls: list[str]) -> list[str]:
    def absent(url: str) -> bool:
        try:
            stamp(url)
            return False
        except ObjectNotFound:
            return True

    with ThreadPoolExecutor(max_workers=16) as pool:
        return [url for url, gone in zip(urls, pool.map(absent, urls)) if gone]


class StampCache:
    """Current stamps of the objects a server reads from, looked up again at most every `ttl` seconds: a
    changed object is noticed within `ttl` (a changed range fails its member checksum at once)."""

    def __init__(self, ttl: float = 30.0):
        self.ttl = ttl
        self._stamps: dict[str, tuple[float, Stamp | ObjectError]] = {}
        self._lock = threading.Lock()

    def get(self, url: str, fresh: bool = False) -> Stamp:
        """The object's stamp, looked up again when older than `ttl` (or `fresh`: now)."""
        now = time.monotonic()
        with self._lock:
            cached = self._stamps.get(url)
        if fresh or cached is None or now - cached[0] > self.ttl:
            try:
                current: Stamp | ObjectError = stamp(url)
            except ObjectError as error:
                current = error
            cached = (now, current)
            with self._lock:
                self._stamps[url] = cached
        if isinstance(cached[1], ObjectError):
            raise cached[1]
        return cached[1]
