"""A live job's producers as its server hears them: each says it is alive (`Heartbeat`) and shows it by its puts;
one counts as gone once its lease passes without either, or when it leaves. What a producer holds (reservations,
claims of unfinished rollouts) lasts while it is alive (`packfeed.server.live.admission`).

The trainers' streams are told when no producer is alive (a state on the stream and in GetJob) and, with
`producer_timeout_s`, fail once no sample was put for that long while they wait for a step (`gone_for`).
These are this server's observations, not the spool's: a server taking the job over starts hearing anew.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DEFAULT_LEASE_S = 15.0
MAX_LEASE_S = 300.0
MAX_PRODUCERS = 4096  # remembered per job (the oldest gone one is forgotten first)


@dataclass
class Seen:
    producer: str
    name: str = ""
    lease_s: float = DEFAULT_LEASE_S
    seen: float = field(default_factory=time.monotonic)
    put: float | None = None  # its last put's time
    samples: int = 0  # accepted from it
    left: bool = False

    def alive(self, now: float) -> bool:
        return not self.left and now - self.seen <= self.lease_s


class Producers:
    def __init__(self, now: float | None = None):
        self.seen: dict[str, Seen] = {}
        self.since = time.monotonic() if now is None else now  # this server began hearing the job's producers
        self.last_put: float | None = None  # any sample's put, from any producer or none named

    def heartbeat(self, producer: str, name: str = "", lease_s: float = 0.0, leaving: bool = False) -> Seen:
        seen = self._of(producer)
        seen.name = name[:256] or seen.name
        seen.lease_s = min(MAX_LEASE_S, lease_s) if lease_s > 0 else seen.lease_s
        seen.seen, seen.left = time.monotonic(), leaving
        return seen

    def put(self, producer: str, samples: int) -> None:
        """A put answered (`samples` of it accepted): the producer, when it gave its id, is alive and active."""
        now = time.monotonic()
        self.last_put = now
        if producer:
            seen = self._of(producer)
            seen.seen, seen.put, seen.left = now, now, False
            seen.samples += samples

    def _of(self, producer: str) -> Seen:
        if producer not in self.seen:
            if len(self.seen) >= MAX_PRODUCERS:
                oldest = min(self.seen.values(), key=lambda s: (s.alive(time.monotonic()), s.seen))
                del self.seen[oldest.producer]
            self.seen[producer] = Seen(producer)
        return self.seen[producer]

    def alive(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [p for p, seen in self.seen.items() if seen.alive(now)]

    def gone_for(self, now: float | None = None) -> float:
        """Seconds since the job last had a put (or since this server began hearing it)."""
        now = time.monotonic() if now is None else now
        return now - max(self.since, self.last_put or self.since)

    def describe(self, now: float | None = None) -> str:
        """Who was heard, for an error a person reads: each producer and how long ago."""
        now = time.monotonic() if now is None else now
        if not self.seen:
            return "no producer was heard from by this server"
        latest = sorted(self.seen.values(), key=lambda s: -s.seen)[:8]
        return "producers: " + ", ".join(
            f"{s.producer}{f' ({s.name})' if s.name else ''} last seen {now - s.seen:.0f} s ago"
            f"{', left' if s.left else ''}" for s in latest) + (" ..." if len(self.seen) > 8 else "")

    def status(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        return [{"producer": s.producer, "name": s.name, "alive": s.alive(now), "seen_s_ago": now - s.seen,
                 "put_s_ago": -1.0 if s.put is None else now - s.put, "samples": s.samples}
                for s in self.seen.values()]
