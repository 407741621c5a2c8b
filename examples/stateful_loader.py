"""A torchtitan-style loop: the data loader is `Stateful` and goes into `torch.distributed.checkpoint` with the
model, so a restart continues at exactly the next step.

    (serve a job as in examples/hf_trainer.py)
    torchrun --nproc-per-node 2 examples/stateful_loader.py 127.0.0.1:50051 dcp-out --steps 2
    torchrun --nproc-per-node 2 examples/stateful_loader.py 127.0.0.1:50051 dcp-out --steps 2 --resume

Each step here only counts its samples; a real loop runs its model on `step.packs` (see docs/training.md "Train a
Hugging Face model").
"""

from __future__ import annotations

import argparse
import os
import socket

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from packfeed.client import PackStream
from packfeed.client.stream.loaders import StatefulPackLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Packfeed server, host:port")
    parser.add_argument("checkpoint", help="the DCP checkpoint folder")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true", help="load the loader's state from the checkpoint first")
    options = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:  # one process: a group of one, on a free port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with PackStream(options.target, job="dcp-example", rank=dist.get_rank(), dp=dist.get_world_size(),
                        microbatches=2, epochs=2) as stream:
            loader = StatefulPackLoader(stream)
            if options.resume:
                dcp.load({"dataloader": loader}, checkpoint_id=options.checkpoint)
            for _, step in zip(range(options.steps), loader):
                print(f"rank {dist.get_rank()}: epoch {step.epoch} step {step.step}, {len(step.sample_keys)} samples "
                      f"in {len(step.packs)} packs", flush=True)
            dcp.save({"dataloader": loader}, checkpoint_id=options.checkpoint)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
