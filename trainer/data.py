"""The data side of the trainer: this replica's `PackStream`, the dataset's conventions the server reports (the
model is sized from them), and `StepSource`, which makes each step ready for the runner (a pipeline's
fixed-shape microbatches, padded by the model) and can buffer steps for trials without losing them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from packfeed.trainer.config import TrainConfig
from packfeed.trainer.parallel.mesh import Mesh, broadcast_object
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import Seat

if TYPE_CHECKING:
    from packfeed.client.stream.tensors import Step

Work = TypeVar("Work")  # what a runner trains on: the client's Step, or a pipeline's padded Microbatches


def job_conventions(stream, mesh: Mesh) -> pb.ModelConventions:
    """The conventions rank 0's stream reported, on every rank (stages without a stream need them too)."""
    raw = broadcast_object(stream.conventions.SerializeToString() if mesh.rank == 0 else None, mesh)
    return pb.ModelConventions.FromString(raw)


def unchanged(step: Step) -> Step:
    return step


@dataclass
class StepSource(Generic[Work]):
    """This rank's steps, each made ready for its runner by `prepare` (a pipeline's padded microbatches, or the
    client's step unchanged for a whole model); `peek(n)` buffers steps for trials without losing them."""

    steps: Iterator[Step]
    prepare: Callable[[Step], Work] = unchanged
    buffer: list[tuple[Step, Work]] = field(default_factory=list)  # (the client's step, prepared)
    data_wait_s: float = 0.0

    def _pull(self) -> tuple[Step, Work] | None:
        started = time.perf_counter()
        step = next(self.steps, None)
        self.data_wait_s += time.perf_counter() - started
        return None if step is None else (step, self.prepare(step))

    def peek(self, n: int) -> list[Work]:
        while len(self.buffer) < n:
            item = self._pull()
            if item is None:
                break
            self.buffer.append(item)
        return [prepared for _, prepared in self.buffer[:n]]

    def next(self) -> Work | None:
        item = self.buffer.pop(0) if self.buffer else self._pull()
        return None if item is None else item[1]

    def state_dict(self) -> dict:
        """The stream position of the next step to train on (buffered steps are not trained yet)."""
        state = self.steps.state_dict()
        if self.buffer:
            state["next"] = [self.buffer[0][0].epoch, self.buffer[0][0].step]
        return state


def open_stream(config: TrainConfig, mesh: Mesh, target: str, checkpoint_dir=None):
    """This replica's stream (first stages only): the job's plan on this mesh, from `target`. With a checkpoint:
    taken at this DP, the stream continues its job at this rank's position; taken at another DP, it opens a job
    of its own that re-plans what the checkpointed job left of its epoch for this DP (elastic resume)."""
    from packfeed.client import Connection, PackStream
    from packfeed.trainer import checkpoint

    d = config.data
    routed = config.parallel.encoder == "phases"  # isf+phases packs with their images routed
    plan = d.plan_config(mesh.dp, mesh.pp, routed, config.parallel.cp, mesh.encoder_ranks)
    options = dict(plan=plan, seed=d.seed, epochs=d.epochs, prefetch=d.prefetch, dataset=d.dataset,
                   pin_memory=mesh.device.type == "cuda", connection=Connection(token=d.token or None))
    # this GPU's share of a CP plan's packs; a CP plan on one GPU per replica reads all its C shares and joins them
    # (an encoder rank's seat streams what it encodes for the LLM ranks: parallel.encoder=disaggregated)
    seats = [mesh.seat] if plan.context_parallel == mesh.cp else \
        [Seat(mesh.replica, lane=lane) for lane in range(plan.context_parallel)]
    states = checkpoint.stream_states(checkpoint_dir) if checkpoint_dir is not None else []
    if not states:
        return _reporting_not_needed(_lane_streams(target, d.job, seats, options))
    saved_encoders = checkpoint.read_meta(checkpoint_dir).get("encoder_ranks", 0)
    if len(states) == mesh.dp and saved_encoders == mesh.encoder_ranks:
        stream = _reporting_not_needed(_lane_streams(target, states[0]["job"], seats, options))
        stream.load_state_dict(checkpoint.encoder_stream_state(checkpoint_dir, mesh.encoder_rank)
                               if mesh.is_encoder else states[mesh.replica])
        return stream
    if plan.context_parallel > 1:
        raise ValueError(f"the checkpoint was taken at DP {len(states)}, this run is DP {mesh.dp}: context-parallel "
                         "jobs resume at the DP they ran at")
    steps = checkpoint.read_meta(checkpoint_dir)["steps_done"]
    # every rank derives the same id (encoder ranks included: they open the same re-planned job)
    job = f"{states[0]['job']}.dp{mesh.dp}" + (f".e{mesh.encoder_ranks}" if mesh.encoder_ranks else "") + \
        f".from{steps}"
    return PackStream(stream_targets(target), job=job, resume=states, seat=mesh.seat, **options)


def _reporting_not_needed(stream):
    """`stream` (one lane's, or lanes joined), unless its job's mixture moves by the losses its ranks report, which
    this trainer does not."""
    rule = stream.info.mixture.rule
    if rule:
        stream.close()
        raise ValueError(f"job {stream.job!r}: its mixture's weights follow the losses its ranks report (rule "
                         f"{rule}), and packfeed train does not report per-dataset losses: train "
                         "it with PackfeedTrainer, PackfeedSFTTrainer or a loop that calls PackStream.report "
                         "(docs/planning.md \"Weights the loss moves\"), or give the mixture a schedule without a rule")
    return stream


def _lane_streams(target: str, job: str, seats: list[Seat], options: dict):
    """The stream of this GPU's seat, or (every lane of a replica) their streams joined into steps of whole
    packs."""
    from packfeed.client import PackStream
    from packfeed.client.model.context_parallel import JoinedStream

    streams = [PackStream(stream_targets(target), job=job, seat=seat, **options) for seat in seats]
    return streams[0] if len(streams) == 1 else JoinedStream(streams)


def stream_targets(target: str) -> str | list[str]:
    """`host:port`, a comma-separated list (failover in that order), or `redis://...`: every live server."""
    if target.startswith(("redis://", "rediss://")):
        from packfeed.client.stream.discovery import servers_from_redis

        servers = servers_from_redis(target)
        if not servers:
            raise ValueError(f"no live Packfeed server is listed in {target}: start `packfeed serve` with "
                             "PACKFEED_REDIS_URL set to it, or give data.target=host:port")
        return servers
    return target.split(",") if "," in target else target
