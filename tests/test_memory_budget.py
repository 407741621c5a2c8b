"""The shared memory budget of a loader server: strict, fair, never stuck; and its estimates from the index."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from packfeed.server.serve.budget import MemoryBudget, StepHold
from packfeed.v1.layout import Seat


def run(coroutine):
    return asyncio.run(coroutine)


async def ask(order: list, name: str, account, nbytes: int) -> None:
    """Reserve, then note the name: the order in which requests were granted."""
    await account.reserve(nbytes)
    order.append(name)


def test_requests_wait_their_turn_and_never_exceed_the_limit():
    async def scenario():
        budget = MemoryBudget(100)
        holder, first, second = budget.account(), budget.account(), budget.account()
        await holder.reserve(60)
        await first.reserve(5)
        await second.reserve(5)
        order = []
        big = asyncio.create_task(ask(order, "big", first, 70))
        small = asyncio.create_task(ask(order, "small", second, 10))
        await asyncio.sleep(0.01)
        assert order == [] and budget.held == 70  # small would fit, but big asked first: arrival order
        holder.release(60)
        await asyncio.sleep(0.01)
        assert order == ["big", "small"] and budget.held == 90
        await asyncio.gather(big, small)

    run(scenario())


def test_the_stream_holding_least_goes_first():
    """Among waiting requests, the stream holding fewer bytes is granted first, whatever their arrival order:
    a stream that holds much never keeps one that holds little waiting."""
    async def scenario():
        budget = MemoryBudget(100)
        greedy, modest = budget.account(), budget.account()
        await greedy.reserve(80)
        await modest.reserve(10)
        order = []
        asks = [asyncio.create_task(ask(order, name, account, 15)) for name, account in (("greedy", greedy),
                                                                                       ("modest", modest))]
        await asyncio.sleep(0.01)
        assert order == []
        greedy.release(10)
        await asyncio.sleep(0.01)
        assert order == ["modest"]  # 95 held: the greedy stream's 15 waits for room
        modest.release(25)
        await asyncio.gather(*asks)
        assert order == ["modest", "greedy"] and budget.held == 85

    run(scenario())


def test_a_stream_holding_nothing_never_waits_on_another():
    """A stream whose step is larger than the budget, or that arrives while another holds all of it, is granted
    its one step at once: memory stays within the limit plus one step per stream, and no stream waits on
    room that another (stalled) stream holds."""
    async def scenario():
        budget = MemoryBudget(100)
        stalled, other = budget.account(), budget.account()
        await stalled.reserve(250)
        await asyncio.wait_for(other.reserve(30), 1)
        assert budget.held == 280
        waiting = asyncio.create_task(other.reserve(1))  # a second step of its own waits for room
        await asyncio.sleep(0.01)
        assert not waiting.done()
        stalled.release(250)
        await asyncio.wait_for(waiting, 1)
        assert budget.held == 31

    run(scenario())


def test_a_stream_above_its_share_sheds_while_others_wait():
    """A request that must wait asks every stream above its fair share (limit / streams) to shed; a stream
    that declines keeps its bytes, one that sheds frees room for the waiting request."""
    async def scenario():
        budget = MemoryBudget(100)
        asked = []

        def shed_all():
            asked.append("stalled")
            stalled.release(stalled.held - 20)  # keeps the step its client is receiving

        stalled = budget.account(shed_all)
        declining = budget.account(lambda: asked.append("declining"))
        waiting_one = budget.account()
        await stalled.reserve(20)
        assert stalled.try_reserve(60)
        await waiting_one.reserve(10)
        await asyncio.wait_for(waiting_one.reserve(30), 1)  # 110 would not fit: the stalled stream shed 60
        assert asked == ["stalled"] and budget.held == 60
        await declining.reserve(10)
        assert declining.try_reserve(30)  # 100 held, declining holds 40 > 100 / 3
        pending = asyncio.create_task(waiting_one.reserve(5))
        await asyncio.sleep(0.01)
        assert asked == ["stalled", "declining"] and not pending.done()  # it declined: the request waits
        declining.release(40)
        await asyncio.wait_for(pending, 1)
        assert budget.held == 65

    run(scenario())


def test_a_cancelled_waiter_holds_nothing_and_blocks_no_one():
    async def scenario():
        budget = MemoryBudget(100)
        holder, first, second = budget.account(), budget.account(), budget.account()
        await holder.reserve(85)
        await first.reserve(1)
        await second.reserve(1)
        stalled = asyncio.create_task(first.reserve(50))
        behind = asyncio.create_task(second.reserve(5))
        await asyncio.sleep(0.01)
        assert not behind.done()
        stalled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stalled
        holder.adjust(-1)  # any change re-checks the queue: the request behind the cancelled one fits
        await asyncio.wait_for(behind, 1)
        assert budget.held == 91

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
            work = job.work(0, step, Seat(rank))
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
        account = budget.account()
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(RankStepResult(messages=[], samples=0))
        for _ in range(2):  # two replicas take the same step
            steps.take((0, 0, 0), lambda: ready)
            await account.reserve(30)
        first, second = StepHold(account, steps, (0, 0, 0), 30), StepHold(account, steps, (0, 0, 0), 30)
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
