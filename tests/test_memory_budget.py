"""The shared memory budget of a loader server: strict, fair, never stuck; and its estimates from the index."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from packfeed.server.serve.budget import MemoryBudget, StepHold


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
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.v1.options import PlanConfig

    source = step_work.DatasetSource(str(index), str(tokenizer))
    name = str(index)  # the worker's cache of opened datasets is by name: one per index
    worker_process.init_worker({name: source})
    dataset = Dataset.open(name, source)
    job = JobRegistry({name: dataset}).open_job(JobSpec("estimate", name, PlanConfig(dp=2, microbatches=microbatches),
                                                        0))
    ratios = []
    for step in range(job.epoch_plan(0).n_steps):
        for rank in range(2):
            work = job.work(0, step, rank)
            if any(len(members) for members, _, _ in work.packs):
                ratios.append(worker_process.build_rank_step(work).nbytes / dataset.estimate_bytes(work))
    return ratios


def test_a_step_hold_releases_its_room_and_its_shared_step_once():
    """Whoever releases a prepared step (the stream, a stopped producer, a cancelled stream's drain) releases it
    once: its room in the budget and its reference among the job's shared steps, however often it is asked."""
    from packfeed.server.serve.step_work import RankStepResult
    from packfeed.server.serve.workers import SharedSteps

    async def scenario():
        budget, steps = MemoryBudget(100), SharedSteps()
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(RankStepResult(messages=[], samples=0))
        for _ in range(2):  # two replicas take the same step
            steps.take((0, 0, 0), lambda: ready)
            await budget.reserve(30)
        first, second = StepHold(budget, steps, (0, 0, 0), 30), StepHold(budget, steps, (0, 0, 0), 30)
        first.resize(40)
        assert budget.held == 70
        first.release()
        first.release()
        assert budget.held == 30 and (0, 0, 0) in steps._steps  # the other replica still holds the step
        with second:
            pass
        second.release()
        assert budget.held == 0 and (0, 0, 0) not in steps._steps
        second.resize(50)  # a released hold changes nothing any more
        assert budget.held == 0

    asyncio.run(scenario())


def test_estimates_from_the_index_match_prepared_packs(small_tile_index):
    """Reservations are made before preparation; they should be close to what the workers produce."""
    from packfeed.server.index.table import read_index_info

    ratios = estimate_ratios(small_tile_index, read_index_info(small_tile_index).tokenizer["path"])
    assert 0.8 < np.median(ratios) < 1.2 and max(ratios) < 1.5, ratios
