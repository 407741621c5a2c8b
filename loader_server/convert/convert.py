"""`packfeed convert`: annotations + images (or Parquet with image bytes) -> WebDataset shards, a report, an index.

Rows are prepared in parallel (read each image, decode it to prove it is an image, check the conversation's
shape) and written in source order by one writer, so the shards are the same whatever the worker count, and
the same bytes on a rerun. Keys derive from the source ids (characters other than letters, digits, `_` and `-`
become `_`; a repeated id gets `_dupN`; a row without id is `row-POSITION`), so a sample keeps its key across
conversions. A row that cannot be converted is never dropped silently: `convert-report.json` counts it and
lists its id, position and reason, and the conversion goes on.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

from PIL import Image
from tqdm import tqdm

from packfeed.media.conversation import ConversationError, attach_images, conversation_turns
from packfeed.media.samples import SampleError, image_size, describe_error, reason_category
from packfeed.media.video import VIDEO_EXTENSIONS, VideoError, probe_video
from packfeed.server.convert.shard_writer import SHARD_PATTERN, FileMember, ShardWriter
from packfeed.server.convert.source_files import FileRules, file_bytes, video_member
from packfeed.server.convert.sources import FORMATS, SourceRow, normalize_turns

Format = Literal["llava", "internvl", "sharegpt", "hf-parquet"]
REPORT = "convert-report.json"
CHUNK_ROWS, CHUNK_BYTES = 64, 32 << 20  # rows per task for a worker; fewer when they carry image bytes
# PIL's format -> the member extension the indexer reads
EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}


@dataclass(frozen=True)
class ConvertOptions:
    format: Format
    source: str
    out: str
    image_root: str | None = None  # relative image paths count from here (default: the source's folder)
    shard_size_mb: int = 1024
    workers: int | None = None  # default: every core
    conversation_column: str | None = None  # hf-parquet: default the first of conversations, messages, texts
    overwrite: bool = False  # replace shards and report a previous conversion left in `out`
    progress: bool = True
    max_image_mb: int = 64  # a larger image file is rejected before it is read
    max_video_mb: int = 4096  # ... and a larger video file
    trust_absolute_paths: bool = False  # absolute paths used as written, outside the image root too

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.shard_size_mb < 1:
            raise ValueError("--shard-size-mb must be at least 1")
        if self.max_image_mb < 1 or self.max_video_mb < 1:
            raise ValueError("--max-image-mb and --max-video-mb must be at least 1")

    @property
    def reading(self) -> FileRules:
        return FileRules(self.root, self.max_image_mb << 20, self.max_video_mb << 20, self.trust_absolute_paths)

    @property
    def root(self) -> Path:
        if self.image_root:
            return Path(self.image_root).resolve()
        source = Path(self.source)
        return (source if source.is_dir() else source.parent).resolve()


@dataclass
class Prepared:
    """One source row, ready to write (`members`) or rejected (`reason`)."""

    position: int
    id: str | None
    members: list[tuple[str, bytes]] = field(default_factory=list)  # (suffix after the key, bytes)
    reason: str | None = None


@dataclass
class ConvertReport:
    format: str
    source: str
    image_root: str
    out: str
    rows: int = 0
    converted: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    rejected_rows: list[dict[str, Any]] = field(default_factory=list)  # {id, position, reason}
    renamed_keys: list[dict[str, Any]] = field(default_factory=list)  # {id, position, key}: ids repeated or unusable
    shards: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    core_seconds: float = 0.0
    samples_per_second: float = 0.0
    samples_per_second_per_core: float = 0.0
    index: dict[str, Any] | None = None  # `packfeed index`'s summary, with --index

    def write(self, out: Path) -> None:
        partial = out / (REPORT + ".partial")
        partial.write_text(json.dumps(asdict(self), indent=1, ensure_ascii=False) + "\n")
        os.replace(partial, out / REPORT)


# ---------------------------------------------------------------------------------------------------------------
# One row (in a worker)


def _video_extension(data: bytes | FileMember, name: str) -> str:
    """The member extension of a video file (its own, when the server reads it), after checking it decodes."""
    try:
        probe_video(data.path if isinstance(data, FileMember) else data)
    except VideoError as error:
        raise SampleError(f"{error} ({name})") from None
    extension = Path(name).suffix.lower().lstrip(".")
    if extension not in VIDEO_EXTENSIONS:
        raise SampleError(f"unsupported video: {name}; the server reads {', '.join(VIDEO_EXTENSIONS)} files")
    return extension


def _extension(data: bytes, name: str) -> str:
    image_size(data, "decode")  # raises SampleError: not an image, undecodable, too many pixels
    with Image.open(io.BytesIO(data)) as image:
        extension = EXTENSIONS.get(image.format or "")
    if extension is None:
        raise SampleError(f"undecodable image: {name} is {image.format}, which the server does not read")
    return extension


def prepare_row(row: SourceRow, rules: FileRules) -> Prepared:
    prepared = Prepared(row.position, row.id)
    try:
        if row.error:
            raise SampleError(f"unreadable row: {row.error}")
        turns = normalize_turns(row.turns)
        attach_images(conversation_turns(turns), len(row.images), len(row.videos))  # as the indexer will accept
        members: list[tuple[str, bytes]] = []
        for k, image in enumerate(row.images):
            data = file_bytes(image, rules)
            extension = _extension(data, image.path or f"image {k}")
            members.append((f"{k}.{extension}" if len(row.images) > 1 else extension, data))
        for k, video in enumerate(row.videos):
            data = video_member(video, rules)
            extension = _video_extension(data, video.path)
            members.append((f"{k}.{extension}" if len(row.videos) > 1 else extension, data))
        doc = {"id": row.id, "conversations": turns, "source_images": [image.path for image in row.images]}
        if row.videos:
            doc["source_videos"] = [video.path for video in row.videos]
        if row.group is not None:
            doc["group"] = row.group
        doc.update(row.fork)  # the indexer checks a fork against its parent
        prepared.members = [("json", json.dumps(doc, ensure_ascii=False).encode()), *members]
    except ConversationError as error:
        prepared.reason = f"bad conversation: {error}"
    except SampleError as error:
        prepared.reason = str(error)
    except Exception as error:  # anything else about one row rejects that row, never the conversion
        prepared.reason = f"unreadable row: {type(error).__name__}: {describe_error(error)}"
    return prepared


def prepare_chunk(rows: list[SourceRow], rules: FileRules) -> tuple[list[Prepared], float]:
    started = time.process_time()
    prepared = [prepare_row(row, rules) for row in rows]
    return prepared, time.process_time() - started


# ---------------------------------------------------------------------------------------------------------------
# All rows


def _chunks(rows: Iterable[SourceRow]) -> Iterator[list[SourceRow]]:
    chunk: list[SourceRow] = []
    carried = 0
    for row in rows:
        chunk.append(row)
        carried += sum(len(image.data or b"") for image in row.images)
        if len(chunk) >= CHUNK_ROWS or carried >= CHUNK_BYTES:
            yield chunk
            chunk, carried = [], 0
    if chunk:
        yield chunk


def _prepared(rows: Iterable[SourceRow], rules: FileRules, workers: int) -> Iterator[tuple[list[Prepared], float]]:
    """Chunks prepared in source order, with a bounded number in flight (memory stays flat on huge sources)."""
    if workers == 1:
        yield from (prepare_chunk(chunk, rules) for chunk in _chunks(rows))
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for chunk in _chunks(rows):
            pending.append(pool.submit(prepare_chunk, chunk, rules))
            if len(pending) >= 3 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class _Keys:
    """Stable keys from source ids."""

    def __init__(self):
        self.used: set[str] = set()

    def key(self, source_id: str | None, position: int) -> tuple[str, bool]:
        """(key, whether it differs from the id)."""
        key = re.sub(r"[^0-9A-Za-z_-]+", "_", source_id) if source_id else f"row-{position:09d}"
        if len(key) > 120:
            key = key[:100] + "_" + hashlib.sha256(key.encode()).hexdigest()[:12]
        base, n = key, 0
        while key in self.used:
            n += 1
            key = f"{base}_dup{n}"
        self.used.add(key)
        return key, key != source_id


def prepare_out(out: Path, overwrite: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    previous = sorted(out.glob("shard-*.tar")) + sorted(out.glob("*.partial")) + \
        [p for p in (out / REPORT, out / "index.parquet") if p.exists()]  # a stale index would not match
    if previous and not overwrite:
        raise FileExistsError(f"{out} holds a previous conversion ({previous[0].name}, ...); pass --overwrite to "
                              f"replace it, or choose another --out")
    for path in previous:
        path.unlink()


def convert(options: ConvertOptions) -> ConvertReport:
    """Convert `options.source` into shards and `convert-report.json` under `options.out`."""
    started = time.perf_counter()
    out, root = Path(options.out), options.root
    rows = FORMATS[options.format](options.source, conversation_column=options.conversation_column)
    prepare_out(out, options.overwrite)
    report = ConvertReport(options.format, str(Path(options.source).resolve()), str(root), str(out.resolve()))
    writer, keys = ShardWriter(out, options.shard_size_mb << 20), _Keys()
    workers = max(1, options.workers or os.cpu_count() or 1)
    reasons: Counter = Counter()
    bar = tqdm(unit="sample", desc=f"converting {Path(options.source).name}", disable=not options.progress)
    try:
        for prepared, core_seconds in _prepared(rows, options.reading, workers):
            report.core_seconds += core_seconds
            for sample in prepared:
                report.rows += 1
                if sample.reason:
                    reasons[reason_category(sample.reason)] += 1
                    report.rejected_rows.append({"id": sample.id, "position": sample.position, "reason": sample.reason})
                    continue
                key, renamed = keys.key(sample.id, sample.position)
                if renamed and sample.id is not None:
                    report.renamed_keys.append({"id": sample.id, "position": sample.position, "key": key})
                try:
                    writer.add([(f"{key}.{suffix}", data) for suffix, data in sample.members])
                except OSError as error:  # a video that changed since it was checked: nothing of it written
                    reasons[reason_category(f"unreadable video: {error}")] += 1
                    report.rejected_rows.append({"id": sample.id, "position": sample.position,
                                                 "reason": f"unreadable video: {error}"})
                    continue
                report.converted += 1
            bar.update(len(prepared))
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    report.shards = [asdict(shard) for shard in writer.close()]
    report.rejected = report.rows - report.converted
    report.rejected_by_reason = dict(sorted(reasons.items()))
    report.seconds = round(time.perf_counter() - started, 3)
    report.samples_per_second = round(report.rows / max(report.seconds, 1e-9), 1)
    report.samples_per_second_per_core = round(report.rows / max(report.core_seconds, 1e-9), 1)
    report.core_seconds = round(report.core_seconds, 3)
    report.write(out)
    return report


def shard_paths(out: str | Path) -> list[str]:
    """The shards a conversion wrote into `out`, in order."""
    return [str(p) for p in sorted(Path(out).glob(SHARD_PATTERN.replace("{:06d}", "*")))]
