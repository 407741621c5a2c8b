"""Balance metrics exactly as DESIGN.md defines them (OmniBal eq. 1 and 2)."""

from __future__ import annotations

import numpy as np


def dist_ratio(rank_loads: np.ndarray) -> float:
    """Mean over steps of sum_d (T_max - T_d) / (T_max * D); rank_loads is (steps, D).

    Steps where every rank is idle (T_max = 0) are not counted: there is nothing to wait for.
    """
    waste, busy = dist_terms(rank_loads)
    return waste / busy if busy else 0.0


def step_waste(rank_loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step of rank_loads (steps, D): its waste sum_d (T_max - T_d) / (T_max * D) (0 where every rank is
    idle), and whether it is busy (T_max > 0)."""
    loads = np.asarray(rank_loads, dtype=np.float64)
    waste = np.zeros(len(loads))
    if loads.size == 0:
        return waste, waste > 0
    t_max = loads.max(axis=1)
    busy = t_max > 0
    waste[busy] = (t_max[busy, None] - loads[busy]).sum(axis=1) / (t_max[busy] * loads.shape[1])
    return waste, busy


def dist_terms(rank_loads: np.ndarray) -> tuple[float, int]:
    """dist_ratio's sum of per-step waste and its count of busy steps, to add up over parts of an epoch (a
    windowed plan's windows) without holding every step's loads at once."""
    waste, busy = step_waste(rank_loads)
    return float(waste.sum()), int(busy.sum())


def pad_ratio(batch_sizes: np.ndarray, batch_max: np.ndarray, batch_sum: np.ndarray) -> float:
    """Padding tokens over padded tokens, summed over mini-batches (sum_i (L_max - L_i) / (L_max * B)).

    Weighted by each mini-batch's padded size, as OmniBal's code reports it. Packed batches have 0.
    """
    padded = (np.asarray(batch_sizes, dtype=np.float64) * batch_max).sum()
    if padded == 0:
        return 0.0
    return float((padded - np.sum(batch_sum, dtype=np.float64)) / padded)
