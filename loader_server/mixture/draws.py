"""The rows of a mixture whose weights move (issue [6/6]): window by window, each dataset gives the count its
weights at that window call for (`schedule.exact_counts`), as the next samples of the dataset's own stream.

A dataset's stream is its valid samples in passes. Pass p is an affine permutation of them drawn from (seed, epoch,
dataset, p): every valid sample once per pass, a new order each pass. Where a window's draw crosses from one pass
into the next, the samples it took from the end of the old pass are put last in the new one, so no window draws a
sample twice (a window never takes more from a dataset than it holds). These are today's repeat rules for moving
weights: a dataset drawn R times its size over an epoch gives each of its valid samples floor(R) or ceil(R) times,
and none again before all of its samples were drawn since.

Everything is a pure function of (the datasets' valid samples, seed, epoch, the window size and each window's
weights): a resumed or failed-over job that knows the weights draws the same rows. Nothing per sample is held but
the drawn windows' rows (12 bytes a row, as a fixed mixture's epoch) and the few samples deferred at pass ends.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from packfeed.server.mixture.schedule import exact_counts

_DRAW_STREAM = 0xD8A3  # random stream of the passes' orders, apart from the planner's and the subsets'


class DatasetStream:
    """One dataset's stream of draws: `take(start, count)` gives the sample ids at positions [start, start+count).
    `span_at(position)`: (start, count) of the window whose draw holds `position`, where a pass ends inside one."""

    def __init__(self, valid: np.ndarray, key: tuple[int, ...], span_at: Callable[[int], tuple[int, int]]):
        self.valid = np.asarray(valid, dtype=np.int64)
        self.n, self.key, self.span_at = len(self.valid), key, span_at
        self._orders: dict[int, tuple[int, int, int]] = {}  # pass -> (a, b, a's inverse mod n)
        self._deferred: dict[int, tuple[np.ndarray, np.ndarray]] = {0: (np.zeros(0, np.int64),) * 2}

    def take(self, start: int, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, np.int64)
        positions = np.arange(start, start + count, dtype=np.int64)
        passes = positions // self.n
        out = np.empty(count, dtype=np.int64)
        for p in np.unique(passes).tolist():
            chosen = passes == p
            out[chosen] = self._in_pass(p, positions[chosen] - p * self.n)
        return out

    def _affine(self, p: int) -> tuple[int, int, int]:
        if p not in self._orders:
            rng = np.random.default_rng(np.random.SeedSequence([*self.key, _DRAW_STREAM, p]))
            a = 1
            while self.n > 1:
                a = int(rng.integers(1, self.n))
                if math.gcd(a, self.n) == 1:
                    break
            b = int(rng.integers(0, self.n)) if self.n > 1 else 0
            self._orders[p] = (a, b, pow(a, -1, self.n) if self.n > 1 else 0)
        return self._orders[p]

    def _in_pass(self, p: int, offsets: np.ndarray) -> np.ndarray:
        """The samples at `offsets` of pass p's order: its permutation without the samples deferred from pass p-1,
        then those, in the order pass p-1 had them."""
        a, b, _ = self._affine(p)
        deferred, deferred_at = self._deferred_into(p)
        kept = self.n - len(deferred)
        head = offsets < kept
        out = np.empty(len(offsets), dtype=np.int64)
        # the q-th position of the permutation that is not a deferred sample's: q plus the deferred before it
        shifted = deferred_at - np.arange(len(deferred_at))
        q = offsets[head]
        positions = q + np.searchsorted(shifted, q, side="right")
        out[head] = self.valid[(positions * a + b) % self.n]
        out[~head] = deferred[offsets[~head] - kept]
        return out

    def _deferred_into(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(samples, their sorted positions in pass p's permutation) that pass p puts last: those the window
        crossing into it took from the end of pass p-1. Computed pass after pass, each from the one before."""
        for q in range(max(self._deferred) + 1, p + 1):
            boundary = q * self.n
            start, count = self.span_at(boundary)
            if start < boundary < start + count:
                samples = self._in_pass(q - 1, np.arange(start - (q - 1) * self.n, self.n, dtype=np.int64))
                a, b, inverse = self._affine(q)
                at = np.sort(((np.searchsorted(self.valid, samples) - b) % self.n) * inverse % self.n)
                self._deferred[q] = (samples, at)
            else:
                self._deferred[q] = self._deferred[0]
        return self._deferred[p]


class WindowWeights(Protocol):
    """Where a moving mixture's window weights come from, one source per epoch's draws: the mixture's schedule
    (`Scheduled`), or a job's ledger deciding them from its trainers' loss reports
    (`packfeed.server.serve.weight_ledger.WeightLedger`)."""

    def window_weights(self, epoch: int, window: int, progress: float,
                       previous: Callable[[int], np.ndarray]) -> np.ndarray:
        """Window `window`'s weights (`progress`: the job's, at the window's middle; `previous(w)`: window w's
        weights, for w < window)."""
        ...

    def window_planned(self, epoch: int, window: int, steps: range) -> None:
        """Window `window` of `epoch` was planned into `steps` (what a later decision reads the losses of)."""
        ...


@dataclass(frozen=True)
class Scheduled:
    """The weights a schedule sets at each window's middle (`schedule.WeightSchedule.weights`)."""

    weights: Callable[[float], np.ndarray]

    def window_weights(self, epoch: int, window: int, progress: float,
                       previous: Callable[[int], np.ndarray]) -> np.ndarray:
        return self.weights(progress)

    def window_planned(self, epoch: int, window: int, steps: range) -> None:
        pass


