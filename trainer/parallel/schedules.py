"""The order each pipeline rank runs its operations in, ("F" | "B", chunk, microbatch) (chunk c of rank s is virtual
stage c * P + s, Megatron's interleaving; 1F1B and GPipe have one chunk), and how the encoder's work of a step
is shared among the ranks that run it in the bubbles (`split_tiles`, due by `encoder_deadlines`). The trainer
runs these orders (`bubbles`); the simulator times them (`packfeed.trainer.simulate`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from packfeed.v1.pipeline import Op, one_f_one_b

Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b"]
SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b")


def gpipe(stage: int, stages: int, m: int) -> list[Op]:
    return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]


def interleaved_1f1b(stage: int, stages: int, m: int, chunks: int) -> list[Op]:
    """Megatron's interleaved 1F1B: microbatches in groups of P, each group through every chunk in turn."""
    if m % stages:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the stages ({stages})")
    total = m * chunks

    def op(kind: str, k: int) -> Op:
        chunk = (k // stages) % chunks
        return kind, chunk if kind == "F" else chunks - 1 - chunk, (k // (stages * chunks)) * stages + k % stages

    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def pipeline_order(schedule: str, stage: int, stages: int, m: int, chunks: int = 1) -> list[Op]:
    if schedule == "interleaved_1f1b":
        return interleaved_1f1b(stage, stages, m, chunks)
    if chunks != 1:
        raise ValueError(f"{schedule} runs one chunk per stage; virtual stages need interleaved_1f1b")
    if schedule == "1f1b":
        return one_f_one_b(stage, stages, m)
    if schedule == "gpipe":
        return gpipe(stage, stages, m)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")


def split_tiles(tiles: Sequence[int], parts: int) -> np.ndarray:
    """(microbatches, parts) whole tiles per part: each microbatch's tiles split evenly, remainders to the
    parts with the fewest tiles so far (a balanced share of the step)."""
    shares = np.zeros((len(tiles), parts), dtype=np.int64)
    totals = np.zeros(parts, dtype=np.int64)
    for j, t in enumerate(tiles):
        shares[j] = int(t) // parts
        extra = int(t) % parts
        if extra:
            shares[j, np.argsort(totals, kind="stable")[:extra]] += 1
        totals += shares[j]
    return shares


def encoder_deadlines(schedule: str, stages: int, m: int, chunks: int = 1) -> dict[int, list[tuple[int, int]]]:
    """Microbatch j -> the backwards (chunk, i) right before which the first stage's order runs F(j): no rank
    can let the first stage reach F(j) before passing its own B(i), so a colocated encoder that finishes its
    share of j before its B(i) never makes the first stage wait (the rule `parallel.encoder=bubbles` runs)."""
    first = pipeline_order(schedule, 0, stages, m, chunks)
    due: dict[int, list[tuple[int, int]]] = {}
    for (kind, chunk, i), (next_kind, next_chunk, j) in zip(first, first[1:]):
        if next_kind == "F" and next_chunk == 0 and kind == "B":
            due.setdefault(j, []).append((chunk, i))
    return due
