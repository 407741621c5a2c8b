"""What a live job's producers ask of it besides their puts (`LiveSteps` has this face): who may put and how much
(the producer token, the spool's bounds), their liveness (`Heartbeat`), reservations under staleness wait
(`Reserve`), claims of unfinished rollouts (`ClaimRollout`), a fork's parent found at its put, the trainers' version
reports, and the time-driven part of the job (`tick`: producers whose lease lapsed give back what they held; groups
past their deadline and steps no longer waiting for a reservation form).
"""

from __future__ import annotations

import hmac

import numpy as np

from packfeed.server.live.admission import CLAIM_PREFIX
from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import LiveSample, Refused, SampleRules, finish_fork
from packfeed.server.live.spool import TOKEN_VERSIONS, SpoolConflict, SpoolError, SpoolFull, beside, read_array, \
    read_member, token_digest

# What a spooled sample takes at least (its tokens and loss mask: two tar members, a header and a block each), and
# what a put's token is counted as against the spool's bound (`check_room`)
SMALLEST_SPOOLED_SAMPLE = 4 * 512
SPOOLED_BYTES_PER_TOKEN = 5


class ProducerSide:
    """Mixed into `LiveSteps`: uses its lock, state and `_form`."""

    def _fork(self, sample: LiveSample, earlier: dict[str, LiveSample], rules: SampleRules | None) -> tuple[str, str]:
        """A fork's parent: pending in the job, or accepted earlier in this put (not in a step yet: a tree is
        planned and trained whole, one group); its inherited turns and images checked (`finish_fork`)."""
        parent = earlier.get(sample.parent)
        if parent is None and sample.parent in self.pending:
            parent = self.rows.get(sample.parent)
        if parent is None:
            where = "taken by a step already" if sample.parent in self.known else "not accepted"
            return "refused", (f"parent: trajectory {sample.parent!r} is {where}: put a tree's trajectories before "
                               "its group forms a step, each after its parent (earlier in the put, or in an "
                               "earlier one)")
        if rules is None:
            raise ValueError("a fork is costed by the job's sample rules: give put(..., rules=)")
        try:
            finish_fork(sample, parent, rules)
        except Refused as refused:
            return "refused", f"{refused.field}: {refused}"
        return "accepted", ""

    def claim_producer(self, token: str) -> None:
        """The job's producer token, as its spool holds it (`token`'s when it has none: `Spool.claim_producer`)."""
        self.producer = self.spool.claim_producer(token)

    def check_producer(self, token: str) -> bool:
        """Whether a put bringing `token` may put into (and end) the job."""
        return not self.producer or hmac.compare_digest(self.producer, token_digest(token))

    def check_room(self, samples: int, nbytes: int) -> None:
        """SpoolFull unless the job has room for `samples` more of about `nbytes` (checked before a put's samples
        are even read, so a flooding producer costs the server next to nothing, and again when they are kept)."""
        if self.max_samples and samples > self.max_samples:
            raise ValueError(f"a put of {samples:,} samples is more than the job may hold at all "
                             f"({self.max_samples:,}, --live-max-samples): put fewer samples at once")
        if self.max_bytes and nbytes > self.max_bytes:
            raise ValueError(f"a put of {nbytes / 2**20:,.1f} MiB is larger than the job's whole spool may hold "
                             f"({self.max_bytes / 2**20:,.1f} MiB, --live-spool-max-gb): put fewer samples at once")
        if self.max_samples and len(self.rows) + samples > self.max_samples:
            raise SpoolFull(f"the job holds {len(self.rows):,} samples not yet consumed, its bound "
                            f"{self.max_samples:,} (--live-max-samples) until the trainers acknowledge the steps "
                            "that took them: retry later (the producer waits and retries by itself)")
        if self.max_bytes and self.spool.bytes + nbytes > self.max_bytes:
            raise SpoolFull(f"the live spool holds {self.spool.bytes / 2**20:,.1f} MiB of its "
                             f"{self.max_bytes / 2**20:,.1f} MiB (--live-spool-max-gb) until the trainers acknowledge "
                             "the steps that took them: retry later (the producer waits and retries by itself)")

    # -- asynchronous RL ---------------------------------------------------------------------------------

    def heartbeat(self, producer: str, name: str = "", lease_s: float = 0.0, leaving: bool = False) -> dict:
        """A producer is alive (or leaves: what it held goes back at once); its view of the job."""
        with self._lock:
            self.producers.heartbeat(producer, name, lease_s, leaving)
            if leaving:
                self._give_back()
            return {"policy_version": self.versions.current, "producers_alive": len(self.producers.alive()),
                    "reservations": self.admission.of(producer) if self.admission is not None else 0,
                    "claims": sum(owner == producer for owner in self.partials.claims.values())}

    def reserve(self, producer: str, group: str, samples: int, version: int | None) -> tuple[bool, int, str]:
        """Staleness wait: the right to generate `samples` of `group` with `version` (None: the job's). (granted,
        the version checked, why not)."""
        with self._lock:
            self.producers.heartbeat(producer)
            version = self.versions.current if version is None else version
            if self.admission is None:
                return True, version, ""  # staleness drop: nothing to reserve, every sample is taken or dropped
            if self.ended:
                return False, version, f"the job ended at step {len(self.steps) - 1}: it takes no more samples"
            samples = samples or self.config.group_size or 1
            why = self.admission.reserve(group, producer, samples, version, self.versions, len(self.steps),
                                         self._pending_versions())
            return not why, version, why

    def claim_rollout(self, producer: str, version: int | None) -> tuple[LiveRow | None, dict, str]:
        """An unfinished rollout for `producer` to continue, and its arrays; (None, {}, why) when none is free (or,
        under staleness wait, none admitted now)."""
        with self._lock:
            self.producers.heartbeat(producer)
            row = self.partials.claim(producer)
            if row is None:
                return None, {}, "no unfinished rollout is waiting to be continued"
            if self.admission is not None and self.partials.claims.get(row.id) != producer:
                version = self.versions.current if version is None else version
                why = self.admission.reserve(CLAIM_PREFIX + row.id, producer, 1, version, self.versions,
                                             len(self.steps), self._pending_versions())
                if why:
                    return None, {}, why
            self.partials.claims[row.id] = producer
        return row, self._arrays(row), ""

    def _arrays(self, row: LiveRow) -> dict:
        """A spooled part's arrays and image files, as its producer put them."""
        tar = self.spool.tar_path(row)
        arrays = {name: read_array(tar, span) for name, span in row.members.items()}
        arrays["images"] = [read_member(beside(tar, file), [offset, size])
                            for _, file, offset, size in row.own_image_refs()]
        if TOKEN_VERSIONS not in arrays:
            arrays[TOKEN_VERSIONS] = np.full(row.tokens, row.policy_version, np.int64)
        return arrays

    def report_version(self, step: int, version: int) -> None:
        """A trainer holds `version` after step `step`'s update (`PolicyVersions.report`)."""
        with self._lock:
            self.versions.report(step, version)

    def tick(self) -> None:
        """The time-driven part of the job, every second or so: what producers that are gone held goes back, and
        the steps that can form now (groups past their deadline, no reservation waited for any more) form."""
        with self._lock:
            if self.ended or self.stale:
                return
            self._give_back()
            try:
                self._form(end=False)
            except SpoolConflict:
                self.stale = True
            except SpoolError:
                pass  # the next put or tick tries again

    def _awaited(self, step: int) -> str:
        """Staleness wait: what step `step` waits for, samples on their way that it is the last chance of ("":
        nothing)."""
        if self.admission is None:
            return ""
        due = self.admission.due_at(step, self.versions)
        if due is not None:
            return f"step {step} waits for {due.samples} sample(s) of {due.key!r} reserved by {due.producer}"
        pending = [self.rows[sample_id] for sample_id in self.pending]
        group = self.admission.group_due_at(step, self.versions, pending, self.config.group_size,
                                            {row.group for row in self.partials.rows.values()})
        return "" if group is None else \
            f"step {step} waits for group {group!r} to be whole (the rest of it is on its way)"

    def _give_back(self) -> None:
        alive = set(self.producers.alive())
        if self.admission is not None:
            self.admission.give_back(alive)
        self.partials.give_back(alive)

    def _pending_versions(self) -> list[int]:
        return [self.rows[sample_id].policy_version for sample_id in self.pending]

    def producers_gone(self) -> str:
        """Why the trainers' streams fail now ("": they wait on): `producer_timeout_s` passed without a put."""
        timeout = self.config.producer_timeout_s
        with self._lock:
            if not timeout or self.ended or self.producers.gone_for() < timeout:
                return ""
            alive = self.producers.alive()
            return (f"no sample was put for {self.producers.gone_for():.0f} s (producer_timeout_s {timeout:g}) and "
                    f"{len(alive)} producer{'s are' if len(alive) != 1 else ' is'} alive; "
                    f"{self.producers.describe()}: restart the producers, or end the job (Producer.end)")

    def waiting_for(self) -> str:
        """Why no step forms now, for a person ("" : the job ended). Asked by GetJob and a waiting stream, not by
        puts: under staleness wait it looks through the pending samples."""
        with self._lock:
            if self.ended:
                return ""
            awaited = self._awaited(len(self.steps))
            if awaited:
                return awaited
            if not self.producers.alive():
                return "no producer is alive"
            return f"{len(self.pending)} of {self.config.step_samples or '-'} samples pending"

    def _async_status(self) -> dict:
        limit = self.config.max_staleness
        return {"policy_version": self.versions.current, "trained_age": dict(self.ages),
                "producers": self.producers.status(), "producers_alive": len(self.producers.alive()),
                "reservations": len(self.admission.held) if self.admission is not None else 0,
                "partials": len(self.partials.rows), "partials_claimed": len(self.partials.claims),
                "groups_filtered": self.filtered_groups, "groups_short": self.short_groups,
                "trained_stale": sum(n for age, n in self.ages.items() if limit is not None and age > limit)}
