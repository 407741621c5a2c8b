"""Admission instead of discard (staleness `wait`): a producer reserves the right to generate before it starts, and
the server grants only what every sample can still be trained within `max_staleness` of the version it was
generated with. A producer over it waits for a grant (back-pressure); no sample is dropped.

The check is earliest-deadline-first over the steps still to form. A sample of version v is within the
staleness of the steps up to its deadline d(v) (`PolicyVersions.deadline`); every step takes `step_samples`. The
samples due by a deadline d (pending ones, and those reserved and not yet put) must fit in the steps from the
next one to d: a new reservation is granted only if that still holds for every deadline from its own on. The
steps form oldest version first (`step_plan.select`), and a step waits while a reservation due at it is outstanding
(`due_at`), or a group whose pending samples are due at it is not whole while the rest of it is on its way
(`group_due_at`: reserved, or an unfinished rollout continued by a claim): that step is their last chance.

A reservation lasts while its producer is alive (`producers`), and ends once its samples arrived, or when they
arrive as an unfinished rollout, whose continuation is admitted again when a producer claims it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from packfeed.server.live.versions import PolicyVersions

RETRY_S = 0.1  # what an answer that grants nothing tells the producer to wait before asking again (a cheap call)
CLAIM_PREFIX = "\0claim:"  # a claim's reservation key (a group is printable)


@dataclass
class Reservation:
    key: str  # its group (or a claimed rollout: CLAIM_PREFIX + its id)
    producer: str
    samples: int  # still to arrive
    version: int  # the policy that generates them


class Admission:
    def __init__(self, max_staleness: int, step_samples: int):
        self.max_staleness, self.step_samples = max_staleness, step_samples
        self.held: dict[str, Reservation] = {}

    def reserve(self, key: str, producer: str, samples: int, version: int, versions: PolicyVersions, formed: int,
                pending_versions: list[int]) -> str:
        """Grant `samples` of `key` to `producer` at `version`: "" when granted (again, for the same producer: a
        retried request), else why not."""
        held = self.held.get(key)
        if held is not None:
            if held.producer == producer:
                return ""
            return f"{key!r} is reserved by producer {held.producer} (until it puts its samples or is gone)"
        due = versions.deadline(version, self.max_staleness)
        if due < formed:
            return (f"policy version {version} is too old: the next step, {formed}, is trained by version "
                    f"{versions.trained_at(formed)} and max_staleness is {self.max_staleness}: generate with newer "
                    "weights")
        demand = collections.Counter(max(formed, versions.deadline(v, self.max_staleness)) for v in pending_versions)
        for reservation in self.held.values():
            demand[max(formed, versions.deadline(reservation.version, self.max_staleness))] += reservation.samples
        demand[due] += samples
        total = 0
        for deadline in sorted(demand):
            total += demand[deadline]
            room = (deadline - formed + 1) * self.step_samples
            if deadline >= due and total > room:
                return (f"the steps {formed} to {deadline}, the last that train version {version} within "
                        f"max_staleness {self.max_staleness}, hold {room} samples and {total - samples} are pending "
                        f"or reserved for them: wait until the trainers take a step (the job trains version "
                        f"{versions.current})")
        self.held[key] = Reservation(key, producer, samples, version)
        return ""

    def arrived(self, key: str) -> None:
        """A sample of `key` arrived (finished, or as an unfinished rollout)."""
        held = self.held.get(key)
        if held is not None:
            held.samples -= 1
            if held.samples <= 0:
                del self.held[key]

    def give_back(self, alive: set[str]) -> list[Reservation]:
        """Reservations of producers no longer alive end; those that ended."""
        gone = [r for r in self.held.values() if r.producer not in alive]
        for reservation in gone:
            del self.held[reservation.key]
        return gone

    def due_at(self, step: int, versions: PolicyVersions) -> Reservation | None:
        """An outstanding reservation whose last chance is `step`: the step waits for it."""
        return next((r for r in self.held.values()
                     if versions.deadline(r.version, self.max_staleness) == step), None)

    def group_due_at(self, step: int, versions: PolicyVersions, pending: list, group_size: int,
                     unfinished_groups: set[str]) -> str | None:
        """A group not yet whole, one of whose pending samples has its last chance at `step`, while the rest of it
        is on its way (reserved, or an unfinished rollout of it): the step waits for the group ("" : none)."""
        if not group_size:
            return None
        counts: collections.Counter = collections.Counter(row.group for row in pending if row.group)
        coming = {r.key for r in self.held.values()} | unfinished_groups
        waiting = {group for group, count in counts.items() if count < group_size and group in coming}
        return next((row.group for row in pending if row.group in waiting
                     and versions.deadline(row.policy_version, self.max_staleness) == step), None)

    def of(self, producer: str) -> int:
        return sum(r.producer == producer for r in self.held.values())
