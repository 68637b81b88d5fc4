"""The library's failure taxonomy (normlab.monitor.collapse) on synthetic loss traces: non-finite, exploded, back to
chance, never left chance (chance known or estimated by the first loss), healthy; its one definition of the window."""

from __future__ import annotations

import math

import pytest

from normlab.monitor.collapse import (
    KINDS,
    CollapseCriteria,
    CollapseLabel,
    CollapseTracker,
    Failure,
    label_collapse,
)

LN10 = math.log(10)
CHANCE, LEARNED = CollapseCriteria().at_chance, CollapseCriteria().learned


def crit(chance=None, window=10):
    return CollapseCriteria(chance_loss=chance, window=window)


def classify_trace(losses, num_classes, window=10, finished=True):
    """(kind, step) of label_collapse with the chance loss of ``num_classes`` classes."""
    label = label_collapse(losses, crit(math.log(num_classes), window), finished=finished)
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
    # above chance (a finite loss 9 x ln C, short of an explosion) also counts, in words that say so
    above = label_collapse(learned + [9 * LN10] * 10, crit(LN10))
    assert above.kind == "returned_to_chance" and above.failure.message.startswith("loss back above chance from step")
    # a jump that takes the very window that crosses to 10 x ln C or more is an explosion, dated to the first loss
    # that high; a slower rise is a return to chance first (the first failure in step order)
    assert classify_trace(learned + [200 * LN10] * 10, 10, window=10) == ("exploded", 30)
    assert classify_trace(learned + [20 * LN10] * 10, 10, window=10) == ("returned_to_chance", 21)
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
    t = CollapseTracker(crit(LN10, window=2))
    assert t.update(0.1) is None and t.update(0.1) is None
    assert t.update(LN10) is None  # window mean (0.1 + ln10) / 2 < 0.95 ln 10
    assert t.update(LN10).kind == "returned_to_chance" and (t.kind, t.step) == ("returned_to_chance", 2)
    assert t.update(float("nan")) is None and t.kind == "returned_to_chance"
    assert LEARNED < CHANCE


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"chance_loss": 0.0}, "chance_loss must be None or a finite number > 0"),
        ({"chance_loss": math.inf}, "chance_loss must be None or a finite number > 0"),
        ({"window": 0}, "window must be an int >= 1"),
        ({"min_windows": 0}, "min_windows must be an int >= 1"),
        ({"learned": 0.99}, r"learned must be a number in \(0, at_chance\)"),
        ({"at_chance": 20.0}, "at_chance must be a number below exploded"),
        ({"exploded": 1.0, "at_chance": 0.9}, "exploded must be a finite number > 1"),
    ],
)
def test_bad_criteria_are_one_line_errors(kw, words):
    with pytest.raises(ValueError, match=words) as e:
        CollapseCriteria(**kw)
    assert str(e.value).startswith("CollapseCriteria:") and "\n" not in str(e.value)
    with pytest.raises(TypeError, match="criteria must be a CollapseCriteria"):
        CollapseTracker(LN10)


def test_the_window_in_steps_or_in_examples():
    """``over_examples`` sets the window from a number of examples (at least 10 steps), and every count of steps of
    the definition follows it: the never-learned test waits min_windows windows, not a fixed 40 steps."""
    by_batch = {b: CollapseCriteria.over_examples(b).window for b in (128, 64, 2, 4096)}
    assert by_batch == {128: 10, 64: 16, 2: 512, 4096: 10}
    small = CollapseCriteria.over_examples(32, chance_loss=LN10)  # a 32-step window: dead only after 128 steps
    assert small.dead_after == 4 * 32
    dead = [LN10] * 127
    assert label_collapse(dead, small).kind is None and label_collapse(dead + [LN10], small).kind == "never_left_chance"
    assert CollapseCriteria.over_examples(64, examples=320).window == 10
    with pytest.raises(ValueError, match="over_examples: batch_size must be an int >= 1"):
        CollapseCriteria.over_examples(0)


def test_without_a_chance_loss_the_first_loss_stands_in_for_chance():
    start, learned = [4.0] * 10, [1.0] * 30
    label = label_collapse(start + learned + [4.0] * 20, crit())
    assert label == CollapseLabel(True, label.step, "returned_to_chance")
    assert "its starting loss (standing in for chance) 4" in label.failure.message
    means = [sum((start + learned + [4.0] * 20)[i - 9 : i + 1]) / 10 for i in range(49, 60)]
    assert label.step == next(i for i, m in zip(range(49, 60), means) if m >= CHANCE * 4.0) - 9
    # a net that never learns is judged against its start too (estimated chance), non-finite still counts
    never = label_collapse([4.0] * 60, crit())
    assert never == CollapseLabel(True, None, "never_left_chance") and "standing in for chance" in never.failure.message
    assert label_collapse([4.0, float("inf")], crit()) == CollapseLabel(True, 1, "non_finite")
    # a healthy run that keeps learning
    assert not label_collapse([4.0 * (1 - 0.8 * t / 100) for t in range(100)], crit()).collapsed


