"""Which coordinator a server uses: the embedded one, or Redis (plain or through its sentinels), from its URL."""

from __future__ import annotations

from packfeed.server.cluster.coordinator import Coordinator, EmbeddedCoordinator


def coordinator_from_url(url: str | None, password: str | None = None) -> Coordinator:
    """`redis://host:port/db` (or `rediss://` for TLS), or a replicated Redis through its sentinels,
    `redis+sentinel://host:port[,host:port...]/SERVICE[/db]` -> RedisCoordinator; empty -> EmbeddedCoordinator."""
    if not url:
        return EmbeddedCoordinator()
    from packfeed.server.cluster.redis_coordinator import RedisCoordinator  # redis loads only for a Redis URL

    return RedisCoordinator(url, password)
