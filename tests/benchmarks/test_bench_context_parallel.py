"""Long samples across GPUs: dynamic vs static context parallelism vs none, simulated on a long-video mix.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_context_parallel.py -m benchmark

The mix (`tests/long_video_mix.py`): the two InternVL-1.2M length files (30,730 short image SFT samples) plus 5%
videos of 8K-128K tokens (log-uniform). Model InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B), N = 32,768
tokens per GPU, M 1, H100-class GPUs (`packfeed simulate`'s defaults), at DP 8 x CP 4 and DP 16 x CP 8:
- `packfeed simulate --context-parallel C --json` (run as a command): dynamic and static CP, K/V all-gathered
  (what `packfeed train` runs) and overlapped on a ring;
- no CP at the same N: the same GPUs as plain data parallelism (dp x C ranks), ISF packs under N tokens, the
  longer samples each alone on one GPU (the `alone` oversize policy: above N, the memory a GPU does not have);
- the bound no CP plan can beat (`work_bound`), so the most any plan could gain over static CP;
- static CP with `--strategy isf` (ISF packs, steps not balanced across ranks) against dynamic;
- what each long video's frames encoded by one GPU of its pack would cost (before `cp_pieces`);
- planning time of each mode (the planner alone, 3 rounds: median and spread).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
from long_video_mix import write_long_video_mix

pytestmark = pytest.mark.benchmark

N = 32768
LAYOUTS = ((8, 4), (16, 8))
# Qwen2-VL-2B's shape (ViT 1280 x 32, LLM 1536 x 28 with 2 K/V heads), frames of 1024 patches -> 256 tokens
QWEN2_VL_2B = {"vision": {"hidden": 1280, "layers": 32, "heads": 16, "ffn": 5120},
               "llm": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "ffn": 8960, "gated": True,
                       "vocab": 151936},
               "patches_per_tile": 1024, "tokens_per_tile": 256, "projector_params": 5120 * 5120 + 5120 * 1536}

# the reference VLM's `2b` flavor, what `packfeed train parallel.cp` trains (ViT 1024 x 24; LLM 2048 x 30, 16 K/V
# heads, SwiGLU 5,632), 448 px tiles of 14 px patches -> 256 tokens
REFERENCE_2B = {"vision": {"hidden": 1024, "layers": 24, "heads": 16, "ffn": 4096, "causal": False},
                "llm": {"hidden": 2048, "layers": 30, "heads": 16, "ffn": 5632, "gated": True, "vocab": 32000},
                "patches_per_tile": 1024, "tokens_per_tile": 256, "projector_params": 1024 * 4 * 2048 + 2048 * 2048}
SHAPES = {"Qwen2-VL-2B": QWEN2_VL_2B, "the reference 2b VLM": REFERENCE_2B}


def model_arguments(tmp_path) -> list[tuple[str, str]]:
    """(name, `--model` argument) of each model benchmarked: InternVL-Chat-1.5's preset, then SHAPES as files."""
    models = [("InternVL-Chat-1.5", "internvl-chat-1.5")]
    for k, (name, shape) in enumerate(SHAPES.items()):
        path = tmp_path / f"shape-{k}.json"
        path.write_text(json.dumps(shape))
        models.append((name, str(path)))
    return models


def mix_samples(mix):
    """The mix's sample loads, as `packfeed simulate --lengths MIX` reads them."""
    from packfeed.cli.simulate_data import samples_of as _samples

    class Args:
        lengths, index = [str(mix)], None

    return _samples(Args)


def simulate(mix, dp: int, cp: int, comm: str, model: str = "internvl-chat-1.5", strategy: str = "isf+balance",
             microbatches: int = 1, mode: str | None = None) -> dict:
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--lengths", str(mix),
                           "--model", model, "--dp", str(dp), "--context-parallel", str(cp),
                           "--max-tokens-per-gpu", str(N), "--microbatches", str(microbatches), "--cp-comm", comm,
                           "--strategy", strategy, "--json"] + (["--cp-mode", mode] if mode else []),
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr
    return {r["mode"]: r for r in json.loads(done.stdout)["context_parallel"]}


