"""Generation that follows the trainer's weights (partial rollouts): completions are generated `chunk_tokens` at a
time, and between chunks, once the trainer has published newer weights, the engine loads them and the completions
still running go on from where they stopped, with those weights. What was generated is kept, not thrown away, and
each token keeps the log-probability and the policy version it was sampled with (the behaviour policy of the
decoupled loss, `packfeed.client.model.losses`).

A running completion continues as a request of its own: its prompt, then what it generated, one completion asked
for. The engine recomputes that prefix with the new weights (their load empties its prefix cache, which a chunk
fills again). Every completion still running after a chunk generated a whole chunk, so they all share one budget
(the tokens left of `max_tokens`, and of `min_tokens`). Each continuation is seeded by its prompt's key, its
member and its length, so a run with the same seeds and weights samples the same completions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from packfeed.client.rollouts.engine_io import Completion, Engine, EngineRequest, Sampling, cut_at


@dataclass
class Generated:
    """A completion and the policy version of each of its tokens."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finished: bool  # ended by itself (end of sequence or a stop token), not cut at max_tokens
    started: int  # the version it started with (its prompt's)

    @classmethod
    def of(cls, completion: Completion, version: int) -> Generated:
        return cls(completion.token_ids, completion.logprobs,
                   np.full(len(completion.token_ids), version, np.int64), completion.finished, version)

    def extended(self, completion: Completion, version: int) -> Generated:
        more = Generated.of(completion, version)
        return Generated(np.concatenate([self.token_ids, more.token_ids]),
                         np.concatenate([self.logprobs, more.logprobs]),
                         np.concatenate([self.versions, more.versions]), more.finished, self.started)

    @property
    def version(self) -> int:
        """The newest version that generated part of it."""
        return int(self.versions.max(initial=self.started))

    @property
    def continued(self) -> bool:
        """Generated with more than one version of the weights."""
        return self.version != self.started


def generate_following(engine: Engine, requests: list[EngineRequest], n: int, sampling: Sampling, chunk_tokens: int,
                       follow: Callable[[], int], stops: set[int]) -> list[list[Generated]]:
    """`n` completions of each request, `chunk_tokens` at a time; before each chunk `follow()` loads newer weights
    into the engine where there are and returns the version it then holds. Completions are cut at `stops`
    (`engine_io.cut_at`)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: give at least 1")
    version = follow()
    first = engine.generate(requests, n, _budget(sampling, 0, chunk_tokens))
    groups = [[Generated.of(cut_at(c, stops), version) for c in group] for group in first]
    while True:
        running = [(index, member) for index, group in enumerate(groups) for member, g in enumerate(group)
                   if not g.finished and len(g.token_ids) < sampling.max_tokens]
        if not running:
            return groups
        done = len(groups[running[0][0]][running[0][1]].token_ids)  # the same for all: see the docstring
        version = follow()
        asks = [_continuation(requests[index], member, groups[index][member]) for index, member in running]
        answers = engine.generate(asks, 1, _budget(sampling, done, chunk_tokens))
        for (index, member), (completion,) in zip(running, answers):
            groups[index][member] = groups[index][member].extended(cut_at(completion, stops), version)


def _budget(sampling: Sampling, done: int, chunk_tokens: int) -> Sampling:
    """The sampling of the chunk after `done` tokens: at most `chunk_tokens` more, within the whole budget."""
    return replace(sampling, max_tokens=min(chunk_tokens, sampling.max_tokens - done),
                   min_tokens=min(chunk_tokens, max(0, sampling.min_tokens - done)))


def _continuation(request: EngineRequest, member: int, generated: Generated) -> EngineRequest:
    """The request that goes on with a completion: its prompt then what it generated (no image placeholder:
    those are cut), seeded by its own key."""
    return replace(request, key=f"{request.key}#{member}@{len(generated.token_ids)}",
                   token_ids=[*request.token_ids, *generated.token_ids.tolist()])
