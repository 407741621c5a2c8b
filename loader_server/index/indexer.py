"""`packfeed index`: one pass over WebDataset shards -> a Parquet table of per-sample costs.

Shards are read in parallel (one process per shard at a time) and the rows concatenated in shard order,
so the index is the same whatever the worker count. Bad input never stops indexing and never passes
silently: a bad sample becomes an invalid row with its reason, an unreadable shard (or the unreadable
rest of one) is reported, and the CLI exits non-zero when anything was skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import io
import os
import time
import warnings
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from packfeed.media.chat import (ChatTemplate, ConversationError, IGNORE_INDEX, attach_images, check_tokens,
                                        cached_encoder, conversation_turns, extend_tokenizer, missing_tokens,
                                        parse_json)
from packfeed.media.image_policy import (DEFAULT_POLICY, VERIFY_MODES, ImagePolicy, TooManyPixels,
                                                policy_from_dict)
from packfeed.server.index.table import (SCHEMA, IndexInfo, describe_error, fingerprint_table, member_checksum,
                                         reason_category, write_index)
from packfeed.media.pixels import oriented_size
from packfeed.server.index.parts import config_digest, load_part, parts_directory, remove_stale_parts, save_part, shard_version
from packfeed.server.index.shards import Member, RawSample, ShardError, expand_shards, is_compressed, iter_samples
from packfeed.media.video import (VideoError, VideoInfo, VideoSampling, frames_fps, probe_video,
                                         video_placeholders)
from packfeed.media.storage import ObjectError, Stamp, is_object_url, stamp



DEFAULT_MAX_SAMPLE_TOKENS = 262_144  # the longest contexts trained today, with room for long videos


@dataclass(frozen=True)
class IndexConfig:
    tokenizer: str
    image_policy: dict[str, Any] = field(default_factory=lambda: {"name": DEFAULT_POLICY})
    chat_template: dict[str, Any] = field(default_factory=lambda: ChatTemplate().to_dict())
    video_policy: dict[str, Any] = field(default_factory=lambda: VideoSampling().to_dict())
    # decode: decode every image (JPEG at 1/8 scale, which still reads every byte) to catch truncated or
    # corrupt data; header: trust the header, several times faster.
    verify_images: str = "decode"
    # When the tokenizer lacks the template's special tokens: refuse (False) or write an extended tokenizer.json
    # beside the index and record it (True).
    extend_tokenizer: bool = False
    # A sample of more LLM tokens (text and placeholders) is invalid: it could never train, and would be
    # tokenised again each time it is served.
    max_sample_tokens: int = DEFAULT_MAX_SAMPLE_TOKENS

    def __post_init__(self):
        if self.verify_images not in VERIFY_MODES:
            raise ValueError(f"verify_images must be one of {VERIFY_MODES}")
        if not Path(self.tokenizer).is_file():
            raise FileNotFoundError(f"tokenizer {self.tokenizer!r} not found: pass a HF tokenizer.json with --tokenizer")
        if isinstance(self.max_sample_tokens, bool) or not isinstance(self.max_sample_tokens, int) \
                or self.max_sample_tokens < 1:
            raise ValueError(f"max_sample_tokens must be a whole number >= 1, not {self.max_sample_tokens!r}")
        # the pixel limit recorded even when left at its default, so the index says which limit it applied
        policy = policy_from_dict(self.image_policy)  # fails early on a bad policy
        object.__setattr__(self, "image_policy", {**self.image_policy, "max_image_pixels": policy.max_image_pixels})
        # recorded whole (every field, defaults filled in), whatever subset was given
        object.__setattr__(self, "video_policy", VideoSampling.from_dict(self.video_policy).to_dict())
        if self.template.video_timestamps and self.video_sampling.is_random:
            raise ValueError("a chat template with video_timestamps writes each temporal patch's time into the text, "
                             "so its frames must be known when indexing: use --frame-sampling uniform, linspace or "
                             "segment, not random")

    # Built once per config, not once per sample (costing reads both for every row).
    @functools.cached_property
    def policy(self) -> ImagePolicy:
        return policy_from_dict(self.image_policy)

    @functools.cached_property
    def video_sampling(self) -> VideoSampling:
        return VideoSampling.from_dict(self.video_policy)

    @functools.cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate.from_dict(self.chat_template)

    def tokenizer_digest(self) -> str:
        return hashlib.sha256(Path(self.tokenizer).read_bytes()).hexdigest()[:16]

    def to_fingerprint_dict(self) -> dict[str, Any]:
        return {"image_policy": self.image_policy, "chat_template": self.chat_template, "video_policy": self.video_policy,
                "tokenizer": self.tokenizer_digest(), "verify_images": self.verify_images,
                "max_sample_tokens": self.max_sample_tokens}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "IndexConfig":
        from packfeed.server.index.conventions import conventions_of, video_policy_of

        if not args.tokenizer:
            raise ValueError("indexing shards needs --tokenizer TOKENIZER.json (the tokenizer the trainer uses)")
        policy, template = conventions_of(args)
        return cls(args.tokenizer, policy, template, video_policy_of(args), args.verify_images, args.extend_tokenizer,
                   **({"max_sample_tokens": args.max_sample_tokens} if args.max_sample_tokens is not None else {}))

    def with_tokenizer_for(self, out: str | Path) -> tuple["IndexConfig", dict[str, Any]]:
        """This config with a tokenizer that knows every special token of the template, and the index's record
        of it. Missing tokens are an error, unless `extend_tokenizer`: then a tokenizer.json with them appended
        is written beside the index, and the index records it (and the one it extends)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(self.tokenizer)
        if not missing_tokens(tokenizer, self.template):
            return self, {"path": str(Path(self.tokenizer).resolve()), "sha256": self.tokenizer_digest()}
        if not self.extend_tokenizer:
            check_tokens(tokenizer, self.template, self.tokenizer)
        extended = (Path(out).parent / "tokenizer.json").resolve()
        if extended == Path(self.tokenizer).resolve():
            raise ValueError(f"--extend-tokenizer would overwrite the tokenizer {self.tokenizer}; write the index "
                             f"to another folder")
        original = {"path": str(Path(self.tokenizer).resolve()), "sha256": self.tokenizer_digest()}
        extended.parent.mkdir(parents=True, exist_ok=True)
        added = extend_tokenizer(self.tokenizer, self.template, extended)
        config = dataclasses.replace(self, tokenizer=str(extended))
        return config, {"path": str(extended), "sha256": config.tokenizer_digest(), "extended_from": original,
                        "added_tokens": added}


