"""Hostile-client soak, its speed and memory goals: eight ranks stream two epochs quiet and then while one
client loops over hostile requests; the median step under attack stays within 2x of the quiet run and the
server's resident memory returns to where it was once the hostile jobs are closed or evicted.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_soak.py -m benchmark
"""

from __future__ import annotations

import pytest

from test_soak import EPOCHS, print_soak, run_soak

pytestmark = pytest.mark.benchmark


def test_steps_and_memory_under_attack(tmp_path):
    soak = run_soak(tmp_path)
    quiet_step, step = print_soak(soak)
    for ledger in (soak.quiet_keys, soak.keys):
        assert sorted(k for rank_keys in ledger.values() for k in rank_keys) == sorted(soak.valid * EPOCHS)
    assert step <= 2 * quiet_step
    assert soak.held_bytes == 0
    assert soak.after_mib <= soak.baseline_mib * 1.15 + 30
