"""One job's loss-driven weights: windows 0 and 1 take the schedule's, window w is decided from window w-1's weights
and the losses reported for window w-2's steps, waiting for every rank's reports (at most the rule's wait_s); bad
reports are counted and left out; a decision once recorded, or handed back by a resumed job, is kept."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from packfeed.server.mixture.weight_rules import WeightRule
from packfeed.server.serve.weight_ledger import LedgerClosed, WeightLedger

NAMES = ["ocr", "chat"]
STEPS = {0: range(0, 3), 1: range(3, 6), 2: range(6, 9), 3: range(9, 12)}  # each window's steps


def ledger(wait_s: float = 30.0) -> WeightLedger:
    return WeightLedger(WeightRule("softmax", temperature=0.5, wait_s=wait_s), NAMES, ranks=2,
                        start=lambda progress: np.array([0.8, 0.2]))


def decide(book: WeightLedger, window: int, epoch: int = 0) -> np.ndarray:
    """Window `window`'s weights, asked as a plan's draws ask: the windows before it planned (their steps told)."""
    for planned in range(window):
        book.window_planned(epoch, planned, STEPS[planned])
    return book.window_weights(epoch, window, 0.5, lambda w: decide(book, w, epoch))


def test_a_window_is_decided_on_the_reports_of_the_window_two_before():
    book = ledger()
    assert decide(book, 0) == pytest.approx([0.8, 0.2]) and decide(book, 1) == pytest.approx([0.8, 0.2])
    for step in STEPS[0]:
        for rank in range(2):
            assert book.report(rank, 0, step, {"ocr": 1.0, "chat": 2.0 + rank}, {"ocr": 10, "chat": 10}) is None
    mean = np.array([1.0, 2.5])  # chat: ranks 2.0 and 3.0, equal counts
    expected = np.exp(mean / 0.5) / np.exp(mean / 0.5).sum()
    assert decide(book, 2) == pytest.approx(expected)
    assert book.partial_windows == 0
    with pytest.raises(RuntimeError, match="window 0 is not planned yet"):  # its steps unknown: nothing to read
        ledger().window_weights(0, 2, 0.5, lambda w: np.array([0.8, 0.2]))


def test_deciding_waits_for_the_last_rank_and_a_rank_that_never_reports_costs_wait_s():
    book = ledger()
    for step in STEPS[0]:
        book.report(0, 0, step, {"ocr": 3.0, "chat": 1.0})
    for step in STEPS[0][:-1]:
        book.report(1, 0, step, {"ocr": 3.0, "chat": 1.0})
    decided = []
    deciding = threading.Thread(target=lambda: decided.append(decide(book, 2)))
    deciding.start()
    deciding.join(timeout=0.5)
    assert deciding.is_alive() and not decided  # one report short: it waits
    book.report(1, 0, STEPS[0][-1], {"ocr": 3.0, "chat": 1.0})
    deciding.join(timeout=30)
    assert decided and decided[0][0] > 0.9 and book.partial_windows == 0
    empty = ledger()  # a rank whose steps held no samples reports none, and completes the window all the same
    for step in STEPS[0]:
        empty.report(0, 0, step, {"ocr": 3.0, "chat": 1.0})
        assert empty.report(1, 0, step, {}) is None
    assert decide(empty, 2)[0] > 0.9 and empty.partial_windows == 0
    late = ledger(wait_s=0.3)  # nobody reports: decided on nothing after wait_s, the weights held
    assert decide(late, 2) == pytest.approx([0.8, 0.2]) and late.partial_windows == 1


def test_closing_the_job_frees_a_window_waiting_for_reports_and_decides_nothing():
    book = ledger(wait_s=600)  # far longer than the joins below: only close() can end the wait
    outcome = []

    def waiting() -> None:
        try:
            outcome.append(decide(book, 2))
        except LedgerClosed as error:
            outcome.append(error)

    deciding = threading.Thread(target=waiting)
    deciding.start()
    deciding.join(timeout=0.5)
    assert deciding.is_alive() and not outcome  # nobody reported window 0: it waits
    book.close()
    deciding.join(timeout=60)
    assert not deciding.is_alive() and isinstance(outcome[0], LedgerClosed), outcome
    assert 2 not in book.recorded().get(0, {}) and book.partial_windows == 0


@pytest.mark.parametrize("rank, losses, counts, reason", [
    (0, {"ocr": 1.0, "video": 2.0}, None, "dataset outside the mixture"),
    (0, {"ocr": math.nan}, None, "loss not a finite number"),
    (0, {"ocr": "1.0"}, None, "loss not a finite number"),
    (0, {"ocr": 1.0}, {"ocr": -3}, "negative count"),
    (0, {"ocr": 1.0}, {"chat": 3}, "dataset outside the mixture"),
    (5, {"ocr": 1.0}, None, "rank outside the job"),
])
def test_a_bad_report_is_counted_and_left_out(rank, losses, counts, reason):
    book = ledger(wait_s=0.2)
    assert book.report(rank, 0, 0, losses, counts) == reason
    assert book.ignored == {reason: 1}
    assert decide(book, 2) == pytest.approx([0.8, 0.2])  # nothing of it entered a decision


def test_a_recorded_decision_is_kept_and_a_restored_job_replays_it():
    book = ledger(wait_s=0.2)
    for step in STEPS[0]:
        for rank in range(2):
            book.report(rank, 0, step, {"ocr": 1.0, "chat": 4.0})
    first = decide(book, 2)
    for step in STEPS[0]:  # reports after the decision change nothing
        book.report(0, 0, step, {"ocr": 9.0, "chat": 0.0})
    assert decide(book, 2) == pytest.approx(first)
    resumed = ledger(wait_s=0.2)
    resumed.restore(book.recorded())
    assert decide(resumed, 2) == pytest.approx(first) and resumed.partial_windows == 0
    with pytest.raises(ValueError, match="not 2 weights >= 0 summing to 1"):
        resumed.restore({0: {3: [0.5, 0.6]}})


def test_a_window_is_decided_once_however_many_streams_wait_for_it():
    """Three threads (each stream's planning, a reconnected stream) ask for window 2 while its reports are
    missing: one decision, counted once as partial, and the same weights for all."""
    book = ledger(wait_s=0.5)
    decided = []
    waiting = [threading.Thread(target=lambda: decided.append(decide(book, 2))) for _ in range(3)]
    for thread in waiting:
        thread.start()
    for thread in waiting:
        thread.join(timeout=60)
    assert len(decided) == 3 and all(np.array_equal(d, decided[0]) for d in decided)
    assert book.partial_windows == 1


def test_a_huge_loss_leaves_the_weights_finite_and_the_job_resumable():
    """A finite but huge loss (1.5e308) is left out of the mean, counted; the rule itself stays finite on such
    losses and on a temperature of 1e-308; the decisions restore into a resumed job."""
    book = ledger(wait_s=0.3)
    assert book.report(0, 0, 0, {"ocr": 1.5e308, "chat": 1.0}) == "loss or count out of range"
    assert book.report(0, 0, 1, {"ocr": 1.0}, {"ocr": 1e300}) == "loss or count out of range"
    for step in STEPS[0]:
        for rank in range(2):
            book.report(rank, 0, step, {"ocr": 1e30, "chat": -1e30})  # the largest taken
    weights = decide(book, 2)
    assert np.isfinite(weights).all() and weights.sum() == pytest.approx(1) and weights[0] > 0.99
    resumed = ledger()
    resumed.restore(book.recorded())
    assert decide(resumed, 2) == pytest.approx(weights)
    cold = WeightRule("softmax", temperature=1e-308, min_weight=0.1, max_weight=0.9, max_change=0.2)
    for losses in ([1.5e308, -1.5e308], [1.5e308, 1.5e308], [-1.5e308, 0.0], [5e-324, 0.0]):
        chosen = cold.next_weights(np.array([0.5, 0.5]), np.array(losses), NAMES)
        assert np.isfinite(chosen).all() and chosen.sum() == pytest.approx(1), (losses, chosen)
        assert (chosen >= 0.1 - 1e-9).all() and (chosen <= 0.9 + 1e-9).all()
    excess = WeightRule("excess_loss", reference={"ocr": -1.5e308, "chat": 1.5e308}, step_size=1e308)
    chosen = excess.next_weights(np.array([0.5, 0.5]), np.array([1.5e308, -1.5e308]), NAMES)
    assert np.isfinite(chosen).all() and chosen[0] == pytest.approx(1)
