"""WebDataset shards: expanding shard specs, and walking a tar's samples with each member's byte offset.

Accepted sample layout (webdataset convention: members sharing a key are consecutive in the tar; the key
is the path up to the first dot of the file name):

    KEY.json                     required: {"conversations": [{"from": "human", "value": ...}, ...]}
    KEY.jpg | KEY.png | ...      one image, or
    KEY.0.jpg, KEY.1.png, ...    several images, ordered by their number
    KEY.<other>                  any other member (txt, cls, ...) is carried along and ignored

Image extensions: jpg, jpeg, png, webp, gif, bmp, tif, tiff. Offsets are positions of member data in the
uncompressed tar stream: for plain .tar files they are file offsets a server can seek to.
"""

from __future__ import annotations

import glob
import os
import re
import tarfile
from dataclasses import dataclass, field
from typing import Iterator

import subprocess

import braceexpand

from packfeed.media.storage import OBJECT_SCHEMES, expand_object_glob, is_object_url, open_object, read_range
from packfeed.media.video import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
_IMAGE_SUFFIX = re.compile(r"^(?:(\d+)\.)?(" + "|".join(IMAGE_EXTENSIONS) + r")$", re.IGNORECASE)
_VIDEO_SUFFIX = re.compile(r"^(?:(\d+)\.)?(" + "|".join(VIDEO_EXTENSIONS) + r")$", re.IGNORECASE)
COMPRESSED_MAGIC = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
REMOTE_PREFIXES = ("pipe:", "ais://", *OBJECT_SCHEMES)


def expand_shards(specs: list[str]) -> list[str]:
    """Brace patterns, then globs, for local paths and object-store URLs ('s3://bucket/shards/*.tar'); other
    remote and pipe: sources pass through unchanged. Local paths become absolute, so the index serves from any
    working directory."""
    out: list[str] = []
    for spec in specs:
        for item in braceexpand.braceexpand(spec):
            if is_object_url(item) and glob.has_magic(item.split("://", 1)[1]):
                out.extend(expand_object_glob(item))
            elif item.startswith(REMOTE_PREFIXES):
                out.append(item)
            elif glob.has_magic(item):
                matches = sorted(glob.glob(item))
                if not matches:
                    raise FileNotFoundError(f"no shard matches {item!r}")
                out.extend(os.path.abspath(match) for match in matches)
            else:
                out.append(os.path.abspath(item[5:] if item.startswith("file:") else item))
    return out


@dataclass
class Member:
    suffix: str  # the name after the key, e.g. "json", "0.jpg"
    offset: int
    size: int
    data: bytes


@dataclass
class RawSample:
    key: str
    members: list[Member] = field(default_factory=list)
    error: str | None = None  # set when the tar broke inside this sample

    def has(self, suffix: str) -> bool:
        return any(m.suffix == suffix for m in self.members)

    def json_member(self) -> Member | None:
        return next((m for m in self.members if m.suffix.lower() == "json"), None)

    def image_members(self) -> list[Member]:
        """Image members ordered by their number (an un-numbered image counts as number 0)."""
        return self._numbered(_IMAGE_SUFFIX)

    def video_members(self) -> list[Member]:
        """Video files (`KEY.mp4`, `KEY.0.webm`, ...) ordered as images are."""
        return self._numbered(_VIDEO_SUFFIX)

    def _numbered(self, suffixes: re.Pattern) -> list[Member]:
        found = []
        for m in self.members:
            match = suffixes.match(m.suffix)
            if match:
                found.append((int(match.group(1) or 0), m.suffix, m))
        return [m for _, _, m in sorted(found, key=lambda x: (x[0], x[1]))]


class ShardError(Exception):
    """The shard could not be read (at all, or past some point); the message says why."""


_KEY_AND_SUFFIX = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")


