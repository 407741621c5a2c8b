"""A DP rank under torchrun (gloo) reading its steps through `StatefulPackLoader` and checkpointing the loader
with torch.distributed.checkpoint, as torchtitan's loops do. Writes the sample keys of the steps it read to
OUT/rank<r>.json.

    torchrun --nproc-per-node 2 tests/loader_worker.py TARGET JOB STEPS CHECKPOINT MODE OUT

MODE: save (read STEPS steps, then save the loader), load (load it, then read), fresh (read from the start)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from packfeed.client import PackStream
from packfeed.client.stream.loaders import StatefulPackLoader


def main(target: str, job: str, steps: int, checkpoint: str, mode: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with PackStream(target, job=job, rank=rank, dp=world, microbatches=2, seed=0, epochs=3) as stream:
            loader = StatefulPackLoader(stream)
            if mode == "load":
                dcp.load({"data": loader}, checkpoint_id=checkpoint)
            keys = [step.sample_keys for _, step in zip(range(steps), loader)]
            if mode == "save":
                dcp.save({"data": loader}, checkpoint_id=checkpoint)
        Path(out, f"rank{rank}.json").write_text(json.dumps(keys))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
