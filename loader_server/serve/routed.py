"""Routed packs (`isf+phases`): every rank encodes the images the plan assigns it, whichever rank's pack
consumes them, and one all-to-all per step hands each encoder output to its consumer.

Pack m of rank r carries two things:
- The LLM side of its own samples, as every pack does (input_ids ... image_token_spans, visual_kind), with
  `image_encoder` (images x 3, int32): for each of its images, the rank that encodes it, the sample's planned
  position in this pack, and the image's number in its sample. Images another rank encodes are not read here.
- The images rank r encodes whose samples train in microbatch m of any rank: `pixels`, `tile_shapes` and
  `tile_image` (or `encoded`, `encoded_sizes`, `image_geometry`) describe those, in the order of
  `encode_target` (encoded images x 3, int32: the consuming rank, the sample's planned position in that rank's
  pack m, the image's number in its sample), with `encode_tokens` (each one's placeholder tokens).
(consumer rank, microbatch, position, image number) names every image on both sides, so the two agree on what
each output is without another message; a sample skipped on one side (a shard changed since indexing) simply
has no partner on the other, and the trainer leaves it out of the loss.

With the encoder on ranks of its own (PlanSpec.encoder_ranks E > 0) the two sides are two rank spaces: an LLM
rank's pack is the first half (`image_encoder` naming encoder ranks, no pixels: it encodes nothing), an encoder
rank's pack the second (no LLM side, `Pack.encoder` set).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.packs import Pack, assemble_pack, load_members

ENCODE_TENSORS = ("pixels", "tile_shapes", "tile_image", "encoded", "encoded_sizes", "image_geometry")


def routed_encodes(plan, step: int, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per microbatch: (plan members `rank` encodes there, their targets: (consumer rank, planned position))."""
    config = plan.config
    out = []
    for microbatch in range(config.microbatches):
        members, targets = [], []
        for consumer in range(config.dp):
            ids = plan.pack_with_truncation(step, consumer, microbatch)[0]
            mine = np.flatnonzero(plan.pack_encoders(step, consumer, microbatch) == rank)
            members.append(np.asarray(ids)[mine])
            targets.append(np.stack([np.full(len(mine), consumer), mine], axis=1))
        out.append((np.concatenate(members).astype(np.int64), np.concatenate(targets).astype(np.int32)))
    return out


def build_routed_pack(parts: list[tuple[IndexRows, Any, str]], pack: tuple, encoders: np.ndarray, encode: tuple,
                      epoch: int, step: int, rank: int, microbatch: int, seed: int = 0,
                      encodes_as: int | None = None) -> Pack:
    """Pack `microbatch` of `rank`: `pack` = its (sample ids, token limits, sources), `encoders` the rank encoding
    each of them; `encode` = (sample ids, sources, targets) of what this rank encodes for microbatch `microbatch`.
    A sample this rank both trains and encodes is read once. `encodes_as`: the number `encoders` gives this rank
    (`rank`; -1 for an LLM rank whose encoders are ranks of their own)."""
    encodes_as = rank if encodes_as is None else encodes_as
    members, truncate_to, sources = pack
    loaded, skipped = load_members(parts, members, truncate_to, sources, epoch, seed, pixels=encoders == encodes_as)
    mine = {(rank, position): sample for position, sample in loaded if encoders[position] == encodes_as}
    ids, encode_sources, targets = encode
    wanted = [i for i, (consumer, position) in enumerate(targets.tolist()) if (consumer, position) not in mine]
    others, failed = load_members(parts, ids[wanted], np.zeros(len(wanted), np.int64), encode_sources[wanted], epoch,
                                  seed)
    for k, sample in others:
        mine[tuple(targets[wanted[k]].tolist())] = sample
    encoded = [(tuple(target), mine[tuple(target)]) for target in targets.tolist() if tuple(target) in mine]
    result = assemble_pack([sample for _, sample in loaded], epoch, step, rank, microbatch,
                           skipped + [(key, f"{reason} (encoded for another rank)") for key, reason in failed])
    vision = assemble_pack([sample for _, sample in encoded], epoch, step, rank, microbatch)
    for name in ENCODE_TENSORS:
        result.tensors.pop(name, None)
        if name in vision.tensors:
            result.tensors[name] = vision.tensors[name]
    result.tensors["image_encoder"] = _image_rows(
        [(int(encoders[position]), position, sample) for position, sample in loaded])
    result.tensors["encode_target"] = _image_rows([(consumer, position, sample)
                                                   for (consumer, position), sample in encoded])
    result.tensors["encode_tokens"] = np.asarray([n for _, sample in encoded for n in sample.image_tokens],
                                                 dtype=np.int32)
    return result


def _image_rows(samples: list[tuple[int, int, Any]]) -> np.ndarray:
    """(rank, position, image number) for every image of every (rank, position, sample), in order."""
    rows = [(rank, position, k) for rank, position, sample in samples for k in range(len(sample.image_tokens))]
    return np.asarray(rows, dtype=np.int32).reshape(-1, 3)