def without_cp(samples, table, patches: int, dp: int, cp: int) -> dict:
    """dp x cp GPUs as plain DP: ISF packs under N tokens (the vision cap at the data's ratio), M 1."""
    from packfeed.server.plan.caps import resolve_caps
    from packfeed.server.plan.planner import make_plan
    from packfeed.trainer.simulate.cluster import Cluster
    from packfeed.trainer.simulate.context_parallel import CpWorkload, simulate_cp
    from packfeed.trainer.simulate.workload import planner_cost_model
    from packfeed.cli.simulate_data import cp_workload
    from packfeed.v1.options import PlanConfig

    base = PlanConfig(dp=dp * cp, microbatches=1, cost_model=planner_cost_model(table, patches))
    caps = resolve_caps(samples, base)
    vision_cap = max(1, int(np.ceil(caps.vision_cap * N / caps.token_cap)))
    config = PlanConfig(dp=dp * cp, microbatches=1, cost_model=base.cost_model, vision_cap=vision_cap, token_cap=N)
    plan = make_plan(samples, config, 0, 0)
    plan.cp_degree = np.ones(len(plan.members), dtype=np.int64)
    plan.cp_group = np.zeros(len(plan.members), dtype=np.int64)
    workload = cp_workload(plan, samples.vision, samples.tokens, patches)
    workload = CpWorkload(workload.step, workload.replica, workload.microbatch, workload.degree, workload.group,
                          workload.loads, workload.steps, dp * cp, 1, 1, workload.samples, "none")
    result = simulate_cp(workload, table, Cluster(dp * cp))
    result["oversize"] = int(len(plan.oversize))
    return result


def rows_of(rows: list, dp: int, cp: int, comm: str) -> dict:
    return {mode: r for d, c, mode, k, r in rows if (d, c) == (dp, cp) and k in (comm, "-")}


def unavoidable_split_gpu_s(samples, table, patches: int, cp: int) -> float:
    """GPU-seconds every CP plan spends beyond running each sample whole: a sample above N runs over at least
    the smallest degree that holds it at N per GPU (at most C), and its share there costs its d GPUs more than the
    sample costs one GPU whole (the split's tiles, exchange and gathered K/V). Each such sample is costed alone
    on its d GPUs: fillers beside it can only add to its pack's exchange and gathered rows."""
    from packfeed.server.plan.context_parallel import degrees
    from packfeed.trainer.simulate.cluster import Cluster
    from packfeed.trainer.simulate.context_parallel import CpWorkload, pack_seconds

    long = np.flatnonzero(samples.valid & (samples.tokens > N))
    tokens = samples.tokens[long].astype(float)
    zeros = np.zeros(len(long), dtype=np.int64)

    def gpu_seconds(degree: np.ndarray) -> float:  # each long sample alone on `degree` GPUs of one node
        packs = CpWorkload.of_packs(zeros, zeros, zeros, degree, zeros, tokens, samples.vision[long].astype(float),
                                    tokens ** 2, patches, 1, 1, 1, cp, len(long), "bound",
                                    [np.array([t], dtype=np.int64) for t in samples.tokens[long]])
        seconds = pack_seconds(table, Cluster(cp), packs.loads, packs.degree,
                               [list(range(int(d))) for d in degree], "allgather", packs.gathered_rows)
        return float((seconds * degree).sum())

    return gpu_seconds(np.minimum(degrees(samples.tokens[long], N), cp)) - gpu_seconds(np.ones_like(zeros))


