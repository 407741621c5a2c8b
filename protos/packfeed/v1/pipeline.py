"""The 1F1B pipeline order, the one definition the planner (which orders microbatches for it) and the trainer
(which runs it) share: stage s of P runs min(P - s - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. Pure Python, part of the contract."""

from __future__ import annotations

Op = tuple[str, int, int]  # ("F" | "B", chunk, microbatch); 1F1B runs one chunk per stage


def one_f_one_b(stage: int, stages: int, m: int) -> list[Op]:
    """Stage `stage`'s operations over `m` microbatches, in the order it runs them."""
    warmup = min(stages - stage - 1, m)
    order: list[Op] = [("F", 0, j) for j in range(warmup)]
    for j in range(m):
        if warmup + j < m:
            order.append(("F", 0, warmup + j))
        order.append(("B", 0, j))
    return order
