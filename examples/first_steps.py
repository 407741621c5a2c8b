"""The client's first steps: an embedded server for an index, and one rank's packs as torch tensors.

    python examples/first_steps.py tour/index.parquet

`PackStream(index=...)` starts a `packfeed serve` process on loopback for this process alone; on a cluster,
give the servers' addresses instead (`PackStream("host:50051", ...)`, docs/training.md).
"""

from __future__ import annotations

import argparse

from packfeed.client import PackStream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("index", help="an index written by `packfeed index`")
    parser.add_argument("--steps", type=int, default=1, help="steps to print")
    args = parser.parse_args()
    # rank 0 of a job planned for 2 data-parallel ranks and 2 microbatches a step: its 2 packs of each step
    with PackStream(index=args.index, job="first-steps", rank=0, dp=2, microbatches=2) as stream:
        for step, _ in zip(stream, range(args.steps)):
            print(f"epoch {step.epoch} step {step.step}: {len(step.sample_keys)} samples in {len(step.packs)} packs")
            for m, pack in enumerate(step.packs):
                shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in sorted(pack.tensors.items()))
                print(f"  pack {m}: {shapes}")


if __name__ == "__main__":
    main()
