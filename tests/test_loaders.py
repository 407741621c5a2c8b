"""`packfeed.client.stream.loaders`: the torchtitan-style `StatefulPackLoader` checkpointed with torch.distributed.checkpoint
at DP 2 under torchrun (its ranks forked preloaded: a restart in new processes reads exactly the next steps; not
loading the state is the control), and the `IterableDataset` face under a `DataLoader` (the same steps and the same
loss as `PackStream`'s plain loop; workers and batching refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from forked_torchrun import torchrun as forked_torchrun

WORKER = Path(__file__).resolve().parent / "loader_worker.py"


def torchrun(target: str, job: str, steps: int, checkpoint: Path, mode: str, out: Path) -> list[list[list[str]]]:
    """`torchrun --nproc-per-node 2 loader_worker.py ...`, its ranks forked preloaded (`forked_torchrun`)."""
    forked_torchrun(WORKER, [target, job, steps, checkpoint, mode, out], out)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_a_dcp_checkpoint_of_the_loader_restarts_at_exactly_the_next_step(tmp_path, small_tile_index):
    from packfeed.client import LocalServer

    with LocalServer(small_tile_index, workers=1) as server:
        straight = torchrun(server.target, "straight", 4, tmp_path / "unused", "fresh", tmp_path / "straight")
        first = torchrun(server.target, "stopped", 2, tmp_path / "checkpoint", "save", tmp_path / "first")
        resumed = torchrun(server.target, "stopped", 2, tmp_path / "checkpoint", "load", tmp_path / "resumed")
        control = torchrun(server.target, "stopped", 2, tmp_path / "checkpoint", "fresh", tmp_path / "control")
    for rank in range(2):
        assert first[rank] + resumed[rank] == straight[rank]
        assert control[rank] == straight[rank][:2] != resumed[rank]  # the state not loaded: it starts over
    assert straight[0] != straight[1]  # each rank its own packs


def test_the_loader_state_names_its_rank_and_refuses_another_dp(small_tile_index):
    from packfeed.client import LocalServer, PackfeedError, PackStream
    from packfeed.client.stream.loaders import StatefulPackLoader

    with LocalServer(small_tile_index, workers=1) as server:
        with PackStream(server.target, job="state", rank=1, dp=2, microbatches=2) as stream:
            loader = StatefulPackLoader(stream)
            next(iter(loader))
            state = loader.state_dict()
            assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
            loader.load_state_dict({})  # a first run's empty state changes nothing
            with pytest.raises(PackfeedError, match="elastic resume"):
                loader.load_state_dict({**state, "world_size": 4})
            with pytest.raises(PackfeedError, match="dp_rank_1"):
                loader.load_state_dict({"dp_rank_0": state["dp_rank_1"], "world_size": 2})


def test_a_dataloader_over_the_dataset_face_gives_the_plain_loops_steps_and_loss(small_tile_index):
    from packfeed.client import LocalServer, PackfeedError, PackStream
    from packfeed.client.stream.loaders import PackIterableDataset, pack_dataloader
    from packfeed.trainer.models import ReferenceModel
    from packfeed.trainer.models.reference import VLMConfig, run_layers
    from packfeed.trainer.models.reference_inputs import microbatches_of
    from trainer_workers import SMALL_MODEL

    model = ReferenceModel(VLMConfig(**SMALL_MODEL))

    def losses(steps) -> list[float]:
        out = []
        for step in steps:
            batch = microbatches_of(step, model.config)
            chunks = [a.tensor_split(len(step.packs)) for a in batch.args]
            with torch.no_grad():
                out.append(sum(float(run_layers(model.layers, tuple(c[m] for c in chunks))[0].sum())
                               for m in range(len(step.packs))) / batch.shape.step_loss_tokens)
        return out

    options = dict(rank=0, dp=2, microbatches=2, seed=0)
    with LocalServer(small_tile_index, workers=1) as server:
        with PackStream(server.target, job="plain", **options) as stream:
            plain = list(stream)
        with PackStream(server.target, job="loader", **options) as stream:
            loaded = list(pack_dataloader(stream))
        with PackStream(server.target, job="workers", **options) as stream:
            with pytest.raises(PackfeedError, match="num_workers=0"):
                next(iter(torch.utils.data.DataLoader(PackIterableDataset(stream), batch_size=None, num_workers=1)))
    assert [s.sample_keys for s in loaded] == [s.sample_keys for s in plain] and plain
    assert losses(loaded) == pytest.approx(losses(plain), rel=1e-5)


def test_the_stateful_loader_example_resumes_at_the_next_step(tmp_path, small_tile_index):
    """examples/stateful_loader.py as a user runs it (one process): a DCP checkpoint after 2 steps, then a run
    with --resume reads steps 2 and 3."""
    from packfeed.client import LocalServer

    script = Path(__file__).resolve().parents[1] / "examples" / "stateful_loader.py"

    def run(*flags: str) -> list[str]:
        done = subprocess.run([sys.executable, str(script), server.target, str(tmp_path / "dcp"), *flags],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return [line.split(",")[0] for line in done.stdout.splitlines()]

    with LocalServer(small_tile_index, workers=1) as server:
        first, resumed = run("--steps", "2"), run("--steps", "2", "--resume")
    assert first == ["rank 0: epoch 0 step 0", "rank 0: epoch 0 step 1"]
    assert resumed == ["rank 0: epoch 0 step 2", "rank 0: epoch 0 step 3"]
