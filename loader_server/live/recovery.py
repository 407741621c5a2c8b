"""A live job read back from its spool (`LiveSteps` has this face): every durable batch's rows, every recorded
step, the counts the steps recorded and the versions they were planned for. A server reads it whenever it takes
the job's lease, and after a write found another server's file (`LiveSteps.reload`).
"""

from __future__ import annotations

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
                if row.id not in released:  # what it reads in earlier batches stays until it is consumed
                    for batch in row.inherited_batches().keys() & self._batch_left.keys():
                        self._batch_left[batch] += 1
                if row.unfinished:
                    self.partials.rows[row.id] = row
                    continue
                self._register(row)
                if row.part:
                    self.partials.finished_part[row.id] = row.part
                if row.id not in taken:
                    self._pend(row)
        for number, rows in batches:
            if not self._batch_left[number]:  # released (or superseded) before a crash let it go
                self._remove_batch(number, rows[0].file)
        self.arrived = len(self.known)
        try:
            self._form(end=False)  # what a crash (or a failed step record) left pending after a put's batch
        except SpoolConflict:
            raise
        except SpoolError:
            pass  # they stay pending, durable in their batches: the next put or end forms their steps
