"""Asynchronous RL on the producer's side (docs/live.md "Asynchronous RL"): the heartbeats that keep a `Producer`
alive in its job's eyes (what it reserved and claimed lasts while they arrive), the `Reservation` a producer holds
under staleness wait, and a claimed `Rollout`, an unfinished generation to continue with newer weights.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from packfeed.client.stream.channel import PackfeedError
from packfeed.v1 import packfeed_pb2 as pb

HEARTBEAT_S = 5.0  # how often a producer says it is alive; it counts as gone after LEASE_HEARTBEATS of them
LEASE_HEARTBEATS = 3


def new_producer_id() -> str:
    """One per Producer: what the server knows it by (its host and process, for a person reading it)."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Reservation:
    """The right to generate `samples` samples of `group` with policy `policy_version` (staleness wait): put them
    with that group and version; it ends once they arrived (or the producer is gone)."""

    group: str
    samples: int
    policy_version: int


@dataclass
class Rollout:
    """An unfinished rollout as claimed (`Producer.claim`): its id, the part put last, its tokens so far with their
    loss mask, per-token tensors and each token's policy version, its group, prompt and images. Continue it with
    `continued` and put what that returns."""

    id: str
    part: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    tensors: dict[str, np.ndarray]
    token_versions: np.ndarray
    group: str = ""
    prompt: str = ""
    images: list = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, message: pb.LiveSample) -> Rollout:
        def array(tensor: pb.Tensor) -> np.ndarray:
            return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).copy()

        return cls(message.id, message.part, array(message.tokens), array(message.loss_mask),
                   {name: array(tensor) for name, tensor in message.tensors.items()}, array(message.token_versions),
                   message.group, message.prompt, list(message.images), dict(message.values))

    @property
    def policy_version(self) -> int:
        """The newest policy that generated part of it."""
        return int(self.token_versions.max(initial=0))

    def continued(self, tokens: Any, policy_version: int, *, loss_mask: Any = None,
                  tensors: dict[str, Any] | None = None, finished: bool = True,
                  values: dict[str, float] | None = None) -> dict[str, Any]:
        """The next part: this rollout followed by `tokens` generated with `policy_version` (their loss mask,
        default all 1, and per-token tensors, one value per new token for every tensor the rollout carries),
        finished (the whole rollout: trained once) or unfinished again. A sample's fields, to `Producer.put`."""
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)
        mask = np.ones(len(new), np.uint8) if loss_mask is None else np.asarray(loss_mask, np.uint8).reshape(-1)
        added = dict(tensors or {})
        if set(added) != set(self.tensors) or len(mask) != len(new):
            raise ValueError(f"a continuation gives a loss mask and every tensor of the rollout "
                             f"({sorted(self.tensors)}), one value per new token ({len(new)})")
        joined = {name: np.concatenate([values_, np.asarray(added[name], np.float32).reshape(-1)])
                  for name, values_ in self.tensors.items()}
        versions = np.concatenate([self.token_versions, np.full(len(new), policy_version, np.int64)])
        return {"id": self.id, "tokens": np.concatenate([self.tokens, new]),
                "loss_mask": np.concatenate([self.loss_mask, mask]), "tensors": joined, "group": self.group,
                "policy_version": int(versions.max(initial=0)), "prompt": self.prompt, "images": list(self.images),
                "values": dict(values or self.values), "unfinished": not finished, "part": self.part + 1,
                "token_versions": versions}


class Heartbeats:
    """A daemon thread saying `beat()` every `every_s` seconds until `stop()` (errors are the next beat's to mend:
    a server that does not know the job yet, a restart, a failover)."""

    def __init__(self, beat: Callable[[], None], every_s: float):
        self._beat, self._every = beat, every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="packfeed-producer-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._beat()
            except PackfeedError:
                pass
            if self._stopped.wait(self._every):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self._every + 1)
