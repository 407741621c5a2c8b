"""Every phase balanced on its own (OrchMLLM): `isf+phases` against `isf+balance`.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_phases.py -m benchmark

1. Plans (in process, the planner's own cost model: InternViT-6B + InternLM2-20B FLOPs), on the two InternVL-1.2M
   length files (30,730 samples) and on an incoherent mix built from them (the same files plus a quarter of
   text-only conversations and 5% many-tile documents), DP 8 and DP 64, M 4, 8 ranks per node:
   - each phase's Dist of its cost on its own assignment, against the joint plan (`isf+balance`, every sample
     encoded where it trains) and the same packs encoded colocated;
   - planning time (median and spread of 5 rounds after a warm-up, each strategy in the same run);
   - the all-to-all per step: vision units (and bytes: 256 LLM tokens x 6,144 x bf16 per tile, InternLM2-20B's
     input) moved naive (the balanced bins left on the ranks LPT numbered them) and solved (routed), the share
     that crosses nodes, and the lower bound on it.
2. The reference trainer on CPU (`packfeed train --nproc 4`, DP 4, pp 1, M 4, 200 demo samples, 3 epochs): step time with
   the encoder routed (all-to-all) against the same plan encoded colocated, alternating, 3 runs each.
3. `packfeed simulate` at cluster scale (InternVL-Chat-1.5 on 512 GPUs: DP 64 x TP 8, pp 1, M 4) for both, and
   for isf+balance.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest
from conftest import LENGTH_FILES, real_lengths_available
from demo_data import indexed_demo
from test_bench_simulate import MODEL, POLICY, simulate  # the simulator benchmark's model, data and command
from trainer_workers import packfeed_train

pytestmark = pytest.mark.benchmark

TILE_BYTES = 256 * 6144 * 2  # one tile's encoder output as the LLM takes it (InternLM2-20B, bf16)


def internvl_lengths() -> tuple[np.ndarray, np.ndarray]:
    vision, tokens = [], []
    for path in LENGTH_FILES:
        for record in json.loads(path.read_text()):
            vision.append(record["vit_num"])
            tokens.append(record["token_num"])
    return np.asarray(vision, np.int64), np.asarray(tokens, np.int64)


def incoherent_mix(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The InternVL files, plus text-only conversations making a quarter of the whole (lognormal text, median
    350 tokens) and many-tile documents making 5% (9-24 tiles, 256 tokens each plus lognormal text)."""
    rng = np.random.default_rng(seed)
    vision, tokens = internvl_lengths()
    real = len(vision)
    text = int(real / 0.7 * 0.25)
    documents = int(real / 0.7 * 0.05)
    text_tokens = np.clip(rng.lognormal(np.log(350), 1.0, text), 16, 8192).astype(np.int64)
    doc_tiles = rng.integers(9, 25, documents)
    doc_tokens = 256 * doc_tiles + np.clip(rng.lognormal(np.log(400), 0.8, documents), 16, 4096).astype(np.int64)
    order = rng.permutation(real + text + documents)
    vision = np.concatenate([vision, np.zeros(text, np.int64), doc_tiles])[order]
    tokens = np.concatenate([tokens, text_tokens, doc_tokens])[order]
    return vision, tokens


def cost_dists(plan, loads, config) -> tuple[float, float]:
    """(vision cost Dist, LLM cost Dist) of a plan with every sample encoded where its pack trains."""
    from packfeed.server.plan.costs import sample_costs
    from packfeed.server.plan.metrics import dist_ratio

    costs = sample_costs(config.cost_model, loads)
    sizes = np.diff(plan.offsets)
    pack = np.repeat(np.arange(len(sizes)), sizes)
    step, rank = pack // config.slots, (pack // config.microbatches) % config.dp
    out = []
    for column in (0, 1):
        per_rank = np.zeros((plan.n_steps, config.dp))
        np.add.at(per_rank, (step, rank), costs[plan.members, column].astype(np.float64))
        out.append(dist_ratio(per_rank))
    return out[0], out[1]


