"""Mixture weights over a job's progress (`packfeed.server.mixture.schedule`): interpolation, exact window counts
that follow the weights and never take a sample twice, and each bad schedule refused naming its dataset."""

from __future__ import annotations

import numpy as np
import pytest

from packfeed.server.mixture.schedule import WeightSchedule, exact_counts

ANNEAL = {"ocr": {0.0: 0.8, 1.0: 0.2}, "chat": {0.0: 0.2, 1.0: 0.8}}


def test_linear_weights_move_between_their_points_and_step_weights_hold():
    linear = WeightSchedule.parse(ANNEAL, "linear")
    assert linear.weights(0.0) == pytest.approx([0.8, 0.2])
    assert linear.weights(0.5) == pytest.approx([0.5, 0.5])
    assert linear.weights(1.0) == pytest.approx([0.2, 0.8])
    step = WeightSchedule.parse({"a": {0.0: 3, 0.5: 1}, "b": {0.0: 1}}, "step")
    assert step.weights(0.49) == pytest.approx([0.75, 0.25]) and step.weights(0.5) == pytest.approx([0.5, 0.5])
    assert step.weights(1.0) == pytest.approx([0.5, 0.5])  # the last point holds to the end


def test_window_counts_follow_the_weights_exactly_over_the_job():
    schedule = WeightSchedule.parse(ANNEAL, "linear")
    windows, samples = 10, 1001
    counts = np.array([schedule.window_counts(w, windows, samples, [10**6, 10**6]) for w in range(windows)])
    assert (counts.sum(axis=1) == samples).all()
    for w, row in enumerate(counts):  # each within one sample of its exact share, at the window's middle
        exact = schedule.weights((w + 0.5) / windows) * samples
        assert np.abs(row - exact).max() < 1
    assert counts[0, 0] > counts[-1, 0] and counts[0, 1] < counts[-1, 1]  # 80/20 moving to 20/80
    again = [schedule.window_counts(w, windows, samples, [10**6, 10**6]).tolist() for w in range(windows)]
    assert again == counts.tolist()


def test_a_dataset_never_gives_a_window_more_than_it_holds():
    counts = exact_counts(np.array([0.9, 0.1, 0.0]), 100, np.array([30, 200, 50]))
    assert counts.tolist() == [30, 70, 0]  # the excess goes to the other weighted dataset
    counts = exact_counts(np.array([1.0, 0.0]), 100, np.array([30, 200]))
    assert counts.tolist() == [30, 70]  # only a dataset weighted 0 is left: it fills the window
    with pytest.raises(ValueError, match="needs more than"):
        exact_counts(np.array([0.5, 0.5]), 100, np.array([30, 20]))
    assert exact_counts(np.array([1 / 3] * 3), 10, np.array([100] * 3)).tolist() == [4, 3, 3]  # ties: first


@pytest.mark.parametrize("specs, interpolate, message", [
    ({"a": {0.0: -1, 1.0: 1}, "b": {0.0: 1, 1.0: 1}}, "linear", "dataset 'a': weight -1"),
    ({"a": {0.0: 0, 1.0: 0}, "b": {0.0: 0, 1.0: 0}}, "linear", "every weight is 0"),
    ({"a": {0.2: 1, 1.0: 1}}, "linear", "give a weight at 0.0"),
    ({"a": {0.0: 1, 0.5: 1}}, "linear", "give a weight at 1.0"),
    ({"a": {0.0: 1, 1.5: 1}}, "linear", "progress 1.5"),
    ({"a": {0.0: "x", 1.0: 1}}, "linear", "weight 'x'"),
    ({"a": {0.0: 1}}, "cubic", "interpolate 'cubic'"),
    ({"a": 0.5}, "step", "weights must map progress"),
])
def test_bad_schedules_are_refused_naming_the_dataset(specs, interpolate, message):
    with pytest.raises(ValueError, match=message):
        WeightSchedule.parse(specs, interpolate, where="mixture file m.yaml")
