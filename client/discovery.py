"""Finding loader servers: the live servers a Redis-coordinated deployment lists (each server announces its
`advertise` address with a TTL)."""

from __future__ import annotations


def servers_from_redis(url: str, password: str | None = None) -> list[str]:
    """host:port of every server that announced itself within its lease TTL, sorted. Pass the list to
    `PackStream(targets, ...)`: it fails over between them."""
    from packfeed.server.coord import RedisCoordinator

    return RedisCoordinator(url, password).live_servers()