def whole_tile_floor(plan, loads, dp: int) -> float:
    """The least vision Dist any assignment of whole tiles gives each step (a tile is one ViT sequence, the
    encoder's unit of work): a step of T = k dp + r tiles leaves dp - r ranks a tile short of the busiest."""
    sizes = np.diff(plan.offsets)
    step = np.repeat(np.arange(len(sizes)), sizes) // plan.config.slots
    totals = np.bincount(step, loads.vision[plan.members].astype(np.float64), minlength=plan.n_steps).astype(np.int64)
    k, r = totals // dp, totals % dp
    busy = totals > 0
    waste = np.where(r > 0, (dp - r) / (dp * (k + 1.0)), 0.0)
    return float(waste[busy].mean()) if busy.any() else 0.0


def timed_plans(loads, config, rounds: int = 3):
    from packfeed.server.plan.planner import make_plan

    make_plan(loads, config, seed=0, epoch=0)  # warm-up: caches, kernels
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        plan = make_plan(loads, config, seed=0, epoch=0)
        seconds.append(time.perf_counter() - started)
    return plan, seconds


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
@pytest.mark.parametrize("dataset", ["internvl", "incoherent"])
def test_each_phase_balanced_on_its_own(dataset):
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.v1.options import PlanConfig

    vision, tokens = internvl_lengths() if dataset == "internvl" else incoherent_mix()
    loads = SampleLoads.from_arrays(vision, tokens)
    print(f"\n[phases] {dataset}: {len(vision):,} samples, {int((vision == 0).sum()):,} text-only, "
          f"{int((vision >= 9).sum()):,} with 9+ tiles")
    print("[phases] DP | strategy | ViT cost Dist | LLM cost Dist | ViT Dist colocated | plan s (median, spread) | "
          "moved per step naive -> solved (units; GB) | inter-node share naive -> solved (bound) | whole-tile floor "
          "of the ViT Dist")
    for dp in (8, 64):
        joint_config = PlanConfig(dp=dp, microbatches=4, strategy="isf+balance")
        phases_config = PlanConfig(dp=dp, microbatches=4, strategy="isf+phases", ranks_per_node=8)
        joint, joint_s = timed_plans(loads, joint_config, rounds=5)
        routed, routed_s = timed_plans(loads, phases_config, rounds=5)
        vit, llm = cost_dists(joint, loads, joint_config)
        print(f"[phases] {dp} | isf+balance | {vit:.6f} | {llm:.6f} | (joint) | {statistics.median(joint_s):.2f} "
              f"({min(joint_s):.2f}-{max(joint_s):.2f}) | - | -")
        v = routed.phases.vision
        steps = routed.n_steps
        naive_inter = v.unrouted_inter_node_units / max(v.unrouted_moved_units, 1)
        solved_inter = v.inter_node_units / max(v.moved_units, 1)
        print(f"[phases] {dp} | isf+phases | {v.dist:.6f} | {routed.phases.llm_dist:.6f} | {v.colocated_dist:.6f} | "
              f"{statistics.median(routed_s):.2f} ({min(routed_s):.2f}-{max(routed_s):.2f}) | "
              f"{v.unrouted_moved_units / steps:.1f} -> {v.moved_units / steps:.1f} "
              f"({v.unrouted_moved_units / steps * TILE_BYTES / 1e9:.2f} -> "
              f"{v.moved_units / steps * TILE_BYTES / 1e9:.2f}) | {naive_inter:.1%} -> {solved_inter:.1%} "
              f"(bound {v.inter_node_bound / max(v.moved_units, 1):.1%}) | {whole_tile_floor(routed, loads, dp):.6f}")
        print(f"[phases] {dp} | planning time isf+phases / isf+balance: "
              f"{statistics.median(routed_s) / statistics.median(joint_s):.2f}x (goal <= 1.5x); "
              f"inter-node units solved / naive: {v.inter_node_units / max(v.unrouted_inter_node_units, 1):.3f} "
              f"(OrchMLLM: 0.436-0.722)")
        assert v.dist <= v.colocated_dist and v.inter_node_units <= v.unrouted_inter_node_units


