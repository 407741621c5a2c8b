"""Loss-driven mixture weights (issue [6/6]): the rule a mixture file names sets each window's weights from the
window before's and the per-dataset losses trainers reported (the server's reports and decisions:
`packfeed.server.serve.weight_ledger`).

    rule:
      name: softmax            # weights ~ exp(loss / temperature): the datasets the model finds hardest get more
      temperature: 0.5
      min_weight: 0.05         # bounds on every weight
      max_weight: 0.8
      max_change: 0.1          # the most any weight moves from one window to the next

    rule:
      name: excess_loss        # DoReMi: weights ~ previous * exp(step_size * max(loss - reference, 0))
      reference: {ocr: 1.10, chat: 0.85}   # a reference run's loss per dataset
      step_size: 1.0
      smoothing: 0.1           # mixed with uniform weights: (1 - c) w + c / k (DoReMi's c)

A dataset no loss was reported for keeps its previous weight, the others share the rest by the rule; with no losses at
all the weights stay. The result is the point within the bounds nearest the rule's weights (weights in [min_weight,
max_weight], none moving more than max_change, summing to 1); where the previous weights lie outside the bounds (a
schedule's start), the weight bounds win over max_change. A pure function of (previous weights, losses, rule).

Finite by construction, whatever finite losses and settings: the rules are computed in log space from differences
to the largest score (each term in [-inf, 0], so every exponential is in [0, 1] and the largest is 1), and a
result that is still not finite weights (it cannot be; guarded all the same) keeps the previous weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from packfeed.server.mixture.schedule import read_number

RuleName = Literal["softmax", "excess_loss"]
RULES: tuple[str, ...] = ("softmax", "excess_loss")
_NUMBERS = ("temperature", "step_size", "smoothing", "min_weight", "max_weight", "max_change", "wait_s")
MAX_WAIT_S = 3600.0  # the longest a window's decision may wait for its reports: past that it decides on what came


@dataclass(frozen=True)
class WeightRule:
    name: RuleName
    temperature: float = 1.0
    reference: dict[str, float] = field(default_factory=dict)
    step_size: float = 1.0
    smoothing: float = 0.0
    min_weight: float = 0.0
    max_weight: float = 1.0
    max_change: float = 1.0
    wait_s: float = 600.0  # how long planning a window waits for the losses of the window it is decided on

    @classmethod
    def parse(cls, raw: object, names: list[str], where: str) -> WeightRule:
        """The mixture file's `rule:`; errors name `where` and the field."""
        if not isinstance(raw, dict) or raw.get("name") not in RULES:
            given = raw.get("name") if isinstance(raw, dict) else raw
            raise ValueError(f"{where}: rule {given!r} is not a rule; give `rule: {{name: softmax or excess_loss, "
                             "...}}`")
        unknown = set(raw) - {"name", "reference", *_NUMBERS}
        if unknown:
            raise ValueError(f"{where}: rule fields {sorted(map(str, unknown))} are unknown; a rule has name, "
                             f"reference and {', '.join(_NUMBERS)}")
        numbers = {key: _number(raw[key], f"{where}: rule {key}") for key in _NUMBERS if key in raw}
        rule = cls(raw["name"], reference=_reference(raw.get("reference"), names, raw["name"], where), **numbers)
        rule.check(len(names), where)
        return rule

    def check(self, datasets: int, where: str) -> None:
        if not self.temperature > 0 or not self.step_size > 0 or not 0 < self.wait_s <= MAX_WAIT_S:
            raise ValueError(f"{where}: rule temperature and step_size must be above 0, wait_s in (0, "
                             f"{MAX_WAIT_S:g}] seconds (it is {self.wait_s:g})")
        if not 0 <= self.smoothing <= 1 or not 0 < self.max_change <= 1:
            raise ValueError(f"{where}: rule smoothing must be in [0, 1] and max_change in (0, 1]")
        if not 0 <= self.min_weight <= self.max_weight <= 1 or self.min_weight * datasets > 1 + 1e-12 \
                or self.max_weight * datasets < 1 - 1e-12:
            raise ValueError(f"{where}: rule bounds min_weight {self.min_weight:g} and max_weight "
                             f"{self.max_weight:g} leave {datasets} weights no way to sum to 1")

    def to_dict(self) -> dict:
        """What the plan's fingerprint covers: the rule, never the losses."""
        return {"name": self.name, "reference": dict(sorted(self.reference.items())),
                **{key: getattr(self, key) for key in _NUMBERS}}

    def next_weights(self, previous: np.ndarray, losses: np.ndarray, names: list[str]) -> np.ndarray:
        """The next window's weights from the previous window's and each dataset's mean loss (NaN: none reported)."""
        previous = np.asarray(previous, dtype=np.float64)
        losses = np.asarray(losses, dtype=np.float64)
        known = np.isfinite(losses)
        target = previous.copy()
        if known.any():
            with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
                if self.name == "softmax":  # exp(loss / T), as differences to the largest loss: in [-inf, 0]
                    scores = (losses[known] - losses[known].max()) / self.temperature
                else:  # previous * exp(step_size * excess), in log space
                    reference = np.array([self.reference[name] for name in names])[known]
                    excess = np.minimum(np.maximum(losses[known] - reference, 0.0), np.finfo(np.float64).max)
                    scores = np.log(np.maximum(previous[known], 1e-12)) + (excess - excess.max()) * self.step_size
                proposed = np.exp(scores - scores.max())
            proposed = (1 - self.smoothing) * proposed / proposed.sum() + self.smoothing / known.sum()
            target[known] = proposed * previous[known].sum() if (~known).any() else proposed
        chosen = self._bounded(target / target.sum(), previous)
        return chosen if np.isfinite(chosen).all() else previous / previous.sum()

    def _bounded(self, target: np.ndarray, previous: np.ndarray) -> np.ndarray:
        """The point nearest `target` with every weight in its bounds, summing to 1."""
        low, high = np.full(len(target), self.min_weight), np.full(len(target), self.max_weight)
        moved_low, moved_high = np.maximum(low, previous - self.max_change), np.minimum(high, previous + self.max_change)
        if moved_low.sum() <= 1 + 1e-12 and moved_high.sum() >= 1 - 1e-12:
            low, high = moved_low, moved_high
        return _project(target, low, high)


def _project(target: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {low <= w <= high, sum(w) = 1}: clip(target + t) with t found by bisection."""
    lo, hi = float((low - target).min()), float((high - target).max())
    for _ in range(100):
        middle = (lo + hi) / 2
        if np.clip(target + middle, low, high).sum() < 1:
            lo = middle
        else:
            hi = middle
    weights = np.clip(target + hi, low, high)
    return weights / weights.sum()


def _number(value: object, where: str) -> float:
    number = read_number(value)
    if not math.isfinite(number):
        raise ValueError(f"{where}: {value!r} is not a finite number")
    return number


def _reference(raw: object, names: list[str], rule: str, where: str) -> dict[str, float]:
    if rule != "excess_loss":
        if raw is not None:
            raise ValueError(f"{where}: rule {rule} takes no reference losses (excess_loss does)")
        return {}
    if not isinstance(raw, dict) or set(map(str, raw)) != set(names):
        raise ValueError(f"{where}: rule excess_loss needs `reference:` with a loss for each dataset "
                         f"({', '.join(names)}): a reference run's per-dataset losses")
    return {str(name): _number(loss, f"{where}: rule reference {name!r}") for name, loss in raw.items()}
