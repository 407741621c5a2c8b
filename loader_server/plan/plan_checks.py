"""What makes a table a plan: the checks `read_plan` runs on a plan file's rows before it trusts them (each
sample once, every pack inside the plan's ranks and microbatches and in order, each CP pack on the plan's GPUs),
refusing a file that fails one with its name and the first row that does."""

from __future__ import annotations

import numpy as np

from packfeed.v1.options import PlanConfig


def checked_cp(path, config: PlanConfig, table, empty: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Each member's CP degree d and cp_group g, checked to place its pack on GPUs [g*d, (g+1)*d) of the plan's
    C: d a power of 2 up to C, g below C / d; (None, None) without context parallelism, where every row must
    say d 1, g 0 (a CP plan's rows under settings without CP would run on fewer GPUs than planned)."""
    c = config.context_parallel
    if "cp" not in table.column_names or "cp_group" not in table.column_names:
        if c > 1:
            raise ValueError(f"{path}: the plan has context_parallel {c} but no cp / cp_group columns; "
                             "the file is not a plan")
        return None, None
    degree = table.column("cp").to_numpy()[~empty].astype(np.int64)
    group = table.column("cp_group").to_numpy()[~empty].astype(np.int64)
    bad = (degree < 1) | (degree > c) | ((degree & (degree - 1)) != 0) | (group < 0) | (group * degree + degree > c)
    if bad.any():
        row = int(np.flatnonzero(~empty)[np.argmax(bad)])
        raise ValueError(f"{path}: row {row} has cp {int(degree[np.argmax(bad)])}, cp_group "
                         f"{int(group[np.argmax(bad)])}: not a pack on the plan's context_parallel {c} GPUs (cp a "
                         f"power of 2 up to {c}, cp_group below {c} / cp); the file is not a plan of its settings")
    return (degree, group) if c > 1 else (None, None)


def checked_packs(path, config: PlanConfig, step: np.ndarray, rank: np.ndarray, microbatch: np.ndarray,
                   samples: np.ndarray) -> np.ndarray:
    """Each row's pack number, once the rows are checked to be a plan's."""
    bounds = {"step": (step, 2**62), "rank": (rank, config.dp), "microbatch": (microbatch, config.microbatches)}
    for column, (values, limit) in bounds.items():
        bad = (values < 0) | (values >= limit)
        if bad.any():
            row = int(np.argmax(bad))
            raise ValueError(f"{path}: row {row} has {column} {int(values[row])}, outside the plan's "
                             f"{config.dp} ranks x {config.microbatches} microbatches; the file is not a plan")
    pack = (step * config.dp + rank) * config.microbatches + microbatch
    if len(pack) > 1 and (np.diff(pack) < 0).any():
        raise ValueError(f"{path}: row {int(np.argmax(np.diff(pack) < 0)) + 1} is out of order (rows go by step, "
                         "rank, microbatch); the file is not a plan")
    if (samples < 0).any():
        raise ValueError(f"{path}: sample_id {int(samples[samples < 0][0])} in a pack not marked empty; "
                         "sample ids are rows of the index, >= 0")
    ids, counts = np.unique(samples, return_counts=True)
    if (counts > 1).any():
        first = int(np.argmax(counts > 1))
        raise ValueError(f"{path}: sample_id {int(ids[first])} is in {int(counts[first])} packs; a plan holds each "
                         "sample once per epoch")
    return pack