def step_times(out) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in records[1:]], records  # the first step pays for warm-up


def test_reference_trainer_all_to_all_against_colocated_on_cpu(tmp_path):
    _, index = indexed_demo(tmp_path / "data", 200, 4, 5, POLICY)
    common = [f"data.index={index}", "data.microbatches=4", "data.server_workers=1", "data.strategy=isf+phases",
              "parallel.pp=1", "parallel.dp=4", "recompute.mode=none", "data.epochs=3"] + \
        [f"model.{k}={v}" for k, v in MODEL.items()]
    times = {"colocated": [], "routed": []}
    moved = []
    for round_ in range(3):
        for name, extra in (("colocated", []), ("routed", ["parallel.encoder=phases"])):
            out = tmp_path / f"{name}-{round_}"
            packfeed_train(4, common + extra, out)
            seconds, records = step_times(out)
            times[name] += seconds
            if name == "routed":
                moved += [(r["all_to_all_bytes"], r["all_to_all_s"]) for r in records[1:]]
    print(f"\n[phases] reference trainer, CPU (2 cores), DP 4, M 4, {len(times['routed'])} steps per placement over "
          "3 alternating runs: step s median (min-max)")
    for name, values in times.items():
        print(f"[phases]   {name}: {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
    print(f"[phases]   routed/colocated: {statistics.median(times['routed']) / statistics.median(times['colocated']):.2f}x;"
          f" all-to-all per step on rank 0: {statistics.median(b for b, _ in moved) / 1e6:.2f} MB in "
          f"{statistics.median(s for _, s in moved) * 1e3:.1f} ms (median)")
    assert times["colocated"] and times["routed"]


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
def test_simulated_at_cluster_scale(tmp_path):
    """InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B) on 512 GPUs: DP 64 x TP 8, pp 1, M 4, 8 GPUs per node;
    isf+phases routed (`--encoder phases`) against the same packs encoded colocated (`--encoder stages`, one
    stage) and against isf+balance."""
    mix = tmp_path / "mix.json"
    vision, tokens = incoherent_mix()
    mix.write_text(json.dumps([{"vit_num": int(v), "token_num": int(t), "image_flags": int(v)}
                               for v, t in zip(vision, tokens)]))
    datasets = {"internvl": [str(f) for f in LENGTH_FILES], "incoherent": [str(mix)]}
    setting = ["--model", "internvl-chat-1.5", "--dp", "64", "--pp", "1", "--tp", "8", "--microbatches", "4"]
    print("\n[phases] simulate, InternVL-Chat-1.5, DP 64 x TP 8 (512 GPUs), M 4: data | strategy | encoder | "
          "step s | epoch s | MFU | idle")
    for name, files in datasets.items():
        rows = {}
        for strategy, encoder in (("isf+balance", "stages"), ("isf+phases", "stages"), ("isf+phases", "phases")):
            record = simulate("--lengths", *files, *setting, "--strategy", strategy, "--encoder", encoder)
            rows[strategy, encoder] = record
            print(f"[phases] {name} | {strategy} | {encoder} | {record['step_s']:.4f} | {record['epoch_s']:.1f} | "
                  f"{record['mfu']:.4f} | {record['bubble_fraction']:.4f}")
        routed, colocated = rows["isf+phases", "phases"], rows["isf+phases", "stages"]
        print(f"[phases] {name}: routed / colocated epoch {routed['epoch_s'] / colocated['epoch_s']:.3f}; "
              f"routed / isf+balance {routed['epoch_s'] / rows['isf+balance', 'stages']['epoch_s']:.3f}")
        assert all(r["epoch_s"] > 0 for r in rows.values())