def key_and_suffix(name: str) -> tuple[str | None, str | None]:
    """A tar member name split at the first dot of its file name (webdataset's rule): 'a/b.0.jpg' -> ('a/b',
    '0.jpg'); (None, None) for a name without one."""
    match = _KEY_AND_SUFFIX.match(name)
    return (match.group(1), match.group(2)) if match else (None, None)


class _PipeStream:
    """stdout of `pipe:COMMAND`; closing it reaps the command and reports a failure."""

    def __init__(self, command: str):
        self.command = command
        self.process = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE)

    def read(self, size: int = -1) -> bytes:
        return self.process.stdout.read(size)

    def close(self) -> None:
        self.process.stdout.close()
        if self.process.wait() != 0:
            raise OSError(f"{self.command!r} exited with status {self.process.returncode}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_shard(url: str):
    """A binary stream of the shard: local files and `file:` paths, `pipe:COMMAND` (the command's stdout),
    object-store and http(s) URLs through fsspec (`packfeed.media.storage`), and other URLs through
    webdataset's gopen, imported only then (it imports torch, which the server and its workers otherwise never
    load)."""
    if url.startswith("pipe:"):
        return _PipeStream(url[5:])
    if is_object_url(url):
        return open_object(url)
    if not url.startswith(REMOTE_PREFIXES):
        return open(url[5:] if url.startswith("file:") else url, "rb")
    from webdataset.gopen import gopen

    return gopen(url, "rb")


def iter_samples(url: str) -> Iterator[RawSample]:
    """Samples of one shard in tar order. Raises ShardError after the last readable sample on corruption."""
    try:
        stream = open_shard(url)
    except Exception as error:  # opening raises many types: OSError, ValueError, subprocess errors
        raise ShardError(f"cannot open: {error}") from None
    current: RawSample | None = None
    members_seen = 0
    try:
        with stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            try:
                for info in tar:
                    if not info.isfile():
                        continue
                    key, suffix = key_and_suffix(info.name)
                    if key is None or not suffix:
                        continue
                    # A repeated member name means a second sample with the same key (reported as a duplicate).
                    if current is None or key != current.key or current.has(suffix):
                        if current is not None:
                            yield current
                        current = RawSample(key)
                    handle = tar.extractfile(info)
                    data = handle.read() if handle else b""
                    if len(data) != info.size:
                        raise tarfile.ReadError("unexpected end of data")
                    current.members.append(Member(suffix, info.offset_data, info.size, data))
                    members_seen += 1
            except (tarfile.ReadError, EOFError, OSError) as error:
                if current is not None:
                    current.error = f"truncated tar: {error}"
                    yield current
                    current = None
                raise ShardError(f"corrupt tar after {members_seen} members: {error}") from None
            end_offset = tar.offset
        if current is not None:
            yield current
    except tarfile.ReadError as error:
        raise ShardError(f"not a readable tar: {error}") from None
    _check_tail(url, end_offset, members_seen)


def _check_tail(url: str, end_offset: int, members_seen: int) -> None:
    """tarfile stops quietly at a corrupt header past the first member; for local plain tars, make that loud.

    A well-formed tar ends with zero blocks; anything else after the last good header is unread data.
    """
    path = url[5:] if url.startswith("file:") else url
    if url.startswith(REMOTE_PREFIXES) or not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        if f.read(6).startswith(COMPRESSED_MAGIC):
            return  # offsets count decompressed bytes; the file size says nothing about them
        f.seek(end_offset)
        while chunk := f.read(1 << 20):
            if chunk.strip(b"\0"):
                raise ShardError(f"corrupt tar header at byte {end_offset} after {members_seen} members; "
                                 "the rest of the shard is unreadable")


def is_compressed(path: str) -> bool:
    """A local file or an object that starts like gzip, bzip2, xz or zstd (other remote sources: False, they are
    not served)."""
    if is_object_url(path):
        return read_range(path, 0, 6).startswith(COMPRESSED_MAGIC)
    if path.startswith(REMOTE_PREFIXES) or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(6).startswith(COMPRESSED_MAGIC)
