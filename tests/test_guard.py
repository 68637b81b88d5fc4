"""normlab.monitor.CollapseGuard: snapshots, rollback on trouble, lower learning rate, give up after N rescues."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from normlab.monitor import VarianceMonitor
from normlab.monitor.guard import CollapseGuard, RunCollapsed
from normlab.monitor.rules import FactorRule


def _net(seed=100):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n, seed=101):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def _train(model, opt, batches, guard=None, poison=(), sched=None):
    """Train over ``batches``; a step in ``poison`` gets a NaN loss. Returns the per-step results of guard.step."""
    taken = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i in poison:
            loss = loss * float("nan")
        loss.backward()
        if guard is None:
            opt.step()
        else:
            taken.append(guard.step(loss))
        if sched is not None:
            sched.step()
    return taken


def test_a_healthy_run_is_not_changed():
    batches = _batches(23)
    a, b = _net(), _net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    _train(a, opt_a, batches)
    guard = CollapseGuard(b, opt_b, every=5)
    assert all(_train(b, opt_b, batches, guard))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert guard.rescues == [] and guard.steps == 23


def test_a_non_finite_loss_rolls_back_past_the_margin_and_halves_the_lr():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    guard = CollapseGuard(model, opt, every=4)  # snapshots at steps 0, 4, 8, ...
    batches = _batches(14)
    # reference: the parameters after 8 clean steps (the snapshot that must be restored for trouble at step 13)
    ref_model = _net()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.2)
    _train(ref_model, ref_opt, batches[:8])
    taken = _train(model, opt, batches[:13], guard)
    assert all(taken) and guard.steps == 13
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(batches[13][0]), batches[13][1]) * float("nan")
    loss.backward()
    assert guard.step(loss) is False
    (r,) = guard.rescues
    assert r.reason.startswith("non-finite loss") and r.step == 13 and r.onset == 13
    assert r.restored_step == 8 and r.steps_lost == 5 and guard.steps == 8  # 8 <= 13 - margin (4); 12 is not
    assert r.lr_before == 0.2 and r.lr_after == 0.1 and opt.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in model.parameters())


def test_a_non_finite_gradient_is_trouble_and_a_second_rescue_lowers_the_lr_again():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    guard = CollapseGuard(model, opt, every=3, max_rescues=5)
    batches = _batches(30)
    handle = model[0].weight.register_hook(lambda g: g * float("inf") if guard.steps in (7,) else g)
    _train(model, opt, batches[:12], guard)
    handle.remove()
    assert guard.rescues[0].reason.startswith("non-finite gradient at step 7")
    assert guard.rescues[0].restored_step == 3 and len(guard.rescues) == 1
    _train(model, opt, batches[12:20], guard, poison=(5,))
    assert len(guard.rescues) == 2
    # the second rescue goes back to a snapshot taken after the first one: its rate already carries 0.5
    assert math.isclose(opt.param_groups[0]["lr"], 0.4 * 0.25)
    assert math.isclose(guard.rescues[1].lr_after, 0.1)


def test_gives_up_after_max_rescues_with_a_clear_message():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, every=2, max_rescues=2)
    words = r"gave up after 2 rescue\(s\): non-finite loss .* learning rate is now 0.025"
    with pytest.raises(RunCollapsed, match=words) as e:
        _train(model, opt, _batches(10), guard, poison=range(3, 10))
    assert e.value.alarm is False  # a non-finite loss, not the monitor's alarm
    assert len(guard.rescues) == 2


def test_a_real_divergence_is_rescued_and_ends_finite():
    """SGD at lr 60 on this net diverges to a non-finite loss; the guard halves the rate until it trains."""
    batches = _batches(60)
    plain = _net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=60.0, momentum=0.9)
    losses = []
    for x, y in batches:
        plain_opt.zero_grad()
        loss = nn.functional.cross_entropy(plain(x), y)
        losses.append(float(loss.detach()))
        loss.backward()
        plain_opt.step()
    assert not math.isfinite(losses[-1])  # the unguarded run collapses
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=60.0, momentum=0.9)
    guard = CollapseGuard(model, opt, every=5, max_rescues=12)
    _train(model, opt, batches, guard)
    assert guard.rescues and all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.param_groups[0]["lr"] < 60.0


def test_schedulers_keep_working_from_the_lowered_rate():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10], gamma=0.1)
    guard = CollapseGuard(model, opt, every=2, schedulers=[sched])
    _train(model, opt, _batches(14), guard, poison=(5,), sched=sched)
    (r,) = guard.rescues
    assert r.lr_after == pytest.approx(0.05)
    # 14 scheduler steps; the rollback restored the scheduler to the snapshot's epoch (2) -> 2 + (14 - 6) = 10
    assert sched.last_epoch == 2 + 14 - 6 and opt.param_groups[0]["lr"] == pytest.approx(0.005)
    lam = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(_net().parameters(), lr=0.1), lambda e: 1.0)
    model2 = _net()
    opt2 = lam.optimizer
    guard2 = CollapseGuard(model2, opt2, every=2, schedulers=[lam])
    _train(model2, opt2, _batches(6), guard2, poison=(3,), sched=lam)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)  # LambdaLR recomputes from its (lowered) base rate


def test_rng_and_monitor_state_are_restored():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1)
    guard = CollapseGuard(model, opt, mon, every=3)
    batches = _batches(5)
    _train(model, opt, batches[:3], guard)  # snapshot after step 3
    expected = torch.rand(4, generator=None)
    torch.set_rng_state(guard._snapshots[-1].state["rng"]["torch"])
    assert torch.equal(torch.rand(4), expected)
    _train(model, opt, batches[3:5], guard, poison=(1,))  # trouble at step 4 -> back to step 0 (4 - 3 = 1 < 3)
    assert guard.rescues[0].restored_step == 0 and mon.current_step == 0 and guard.steps == 0
    assert mon.records == []  # the abandoned steps' records went with them


def test_the_monitor_keeps_one_record_per_layer_and_step_across_rescues():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1)
    guard = CollapseGuard(model, opt, mon, every=2, margin=2, max_rescues=3)
    _train(model, opt, _batches(12), guard, poison=(5, 9))
    assert len(guard.rescues) == 2
    keys = [(r["step"], r["layer"]) for r in mon.records]
    assert len(keys) == len(set(keys)) and [k[0] for k in keys] == sorted(k[0] for k in keys)
    assert {k[0] for k in keys} == set(range(mon.current_step))


def test_a_monitor_alarm_is_trouble_dated_to_the_alarm():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = VarianceMonitor(model, every=1, rules=[FactorRule(explode_factor=1.0001, watch_output_layer=True)])
    guard = CollapseGuard(model, opt, mon, every=2, max_rescues=1, confirm=None)  # act on the alarm at once
    batches = _batches(8)
    taken = []
    for x, y in batches[:3]:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        taken.append(guard.step())
        if not taken[-1]:
            break
    assert taken[-1] is False
    (r,) = guard.rescues
    assert r.reason.startswith("monitor alarm: collapse warning at step")
    assert mon.alarm is None and r.onset <= r.step


def test_grad_scaler_state_is_snapshotted():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # the scale doubles every step
    guard = CollapseGuard(model, opt, every=2, margin=0, scaler=scaler)
    for i, (x, y) in enumerate(_batches(6)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i == 3:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        guard.step(loss)
    # trouble at step 3: back to the snapshot of step 2 (scale 2**10, after two doublings; it was 2**11), then two
    # more steps double it twice: 2**12 (without the restore it would be 2**13)
    assert guard.rescues[0].restored_step == 2 and scaler.get_scale() == 2.0**10 * 2 ** (6 - 4)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"every": 0}, "every must be an int >= 1"),
        ({"keep": 0}, "keep must be an int >= 1"),
        ({"lr_factor": 0}, "lr_factor must be a number in (0, 1]"),
        ({"lr_factor": 1.5}, "lr_factor"),
        ({"margin": -1}, "margin must be an int >= 0"),
        ({"max_rescues": -1}, "max_rescues must be an int >= 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(kw, words):
    model = _net()
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as e:
        CollapseGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    assert "\n" not in str(e.value) and str(e.value).startswith("CollapseGuard:")


def test_the_guard_does_not_copy_the_model_object():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [id(p) for p in model.parameters()]
    guard = CollapseGuard(model, opt, every=1)
    _train(model, opt, _batches(4), guard, poison=(2,))
    assert [id(p) for p in model.parameters()] == params  # optimizers and hooks built on them stay valid
    assert copy.deepcopy(guard.state_dict())["rescues"][0]["restored_step"] == 1


def test_state_dict_round_trip_keeps_the_rescues_and_the_snapshots():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, every=2, max_rescues=2)
    _train(model, opt, _batches(6), guard, poison=(3,))
    state = guard.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # what a checkpoint does; read back as the trainer reads its checkpoints
    buf.seek(0)
    other = CollapseGuard(model, opt, every=2, max_rescues=2)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.steps == guard.steps and other.rescues == guard.rescues and other._scale == 0.5
    assert [s.step for s in other._snapshots] == [s.step for s in guard._snapshots] and len(other._snapshots) > 1
    old = CollapseGuard(model, opt, every=2, max_rescues=2)  # a state saved before the snapshots were
    old.load_state_dict({k: v for k, v in copy.deepcopy(state).items() if k not in ("snapshots", "armed")})
    assert [s.step for s in old._snapshots] == [guard.steps]
    with pytest.raises(RunCollapsed):  # the earlier rescue counts: one more is allowed, then it gives up
        _train(model, opt, _batches(6), other, poison=(0, 1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="expected a dict from CollapseGuard.state_dict"):
        other.load_state_dict({"steps": 1})


def test_after_step_for_a_loop_that_steps_itself_matches_step():
    """The loop takes opt.step() and then calls guard.after_step(loss): the same rescues and the same weights as
    guard.step(loss), although the bad step was applied before the guard saw it."""
    batches = _batches(16)
    a, b = _net(), _net()
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (a, b))
    guard_a, guard_b = CollapseGuard(a, opt_a, every=3), CollapseGuard(b, opt_b, every=3)
    _train(a, opt_a, batches, guard_a, poison=(7, 12))
    kept = []
    for i, (x, y) in enumerate(batches):
        opt_b.zero_grad()
        loss = nn.functional.cross_entropy(b(x), y) * (float("nan") if i in (7, 12) else 1.0)
        loss.backward()
        opt_b.step()  # a NaN step: the weights are NaN now
        kept.append(guard_b.after_step(loss))
    assert kept.count(False) == 2 and guard_b.rescues == guard_a.rescues and guard_b.steps == guard_a.steps
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_roll_back_after_giving_up_ends_on_the_last_good_state():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, every=2, max_rescues=1)
    batches = _batches(8)
    _train(model, opt, batches[:4], guard)  # snapshots at 0, 2, 4
    with pytest.raises(RunCollapsed):  # NaN at step 4: back to 2 (4 - margin 2); NaN again at 2: gives up
        for x, y in batches[4:]:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y) * float("nan")
            loss.backward()
            opt.step()
            guard.after_step(loss)
    assert guard.rescues[0].restored_step == 2
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the second NaN step was applied
    assert guard.roll_back() == 0 and guard.steps == 0  # the newest snapshot at least margin (2) steps back
    for p, q in zip(model.parameters(), _net().parameters()):  # the state of step 0: the initial weights
        assert torch.equal(p, q)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the rescue's factor stays, no new one


class _ScriptedMonitor:
    """A monitor whose alarm is raised at a chosen step (its own counter, rolled back with its state)."""

    def __init__(self, alarm_at):
        self.alarm_at, self.current_step, self.alarm = set(alarm_at), 0, None
        self.records = []

    def step(self, opt, loss=None):
        opt.step()
        if self.current_step in self.alarm_at and self.alarm is None:
            self.alarm = type("Alarm", (), {"step": self.current_step, "__str__": lambda s: "scripted"})()
        self.current_step += 1

    def state_dict(self):
        return {"current_step": self.current_step, "alarm": self.alarm}

    def load_state_dict(self, state):
        self.current_step, self.alarm = state["current_step"], state["alarm"]


def _guarded(batches, alarm_at, poison=(), **kw):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = CollapseGuard(model, opt, _ScriptedMonitor(alarm_at), **kw)
    return model, guard, _train(model, opt, batches, guard, poison)


def test_confirm_dismisses_an_alarm_no_trouble_follows_and_leaves_the_run_unchanged():
    batches = _batches(30)
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train(ref, opt, batches)
    model, guard, taken = _guarded(batches, alarm_at={7}, every=5, confirm=10)
    assert all(taken) and guard.rescues == []
    (d,) = guard.dismissed
    assert (d.step, d.dismissed_at, d.reason) == (7, 18, "monitor alarm: scripted")
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert guard.state_dict()["dismissed"] == [d.to_dict()]


def test_without_confirm_the_same_alarm_rolls_back_at_once():
    model, guard, taken = _guarded(_batches(30), alarm_at={7}, every=5, confirm=None)
    assert taken[7] is False and guard.rescues[0].onset == 7 and guard.dismissed == []


@pytest.mark.parametrize("trouble_at, rescued", [(12, True), (17, True), (18, False)])
def test_confirm_trouble_within_the_wait_restores_the_snapshot_pinned_for_the_alarm(trouble_at, rescued):
    # snapshots every 2 steps, two kept: by the trouble the deque holds only post-alarm snapshots; the pinned one
    # (newest <= alarm - margin = 4) must be the one restored, and the rescue is dated to the alarm
    model, guard, taken = _guarded(
        _batches(20), alarm_at={7}, poison={trouble_at}, every=2, keep=2, margin=3, confirm=10, max_rescues=1
    )
    r = guard.rescues[0]
    if rescued:
        assert (r.step, r.onset, r.restored_step) == (trouble_at, 7, 4)
        assert r.reason.startswith("non-finite loss") and r.reason.endswith("after the monitor alarm: scripted")
        assert guard.dismissed == []
    else:  # the wait was over after step 17: the trouble is new, dated to itself, restored from the deque
        assert guard.dismissed[0].dismissed_at == 18
        assert (r.onset, r.restored_step) == (trouble_at, 16)  # deque {16, 18}: none <= 15, the oldest


def _climb_guard(losses, climb):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, every=5, margin=0, loss_climb=climb)
    out = [guard.step(v) for v in losses]
    return guard, out


def test_loss_climb_is_trouble_dated_to_the_start_of_its_window():
    losses = [2.3] * 10 + [0.5] * 20 + [2.2] * 10  # learned (0.5 < 0.8 x 2.3), then back near its start
    guard, taken = _climb_guard(losses, climb=0.75)
    (r,) = guard.rescues
    # the 10-step mean crosses 0.5 + 0.75 x 1.8 = 1.85 at step 37 (8 of 10 losses at 2.2); window start 28
    assert r.step == 37 and r.onset == 28 and r.restored_step == 25 and taken.index(False) == 37
    assert r.reason.startswith("loss climbed back at step 37")


@pytest.mark.parametrize(
    "losses",
    [
        [2.3] * 40,  # never learned: nothing to climb back from
        [2.3] * 10 + [2.0] * 30 + [2.3] * 10,  # best 2.0 is not below 0.8 x first
        [2.3] * 10 + [0.5] * 20 + [1.0] * 20,  # a bump that stays below 0.5 + 0.75 x 1.8
    ],
)
def test_loss_climb_needs_a_learned_run_and_a_climb_past_the_fraction(losses):
    guard, taken = _climb_guard(losses, climb=0.75)
    assert all(taken) and guard.rescues == []


def test_loss_climb_state_is_rolled_back_with_the_snapshot():
    # after the rescue the trend is the snapshot's: the best mean survives, the climbed window does not
    losses = [2.3] * 10 + [0.5] * 20 + [2.2] * 8  # the rescue comes at the last step, 37, back to step 25
    guard, _ = _climb_guard(losses, climb=0.75)
    assert len(guard.rescues) == 1 and guard.steps == 25
    assert guard._trend.best == pytest.approx(0.5) and guard._trend.first == pytest.approx(2.3)
    assert list(guard._trend.recent) == [0.5] * 10  # the losses of steps 15-24


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"confirm": 0}, "confirm must be an int >= 1 or None"),
        ({"confirm": True}, "confirm must be an int >= 1 or None"),
        ({"loss_climb": 0}, "loss_climb must be a number in (0, 1] or None"),
        ({"loss_climb": 1.5}, "loss_climb must be a number in (0, 1] or None"),
        ({"chance_loss": 0}, "chance_loss must be a finite number > 0 or None"),
        ({"chance_loss": float("inf")}, "chance_loss must be a finite number > 0 or None"),
        ({"checkpoint_snapshots": 1}, "checkpoint_snapshots must be True or False"),
    ],
)
def test_bad_confirm_arguments_are_one_line_errors(kw, words):
    test_bad_arguments_are_one_line_errors(kw, words)


def test_the_loss_trend_travels_with_the_state_dict():
    # resumed at step 40, the climb is still measured from the first mean (2.3), not from the resumed one (0.5)
    losses = [2.3] * 20 + [0.5] * 20 + [0.25] * 10 + [0.18] * 10 + [0.24] * 10
    whole, _ = _climb_guard(losses, climb=0.75)
    first, _ = _climb_guard(losses[:40], climb=0.75)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = CollapseGuard(model, opt, every=5, margin=0, loss_climb=0.75)
    resumed.load_state_dict(first.state_dict())
    assert all(resumed.step(v) for v in losses[40:])
    assert whole.rescues == [] and resumed.rescues == [] and resumed._trend.first == pytest.approx(2.3)


def test_chance_loss_without_losses_does_not_wait_forever():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, _ScriptedMonitor({7}), every=5, chance_loss=math.log(3))
    for x, y in _batches(40):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert guard.step()  # no loss passed: nothing to wait for
    assert [(d.step, d.dismissed_at) for d in guard.dismissed] == [(7, 18)]


def test_chance_loss_confirms_a_waiting_alarm_on_a_dead_network():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, _ScriptedMonitor({3}), every=10, margin=2, chance_loss=math.log(10))
    for _ in range(60):
        opt.zero_grad()
        if not guard.step(2.3):  # at chance from the start: it never learns
            break
    (r,) = guard.rescues
    assert r.step == 39 and r.onset == 3 and r.restored_step == 0 and r.reason.startswith("no learning since the alarm")


def test_giving_up_names_the_kind_of_trouble_and_roll_back_keeps_the_waiting_alarms_date():
    model, opt = _net(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, _ScriptedMonitor({93}), every=10, margin=5, max_rescues=0)
    with pytest.raises(RunCollapsed) as e:
        for t in range(101):
            opt.zero_grad()
            guard.step(float("nan") if t == 100 else 1.0)
    assert e.value.kind == "non_finite" and e.value.alarm is True and guard.steps == 100
    assert guard.roll_back() == 80  # the snapshot for the alarm at 93 (<= 88), not for step 100 (<= 95)
    climb = CollapseGuard(model, opt, every=5, max_rescues=0)
    with pytest.raises(RunCollapsed) as e:
        for v in [2.3] * 10 + [0.5] * 20 + [2.2] * 10:
            climb.step(v)
    assert e.value.kind == "loss_climb" and e.value.alarm is False


def test_a_rollback_drops_the_dismissed_alarms_of_the_steps_it_throws_away():
    # the alarm at 12 is dismissed at 23; the NaN at 27 (no alarm waiting) goes back to step 10 (margin 15): the
    # dismissed alarm was on the steps thrown away, so it goes; with margin 5 the rollback to 20 keeps it
    model, guard, _ = _guarded(_batches(30), alarm_at={12}, poison={27}, every=10, keep=3, margin=15, confirm=10)
    (r,) = guard.rescues
    assert r.restored_step == 10 and guard.dismissed == []  # back to 10: the alarm at 12 was on the steps thrown away
    model, guard, _ = _guarded(_batches(30), alarm_at={12}, poison={27}, every=10, keep=3, margin=5, confirm=10)
    assert guard.rescues[0].restored_step == 20 and [d.step for d in guard.dismissed] == [12]


def test_a_guard_resumed_while_an_alarm_waits_rolls_back_as_if_never_interrupted():
    # alarm at step 5, NaN loss at step 9 (within confirm=10): the uninterrupted guard goes back to before the alarm.
    # Interrupted after step 7 (the alarm waiting), the state carried over, the resumed guard does the same.
    batches, kw = _batches(14), dict(every=2, keep=2, margin=2, confirm=10)
    model, guard, _ = _guarded(batches, {5}, poison=(9,), **kw)
    assert [(r.step, r.onset, r.restored_step) for r in guard.rescues] == [(9, 5, 2)]

    first = _net()
    opt = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    mon = _ScriptedMonitor({5})
    part = CollapseGuard(first, opt, mon, **kw)
    _train(first, opt, batches[:8], part)
    assert part._armed is not None and part._armed.onset == 5  # the alarm still waits at the interruption
    state, weights, opt_state, mon_state = map(
        copy.deepcopy, (part.state_dict(), first.state_dict(), opt.state_dict(), mon.state_dict())
    )
    second = _net(seed=7)  # a fresh process: other weights until the checkpoint is loaded
    second.load_state_dict(weights)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt_state)
    mon2 = _ScriptedMonitor({5})
    mon2.load_state_dict(mon_state)
    resumed = CollapseGuard(second, opt2, mon2, **kw)
    resumed.load_state_dict(state)
    _train(second, opt2, batches[8:], resumed, poison=(1,))  # batch 9 of the whole run
    assert resumed.rescues == guard.rescues and resumed.steps == guard.steps
    for a, b in zip(second.parameters(), model.parameters()):
        assert torch.equal(a, b)
    dropped = CollapseGuard(second, opt2, mon2, **kw)  # without the waiting alarm in the state: no rollback to it
    dropped.load_state_dict({**state, "armed": None})
    assert dropped._armed is None
    with pytest.raises(ValueError, match="malformed snapshots or waiting alarm"):
        dropped.load_state_dict({**state, "armed": {**state["armed"], "pinned": None, "step": 999}})


def test_checkpoint_snapshots_false_keeps_the_state_to_counters_and_the_resume_restarts_the_snapshots():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = CollapseGuard(model, opt, _ScriptedMonitor({3}), every=2, checkpoint_snapshots=False)
    _train(model, opt, _batches(5), guard)
    state = guard.state_dict()
    assert guard._armed is not None and "snapshots" not in state and "armed" not in state
    assert not any(isinstance(v, torch.Tensor) for v in state.values())  # no copies of the model
    other = CollapseGuard(model, opt, every=2)
    other.load_state_dict(state)
    assert [s.step for s in other._snapshots] == [guard.steps] and other._armed is None


@pytest.mark.parametrize("own_schedule", [False, True])
def test_a_rescue_keeps_the_rate_of_a_schedule_the_guard_does_not_own(own_schedule):
    """Without schedulers the loop's own schedule is not rolled back: the rate after a rescue is the rate in use at
    the trouble times lr_factor (so the loop need not set it again); with them, the snapshot's rate times it."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[7], gamma=0.1)
    guard = CollapseGuard(model, opt, every=5, margin=0, max_rescues=1, schedulers=[sched] if own_schedule else ())
    for t, (x, y) in enumerate(_batches(9)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y) * (math.nan if t == 8 else 1.0)
        loss.backward()
        guard.step(loss)
        sched.step()  # the loop's per-step schedule: 0.1 until step 7, then 0.01
    (r,) = guard.rescues
    assert (r.restored_step, r.lr_before) == (5, pytest.approx(0.01))
    assert r.lr_after == pytest.approx(0.05 if own_schedule else 0.005) == opt.param_groups[0]["lr"]
