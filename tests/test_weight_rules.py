"""The rules that set a window's mixture weights from reported losses: softmax over a temperature and DoReMi's excess
loss, each within its bounds on every weight and on how fast a weight moves; bad rules refused naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packfeed.server.mixture.weight_rules import WeightRule

NAMES = ["ocr", "chat", "math"]


def test_softmax_gives_the_hardest_dataset_the_most_weight_and_sharpens_as_the_temperature_falls():
    losses = np.array([2.0, 1.0, 1.5])
    warm = WeightRule("softmax", temperature=2.0).next_weights(np.ones(3) / 3, losses, NAMES)
    cold = WeightRule("softmax", temperature=0.25).next_weights(np.ones(3) / 3, losses, NAMES)
    expected = np.exp(losses / 2.0) / np.exp(losses / 2.0).sum()
    assert warm == pytest.approx(expected, abs=1e-9)
    assert np.argmax(warm) == 0 and np.argmin(warm) == 1 and cold[0] > warm[0] > 1 / 3
    assert WeightRule("softmax").next_weights(np.array([0.6, 0.3, 0.1]), np.ones(3), NAMES) == \
        pytest.approx([1 / 3] * 3, abs=1e-9)


def test_excess_loss_moves_weight_to_the_datasets_above_their_reference_as_doremi_does():
    rule = WeightRule("excess_loss", reference={"ocr": 1.0, "chat": 1.0, "math": 1.0}, step_size=0.5, smoothing=0.1)
    previous = np.array([0.5, 0.3, 0.2])
    losses = np.array([0.8, 1.6, 1.2])  # ocr below its reference: no excess
    doremi = previous * np.exp(0.5 * np.maximum(losses - 1.0, 0))
    doremi = 0.9 * doremi / doremi.sum() + 0.1 / 3
    assert rule.next_weights(previous, losses, NAMES) == pytest.approx(doremi, abs=1e-9)
    assert rule.next_weights(previous, np.array([0.5, 0.5, 0.5]), NAMES) == pytest.approx(0.9 * previous + 0.1 / 3)


def test_a_dataset_without_a_loss_keeps_its_weight_and_no_losses_change_nothing():
    rule = WeightRule("softmax")
    previous = np.array([0.5, 0.3, 0.2])
    moved = rule.next_weights(previous, np.array([1.0, math.nan, 3.0]), NAMES)
    assert moved[1] == pytest.approx(0.3) and moved[2] > moved[0] and moved.sum() == pytest.approx(1)
    assert rule.next_weights(previous, np.full(3, math.nan), NAMES) == pytest.approx(previous)


def test_weights_stay_within_their_bounds_and_move_at_most_max_change_whatever_the_losses():
    rng = np.random.default_rng(0)
    rule = WeightRule("softmax", temperature=0.05, min_weight=0.1, max_weight=0.6, max_change=0.05)
    weights = np.array([0.2, 0.3, 0.5])
    for _ in range(300):
        losses = rng.uniform(0, 5, 3)
        losses[rng.random(3) < 0.1] = math.nan
        moved = rule.next_weights(weights, losses, NAMES)
        assert moved.sum() == pytest.approx(1, abs=1e-9)
        assert (moved >= 0.1 - 1e-9).all() and (moved <= 0.6 + 1e-9).all()
        assert np.abs(moved - weights).max() <= 0.05 + 1e-9
        weights = moved
    unbounded = WeightRule("softmax", temperature=0.05).next_weights(np.array([0.2, 0.3, 0.5]),
                                                                     np.array([5.0, 0, 0]), NAMES)
    assert unbounded[0] > 0.99  # the bounds above did the holding


def test_bounds_win_over_max_change_where_the_start_lies_outside_them():
    rule = WeightRule("softmax", min_weight=0.2, max_weight=0.5, max_change=0.01)
    moved = rule.next_weights(np.array([1.0, 0.0, 0.0]), np.ones(3), NAMES)
    assert moved.max() <= 0.5 + 1e-9 and moved.min() >= 0.2 - 1e-9 and moved.sum() == pytest.approx(1)


def test_the_projection_is_the_nearest_point_within_the_bounds():
    rule = WeightRule("softmax", min_weight=0.1, max_weight=0.5)
    target = np.array([0.8, 0.15, 0.05])
    got = rule._bounded(target, np.ones(3) / 3)
    grid = [np.array([a, b, 1 - a - b]) for a in np.arange(0.1, 0.5001, 0.002) for b in np.arange(0.1, 0.5001, 0.002)
            if 0.1 - 1e-12 <= 1 - a - b <= 0.5 + 1e-12]
    best = min(grid, key=lambda w: np.square(w - target).sum())
    assert np.square(got - target).sum() <= np.square(best - target).sum() + 1e-9


@pytest.mark.parametrize("raw, message", [
    ({"name": "bandit"}, "is not a rule"),
    ("softmax", "is not a rule"),
    ({"name": "softmax", "temprature": 1}, "['temprature'] are unknown"),
    ({"name": "softmax", "temperature": 0}, "must be above 0"),
    ({"name": "softmax", "temperature": "hot"}, "rule temperature: 'hot' is not a finite number"),
    ({"name": "softmax", "min_weight": 0.5}, "no way to sum to 1"),
    ({"name": "softmax", "max_weight": 0.2}, "no way to sum to 1"),
    ({"name": "softmax", "max_change": 0}, "max_change in (0, 1]"),
    ({"name": "softmax", "reference": {"ocr": 1}}, "takes no reference"),
    ({"name": "excess_loss"}, "needs `reference:` with a loss for each dataset"),
    ({"name": "excess_loss", "reference": {"ocr": 1, "chat": 1}}, "needs `reference:`"),
    ({"name": "excess_loss", "reference": {"ocr": 1, "chat": 1, "math": float("nan")}}, "is not a finite number"),
])
def test_bad_rules_are_refused_naming_the_field(raw, message):
    with pytest.raises(ValueError, match="mixture file m.yaml") as refused:
        WeightRule.parse(raw, NAMES, "mixture file m.yaml")
    assert message in str(refused.value)


def test_a_rule_reads_as_given_and_its_fingerprint_basis_is_the_rule_alone():
    rule = WeightRule.parse({"name": "excess_loss", "reference": {"ocr": 1.1, "chat": 0.9, "math": 2},
                             "step_size": 0.5, "max_change": 0.1}, NAMES, "m")
    assert rule.reference == {"ocr": 1.1, "chat": 0.9, "math": 2.0} and rule.step_size == 0.5
    assert rule.to_dict()["max_change"] == 0.1 and "losses" not in rule.to_dict()


def test_wait_s_is_bounded_and_read_as_a_number_however_yaml_reads_it():
    import yaml

    names = ["ocr", "chat"]
    raw = yaml.safe_load("{name: softmax, wait_s: 1.0e3}")
    assert isinstance(raw["wait_s"], str)  # YAML 1.1 reads an exponent without its sign as a string
    assert WeightRule.parse(raw, names, "mix.yaml").wait_s == 1000.0
    with pytest.raises(ValueError, match=r"wait_s in \(0, 3600\] seconds \(it is 1e\+12\)"):
        WeightRule.parse(yaml.safe_load("{name: softmax, wait_s: 1.0e12}"), names, "mix.yaml")


@settings(max_examples=60, deadline=None)
@given(losses=st.lists(st.floats(-1.7e308, 1.7e308), min_size=3, max_size=3),
       temperature=st.floats(1e-308, 1e308), previous=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3))
def test_the_rules_are_finite_on_any_finite_losses_and_settings(losses, temperature, previous):
    names = ["a", "b", "c"]
    previous = np.array(previous) / sum(previous)
    for rule in (WeightRule("softmax", temperature=temperature, min_weight=0.05, max_change=0.5),
                 WeightRule("excess_loss", reference={"a": 0.0, "b": -1e308, "c": 1e308}, step_size=temperature,
                            smoothing=0.1)):
        chosen = rule.next_weights(previous, np.array(losses), names)
        assert np.isfinite(chosen).all() and chosen.sum() == pytest.approx(1) and (chosen >= 0).all()
