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

import errno
import io
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


class DiskFull(RuntimeError):
    """A checkpoint that did not fit on its disk: the last complete one is kept."""


def _no_space(error: BaseException) -> bool:
    """ENOSPC anywhere in the error's chain, or in what torch.distributed.checkpoint collected from the ranks."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        pending += [current.__cause__, current.__context__]
        for failure in (getattr(current, "failures", None) or {}).values():  # CheckpointException: rank -> error
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return "No space left on device" in str(error)


def save_sharded(root: Path, steps_done: int, mesh, model: torch.nn.Module, optimizer, scheduler,
                 stream_state: dict | None, meta: dict, keep: int = 2) -> Path:
    """Collective, for FSDP2-sharded models: every rank writes its shards of the model and optimizer with
    `torch.distributed.checkpoint` (step-N/sharded/), its stream position, and rank 0 the LR schedule; complete
    once `latest` names it, as `save`. A full disk raises `DiskFull`, saying so, and the incomplete directory
    is removed (the last complete checkpoint stays, and resumes the run exactly)."""
    directory = root / f"step-{steps_done:06d}"
    try:
        return _save_sharded(root, directory, steps_done, mesh, model, optimizer, scheduler, stream_state, meta,
                             keep)
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if not _no_space(error):
            raise
        if mesh.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        last = latest(root)
        free = shutil.disk_usage(root).free >> 20
        raise DiskFull(f"the checkpoint of step {steps_done} does not fit in {root}: the disk is full ({free} MiB "
                       f"free). The last complete checkpoint, {last.name if last else 'none yet'}, is kept and "
                       "resumes the run exactly: free space (or give out= a larger disk) and run the same command "
                       "again") from error


def _save_sharded(root: Path, directory: Path, steps_done: int, mesh, model: torch.nn.Module, optimizer, scheduler,
                  stream_state: dict | None, meta: dict, keep: int) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if mesh.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "sharded"))
    if stream_state is not None and mesh.lane == 0:  # the CP ranks of a replica stand at one step
        name = f"stream-encoder{mesh.encoder_rank}" if mesh.is_encoder else f"stream-rank{mesh.replica}"
        (directory / f"{name}.json").write_text(json.dumps(stream_state))
    if mesh.rank == 0:
        write_torch(scheduler.state_dict(), directory / "scheduler.pt")
    dist.barrier()
    if mesh.rank == 0:
        _publish(root, directory, {"steps_done": steps_done, **meta}, keep)
    dist.barrier()
    return directory


def write_torch(value, path: Path) -> None:
    """torch.save through memory: a full disk then raises OSError(ENOSPC), which `save_sharded` reports as
    `DiskFull`; torch.save to a file reports it as "unexpected pos 704 vs 598", naming no cause."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    path.write_bytes(buffer.getbuffer())


def load_sharded(directory: Path, model: torch.nn.Module, optimizer, scheduler) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_flat())
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / "sharded"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_flat())
    scheduler.load_state_dict(torch.load(directory / "scheduler.pt", weights_only=False))
