"""`PackStream` in the shapes other training loops expect.

- `StatefulPackLoader`: a dataloader with the `Stateful` protocol (`state_dict` / `load_state_dict`) as
  torchtitan's loops and `torch.distributed.checkpoint` (DCP) use it. Its state is this DP rank's stream
  position under `dp_rank_<rank>`, beside the DP world size, so the ranks' states merge into one checkpoint
  without colliding and each rank loads back its own (torchdata's `StatefulDataLoader` convention, as
  torchtitan's `ParallelAwareDataloader` keys it). Each item is one step: a `Step` of M packs.
- `PackIterableDataset`: a `torch.utils.data.IterableDataset` for code that insists on a `DataLoader`. Use it
  as `DataLoader(dataset, batch_size=None, num_workers=0)`: a step is already a batch (M packs, never collated
  or padded again), and the stream already receives in a background thread. What it costs: the DataLoader's
  per-item bookkeeping, microseconds a step; `num_workers > 0` is refused (each worker process would open the
  rank's stream again and deliver its steps twice); give `batch_size=None` (`pack_dataloader` does): a step is
  already a batch, and torch's collation would try to batch steps again.
  `DataLoader(pin_memory=True)` does not pin `Step`s: give `PackStream(pin_memory=True)` instead.

Neither re-shards anything: the server already sends each DP rank exactly its packs, so a framework's own
sampler or shuffling must stay off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from packfeed.client.stream.channel import PackfeedError
from packfeed.client.stream.resume import ForwardsStreamState
from packfeed.client.stream.pack_stream import PackStream
from packfeed.client.stream.tensors import Step


def job_steps(stream: PackStream) -> int:
    """The job's optimizer steps over all its epochs (each epoch's own count), or 0 while a windowed plan has
    not planned its last window."""
    try:
        return len(stream)
    except TypeError:
        return 0


def job_progress(stream: PackStream, step) -> tuple[int, float]:
    """Where `step` stands in its job: its number k from 1 over all epochs, and the job's epoch with the
    fraction of it done once the step is trained (how the framework faces log progress)."""
    in_epoch = int(stream.info.epoch_steps[step.epoch]) if step.epoch < len(stream.info.epoch_steps) else 0
    return stream.step_number(step.epoch, step.step) + 1, step.epoch + (step.step + 1) / max(1, in_epoch)


def job_batches(stream: PackStream) -> int:
    """The job's packs for one rank (steps x M): the length of a loader that hands out a pack per batch. A
    TypeError while the step count is unknown, which is how frameworks learn an iterable has no length."""
    steps = job_steps(stream)
    if not steps:
        raise TypeError("the job's step count is not known yet (a windowed plan)")
    return steps * stream.info.plan.microbatches


class StatefulPackLoader:
    """Iterate this DP rank's steps; save and restore its position with any Stateful-aware checkpointer."""

    def __init__(self, stream: PackStream):
        self.stream = stream
        self.dp = stream.info.plan.dp
        self.key = f"dp_rank_{stream.rank}"

    def __iter__(self) -> Iterator[Step]:
        return iter(self.stream)

    def state_dict(self) -> dict[str, Any]:
        """{"dp_rank_<rank>": the stream's position, "world_size": DP}: only this rank's entry, so the ranks'
        entries merge into one checkpoint."""
        return {self.key: self.stream.state_dict(), "world_size": self.dp}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at exactly the step after the last one delivered when `state` was saved. An empty state
        (a checkpointer's first load) leaves the stream where it is."""
        if not state:
            return
        if state.get("world_size") != self.dp:
            raise PackfeedError(f"this loader state was saved at DP {state.get('world_size')}, the job runs at DP "
                                f"{self.dp}: to continue at another DP, open the stream with PackStream(resume=<every "
                                "old rank's state>) (elastic resume) instead of loading it")
        if self.key not in state:
            raise PackfeedError(f"the loader state holds {sorted(k for k in state if k != 'world_size')}, not "
                                f"{self.key}: load each rank's own entry (a checkpointer that merges ranks does)")
        self.stream.load_state_dict(state[self.key])


class PackIterableDataset(ForwardsStreamState, IterableDataset):
    """A rank's stream as an IterableDataset: `DataLoader(dataset, batch_size=None, num_workers=0)`."""

    def __init__(self, stream: PackStream):
        super().__init__()
        self.stream = stream

    def __iter__(self) -> Iterator[Step]:
        if get_worker_info() is not None:
            raise PackfeedError("PackIterableDataset runs in the trainer's process: give the DataLoader "
                                "num_workers=0 (each worker would open this rank's stream again and deliver its "
                                "steps twice; the stream already receives in a background thread)")
        return iter(self.stream)

    def __getstate__(self) -> dict:
        raise PackfeedError("PackIterableDataset cannot be pickled into DataLoader workers: use num_workers=0")


def pack_dataloader(stream: PackStream) -> torch.utils.data.DataLoader:
    """The DataLoader a loop that insists on one should use: the stream's steps, unbatched, in this process."""
    return torch.utils.data.DataLoader(PackIterableDataset(stream), batch_size=None, num_workers=0)
