"""Assembling a pack: the samples of one microbatch of one rank, concatenated without padding.

LLM side: `input_ids`, `labels`, `position_ids` (restarting at 0 in every sample) and `cu_seqlens` (sample
boundaries, for variable-length attention, so samples never attend to each other). Vision side: every tile
of every image as one flat uint8 buffer with per-tile (C, H, W) shapes, the tile -> image and image ->
sample maps, and each image's placeholder span in `input_ids`, where the projected vision features go.
Tensors travel as raw little-endian bytes + dtype + shape (`packfeed.server.serve.wire`), never as repeated numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from packfeed.media.chat import IGNORE_INDEX
from packfeed.media.pixels import GEOMETRY_COLUMNS
from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.preprocess import SampleTensors
from packfeed.v1.options import VisualKind


@dataclass(frozen=True)
class Chunks:
    """A 1-D tensor kept as the arrays it is made of, in order: a pack's pixels, each tile as cut. The wire writes
    them one after another into the step's shared file (`packfeed.server.serve.wire`), so the pixels are never
    joined into one array on the way. `np.asarray` joins them (for readers that want one array)."""

    arrays: tuple[np.ndarray, ...]
    dtype: np.dtype

    def __len__(self) -> int:
        return sum(array.size for array in self.arrays)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        joined = np.concatenate([array.reshape(-1) for array in self.arrays]) if self.arrays \
            else np.zeros(0, self.dtype)
        return joined if dtype is None else joined.astype(dtype)


@dataclass
class Pack:
    epoch: int
    step: int
    rank: int
    microbatch: int
    sample_keys: list[str]
    tensors: dict[str, np.ndarray | Chunks]
    loss_tokens: int
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) of samples left out
    step_loss_tokens: int = 0  # filled in once every pack of the step is known
    sample_sources: list[str] = field(default_factory=list)  # the dataset of each sample (mixtures mix them)
    positions: list[int] = field(default_factory=list)  # each sample's position among the planned members
    encoder: bool = False  # an encoder rank's pack (PlanSpec.encoder_ranks): images to encode, no LLM side
    sample_groups: list[str] = field(default_factory=list)  # a live job's: the prompt each sample answers

    @property
    def empty(self) -> bool:
        if self.encoder:
            return not len(self.tensors.get("encode_target", ()))
        return not self.sample_keys


def assemble_pack(samples: list[SampleTensors], epoch: int, step: int, rank: int, microbatch: int,
                  skipped: list[tuple[str, str]] | None = None) -> Pack:
    lengths = [len(s.input_ids) for s in samples]
    cu_seqlens = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    input_ids = np.concatenate([s.input_ids for s in samples]) if samples else np.zeros(0, np.int32)
    labels = np.concatenate([s.labels for s in samples]) if samples else np.zeros(0, np.int32)
    position_ids = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]) if samples \
        else np.zeros(0, np.int32)

    tiles = [tile for s in samples for tile in s.tiles]
    geometry = [g for s in samples for g in s.geometry]
    shapes = [t.shape for t in tiles] or [shape for g in geometry for shape in g.tile_shapes()]
    tile_shapes = np.array(shapes, dtype=np.int32).reshape(-1, 3)
    pixels = Chunks(tuple(tiles), np.dtype(np.uint8))
    tile_image, image_sample, spans = [], [], []
    image_no = 0
    for k, sample in enumerate(samples):
        for n_tiles, n_tokens, start in zip(sample.tiles_per_image, sample.image_tokens, sample.image_starts):
            tile_image.extend([image_no] * n_tiles)
            image_sample.append(k)
            spans.append((int(cu_seqlens[k]) + start, n_tokens))
            image_no += 1
    tensors = {
        "input_ids": input_ids.astype(np.int32),
        "labels": labels.astype(np.int32),
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "pixels": pixels,
        "tile_shapes": tile_shapes,
        "tile_image": np.asarray(tile_image, dtype=np.int32),
        "image_sample": np.asarray(image_sample, dtype=np.int32),
        "image_token_spans": np.asarray(spans, dtype=np.int32).reshape(-1, 2),
        "visual_kind": np.asarray([kind for s in samples for kind in s.kinds], dtype=np.int32),
        "frame_seconds": np.asarray([seconds for s in samples for seconds in s.frame_seconds], dtype=np.float32),
    }
    if geometry:  # pixels: encoded: the client decodes these into `pixels` (packfeed.client.stream.decode)
        files = [data for s in samples for data in s.encoded]
        tensors["encoded"] = np.frombuffer(b"".join(files), dtype=np.uint8)
        tensors["encoded_sizes"] = np.array([len(data) for data in files], dtype=np.int64)
        tensors["image_geometry"] = np.array([g.row() for g in geometry], dtype=np.int32).reshape(-1, GEOMETRY_COLUMNS)
    live = any(s.policy_version is not None for s in samples)
    if live:
        tensors.update(_live_tensors(samples, lengths))
    return Pack(epoch, step, rank, microbatch, [s.key for s in samples], tensors,
                int((labels != IGNORE_INDEX).sum()), list(skipped or []), sample_sources=[s.source for s in samples],
                sample_groups=[s.group for s in samples] if live else [])


TOKEN_VERSIONS = "token_policy_version"  # a live pack's tensor of each token's policy version (int64, L)


def _live_tensors(samples: list[SampleTensors], lengths: list[int]) -> dict[str, np.ndarray]:
    """A live job's per-token tensors ("token.NAME", float32 beside input_ids; 0 where a sample has none), each
    sample's policy version, each token's ("token_policy_version", int64) and each sample's values ("value.NAME",
    float64; NaN where a sample has none)."""
    out = {}
    for name in sorted({name for s in samples for name in s.token_tensors}):
        out[f"token.{name}"] = np.concatenate([s.token_tensors.get(name, np.zeros(n, np.float32))
                                               for s, n in zip(samples, lengths)]).astype(np.float32)
    out["policy_version"] = np.array([s.policy_version or 0 for s in samples], dtype=np.int64)
    out[TOKEN_VERSIONS] = np.concatenate(
        [s.token_versions if s.token_versions is not None else np.full(n, s.policy_version or 0, np.int64)
         for s, n in zip(samples, lengths)] or [np.zeros(0, np.int64)]).astype(np.int64)
    for name in sorted({name for s in samples for name in s.values}):
        out[f"value.{name}"] = np.array([s.values.get(name, np.nan) for s in samples], dtype=np.float64)
    return out


def truncate_sample(sample: SampleTensors, limit: int) -> SampleTensors:
    """The sample cut to at most `limit` tokens (the `truncate` oversize policy). An image whose placeholder
    run would be cut is dropped with everything after it, so every image kept has all its tokens."""
    if len(sample.input_ids) <= limit:
        return sample
    keep_images = 0
    for start, n_tokens in zip(sample.image_starts, sample.image_tokens):
        if start + n_tokens > limit:
            limit = min(limit, start)
            break
        keep_images += 1
    n_tiles = sum(sample.tiles_per_image[:keep_images])
    n_encoded = sum(kind == VisualKind.IMAGE for kind in sample.kinds[:keep_images]) if sample.encoded else 0
    return SampleTensors(sample.key, sample.input_ids[:limit], sample.labels[:limit], sample.tiles[:n_tiles],
                         sample.tiles_per_image[:keep_images], sample.image_tokens[:keep_images],
                         sample.image_starts[:keep_images], sample.source, sample.encoded[:n_encoded],
                         sample.geometry[:n_encoded], sample.kinds[:keep_images], sample.frame_seconds[:keep_images],
                         {name: values[:limit] for name, values in sample.token_tensors.items()}, sample.group,
                         sample.policy_version, None if sample.token_versions is None else sample.token_versions[:limit],
                         sample.values)


def build_pack(parts: list[tuple[IndexRows, Any, str]], members: np.ndarray, truncate_to: np.ndarray,
               sources: np.ndarray, epoch: int, step: int, rank: int, microbatch: int, seed: int = 0,
               shared_prefixes: bool = False) -> Pack:
    """One pack from its planned members; member k is sample `members[k]` of `parts[sources[k]]` (rows, reader,
    dataset label); `seed` is the job's (random video frames are drawn from it). A sample that fails at serve
    time is left out and reported in the pack's `skipped`; the pack still goes out, flagged empty if nothing is
    left. `shared_prefixes`: the job plans groups with their prefix shared (docs/wire.md "Shared prefixes");
    each member's rows then say what it shares its prefix with (`prefix_of`)."""
    chosen = list(zip(np.asarray(members).tolist(), np.asarray(sources).tolist()))
    prefixes = [parts[source][0].prefix_of(sample_id) if shared_prefixes else None for sample_id, source in chosen]
    owners = _prefix_owners(prefixes)
    forks = _fork_parents(parts, chosen) if shared_prefixes else [None] * len(chosen)
    reads = [owner == k for k, owner in enumerate(owners)]  # a sibling's images are its owner's: not read
    own_only = [fork is not None for fork in forks]  # a fork's inherited images are its parent's, in the pack
    loaded, skipped = load_members(parts, members, truncate_to, sources, epoch, seed, pixels=reads, own_only=own_only)

    def reload(position: int) -> list[tuple[int, SampleTensors]]:  # a sibling standing alone: with its images
        again, failed = load_members(parts, members[position:position + 1], truncate_to[position:position + 1],
                                     sources[position:position + 1], epoch, seed)
        skipped.extend(failed)
        return [(position, sample) for _, sample in again]

    loaded, rows = _shared(loaded, prefixes, owners, reload, forks)
    pack = assemble_pack([sample for _, sample in loaded], epoch, step, rank, microbatch, skipped)
    if rows is not None:
        pack.tensors["shared_prefix"] = rows
    pack.positions = [position for position, _ in loaded]
    return pack


