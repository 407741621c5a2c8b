"""The Redis key layout Packfeed servers share (the one place it is written down).

Servers coordinated through one Redis (`redis_url`) keep there, under a prefix (`packfeed:` by default):

| key | type | holds |
|---|---|---|
| `job:{job}` | hash, field `record` | JSON of what every server must agree on: `spec` (dataset, plan config, seed, epochs), `plan_fingerprint`, `index_fingerprint`, and `registered_ms` (when first registered); set once, and set again by the servers serving the job when Redis lost it (the older registration wins a conflict) |
| `lease:{job}:{seat}` | string with a TTL (ms) | the `advertise` address of the server streaming to that seat (`Seat.lease_name`: an LLM rank's first seat is the rank's number, as in v1; `3.lane-1`, `3.replica-2`, `encoder-0` the others) |
| `acked:{job}` | hash rank -> integer | the rank's acknowledged position `epoch << 32 | step`; it only grows |
| `skipped:{job}` | hash sample key -> reason | samples skipped at serve time |
| `servers` | sorted set address -> score | live servers; the score is when the entry expires, in ms on Redis's own clock (`TIME`) |

Servers write these (`packfeed.server.cluster`); clients only read `servers` to discover servers
(`packfeed.client.servers_from_redis`). Both connect with `packfeed.v1.redis_url.redis_client`: a plain Redis
URL, or a replicated Redis through its sentinels (`redis+sentinel://host:port[,host:port...]/SERVICE[/db]`).
"""

from __future__ import annotations

DEFAULT_PREFIX = "packfeed:"


def key(prefix: str, *parts: object) -> str:
    """`prefix` + the parts joined by ':' (e.g. key('packfeed:', 'lease', 'run-7', 3) -> 'packfeed:lease:run-7:3')."""
    return prefix + ":".join(str(part) for part in parts)


def job_key(job: str, prefix: str = DEFAULT_PREFIX) -> str:
    return key(prefix, "job", job)


def lease_key(job: str, lease: str | int, prefix: str = DEFAULT_PREFIX) -> str:
    """`lease`: a seat's lease name (`packfeed.v1.layout.Seat.lease_name`): an LLM rank's first seat is its number."""
    return key(prefix, "lease", job, lease)


def acked_key(job: str, prefix: str = DEFAULT_PREFIX) -> str:
    return key(prefix, "acked", job)


def skipped_key(job: str, prefix: str = DEFAULT_PREFIX) -> str:
    return key(prefix, "skipped", job)


def servers_key(prefix: str = DEFAULT_PREFIX) -> str:
    return key(prefix, "servers")


def position(epoch: int, step: int) -> int:
    """(epoch, step) as one integer that orders like the pair (steps fit in 32 bits)."""
    return (epoch << 32) | step


def unposition(value: int) -> tuple[int, int]:
    return value >> 32, value & 0xFFFFFFFF


def redis_time_ms(client) -> int:
    """Redis's clock in ms, so that machines with skewed clocks agree on what has expired."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000