# ---------------------------------------------------------------------------------------------------------------
# One sample


class SampleError(ValueError):
    pass


def image_size(data: bytes, verify: str, policy: ImagePolicy | None = None) -> tuple[int, int]:
    """(width, height) upright (EXIF orientation applied) from the header; with verify='decode' also decodes
    (JPEG at 1/8 scale), unless the `policy`'s pixel limit refuses the image first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = oriented_size(image, data)  # a PNG is not decoded to look for its EXIF
                if policy is not None:
                    policy.check_pixels(width, height)  # before decoding: verifying it would cost its memory
                if verify == "decode":
                    if image.format == "JPEG":
                        image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                    image.load()
    except UnidentifiedImageError:
        raise SampleError("not an image") from None
    except TooManyPixels as error:
        raise SampleError(f"image rejected by policy: {error}") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise SampleError(f"undecodable image: too many pixels ({describe_error(error)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise SampleError(f"undecodable image: {describe_error(error)}") from None
    if width < 1 or height < 1:
        raise SampleError(f"undecodable image: size {width}x{height}")
    return width, height


def _video_infos(images: list[Member], videos: list[Member], doc: Any,
                 verify: str, policy: ImagePolicy) -> tuple[list[VideoInfo], float | None]:
    """The sample's videos as the container (or, for a frame sequence, its JSON and frames) describes them, and
    the frame sequence's rate (None when its images are images)."""
    rate = frames_fps(doc)
    if rate is None:
        return [probe_video(member.data, decode=verify == "decode") for member in videos], None
    if videos:
        raise SampleError("frame sequence and video files in one sample: give the frames or the files")
    if not images:
        raise SampleError('frame sequence without frames: "frames" needs numbered images KEY.0.jpg, KEY.1.jpg, ...')
    sizes = {image_size(member.data, verify, policy) for member in images}
    if len(sizes) > 1:
        raise SampleError(f"frame sequence: frames differ in size ({', '.join(f'{w}x{h}' for w, h in sorted(sizes))})")
    (width, height), = sizes
    return [VideoInfo(width, height, len(images), rate)], rate


