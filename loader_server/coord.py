"""Shared job state for one or many loader servers: embedded (in this process) or in Redis.

The plan is deterministic, so servers share very little: which jobs exist and with which fingerprints,
which server currently feeds which rank (a lease with a TTL, renewed by heartbeats), each rank's
acknowledged step (a cursor that only moves forward), the samples skipped as bad, and which servers are
alive (so clients can find another one). Everything else — the plan, the packs — any server recomputes.

    coordinator = coordinator_from_url(os.environ.get("PACKFEED_REDIS_URL"))   # None -> embedded
    coordinator.register_job(job, record)           # refuses a different fingerprint for the same job id
    coordinator.acquire_lease(job, rank, server_id, ttl_s=10)
    coordinator.ack(job, rank, epoch, step)         # monotone: a late or repeated ack never moves it back

Redis keys (prefix `packfeed:` by default): `job:{job}` (hash), `lease:{job}:{rank}` (string with a TTL),
`acked:{job}` (hash rank -> position), `skipped:{job}` (hash key -> reason), `servers` (sorted set
address -> expiry). Compare-and-set steps run as Lua scripts, so two servers never race.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Protocol


class CoordinationError(RuntimeError):
    """The coordinator refused a request; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class CoordinationUnavailable(RuntimeError):
    """The coordinator cannot be reached now; callers keep serving what they have and retry."""


@dataclass(frozen=True)
class JobRecord:
    """What every server must agree on to serve a job."""

    spec: str  # JobSpec.describe(): dataset, plan config, seed, epochs
    plan_fingerprint: str
    index_fingerprint: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def position(epoch: int, step: int) -> int:
    """(epoch, step) as one integer that orders like the pair (steps fit in 32 bits)."""
    return (epoch << 32) | step


def unposition(value: int) -> tuple[int, int]:
    return value >> 32, value & 0xFFFFFFFF


def _mismatch(job: str, existing: JobRecord, record: JobRecord) -> CoordinationError:
    return CoordinationError("FAILED_PRECONDITION",
                             f"job {job!r} is registered with plan {existing.plan_fingerprint} over index "
                             f"{existing.index_fingerprint} ({existing.spec}); this server computes plan "
                             f"{record.plan_fingerprint} over index {record.index_fingerprint} ({record.spec}). "
                             f"Serve the same index and settings on every server, or use a new job id")


class Coordinator(Protocol):
    def register_job(self, job: str, record: JobRecord) -> JobRecord: ...
    def job(self, job: str) -> JobRecord | None: ...
    def acquire_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool: ...
    def renew_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool: ...
    def release_lease(self, job: str, rank: int, owner: str) -> bool: ...
    def lease_owner(self, job: str, rank: int) -> str | None: ...
    def ack(self, job: str, rank: int, epoch: int, step: int) -> tuple[int, int]: ...
    def acked(self, job: str, rank: int) -> tuple[int, int] | None: ...
    def add_skipped(self, job: str, key: str, reason: str) -> None: ...
    def skipped(self, job: str) -> dict[str, str]: ...
    def heartbeat_server(self, address: str, ttl_s: float) -> None: ...
    def live_servers(self) -> list[str]: ...


