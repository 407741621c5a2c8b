"""Loss-driven mixture weights on a simulated run (issue [6/6]): three datasets whose synthetic loss falls as the model
sees their samples, windows drawn by `MixtureDraws` exactly as a server draws them, and each window's weights set by a
rule from the losses of the window two before (the one whose reports are complete when a window is planned ahead).

Loss of dataset d after seeing s_d of its samples: floor_d + span_d * exp(-s_d / scale_d), with
  ocr:  floor 0.6, span 2.0, scale  40,000  (hard at first, learnt fast)
  chat: floor 1.0, span 0.8, scale 150,000  (easy, learnt slowly)
  math: floor 1.4, span 1.4, scale 400,000  (hard and slow)
An epoch of 1,000,000 samples in windows of 50,000, starting from equal weights. DoReMi's reference losses are the
floors plus 0.2 (a reference model that learnt each dataset to near its floor).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_weight_rules.py -m benchmark
"""

from __future__ import annotations

import numpy as np
import pytest

from packfeed.server.mixture.draws import MixtureDraws
from packfeed.server.mixture.weight_rules import WeightRule

pytestmark = pytest.mark.benchmark
NAMES = ["ocr", "chat", "math"]
FLOOR, SPAN, SCALE = np.array([0.6, 1.0, 1.4]), np.array([2.0, 0.8, 1.4]), np.array([40e3, 150e3, 400e3])
SAMPLES, WINDOW = 1_000_000, 50_000


def simulate(rule: WeightRule) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each window's weights and the losses at its end."""
    weights, losses_after = [], []
    seen = np.zeros(3)

    class Simulated:  # the draws' weight source: the rule on the simulated losses
        def window_weights(self, epoch: int, window: int, progress: float, previous) -> np.ndarray:
            if window < 2:
                chosen = np.ones(3) / 3  # the schedule's start: no window's losses are complete yet
            else:
                chosen = rule.next_weights(weights[window - 1], losses_after[window - 2], NAMES)
            weights.append(chosen)
            return chosen

        def window_planned(self, epoch: int, window: int, steps: range) -> None:
            pass

    draws = MixtureDraws([np.arange(300_000)] * 3, SAMPLES, WINDOW, 0, 0, Simulated())
    for window in range(draws.n_windows):
        seen += draws.counts(window)
        losses_after.append(FLOOR + SPAN * np.exp(-seen / SCALE))
    return weights, losses_after


def test_the_rules_move_the_weights_as_the_losses_fall():
    rules = {"softmax T=0.5, bounds [0.1, 0.7], max_change 0.1":
             WeightRule("softmax", temperature=0.5, min_weight=0.1, max_weight=0.7, max_change=0.1),
             "excess_loss eta=2, smoothing 0.1, bounds [0.1, 0.7], max_change 0.1":
             WeightRule("excess_loss", reference=dict(zip(NAMES, (FLOOR + 0.2).tolist())), step_size=2.0,
                        smoothing=0.1, min_weight=0.1, max_weight=0.7, max_change=0.1)}
    print()
    for label, rule in rules.items():
        weights, losses = simulate(rule)
        print(f"[weight rules] {label}: window, weights ({', '.join(NAMES)}), losses at its end")
        for window in (0, 2, 3, 5, 8, 12, 19):
            print(f"  {window:2d}  " + "  ".join(f"{w:.3f}" for w in weights[window]) + "   " +
                  "  ".join(f"{loss:.3f}" for loss in losses[window]))
        final = losses[-1]
        uniform_weights, uniform_losses = simulate(WeightRule("softmax", temperature=1e9))
        print(f"  mean final loss {final.mean():.4f} (equal weights throughout: {uniform_losses[-1].mean():.4f}); "
              f"largest move between windows {max(np.abs(a - b).max() for a, b in zip(weights[1:], weights)):.3f}")
        stacked = np.array(weights)
        assert (stacked >= 0.1 - 1e-9).all() and (stacked <= 0.7 + 1e-9).all()
        assert np.abs(np.diff(stacked, axis=0)).max() <= 0.1 + 1e-9
        assert np.allclose(uniform_weights, 1 / 3)
