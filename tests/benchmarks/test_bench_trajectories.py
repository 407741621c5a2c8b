"""Trees of trajectories computed once (issue [5/6]): an agentic mix planned and simulated three ways in the same
run: as trees (every shared turn once), with one-level sharing (each group's prompt once: today's GRPO groups),
and each trajectory alone.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_trajectories.py -m benchmark

The mix, from the two InternVL-1.2M length files: 8-turn trajectories (observation, action, x4), each observation
a real record (its tokens and image tiles: a screenshot), each action log-normal (median 120 tokens, 16-1,024);
one task per tree, forking 4 ways at two depths (16 trajectories a tree): at turns 2 and 6, and at turns 4 and 6.
The plans are Packfeed's (isf+balance, caps searched on the trajectories alone, the same for all three), the
step time the simulator's (internvl-chat-1.5 preset, PP 4, M 8) at DP 8 and DP 64; median and range over 3
rounds (different draws). Then the reference trainer's step on CPU on one tree's pack laid out the three ways,
its trajectories' log-probabilities compared with each alone.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from conftest import real_lengths_available
from test_bench_phases import internvl_lengths

pytestmark = pytest.mark.benchmark
ROUNDS = 3
TREES = 1500
FORKS = 4
TURNS = 8


def tree_mix(seed: int, depths: tuple[int, int]):
    """(loads as trees, loads with one-level sharing, loads alone) of TREES trees of FORKS x FORKS trajectories."""
    from packfeed.server.plan.costs import SampleLoads

    rng = np.random.default_rng(seed)
    vision, tokens = internvl_lengths()
    first, second = depths
    rows = []  # (tokens, vision, parent, shared tokens, shared vision, prompt tokens, prompt vision, tree)

    def turns(n: int):
        """n turns alternating observation (a real record) and action: their (tokens, vision) each."""
        out = []
        for k in range(n):
            if k % 2 == 0:
                record = int(rng.integers(len(vision)))
                out.append((int(tokens[record]), int(vision[record])))
            else:
                out.append((int(np.clip(rng.lognormal(np.log(120), 0.8), 16, 1024)), 0))
        return out

    for tree in range(TREES):
        trunk = turns(first)
        branches = [turns(second - first) for _ in range(FORKS)]
        for b, branch in enumerate(branches):
            for leaf in range(FORKS):
                path = trunk + branch + turns(TURNS - second)
                t, v = sum(x for x, _ in path), sum(y for _, y in path)
                root = len(rows) - b * FORKS - leaf
                if b == 0 and leaf == 0:
                    parent, shared = -1, trunk[:0]
                elif leaf == 0:
                    parent, shared = root, trunk
                else:
                    parent, shared = len(rows) - leaf, trunk + branch
                rows.append((t, v, parent, sum(x for x, _ in shared), sum(y for _, y in shared), trunk[0][0],
                             trunk[0][1], tree))
    table = np.array(rows, np.int64)
    t, v, parent, shares, shared_vision, prompt, prompt_vision, tree = table.T

    def loads():
        out = SampleLoads.from_arrays(v, t)
        out.group = tree.copy()
        return out

    as_trees = loads()
    as_trees.parent, as_trees.prefix, as_trees.shared_vision = parent, shares.astype(np.int32), \
        shared_vision.astype(np.int32)
    one_level = loads()  # every trajectory of a tree continues its first for the prompt (turn 0) only
    first_of = np.searchsorted(tree, tree)
    one_level.parent = np.where(first_of != np.arange(len(t)), first_of, -1)
    one_level.prefix = np.where(one_level.parent >= 0, prompt, 0).astype(np.int32)
    one_level.shared_vision = np.where(one_level.parent >= 0, prompt_vision, 0).astype(np.int32)
    alone = SampleLoads.from_arrays(v, t)
    return as_trees, one_level, alone


def simulated(loads, dp: int, caps) -> dict:
    from dataclasses import replace

    from packfeed.cli.simulate_data import shared_of
    from packfeed.server.plan.planner import make_plan
    from packfeed.trainer.simulate.cluster import Cluster
    from packfeed.trainer.simulate.model_shape import load_model
    from packfeed.trainer.simulate.predict import Settings, simulate_plan
    from packfeed.trainer.simulate.workload import TILES, TOKENS, planner_cost_model, workload_of
    from packfeed.v1.options import PlanConfig

    table, shape = load_model("internvl-chat-1.5")
    patches = shape.patches_per_tile
    config = PlanConfig(dp=dp, microbatches=8, pipeline_stages=4, cost_model=planner_cost_model(table, patches),
                        token_cap=caps.token_cap, vision_cap=caps.vision_cap)
    plan = make_plan(loads, config, 0, 0)
    saved, _ = shared_of(plan, loads)
    workload = workload_of(plan.offsets, plan.members, loads.vision, loads.tokens, config, patches, "isf+balance",
                           saved)
    prediction = simulate_plan(workload, table, Cluster(dp * 4), Settings("stages", 4), None)
    return {"tokens": int(workload.useful[..., TOKENS].sum()), "vision": int(workload.useful[..., TILES].sum()),
            "step_s": prediction.step_s, "epoch_s": prediction.epoch_s, "steps": prediction.steps}


@pytest.mark.skipif(not real_lengths_available(), reason="the real InternVL length files are not here")
@pytest.mark.parametrize("depths", [(4, 6), (2, 6)])
def test_trees_against_one_level_sharing_and_each_alone(depths):
    from packfeed.server.plan.caps import resolve_caps
    from packfeed.v1.options import PlanConfig

    results: dict[int, dict[str, list[dict]]] = {8: {}, 64: {}}
    for round_ in range(ROUNDS):
        mixes = dict(zip(("tree", "one-level", "alone"), tree_mix(round_, depths)))
        caps = resolve_caps(mixes["alone"], PlanConfig(dp=8, microbatches=8, pipeline_stages=4))
        for dp in results:
            for label, loads in mixes.items():
                results[dp].setdefault(label, []).append(simulated(loads, dp, caps))
    print(f"\n{TREES} trees x {FORKS * FORKS} trajectories of {TURNS} turns, forks of {FORKS} at turns {depths}:")
    for dp, by_label in results.items():
        print(f"DP {dp}, PP 4, M 8, internvl-chat-1.5:")
        for label, rounds in by_label.items():
            def stat(name, scale=1.0):
                values = [r[name] / scale for r in rounds]
                return f"{statistics.median(values):,.3f} ({min(values):,.3f}-{max(values):,.3f})"
            print(f"  {label:>9}: LLM tokens {stat('tokens', 1e6)} M, vision units {stat('vision', 1e3)} k, steps "
                  f"{stat('steps')}, step {stat('step_s')} s, epoch {stat('epoch_s')} s")
        ratio = [o["tokens"] / t["tokens"] for o, t in zip(by_label["one-level"], by_label["tree"])]
        print(f"  one-level / tree LLM tokens: {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})")
        for tree, one, alone in zip(by_label["tree"], by_label["one-level"], by_label["alone"]):
            assert tree["tokens"] < one["tokens"] < alone["tokens"] and tree["vision"] < one["vision"]


# -- the trainer's step on CPU ------------------------------------------------------------------------------------

CPU_MODEL = {"vit_dim": 48, "vit_layers": 2, "llm_dim": 96, "llm_layers": 3, "patch_size": 14, "seed": 0}


def test_the_trainers_step_on_cpu_on_a_tree_one_level_and_alone(tmp_path):
    """The reference trainer's step (forward and backward, `microbatches_of` and the model as `packfeed train`
    runs a microbatch) on one tree of tests/trajectory_data.py's trajectories (six turns, images at turns 0, 2
    and 4, forks at two depths; the internvl family's tiny tiles) laid out as a tree, with one-level sharing
    (every trajectory's parent its tree's root, sharing turn 0) and each trajectory alone (`unshared`): median
    and range of per-step seconds over 5 rounds, alternating; the tree's log-probabilities against each alone."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from hf_models import family_dataset
    from trajectory_data import tree_of_turns, tree_packs

    from packfeed.client.model.losses import sample_logprobs
    from packfeed.client.model.shared_prefix import shared, unshared
    from packfeed.trainer.models.reference import VLMConfig, build_layers, run_layers, sized_model
    from packfeed.trainer.models.reference_inputs import microbatches_of

    data = family_dataset(tmp_path, "internvl")
    config = sized_model(VLMConfig(**CPU_MODEL), data.conventions)
    layers = build_layers(config)
    trajectories = tree_of_turns(data, seed=0)
    wire, _ = tree_packs(trajectories)
    rows = wire.shared_prefix.view(-1, 2).clone()
    first_turn = [len(t.turns[0].ids) for t in trajectories]
    one_level_rows = [[0, first_turn[k]] if t.parent >= 0 else [k, 0] for k, t in enumerate(trajectories)]
    from trajectory_data import concatenated

    one_level = concatenated(trajectories, [first_turn[k] if t.parent >= 0 else 0 for k, t in enumerate(trajectories)],
                             wire.step_loss_tokens, one_level_rows)
    layouts = {"tree": wire, "one-level": one_level, "alone": unshared(wire)}
    assert rows.numel()

    def step(pack) -> float:
        from types import SimpleNamespace

        started = time.perf_counter()
        batch = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
        layers.zero_grad(set_to_none=True)
        loss = layers[-1](*run_layers(layers[:-1], microbatches_of(batch, config, token_multiple=1).args))[0]
        loss.backward()
        return time.perf_counter() - started

    times: dict[str, list[float]] = {label: [] for label in layouts}
    for _ in range(5):
        for label, pack in layouts.items():
            times[label].append(step(pack))
    print()
    for label, pack in layouts.items():
        rows_computed = int(shared(pack).input_ids.numel())
        print(f"  {label:>9}: {rows_computed} LLM rows, {int(shared(pack).tile_shapes.shape[0])} tiles, step "
              f"{statistics.median(times[label]) * 1e3:.1f} ms ({min(times[label]) * 1e3:.1f}-"
              f"{max(times[label]) * 1e3:.1f})")

    def logprobs(pack):
        from types import SimpleNamespace

        batch = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
        with torch.no_grad():
            hidden = run_layers(layers[:-1], microbatches_of(batch, config, token_multiple=1).args)
            logits = layers[-1].out(layers[-1].norm(hidden[0]))[:int(shared(pack).input_ids.numel())]
        return sample_logprobs(logits, pack, shared_prefix=True)

    tree_logp, mask = logprobs(wire)
    alone_logp, alone_mask = logprobs(layouts["alone"])
    assert torch.equal(mask, alone_mask)
    difference = float((tree_logp - alone_logp).abs()[mask].max())
    print(f"  largest difference of a trained token's log-probability, tree vs alone: {difference:.2e}")
    assert difference < 1e-5
