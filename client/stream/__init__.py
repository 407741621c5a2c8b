"""The stream: what a trainer gets from a Packfeed server and gives it. Floors, bottom up: the wire (`wire`) and
a step's tensors made of it (`tensors`), the channel to the servers (`channel`), decoding images and video
(`decode`), the receiving thread (`receiver`), a stream's saved state and the losses it reports
(`resume`, `loss_reports`), `PackStream` itself (`pack_stream`, its keywords in `keywords`) and the loaders
over it (`loaders`); beside them the `Producer` that puts a live job's samples (`producer`), finding servers
through Redis (`discovery`) and the embedded server (`local`).

`from packfeed.client.stream import PackStream` still works (the module's name before this room): it loads
on first use, so `discovery` imports without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packfeed.client.stream.pack_stream import PackStream

__all__ = ["PackStream"]


def __getattr__(name: str):
    if name != "PackStream":
        raise AttributeError(f"module 'packfeed.client.stream' has no attribute {name!r}")
    return importlib.import_module("packfeed.client.stream.pack_stream").PackStream
