"""Partial rollouts: a generation interrupted by a weight update is put unfinished (its prefix so far, with each
token's policy version and its behaviour log-probabilities), kept, and continued by any producer with newer
weights, not thrown away.

A rollout's parts share its id and count up from 0. Part k + 1 is accepted only after part k, and only if it
starts with part k as put (its tokens, mask, tensors and versions: `LiveSample.covers`); a finished part is the
whole rollout and is trained once, as any sample. An unfinished rollout is claimed by one producer at a time
(`claim`), for as long as that producer is alive; then it returns to the pool. Exactly once: every part is
durable in the spool before its put answers; a retried part is a duplicate; a second producer continuing the same
part (after the first's claim lapsed) is refused, since that part was put already.
"""

from __future__ import annotations

from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import LiveSample


class Partials:
    def __init__(self):
        self.rows: dict[str, LiveRow] = {}  # id -> its latest unfinished part (oldest first: claims go in order)
        self.claims: dict[str, str] = {}  # id -> the producer continuing it
        self.finished_part: dict[str, int] = {}  # id -> the part that finished it (rollouts put in parts)

    def admit(self, sample: LiveSample, finished_digest: str | None) -> tuple[str, str] | None:
        """The outcome of a part of a rollout put in parts ("accepted" | "duplicate" | "refused", reason), or None
        for a sample put whole (`finished_digest`: what its id finished as, None when it did not)."""
        held = self.rows.get(sample.id)
        if held is None and not sample.part and sample.id not in self.finished_part:
            return ("accepted", "") if sample.unfinished and finished_digest is None else None
        if finished_digest is not None:
            done = self.finished_part.get(sample.id, 0)
            if sample.part < done or (sample.part == done and (not finished_digest or finished_digest == sample.digest)):
                return "duplicate", "already accepted"
            return "refused", (f"part: rollout {sample.id!r} was finished by its part {done}: a retry sends the same "
                               "part; give a new rollout an id of its own")
        if held is None:
            return "refused", (f"part: rollout {sample.id!r} has no part {sample.part - 1}: put its parts in order "
                               "(a claimed rollout continues with its part + 1)")
        if sample.part <= held.part:
            if sample.part < held.part or sample.digest == held.digest:
                return "duplicate", "already accepted"
            return "refused", (f"part: part {held.part} of rollout {sample.id!r} was put with other content (another "
                               "producer continued it after this one's claim lapsed?): claim another")
        if sample.part > held.part + 1:
            return "refused", f"part: rollout {sample.id!r}'s last part is {held.part}: put part {held.part + 1}"
        if sample.n_tokens < held.tokens or sample.prefix_digest(held.tokens) != held.covers:
            return "refused", (f"tokens: part {sample.part} of rollout {sample.id!r} must start with its part "
                               f"{held.part} as put ({held.tokens} tokens, with their mask, tensors and versions): "
                               "continue the rollout as claimed")
        return "accepted", ""

    def kept(self, row: LiveRow) -> LiveRow | None:
        """A part is durable: the part it continues, which it supersedes (None: its first)."""
        before = self.rows.pop(row.id, None)
        self.claims.pop(row.id, None)  # a new part is unclaimed again (or finished)
        if row.unfinished:
            self.rows[row.id] = row
        elif before is not None:
            self.finished_part[row.id] = row.part
        return before

    def claim(self, producer: str) -> LiveRow | None:
        """The producer's claimed rollout (a retried claim), else the oldest unclaimed one, now its; None: none."""
        held = next((sample_id for sample_id, owner in self.claims.items() if owner == producer), None)
        if held is None:
            held = next((sample_id for sample_id in self.rows if sample_id not in self.claims), None)
        return None if held is None else self.rows[held]

    def give_back(self, alive: set[str]) -> None:
        """Claims of producers no longer alive return their rollouts to the pool."""
        for sample_id in [s for s, producer in self.claims.items() if producer not in alive]:
            del self.claims[sample_id]
