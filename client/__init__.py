"""Trainer-side Packfeed client: `PackStream` iterates a rank's balanced packs as torch tensors."""

from packfeed.client.discovery import servers_from_redis
from packfeed.client.local import LocalServer
from packfeed.client.stream import PackfeedError, PackStream, PackTensors, Step

__all__ = ["LocalServer", "PackStream", "PackTensors", "PackfeedError", "Step", "servers_from_redis"]
