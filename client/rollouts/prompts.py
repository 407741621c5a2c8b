"""The prompts of a reinforcement-learning run: a Packfeed job over the server's prompt index (JOB-prompts) that gives
every consumer (a trainer rank, a rollout worker) the same number of prompts a step, balanced on their tokens, each
as the model generates from it: its tokens before its first loss token (image placeholders expanded, as the
trainer sees them) and its images' model inputs (pixel values and `image_grid_thw`), decoded and laid out once, on
the loader server. TRL's face (`packfeed.client.frameworks.trl`) and the rollout workers (`worker`) read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from packfeed.client.model.hf import to_hf_inputs
from packfeed.client.stream.channel import Connection, PackfeedError
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors
from packfeed.v1.options import PlanConfig


@dataclass(frozen=True)
class Prompt:
    """One prompt of the prompt job, as the model generates from it."""

    key: str  # the indexed sample's key: its group, and where its images come from
    ids: list[int]  # its tokens before the first loss token, image placeholders included
    solution: list[int]  # its loss tokens (the indexed answer)
    fields: dict[str, torch.Tensor]  # its images' model inputs (pixel_values, image_grid_thw), empty for text
    token_types: list[int]  # mm_token_type_ids of its tokens (1: an image placeholder)
    source: str = ""  # its dataset (a mixture's name for it)


def prompts_of(pack: PackTensors, family: str, conventions: Any) -> list[Prompt]:
    """The prompts of a pack of the prompt job, each with the model inputs of its own images."""
    if pack.empty:
        return []
    inputs = to_hf_inputs(pack, family, conventions=conventions)
    if "pixel_values_videos" in inputs:
        raise PackfeedError(f"prompts {pack.sample_keys}: a video in a GRPO prompt is not supported yet")
    grids = inputs.get("image_grid_thw")
    rows = grids.prod(dim=1).tolist() if grids is not None else []
    starts = np.cumsum([0] + rows)
    image_sample = pack.image_sample.tolist() if "image_sample" in pack.tensors else []
    bounds, ids, labels = pack.cu_seqlens.tolist(), pack.input_ids.tolist(), pack.labels.tolist()
    types = inputs["mm_token_type_ids"][0].tolist() if "mm_token_type_ids" in inputs else [0] * len(ids)
    out = []
    for i, key in enumerate(pack.sample_keys):
        tokens, targets = ids[bounds[i]:bounds[i + 1]], labels[bounds[i]:bounds[i + 1]]
        trained = [t for t, label in enumerate(targets) if label != IGNORE_INDEX]
        if not trained:
            raise PackfeedError(f"prompt {key!r} has no answer: give every prompt an assistant turn (its reference "
                                "answer, given to reward functions as `solution`); the prompt is what precedes it")
        images = [j for j, owner in enumerate(image_sample) if owner == i]
        fields = {}
        if images:
            first, last = images[0], images[-1] + 1
            fields = {"pixel_values": inputs["pixel_values"][starts[first]:starts[last]],
                      "image_grid_thw": grids[first:last]}
        out.append(Prompt(key, tokens[:trained[0]], [tokens[t] for t in trained], fields,
                          types[bounds[i]:bounds[i] + trained[0]],
                          pack.sample_sources[i] if pack.sample_sources else ""))
    return out


def prompt_job_stream(target: str | list[str], job: str, *, consumers: int, consumer: int, per_consumer: int,
                      seed: int = 0, epochs: int = 1, dataset: str = "", connection: Connection | None = None,
                      window: int = 0) -> PackStream:
    """Consumer `consumer`'s stream of the run's prompt job (JOB-prompts): each of the `consumers` gets
    `per_consumer` prompts a step, balanced over them on their tokens (`length-group`), for `epochs` epochs. Its
    `conventions` size a model built for the dataset. `window`: samples planned at a time, which a mixture whose
    weights move needs (docs/planning.md "Mixtures that move")."""
    plan = PlanConfig(dp=consumers, microbatches=1, strategy="length-group", samples_per_pack=per_consumer,
                      window=window)
    return PackStream(target, job=f"{job}-prompts", rank=consumer, plan=plan, seed=seed, epochs=epochs,
                      dataset=dataset, connection=connection)
