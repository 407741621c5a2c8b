"""Trainer-side Packfeed client: `PackStream` iterates a rank's balanced packs as torch tensors.

Depends only on the contract (`packfeed.v1`: the proto, `PlanConfig`, the Redis key layout), never on the
server's code: a trainer needs nothing but this package and a reachable server. Its floors, bottom up (a module
imports none above its own; tests/test_layout.py): the wire and the tensors made of it, the channel, decoding
and the Hugging Face model inputs, the receiving thread and saved states (`resume`), the stream, the loaders,
the framework integrations.

The names below load their module on first use, so a module that needs no tensors (finding servers through
Redis, `packfeed.client.discovery`) is imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from packfeed.v1.layout import Layout, Seat
from packfeed.v1.options import CostModel, Oversize, PlanConfig, Strategy

if TYPE_CHECKING:
    from packfeed.client.channel import Connection, PackfeedError
    from packfeed.client.discovery import servers_from_redis
    from packfeed.client.local import LocalServer
    from packfeed.client.producer import Producer, PutResult, Sample, SampleRefused
    from packfeed.client.stream import PackStream
    from packfeed.client.tensors import PackTensors, Step

_MODULE_OF = {"Connection": "channel", "PackfeedError": "channel", "servers_from_redis": "discovery",
              "LocalServer": "local", "PackStream": "stream",
              "Producer": "producer", "PutResult": "producer", "Sample": "producer", "SampleRefused": "producer", "PackTensors": "tensors", "Step": "tensors"}

__all__ = ["Connection", "CostModel", "Layout", "LocalServer", "Oversize", "PackStream", "PackTensors", "PackfeedError",
           "PlanConfig", "Producer", "PutResult", "Sample", "SampleRefused", "Seat", "Step", "Strategy", "servers_from_redis"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'packfeed.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"packfeed.client.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
