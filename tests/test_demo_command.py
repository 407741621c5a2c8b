"""`make demo`'s command, as the Makefile runs it (`packfeed demo --out DIR`): every stage of the flow on the demo
photographs, from the shards to two pipeline stages training on the packs, succeeds and leaves what it says."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_demo_runs_every_stage(tmp_path):
    out = tmp_path / "demo-out"
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "demo", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for stage in range(1, 7):
        assert f"[{stage}/6]" in done.stdout
    assert (out / "report" / "report.html").stat().st_size > 0 and (out / "plan.parquet").is_file()
    steps = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(step["loss"] > 0 for step in steps)
