"""One rank stream's step pump: keeps up to `prefetch_steps` of the rank's steps being prepared in the worker
pool, each within the shared memory budget, and puts them in order into the stream's bounded queue.

A slow consumer fills its own queue and so stops its own pump: it never holds the pool or grows memory.
Room for a step is reserved when it is submitted (estimated from the index) and corrected once it is ready;
the stream releases it once gRPC has taken the step's bytes. The replicas of a rank share steps (`Job.steps`):
a pump takes a step another replica's pump is preparing or holding rather than preparing it again,
and gives it back once its stream has sent it. Each taker still reserves room for it (the budget counts a
shared step once per taker: more than it takes, never less).
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures.process import BrokenProcessPool

from packfeed.server.serve.budget import Account, StepHold
from packfeed.server.serve.config import ServerConfig
from packfeed.server.serve.job_spec import JobError
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.observe import Metrics, log
from packfeed.server.serve.step_work import RankStepResult
from packfeed.server.serve.workers import WorkerPool
from packfeed.v1.layout import Seat

END = None  # put in the queue after the job's last step (or after a failure)


async def produce(job: Job, seat: Seat, cursor: tuple[int, int] | None, queue: asyncio.Queue, pool: WorkerPool,
                  account: Account, config: ServerConfig, metrics: Metrics | None = None) -> None:
    """Put ((epoch, step), RankStepResult, StepHold) for every step from `cursor` to the end of the job, then END
    (the stream releases each hold once the step is sent); `account`: the stream's in the memory budget.
    An encoder rank's steps are what it encodes (bounded like any rank's by its queue, so by how fast its trainer,
    which waits on the LLM ranks, takes them). The seats of one rank share each step's preparation.
    Raises JobError when a step takes over `prepare_timeout_s` (a stalled read) or loses more than
    `max_skipped_fraction` of its samples (the dataset is not what was indexed, or not reachable)."""
    prefetch_steps = config.prefetch_steps
    in_flight: collections.deque = collections.deque()  # (position, StepHold, future)
    owned = None  # the hold of a prepared step not yet in the queue
    pending = None  # (work, estimate) of the cursor's step when it could not be submitted yet
    working = None  # job.work of the cursor's step, under way (a loss-driven window's may wait for reports)
    try:
        while cursor is not None or in_flight:
            while cursor is not None and len(in_flight) < prefetch_steps:
                if pending is None:
                    if not in_flight:  # a live job's next step may not have formed yet
                        await job.wait_formed(*cursor)
                    elif job.live is not None and cursor[1] >= job.live.formed:
                        break  # deliver what is in preparation first; wait for this one then
                    if working is None:
                        # a sample needing more than the budget's working limit is skipped, not prepared
                        working = asyncio.ensure_future(asyncio.to_thread(job.work, cursor[0], cursor[1], seat,
                                                                          account.budget.working_limit))
                    if in_flight and not working.done():
                        await asyncio.wait({working, in_flight[0][2]}, return_when=asyncio.FIRST_COMPLETED)
                        if not working.done():  # deliver what is ready: its trainer's reports may be what this
                            break               # step's window waits for
                    work, working = await working, None
                    # room for the packs, and meanwhile for decoding the step's largest image (or tokenising its
                    # longest sample)
                    pending = work, job.dataset.estimate_bytes(work) + job.dataset.working_bytes(work)
                work, estimate = pending
                if not in_flight:
                    await account.reserve(estimate)  # nothing of ours in preparation: wait in line
                elif not account.try_reserve(estimate):
                    break  # no room to prefetch: deliver what is in preparation first (it frees room)
                pending = None
                key = ("encoder", seat.rank, *cursor) if seat.encoder else (seat.rank, *cursor)  # encoders: their own
                future, started = job.steps.take(key, lambda: pool.run(work))
                hold = StepHold(account, job.steps, key, estimate)
                if metrics is not None:
                    (metrics.steps_prepared if started else metrics.steps_shared).labels(job.spec.job).inc()
                in_flight.append((cursor, hold, future))
                cursor = await asyncio.to_thread(job.next_step, *cursor)
            position, hold, future = in_flight[0]
            try:
                result: RankStepResult = await asyncio.wait_for(asyncio.shield(future), config.prepare_timeout_s)
                result.attach()  # the worker's shared file, mapped: from here dropping the result frees it
            except asyncio.TimeoutError:
                raise JobError("UNAVAILABLE", f"step {position[0]}:{position[1]} of {seat.name} took "
                                              f"over {config.prepare_timeout_s:g} s to prepare (a stalled read?); "
                                              "retry, or use another server") from None
            except BrokenProcessPool:
                pool.restart()
                raise JobError("UNAVAILABLE", "a pre-processing worker died (out of memory?); the pool was "
                                              "restarted: retry") from None
            # still in flight: released if so
            check_skipped(result, position, seat.name, config.max_skipped_fraction)
            in_flight.popleft()
            owned = hold  # counted in the budget, not yet in the queue
            hold.resize(result.nbytes)
            await queue.put((position, result, hold))
            owned = hold = result = future = None  # the stream releases it once sent
        await queue.put(END)
    except asyncio.CancelledError:
        if working is not None:
            working.cancel()  # its thread finishes on its own; nothing waits for it
        release_all(in_flight, owned)
        raise
    except Exception as error:
        log.error("pack preparation failed", exc_info=not isinstance(error, JobError),
                  extra={"job": job.spec.job, "seat": seat.name, "error": str(error)})
        release_all(in_flight, owned)  # a step a worker finishes is discarded
        await queue.put(END)
        raise


def release_all(in_flight, owned: StepHold | None) -> None:
    """What a stopped pump holds: its steps in preparation (abandoned unless another replica holds them),
    a prepared one not yet queued, and their room in the budget."""
    for _, hold, _ in in_flight:
        hold.release()
    if owned is not None:
        owned.release()


def check_skipped(result: RankStepResult, position: tuple[int, int], who: str, tolerance: float) -> None:
    """A step that lost most of its samples is not trained on in silence: its stream fails with the reasons."""
    if result.samples and len(result.skipped) > tolerance * result.samples:
        reasons = sorted({reason for _, reason in result.skipped})
        raise JobError("FAILED_PRECONDITION", f"step {position[0]}:{position[1]} of {who}: {len(result.skipped)} "
                                              f"of {result.samples} samples skipped (max_skipped_fraction "
                                              f"{tolerance:g}), e.g. {reasons[:3]}; fix the dataset, or raise "
                                              "the tolerance")
