"""The shared memory budget of a loader server: strict, fair, never stuck; and its estimates from the index."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from packfeed.server.serve.budget import MemoryBudget


def run(coroutine):
    return asyncio.run(coroutine)


def test_requests_wait_their_turn_and_never_exceed_the_limit():
    async def scenario():
        budget = MemoryBudget(100)
        await budget.reserve(60)
        order = []

        async def ask(name, nbytes):
            await budget.reserve(nbytes)
            order.append(name)

        big, small = asyncio.create_task(ask("big", 70)), asyncio.create_task(ask("small", 10))
        await asyncio.sleep(0.01)
        assert order == [] and budget.held == 60  # small would fit, but big asked first: arrival order
        budget.release(60)
        await asyncio.sleep(0.01)
        assert order == ["big", "small"] and budget.held == 80
        await asyncio.gather(big, small)

    run(scenario())


def test_a_step_larger_than_the_budget_goes_out_alone():
    async def scenario():
        budget = MemoryBudget(100)
        await budget.reserve(250)  # nothing else held: granted, or that stream could never progress
        waiting = asyncio.create_task(budget.reserve(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        budget.release(250)
        await asyncio.wait_for(waiting, 1)
        assert budget.held == 1

    run(scenario())


def test_a_cancelled_waiter_holds_nothing_and_blocks_no_one():
    async def scenario():
        budget = MemoryBudget(100)
        await budget.reserve(90)
        stalled = asyncio.create_task(budget.reserve(50))
        behind = asyncio.create_task(budget.reserve(5))
        await asyncio.sleep(0.01)
        stalled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stalled
        budget.adjust(-1)  # any change re-checks the queue: the request behind the cancelled one fits
        await asyncio.wait_for(behind, 1)
        assert budget.held == 94

    run(scenario())


def estimate_ratios(index, tokenizer, microbatches: int = 2) -> list[float]:
    """Prepared bytes / reserved estimate of every non-empty rank-step of an epoch at DP 2."""
    from packfeed.server.serve import step_work, worker_process
    from packfeed.server.serve.jobs import Dataset, JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.v1.options import PlanConfig

    source = step_work.DatasetSource(str(index), str(tokenizer))
    name = str(index)  # the worker's cache of opened datasets is by name: one per index
    worker_process.init_worker({name: source})
    dataset = Dataset.open(name, source)
    job = JobRegistry({name: dataset}).open_job(JobSpec("estimate", name, PlanConfig(dp=2, microbatches=microbatches),
                                                        0))
    ratios = []
    for step in range(job.plan(0).n_steps):
        for rank in range(2):
            work = job.work(0, step, rank)
            if any(len(members) for members, _, _ in work.packs):
                ratios.append(worker_process.build_rank_step(work).nbytes / dataset.estimate_bytes(work))
    return ratios


def test_estimates_from_the_index_match_prepared_packs(small_tile_index):
    """Reservations are made before preparation; they should be close to what the workers produce."""
    from packfeed.server.index.table import read_index_info

    ratios = estimate_ratios(small_tile_index, read_index_info(small_tile_index).tokenizer["path"])
    assert 0.8 < np.median(ratios) < 1.2 and max(ratios) < 1.5, ratios
