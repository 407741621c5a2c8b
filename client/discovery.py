"""Finding loader servers: the live servers a Redis-coordinated deployment lists. Each server announces its
`advertise` address with an expiry; this reads the `servers` key of `packfeed.v1.redis_keys` directly (no
server code on the trainer's side). It also owns connecting to that Redis (`redis_client`), plain or through
its sentinels, which the servers' coordinator uses too."""

from __future__ import annotations

from packfeed.v1 import redis_keys


def servers_from_redis(url: str, password: str | None = None, prefix: str = redis_keys.DEFAULT_PREFIX,
                       timeout_s: float = 5.0) -> list[str]:
    """host:port of every server whose announcement has not expired, sorted. Pass the list to
    `PackStream(targets, ...)`: it fails over between them. `url`: redis://... or redis+sentinel://..."""
    with redis_client(url, password, timeout_s) as client:
        now_ms = redis_keys.redis_time_ms(client)
        return sorted(client.zrangebyscore(redis_keys.servers_key(prefix), now_ms, "+inf"))


SENTINEL_SCHEME = "redis+sentinel://"


def redis_client(url: str, password: str | None, timeout_s: float):
    """A redis-py client for `redis://` / `rediss://` URLs, or, for `redis+sentinel://h1:p1,h2:p2/SERVICE[/db]`,
    one that asks the sentinels for SERVICE's current master on every (re)connection (redis-py's Sentinel), so a
    failover is followed by reconnecting. The password is the data servers'; the sentinels are asked without."""
    import redis
    from redis.sentinel import Sentinel

    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "decode_responses": True,
               "health_check_interval": 5}
    if not url.startswith(SENTINEL_SCHEME):
        return redis.Redis.from_url(url, password=password or None, **options)
    hosts, service, db = parse_sentinel_url(url)
    sentinel = Sentinel(hosts, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return sentinel.master_for(service, password=password or None, db=db, **options)


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """(sentinel (host, port)s, service name, db) of `redis+sentinel://h1:p1[,h2:p2...]/SERVICE[/db]`."""
    where, _, path = url[len(SENTINEL_SCHEME):].partition("/")
    parts = [part for part in path.split("/") if part]
    try:
        hosts = [(host, int(port)) for host, _, port in (item.rpartition(":") for item in where.split(","))]
        if not hosts or any(not host for host, _ in hosts) or not 1 <= len(parts) <= 2:
            raise ValueError
        return hosts, parts[0], int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise ValueError(f"{url!r}: a sentinel URL is {SENTINEL_SCHEME}HOST:PORT[,HOST:PORT...]/SERVICE[/DB], "
                         "the sentinels' addresses and the name they monitor the master under") from None
