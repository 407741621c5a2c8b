"""What goes into an inference engine and what comes out, whatever the engine (vLLM's `LLM` in the rollout process,
a vLLM server over HTTP): a prompt exactly as the trainer will see it, and each sampled completion with the
engine's own log-probability of every token it sampled (the behaviour policy's).

vLLM's `LLM` expands each image's placeholder itself, from its `image_grid_thw`: it takes the prompt's tokens with
one placeholder per image. Given the trainer's expanded tokens it would expand them again and generate from a
wrong prompt without an error, so `engine_request` collapses each image's run and checks its length; an engine
that takes the prompt expanded, with its images' positions (vLLM's tokens-in endpoint), gets the trainer's tokens
back from `EngineRequest.expanded`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from packfeed.client.rollouts.prompts import Prompt
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.stream.channel import PackfeedError


@dataclass(frozen=True)
class EngineRequest:
    """One prompt as an engine takes it. `token_ids`: its tokens with one image placeholder per image;
    `pixel_values` / `image_grid_thw`: its images exactly as the trainer gets them (normalised patches laid out by
    the loader server; None for a text prompt)."""

    key: str
    token_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    placeholder: int = -1  # the image placeholder's id
    runs: tuple[int, ...] = ()  # each image's placeholder count, expanded

    @property
    def images(self) -> int:
        return 0 if self.image_grid_thw is None else len(self.image_grid_thw)

    def expanded(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The tokens as the trainer sees them (each image's placeholder expanded to its run) and each image's
        run as (offset, length): for engines that take a prompt already expanded, with its images' positions."""
        ids, spans, runs = [], [], iter(self.runs)
        for token in self.token_ids:
            if token != self.placeholder:
                ids.append(token)
                continue
            length = next(runs)
            spans.append((len(ids), length))
            ids += [token] * length
        return ids, spans


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled. `seed`: with a request's key, the seed of its completions (the same prompt,
    seed and weights sample the same completions); `stop_token_ids`: besides the model's end of sequence."""

    max_tokens: int = 256
    min_tokens: int = 0  # no end of sequence or stop token before this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not (0 <= self.min_tokens <= self.max_tokens and self.max_tokens >= 1 and self.temperature >= 0
                and 0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p <= 1
                and self.repetition_penalty > 0):
            raise ValueError(f"{self}: 0 <= min_tokens <= max_tokens, max_tokens >= 1, temperature >= 0, "
                             "0 < top_p <= 1, top_k >= 0, 0 <= min_p <= 1 and repetition_penalty > 0")

    def seed_of(self, key: str) -> int:
        """The seed of a request's completions: the run's seed and the prompt's key."""
        digest = hashlib.blake2b(f"{self.seed}/{key}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass(frozen=True)
class Completion:
    """One sampled completion: its tokens, the engine's log-probability of each (the behaviour log-probabilities
    of the loss), and whether it ended by itself (end of sequence or a stop token) or was cut at max_tokens."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    finished: bool

    def __post_init__(self):
        if len(self.token_ids) != len(self.logprobs):
            raise PackfeedError(f"the engine gave {len(self.token_ids)} tokens and {len(self.logprobs)} "
                                "log-probabilities: ask it for the sampled token's log-probability (logprobs=0)")


def cut_at(completion: Completion, token_ids: set[int]) -> Completion:
    """The completion up to the first of `token_ids` it holds (the stop it ended on, left out), or whole. A
    completion must never hold an image placeholder (the trainer would find no image for it), so placeholders are
    stop tokens and are cut: stopping leaves the sampling distribution, and so the behaviour log-probabilities, as
    they are, where suppressing the token would change both."""
    hits = np.flatnonzero(np.isin(completion.token_ids, list(token_ids)))
    if not len(hits):
        return completion
    return Completion(completion.token_ids[:hits[0]], completion.logprobs[:hits[0]], True)


def placeholders_of(conventions: Any) -> set[int]:
    """The dataset's image and video placeholder ids (`ModelConventions`)."""
    found = {conventions.image_context_id}
    if conventions.HasField("video_context_id"):
        found.add(conventions.video_context_id)
    return found


class Engine(Protocol):
    """An inference engine the rollout worker generates with (`VLLMEngine`, `VLLMServerEngine`)."""

    def generate(self, requests: list[EngineRequest], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions of each request, in order."""

    def load_version(self, weights: WeightVersions, version: int, timeout_s: float) -> None:
        """Replace the model's weights by `version`'s from `weights` (waiting up to `timeout_s` for it to be
        published) and forget what the old ones computed (prefix and multimodal caches)."""

    def decode(self, token_ids: list[int]) -> str:
        """Text of tokens, for reward functions."""


def engine_request(prompt: Prompt, conventions: Any) -> EngineRequest:
    """`prompt` as an engine takes it: each image's run of placeholders (`conventions.image_context_id`, the
    dataset's `ModelConventions`) collapsed to one. A run whose length is not its image's placeholder count (its
    `image_grid_thw` over the patches a placeholder stands for), or a count of runs that is not the prompt's image
    count, is refused."""
    placeholder, runs, ids = conventions.image_context_id, [], []
    for token in prompt.ids:
        if token == placeholder and ids and ids[-1] == placeholder:
            runs[-1] += 1
            continue
        if token == placeholder:
            runs.append(1)
        ids.append(token)
    grid = prompt.fields.get("image_grid_thw")
    per_unit = max(1, conventions.image_policy.patches_per_unit)
    needed = [] if grid is None else [int(g.prod()) // per_unit for g in grid]
    if runs != needed:
        raise PackfeedError(f"prompt {prompt.key!r}: its image placeholders run {runs} tokens, its images need "
                            f"{needed}: the index's placeholders and the served images disagree (re-index with the "
                            "model's image policy)")
    return EngineRequest(prompt.key, ids, prompt.fields.get("pixel_values"), grid, placeholder, tuple(runs))
