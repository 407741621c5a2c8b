"""One job's loss-driven mixture weights (issue [6/6]): the per-dataset losses its trainers report, step by step,
and the weights each window was given, recorded before the window is drawn: serving state, the weight source of
its epochs' draws (`packfeed.server.mixture.draws.WindowWeights`), told each window's steps as its plan plans it.

Window w of an epoch is decided from window w-1's weights and the mean loss per dataset over the steps of window w-2
(the last window whose steps the trainers have surely trained when window w is planned, one window ahead of the
streams): `rule.next_weights`. Windows 0 and 1 take the schedule's weights (the mixture file's `weights:`, the start).
Deciding waits until every DP rank reported every step of window w-2, at most the rule's `wait_s`; then it decides
on what arrived and counts the window as decided on partial reports. A window is decided once: every other thread
asking for it meanwhile (each stream's planning, a reconnected stream) waits for that decision. A window once
decided keeps its weights: a decision handed back (`restore`: a resumed or failed-over job) is used as recorded, so
the same windows are drawn.

Bounds: a reported loss beyond +-MAX_LOSS or a count beyond MAX_COUNT is left out (no mean of them overflows), and
the ledger holds at most MAX_HELD reports of steps no window has been decided on yet (reports of steps past the
job's end are left out by the job: `serve.mixture_weights.report_losses`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from packfeed.server.mixture.weight_rules import WeightRule

log = logging.getLogger("packfeed.server")
MAX_LOSS = 1e30  # a per-dataset loss (or minus a reward) beyond this is not a loss: left out, counted
MAX_COUNT = 1e15  # tokens or samples a mean is over
MAX_HELD = 100_000  # reports held for windows not decided yet (a rank's step each)


class LedgerClosed(RuntimeError):
    """The job closed (closed, forgotten, or its server stopping) while a window waited for loss reports."""


class WeightLedger:
    def __init__(self, rule: WeightRule, names: list[str], ranks: int, start: Callable[[float], np.ndarray]):
        self.rule, self.names, self.ranks, self.start = rule, list(names), ranks, start
        self._index = {name: k for k, name in enumerate(self.names)}
        self._decided: dict[int, dict[int, np.ndarray]] = {}  # epoch -> window -> weights
        self._reports: dict[tuple[int, int], dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # (epoch, step) -> rank
        self._changed = threading.Condition()
        self.ignored: dict[str, int] = {}  # reports left out, by reason
        self.partial_windows = 0  # windows decided before every report of their basis arrived
        self._deciding: set[tuple[int, int]] = set()  # (epoch, window) being decided: other askers wait for it
        self._steps: dict[tuple[int, int], range] = {}  # (epoch, window) -> its steps, once planned
        self._closed = False

    def report(self, rank: int, epoch: int, step: int, losses: dict[str, float],
               counts: dict[str, float] | None = None) -> str | None:
        """A trainer's mean loss per dataset over one step (`counts`: what each mean is over, tokens or samples; 1
        each when not given; none at all: the rank's step held no samples, which completes its reports too). None
        when taken; else why it was left out (and counted), the job going on."""
        reason = self._refused(rank, losses, counts)
        if reason is None and (epoch, step) not in self._reports and len(self._reports) * self.ranks >= MAX_HELD:
            reason = "too many reports held ahead of the windows"
        if reason is not None:
            return self.ignore(reason)
        loss, weight = np.full(len(self.names), math.nan), np.zeros(len(self.names))
        for name, value in losses.items():
            loss[self._index[name]] = float(value)
            weight[self._index[name]] = float((counts or {}).get(name, 1.0))
        with self._changed:
            self._reports.setdefault((epoch, step), {})[rank] = (loss, weight)  # a repeated report replaces its twin
            self._changed.notify_all()
        return None

    def ignore(self, reason: str) -> str:
        """A report left out, counted by `reason`."""
        with self._changed:
            self.ignored[reason] = self.ignored.get(reason, 0) + 1
        return reason

    def _refused(self, rank: int, losses: dict, counts: dict | None) -> str | None:
        if not 0 <= rank < self.ranks:
            return "rank outside the job"
        if set(losses) - set(self._index) or set(counts or {}) - set(losses):
            return "dataset outside the mixture"
        values = list(losses.values()) + list((counts or {}).values())
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            return "loss not a finite number"
        if any(v < 0 for v in (counts or {}).values()):
            return "negative count"
        if any(abs(v) > MAX_LOSS for v in losses.values()) or any(v > MAX_COUNT for v in (counts or {}).values()):
            return "loss or count out of range"
        return None

    def window_planned(self, epoch: int, window: int, steps: range) -> None:
        """Window `window` of `epoch` was planned into `steps`: the decision of window `window` + 2 reads their
        losses."""
        with self._changed:
            self._steps[epoch, window] = steps

    def _steps_of(self, epoch: int, window: int) -> range:
        with self._changed:
            steps = self._steps.get((epoch, window))
        if steps is None:  # a plan plans windows in order, and tells each before the one two later is drawn
            raise RuntimeError(f"epoch {epoch}'s window {window} is not planned yet: its steps are not known")
        return steps

    def window_weights(self, epoch: int, window: int, progress: float,
                       previous: Callable[[int], np.ndarray]) -> np.ndarray:
        """Window `window`'s weights: as recorded, the schedule's for windows 0 and 1, else decided now (waiting for
        the reports of window `window` - 2's steps) and recorded. `previous(w)`: window w's weights."""
        with self._changed:  # one decision per window: another asker waits for it
            while (epoch, window) in self._deciding:
                self._check_open(f"epoch {epoch}'s window {window}")
                self._changed.wait(1.0)
            recorded = self._decided.get(epoch, {}).get(window)
            if recorded is not None:
                return recorded
            self._deciding.add((epoch, window))
        try:
            if window < 2:
                chosen = np.asarray(self.start(progress), dtype=np.float64)
                chosen = chosen / chosen.sum()
            else:
                losses = self._losses(epoch, self._steps_of(epoch, window - 2))
                chosen = self.rule.next_weights(previous(window - 1), losses, self.names)
            with self._changed:
                chosen = self._decided.setdefault(epoch, {}).setdefault(window, chosen)  # a restored one wins
                self._forget(epoch, self._steps_of(epoch, window - 2).start if window >= 2 else 0)
            return chosen
        finally:
            with self._changed:
                self._deciding.discard((epoch, window))
                self._changed.notify_all()

    def _check_open(self, waiting: str) -> None:
        if self._closed:  # nobody will report any more: decide nothing, and free the waiting thread
            raise LedgerClosed(f"the job closed while {waiting} waited for loss reports")

    def _losses(self, epoch: int, steps: range) -> np.ndarray:
        """Mean loss per dataset over `steps`, weighted by the reports' counts; NaN where none reported it."""
        deadline = time.monotonic() + self.rule.wait_s
        with self._changed:
            while not self._complete(epoch, steps):
                self._check_open(f"epoch {epoch}'s window after steps {steps.start}-{steps.stop - 1}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self.partial_windows += 1
                    missing = [(step, sorted(set(range(self.ranks)) - set(self._reports.get((epoch, step), {}))))
                               for step in steps if len(self._reports.get((epoch, step), {})) < self.ranks]
                    log.warning("a window's weights decided without every rank's loss reports",
                                extra={"epoch": epoch, "steps": [steps.start, steps.stop],
                                       "missing_steps_and_ranks": missing[:20], "wait_s": self.rule.wait_s})
                    break
                self._changed.wait(min(left, 1.0))
            totals, counts = np.zeros(len(self.names)), np.zeros(len(self.names))
            for step in steps:
                for loss, weight in self._reports.get((epoch, step), {}).values():
                    known = np.isfinite(loss)
                    totals[known] += loss[known] * weight[known]
                    counts[known] += weight[known]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, totals / np.maximum(counts, 1e-300), math.nan)

    def close(self) -> None:
        """The job is closing: a decision waiting for reports stops waiting (`LedgerClosed`), at once, so a server
        stops without waiting out wait_s."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _complete(self, epoch: int, steps: range) -> bool:
        return all(len(self._reports.get((epoch, step), {})) == self.ranks for step in steps)

    def _forget(self, epoch: int, before: int) -> None:
        """Reports no later window is decided on: those before the basis of the window just decided."""
        for key in [key for key in self._reports if key < (epoch, before)]:
            del self._reports[key]

    def recorded(self) -> dict[int, dict[int, list[float]]]:
        """Every decided window's weights, per epoch and window, as a resumed job hands them back (`restore`)."""
        with self._changed:
            return {epoch: {w: windows[w].tolist() for w in sorted(windows)} for epoch, windows in self._decided.items()}

    def restore(self, recorded: dict[int, dict[int, list[float]]]) -> None:
        """Decisions an earlier run of the job recorded, checked: one weight per dataset, finite, >= 0, summing to
        1, and none against a decision taken here already."""
        for epoch, windows in recorded.items():
            for window, weights in windows.items():
                weights = np.asarray(weights, dtype=np.float64)
                if weights.shape != (len(self.names),) or not np.isfinite(weights).all() or (weights < 0).any() \
                        or abs(weights.sum() - 1) > 1e-6:
                    raise ValueError(f"recorded weights of epoch {epoch}, window {window} are not {len(self.names)} "
                                     f"weights >= 0 summing to 1: {weights.tolist()}")
                with self._changed:
                    known = self._decided.setdefault(int(epoch), {}).setdefault(int(window), weights)
                if not np.allclose(known, weights, rtol=0, atol=1e-9):
                    raise ValueError(f"epoch {epoch}, window {window} was decided as {known.tolist()} here, not as "
                                     f"the recorded {weights.tolist()}: the states are of another run of the job")
