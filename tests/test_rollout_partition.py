"""A step's rollouts over the data-parallel ranks (`packfeed.server.plan.rollouts`, under verl's `balance_batch`
face): equal counts, every rollout once, groups whole where the trainer shares their prompt, the shared cost as a
group's members computed with the prompt once, and better balance than token-sum chunks on real lengths. verl's
own classes run the face in tests/benchmarks/test_bench_rl_balance.py (an environment of their own)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import LENGTH_FILES, real_lengths_available

from packfeed.server.plan.rollouts import Rollouts, partition_rollouts, rollout_costs
from packfeed.v1.options import CostModel

MODEL = CostModel(vision_linear=2.0, vision_quadratic=0.5, llm_linear=3.0, llm_quadratic=0.25)


def grpo_step(seed: int, prompts: int = 64, g: int = 8) -> Rollouts:
    rng = np.random.default_rng(seed)
    prompt = np.repeat(rng.integers(50, 2000, prompts), g)
    patches = np.repeat(rng.choice([0, 256, 1024, 4096], prompts).astype(np.float64), g)
    tokens = prompt + rng.integers(10, 1500, prompts * g)
    return Rollouts(tokens, prompt, patches, patches ** 2 / 4, np.repeat(np.arange(prompts), g))


@pytest.mark.parametrize("shared", [False, True])
def test_every_rank_gets_the_same_count_and_every_rollout_lands_once(shared):
    step = grpo_step(0)
    part = partition_rollouts(step, 8, MODEL, shared_prefix=shared)
    assert [len(r) for r in part.ranks] == [len(step) // 8] * 8
    assert sorted(part.order.tolist()) == list(range(len(step)))
    assert part.groups_whole
    owners = {int(step.group[i]): rank for rank, members in enumerate(part.ranks) for i in members}
    assert all(owners[int(step.group[i])] == rank for rank, members in enumerate(part.ranks) for i in members)
    assert partition_rollouts(step, 8, MODEL, shared_prefix=shared).order.tolist() == part.order.tolist()


def test_a_shared_group_costs_its_prompt_once():
    step = Rollouts(np.array([12, 15]), np.array([10, 10]), np.array([4.0, 4.0]), np.array([8.0, 8.0]),
                    np.array([0, 0]))
    _, (shared,) = rollout_costs(step, MODEL, True)[0:2]
    vision = 2.0 * 4 + 0.5 * 8  # the prompt's images, once
    llm = 3.0 * (10 + 2 + 5) + 0.25 * (10 ** 2 + (12 ** 2 - 10 ** 2) + (15 ** 2 - 10 ** 2))
    assert shared == pytest.approx(vision + llm)
    _, (alone,) = rollout_costs(step, MODEL, False)
    assert alone == pytest.approx(2 * vision + 3.0 * 27 + 0.25 * (12 ** 2 + 15 ** 2))


def test_groups_of_unequal_sizes_are_placed_rollout_by_rollout():
    step = grpo_step(1, prompts=16, g=4)
    ragged = Rollouts(step.tokens, step.prompt, step.vit_patches, step.vit_attn_sq,
                      np.where(np.arange(len(step)) < 6, 0, step.group))  # group 0 has 6 members, group 1 two
    part = partition_rollouts(ragged, 4, MODEL, shared_prefix=True)
    assert not part.groups_whole and [len(r) for r in part.ranks] == [16] * 4


def test_a_step_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="equal shares"):
        partition_rollouts(grpo_step(0, prompts=3, g=3), 2, MODEL)


@pytest.mark.skipif(not real_lengths_available(), reason="the real InternVL length files are not here")
def test_on_real_prompts_it_balances_better_than_token_sum_chunks():
    records = [r for path in LENGTH_FILES for r in json.loads(path.read_text())]
    vision = np.array([r["vit_num"] for r in records])
    tokens = np.array([r["token_num"] for r in records])
    rng = np.random.default_rng(3)
    prompts = rng.choice(len(vision), 256, replace=False)
    prompt = np.repeat(tokens[prompts], 8)
    patches = np.repeat(vision[prompts], 8).astype(np.float64) * 1024
    step = Rollouts(prompt + rng.integers(100, 4096, 2048), prompt, patches, patches * 1024)
    model = CostModel.from_shapes()
    ours = partition_rollouts(step, 8, model)
    # token sums balanced by LPT with equal counts, then costed on the same model
    from packfeed.server.plan.balance import lpt_assign

    bins = lpt_assign(step.tokens.astype(np.float64), 8, len(step) // 8)
    _, cost = rollout_costs(step, model, False)
    sums = np.bincount(bins, cost, 8)
    assert ours.dist < sums.max() / sums.mean() - 1
