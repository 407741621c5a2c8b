"""`spawn`: torch.distributed ranks for a test, as `torch.multiprocessing.spawn` starts them, but forked from one
fork server per test process that imported torch, transformers' VLM families and the trainer once.

A spawned rank imports all of that again (about 6 s of CPU on this 2-core host, more than most ranks' work); a
fork of the preloaded server starts in milliseconds. Each rank is still a fresh process of its own, with its own
process group over gloo. The fork server starts at the first call with the environment of that moment: tests
pass what a rank needs as arguments, never through variables set around the call."""

from __future__ import annotations

import multiprocessing

import torch.multiprocessing as mp

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    *(f"transformers.models.{family}.modeling_{family}" for family in
      ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl", "llava")),
    "packfeed.trainer.models", "packfeed.trainer.parallel.pipeline", "packfeed.client.model.hf",
    "trainer_workers", "hf_models",
]


def spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """`torch.multiprocessing.spawn(fn, args, nprocs, join)`, the ranks forked from the preloaded fork server."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the fork server starts: the first call
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