def _tile_bytes(geometry) -> int:
    return sum(c * h * w for c, h, w in geometry.tile_shapes())


def cost_sample(raw: RawSample, config: IndexConfig) -> dict[str, Any]:
    """One index row (without sample_id and shard)."""
    images, videos = raw.image_members(), raw.video_members()
    doc = raw.json_member()
    row: dict[str, Any] = {
        "key": raw.key, "valid": False, "reason": None,
        "json_offset": doc.offset if doc else None, "json_size": doc.size if doc else None,
        "json_checksum": member_checksum(doc.data) if doc else None,
        "image_names": [m.suffix for m in images], "image_offsets": [m.offset for m in images],
        "image_sizes": [m.size for m in images], "image_checksums": [member_checksum(m.data) for m in images],
        "image_widths": [], "image_heights": [],
        "n_images": len(images), "vision_units": 0, "vision_tokens": 0, "vit_patches": 0, "vit_attn_sq": 0,
        "text_tokens": 0, "llm_tokens": 0, "loss_tokens": 0,
        "n_videos": len(videos), "video_names": [m.suffix for m in videos], "video_offsets": [m.offset for m in videos],
        "video_sizes": [m.size for m in videos], "video_checksums": [member_checksum(m.data) for m in videos],
        "video_widths": [], "video_heights": [], "video_frames": [], "video_rates": [], "video_sampled": [],
        "frames_fps": None, "pixel_bytes": 0,
    }
    try:
        if raw.error:
            raise SampleError(raw.error)
        if doc is None:
            raise SampleError("missing json")
        document = parse_json(doc.data)
        turns = conversation_turns(document.get("conversations") if isinstance(document, dict) else None)
        policy = config.policy
        infos, sequence_rate = _video_infos(images, videos, document, config.verify_images, policy)
        if sequence_rate is not None:  # the images are one video's frames
            row.update(n_images=0, n_videos=1, video_names=["frames"], video_offsets=[0], video_sizes=[0],
                       video_checksums=[0], frames_fps=sequence_rate)
            row["image_widths"], row["image_heights"] = [infos[0].width] * len(images), [infos[0].height] * len(images)
            images = []
        turns = attach_images(turns, len(images), len(infos))
        costs = []
        for member in images:
            width, height = image_size(member.data, config.verify_images, policy)
            row["image_widths"].append(width)
            row["image_heights"].append(height)
            try:
                costs.append(policy.cost(width, height, len(images)))
                row["pixel_bytes"] += _tile_bytes(policy.geometry(width, height, len(images)))
            except ValueError as error:
                raise SampleError(f"image rejected by policy: {error}") from None
        video_items, video_times = [], []
        for info in infos:
            frames = config.video_sampling.frame_count(info.frames, info.rate, policy.frame_multiple)
            if frames < 1:
                raise SampleError(f"video too short: {info.frames} frames, the image policy takes them "
                                  f"{policy.frame_multiple} at a time")
            try:
                policy.check_pixels(info.width, info.height, "video frame")
                cost = policy.video_cost(info.width, info.height, frames)
                row["pixel_bytes"] += frames * _tile_bytes(policy.frame_geometry(info.width, info.height))
            except ValueError as error:
                raise SampleError(f"video rejected by policy: {error}") from None
            costs.append(cost)
            items, times = video_placeholders(config.template, config.video_sampling, policy, info, frames, cost)
            video_items.append(items)
            video_times.append(times)
            for name, value in (("widths", info.width), ("heights", info.height), ("frames", info.frames),
                                ("rates", info.rate), ("sampled", frames)):
                row[f"video_{name}"].append(value)
        encoder = cached_encoder(config.tokenizer, config.template)
        check_text_length(turns, config.max_sample_tokens, encoder.tokenizer)
        ids, labels, _ = encoder.encode(
            turns, [c.llm_tokens for c in costs[:len(images)]], video_items, video_times)
        if len(ids) > config.max_sample_tokens:
            raise SampleError(f"too long: {len(ids):,} tokens, over max_sample_tokens {config.max_sample_tokens:,}; "
                              "raise it with --max-sample-tokens")
    except (SampleError, ConversationError, VideoError) as error:
        row["reason"] = str(error)
        return row
    except Exception as error:  # anything else about one sample makes that sample invalid, never the index
        row["reason"] = f"unreadable sample: {type(error).__name__}: {describe_error(error)}"
        return row
    vision_tokens = sum(c.llm_tokens for c in costs)
    row.update(valid=True, vision_units=sum(c.units for c in costs), vision_tokens=vision_tokens,
               vit_patches=sum(c.vit_patches for c in costs), vit_attn_sq=sum(c.vit_attn_sq for c in costs),
               text_tokens=len(ids) - vision_tokens, llm_tokens=len(ids),
               loss_tokens=int((labels != IGNORE_INDEX).sum()))
    return row