def bound_seconds(by_mode: dict, gpus: int, tokens: int, split_gpu_s: float) -> tuple[float, tuple, int]:
    """(the bound, its (whole, split, sync) seconds, the fewest steps): `work_bound`'s sum."""
    steps = -(-tokens // (gpus * N))
    parts = (by_mode["none"]["busy_gpu_s"] / gpus, split_gpu_s / gpus, steps * by_mode["static"]["sync_s"])
    return sum(parts), parts, steps


def work_bound(by_mode: dict, gpus: int, tokens: int, split_gpu_s: float, what: str) -> str:
    """The shortest epoch any CP plan of these samples could take: the work without CP's split costs (the
    GPU-seconds of the no-CP run, each sample whole on one GPU) plus what splitting the samples above N costs at
    the least (`unavoidable_split_gpu_s`), spread evenly over every GPU with no bubble, plus the gradient sync of
    the fewest steps that hold every token at N per GPU; so the most any plan could gain over static CP."""
    bound, (whole, split, sync), steps = bound_seconds(by_mode, gpus, tokens, split_gpu_s)
    static, dynamic = by_mode["static"]["epoch_s"], by_mode["dynamic"]["epoch_s"]
    assert split > 0 and bound <= dynamic  # the bound holds for the plan that runs
    return (f"{what}: no CP plan beats {bound:.1f} s an epoch ({whole:.1f} s of unsplit work and {split:.1f} s of "
            f"unavoidable splitting over {gpus} GPUs with no bubble, {sync:.1f} s of sync over at least {steps} "
            f"steps): at most {static / bound:.2f}x over static CP; dynamic gets {static / dynamic:.2f}x, "
            f"{dynamic / bound - 1:.1%} above the bound")


def one_gpu_encoding_each_video(samples, table, patches: int, dp: int, cp: int, mode: str) -> tuple[float, float]:
    """Epoch seconds of the CP plan as simulated (the d GPUs of a pack share its vision tiles, as `cp_pieces` has
    them do), and with each long video's frames encoded by one GPU of its pack (what the trainer did before
    `cp_pieces`: an item went whole to one GPU), its other tiles shared by all."""
    from packfeed.cli.simulate_data import cp_workload
    from packfeed.server.plan.context_parallel import subpacks
    from packfeed.server.plan.planner import make_plan
    from packfeed.trainer.simulate.cluster import Cluster
    from packfeed.trainer.simulate.context_parallel import simulate_cp
    from packfeed.trainer.simulate.model_shape import TILES, VISION_SQUARE
    from packfeed.trainer.simulate.workload import planner_cost_model
    from packfeed.v1.options import PlanConfig

    config = PlanConfig(dp=dp, microbatches=1, cost_model=planner_cost_model(table, patches), context_parallel=cp,
                        max_tokens_per_gpu=N, cp_mode=mode)
    plan = make_plan(samples, config, 0, 0)
    shared = cp_workload(plan, samples.vision, samples.tokens, patches)
    _, starts, stops = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    vision, tokens = samples.vision[plan.members], samples.tokens[plan.members]
    whole = dataclasses.replace(shared, loads=shared.loads.copy())
    for p, (a, b) in enumerate(zip(starts, stops)):
        d = int(shared.degree[p])
        videos = vision[a:b][tokens[a:b] > N]  # the long videos (one item each) of a split pack
        if d > 1 and len(videos):
            whole.loads[p, TILES] = d * max(float(videos.max()), vision[a:b].sum() / d)  # pack_seconds divides by d
            whole.loads[p, VISION_SQUARE] = whole.loads[p, TILES] * patches ** 2
    return (simulate_cp(shared, table, Cluster(dp * cp))["epoch_s"], simulate_cp(whole, table, Cluster(dp * cp))["epoch_s"])


def planning_seconds(samples, table, patches: int, dp: int, cp: int, mode: str) -> list[float]:
    from packfeed.server.plan.planner import make_plan
    from packfeed.trainer.simulate.workload import planner_cost_model
    from packfeed.v1.options import PlanConfig

    config = PlanConfig(dp=dp, microbatches=1, cost_model=planner_cost_model(table, patches), context_parallel=cp,
                        max_tokens_per_gpu=N, cp_mode=mode)
    make_plan(samples, config, 0, 0)  # compiled once
    rounds = []
    for seed in range(3):
        started = time.perf_counter()
        make_plan(samples, config, seed, 0)
        rounds.append(time.perf_counter() - started)
    return rounds


def test_dynamic_static_and_no_context_parallelism(tmp_path):
    from packfeed.trainer.simulate.model_shape import load_model

    mix = write_long_video_mix(tmp_path / "mix.json")
    table, shape = load_model("internvl-chat-1.5")
    samples = mix_samples(mix)
    tokens = int(samples.tokens.sum())
    rows = []
    for dp, cp in LAYOUTS:
        for comm in ("allgather", "ring"):
            got = simulate(mix, dp, cp, comm)
            for mode in ("dynamic", "static"):
                rows.append((dp, cp, mode, comm, got[mode]))
        rows.append((dp, cp, "none", "-", without_cp(samples, table, shape.patches_per_tile, dp, cp)))
    print(f"\nlong-video mix: {len(samples)} samples ({int((samples.tokens > N).sum())} above N = {N} tokens, the "
          f"longest {int(samples.tokens.max())})")
    print("  DP x CP   mode     K/V        steps  step s    epoch s  bubbles  MFU    peak tokens/GPU  over N  degrees")
    for dp, cp, mode, comm, r in rows:
        print(f"  {dp:>2} x {cp}   {mode:<8} {comm:<10} {r['steps']:>5}  {r['step_s']:>7.3f}  {r['epoch_s']:>8.1f}  "
              f"{r['bubble_fraction']:>7.3f}  {r['mfu']:.3f}  {r['peak_tokens_per_gpu']:>15}  "
              f"{r.get('oversize', 0):>6}  {r['degrees']}")
    for dp, cp in LAYOUTS:
        for comm in ("allgather", "ring"):
            by = rows_of(rows, dp, cp, comm)
            print(f"  DP {dp} x CP {cp}, K/V {comm}: dynamic vs static {by['static']['epoch_s'] / by['dynamic']['epoch_s']:.2f}x "
                  f"per epoch; dynamic vs no CP {by['none']['epoch_s'] / by['dynamic']['epoch_s']:.2f}x (no CP puts "
                  f"{by['none']['peak_tokens_per_gpu']} tokens on a GPU)")
            assert by["dynamic"]["peak_tokens_per_gpu"] <= N and by["static"]["peak_tokens_per_gpu"] <= N
            assert by["none"]["peak_tokens_per_gpu"] > N
        split = unavoidable_split_gpu_s(samples, table, shape.patches_per_tile, cp)
        print("  " + work_bound(rows_of(rows, dp, cp, "allgather"), dp * cp, tokens, split,
                                f"DP {dp} x CP {cp}, K/V all-gather"))
    models = model_arguments(tmp_path)
    for name, shape_file in models[1:]:
        shape_table, shaped = load_model(shape_file)
        for dp, cp in LAYOUTS:
            got = simulate(mix, dp, cp, "allgather", shape_file)
            got["none"] = without_cp(samples, shape_table, shaped.patches_per_tile, dp, cp)
            print(f"  {name}, DP {dp} x CP {cp}, K/V all-gather: " + "; ".join(
                f"{mode} {got[mode]['steps']} steps x {got[mode]['step_s']:.3f} s = {got[mode]['epoch_s']:.1f} s, "
                f"bubbles {got[mode]['bubble_fraction']:.3f}, MFU {got[mode]['mfu']:.3f}"
                for mode in ("dynamic", "static"))
                + f"; dynamic vs static {got['static']['epoch_s'] / got['dynamic']['epoch_s']:.2f}x")
            split = unavoidable_split_gpu_s(samples, shape_table, shaped.patches_per_tile, cp)
            print("    " + work_bound(got, dp * cp, tokens, split, f"{name}, DP {dp} x CP {cp}"))
    for name, model in models:
        for dp, cp in LAYOUTS:
            unbalanced = simulate(mix, dp, cp, "allgather", model, "isf")
            print(f"  {name}, DP {dp} x CP {cp}, K/V all-gather, --strategy isf (packs not balanced across "
                  f"ranks): static {unbalanced['static']['epoch_s']:.1f} s, bubbles "
                  f"{unbalanced['static']['bubble_fraction']:.3f}; dynamic {unbalanced['dynamic']['epoch_s']:.1f} s; "
                  f"dynamic vs static {unbalanced['static']['epoch_s'] / unbalanced['dynamic']['epoch_s']:.2f}x")
    for dp, cp in LAYOUTS:
        for mode in ("dynamic", "static"):
            shared, whole = one_gpu_encoding_each_video(samples, table, shape.patches_per_tile, dp, cp, mode)
            print(f"  DP {dp} x CP {cp} {mode}, K/V all-gather: the pack's GPUs sharing its vision tiles {shared:.1f} s "
                  f"an epoch; each long video encoded by one of them {whole:.1f} s ({whole / shared:.2f}x)")
            assert whole > shared
    for dp, cp in LAYOUTS:
        for mode in ("dynamic", "static"):
            rounds = planning_seconds(samples, table, shape.patches_per_tile, dp, cp, mode)
            print(f"  planning DP {dp} x CP {cp} {mode}: median {statistics.median(rounds):.3f} s "
                  f"(min {min(rounds):.3f}, max {max(rounds):.3f}) over 3 rounds")


def test_every_mode_against_the_bound(tmp_path):
    """Each row: a model at DP x CP and M, K/V all-gathered; the epoch of dynamic CP, balanced static CP, static CP
    of unbalanced ISF packs (`--strategy isf`), static CP as Megatron-Core's LLaVA runs it (every GPU of a pack
    running the vision tower over all its images), and the bound no CP plan beats (`bound_epoch_s`, counted with
    M), all from `packfeed simulate --context-parallel C --json` run as a command."""
    mix = write_long_video_mix(tmp_path / "mix.json")
    print(f"\n[modes] long-video mix, N {N}, K/V all-gather: model | DP x CP | M | steps (dynamic) | dynamic s | "
          "static s | static isf s | megatron-llava s | bound s | dynamic above the bound | static above")
    worst = 0.0
    for name, model in model_arguments(tmp_path):
        for dp, cp in LAYOUTS:
            for m in (1, 4):
                got = simulate(mix, dp, cp, "allgather", model, microbatches=m)
                got["isf"] = simulate(mix, dp, cp, "allgather", model, "isf", m, "static")["static"]
                bound = got["dynamic"]["bound_epoch_s"]
                assert all(r["peak_tokens_per_gpu"] <= N and r["epoch_s"] >= bound for r in got.values())
                above = got["dynamic"]["epoch_s"] / bound - 1
                worst = max(worst, above)
                print(f"[modes] {name} | {dp} x {cp} | {m} | {got['dynamic']['steps']} | {got['dynamic']['epoch_s']:.1f} | "
                      f"{got['static']['epoch_s']:.1f} | {got['isf']['epoch_s']:.1f} | "
                      f"{got['megatron-llava']['epoch_s']:.1f} | {bound:.1f} | {above:.1%} | "
                      f"{got['static']['epoch_s'] / bound - 1:.1%}")
    print(f"[modes] dynamic CP's largest gap to the bound over every row: {worst:.1%}")


@pytest.mark.parametrize("dp, cp", [(8, 4)])
def test_the_gain_by_share_of_videos(tmp_path, dp, cp):
    """Dynamic against static CP (K/V all-gathered) and the bound no plan beats (`work_bound`), for mixes of 2% to
    20% videos beside the same short samples, each model at DP dp x CP cp."""
    from packfeed.trainer.simulate.model_shape import load_model

    models = model_arguments(tmp_path)
    print(f"\n[videos] DP {dp} x CP {cp}, K/V all-gather: videos | model | dynamic vs static | most any plan gains "
          "over static | dynamic above the bound")
    for share in (0.02, 0.05, 0.10, 0.20):
        mix = write_long_video_mix(tmp_path / f"mix-{share}.json", videos=share)
        samples = mix_samples(mix)
        tokens = int(samples.tokens.sum())
        for name, model in models:
            table, shape = load_model(model)
            got = simulate(mix, dp, cp, "allgather", model)
            got["none"] = without_cp(samples, table, shape.patches_per_tile, dp, cp)
            split = unavoidable_split_gpu_s(samples, table, shape.patches_per_tile, cp)
            bound = bound_seconds(got, dp * cp, tokens, split)[0]
            static, dynamic = got["static"]["epoch_s"], got["dynamic"]["epoch_s"]
            assert bound <= dynamic
            print(f"[videos] {share:.0%} | {name} | {static / dynamic:.2f}x | {static / bound:.2f}x | "
                  f"{dynamic / bound - 1:.1%}")


MODEL = {"vit_dim": 96, "vit_layers": 3, "llm_dim": 256, "llm_layers": 3, "patch_size": 14, "seed": 0}
POLICY = {"name": "internvl", "image_size": 224, "tokens_per_tile": 64, "max_num": 6}
MEASURED_N = 256  # tokens per GPU: the demo's longer samples need 2 GPUs


def test_simulator_against_measured_cpu_steps_of_context_parallelism(tmp_path):
    """`packfeed train parallel.cp=2` (2 processes on this 2-core host, one thread each), dynamic and static, and
    `packfeed simulate --run` predicting each measured step from the run's packs, with the per-layer costs a
    partition search measured on this host (a pp 2 run of the same model, 2 processes too)."""
    from demo_data import indexed_demo
    from trainer_workers import packfeed_train

    index = indexed_demo(tmp_path / "data", 200, 4, 5, POLICY)[1]
    common = [f"data.index={index}", "data.job=bench", "data.server_workers=1", "data.prefetch=4",
              "recompute.mode=none"] + [f"model.{k}={v}" for k, v in MODEL.items()]
    packfeed_train(2, common + ["data.microbatches=4", "parallel.pp=2", "optim.steps=3", "partition.top_k=2",
                                "partition.trial_steps=1"], tmp_path / "costs", timeout=1200)
    print(f"\n[cp] measured on this CPU host: the reference model, 200 demo samples, DP 1 x CP 2, M 2, N "
          f"{MEASURED_N}; costs from a pp 2 partition search on the same host")
    print("[cp] mode | steps compared | measured s (sum) | calibration | mean error raw | MAE raw | mean error | MAE")
    errors = []
    for mode in ("dynamic", "static"):
        out = tmp_path / mode
        packfeed_train(2, common + ["data.microbatches=2", "parallel.pp=1", "parallel.cp=2", f"data.cp_mode={mode}",
                                    f"data.max_tokens_per_gpu={MEASURED_N}", "optim.steps=0"], out, timeout=1200)
        done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--run", str(out), "--model",
                               str(tmp_path / "costs" / "cost_model.json"), "--json"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        check = json.loads(done.stdout)
        errors.append(check["mean_abs_error"])
        print(f"[cp] {mode} | {len(check['steps'])} | {sum(s['measured_s'] for s in check['steps']):.2f} | "
              f"{check['overhead_factor']:.3f} | {check['mean_error_raw']:+.1%} | {check['mean_abs_error_raw']:.1%} | "
              f"{check['mean_error']:+.1%} | {check['mean_abs_error']:.1%}")
    print(f"[cp] calibrated MAE over both runs: {statistics.mean(errors):.1%}")
    assert all(np.isfinite(errors))
