"""The actor update of GRPO balanced five ways (issue [5/6]), on a GRPO-shaped mix, in the same run.

Run: make verl-env (once: builds verl's environment, minutes), then
.venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_rl_balance.py -m benchmark

verl pins transformers below 5.11, under the project's `hf` extra, so it runs in an environment of its own
(tests/verl_env.py says what it holds). There tests/benchmarks/verl_balance.py runs verl's own `RayPPOTrainer._balance_batch` on verl
`DataProto`s (plain, and with `use_prefix_grouper`), and Packfeed's `packfeed.cli.verl_batches.balance_batch`
(checked there as a DataProto in, DataProto out call).

The mix ([4/6]'s): real prompts of the two InternVL-1.2M length files (their tokens and 448-px tiles, each tile
1,024 ViT patches attended within itself), G = 8 responses each, log-normal (median 600 tokens) clipped to
100-4,096. A step: 512 prompts (4,096 rollouts), drawn without replacement; 8 steps a round, 3 rounds.

Per method, the ranks' work on Packfeed's cost model (InternVL-Chat-1.5's FLOPs: ViT and LLM, attention squares
included): each rank's rollouts whole, except where the trainer computes a group's prompt once (verl's prefix
grouper, Packfeed with groups: its images and tokens once per group on a rank). Reported: Dist (the busiest rank
over the mean, minus 1), the simulated actor-update step (the busiest rank's FLOPs at 400 TFLOP/s), and padding
(the padded path's: each rank's rollouts in micro-batches of 8, padded to their longest; Packfeed's packs are
not padded). Methods: none (verl's chunks in generation order), verl's balance_batch, LPT on response tokens with
equal counts (UniRL), Packfeed without groups, Packfeed with groups.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import real_lengths_available
from test_bench_phases import internvl_lengths

from verl_env import built_python

from packfeed.server.plan.balance import lpt_assign
from packfeed.server.plan.rollouts import Rollouts, rollout_costs
from packfeed.v1.options import CostModel

pytestmark = pytest.mark.benchmark
G, PROMPTS, STEPS, ROUNDS = 8, 512, 8, 3
TILE_PATCHES, MICROBATCH, FLOPS = 1024, 8, 400e12
def grpo_steps(seed: int) -> list[dict]:
    """STEPS steps of PROMPTS real prompts each, G drawn responses each, in generation order (a prompt's G
    responses together, as verl's rollout leaves them)."""
    rng = np.random.default_rng(seed)
    vision, tokens = internvl_lengths()
    order = rng.permutation(len(vision))
    steps = []
    for k in range(STEPS):
        prompts = order[k * PROMPTS:(k + 1) * PROMPTS]
        responses = np.clip(rng.lognormal(np.log(600), 1.0, (PROMPTS, G)), 100, 4096).astype(np.int64)
        prompt = np.repeat(tokens[prompts], G)
        tiles = np.repeat(vision[prompts], G)
        steps.append({"tokens": prompt + responses.reshape(-1), "prompt": prompt, "tiles": tiles,
                      "uid": np.repeat(np.array([f"p{p}" for p in prompts]), G)})
    return steps


def rollouts(step: dict, groups: bool) -> Rollouts:
    patches = step["tiles"].astype(np.float64) * TILE_PATCHES
    group = np.unique(step["uid"], return_inverse=True)[1] if groups else None
    return Rollouts(step["tokens"], step["prompt"], patches, patches * TILE_PATCHES, group)


def rank_costs(step: dict, order: list[int], dp: int, shared: bool, model: CostModel) -> np.ndarray:
    """Each rank's FLOPs for its equal chunk of `order` (its groups' prompts once where `shared`)."""
    chunks = np.asarray(order).reshape(dp, -1)
    costs = []
    for chunk in chunks:
        part = {name: values[chunk] for name, values in step.items()}
        _, cost = rollout_costs(rollouts(part, shared), model, shared)
        costs.append(cost.sum())
    return np.asarray(costs)


def padding(step: dict, order: list[int], dp: int) -> float:
    """Padded tokens over all, each rank's chunk in micro-batches of MICROBATCH padded to their longest."""
    tokens = step["tokens"][np.asarray(order)].reshape(dp, -1, MICROBATCH)
    padded = tokens.max(axis=2, keepdims=True) * np.ones_like(tokens)
    return float(1 - tokens.sum() / padded.sum())


def lpt_order(step: dict, dp: int) -> list[int]:
    """UniRL's balancing: greedy LPT on response tokens, the same count on each rank."""
    bins = lpt_assign((step["tokens"] - step["prompt"]).astype(np.float64), dp, len(step["tokens"]) // dp)
    return [i for rank in range(dp) for i in np.flatnonzero(bins == rank)]


@pytest.mark.skipif(not real_lengths_available(), reason="the real InternVL length files are not here")
def test_actor_update_balanced_five_ways(tmp_path):
    python = built_python()
    if python is None:
        pytest.skip("verl's environment is not built: run `make verl-env` first (minutes, once)")
    model = CostModel.from_shapes()
    methods = ["none", "verl", "lpt_response", "packfeed", "verl_prefix_grouper", "packfeed_groups"]
    shared = {"verl_prefix_grouper", "packfeed_groups"}
    for dp in (8, 64):
        table = {m: {"dist": [], "step_s": [], "padding": []} for m in methods}
        for round_ in range(ROUNDS):
            steps = grpo_steps(round_)
            arrays = {"count": len(steps)}
            for k, step in enumerate(steps):
                grids = np.empty(len(step["tiles"]), dtype=object)  # each rollout's tiles as Qwen-style grids
                grids[:] = [[[1, 32, 32]] * int(t) for t in step["tiles"]]
                arrays.update({f"tokens{k}": step["tokens"], f"prompt{k}": step["prompt"], f"uid{k}": step["uid"],
                               f"grids{k}": grids})
            np.savez(tmp_path / "steps.npz", **arrays)
            subprocess.run([str(python), str(Path(__file__).with_name("verl_balance.py")), str(tmp_path / "steps.npz"),
                            str(dp), str(tmp_path / "orders.json")], check=True, cwd=tmp_path)
            orders = json.loads((tmp_path / "orders.json").read_text())
            for step, order in zip(steps, orders):
                order["none"] = list(range(len(step["tokens"])))
                order["lpt_response"] = lpt_order(step, dp)
                for m in methods:
                    costs = rank_costs(step, order[m], dp, m in shared, model)
                    table[m]["dist"].append(costs.max() / costs.mean() - 1)
                    table[m]["step_s"].append(costs.max() / FLOPS)
                    table[m]["padding"].append(0.0 if m.startswith("packfeed") else padding(step, order[m], dp))
        print(f"\nDP {dp}: {PROMPTS} prompts x G {G} a step, {STEPS} steps x {ROUNDS} rounds; median (range)")
        for m in methods:
            def stat(name, fmt):
                values = table[m][name]
                return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"

            print(f"  {m:>20}: Dist {stat('dist', '{:.3f}')}, step {stat('step_s', '{:.2f}')} s, "
                  f"padding {stat('padding', '{:.3f}')}")
        verl_step = statistics.median(table["verl"]["step_s"])
        ours = statistics.median(table["packfeed_groups"]["step_s"])
        print(f"  Packfeed with groups vs verl's balance_batch: {verl_step / ours:.2f}x faster step")
        assert statistics.median(table["packfeed"]["dist"]) <= statistics.median(table["verl"]["dist"])
        assert ours < verl_step