def check_text_length(turns: list[dict[str, str]], max_tokens: int, tokenizer) -> None:
    """Refuse text far over `max_tokens` after tokenising only about `max_tokens` of it: tokenising 10 MB in one
    call costs seconds and gigabytes (the tokenizer keeps every token's string and offsets). The text is counted in
    pieces cut just before a space that follows a word, where byte-level and sentencepiece pre-tokenizers cut too,
    less one token per cut for safety: a lower bound, so nothing within the limit is refused here (the exact
    count after encoding decides)."""
    text = "".join(turn["value"] for turn in turns)
    if len(text.encode("utf-8", "surrogatepass")) <= max_tokens:  # a token holds at least a byte
        return
    counted, start = 0, 0
    while start < len(text) and counted <= max_tokens:
        end = _word_boundary(text, start + TEXT_PIECE_CHARS)
        counted += len(tokenizer.encode(text[start:end], add_special_tokens=False).ids) - 1
        start = end
    if counted > max_tokens:
        raise SampleError(f"too long: over {max_tokens:,} tokens of text (counted {counted:,} before stopping), over "
                          f"max_sample_tokens; raise it with --max-sample-tokens")


TEXT_PIECE_CHARS = 1 << 16


def _word_boundary(text: str, at: int) -> int:
    """The first position from `at` just before a space that follows a non-space (the text's end if none)."""
    found = text.find(" ", max(at, 1))
    while found != -1 and text[found - 1].isspace():
        found = text.find(" ", found + 1)
    return len(text) if found == -1 else found


# ---------------------------------------------------------------------------------------------------------------
# One shard, then all of them


@dataclass
class ShardResult:
    url: str
    rows: list[dict[str, Any]]
    error: str | None
    seconds: float
    stamp: Stamp | None = None  # an object's size and ETag as indexed


COMPRESSED_REASON = "compressed shard: serving reads samples at their offsets; decompress it to a plain .tar"


