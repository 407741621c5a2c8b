"""Trainer-side Packfeed client: `PackStream` iterates a rank's balanced packs as torch tensors.

Depends only on the contract (`packfeed.v1`: the proto, `PlanConfig`, the Redis key layout), never on the
server's code: a trainer needs nothing but this package and a reachable server.
"""

from packfeed.client.channel import Connection, PackfeedError
from packfeed.client.discovery import servers_from_redis
from packfeed.client.local import LocalServer
from packfeed.client.stream import PackStream
from packfeed.client.tensors import PackTensors, Step
from packfeed.v1.options import CostModel, Oversize, PlanConfig, Strategy

__all__ = ["Connection", "CostModel", "LocalServer", "Oversize", "PackStream", "PackTensors", "PackfeedError",
           "PlanConfig", "Step", "Strategy", "servers_from_redis"]
