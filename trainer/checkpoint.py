"""Checkpoints that resume training at exactly the next step.

Layout under OUT/checkpoints/:

    step-000120/sharded/            weights and AdamW state, written by every rank with
                                    `torch.distributed.checkpoint`: each pipeline stage its layers (named by
                                    their index in the model, so the keys do not depend on the partition), each
                                    FSDP rank its shards; replicated tensors once
    step-000120/scheduler.pt        the LR schedule (the same on every rank)
    step-000120/stream-rank0.json   each replica's stream position (PackStream.state_dict of its first stage)
    step-000120/stream-encoder0.json  each encoder rank's (parallel.encoder=disaggregated)
    step-000120/meta.json           steps done, partition, recompute plan
    latest                          name of the newest complete checkpoint (written last, after a barrier)

A checkpoint directory is complete once `latest` names it, so a crash while saving leaves the previous one in
use. Packfeed's plans are deterministic, so the stream position is all the data state there is; a checkpoint
restarted at another DP hands every saved position to an elastic resume (packfeed.trainer.data.open_stream).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # every optimizer entry under its parameter's name: pipeline ranks hold different parameters, and an
    # unflattened `param_groups` list would be one object that the last rank's copy overwrites
    return StateDictOptions(flatten_optimizer_state_dict=True)


def latest(root: Path) -> Path | None:
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    directory = root / pointer.read_text().strip()
    return directory if (directory / "meta.json").is_file() else None


def _publish(root: Path, directory: Path, meta: dict, keep: int) -> None:
    """Mark `directory` complete (meta.json, then `latest`), and drop all but the newest `keep`."""
    (directory / "meta.json").write_text(json.dumps(meta))
    (root / "latest.tmp").write_text(directory.name)
    (root / "latest.tmp").replace(root / "latest")
    complete = sorted(p for p in root.glob("step-*") if (p / "meta.json").is_file())
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


def stream_states(directory: Path) -> list[dict]:
    """Every replica's stream position in the checkpoint, in rank order (as many as the DP it was taken at)."""
    paths = sorted(directory.glob("stream-rank*.json"), key=lambda p: int(p.stem.removeprefix("stream-rank")))
    return [json.loads(path.read_text()) for path in paths]


def encoder_stream_state(directory: Path, encoder_rank: int) -> dict | None:
    """Encoder rank `encoder_rank`'s stream position in the checkpoint (None: it had no such rank)."""
    path = directory / f"stream-encoder{encoder_rank}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def save_sharded(root: Path, steps_done: int, mesh, model: torch.nn.Module, optimizer, scheduler,
                 stream_state: dict | None, meta: dict, keep: int = 2) -> Path:
    """Collective, for FSDP2-sharded models: every rank writes its shards of the model and optimizer with
    `torch.distributed.checkpoint` (step-N/sharded/), its stream position, and rank 0 the LR schedule; complete
    once `latest` names it, as `save`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = root / f"step-{steps_done:06d}"
    if mesh.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "sharded"))
    if stream_state is not None and mesh.cp_rank == 0:  # the CP ranks of a replica stand at one step
        name = f"stream-encoder{mesh.encoder_rank}" if mesh.is_encoder else f"stream-rank{mesh.replica}"
        (directory / f"{name}.json").write_text(json.dumps(stream_state))
    if mesh.rank == 0:
        torch.save(scheduler.state_dict(), directory / "scheduler.pt")
    dist.barrier()
    if mesh.rank == 0:
        _publish(root, directory, {"steps_done": steps_done, **meta}, keep)
    dist.barrier()
    return directory


def load_sharded(directory: Path, model: torch.nn.Module, optimizer, scheduler) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / "sharded"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_flat())
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
