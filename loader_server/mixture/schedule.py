"""Mixture weights that move over a job (issue [6/6], first part): each dataset's weight as points over the job's
progress (0 to 1), linear between them or held until the next, and the exact sample counts a window draws.

    interpolate: linear          # or step
    datasets:
      ocr:  {index: ocr/index.parquet,  weights: {0.0: 0.8, 1.0: 0.2}}
      chat: {index: chat/index.parquet, weights: {0.0: 0.2, 1.0: 0.8}}

Weights are relative: at any progress they are divided by their sum. A window spanning progress [a, b) draws by
the weights at its middle, (a + b) / 2. Its counts follow them exactly: the largest-remainder rounding of the
window's samples, ties to the dataset listed first; a dataset never gives a window more samples than it holds
(no sample twice in a window), its excess going to the others by their weights. Pure functions of the schedule,
the window and the datasets' sizes: a resumed or failed-over job draws the same counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Interpolation = Literal["linear", "step"]
INTERPOLATIONS: tuple[str, ...] = ("linear", "step")


@dataclass(frozen=True)
class WeightSchedule:
    """Each dataset's weight points (progress, weight), progress ascending from 0."""

    names: tuple[str, ...]
    points: tuple[tuple[tuple[float, float], ...], ...]
    interpolate: Interpolation = "linear"

    @classmethod
    def parse(cls, specs: dict[str, object], interpolate: object = "linear", where: str = "mixture") -> WeightSchedule:
        """A schedule from each dataset's `weights:` mapping (progress -> weight); errors name `where` and the
        dataset."""
        if interpolate not in INTERPOLATIONS:
            raise ValueError(f"{where}: interpolate {interpolate!r}; give one of {', '.join(INTERPOLATIONS)}")
        names, points = [], []
        for name, given in specs.items():
            names.append(str(name))
            points.append(_points(given, interpolate, f"{where}: dataset {name!r}"))
        schedule = cls(tuple(names), tuple(points), interpolate)
        breaks = sorted({p for series in points for p, _ in series} | {1.0})
        for progress in breaks:  # the sum is piecewise linear (or constant): positive at every break, positive all along
            if not schedule.raw(progress).sum() > 0:
                raise ValueError(f"{where}: every weight is 0 at progress {progress}: at least one dataset must "
                                 "have a weight above 0 at every point of the job")
        return schedule

    def raw(self, progress: float) -> np.ndarray:
        """Each dataset's weight at `progress`, as given (not divided by their sum)."""
        return np.array([_at(series, progress, self.interpolate) for series in self.points])

    def weights(self, progress: float) -> np.ndarray:
        """The datasets' weights at `progress` (summing to 1)."""
        raw = self.raw(progress)
        return raw / raw.sum()

    def window_counts(self, window: int, windows: int, samples: int, sizes: list[int] | np.ndarray) -> np.ndarray:
        """How many samples each dataset gives window `window` of `windows` (of `samples` samples in all), by the
        weights at its middle; at most `sizes[d]` from dataset d."""
        if not 0 <= window < windows:
            raise ValueError(f"window {window} of {windows}")
        return exact_counts(self.weights((window + 0.5) / windows), samples, np.asarray(sizes, dtype=np.int64))


def exact_counts(weights: np.ndarray, total: int, sizes: np.ndarray) -> np.ndarray:
    """Integers summing to `total` that follow `weights` (largest remainders, ties to the lower index), none above
    its dataset's size: a full dataset gives all it has and the rest is shared again by the others' weights."""
    if total > int(sizes.sum()):
        raise ValueError(f"a window of {total} samples needs more than the {int(sizes.sum())} the datasets hold")
    counts = np.zeros(len(weights), dtype=np.int64)
    open_ = (weights > 0) & (sizes > 0)
    remaining = total
    while remaining:
        if not open_.any():  # the weighted datasets are exhausted: the rest from those weighted 0, by size
            open_ = counts < sizes
            part = np.where(open_, sizes - counts, 0).astype(np.float64)
        else:
            part = np.where(open_, weights, 0.0)
        want = _largest_remainders(part / part.sum(), remaining)
        take = np.minimum(want, sizes - counts)
        counts += take
        remaining -= int(take.sum())
        open_ &= counts < sizes
    return counts


def _largest_remainders(weights: np.ndarray, total: int) -> np.ndarray:
    exact = weights * total
    counts = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    order = np.lexsort((np.arange(len(weights)), -(exact - counts)))  # largest remainder first, then lower index
    counts[order[:short]] += 1
    return counts


def _points(given: object, interpolate: str, where: str) -> tuple[tuple[float, float], ...]:
    if not isinstance(given, dict) or not given:
        raise ValueError(f"{where}: weights must map progress (0 to 1) to a weight, e.g. {{0.0: 0.8, 1.0: 0.2}}")
    points = []
    for progress, weight in given.items():
        p, w = read_number(progress), read_number(weight)
        if not 0 <= p <= 1:
            raise ValueError(f"{where}: progress {progress!r} is not a number from 0 to 1 (the job's start to end)")
        if not w >= 0 or not math.isfinite(w):
            raise ValueError(f"{where}: weight {weight!r} at progress {progress}; give a number >= 0")
        points.append((p, w))
    points.sort()
    if points[0][0] != 0:
        raise ValueError(f"{where}: its weights start at progress {points[0][0]}, so the job's start has none: "
                         "give a weight at 0.0")
    if interpolate == "linear" and points[-1][0] != 1:
        raise ValueError(f"{where}: linear weights end at progress {points[-1][0]}, so the job's end has none: give "
                         "a weight at 1.0 (or interpolate: step, which holds the last weight to the end)")
    return tuple(points)


def read_number(value: object) -> float:
    """A number as a mixture file gives it: an int or float, or a string that reads as one (YAML reads `1.0e12`,
    without the exponent's sign, as a string); NaN for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return math.nan
    try:
        return float(value)
    except ValueError:
        return math.nan


def _at(series: tuple[tuple[float, float], ...], progress: float, interpolate: str) -> float:
    """The weight at `progress`: the last point at or before it when held; linear between its neighbours."""
    at = [p for p, _ in series]
    k = int(np.searchsorted(at, progress, side="right")) - 1
    if interpolate == "step" or k == len(series) - 1:
        return series[k][1]
    (p0, w0), (p1, w1) = series[k], series[k + 1]
    return w0 + (w1 - w0) * (progress - p0) / (p1 - p0)
