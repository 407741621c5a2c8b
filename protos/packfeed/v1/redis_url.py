"""Connecting to the Redis that coordinates Packfeed servers, as both sides do: the servers' coordinator writes
there (`packfeed.server.cluster`), a client reads the live servers from it (`packfeed.client.servers_from_redis`).
Two URL forms: a plain Redis (`redis://`, `rediss://`), or a replicated one through its sentinels,
`redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`.

The contract stays importable without redis-py: it is imported inside `redis_client`, the one place that
connects."""

from __future__ import annotations

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
