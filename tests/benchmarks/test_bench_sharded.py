"""Sharded data parallelism in the simulator (issue [5/6]): FSDP / ZeRO-3 make every layer a barrier over the DP
group, so each phase of a step waits for its own slowest rank, and balancing each phase on its own pays.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_sharded.py -m benchmark

`packfeed simulate --data-parallel zero3 --json` (run as a command) for InternVL-Chat-1.5 at pp 1 on the two
InternVL-1.2M length files (30,730 samples): random padded batches (OmniBal's baseline), random packs,
`isf+balance`, and `isf+phases` encoded colocated and routed, at DP 32 (OmniBal's DeepSpeed ZeRO-3 rows; its
Table 2 reports 1.54x from its balance) and DP 64, M 4; DDP rows for comparison.
"""

from __future__ import annotations

import pytest
from conftest import LENGTH_FILES, real_lengths_available
from test_bench_simulate import simulate  # `packfeed simulate ... --json` as a command

pytestmark = pytest.mark.benchmark

ROWS = (("random-padded", "stages"), ("random", "stages"), ("isf+balance", "stages"), ("isf+phases", "stages"),
        ("isf+phases", "phases"))


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
@pytest.mark.parametrize("dp", [32, 64])
def test_zero3_strategies_at_omnibals_deepspeed_setting(dp):
    files = [str(f) for f in LENGTH_FILES]
    print(f"\n[sharded] InternVL-Chat-1.5, pp 1, DP {dp}, M 4, 30,730 samples, H100 figures, 8 GPUs per node")
    print("[sharded] data parallel | strategy | encoder | step s | epoch s | idle | MFU | vs random-padded")
    for data_parallel in ("zero3", "ddp"):
        rows = {}
        for strategy, encoder in ROWS:
            rows[strategy, encoder] = record = simulate(
                "--lengths", *files, "--model", "internvl-chat-1.5", "--dp", str(dp), "--pp", "1", "--microbatches",
                "4", "--strategy", strategy, "--encoder", encoder, "--data-parallel", data_parallel)
            baseline = rows["random-padded", "stages"]["epoch_s"]
            print(f"[sharded] {data_parallel} | {strategy} | {encoder} | {record['step_s']:.3f} | "
                  f"{record['epoch_s']:.0f} | {record['bubble_fraction']:.1%} | {record['mfu']:.1%} | "
                  f"{baseline / record['epoch_s']:.2f}x")
        routed = rows["isf+phases", "phases"]["epoch_s"]
        print(f"[sharded] {data_parallel}: routed isf+phases vs isf+balance "
              f"{rows['isf+balance', 'stages']['epoch_s'] / routed:.2f}x, vs the same plan colocated "
              f"{rows['isf+phases', 'stages']['epoch_s'] / routed:.2f}x")
        assert all(r["epoch_s"] > 0 for r in rows.values())
