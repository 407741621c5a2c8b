"""Writing WebDataset shards: plain tars of about a target size, each written whole or not at all.

A shard is written as `NAME.tar.partial` and renamed to `NAME.tar` once complete and synced, so a killed
conversion leaves at most a `.partial` file, never a `.tar` that looks complete but is cut short. Members have
fixed metadata (mtime 0, mode 0444, owner 0), so the same samples give byte-identical shards.
"""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

SHARD_PATTERN = "shard-{:06d}.tar"


@dataclass
class WrittenShard:
    name: str
    samples: int
    bytes: int


class FileMember(NamedTuple):
    """A member copied from a file when its shard is written, never held whole in memory (a video of gigabytes);
    `size`: the bytes it had when it was checked."""

    path: str
    size: int


def _size(data: bytes | FileMember) -> int:
    return data.size if isinstance(data, FileMember) else len(data)


class ShardWriter:
    """Samples in, shards of about `target_bytes` out (a sample never spans two shards)."""

    def __init__(self, out: Path, target_bytes: int):
        self.out, self.target_bytes = out, target_bytes
        self.shards: list[WrittenShard] = []
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._samples = 0

    def add(self, members: list[tuple[str, bytes | FileMember]]) -> None:
        """One sample: (member name, bytes or a file) pairs, the names starting with the sample's key. Raises
        OSError, before writing anything, when a file member changed size since it was checked."""
        sources = []
        try:  # every file opened and checked first: a sample is written whole or not at all
            for _, data in members:
                sources.append(open(data.path, "rb") if isinstance(data, FileMember) else io.BytesIO(data))
                if isinstance(data, FileMember) and os.fstat(sources[-1].fileno()).st_size != data.size:
                    raise OSError(f"{data.path} changed while converting ({data.size} bytes when checked)")
        except OSError:
            for source in sources:
                source.close()
            raise
        size = sum(512 + -(-_size(data) // 512) * 512 for _, data in members)
        if self._tar is not None and self._file.tell() + size > self.target_bytes:
            self._finish()
        if self._tar is None:
            self._start()
        for (name, data), source in zip(members, sources):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = _size(data), 0, 0o444, 0, 0
            with source:
                self._tar.addfile(info, source)  # copied in blocks
        self._samples += 1

    def close(self) -> list[WrittenShard]:
        if self._tar is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        """Drop the shard being written (its .partial file); finished shards stay."""
        if self._tar is not None:
            self._tar.close()
            self._file.close()
            os.unlink(self._partial)
            self._tar = None

    @property
    def _partial(self) -> Path:
        return self.out / (SHARD_PATTERN.format(len(self.shards)) + ".partial")

    def _start(self) -> None:
        self._file = open(self._partial, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.GNU_FORMAT)
        self._samples = 0

    def _finish(self) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        name = SHARD_PATTERN.format(len(self.shards))
        os.replace(self._partial, self.out / name)
        self.shards.append(WrittenShard(name, self._samples, size))
        self._tar = None