class EmbeddedCoordinator:
    """The single-server default: the same semantics, in this process's memory."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._leases: dict[tuple[str, int], tuple[str, float]] = {}
        self._acked: dict[tuple[str, int], int] = {}
        self._skipped: dict[str, dict[str, str]] = {}
        self._servers: dict[str, float] = {}

    def register_job(self, job: str, record: JobRecord) -> JobRecord:
        with self._lock:
            existing = self._jobs.setdefault(job, record)
        if existing != record:
            raise _mismatch(job, existing, record)
        return existing

    def job(self, job: str) -> JobRecord | None:
        return self._jobs.get(job)

    def _holder(self, job: str, rank: int) -> str | None:
        owner, expiry = self._leases.get((job, rank), (None, 0.0))
        return owner if owner is not None and expiry > self._clock() else None

    def acquire_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool:
        with self._lock:
            holder = self._holder(job, rank)
            if holder not in (None, owner):
                return False
            self._leases[(job, rank)] = (owner, self._clock() + ttl_s)
            return True

    def renew_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool:
        with self._lock:
            if self._holder(job, rank) != owner:
                return False
            self._leases[(job, rank)] = (owner, self._clock() + ttl_s)
            return True

    def release_lease(self, job: str, rank: int, owner: str) -> bool:
        with self._lock:
            if self._holder(job, rank) != owner:
                return False
            del self._leases[(job, rank)]
            return True

    def lease_owner(self, job: str, rank: int) -> str | None:
        with self._lock:
            return self._holder(job, rank)

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
        with self._lock:
            self._servers[address] = self._clock() + ttl_s

    def live_servers(self) -> list[str]:
        now = self._clock()
        return sorted(a for a, expiry in self._servers.items() if expiry > now)


# KEYS[1] = lease key; ARGV = owner, ttl ms. Take the lease when free or already ours.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Renew (ARGV[2] = ttl ms) or release (no ARGV[2]) only a lease we hold.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) else redis.call('DEL', KEYS[1]) end
return 1
"""
# KEYS[1] = acked hash; ARGV = rank, position. Keep the larger: a cursor never goes backwards.
_ACK = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw == false or tonumber(ARGV[2]) > tonumber(raw) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
return raw
"""
# KEYS[1] = job hash; ARGV[1] = record JSON. Register unless another record is there; return what is.
_REGISTER = """
if redis.call('HSETNX', KEYS[1], 'record', ARGV[1]) == 1 then return ARGV[1] end
return redis.call('HGET', KEYS[1], 'record')
"""


class RedisCoordinator:
    """Coordination in a real Redis server. Every call raises `CoordinationUnavailable` while Redis cannot
    be reached; the connection is re-established on the next call once it is back."""

    def __init__(self, url: str, password: str | None = None, prefix: str = "packfeed:",
                 timeout_s: float = 2.0):
        import redis

        self._auth_errors = (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError)
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError)
        self.client = redis.Redis.from_url(url, password=password or None, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s, decode_responses=True,
                                           health_check_interval=5)
        self.prefix = prefix
        self._scripts = {name: self.client.register_script(source) for name, source in
                         (("acquire", _ACQUIRE), ("renew", _RENEW), ("ack", _ACK), ("register", _REGISTER))}

    def _call(self, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except self._auth_errors as error:  # a configuration mistake: retrying cannot fix it
            raise CoordinationError("FAILED_PRECONDITION", f"Redis refused the credentials ({error}): give the "
                                    "password the Redis server requires (its `requirepass`)") from None
        except self._redis_errors as error:
            raise CoordinationUnavailable(f"Redis unreachable: {error}") from None

    def _key(self, *parts) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    def ping(self) -> bool:
        return bool(self._call(self.client.ping))

    def register_job(self, job: str, record: JobRecord) -> JobRecord:
        stored = self._call(self._scripts["register"], keys=[self._key("job", job)], args=[record.to_json()])
        existing = JobRecord(**json.loads(stored))
        if existing != record:
            raise _mismatch(job, existing, record)
        return existing

    def job(self, job: str) -> JobRecord | None:
        stored = self._call(self.client.hget, self._key("job", job), "record")
        return JobRecord(**json.loads(stored)) if stored else None

    def acquire_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool:
        return bool(self._call(self._scripts["acquire"], keys=[self._key("lease", job, rank)],
                               args=[owner, int(ttl_s * 1000)]))

    def renew_lease(self, job: str, rank: int, owner: str, ttl_s: float) -> bool:
        return bool(self._call(self._scripts["renew"], keys=[self._key("lease", job, rank)],
                               args=[owner, int(ttl_s * 1000)]))

    def release_lease(self, job: str, rank: int, owner: str) -> bool:
        return bool(self._call(self._scripts["renew"], keys=[self._key("lease", job, rank)], args=[owner]))

    def lease_owner(self, job: str, rank: int) -> str | None:
        return self._call(self.client.get, self._key("lease", job, rank))

    def ack(self, job: str, rank: int, epoch: int, step: int) -> tuple[int, int]:
        value = self._call(self._scripts["ack"], keys=[self._key("acked", job)], args=[rank, position(epoch, step)])
        return unposition(int(value))

    def acked(self, job: str, rank: int) -> tuple[int, int] | None:
        value = self._call(self.client.hget, self._key("acked", job), rank)
        return None if value is None else unposition(int(value))

    def add_skipped(self, job: str, key: str, reason: str) -> None:
        self._call(self.client.hset, self._key("skipped", job), key, reason)

    def skipped(self, job: str) -> dict[str, str]:
        return self._call(self.client.hgetall, self._key("skipped", job))

    def heartbeat_server(self, address: str, ttl_s: float) -> None:
        now_ms = self._server_time_ms()
        key = self._key("servers")
        self._call(self.client.zadd, key, {address: now_ms + int(ttl_s * 1000)})
        self._call(self.client.zremrangebyscore, key, "-inf", now_ms)

    def live_servers(self) -> list[str]:
        return sorted(self._call(self.client.zrangebyscore, self._key("servers"), self._server_time_ms(), "+inf"))

    def _server_time_ms(self) -> int:
        """Redis's clock, so that servers with skewed clocks agree on what has expired."""
        seconds, micros = self._call(self.client.time)
        return int(seconds) * 1000 + int(micros) // 1000


def coordinator_from_url(url: str | None, password: str | None = None) -> Coordinator:
    """`redis://host:port/db` (or `rediss://` for TLS) -> RedisCoordinator; empty -> EmbeddedCoordinator."""
    return RedisCoordinator(url, password) if url else EmbeddedCoordinator()
