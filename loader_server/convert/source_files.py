"""What a conversion reads of the files its source names, safely: regular files only, under the image root once
every symlink is resolved, each within its size cap, checked before a byte is read (`FileRules`). A row whose
path breaks a rule is rejected with the reason; the conversion goes on."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from packfeed.media.samples import SampleError
from packfeed.server.convert.shard_writer import FileMember
from packfeed.server.convert.sources import SourceImage


@dataclass(frozen=True)
class FileRules:
    """What a conversion may read: regular files only, under the image root once every symlink is resolved
    (absolute paths too, unless trusted), each at most its size cap. Checked before a byte is read, so a path
    naming a FIFO, a device, a huge sparse file or a secret elsewhere rejects its row instead of hanging,
    exhausting memory or leaking the file into a shard."""

    root: Path  # resolved
    max_image_bytes: int
    max_video_bytes: int
    trust_absolute_paths: bool = False

    def cap(self, kind: str) -> int:
        return self.max_video_bytes if kind == "video" else self.max_image_bytes


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> str | None:
    """What a file that is not a regular file is ("a FIFO", ...), None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")


def _checked_size(size: int, image: SourceImage, kind: str, rules: FileRules) -> None:
    if size > rules.cap(kind):
        raise SampleError(f"{kind} too large: {image.path or 'its bytes'} is {size:,} bytes, over "
                          f"--max-{kind}-mb {rules.cap(kind) >> 20}")


def _resolved(image: SourceImage, kind: str, rules: FileRules) -> Path:
    """The file a source path names, every symlink resolved, inside the image root unless trusted."""
    path = Path(image.path)
    absolute = path.is_absolute()
    real = Path(os.path.realpath(path if absolute else rules.root / path))
    if absolute and rules.trust_absolute_paths:
        return real
    if os.path.commonpath([rules.root, real]) != str(rules.root):
        shown = "" if str(real) == image.path else f" (resolves to {real})"
        hint = "; pass --trust-absolute-paths to read absolute paths as written" if absolute else ""
        raise SampleError(f"{kind} outside the image root: {image.path}{shown}{hint}")
    return real


def file_bytes(image: SourceImage, rules: FileRules, kind: str = "image") -> bytes:
    """The bytes of an image the source stores or names (relative to the image root), read only from a regular
    file within the rules."""
    if image.data is not None:
        _checked_size(len(image.data), image, kind, rules)
        return image.data
    _, fd, _ = _opened(image, rules, kind)
    with os.fdopen(fd, "rb") as file:
        data = file.read(rules.cap(kind) + 1)
    _checked_size(len(data), image, kind, rules)  # a file that grew while it was read
    return data


def video_member(video: SourceImage, rules: FileRules) -> bytes | FileMember:
    """A video the source stores (its bytes), or names: its file, checked as `file_bytes` checks an image's
    but not read: it is probed from the file and copied into the shard in blocks, so a video of gigabytes never
    sits in memory (nor travels between processes)."""
    if video.data is not None:
        _checked_size(len(video.data), video, "video", rules)
        return video.data
    path, fd, size = _opened(video, rules, "video")
    os.close(fd)
    return FileMember(str(path), size)


def _opened(image: SourceImage, rules: FileRules, kind: str) -> tuple[Path, int, int]:
    """(path, an open descriptor, size) of the regular file within the rules a source path names."""
    if not image.path:
        raise SampleError(f"missing {kind}: neither bytes nor a path")
    path = _resolved(image, kind, rules)
    try:
        what = _not_regular(os.stat(path).st_mode)  # before opening: opening a FIFO blocks, a device never ends
        if what:
            raise SampleError(f"{kind} not a regular file: {image.path} is {what}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SampleError(f"missing {kind}: {image.path}") from None
    except OSError as error:
        raise SampleError(f"unreadable {kind}: {image.path}: {error.strerror}") from None
    try:
        status = os.fstat(fd)  # what was opened, had the path been swapped since it was checked
        what = _not_regular(status.st_mode)
        if what:
            raise SampleError(f"{kind} not a regular file: {image.path} is {what}")
        _checked_size(status.st_size, image, kind, rules)
    except BaseException:
        os.close(fd)
        raise
    return path, fd, status.st_size
