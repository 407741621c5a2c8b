"""A live job read back from its spool (`LiveSteps` has this face): every durable batch's rows, every recorded
step, the counts the steps recorded and the versions they were planned for. A server reads it whenever it takes
the job's lease, and after a write found another server's file (`LiveSteps.reload`); and a batch leaving it once
every sample of it, and every fork reading its images, is consumed.
"""

from __future__ import annotations

from packfeed.server.live.rows import LiveRow
from packfeed.server.live.spool import SpoolConflict, SpoolError


class SpoolRecovery:
    """Mixed into `LiveSteps`: fills its state (`_reset` emptied it) from its spool."""

    def _recover(self) -> None:
        """The job as its spool holds it: every durable batch's rows, every recorded step (a rollout put in parts
        by its latest part: those before it are superseded, and count as consumed)."""
        taken, released = set(), set()
        self.steps = self.spool.read_steps()
        self._released = (self.spool.read_json("released.json") or {"step": -1})["step"]
        for step, record in enumerate(self.steps):
            consumed = self.spool.taken_by(record)
            taken.update(consumed)
            if step <= self._released:
                released.update(consumed)
            self._count_step(record)
        self.versions.recovered(self.steps, self._released)
        self.known.update(dict.fromkeys(taken, ""))
        batches = self.spool.recover()
        latest = {row.id: (number, row.part) for number, rows in batches for row in rows}  # parts come in order
        for number, rows in batches:
            self._next_batch = number + 1
            self._batch_ids[number] = [row.id for row in rows]
            current = [row for row in rows if latest[row.id] == (number, row.part)]
            self._batch_left[number] = sum(row.id not in released for row in current)
            for row in current:
                if row.unfinished:
                    self.partials.rows[row.id] = row
                    continue
                self._register(row)
                if row.part:
                    self.partials.finished_part[row.id] = row.part
                if row.id not in taken:
                    self._pend(row)
        for number, rows in batches:  # a fork not yet released keeps its parent's batch (its images are there)
            for row in rows:
                if row.id not in released and latest[row.id] == (number, row.part):
                    for batch in row.inherited_batches() & self._batch_left.keys():
                        self._batch_left[batch] += 1
        for number, rows in batches:
            if not self._batch_left[number]:  # released (or superseded) before a crash let it go
                self._remove_batch(number, rows[0])
        self.arrived = len(self.known)
        try:
            self._form(end=False)  # what a crash (or a failed step record) left pending after a put's batch
        except SpoolConflict:
            raise
        except SpoolError:
            pass  # they stay pending, durable in their batches: the next put or end forms their steps

    def _consumed(self, batch: int, row: LiveRow) -> None:
        """One reader of `batch` consumed (`row`, a sample of it or a fork reading its images)."""
        if batch not in self._batch_left:
            return
        self._batch_left[batch] -= 1
        if not self._batch_left[batch]:
            if batch != row.batch:  # a parent's batch: named by one of its own rows
                row = next((self.rows[i] for i in self._batch_ids[batch] if i in self.rows and self.rows[i].batch == batch),
                           row)
            self._remove_batch(batch, row)

    def _remove_batch(self, number: int, row: LiveRow) -> None:
        for sample_id in self._batch_ids.pop(number):
            if sample_id in self.rows and self.rows[sample_id].batch == number:  # not a later part's row
                self.rows.pop(sample_id)
        del self._batch_left[number]
        try:
            self.spool.remove_batch(number, row)
        except (SpoolError, OSError):
            pass  # its files stay: every step that took its samples is acknowledged, so nothing reads them again
