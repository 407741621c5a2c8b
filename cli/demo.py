"""`packfeed demo` (`make demo`): the demo dataset (`packfeed.server.tools.demo`) built, indexed, reported and
planned, then served and consumed with one client per DP rank (`consume`), and a short training run on it. The
command line runs both sides, so this lives here: no other server room imports the client."""

from __future__ import annotations

import json
import os
from pathlib import Path

from packfeed.server.tools.demo import write_demo_dataset


def run_demo(out: Path, samples: int = 240, dataset_only: bool = False) -> int:
    """`make demo`: build the demo dataset, index it, write the statistics report, plan an epoch, then serve
    it and consume the epoch with one client per DP rank. `dataset_only`: stop after the index (the
    docker-compose demo prepares its shared data volume this way)."""
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan
    from packfeed.server.tools.stats import write_report
    from packfeed.v1.options import PlanConfig

    print(f"[1/6] writing {samples} demo samples (scikit-image photographs) to {out}/shards")
    paths = write_demo_dataset(out, samples=samples)
    print(f"[2/6] indexing {len(paths.shards)} shards")
    config = IndexConfig(tokenizer=str(paths.tokenizer))
    result = build_index([str(p) for p in paths.shards], out / "index.parquet", config)
    print(json.dumps(result.summary(), indent=2))
    if dataset_only:
        return 0
    plan_config = PlanConfig(dp=2, microbatches=2, pipeline_stages=2, samples_per_pack=4)
    print(f"[3/6] statistics report (DP {plan_config.dp}, M {plan_config.microbatches})")
    report = write_report(out / "index.parquet", out / "report", plan_config)
    print(f"      {report['html']}")
    print("[4/6] plan for epoch 0")
    loads, info = load_sample_loads(out / "index.parquet")
    plan = make_plan(loads, plan_config, seed=0, epoch=0, index_fingerprint=info.fingerprint)
    plan.write(out / "plan.parquet")
    print(json.dumps(plan.summary(loads)))
    print(f"[5/6] serving over gRPC on loopback; {plan_config.dp} clients (one per DP rank, "
          f"M = {plan_config.microbatches}) consume the epoch")
    try:
        from packfeed.cli.consume import consume_epoch
    except ImportError as error:  # the server side installs without torch
        print(f"      skipped: the client needs torch ({error}); pip install 'packfeed[client]'")
        return 0
    print(json.dumps(consume_epoch(out / "index.parquet", plan_config.dp, plan_config.microbatches,
                                   plan_config.pipeline_stages), indent=2))
    print("      (these clients do no training, so they wait on pre-processing nearly all the time; with a\n"
          "       training step the server prefetches ahead: see 'data wait' in BENCHMARKS.md)")
    return train_demo(out, plan_config)


DEMO_TRAIN_STEPS = 4


def train_demo(out: Path, plan_config) -> int:
    """[6/6] A short CPU training run of the reference trainer: 2 pipeline stages under torchrun, fed by an
    embedded server, with partition search and adaptive recompute; its log is the demo's output."""
    import subprocess
    import sys

    print(f"[6/6] training a small VLM for {DEMO_TRAIN_STEPS} steps: {plan_config.pipeline_stages} pipeline stages "
          f"(torchrun, gloo on CPU), M = {plan_config.microbatches}, packs from an embedded server")
    overrides = [f"data.index={out / 'index.parquet'}", f"data.microbatches={plan_config.microbatches}",
                 f"parallel.pp={plan_config.pipeline_stages}", f"optim.steps={DEMO_TRAIN_STEPS}",
                 f"out={out / 'train'}", "partition.top_k=2", "partition.trial_steps=1",
                 "recompute.budget_mb=200", "model.vit_layers=2", "model.llm_layers=2", "model.vit_dim=32",
                 "model.llm_dim=64", "model.patch_size=28", "data.job=demo-train"]
    command = [sys.executable, "-m", "packfeed.cli", "train", "--nproc", str(plan_config.pipeline_stages),
               *overrides]
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(out / "train" / "error.json")}
    code = subprocess.call(command, env=env)
    if code == 0:
        print(f"      decisions (reused by a restart): {out / 'train' / 'partition.json'}, recompute-stage*.json; "
              f"per-step metrics: {out / 'train' / 'metrics.jsonl'}")
    return code
