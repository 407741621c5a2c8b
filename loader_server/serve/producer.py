"""One rank stream's producer: keeps up to `prefetch_steps` of the rank's steps being prepared in the worker
pool, each within the shared memory budget, and puts them in order into the stream's bounded queue.

A slow consumer fills its own queue and so stops its own producer: it never holds the pool or grows memory.
Room for a step is reserved when it is submitted (estimated from the index) and corrected once it is ready;
the stream releases it once gRPC has taken the step's bytes.
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import Executor

from packfeed.server.serve.budget import MemoryBudget
from packfeed.server.serve.jobs import Job
from packfeed.server.serve.observe import log
from packfeed.server.serve.workers import RankStepResult, build_rank_step

END = None  # put in the queue after the job's last step (or after a failure)


async def produce(job: Job, rank: int, cursor: tuple[int, int] | None, queue: asyncio.Queue, pool: Executor,
                  budget: MemoryBudget, prefetch_steps: int) -> None:
    """Put ((epoch, step), RankStepResult) for every step from `cursor` to the end of the job, then END."""
    loop = asyncio.get_running_loop()
    in_flight: collections.deque = collections.deque()  # (position, reserved bytes, future)
    owned = 0  # bytes of a prepared step counted in the budget but not yet in the queue
    pending = None  # (work, estimate) of the cursor's step when it could not be submitted yet
    try:
        while cursor is not None or in_flight:
            while cursor is not None and len(in_flight) < prefetch_steps:
                if pending is None:
                    work = await asyncio.to_thread(job.work, cursor[0], cursor[1], rank)
                    pending = work, job.dataset.estimate_bytes(work)
                work, estimate = pending
                if not in_flight:
                    await budget.reserve(estimate)  # nothing of ours in preparation: wait in line
                elif not budget.try_reserve(estimate):
                    break  # no room to prefetch: deliver what is in preparation first (it frees room)
                pending = None
                in_flight.append((cursor, estimate, loop.run_in_executor(pool, build_rank_step, work)))
                cursor = await asyncio.to_thread(job.next_step, *cursor)
            position, estimate, future = in_flight[0]
            result: RankStepResult = await future
            in_flight.popleft()
            budget.adjust(result.nbytes - estimate)
            owned = result.nbytes  # counted in the budget, not yet in the queue
            await queue.put((position, result))
            owned, result, future = 0, None, None  # the stream frees it once sent: keep no reference here
        await queue.put(END)
    except asyncio.CancelledError:
        for _, estimate, future in in_flight:
            future.cancel()
            budget.release(estimate)
        budget.release(owned)
        raise
    except Exception:
        log.exception("pack preparation failed", extra={"job": job.spec.job, "rank": rank})
        for _, estimate, _ in in_flight:
            budget.release(estimate)
        await queue.put(END)
        raise
