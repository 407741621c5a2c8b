"""What clients ask, checked before anything acts on it: a job's resume, a replica's lease, the samples an
acknowledgement reports as skipped, and the request bytes themselves (a malformed message is INVALID_ARGUMENT,
never gRPC's UNKNOWN with a Python exception in it)."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from packfeed.server.serve.job_spec import JobError, Resume
from packfeed.server.serve.registry import check_name
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.layout import MAX_REPLICAS, Layout, Seat
from packfeed.v1.options import MAX_RESUME_CHAIN, PlanConfig
from packfeed.v1.wire_format import WireFormatError


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


def seat_of(request: pb.StreamPacksRequest | pb.AckStepRequest, job: str, layout: Layout,
            replicas: int = 0) -> Seat:
    """The consumer's seat: the request's `seat`, or v1's separate fields (rank, replica, cp_rank, encoder), the
    same thing; checked against the job's layout (and `replicas`, the stream's replicated consumers, where it
    says them). A rank past the job's is OUT_OF_RANGE, any other problem INVALID_ARGUMENT."""
    flat = Seat(request.rank, request.replica, request.cp_rank, request.encoder)
    seat = flat
    if request.HasField("seat"):
        given = request.seat
        seat = Seat(given.rank, given.replica, given.lane, given.encoder)
        if flat not in (Seat(0), seat):
            raise JobError("INVALID_ARGUMENT", f"the request's seat ({seat.name}) and its separate fields "
                                               f"({flat.name}) differ: send the seat, or the same place in both")
    if replicas and not seat.replica < replicas <= MAX_REPLICAS:
        raise JobError("INVALID_ARGUMENT", f"replica {seat.replica} of {replicas}: give 0 <= replica < replicas <= "
                                           f"{MAX_REPLICAS}")
    if problems := seat.problems(layout):
        past = not seat.within(layout) and (layout.encoder_ranks or not seat.encoder)
        raise JobError("OUT_OF_RANGE" if past else "INVALID_ARGUMENT", f"job {job!r}: " + "; ".join(problems))
    return seat


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
    except (DecodeError, WireFormatError):
        raise JobError("INVALID_ARGUMENT", f"not a well-formed {message_type.DESCRIPTOR.full_name} (bad bytes or "
                                           "invalid UTF-8 in a string field)") from None
