"""Shared job state for one or many loader servers: embedded (in this process) or in Redis.

The plan is deterministic, so servers share very little: which jobs exist and with which fingerprints,
which server currently feeds which rank (a lease with a TTL, renewed by heartbeats), each rank's
acknowledged step (a cursor that only moves forward), the samples skipped as bad, and which servers are
alive (so clients can find another one). Everything else — the plan, the packs — any server recomputes.

    coordinator = coordinator_from_url(os.environ.get("PACKFEED_REDIS_URL"))   # None -> embedded (`connect`)
    coordinator.register_job(job, record)           # refuses a different fingerprint for the same job id
    coordinator.reassert_job(job, record)           # what a server serving the job re-registers now and then
    coordinator.acquire_lease(job, rank, server_id, ttl_s=10)
    coordinator.ack(job, rank, epoch, step)         # monotone: a late or repeated ack never moves it back

In Redis (`packfeed.server.cluster.redis_coordinator`) the keys follow `packfeed.v1.redis_keys`, the one
description of the layout; compare-and-set steps run as Lua scripts, so two servers never race.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from packfeed.v1.redis_keys import position, unposition


class CoordinationError(RuntimeError):
    """The coordinator refused a request; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class CoordinationUnavailable(RuntimeError):
    """The coordinator cannot be reached now; callers keep serving what they have and retry."""


@dataclass(frozen=True)
class JobRecord:
    """What every server must agree on to serve a job, and when it was first registered."""

    spec: str  # JobSpec.describe(): dataset, plan config, seed, epochs
    plan_fingerprint: str
    index_fingerprint: str
    # ms since the epoch (the first registering server's clock), kept by every server that joins: when the
    # coordinator lost its data and another server registered the id anew, the older registration wins
    registered_ms: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        return cls(**json.loads(text))

    def same_job(self, other: "JobRecord") -> bool:
        """The same settings, plan and index (whenever each was registered)."""
        return replace(self, registered_ms=0) == replace(other, registered_ms=0)


class Reassertion(enum.Enum):
    """What `reassert_job` found: the job's record as it was, missing (restored), or another, younger
    registration of the id (reclaimed: replaced by the older one)."""

    HELD = "held"
    RESTORED = "restored"
    RECLAIMED = "reclaimed"


class LeaseOutcome(enum.Enum):
    """What a server's try to take or keep a rank's lease found."""

    HELD = "held"  # this server holds it
    TAKEN = "taken"  # another server holds it
    UNREACHABLE = "unreachable"  # the coordinator did not answer: a running stream goes on, no new one starts


def mismatch(job: str, existing: JobRecord, record: JobRecord) -> CoordinationError:
    return CoordinationError("FAILED_PRECONDITION",
                             f"job {job!r} is registered with plan {existing.plan_fingerprint} over index "
                             f"{existing.index_fingerprint} ({existing.spec}); this server computes plan "
                             f"{record.plan_fingerprint} over index {record.index_fingerprint} ({record.spec}). "
                             f"Serve the same index and settings on every server, or use a new job id")


class Coordinator(Protocol):
    def register_job(self, job: str, record: JobRecord) -> JobRecord: ...
    def reassert_job(self, job: str, record: JobRecord) -> tuple[Reassertion, JobRecord | None]: ...
    def job(self, job: str) -> JobRecord | None: ...
    def acquire_lease(self, job: str, lease: str, owner: str, ttl_s: float) -> bool: ...
    def release_lease(self, job: str, lease: str, owner: str) -> bool: ...
    def lease_owner(self, job: str, lease: str) -> str | None: ...
    def ack(self, job: str, rank: int, epoch: int, step: int) -> tuple[int, int]: ...
    def acked(self, job: str, rank: int) -> tuple[int, int] | None: ...
    def add_skipped(self, job: str, key: str, reason: str) -> None: ...
    def skipped(self, job: str) -> dict[str, str]: ...
    def heartbeat_server(self, address: str, ttl_s: float) -> None: ...  # clients list the live ones (discovery)


class EmbeddedCoordinator:
    """The single-server default: the same semantics, in this process's memory."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._leases: dict[tuple[str, int], tuple[str, float]] = {}
        self._acked: dict[tuple[str, int], int] = {}
        self._skipped: dict[str, dict[str, str]] = {}

    def register_job(self, job: str, record: JobRecord) -> JobRecord:
        with self._lock:
            existing = self._jobs.setdefault(job, record)
        if not existing.same_job(record):
            raise mismatch(job, existing, record)
        return existing

    def reassert_job(self, job: str, record: JobRecord) -> tuple[Reassertion, JobRecord | None]:
        with self._lock:
            outcome, stored = reassertion(self._jobs.get(job), record)
            if outcome in (Reassertion.RESTORED, Reassertion.RECLAIMED):
                self._jobs[job] = record
        if outcome is None:
            raise mismatch(job, stored, record)
        return outcome, stored

    def job(self, job: str) -> JobRecord | None:
        return self._jobs.get(job)

    def _holder(self, job: str, lease: str) -> str | None:
        owner, expiry = self._leases.get((job, str(lease)), (None, 0.0))
        return owner if owner is not None and expiry > self._clock() else None

    def acquire_lease(self, job: str, lease: str, owner: str, ttl_s: float) -> bool:
        with self._lock:
            holder = self._holder(job, lease)
            if holder not in (None, owner):
                return False
            self._leases[(job, str(lease))] = (owner, self._clock() + ttl_s)
            return True

    def release_lease(self, job: str, lease: str, owner: str) -> bool:
        with self._lock:
            if self._holder(job, lease) != owner:
                return False
            del self._leases[(job, str(lease))]
            return True

    def lease_owner(self, job: str, lease: str) -> str | None:
        with self._lock:
            return self._holder(job, lease)

    def ack(self, job: str, rank: int, epoch: int, step: int) -> tuple[int, int]:
        with self._lock:
            value = max(self._acked.get((job, rank), -1), position(epoch, step))
            self._acked[(job, rank)] = value
        return unposition(value)

    def acked(self, job: str, rank: int) -> tuple[int, int] | None:
        value = self._acked.get((job, rank))
        return None if value is None else unposition(value)

    def add_skipped(self, job: str, key: str, reason: str) -> None:
        with self._lock:
            self._skipped.setdefault(job, {})[key] = reason

    def skipped(self, job: str) -> dict[str, str]:
        return dict(self._skipped.get(job, {}))

    def heartbeat_server(self, address: str, ttl_s: float) -> None:
        """Nothing to announce: an embedded coordinator's one server is found by its address."""


def reassertion(stored: JobRecord | None, record: JobRecord) -> tuple[Reassertion | None, JobRecord | None]:
    """What re-asserting `record` over the `stored` one does: None when the stored one is another, older
    registration (this server must give the job up). The Redis script follows the same rule."""
    if stored is None:
        return Reassertion.RESTORED, None
    if stored.same_job(record):
        return Reassertion.HELD, stored
    if stored.registered_ms > record.registered_ms:
        return Reassertion.RECLAIMED, stored
    return None, stored
