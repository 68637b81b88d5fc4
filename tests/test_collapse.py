"""The library's collapse definition (normlab.monitor.collapse) on synthetic loss traces: non-finite, back to chance,
never left chance, diverged (no chance loss), healthy."""

from __future__ import annotations

import math

import pytest

from normlab.monitor.collapse import CHANCE, LEARNED, CollapseLabel, CollapseTracker, label_collapse, loss_window

LN10 = math.log(10)


def classify_trace(losses, num_classes, window=10, finished=True):
    """(kind, step) of label_collapse with the chance loss of ``num_classes`` classes."""
    label = label_collapse(losses, math.log(num_classes), window=window, finished=finished)
    assert label.collapsed == (label.kind is not None)
    return label.kind, label.step


def test_healthy_run_is_not_a_collapse():
    losses = [LN10 * (1 - 0.9 * t / 200) for t in range(200)]
    assert classify_trace(losses, 10, window=10) == (None, None)


def test_non_finite_loss_is_a_collapse_at_its_step():
    losses = [2.0] * 5 + [float("nan")] + [2.0] * 5
    assert classify_trace(losses, 10) == ("non_finite", 5)
    assert classify_trace([1.0, None], 10) == ("non_finite", 1)
    assert classify_trace([1.0, float("inf")], 10) == ("non_finite", 1)


def test_return_to_chance_after_learning():
    learned = [0.5 * LN10] * 30
    back = [1.0 * LN10] * 30
    kind, step = classify_trace(learned + back, 10, window=10)
    assert kind == "returned_to_chance"
    # the collapse is dated at the first step of the window whose mean crossed 0.95 ln C
    means = [sum((learned + back)[i - 9 : i + 1]) / 10 for i in range(9, 60)]
    crossing = next(i for i, m in zip(range(9, 60), means) if m >= CHANCE * LN10)
    assert step == crossing - 9
    # worse than chance (a finite loss far above ln C) also counts
    assert classify_trace(learned + [5 * LN10] * 10, 10, window=10)[0] == "returned_to_chance"
    # never below LEARNED x ln C before: not a return (it never learned); ending at chance, it is a dead network
    assert classify_trace([0.85 * LN10] * 30 + back, 10, window=10) == ("never_left_chance", None)
    assert classify_trace([0.85 * LN10] * 30 + back, 10, window=10, finished=False) == (None, None)


def test_never_leaving_chance_is_a_dead_network_once_the_run_is_long_enough():
    dead = [LN10 * 1.001] * 40
    assert classify_trace(dead, 10, window=10) == ("never_left_chance", None)
    assert classify_trace(dead[:39], 10, window=10) == (None, None)  # under 4 windows: too short to judge
    assert classify_trace(dead, 10, window=10, finished=False) == (None, None)
    slow = [LN10 * 0.93] * 40  # below 0.95 ln C at the end: learning, slowly
    assert classify_trace(slow, 10, window=10) == (None, None)
    # it dipped below 0.95 ln C once but never learned (never below 0.8 ln C) and ends at chance: dead
    dipped = [LN10 * 0.9] * 10 + [LN10 * 1.0] * 30
    assert classify_trace(dipped, 10, window=10) == ("never_left_chance", None)


def test_tracker_reports_the_first_collapse_only_and_checks_its_arguments():
    t = CollapseTracker(LN10, window=2)
    assert t.update(0.1) is None and t.update(0.1) is None
    assert t.update(LN10) is None  # window mean (0.1 + ln10) / 2 < 0.95 ln 10
    assert t.update(LN10) == "returned_to_chance" and (t.kind, t.step) == ("returned_to_chance", 2)
    assert t.update(float("nan")) is None and t.kind == "returned_to_chance"
    assert LEARNED < CHANCE
    with pytest.raises(ValueError, match="chance_loss must be None or a finite number > 0"):
        CollapseTracker(0.0)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        CollapseTracker(LN10, window=0)


def test_loss_window_is_about_a_thousand_samples():
    assert loss_window(128) == 10 and loss_window(64) == 16 and loss_window(2) == 512 and loss_window(4096) == 10


