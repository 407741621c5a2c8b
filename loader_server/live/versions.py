"""A live job's policy versions: which version the trainers train now, and which version each step will be trained
at, from what the trainers report (`AckStepRequest.policy_version`: the version they hold after a step's update).

Without reports the rule is one update a step: step s is trained by version s. With one, (version V after step a)
step s > a is trained by V + (s - a - 1): the report anchors the count, one update a step after it. The version a
step was planned for is written in its record, so a server that reads the spool again (a restart, a takeover)
continues from the last step formed until the trainers report again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PolicyVersions:
    base: int = 0  # step s is trained by version base + s
    reported_step: int = -1  # the step of the report that set `base` (-1: none this server heard)
    current: int = 0  # the version the trainers hold now (what producers should generate with)

    def trained_at(self, step: int) -> int:
        """The version step `step` is trained by."""
        return self.base + step

    def report(self, step: int, version: int) -> bool:
        """A trainer's report: it holds `version` after step `step`'s update. The latest step's report counts (ranks
        of one step report the same version; a report of an older step says nothing new). Whether it was taken."""
        if step < self.reported_step or (step == self.reported_step and version <= self.current):
            return False
        self.reported_step, self.current = step, max(version, self.current)
        self.base = version - step - 1
        return True

    def released(self, step: int) -> None:
        """Every rank acknowledged step `step`: without reports, the trainers now hold version step + 1."""
        if self.reported_step < 0:
            self.current = max(self.current, self.trained_at(step + 1))

    def recovered(self, records: list[dict], released: int) -> None:
        """The versions as a spool left them: the last step formed was planned for its record's version."""
        last = next((s for s in range(len(records) - 1, -1, -1) if "version" in records[s]), None)
        self.base = records[last]["version"] - last if last is not None else 0
        self.reported_step = -1
        self.current = self.trained_at(released + 1)

    def deadline(self, version: int, max_staleness: int) -> int:
        """The last step that trains a sample of `version` within `max_staleness` versions of it."""
        return version + max_staleness - self.base
