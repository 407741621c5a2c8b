"""What a live job's producers call besides PutSamples (docs/live.md "Asynchronous RL"): `Heartbeat` (alive, or
leaving), `Reserve` (staleness wait: the right to generate, before generating) and `ClaimRollout` (an unfinished
rollout to continue). Each is checked as a put is (a live job, its producer token) and answered from the job's
`LiveSteps`; nothing here waits: a producer that is not granted asks again after `retry_s`."""

from __future__ import annotations

import asyncio
import math
import time

from packfeed.server.live.admission import RETRY_S
from packfeed.server.live.spool import TOKEN_VERSIONS
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.live_put import live_of
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import MAX_NAME


EMPTY_PART = pb.PackPart().SerializeToString()  # no data, not last: a client's assembler adds nothing
LIVE_CHECK_S = 1.0  # a live stream waiting for its next step looks this often whether its job's state changed
LIVE_STATE_S = 10.0  # ... and sends it at least this often


class LiveWait:
    """What a stream waiting for its next step sends: for a live job its state (`PackPart.waiting`) when it changed
    and every LIVE_STATE_S, at once when its producers are gone (`gone`: then the stream fails); an empty piece
    otherwise."""

    def __init__(self, job: Job):
        self.job, self.gone = job, ""  # the job, not its LiveSteps: this looks at the job's state, never a sample
        self._shown: tuple | None = None
        self._sent = time.monotonic()

    def part(self) -> bytes | None:
        live = self.job.live
        if live is None:
            return EMPTY_PART
        status, waiting = live.status(), live.waiting_for()
        self.gone = live.producers_gone()
        shown = (status.get("producers_alive"), waiting, self.gone)
        if shown == self._shown and time.monotonic() - self._sent < LIVE_STATE_S:
            return None
        self._shown, self._sent = shown, time.monotonic()
        return pb.PackPart(waiting=live_status(self.job, status, waiting, self.gone)).SerializeToString()


def live_status(job: Job, status: dict | None = None, waiting: str | None = None,
                gone: str | None = None) -> pb.LiveStatus:
    """A live job's `LiveSteps` as the wire's LiveStatus: its `status()`, `waiting_for()` and `producers_gone()`,
    each asked unless the caller holds it already."""
    live = job.live
    status = live.status() if status is None else status
    message = pb.LiveStatus(**{name: value for name, value in status.items() if name != "producers"})
    message.producers.extend(pb.ProducerInfo(**seen) for seen in status.get("producers", ()))
    message.waiting_for = live.waiting_for() if waiting is None else waiting
    message.producers_gone = live.producers_gone() if gone is None else gone
    return message


def producer_id(value: str) -> str:
    if not value or len(value) > MAX_NAME or not value.isprintable():
        raise JobError("INVALID_ARGUMENT", f"give the producer an id of 1 to {MAX_NAME} printable characters "
                                           "(Producer chooses one per process)")
    return value


async def heartbeat(job: Job, request: pb.ProducerHeartbeat) -> pb.ProducerState:
    live = live_of(job, request.producer_token)
    if not math.isfinite(request.lease_s) or request.lease_s < 0:
        raise JobError("INVALID_ARGUMENT", f"lease_s is {request.lease_s}: give seconds >= 0 (0: 15 s)")
    # in a thread, as every call that takes the job's lock: a put holds it while its batch is made durable
    state = await asyncio.to_thread(live.heartbeat, producer_id(request.producer), request.name, request.lease_s,
                                    request.leaving)
    return pb.ProducerState(**state)


async def reserve(job: Job, request: pb.ReserveRequest) -> pb.ReserveResponse:
    live = live_of(job, request.producer_token)
    if not request.group or len(request.group) > MAX_NAME or not request.group.isprintable():
        raise JobError("INVALID_ARGUMENT", f"a reservation names its group (1 to {MAX_NAME} printable characters): "
                                           "the samples it reserves are put with that group")
    version = request.policy_version if request.HasField("policy_version") else None
    granted, checked, why = await asyncio.to_thread(live.reserve, producer_id(request.producer), request.group,
                                                    request.samples, version)
    return pb.ReserveResponse(granted=granted, policy_version=checked, policy_version_now=live.versions.current,
                              retry_s=0.0 if granted else RETRY_S, reason=why)


async def claim_rollout(job: Job, request: pb.ClaimRolloutRequest) -> pb.ClaimRolloutResponse:
    live = live_of(job, request.producer_token)
    version = request.policy_version if request.HasField("policy_version") else None
    try:
        row, arrays, why = await asyncio.to_thread(live.claim_rollout, producer_id(request.producer), version)
    except (OSError, ValueError) as error:
        raise JobError("UNAVAILABLE", f"job {job.spec.job!r}: an unfinished rollout could not be read from the "
                                      f"spool ({error}): retry") from None
    response = pb.ClaimRolloutResponse(policy_version_now=live.versions.current)
    if row is None:
        response.retry_s, response.reason = RETRY_S, why
        return response
    response.claimed = True
    rollout = response.rollout
    rollout.id, rollout.group, rollout.prompt, rollout.part = row.id, row.group, row.prompt, row.part
    rollout.policy_version, rollout.unfinished = row.policy_version, True
    rollout.images.extend(arrays["images"])
    rollout.values.update(row.values)
    for name, target in (("tokens", rollout.tokens), ("loss_mask", rollout.loss_mask),
                         (TOKEN_VERSIONS, rollout.token_versions)):
        _tensor(target, arrays[name])
    for name in row.tensors:
        _tensor(rollout.tensors[name], arrays[name])
    return response


def _tensor(target: pb.Tensor, values) -> None:
    target.dtype, target.data = values.dtype.name, values.tobytes()
    target.shape[:] = [len(values)]