def test_without_a_chance_loss_the_reference_is_the_starting_loss():
    start, learned = [4.0] * 10, [1.0] * 30
    label = label_collapse(start + learned + [4.0] * 20, window=10)
    assert label == CollapseLabel(True, label.step, "diverged")
    means = [sum((start + learned + [4.0] * 20)[i - 9 : i + 1]) / 10 for i in range(49, 60)]
    assert label.step == next(i for i, m in zip(range(49, 60), means) if m >= CHANCE * 4.0) - 9
    # never learning is no collapse without a chance loss (nothing to call dead against), non-finite still is
    assert label_collapse([4.0] * 60, window=10) == CollapseLabel(False, None, None)
    assert label_collapse([4.0, float("inf")], window=10) == CollapseLabel(True, 1, "non_finite")
    # a healthy run that keeps learning
    assert not label_collapse([4.0 * (1 - 0.8 * t / 100) for t in range(100)], window=10).collapsed


EXTREMES = [1e23, 1e24, 1e300, 1.7e308, 1e-300, 5e-324, 0.0]  # losses of a classifier: >= 0


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("where", [0, 3, 9, 25])
def test_one_extreme_finite_loss_anywhere_does_not_ruin_the_smoothed_loss(value, where):
    """The window mean is the mean of the window's values, whatever came before: a run that sits at chance after one
    huge (or tiny) finite loss is a dead network, and one that learned and came back is a return to chance."""
    if value > LN10:  # (a loss near 0 at chance is a net that learned something: not a dead-network case)
        dead = [LN10] * 60
        dead[where] = value
        assert classify_trace(dead, 10, window=10) == ("never_left_chance", None)
        t = CollapseTracker(LN10, window=10)
        for v in dead:
            t.update(v)
        assert t.smoothed() == pytest.approx(LN10) and t.at_chance()
    # learned, one extreme loss inside the learned stretch, then back at chance: dated where the window crosses
    trace = [0.3 * LN10] * 30 + [LN10] * 30
    trace[where] = value
    kind, step = classify_trace(trace, 10, window=10)
    if value > 0.95 * LN10 * 10 and 1 <= where < 30:
        # a huge loss after the run learned (its first losses are low) is itself a return to chance
        assert (kind, step) == ("returned_to_chance", max(0, where - 9))
    else:  # as without it: the first window of ten losses at chance
        assert (kind, step) == ("returned_to_chance", 30)


def test_the_first_example_of_the_report_is_a_dead_network():
    # a run at chance with one loss of 1e24: the running sum lost every other value and called it healthy
    assert label_collapse([2.3] * 5 + [1e24] + [2.3] * 60, LN10) == CollapseLabel(True, None, "never_left_chance")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), None])
@pytest.mark.parametrize("where", [0, 5, 9, 40])
def test_a_non_finite_loss_anywhere_in_the_window_is_a_collapse_at_its_step(bad, where):
    trace = [0.3 * LN10] * 50
    trace[where] = bad
    assert classify_trace(trace, 10, window=10) == ("non_finite", where)


def test_window_mean_is_exact_and_does_not_overflow():
    from normlab.monitor.collapse import window_mean

    assert window_mean([1.7e308] * 10) == pytest.approx(1.7e308)
    assert window_mean([1e23, 1.0, -1e23, 1.0]) == 0.5
    with pytest.raises(ValueError, match="window_mean: expected at least one loss"):
        window_mean([])


def test_the_guard_and_the_trainer_read_the_same_window_mean():
    """The guard's loss trend and the trainer's tracker (CollapseTracker) average a window the same way: one huge
    loss leaves no residue once it has left the window, and a window of the largest floats does not overflow."""
    from normlab.monitor.guard import LOSS_WINDOW, _LossTrend

    trend, tracker = _LossTrend(), CollapseTracker(LN10, window=LOSS_WINDOW)
    for v in [LN10] * 5 + [1e24] + [LN10] * 30:
        mean = trend.update(v)
        tracker.update(v)
        assert mean is None or mean == tracker.smoothed()
    assert trend.update(LN10) == pytest.approx(LN10)
    big = _LossTrend()
    assert [big.update(1.7e308) for _ in range(LOSS_WINDOW)][-1] == pytest.approx(1.7e308)