def index_shard(url: str, config: IndexConfig, version: dict[str, Any] | None = None) -> ShardResult:
    """Index one shard. `version`: the object's stamp as build_index just asked it (saves asking the store
    again); the object is stamped once more after reading, and a change in between invalidates its rows."""
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    error, before = None, None
    try:
        if is_object_url(url):
            before = Stamp(**version) if version else stamp(url)
        compressed = is_compressed(url)
        for raw in iter_samples(url):
            row = cost_sample(raw, config)
            if raw.key in seen:
                row.update(valid=False, reason="duplicate key: the key appears earlier in this shard")
            elif compressed:
                row.update(valid=False, reason=COMPRESSED_REASON)
            seen.add(raw.key)
            rows.append(row)
        if before is not None and stamp(url) != before:
            error = "object changed while it was indexed: index it again"
            for row in rows:
                row.update(valid=False, reason="shard changed: the object changed while it was indexed")
    except ShardError as shard_error:
        error = str(shard_error)
    except ObjectError as object_error:
        error = f"cannot open: {object_error}"
    return ShardResult(url, rows, error, time.perf_counter() - started, before)


@dataclass
class IndexResult:
    out: str
    info: IndexInfo
    rows: int
    valid: int
    seconds: float
    core_seconds: float
    reused: int = 0  # shards whose kept part was taken as it was (unchanged since an earlier run)

    @property
    def skipped_anything(self) -> bool:
        return bool(self.info.skipped_shards) or self.valid < self.rows

    def summary(self) -> dict[str, Any]:
        return {"index": self.out, "fingerprint": self.info.fingerprint, "rows": self.rows, "valid": self.valid,
                "invalid": self.rows - self.valid, "invalid_by_reason": self.info.invalid_by_reason,
                "shard_errors": self.info.skipped_shards, "shards_reused": self.reused,
                "seconds": round(self.seconds, 3),
                "rows_per_second": round(self.rows / max(self.seconds, 1e-9), 1),
                "rows_per_second_per_core": round(self.rows / max(self.core_seconds, 1e-9), 1)}


def build_index(specs: list[str], out: str | Path, config: IndexConfig, workers: int | None = None,
                progress: bool = True, ray: str | None = None) -> IndexResult:
    """Index the shards `specs` names into `out`. `ray`: run the per-shard work as tasks on the Ray cluster at
    this address ("local": a Ray instance started for this run) instead of local processes; the index is the
    same either way."""
    started = time.perf_counter()
    urls = expand_shards(specs)
    if not urls:
        raise ValueError("no shards given")
    config, tokenizer_record = config.with_tokenizer_for(out)
    parts, digest = parts_directory(out), config_digest(config.to_fingerprint_dict())
    with ThreadPoolExecutor(max_workers=16) as pool:  # a HEAD per object: many at once
        versions = dict(zip(urls, pool.map(shard_version, urls)))
    kept = {url: load_part(parts, url, versions[url], digest) for url in urls}
    pending = [url for url in urls if kept[url] is None]
    bar = tqdm(total=len(urls), initial=len(urls) - len(pending), unit="shard", desc="indexing", disable=not progress)
    pending_versions = [versions[url] for url in pending]
    fresh = (_index_shards_on_ray(pending, pending_versions, config, ray, bar) if ray
             else _index_shards(pending, pending_versions, config, workers, bar))
    bar.close()
    for url, result in fresh.items():  # kept before duplicates across shards are marked: those depend on the others
        save_part(parts, result, versions[url], digest)
    remove_stale_parts(parts, urls)
    results = [kept[url] or fresh[url] for url in urls]

    _mark_duplicates_across_shards(results)
    table = _rows_to_table(results)
    invalid = Counter(reason_category(r) for r in table.column("reason").to_pylist() if r is not None)
    config_fp = config.to_fingerprint_dict()
    info = IndexInfo(
        fingerprint=fingerprint_table(table, config_fp), source="shards", inputs=urls,
        image_policy=config.image_policy, video_policy=config.video_policy, tokenizer=tokenizer_record,
        chat_template=config.chat_template,
        skipped_shards=[{"shard": r.url, "error": r.error, "samples_read": len(r.rows)} for r in results if r.error],
        invalid_by_reason=dict(sorted(invalid.items())),
        objects={r.url: r.stamp.to_dict() for r in results if r.stamp} or None,
    )
    seconds = time.perf_counter() - started
    core_seconds = sum(r.seconds for r in fresh.values())
    info.rows_per_second = round(table.num_rows / max(seconds, 1e-9), 1)
    write_index(table, out, info)
    valid = int(np.count_nonzero(table.column("valid").to_numpy(zero_copy_only=False)))
    return IndexResult(str(out), info, table.num_rows, valid, seconds, core_seconds, len(urls) - len(pending))


