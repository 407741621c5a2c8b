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

SHARD_PATTERN = "shard-{:06d}.tar"


@dataclass
class WrittenShard:
    name: str
    samples: int
    bytes: int


class ShardWriter:
    """Samples in, shards of about `target_bytes` out (a sample never spans two shards)."""

    def __init__(self, out: Path, target_bytes: int):
        self.out, self.target_bytes = out, target_bytes
        self.shards: list[WrittenShard] = []
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._samples = 0

    def add(self, members: list[tuple[str, bytes]]) -> None:
        """One sample: (member name, bytes) pairs, the names starting with the sample's key."""
        size = sum(512 + -(-len(data) // 512) * 512 for _, data in members)
        if self._tar is not None and self._file.tell() + size > self.target_bytes:
            self._finish()
        if self._tar is None:
            self._start()
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o444, 0, 0
            self._tar.addfile(info, io.BytesIO(data))
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