EXTREMES = [1e23, 1e24, 1e300, 1.7e308, 1e-300, 5e-324, 0.0]  # losses of a classifier: >= 0


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("where", [0, 3, 9, 25])
def test_one_extreme_finite_loss_anywhere_does_not_ruin_the_smoothed_loss(value, where):
    """The window mean is the mean of the window's values, whatever came before: a run that sits at chance after one
    huge (or tiny) finite loss is a dead network, and one that learned and came back is a return to chance."""
    # one such loss makes a 10-step mean an explosion (10 x chance or more); as the first loss it is the start, and the
    # explosion is measured from the larger of chance and the start
    huge = value >= 10 * 10 * LN10 and where > 0
    if value > LN10:  # (a loss near 0 at chance is a net that learned something: not a dead-network case)
        dead = [LN10] * 60
        dead[where] = value
        assert classify_trace(dead, 10, window=10) == (("exploded", where) if huge else ("never_left_chance", None))
        t = CollapseTracker(crit(LN10))
        for v in dead[where + 10 :]:  # the smoothed loss of a window without it
            t.update(v)
        assert t.smoothed() == pytest.approx(LN10) and t.at_chance()
    # learned, one extreme loss inside the learned stretch, then back at chance
    trace = [0.3 * LN10] * 30 + [LN10] * 30
    trace[where] = value
    kind, step = classify_trace(trace, 10, window=10)
    if huge and where < 30:
        assert (kind, step) == ("exploded", where)  # the spike is itself an explosion, dated to its own step
    else:  # as without it: the first window of ten losses at chance
        assert (kind, step) == ("returned_to_chance", 30)


def test_the_first_example_of_the_report_is_not_called_healthy():
    # a run at chance with one loss of 1e24: the running sum lost every other value and called it healthy; the window
    # mean sees a 1e23 mean: an explosion at that step
    assert label_collapse([2.3] * 5 + [1e24] + [2.3] * 60, crit(LN10)) == CollapseLabel(True, 5, "exploded")


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


def test_the_guard_reads_the_same_tracker_as_the_label():
    """The guard's failure tracker is a CollapseTracker with the guard's criteria: it finds what label_collapse finds,
    at the same step, on the same losses (one definition, no second implementation)."""
    import torch

    from normlab.monitor import CollapseGuard, RescueOptions

    trace = [2.3] * 10 + [0.5] * 20 + [2.2] * 10
    label = label_collapse(trace, crit(2.3))
    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    guard = CollapseGuard(net, opt, criteria=crit(2.3), rescue=RescueOptions(check_every=1))
    assert isinstance(guard.tracker, CollapseTracker)
    for v in trace:
        guard.observe_loss(v)
        opt.step()
        if guard.rolled_back:
            break
    (r,) = guard.rescues
    assert (r.kind, r.onset) == (label.kind, label.step) and r.reason == label.failure.message


def test_a_finite_explosion_that_never_learned_is_labelled_without_a_chance_loss():
    """The pre-LN transformer of the report: AdamW at lr 1 took the loss from 3.0 to 20,411 without a non-finite
    value and without learning first; the label (no chance loss) calls it an explosion, with words that say above."""
    trace = [3.0, 1290.0, 1.04e4, 1.34e4, 2.81e4, 4.82e4] + [2.0e4] * 30
    label = label_collapse(trace)
    assert (label.kind, label.step) == ("exploded", 1)
    assert label.failure.message.startswith("loss exploded from step 1: 10-step mean")
    assert "at chance" not in label.failure.message
    # with the chance loss the same, and a run that starts above chance is measured from its start
    assert label_collapse(trace, crit(math.log(16))).kind == "exploded"
    high_start = [50.0] * 10 + [45.0] * 30  # starts at 18 x ln 16 and never moves: not an explosion
    assert label_collapse(high_start, crit(math.log(16))).kind != "exploded"


@pytest.mark.parametrize(
    "chance, words",
    [
        (None, "x its starting loss (3, standing in for chance)"),
        (2.0, "x its starting loss (3, above chance 2)"),
        (4.0, "x chance (4)"),
    ],
)
def test_an_explosion_names_the_reference_it_was_measured_against(chance, words):
    """The reference of an explosion is the larger of chance and the start: a run that starts above a known chance is
    measured from its start, and the message says so, with chance's own value (it used to call the start chance)."""
    trace = [3.0] + [100.0] * 12
    label = label_collapse(trace, crit(chance))
    assert (label.kind, label.step) == ("exploded", 1)
    assert label.failure.message.endswith(words), label.failure.message
    assert label.failure.reference == max(3.0, chance or 0.0) and label.failure.chance == chance
    assert Failure.from_dict(label.failure.to_dict()) == label.failure


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_its_own_one_line_message(kind):
    f = Failure(kind, 7, value=3.0, reference=2.0, best=0.5, window=10, what="loss")
    words = {
        "non_finite": "non-finite loss (3.0) at step 7",
        "exploded": "loss exploded from step 7",
        "returned_to_chance": "loss back above chance from step 7",
        "never_left_chance": "never learned",
        "alarm": "monitor alarm: loss",
        "external": "loss",
    }[kind]
    assert f.message.startswith(words) and "\n" not in f.message
    assert Failure.from_dict(f.to_dict()) == f
    assert Failure(kind, 7, 3.0, 2.0, best=0.5, window=10, after="monitor alarm: x").message.endswith(
        ", after the monitor alarm: x"
    )
    with pytest.raises(ValueError, match="Failure: kind must be one of"):
        Failure("diverged", 1)


def test_the_definition_is_described_from_its_values():
    c = CollapseCriteria(window=16, min_windows=5)
    text = c.describe()
    assert "16-step mean" in text and "after 80 steps" in text and "10 x the reference" in text
    assert "about 1,024 examples" in c.describe(examples=1024) and "5 such windows" in c.describe(examples=1024)