class MixtureDraws:
    """Each window's rows of a moving mixture: (dataset, sample id there), the datasets in their listed order.
    `source` gives each window's weights (`WindowWeights`); windows are drawn in order, each once."""

    def __init__(self, valid: list[np.ndarray], samples: int, window: int, seed: int, epoch: int,
                 source: WindowWeights):
        if window < 1 or samples < 1:
            raise ValueError(f"a moving mixture draws windows of at least one sample (window {window}, "
                             f"samples {samples})")
        self.sizes = np.array([len(v) for v in valid], dtype=np.int64)
        if min(window, samples) > self.sizes.sum():
            raise ValueError(f"a window of {min(window, samples):,} samples is more than the mixture's {int(self.sizes.sum()):,} valid "
                             "samples: no window may hold a sample twice; give a smaller window")
        self.samples, self.window, self.epoch, self.source = samples, window, epoch, source
        self.n_windows = math.ceil(samples / window)
        self._counts: list[np.ndarray] = []  # per drawn window, its count from each dataset
        self._weights: list[np.ndarray] = []  # per drawn window, its weights (summing to 1)
        self._starts = [np.zeros(len(valid), np.int64)]  # per window, each dataset's stream position before it
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()
        self.streams = [DatasetStream(v, (seed, epoch, k), self._span_of(k)) for k, v in enumerate(valid)]

    def window_samples(self, window: int) -> int:
        return min(self.window, self.samples - window * self.window)

    def progress(self, window: int) -> float:
        """The job's progress (0 to 1) at the middle of window `window`'s samples."""
        return (window * self.window + self.window_samples(window) / 2) / self.samples

    @property
    def decided(self) -> int:
        """Windows whose weights are known (0 to this, in order)."""
        return len(self._counts)

    def counts(self, window: int) -> np.ndarray:
        """Window `window`'s count from each dataset (the windows before it are counted first). A window's weights
        are asked for with no lock held: a loss-driven one's may wait for reports (`WeightLedger`), and two threads
        asking for one window get the same weights."""
        while True:
            with self._lock:
                if window < len(self._counts):
                    return self._counts[window]
                w = len(self._counts)
            weights = np.asarray(self.source.window_weights(self.epoch, w, self.progress(w), self.weights),
                                 dtype=np.float64)
            with self._lock:
                if len(self._counts) == w:
                    self._weights.append(weights / weights.sum())
                    self._counts.append(exact_counts(self._weights[-1], self.window_samples(w), self.sizes))
                    self._starts.append(self._starts[-1] + self._counts[-1])

    def weights(self, window: int) -> np.ndarray:
        """Window `window`'s weights, divided by their sum."""
        self.counts(window)
        return self._weights[window]

    def describe(self, window: int, names: list[str]) -> dict:
        """A window's weights and draws, as summaries and the job's status give them."""
        return {"window": window, "progress": round(self.progress(window), 6),
                "weights": {name: round(float(w), 6) for name, w in zip(names, self.weights(window))},
                "drawn": {name: int(c) for name, c in zip(names, self.counts(window))}}

    def rows(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset int32, sample id int64) of the window's rows, dataset by dataset."""
        if window not in self._rows:
            counts = self.counts(window)
            starts = self._starts[window]
            datasets = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
            ids = [stream.take(int(s), int(c)) for stream, s, c in zip(self.streams, starts, counts)]
            self._rows[window] = (datasets, np.concatenate(ids) if ids else np.zeros(0, np.int64))
        return self._rows[window]

    def _span_of(self, dataset: int) -> Callable[[int], tuple[int, int]]:
        def span_at(position: int) -> tuple[int, int]:
            """(start, count) of the window whose draw from `dataset` holds stream position `position`."""
            w = 0
            while True:
                count = int(self.counts(w)[dataset])
                start = int(self._starts[w][dataset])
                if position < start + count or w + 1 == self.n_windows:
                    return start, count
                w += 1
        return span_at


class DrawnColumn:
    """A column of the drawn rows (`datasets` or `sample_ids`) indexed by global row id, as a numpy column would
    be: row r is row r % window of window r // window."""

    def __init__(self, draws: MixtureDraws, which: int):
        self.draws, self.which = draws, which

    def __len__(self) -> int:
        return self.draws.samples

    def __getitem__(self, rows) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        windows = rows // self.draws.window
        out = np.empty(rows.shape, dtype=np.int32 if self.which == 0 else np.int64)
        for w in np.unique(windows).tolist():
            chosen = windows == w
            out[chosen] = self.draws.rows(w)[self.which][rows[chosen] - w * self.draws.window]
        return out


def drawn_again(rows, carried: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """Mask of the `carried` rows (a windowed plan's, into a window that drew `drawn`) whose sample the window drew
    itself, or another carried row holds (a dataset drawn whole in a row of windows): they go one window further, so
    a window serves each sample at most once. `rows`: with `datasets` and `sample_ids` columns (RowLoads)."""
    again = np.zeros(len(carried), bool)
    if not len(carried):
        return again
    datasets, ids = rows.datasets[carried], rows.sample_ids[carried]
    drawn_datasets, drawn_ids = rows.datasets[drawn], rows.sample_ids[drawn]
    for k in np.unique(datasets).tolist():  # a mask per dataset: linear in the window, where isin sorts it
        mine = np.flatnonzero(datasets == k)
        theirs = drawn_ids[drawn_datasets == k]
        seen = np.zeros(int(max(ids[mine].max(), theirs.max(initial=-1))) + 1, bool)
        seen[theirs] = True
        again[mine] = seen[ids[mine]]
        first = np.unique(ids[mine], return_index=True)[1]  # of carried twins, the first stays
        again[np.setdiff1d(mine, mine[first])] = True
    return again
