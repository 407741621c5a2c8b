"""Finding loader servers: the live servers a Redis-coordinated deployment lists. Each server announces its
`advertise` address with an expiry; this reads the `servers` key of `packfeed.v1.redis_keys` directly (no
server code on the trainer's side), connected as the contract says (`packfeed.v1.redis_url`)."""

from __future__ import annotations

from packfeed.v1 import redis_keys
from packfeed.v1.redis_url import redis_client


def servers_from_redis(url: str, password: str | None = None, prefix: str = redis_keys.DEFAULT_PREFIX,
                       timeout_s: float = 5.0) -> list[str]:
    """host:port of every server whose announcement has not expired, sorted. Pass the list to
    `PackStream(targets, ...)`: it fails over between them. `url`: redis://... or redis+sentinel://..."""
    with redis_client(url, password, timeout_s) as client:
        now_ms = redis_keys.redis_time_ms(client)
        return sorted(client.zrangebyscore(redis_keys.servers_key(prefix), now_ms, "+inf"))
