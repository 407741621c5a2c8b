"""What clients ask, checked before anything acts on it: a job's resume, a replica's lease, the samples an
acknowledgement reports as skipped, and the request bytes themselves (a malformed message is INVALID_ARGUMENT,
never gRPC's UNKNOWN with a Python exception in it)."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from packfeed.server.serve.job_spec import JobError, Resume
from packfeed.server.serve.registry import check_name
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import MAX_RESUME_CHAIN, PlanConfig

MAX_REPLICAS = 1024  # consumers of one DP rank (a TP x CP x SP group beyond this is not a real deployment)


def resume_of(request: pb.OpenJobRequest) -> Resume:
    """The job's elastic resume, checked: an old plan that parses, an epoch of this job, the old job's seed and
    plan fingerprint given (the plan itself is checked against it when the job is planned)."""
    if request.resume.seed != request.seed:
        raise JobError("FAILED_PRECONDITION", f"resume: the old job ran with seed {request.resume.seed}, this job "
                                              f"asks for {request.seed}; give it the old job's seed")
    if request.resume.epoch >= (request.epochs or 1):
        raise ValueError(f"resume.epoch {request.resume.epoch} is not an epoch of this job ({request.epochs or 1})")
    return _resume(request.resume, depth=0)


def _resume(message: pb.ResumeFrom, depth: int) -> Resume:
    if depth >= MAX_RESUME_CHAIN:
        raise ValueError(f"resume: a chain of more than {MAX_RESUME_CHAIN} resumed jobs; start a new job")
    if not message.plan_fingerprint:
        raise ValueError("resume.plan_fingerprint is required: the old job's JobInfo.plan_fingerprint, which its "
                         "ranks' state_dicts hold (states saved before Packfeed recorded it cannot resume elastically)")
    previous = _resume(message.previous, depth + 1) if message.HasField("previous") else None
    return Resume(PlanConfig.from_proto(message.plan), message.epoch, message.step, message.plan_fingerprint,
                  message.seed, message.index_fingerprint, previous)


def replica_lease(rank: int, replica: int, replicas: int, dp: int, encoder_ranks: int = 0,
                  encoder: bool = False) -> int:
    """The lease a replica holds: the rank's own for replica 0, one apart for each other (numbered past every
    rank, so no two replicas or ranks share one); an encoder rank's are numbered past every LLM rank's."""
    if replicas > MAX_REPLICAS or replica >= replicas:
        raise JobError("INVALID_ARGUMENT", f"replica {replica} of {replicas}: give 0 <= replica < replicas <= "
                                           f"{MAX_REPLICAS}")
    if encoder:
        return dp * MAX_REPLICAS + rank + replica * encoder_ranks
    return rank + replica * dp


MAX_CLIENT_SKIPPED = 4096  # samples one acknowledgement may report as left out by the client
MAX_REASON = 1024  # characters of a client's reason kept


def client_skipped(request: pb.AckStepRequest) -> list[tuple[str, str]]:
    """The samples an acknowledgement reports as left out by the client, checked before anything is recorded."""
    if len(request.skipped) > MAX_CLIENT_SKIPPED:
        raise JobError("INVALID_ARGUMENT", f"an acknowledgement may report at most {MAX_CLIENT_SKIPPED} skipped samples")
    for entry in request.skipped:
        check_name(entry.key, "a skipped sample's key")
        if (entry.epoch, entry.step) != (request.epoch, request.step):
            raise JobError("INVALID_ARGUMENT", "skipped samples are reported with the acknowledgement of their own step")
    return [(entry.key, "".join(c if c.isprintable() else " " for c in entry.reason[:MAX_REASON]) or "no reason given")
            for entry in request.skipped]


def parse(message_type, raw: bytes):
    try:
        return message_type.FromString(raw)
    except DecodeError:
        raise JobError("INVALID_ARGUMENT", f"not a well-formed {message_type.DESCRIPTOR.full_name} (bad bytes or "
                                           "invalid UTF-8 in a string field)") from None