def _index_shards(urls: list[str], versions: list, config: IndexConfig, workers: int | None,
                  bar) -> dict[str, ShardResult]:
    """Index these shards (at these versions), in parallel processes; {url: result}."""
    results: dict[str, ShardResult] = {}
    workers = max(1, min(workers or os.cpu_count() or 1, len(urls) or 1))
    if workers == 1:
        for url, version in zip(urls, versions):
            results[url] = index_shard(url, config, version)
            bar.update(1)
        return results
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for url, result in zip(urls, pool.map(index_shard, urls, [config] * len(urls), versions)):
            results[url] = result
            bar.update(1)
    return results


RAY_TASK_RETRIES = 3  # a task whose worker died (killed, out of memory, a crashing decoder) runs again


def _index_shards_on_ray(urls: list[str], versions: list, config: IndexConfig, address: str,
                         bar) -> dict[str, ShardResult]:
    """Index these shards as Ray tasks, one per shard; {url: result}. The cluster's workers must be able to
    import Packfeed (the same environment, or a runtime_env that installs it) and to read the shards."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'packfeed[ray]'") from None
    if not urls:
        return {}
    # "local" starts a Ray instance of our own (None would join any cluster `ray start` left on this machine)
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, include_dashboard=False)
    try:
        task = ray.remote(max_retries=RAY_TASK_RETRIES)(index_shard)
        config_ref = ray.put(config)
        running = {task.remote(url, config_ref, version): url for url, version in zip(urls, versions)}
        results: dict[str, ShardResult] = {}
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                url = running.pop(ref)
                try:
                    results[url] = ray.get(ref)
                except ray.exceptions.RayError as error:  # retries spent: report the shard, keep the others
                    results[url] = ShardResult(url, [], f"the Ray task failed: {type(error).__name__}: "
                                                         f"{str(error).splitlines()[0]}", 0.0)
                bar.update(1)
        return results
    finally:
        ray.shutdown()


def _mark_duplicates_across_shards(results: list[ShardResult]) -> None:
    """A key seen in an earlier shard makes the later sample invalid (keys name samples in packs and reports)."""
    first_shard: dict[str, str] = {}
    for result in results:
        for row in result.rows:
            earlier = first_shard.setdefault(row["key"], result.url)
            if earlier != result.url and row["valid"]:
                row.update(valid=False, reason=f"duplicate key: the key appears earlier in shard {earlier}")


def _rows_to_table(results: list[ShardResult]) -> pa.Table:
    rows = [row for result in results for row in result.rows]
    shard_index = np.concatenate([np.full(len(r.rows), k, dtype=np.int32) for k, r in enumerate(results)]) \
        if results else np.zeros(0, np.int32)
    columns: dict[str, Any] = {"sample_id": pa.array(np.arange(len(rows), dtype=np.int64))}
    columns["shard"] = pa.DictionaryArray.from_arrays(pa.array(shard_index, type=pa.int32()),
                                                      pa.array([r.url for r in results], type=pa.string()))
    for field_ in SCHEMA:
        if field_.name not in columns:
            columns[field_.name] = pa.array([row[field_.name] for row in rows], type=field_.type)
    return pa.table(columns, schema=SCHEMA)
