"""The planner's columns memory-mapped from a file beside the index, for windowed planning at any size.

Whole-epoch planning needs every sample's loads in memory (17 bytes a sample: 1.7 GB at 100M). A windowed plan
only needs one window's at a time, so it reads them from `INDEX.<fingerprint>.plan.arrow`: the five planner
columns, uncompressed Arrow IPC in record batches of 1M rows (valid as uint8), written once from the index by
whichever process needs it first. Gathering a window's samples goes batch by batch, and each batch's pages are
handed back to the kernel (`madvise(MADV_DONTNEED)`) once read: they stay in the page cache, shared and cheap
to fault in again, but out of the process's resident memory. A window spread over the whole dataset would
otherwise touch, and keep resident, nearly every page of every column.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from packfeed.server.index.table import IndexInfo, read_index_info
from packfeed.server.plan.costs import TOWER_COLUMNS, SampleLoads, check_sample_ids, index_towers

# planner name -> (index column, dtype in the file); valid as uint8: Arrow packs booleans into bits; towers are
# derived from the index's media counts (`index_towers`)
PLAN_COLUMNS = {"valid": ("valid", np.uint8), "vision": ("vision_units", np.int32), "tokens": ("llm_tokens", np.int32),
                "vit_patches": ("vit_patches", np.float32), "vit_attn_sq": ("vit_attn_sq", np.float32),
                "towers": (None, np.uint8)}
FORMAT = "v2"  # v2: towers; a file of another format is written again beside it
BATCH_ROWS = 1 << 20


def plan_columns_path(index: Path, fingerprint: str) -> Path:
    return index.with_name(f"{index.stem}.{fingerprint[:16]}.{FORMAT}.plan.arrow")


def write_plan_columns(batches, path: Path) -> None:
    """Write record batches of PLAN_COLUMNS (by planner name; towers, when absent, from the vision units) as
    the mapped file, atomically."""
    schema = pa.schema([(name, pa.from_numpy_dtype(dtype)) for name, (_, dtype) in PLAN_COLUMNS.items()])
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for columns in batches:
                if "towers" not in columns:
                    columns = {**columns, "towers": np.asarray(columns["vision"]) > 0}
                writer.write_batch(pa.record_batch([pa.array(np.asarray(columns[name], dtype=dtype))
                                                    for name, (_, dtype) in PLAN_COLUMNS.items()], schema=schema))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _index_batches(index: Path):
    """The index's planner columns, BATCH_ROWS at a time (never the whole column in memory)."""
    parquet = pq.ParquetFile(index, memory_map=True)
    check_sample_ids(parquet, index)
    names = [column for column, _ in PLAN_COLUMNS.values() if column]
    towers = [column for column in TOWER_COLUMNS if column in parquet.schema_arrow.names]
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=names + towers):
        columns = {name: batch.column(column).to_numpy(zero_copy_only=False)
                   for name, (column, _) in PLAN_COLUMNS.items() if column}
        yield {**columns, "towers": index_towers(batch, columns["vision"])}


def valid_mask(loads) -> np.ndarray:
    """Every sample's validity as a bool array, whether the loads hold it or gather it."""
    valid = loads.valid
    return valid if isinstance(valid, np.ndarray) else valid[np.arange(len(loads))]


class GatheredColumn:
    """One column of loads that are gathered, not held (MappedLoads, a mixture's RowLoads): `column[ids]` is
    `loads.gather(ids, (name,))[name]`, as indexing a numpy column would give."""

    def __init__(self, loads, name: str):
        self.loads, self.name = loads, name

    def __len__(self) -> int:
        return len(self.loads)

    def __getitem__(self, ids) -> np.ndarray:
        return self.loads.gather(np.asarray(ids, dtype=np.int64), (self.name,))[self.name]


class MappedLoads:
    """SampleLoads' columns read from the mapped file: `loads.vision[ids]` etc. gather as numpy arrays do, and
    `subset(ids)` gives a window's SampleLoads in one pass over the batches."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        base = pa.py_buffer(self._map)
        self._base_address = base.address
        reader = pa.ipc.open_file(pa.BufferReader(base))
        self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        sizes = np.array([batch.num_rows for batch in self._batches], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)])
        for name in PLAN_COLUMNS:
            setattr(self, name, GatheredColumn(self, name))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def gather(self, ids: np.ndarray, names=tuple(PLAN_COLUMNS)) -> dict[str, np.ndarray]:
        """Columns `names` at sample ids `ids` (in their order), reading each batch once and then releasing its
        pages from this process's resident memory."""
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"sample ids out of range 0..{len(self) - 1}")
        out = {name: np.empty(len(ids), dtype=PLAN_COLUMNS[name][1]) for name in names}
        batch_of = np.searchsorted(self._starts, ids, side="right") - 1
        order = np.argsort(batch_of.astype(np.uint32), kind="stable")  # a radix sort: linear in the ids
        bounds = np.searchsorted(batch_of[order], np.arange(len(self._batches) + 1))
        for b, batch in enumerate(self._batches):
            chosen = order[bounds[b]:bounds[b + 1]]
            if not len(chosen):
                continue
            local = ids[chosen] - self._starts[b]
            for name in names:
                column = batch.column(name)
                out[name][chosen] = column.to_numpy()[local]
                self._release(column.buffers()[1])
        if "valid" in out:
            out["valid"] = out["valid"].view(bool)
        return out

    def _release(self, buffer: pa.Buffer) -> None:
        start = buffer.address - self._base_address
        aligned = start - start % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, aligned, start + buffer.size - aligned)

    def subset(self, ids: np.ndarray) -> SampleLoads:
        columns = self.gather(np.asarray(ids, dtype=np.int64))
        return SampleLoads(**columns)


def map_sample_loads(index_path: str | Path) -> tuple[MappedLoads | SampleLoads, IndexInfo]:
    """The planner's columns of an index, memory-mapped (the file written first when missing). Where the
    index's folder is not writable, they are read into memory (load_sample_loads)."""
    from packfeed.server.plan.costs import load_sample_loads

    index = Path(index_path)
    info = read_index_info(index)
    if info.encoders or info.groups:  # the mapped file holds the five planner columns only: the others in memory
        return load_sample_loads(index)
    path = plan_columns_path(index, info.fingerprint)
    if not path.exists():
        try:
            write_plan_columns(_index_batches(index), path)
        except OSError:
            return load_sample_loads(index)
    return MappedLoads(path), info
