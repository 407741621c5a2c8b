"""Trainer-side Packfeed client: `PackStream` iterates a rank's balanced packs as torch tensors.

Depends only on the contract (`packfeed.v1`: the proto, `PlanConfig`, the Redis key layout), never on the
server's code: a trainer needs nothing but this package and a reachable server. Three rooms, bottom up (a room
imports none above it, and inside a room a module none on a floor above its own; tests/test_layout.py):

- `stream`: what comes from a server and goes to one: the wire, the step's tensors, the channel, decoding, the
  receiving thread, saved states, `PackStream`, its loaders, the `Producer` that puts live samples, finding
  servers, the embedded `LocalServer`.
- `model`: what a model makes of a step: Hugging Face model inputs (`model.hf`), attention masks, context
  parallel splits, shared prefixes, losses, the vision towers every rank runs.
- `frameworks`: the faces to the trainers people run: the HF `Trainer` and TRL's (`PackfeedTrainer`, SFT, GRPO),
  Lightning, Megatron. verl's face stands with the command line (`packfeed.cli.verl_ppo`), as it runs the planner
  on verl's driver, which no client code may import.

The names below load their module on first use, so a module that needs no tensors (finding servers through
Redis, `packfeed.client.stream.discovery`) is imported without torch. The modules' paths before the rooms
(`packfeed.client.hf_trainer`, ...) still import, with a DeprecationWarning naming the new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING

from packfeed.v1.layout import Layout, Seat
from packfeed.v1.options import CostModel, Oversize, PlanConfig, Strategy

if TYPE_CHECKING:
    from packfeed.client.stream.channel import Connection, PackfeedError, ProducersGone
    from packfeed.client.stream.discovery import servers_from_redis
    from packfeed.client.stream.local import LocalServer
    from packfeed.client.stream.pack_stream import PackStream
    from packfeed.client.stream.claims import Reservation, Rollout
    from packfeed.client.stream.producer import Producer, PutResult, Sample, SampleRefused
    from packfeed.client.stream.tensors import PackTensors, Step

_MODULE_OF = {"Connection": "stream.channel", "PackfeedError": "stream.channel", "ProducersGone": "stream.channel",
              "Reservation": "stream.claims", "Rollout": "stream.claims",
              "servers_from_redis": "stream.discovery", "LocalServer": "stream.local", "PackStream": "stream.pack_stream",
              "Producer": "stream.producer", "PutResult": "stream.producer", "Sample": "stream.producer",
              "SampleRefused": "stream.producer", "PackTensors": "stream.tensors", "Step": "stream.tensors"}

__all__ = ["Connection", "CostModel", "Layout", "LocalServer", "Oversize", "PackStream", "PackTensors", "PackfeedError",
           "PlanConfig", "Producer", "ProducersGone", "PutResult", "Reservation", "Rollout", "Sample", "SampleRefused",
           "Seat", "Step", "Strategy", "servers_from_redis"]

# Where each module stood before the client had rooms -> where it stands now.
MOVED = {"wire": "stream.wire", "tensors": "stream.tensors", "channel": "stream.channel", "decode": "stream.decode",
         "receiver": "stream.receiver", "resume": "stream.resume", "loss_reports": "stream.loss_reports",
         "local": "stream.local", "producer": "stream.producer", "stream_keywords": "stream.keywords",
         "loaders": "stream.loaders", "discovery": "stream.discovery", "attention": "model.attention",
         "shared_prefix": "model.shared_prefix", "context_parallel": "model.context_parallel", "hf": "model.hf",
         "hf_config": "model.hf_config", "hf_families": "model.hf_families", "towers": "model.towers",
         "losses": "model.losses", "dataset_losses": "model.dataset_losses", "guard_updates": "model.guard_updates",
         "hf_trainer": "frameworks.hf_trainer", "sft_trainer": "frameworks.sft_trainer",
         "lightning": "frameworks.lightning", "megatron": "frameworks.megatron", "trl": "frameworks.trl",
         "grpo_prompts": "frameworks.grpo_prompts", "grpo_config": "frameworks.grpo_config"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import packfeed.client.hf_trainer` gives the module at its new path (the same module object, so its
    classes are the same classes), warning once per module. (`packfeed.client.stream` is now the stream's room,
    whose `PackStream` it still exports.)"""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(f"{__name__}.")
        return importlib.util.spec_from_loader(fullname, self) if fullname != old and old in MOVED else None

    def create_module(self, spec):
        new = f"{__name__}.{MOVED[spec.name.removeprefix(__name__ + '.')]}"
        warnings.warn(f"{spec.name} moved to {new}: import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._own_spec = module.__spec__  # the import system sets the old path's spec on it next
        return module

    def exec_module(self, module) -> None:  # the module ran at its new path: it keeps that path's spec
        module.__spec__ = self._own_spec


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'packfeed.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"packfeed.client.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
