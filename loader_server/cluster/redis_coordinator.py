"""Coordination in a real Redis server, under the key layout of `packfeed.v1.redis_keys`.

Every compare-and-set (take or keep a lease, release it, move an acknowledged cursor, register a job) is one
Lua script, so two servers never race; a Redis that cannot be reached raises `CoordinationUnavailable`, and
callers keep running streams going but start no new one (fail-closed exclusivity, `packfeed.server.serve`).
"""

from __future__ import annotations

from packfeed.v1.redis_url import redis_client
from packfeed.server.cluster.coordinator import (CoordinationError, CoordinationUnavailable, JobRecord, Reassertion,
                                                 mismatch)
from packfeed.v1 import redis_keys
from packfeed.v1.redis_keys import position, unposition

# KEYS[1] = lease key; ARGV = owner, ttl ms. Take the lease when free or already ours.
_ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Release only a lease we hold (renewing is taking it again: _ACQUIRE keeps a lease for its holder).
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
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
# KEYS[1] = job hash; ARGV[1] = record JSON. `coordinator.reassertion` as one step: restore a missing record,
# replace a younger registration of another job, keep an equal one; returns {outcome, the record found}.
_REASSERT = """
local raw = redis.call('HGET', KEYS[1], 'record')
if raw == false then
  redis.call('HSET', KEYS[1], 'record', ARGV[1])
  return {'restored', ''}
end
local stored, ours = cjson.decode(raw), cjson.decode(ARGV[1])
if stored.spec == ours.spec and stored.plan_fingerprint == ours.plan_fingerprint
    and stored.index_fingerprint == ours.index_fingerprint then
  return {'held', raw}
end
if (tonumber(stored.registered_ms) or 0) > tonumber(ours.registered_ms) then
  redis.call('HSET', KEYS[1], 'record', ARGV[1])
  return {'reclaimed', raw}
end
return {'conflict', raw}
"""


class RedisCoordinator:
    """Coordination in a real Redis server. Every call raises `CoordinationUnavailable` while Redis cannot
    be reached; the connection is re-established on the next call once it is back."""

    def __init__(self, url: str, password: str | None = None, prefix: str = redis_keys.DEFAULT_PREFIX,
                 timeout_s: float = 2.0):
        import redis

        self._auth_errors = (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError)
        # ReadOnlyError: a master demoted to a replica by a failover, until the client finds the new master
        self._redis_errors = (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError)
        self.client = redis_client(url, password, timeout_s)
        self.prefix = prefix
        self._scripts = {name: self.client.register_script(source) for name, source in
                         (("acquire", _ACQUIRE), ("release", _RELEASE), ("ack", _ACK), ("register", _REGISTER),
                          ("reassert", _REASSERT))}

    def _call(self, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except self._auth_errors as error:  # a configuration mistake: retrying cannot fix it
            raise CoordinationError("FAILED_PRECONDITION", f"Redis refused the credentials ({error}): give the "
                                    "password the Redis server requires (its `requirepass`)") from None
        except self._redis_errors as error:
            raise CoordinationUnavailable(f"Redis unreachable: {error}") from None

    def register_job(self, job: str, record: JobRecord) -> JobRecord:
        stored = self._call(self._scripts["register"], keys=[redis_keys.job_key(job, self.prefix)], args=[record.to_json()])
        existing = JobRecord.from_json(stored)
        if not existing.same_job(record):
            raise mismatch(job, existing, record)
        return existing

    def reassert_job(self, job: str, record: JobRecord) -> tuple[Reassertion, JobRecord | None]:
        outcome, stored = self._call(self._scripts["reassert"], keys=[redis_keys.job_key(job, self.prefix)],
                                     args=[record.to_json()])
        found = JobRecord.from_json(stored) if stored else None
        if outcome == "conflict":
            raise mismatch(job, found, record)
        return Reassertion(outcome), found

    def job(self, job: str) -> JobRecord | None:
        stored = self._call(self.client.hget, redis_keys.job_key(job, self.prefix), "record")
        return JobRecord.from_json(stored) if stored else None

    def acquire_lease(self, job: str, lease: str, owner: str, ttl_s: float) -> bool:
        return bool(self._call(self._scripts["acquire"], keys=[redis_keys.lease_key(job, lease, self.prefix)],
                               args=[owner, int(ttl_s * 1000)]))

    def release_lease(self, job: str, lease: str, owner: str) -> bool:
        return bool(self._call(self._scripts["release"], keys=[redis_keys.lease_key(job, lease, self.prefix)], args=[owner]))

    def lease_owner(self, job: str, lease: str) -> str | None:
        return self._call(self.client.get, redis_keys.lease_key(job, lease, self.prefix))

    def ack(self, job: str, rank: int, epoch: int, step: int) -> tuple[int, int]:
        value = self._call(self._scripts["ack"], keys=[redis_keys.acked_key(job, self.prefix)], args=[rank, position(epoch, step)])
        return unposition(int(value))

    def acked(self, job: str, rank: int) -> tuple[int, int] | None:
        value = self._call(self.client.hget, redis_keys.acked_key(job, self.prefix), rank)
        return None if value is None else unposition(int(value))

    def add_skipped(self, job: str, key: str, reason: str) -> None:
        self._call(self.client.hset, redis_keys.skipped_key(job, self.prefix), key, reason)

    def skipped(self, job: str) -> dict[str, str]:
        return self._call(self.client.hgetall, redis_keys.skipped_key(job, self.prefix))

    def heartbeat_server(self, address: str, ttl_s: float) -> None:
        now_ms = self._server_time_ms()
        key = redis_keys.servers_key(self.prefix)
        self._call(self.client.zadd, key, {address: now_ms + int(ttl_s * 1000)})
        self._call(self.client.zremrangebyscore, key, "-inf", now_ms)

    def _server_time_ms(self) -> int:
        return self._call(redis_keys.redis_time_ms, self.client)
