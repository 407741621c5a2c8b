"""What a live job's spool raises when it cannot keep a job's files (`packfeed.server.live.spool`)."""


class SpoolError(Exception):
    """The spool cannot hold or give back what the job needs (a full disk, a folder of another job)."""


class SpoolFull(SpoolError):
    """The spool holds its bound (`--live-spool-max-gb`): producers wait until trainers acknowledge steps."""


class SpoolConflict(SpoolError):
    """A batch or step record of that number exists already: another server wrote to the job's spool after this
    one read it (this one lost the job's lease, or took it while the other still wrote). Nothing was written; the
    job's state must be read from the spool again before this server serves it on."""