def _prefix_owners(prefixes: list) -> list[int]:
    """Per member, the first member of the pack sharing its prefix (itself when none before it does)."""
    first: dict[str, int] = {}
    return [first.setdefault(prefix[0], k) if prefix else k for k, prefix in enumerate(prefixes)]


def _fork_parents(parts, chosen: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
    """Per member, a fork's (parent's position in the pack, tokens it shares with it) where its parent is in the
    pack before it, else None (it is then read whole, its inherited images too)."""
    forks = [parts[source][0].fork_of(sample_id) for sample_id, source in chosen]
    if not any(forks):
        return forks
    position_of = {(source, parts[source][0].key_of(parts[source][0].row(sample_id))): k
                   for k, (sample_id, source) in enumerate(chosen)}
    out = []
    for k, fork in enumerate(forks):
        parent = position_of.get((chosen[k][1], fork[0]), k) if fork else k
        out.append((parent, int(fork[1])) if parent < k else None)
    return out


def _shared(loaded, prefixes, owners, reload, forks) -> tuple[list, np.ndarray | None]:
    """The loaded members and their `shared_prefix` rows (docs/wire.md "Shared prefixes"; None when nothing is
    shared). A sibling whose owner loaded with its whole prefix shares it and carries no images (every image of a
    grouped sample is in its prefix); one whose owner did not (it failed to load, or was cut short) is read again
    with its images (`reload`) and shares nothing. A fork (`forks`: its parent's position and shared tokens) was
    read without its inherited images: it shares them with its parent where that one loaded with them, else it
    is read again whole."""
    by_position = dict(loaded)

    def holds(parent: int, size: int, sample: SampleTensors) -> bool:  # both loaded with the shared tokens
        return size >= 2 and parent in by_position and min(len(by_position[parent].input_ids),
                                                           len(sample.input_ids)) >= size

    kept = []  # (position, sample, its owner's position or None, shared tokens)
    for position, sample in loaded:
        owner = owners[position]
        size = int(prefixes[position][1]) if prefixes[position] else 0
        if forks[position] is not None:
            owner, size = forks[position]
        if owner == position:
            kept.append((position, sample, None, 0))
        elif holds(owner, size, sample):  # a sibling's images are its owner's; a fork was read without its own
            kept.append((position, sample if forks[position] is not None else _without_images(sample), owner, size))
        else:
            kept += [(p, again, None, 0) for p, again in reload(position)]
    index = {position: k for k, (position, *_) in enumerate(kept)}
    owning: dict[int, int] = {}
    for *_, owner, size in kept:  # a root's S: the most tokens a sample shares with it
        if owner is not None:
            owning[owner] = max(owning.get(owner, 0), size)
    rows = [[index[owner], size] if owner is not None else [k, owning.get(position, 0)]
            for k, (position, _, owner, size) in enumerate(kept)]
    table = np.array(rows, dtype=np.int32).reshape(-1, 2)
    return [(position, sample) for position, sample, *_ in kept], table if owning else None


def _without_images(sample: SampleTensors) -> SampleTensors:
    """A sibling's sample without images: they are its owner's (every image of a grouped sample is in its
    prefix)."""
    return replace(sample, tiles=[], tiles_per_image=[], image_tokens=[], image_starts=[], encoded=[], geometry=[],
                   kinds=[], frame_seconds=[])


def load_members(parts: list[tuple[IndexRows, Any, str]], members: np.ndarray, truncate_to: np.ndarray,
                 sources: np.ndarray, epoch: int, seed: int = 0, pixels: np.ndarray | None = None,
                 own_only: list[bool] | None = None) -> tuple[list[tuple[int, SampleTensors]], list[tuple[str, str]]]:
    """(position, sample) of every member that loads, and (key, reason) of those that do not. `pixels`: per
    member, whether to read its images (False: text and placeholder counts only); all when None. `own_only`: per
    member, a fork read without the images it inherits."""
    from packfeed.server.serve.shard_reader import SampleSkipped

    loaded, skipped = [], []
    with_pixels = np.ones(len(members), dtype=bool) if pixels is None else np.asarray(pixels, dtype=bool)
    chosen = [(parts[source], parts[source][0].row(sample_id), limit) for sample_id, limit, source in
              zip(members.tolist(), np.asarray(truncate_to).tolist(), np.asarray(sources).tolist())]
    for part in {id(part): part for part, _, _ in chosen}.values():  # object stores: all ranges at once
        part[1].prefetch([row for (other, row, _), read in zip(chosen, with_pixels) if other is part and read])
    for position, ((rows, reader, label), row, limit) in enumerate(chosen):
        try:
            options = {"own_only": True} if own_only is not None and own_only[position] else {}
            sample = replace(reader.load(row, seed, epoch, pixels=bool(with_pixels[position]), **options), source=label)
        except SampleSkipped as error:
            skipped.append((rows.key_of(row), str(error)))
            continue
        loaded.append((position, truncate_sample(sample, limit) if limit > 0 else sample))
    return loaded, skipped
