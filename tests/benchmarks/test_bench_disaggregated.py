"""The encoder on ranks of its own (issue [4/6]): measured against the other placements, checked against the
simulator, and simulated at the papers' settings with the split searched.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_disaggregated.py -m benchmark

1. Measured on this CPU host, 2 and then 3 processes each: `packfeed train` of the reference model on 200 demo
   samples, M 4, two epochs: the encoder in the stages (pp 2 or 3, partition search), in the bubbles (pp 2 or
   3), and on a rank of its own (parallel.encoder=disaggregated, 1 encoder rank + 1 LLM rank, or + an LLM
   pipeline of 2 stages). Per run: the median measured step
   and its spread (pipeline seconds, every step after the first), and `packfeed simulate --run` on it (the
   disaggregated run borrows the stages run's measured layer costs); mean absolute errors, raw and calibrated.
2. OmniBal's setting (InternVL-Chat-1.5, 32 GPUs, DP 8 x PP 4 for the stages, M 8, the two InternVL-1.2M length
   files): `packfeed simulate --encoder disaggregated` with E searched (each split planned for itself), against
   the encoder in the stages and in the bubbles.
3. DistTrain's (MMScale's) model sizes: ViT-Huge (0.63B) with Llama3-7B (MLLM-9B) and Llama3-13B (MLLM-15B), TP 8,
   the LLM at PP 1 and PP 2 as its paper runs Megatron-LM, 64 GPUs, on the same lengths: stages against
   disaggregated with E searched.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import LENGTH_FILES, real_lengths_available
from test_bench_simulate import simulate  # `packfeed simulate ... --json` as a command
from demo_data import indexed_demo
from trainer_workers import packfeed_train

pytestmark = pytest.mark.benchmark

MODEL = {"vit_dim": 48, "vit_layers": 3, "llm_dim": 96, "llm_layers": 3, "patch_size": 14, "seed": 0}
POLICY = {"name": "internvl", "image_size": 224, "tokens_per_tile": 64, "max_num": 6}
ENCODER_RANK = ["parallel.encoder=disaggregated", "parallel.encoder_ranks=1"]
PLACEMENTS = {  # processes -> placement -> overrides: every placement on the same number of processes
    2: {"stages": ["parallel.pp=2"], "bubbles": ["parallel.pp=2", "parallel.encoder=bubbles"],
        "disaggregated": ["parallel.pp=1"] + ENCODER_RANK},
    3: {"stages": ["parallel.pp=3"], "bubbles": ["parallel.pp=3", "parallel.encoder=bubbles"],
        "disaggregated": ["parallel.pp=2"] + ENCODER_RANK},  # the LLM pipelined beside the encoder rank
}


@pytest.mark.parametrize("processes", [2, 3])
def test_measured_placements_and_the_simulator_against_them(tmp_path, processes):
    index = indexed_demo(tmp_path / "data", 200, 4, 5, POLICY)[1]
    common = [f"data.index={index}", "data.microbatches=4", "data.epochs=2", "data.job=bench",
              "data.server_workers=1", "data.prefetch=4", "recompute.mode=none", "optim.steps=0",
              "partition.top_k=2", "partition.trial_steps=1"] + [f"model.{k}={v}" for k, v in MODEL.items()]
    print("\n[disaggregated] measured on this 2-core CPU host: the reference model, 2 epochs of 200 demo samples, "
          f"M 4, {processes} processes per run; every step after the first")
    print("[disaggregated] placement | steps | median step ms (min-max) | median pipeline ms (IQR) | "
          "mean error raw | MAE raw | mean error | MAE")
    pipelines, errors = {}, {}
    for placement, overrides in PLACEMENTS[processes].items():
        out = tmp_path / placement
        _, records = packfeed_train(processes, common + overrides, out, timeout=1800)
        model = [] if placement != "disaggregated" else ["--model", str(tmp_path / "stages" / "cost_model.json")]
        check = simulate("--run", str(out), *model)
        steps = records[1:]
        pipeline = np.array([r["pipeline_s"] for r in steps]) * 1e3
        step = np.array([r["step_s"] for r in steps]) * 1e3
        pipelines[placement], errors[placement] = pipeline, check["mean_abs_error"]
        q1, q3 = np.percentile(pipeline, [25, 75])
        print(f"[disaggregated] {placement} | {len(steps)} | {np.median(step):.1f} ({step.min():.1f}-{step.max():.1f}) "
              f"| {np.median(pipeline):.1f} ({q1:.1f}-{q3:.1f}) | {check['mean_error_raw']:+.1%} | "
              f"{check['mean_abs_error_raw']:.1%} | {check['mean_error']:+.1%} | {check['mean_abs_error']:.1%}")
    for placement in ("bubbles", "disaggregated"):
        ratio = np.median(pipelines["stages"]) / np.median(pipelines[placement])
        print(f"[disaggregated] median pipeline step, stages / {placement}: {ratio:.2f}x")
    print(f"[disaggregated] the simulator on the disaggregated run: calibrated MAE {errors['disaggregated']:.1%} "
          "(goal: within 15%)")
    assert all(np.isfinite(list(errors.values())))


OMNIBAL = ["--model", "internvl-chat-1.5", "--dp", "8", "--pp", "4", "--microbatches", "8", "--gpus", "32"]


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
def test_omnibal_setting_with_the_split_searched():
    files = [str(f) for f in LENGTH_FILES]
    print("\n[disaggregated] OmniBal's setting: InternVL-Chat-1.5, 32 GPUs, M 8 per replica of the stages' DP 8 "
          "(64 packs a step), PP 4, isf+balance, 30,730 samples")
    print("[disaggregated] encoder | layout | step s | epoch s | bubble | MFU | split search")
    rows = {}
    for encoder in ("stages", "bubbles", "disaggregated"):
        record = simulate("--lengths", *files, *OMNIBAL, "--strategy", "isf+balance", "--encoder", encoder)
        rows[encoder] = record
        search = record["search"]
        found = (f"E {search['encoder_gpus']} GPUs + LLM dp {search['llm_dp']} (simulated {search['simulated']} of "
                 f"{search['candidates']} splits, each planned for itself: {search['replanned']})") if search else "-"
        layout = record["layout"]
        print(f"[disaggregated] {encoder} | dp {layout['dp']} x pp {layout['pp']} | {record['step_s']:.3f} | "
              f"{record['epoch_s']:.0f} | {record['bubble_fraction']:.1%} | {record['mfu']:.1%} | {found}")
    for encoder in ("stages", "bubbles"):
        print(f"[disaggregated] epoch, {encoder} / disaggregated: "
              f"{rows[encoder]['epoch_s'] / rows['disaggregated']['epoch_s']:.2f}x (goal vs stages: >= 1)")
    assert all(r["epoch_s"] > 0 for r in rows.values())


VIT_HUGE = {"hidden": 1280, "layers": 32, "heads": 16, "ffn": 5120}
LLAMA = {"7b": {"hidden": 4096, "layers": 32, "heads": 32, "ffn": 11008, "gated": True, "vocab": 32000},
         "13b": {"hidden": 5120, "layers": 40, "heads": 40, "ffn": 13824, "gated": True, "vocab": 32000}}


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
@pytest.mark.parametrize("llm, pp, tp", [("7b", 1, 8), ("13b", 2, 8), ("7b", 2, 1)])
def test_disttrain_model_sizes_with_the_split_searched(tmp_path, llm, pp, tp):
    """ViT-Huge over 448 px tiles of 14 px patches (1024 patches; pixel-shuffled to 256 tokens, as the length
    files count them) and a Llama LLM. The simulator gives both sides one TP size: at TP 8 the encoder comes in
    groups of 8 GPUs (DistTrain replicates its ViT instead); TP 1 with the LLM at PP 2 shows finer splits."""
    shape = {"vision": VIT_HUGE, "llm": LLAMA[llm], "patches_per_tile": 1024, "tokens_per_tile": 256,
             "projector_params": 4 * 1280 * LLAMA[llm]["hidden"] + LLAMA[llm]["hidden"] ** 2}
    model = tmp_path / f"mllm-{llm}.json"
    model.write_text(json.dumps(shape))
    files = [str(f) for f in LENGTH_FILES]
    dp = 64 // (tp * pp)
    common = ["--lengths", *files, "--model", str(model), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp),
              "--microbatches", str(64 // dp), "--strategy", "isf+balance", "--gpus", "64"]
    stages = simulate(*common, "--encoder", "stages")
    split = simulate(*common, "--encoder", "disaggregated")
    search = split["search"]
    print(f"\n[disaggregated] DistTrain's sizes: ViT-Huge + Llama3-{llm.upper()}, 64 GPUs, TP {tp}, PP {pp}, 64 packs a "
          f"step, isf+balance: stages dp {dp}: step {stages['step_s']:.3f} s, epoch {stages['epoch_s']:.0f} s, MFU "
          f"{stages['mfu']:.1%}; disaggregated E {search['encoder_gpus']} GPUs + LLM dp {search['llm_dp']}: step "
          f"{split['step_s']:.3f} s, epoch {split['epoch_s']:.0f} s, MFU {split['mfu']:.1%}; "
          f"{stages['epoch_s'] / split['epoch_s']:.2f}x per epoch (simulated {search['simulated']} of "
          f"{search['candidates']} splits)")
    assert split["epoch_s"] > 0 and stages["epoch_s"] > 0
