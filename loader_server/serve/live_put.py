"""PutSamples: a producer's samples into a live job. Each is checked on its own (`packfeed.server.live.samples`):
one bad sample is refused with its field and reason while the others of the request are kept. The answer
comes once every accepted sample is durable in the job's spool."""

from __future__ import annotations

import asyncio

from packfeed.server.live.put_request import PutRequest
from packfeed.server.live.samples import Refused, checked_sample
from packfeed.server.live.spool import SpoolConflict, SpoolError, SpoolFull
from packfeed.server.live.steps import LiveClosed, StepNotRecorded
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.observe import Metrics, log
from packfeed.v1 import packfeed_pb2 as pb

MAX_PUT_SAMPLES = 4096  # samples in one request (its bytes are bounded by the server's max_message_mb)
# What a put that fails answers, by why (the first that matches: SpoolFull and the others are SpoolErrors). A
# StepNotRecorded put kept its samples and says so itself; SpoolConflict: another server wrote the spool after this
# one read it, which reads it again before it serves the job on (or gives it up, if it lost the job's lease)
REFUSALS = ((LiveClosed, "FAILED_PRECONDITION", ""), (SpoolFull, "RESOURCE_EXHAUSTED", ""),
            (StepNotRecorded, "UNAVAILABLE", ""),
            (SpoolConflict, "UNAVAILABLE", "; nothing of this put was kept: retry (this server reads the job's "
                                           "spool again first)"),
            (SpoolError, "UNAVAILABLE", "; nothing of this put was kept: retry"), (ValueError, "INVALID_ARGUMENT", ""))


async def put_samples(job: Job, request: PutRequest, metrics: Metrics,
                      decode_budget: int = 0) -> pb.PutSamplesResponse:
    """`decode_budget`: what a worker may take to decode one image (`MemoryBudget.working_limit`)."""
    live = live_of(job, request.producer_token)
    if len(request.samples) > MAX_PUT_SAMPLES:
        raise JobError("INVALID_ARGUMENT", f"{len(request.samples)} samples in one put: at most {MAX_PUT_SAMPLES}")
    try:
        live.check_room(len(request.samples), request.ByteSize())
    except (SpoolFull, ValueError) as error:
        raise refusal(job, error) from None
    rules = job.dataset.rules(job.spec.plan_config, decode_budget)
    before = live.status()
    checked = await asyncio.to_thread(check_all, request.samples, rules)  # images are decoded: off the event loop
    try:
        outcomes = await asyncio.to_thread(live.put, checked, request.end, request.producer[:256], rules)
    except (LiveClosed, SpoolError, ValueError) as error:
        log.warning("a put into a live job failed", extra={"job": job.spec.job, "error": str(error),
                                                         "samples": len(request.samples)})
        raise refusal(job, error) from None
    job.touch()
    status = live.status()
    metrics.live_observe(job.spec.job, status, before)
    response = pb.PutSamplesResponse()
    for message, (outcome, reason) in zip(request.samples, outcomes):
        field, _, why = reason.partition(": ") if outcome == "refused" else ("", "", "")
        response.results.add(id=message.id[:256], accepted=outcome != "refused", duplicate=outcome == "duplicate",
                             field=field, reason=why)
    response.pending, response.steps_formed, response.ended = status["pending"], status["steps_formed"], \
        status["ended"]
    response.policy_version = live.versions.current
    return response


def live_of(job: Job, producer_token: str):
    """The job's live steps, for a producer bringing `producer_token` (JobError: not live, or the wrong token)."""
    live = job.live
    if live is None:
        raise JobError("FAILED_PRECONDITION", f"job {job.spec.job!r} is not live (its plan has live false): its "
                                              "samples come from its dataset; open a job with live=True")
    if not live.check_producer(producer_token):
        raise JobError("PERMISSION_DENIED", f"job {job.spec.job!r} takes puts and its end only with its producer "
                                            "token (the one it was opened with: Producer(producer_token=...), "
                                            "`packfeed put --producer-token`, or PACKFEED_PRODUCER_TOKEN)")
    return live


def check_all(messages, rules) -> list:
    """Each sample checked on its own: a LiveSample, or its Refused."""
    checked = []
    for message in messages:
        try:
            checked.append(checked_sample(message, rules))
        except Refused as refused:
            checked.append(refused)
    return checked


def refusal(job: Job, error: Exception) -> JobError:
    """The gRPC answer to a put refused whole (`REFUSALS`)."""
    code, suffix = next((code, suffix) for kind, code, suffix in REFUSALS if isinstance(error, kind))
    return JobError(code, f"job {job.spec.job!r}: {error}{suffix}")
