"""The planner's columns memory-mapped beside the index: they gather as the in-memory columns do, a windowed plan
over them is the same plan, and gathering hands the mapped pages back instead of keeping them resident."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from packfeed.server.plan.costs import SampleLoads, load_sample_loads
from packfeed.server.plan.mapped_loads import MappedLoads, map_sample_loads, plan_columns_path, write_plan_columns
from packfeed.server.plan.windows import WindowedPlan
from packfeed.v1.options import PlanConfig, Strategy


def synthetic_loads(n: int, seed: int = 0) -> SampleLoads:
    rng = np.random.default_rng(seed)
    return SampleLoads.from_arrays(rng.integers(0, 13, n), rng.integers(64, 4096, n), rng.random(n) > 0.03)


def mapped(loads: SampleLoads, path, batch: int) -> MappedLoads:
    """Loads written as the mapped file in batches of `batch` rows (several batches: the gathers cross them)."""
    names = ("valid", "vision", "tokens", "vit_patches", "vit_attn_sq")
    write_plan_columns(({name: getattr(loads, name)[start:start + batch] for name in names}
                        for start in range(0, len(loads), batch)), path)
    return MappedLoads(path)


def test_an_index_is_mapped_beside_it_with_the_same_columns(tmp_path, small_tile_index):
    in_memory, info = load_sample_loads(small_tile_index)
    loads, mapped_info = map_sample_loads(small_tile_index)
    assert isinstance(loads, MappedLoads) and mapped_info.fingerprint == info.fingerprint
    assert loads.path == plan_columns_path(small_tile_index, info.fingerprint) and loads.path.exists()
    ids = np.random.default_rng(0).permutation(len(in_memory))
    for name in ("valid", "vision", "tokens", "vit_patches", "vit_attn_sq"):
        got = getattr(loads, name)[ids]
        assert got.dtype == getattr(in_memory, name).dtype and np.array_equal(got, getattr(in_memory, name)[ids])
    assert map_sample_loads(small_tile_index)[0].path == loads.path  # written once, then reused


def test_a_windowed_plan_over_mapped_columns_is_the_same_plan(tmp_path):
    loads = synthetic_loads(12_000, seed=4)
    columns = mapped(loads, tmp_path / "loads.plan.arrow", batch=1_000)
    config = PlanConfig(dp=2, microbatches=2, strategy=Strategy.ISF_BALANCE)
    in_memory = WindowedPlan(loads, config, seed=1, epoch=2, size=2_500)
    from_file = WindowedPlan(columns, config, seed=1, epoch=2, size=2_500)
    assert from_file.n_steps == in_memory.n_steps
    for step in range(in_memory.n_steps):
        for rank in range(2):
            for microbatch in range(2):
                assert np.array_equal(from_file.pack_with_truncation(step, rank, microbatch)[0],
                                      in_memory.pack_with_truncation(step, rank, microbatch)[0])
    assert from_file.fingerprint() == in_memory.fingerprint()
    balance = from_file.epoch_balance()
    assert balance["samples"] == int(loads.valid.sum()) and balance == in_memory.epoch_balance()


def test_out_of_range_ids_are_refused(tmp_path):
    columns = mapped(synthetic_loads(100), tmp_path / "small.plan.arrow", batch=30)
    with pytest.raises(IndexError, match="out of range"):
        columns.tokens[np.array([5, 100])]


MAPPED_RSS = """
import sys
import numpy as np
from packfeed.server.plan.mapped_loads import MappedLoads
loads = MappedLoads(__import__("pathlib").Path(sys.argv[1]))
ids = np.random.default_rng(0).permutation(len(loads))
loads.subset(ids)
resident = 0
with open("/proc/self/smaps") as smaps:
    inside = False
    for line in smaps:
        if "-" in line.split()[0]:
            inside = line.rstrip().endswith(sys.argv[1])
        elif inside and line.startswith("Rss:"):
            resident += int(line.split()[1])
print(resident)
"""


def test_gathering_hands_the_mapped_pages_back(tmp_path):
    """Every page of every column is read (a random permutation of all ids), yet the mapping holds next to
    nothing resident afterwards; without the release it would hold the whole file."""
    path = tmp_path / "large.plan.arrow"
    mapped(synthetic_loads(2_000_000, seed=2), path, batch=1 << 18)
    size_kb = path.stat().st_size // 1024
    done = subprocess.run([sys.executable, "-c", MAPPED_RSS, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    resident_kb = int(done.stdout)
    assert size_kb > 30_000 and resident_kb < size_kb // 20, (resident_kb, size_kb)
