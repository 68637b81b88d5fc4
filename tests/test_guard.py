"""normlab.monitor.CollapseGuard: snapshots, rollback on trouble, lower learning rate, give up after N rescues; one way
in (the optimizer's own step), its options grouped, the alarm's confirmation, checkpoints."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from normlab.monitor import (
    CollapseCriteria,
    RescueOptions,
    SnapshotOptions,
    VarianceMonitor,
    scaler_step,
)
from normlab.monitor.guard import CollapseGuard, RunCollapsed
from normlab.monitor.optim_step import step_hooks
from normlab.monitor.rules import FactorRule


def _net(seed=100):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n, seed=101):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def guard_of(model, opt, monitor=None, *, every=50, keep=None, check_every=1, chance=None, window=10, **kw):
    """A guard whose options are given flat (the tests' shorthand); checks every step unless told. ``keep`` None:
    at least 3, and enough that snapshots ``every`` steps apart reach a window and the margin back (the guard then
    takes them ``every`` steps apart: ``snapshot_interval``)."""
    if keep is None:
        margin = kw.get("margin")
        keep = max(3, 1 + math.ceil((window + (every if margin is None else margin)) / every))
    snap = {k: kw.pop(k) for k in ("store", "directory", "max_bytes", "in_checkpoint") if k in kw}
    rescue_keys = ("margin", "lr_factor", "max_rescues", "confirm", "check_grads", "on_give_up")
    rescue = {k: kw.pop(k) for k in rescue_keys if k in kw}
    return CollapseGuard(
        model,
        opt,
        monitor,
        snapshots=SnapshotOptions(every=every, keep=keep, **snap),
        rescue=RescueOptions(check_every=check_every, **rescue),
        criteria=CollapseCriteria(chance_loss=chance, window=window),
        **kw,
    )


def _train(model, opt, batches, guard=None, poison=(), sched=None):
    """Train over ``batches``; a step in ``poison`` gets a NaN loss. Returns, per step, whether it was kept."""
    kept = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i in poison:
            loss = loss * float("nan")
        loss.backward()
        if guard is not None:
            guard.observe_loss(loss)
        opt.step()
        kept.append(guard is None or not guard.rolled_back)
        if sched is not None:
            sched.step()
    return kept


def test_a_healthy_run_is_not_changed():
    batches = _batches(23)
    a, b = _net(), _net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    _train(a, opt_a, batches)
    guard = guard_of(b, opt_b, every=5, check_every=3)
    assert all(_train(b, opt_b, batches, guard))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert guard.rescues == [] and guard.steps == 23


def test_a_non_finite_loss_rolls_back_past_the_margin_and_halves_the_lr():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    guard = guard_of(model, opt, every=4)  # snapshots at steps 0, 4, 8, ...
    batches = _batches(14)
    # reference: the parameters after 8 clean steps (the snapshot that must be restored for trouble at step 13)
    ref_model = _net()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.2)
    _train(ref_model, ref_opt, batches[:8])
    assert all(_train(model, opt, batches[:13], guard)) and guard.steps == 13
    assert _train(model, opt, batches[13:], guard, poison=(0,)) == [False]  # step 13: NaN, taken, then undone
    (r,) = guard.rescues
    assert r.reason.startswith("non-finite loss") and (r.step, r.onset, r.kind) == (13, 13, "non_finite")
    assert r.restored_step == 8 and r.steps_lost == 6 and guard.steps == 8  # 8 <= 13 - margin (4); 12 is not
    assert r.lr_before == 0.2 and r.lr_after == 0.1 and opt.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("check_every", [1, 3, 5])
def test_trouble_is_seen_at_the_next_check_and_the_bad_step_is_still_undone(check_every):
    """Checks every k steps: a NaN at step 7 is seen at the first check after it; the steps taken meanwhile (on NaN
    weights) are thrown away with it, and the run goes back to the same snapshot as with a check every step."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    guard = guard_of(model, opt, every=4, check_every=check_every, margin=2)
    kept = _train(model, opt, _batches(11), guard, poison=(7,))
    seen_at = next(s for s in range(8, 16) if s % check_every == 0 or s % 4 == 0) - 1  # the last step of that check
    (r,) = guard.rescues
    assert (r.step, r.onset, r.restored_step) == (seen_at, 7, 4) and kept.index(False) == seen_at
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    _train(ref, ref_opt, _batches(11)[:4])
    restored_then = guard.steps
    assert all(torch.isfinite(p).all() for p in model.parameters()) and restored_then == 4 + (10 - seen_at)


def test_a_non_finite_gradient_is_trouble_and_a_second_rescue_lowers_the_lr_again():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    guard = guard_of(model, opt, every=3, max_rescues=5)
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
    guard = guard_of(model, opt, every=2, max_rescues=2)
    words = r"gave up after 2 rescue\(s\): non-finite loss .* learning rate is now 0.025"
    with pytest.raises(RunCollapsed, match=words) as e:  # out of opt.step()
        _train(model, opt, _batches(10), guard, poison=range(3, 10))
    assert e.value.alarm is False and e.value.kind == "non_finite"  # a non-finite loss, not the monitor's alarm
    assert len(guard.rescues) == 2


def test_on_give_up_stop_rolls_back_and_leaves_the_later_steps_alone():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, every=2, max_rescues=1, on_give_up="stop")
    _train(model, opt, _batches(12), guard, poison=range(3, 6))
    assert len(guard.rescues) == 1 and guard.gave_up.startswith("CollapseGuard: gave up after 1 rescue(s)")
    assert "back on the state of step" in guard.gave_up
    steps = guard.steps
    _train(model, opt, _batches(3), guard, poison=(0,))  # after giving up: no more rescues, no counting
    assert len(guard.rescues) == 1 and guard.steps == steps


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
    guard = guard_of(model, opt, every=5, max_rescues=12, check_every=5)
    _train(model, opt, batches, guard)
    assert guard.rescues and all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.param_groups[0]["lr"] < 60.0


def test_schedulers_keep_working_from_the_lowered_rate():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10], gamma=0.1)
    guard = guard_of(model, opt, every=2, schedulers=[sched])
    _train(model, opt, _batches(14), guard, poison=(5,), sched=sched)
    (r,) = guard.rescues
    assert r.lr_after == pytest.approx(0.05)
    # 14 scheduler steps; the rollback restored the scheduler to the snapshot's epoch (2) -> 2 + (14 - 6) = 10
    assert sched.last_epoch == 2 + 14 - 6 and opt.param_groups[0]["lr"] == pytest.approx(0.005)
    lam = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(_net().parameters(), lr=0.1), lambda e: 1.0)
    model2 = _net()
    opt2 = lam.optimizer
    opt2.param_groups[0]["params"] = list(model2.parameters())
    guard2 = guard_of(model2, opt2, every=2, schedulers=[lam])
    _train(model2, opt2, _batches(6), guard2, poison=(3,), sched=lam)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05)  # LambdaLR recomputes from its (lowered) base rate


def test_rng_and_monitor_state_are_restored_and_the_history_kept():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = VarianceMonitor(model, every=1, optimizer=opt, rules=[FactorRule(explode_factor=1.0001)])
    guard = guard_of(model, opt, mon, every=3, confirm=5)
    batches = _batches(5)
    _train(model, opt, batches[:3], guard)  # snapshot after step 3
    expected = torch.rand(4, generator=None)
    torch.set_rng_state(guard._store.get(guard._snaps[-1].key)["rng"]["torch"])
    assert torch.equal(torch.rand(4), expected)
    alarm = mon.alarm
    assert alarm is not None and alarm.step < 3  # a (deliberately touchy) alarm, waiting for its confirmation
    _train(model, opt, batches[3:5], guard, poison=(1,))  # trouble at step 4 -> back to step 0 (dated to the alarm)
    assert guard.rescues[0].restored_step == 0 and mon.current_step == 0 and guard.steps == 0
    assert guard.rescues[0].reason.endswith(f"after the monitor alarm: {alarm}")
    assert mon.records == [] and mon.events == [] and mon.alarm is None  # the abandoned steps' records and events
    gone = [e for e in mon.history if e.rolled_back]  # ... stay readable, marked
    assert gone and gone[0].rule == alarm.rule and gone[0].step == alarm.step and "(rolled back)" in str(gone[0])
    assert mon.state_dict()["history"][0]["rolled_back"] is True


def test_the_monitor_keeps_one_record_per_layer_and_step_across_rescues():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, every=1, optimizer=opt)
    guard = guard_of(model, opt, mon, every=2, margin=2, max_rescues=3)
    _train(model, opt, _batches(12), guard, poison=(5, 9))
    assert len(guard.rescues) == 2
    keys = [(r["step"], r["layer"]) for r in mon.records]
    assert len(keys) == len(set(keys)) and [k[0] for k in keys] == sorted(k[0] for k in keys)
    assert {k[0] for k in keys} == set(range(mon.current_step))


def test_a_monitor_alarm_is_trouble_dated_to_the_alarm():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mon = VarianceMonitor(model, every=1, optimizer=opt, rules=[FactorRule(explode_factor=1.0001)])
    guard = guard_of(model, opt, mon, every=2, max_rescues=1, confirm=None)  # act on the alarm at once
    kept = _train(model, opt, _batches(3), guard)
    assert False in kept
    (r,) = guard.rescues
    assert r.kind == "alarm" and r.reason.startswith("monitor alarm: collapse warning at step")
    assert mon.alarm is None and r.onset <= r.step
    assert [e.rule for e in mon.history if e.rolled_back] == ["factor"]


def test_grad_scaler_state_is_snapshotted_and_scaler_step_counts_the_skipped_step():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # the scale doubles every step
    guard = guard_of(model, opt, every=2, margin=0, scaler=scaler)
    taken = []
    for i, (x, y) in enumerate(_batches(6)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if i == 3:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        guard.observe_loss(loss)
        taken.append(scaler_step(scaler, opt))
    # trouble at step 3 (the scaler skipped it; the guard counted it and saw the NaN loss): back to the snapshot of
    # step 2 (scale 2**10, after two doublings; it was 2**11), then two more steps double it twice: 2**12
    assert taken == [True, True, True, False, True, True]
    assert guard.rescues[0].restored_step == 2 and scaler.get_scale() == 2.0**10 * 2 ** (6 - 4)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: SnapshotOptions(every=0), "SnapshotOptions: every must be an int >= 1"),
        (lambda: SnapshotOptions(keep=0), "SnapshotOptions: keep must be an int >= 1"),
        (lambda: SnapshotOptions(store="gpu"), "SnapshotOptions: store must be one of"),
        (lambda: SnapshotOptions(store="dcp"), "SnapshotOptions: store 'dcp' needs a directory"),
        (lambda: SnapshotOptions(max_bytes=0), "SnapshotOptions: max_bytes must be an int >= 1"),
        (lambda: SnapshotOptions(in_checkpoint=1), "SnapshotOptions: in_checkpoint must be True or False"),
        (lambda: RescueOptions(lr_factor=0), r"RescueOptions: lr_factor must be a number in \(0, 1\]"),
        (lambda: RescueOptions(lr_factor=1.5), "RescueOptions: lr_factor"),
        (lambda: RescueOptions(margin=-1), "RescueOptions: margin must be an int >= 0"),
        (lambda: RescueOptions(max_rescues=-1), "RescueOptions: max_rescues must be an int >= 0"),
        (lambda: RescueOptions(check_every=0), "RescueOptions: check_every must be an int >= 1"),
        (lambda: RescueOptions(confirm=0), "RescueOptions: confirm must be an int >= 1"),
        (lambda: RescueOptions(confirm=True), "RescueOptions: confirm must be an int >= 1"),
        (lambda: RescueOptions(check_grads=1), "RescueOptions: check_grads must be True or False"),
        (lambda: RescueOptions(on_give_up="ignore"), "RescueOptions: on_give_up must be one of"),
    ],
)
def test_bad_options_are_one_line_errors(make, words):
    with pytest.raises(ValueError, match=words) as e:
        make()
    assert "\n" not in str(e.value)


def test_bad_guard_arguments_are_one_line_errors():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="CollapseGuard: snapshots must be None or a SnapshotOptions, got dict"):
        CollapseGuard(model, opt, snapshots={"every": 5})
    with pytest.raises(TypeError, match="CollapseGuard: optimizer must be a torch.optim.Optimizer"):
        CollapseGuard(model, None)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="CollapseGuard: the monitor must follow the guard's optimizer"):
        CollapseGuard(model, opt, VarianceMonitor(model, optimizer=other))


def test_the_guard_does_not_copy_the_model_object():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [id(p) for p in model.parameters()]
    guard = guard_of(model, opt, every=1)
    _train(model, opt, _batches(4), guard, poison=(2,))
    assert [id(p) for p in model.parameters()] == params  # optimizers and hooks built on them stay valid
    assert copy.deepcopy(guard.state_dict())["rescues"][0]["restored_step"] == 1


def test_the_optimizer_never_aliases_a_snapshot():
    """After a rollback the optimizer's state tensors are its own: further steps leave the snapshot untouched, so a
    second rollback to it restores the same state."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = guard_of(model, opt, every=4, margin=1, max_rescues=3)
    _train(model, opt, _batches(6), guard, poison=(5,))  # back to 4
    first = copy.deepcopy(opt.state_dict()["state"])
    _train(model, opt, _batches(2), guard, poison=(1,))  # steps 4, 5 (NaN): back to 4 again
    again = opt.state_dict()["state"]
    assert all(torch.equal(first[k]["momentum_buffer"], again[k]["momentum_buffer"]) for k in first)


def test_state_dict_round_trip_keeps_the_rescues_and_the_snapshots():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, every=2, max_rescues=2)
    _train(model, opt, _batches(6), guard, poison=(3,))
    state = guard.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # what a checkpoint does; read back as the trainer reads its checkpoints
    buf.seek(0)
    other = guard_of(model, opt, every=2, max_rescues=2)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.steps == guard.steps and other.rescues == guard.rescues and other.lr_scale == 0.5
    assert [s.step for s in other._snaps] == [s.step for s in guard._snaps] and len(other._snaps) > 1
    old = guard_of(model, opt, every=2, max_rescues=2)  # a state without the snapshots
    old.load_state_dict({k: v for k, v in copy.deepcopy(state).items() if k not in ("snapshots", "armed")})
    assert [s.step for s in old._snaps] == [guard.steps]
    guard.close(), old.close()
    with pytest.raises(RunCollapsed):  # the earlier rescue counts: one more is allowed, then it gives up
        _train(model, opt, _batches(6), other, poison=(0, 1, 2, 3, 4, 5))
    with pytest.raises(ValueError, match="expected a dict from CollapseGuard.state_dict"):
        other.load_state_dict({"steps": 1})


def test_roll_back_after_giving_up_ends_on_the_last_good_state():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, every=2, max_rescues=1)
    batches = _batches(8)
    _train(model, opt, batches[:4], guard)  # snapshots at 0, 2, 4
    with pytest.raises(RunCollapsed):  # NaN at step 4: back to 2 (4 - margin 2); NaN again at 2: gives up
        _train(model, opt, batches[4:], guard, poison=range(4))
    assert guard.rescues[0].restored_step == 2
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the second NaN step was applied
    assert guard.roll_back() == 0 and guard.steps == 0  # the newest snapshot at least margin (2) steps back
    for p, q in zip(model.parameters(), _net().parameters()):  # the state of step 0: the initial weights
        assert torch.equal(p, q)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the rescue's factor stays, no new one


class _ScriptedMonitor:
    """A monitor whose alarm is raised at a chosen step (its own counter, rolled back with its state), attached to
    the optimizer as VarianceMonitor is (its step hooks, called before the guard's)."""

    def __init__(self, alarm_at, optimizer):
        self.alarm_at, self.current_step, self.alarm = set(alarm_at), 0, None
        self.records, self.optimizer = [], optimizer
        self.handle = step_hooks(optimizer).add(0, lambda: None, self._after)

    def _after(self, stepped, loss):
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
    guard = guard_of(model, opt, _ScriptedMonitor(alarm_at, opt), **kw)
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
    # snapshots every 3 steps, two kept (a window of 2 and a margin of 1: they reach back far enough at 3): by the
    # trouble the kept ones are all after the alarm; the pinned one (newest <= alarm - margin = 6) must be the one
    # restored, and the rescue is dated to the alarm
    model, guard, taken = _guarded(
        _batches(20), alarm_at={7}, poison={trouble_at}, every=3, keep=2, margin=1, window=2, confirm=10, max_rescues=1
    )
    assert guard.snapshot_every == 3
    r = guard.rescues[0]
    if rescued:
        assert (r.step, r.onset, r.restored_step) == (trouble_at, 7, 6)
        assert r.reason.startswith("non-finite loss") and r.reason.endswith("after the monitor alarm: scripted")
        assert guard.dismissed == []
    else:  # the wait was over after step 17: the trouble is new, dated to itself, restored from those kept
        assert guard.dismissed[0].dismissed_at == 18
        assert (r.onset, r.restored_step) == (trouble_at, 15)  # kept {15, 18}: the newest <= 17


@pytest.mark.parametrize("confirm", [10, None])
def test_a_failure_before_an_alarm_in_the_same_check_is_not_said_to_follow_it(confirm):
    # the NaN of step 5 and the alarm of step 7 are read by the same check (step 10): the failure came first, so it
    # is acted on alone, dated to itself, and its message does not claim the alarm (it used to, with confirm)
    model, guard, taken = _guarded(_batches(20), alarm_at={7}, poison={5}, every=5, check_every=5, confirm=confirm)
    r = guard.rescues[0]
    assert (r.kind, r.onset, r.step, r.restored_step) == ("non_finite", 5, 9, 0)
    assert r.reason == "non-finite loss (nan) at step 5"
    assert all(d.step != 7 or d.dismissed_at > 10 for d in guard.dismissed)


def test_a_failure_dated_before_a_waiting_alarm_is_not_said_to_follow_it():
    # the alarm of step 2 waits from the check of step 3; the explosion, seen once the window is full (step 9), is
    # dated to step 1: before the alarm, so it is its own trouble (it used to end "after the monitor alarm")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, _ScriptedMonitor({2}, opt), every=5, margin=0, confirm=10)
    for v in [3.0, 1290.0, 1.04e4] + [2.0e4] * 7:
        guard.observe_loss(v)
        opt.step()
    (r,) = guard.rescues
    assert (r.kind, r.step, r.onset, r.restored_step) == ("exploded", 9, 1, 0)
    assert r.reason.startswith("loss exploded from step 1:") and "monitor alarm" not in r.reason


def _loss_guard(losses, window=10, chance=None, **kw):
    """A guard fed the given losses one step at a time (an optimizer without gradients: the steps change nothing)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, every=5, margin=0, window=window, chance=chance, **kw)
    kept = []
    for v in losses:
        guard.observe_loss(v)
        opt.step()
        kept.append(not guard.rolled_back)
    return guard, kept


def test_a_return_to_chance_is_trouble_dated_to_the_start_of_its_window():
    losses = [2.3] * 10 + [0.5] * 20 + [2.2] * 10  # learned (0.5 < 0.8 x 2.3), then back at its start
    guard, kept = _loss_guard(losses)
    (r,) = guard.rescues
    # the 10-step mean reaches 0.95 x 2.3 (the first loss, standing in for chance) at step 39; window start 30
    assert (r.kind, r.step, r.onset, r.restored_step) == ("returned_to_chance", 39, 30, 30) and kept.index(False) == 39
    assert r.reason.startswith("loss back at its start from step 30")


@pytest.mark.parametrize(
    "losses",
    [
        [2.3] * 40,  # never learned, and no alarm waits: left alone
        [2.3] * 10 + [2.0] * 30 + [2.3] * 10,  # best 2.0 is not below 0.8 x the start
        [2.3] * 10 + [0.5] * 20 + [1.5] * 20,  # a bump that stays below 0.95 x the start
    ],
)
def test_a_return_needs_a_learned_run_and_a_mean_back_at_chance(losses):
    guard, kept = _loss_guard(losses)
    assert all(kept) and guard.rescues == []


def test_an_explosion_is_trouble_learned_first_or_not():
    guard, kept = _loss_guard([3.0, 1290.0, 1.04e4] + [2.0e4] * 10)
    (r,) = guard.rescues
    assert (r.kind, r.onset, r.restored_step) == ("exploded", 1, 0) and r.reason.startswith("loss exploded from step 1")


def test_the_tracker_is_rolled_back_with_the_snapshot():
    # after the rescue the tracker is the snapshot's: the best mean survives, the returned window does not
    losses = [2.3] * 10 + [0.5] * 20 + [2.2] * 10  # the rescue comes at the last step, 39, back to step 30
    guard, _ = _loss_guard(losses)
    assert len(guard.rescues) == 1 and guard.steps == 30
    t = guard.tracker
    assert t.best == pytest.approx(0.5) and t.start == pytest.approx(2.3) and t.learned and t.failure is None
    assert [v for _, v in t._recent] == [0.5] * 10  # the losses of steps 20-29


def test_the_tracker_and_the_pending_steps_travel_with_the_state_dict():
    # resumed at step 43 (3 steps not checked yet), the return is still measured from the first loss (2.3)
    losses = [2.3] * 20 + [0.5] * 23
    first, _ = _loss_guard(losses, check_every=5)
    state = first.state_dict()
    assert [s for s, *_ in state["pending"]] == [40, 41, 42]
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = guard_of(model, opt, every=5, margin=0, check_every=5)
    resumed.load_state_dict(state)
    for v in [2.2] * 15:  # the window of steps 46-55, checked at 55
        resumed.observe_loss(v)
        opt.step()
    (r,) = resumed.rescues
    assert r.kind == "returned_to_chance" and resumed.tracker.start == pytest.approx(2.3)


def test_chance_loss_without_losses_does_not_wait_forever():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, _ScriptedMonitor({7}, opt), every=5, chance=math.log(3))
    kept = _train_without_loss(model, opt, 40, guard)
    assert all(kept) and [(d.step, d.dismissed_at) for d in guard.dismissed] == [(7, 18)]


def _train_without_loss(model, opt, n, guard):
    kept = []
    for x, y in _batches(n):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # no loss observed: the guard sees the gradients only
        kept.append(not guard.rolled_back)
    return kept


def test_chance_loss_confirms_a_waiting_alarm_on_a_dead_network():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, _ScriptedMonitor({3}, opt), every=10, margin=2, chance=math.log(10))
    for _ in range(60):
        guard.observe_loss(2.3)  # at chance from the start: it never learns
        opt.step()
        if guard.rolled_back:
            break
    (r,) = guard.rescues
    assert (r.step, r.onset, r.restored_step, r.kind) == (39, 3, 0, "never_left_chance")
    assert r.reason.startswith("never learned") and r.reason.endswith("after the monitor alarm: scripted")


def test_giving_up_names_the_kind_of_trouble_and_roll_back_keeps_the_waiting_alarms_date():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, _ScriptedMonitor({93}, opt), every=10, margin=5, max_rescues=0)
    with pytest.raises(RunCollapsed) as e:
        for t in range(101):
            guard.observe_loss(float("nan") if t == 100 else 1.0)
            opt.step()
    assert e.value.kind == "non_finite" and e.value.alarm is True and guard.steps == 101
    assert guard.roll_back() == 80  # the snapshot for the alarm at 93 (<= 88), not for step 100 (<= 95)
    model2 = _net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    back = guard_of(model2, opt2, every=5, max_rescues=0)
    with pytest.raises(RunCollapsed) as e:
        for v in [2.3] * 10 + [0.5] * 20 + [2.2] * 10:
            back.observe_loss(v)
            opt2.step()
    assert e.value.kind == "returned_to_chance" and e.value.alarm is False


def test_a_rollback_drops_the_dismissed_alarms_of_the_steps_it_throws_away():
    # the alarm at 12 is dismissed at 23; the NaN at 27 (no alarm waiting) goes back to step 10 (margin 15): the
    # dismissed alarm was on the steps thrown away, so it goes; with margin 5 the rollback to 20 keeps it
    kw = dict(every=10, keep=3, window=2, confirm=10)  # two snapshots 10 apart reach a window of 2 and 15 steps back
    model, guard, _ = _guarded(_batches(30), alarm_at={12}, poison={27}, margin=15, **kw)
    assert guard.snapshot_every == 10
    (r,) = guard.rescues
    assert r.restored_step == 10 and guard.dismissed == []
    model, guard, _ = _guarded(_batches(30), alarm_at={12}, poison={27}, margin=5, **kw)
    assert guard.rescues[0].restored_step == 20 and [d.step for d in guard.dismissed] == [12]


def test_a_guard_resumed_while_an_alarm_waits_rolls_back_as_if_never_interrupted():
    # alarm at step 5, NaN loss at step 9 (within confirm=10): the uninterrupted guard goes back to before the alarm.
    # Interrupted after step 7 (the alarm waiting), the state carried over, the resumed guard does the same.
    batches, kw = _batches(14), dict(every=3, keep=2, margin=1, window=2, confirm=10)
    model, guard, _ = _guarded(batches, {5}, poison=(9,), **kw)
    assert [(r.step, r.onset, r.restored_step) for r in guard.rescues] == [(9, 5, 3)]

    first = _net()
    opt = torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9)
    mon = _ScriptedMonitor({5}, opt)
    part = guard_of(first, opt, mon, **kw)
    _train(first, opt, batches[:8], part)
    assert part._armed is not None and part._armed.onset == 5  # the alarm still waits at the interruption
    state, weights, opt_state, mon_state = map(
        copy.deepcopy, (part.state_dict(), first.state_dict(), opt.state_dict(), mon.state_dict())
    )
    second = _net(seed=107)  # a fresh process: other weights until the checkpoint is loaded
    second.load_state_dict(weights)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(opt_state)
    mon2 = _ScriptedMonitor({5}, opt2)
    mon2.load_state_dict(mon_state)
    resumed = guard_of(second, opt2, mon2, **kw)
    resumed.load_state_dict(state)
    _train(second, opt2, batches[8:], resumed, poison=(1,))  # batch 9 of the whole run
    assert resumed.rescues == guard.rescues and resumed.steps == guard.steps
    for a, b in zip(second.parameters(), model.parameters()):
        assert torch.equal(a, b)
    resumed.close()
    dropped = guard_of(second, opt2, mon2, **kw)  # without the waiting alarm in the state: no rollback to it
    dropped.load_state_dict({**state, "armed": None})
    assert dropped._armed is None
    with pytest.raises(ValueError, match="malformed snapshots or waiting alarm"):
        dropped.load_state_dict({**state, "armed": {**state["armed"], "pinned": None, "step": 999}})


def test_in_checkpoint_false_keeps_the_state_to_counters_and_the_resume_restarts_the_snapshots():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, _ScriptedMonitor({3}, opt), every=2, in_checkpoint=False)
    _train(model, opt, _batches(5), guard)
    state = guard.state_dict()
    assert guard._armed is not None and "snapshots" not in state and "armed" not in state
    assert not any(isinstance(v, torch.Tensor) for v in state.values())  # no copies of the model
    guard.close()
    other = guard_of(model, opt, every=2)
    other.load_state_dict(state)
    assert [s.step for s in other._snaps] == [guard.steps] and other._armed is None


@pytest.mark.parametrize("own_schedule", [False, True])
def test_a_rescue_keeps_the_rate_of_a_schedule_the_guard_does_not_own(own_schedule):
    """Without schedulers the loop's own schedule is not rolled back: the rate after a rescue is the rate in use at
    the trouble times lr_factor (so the loop need not set it again); with them, the snapshot's rate times it."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[7], gamma=0.1)
    guard = guard_of(model, opt, every=5, margin=0, max_rescues=1, schedulers=[sched] if own_schedule else ())
    _train(model, opt, _batches(9), guard, poison=(8,), sched=sched)  # the loop's per-step schedule: 0.01 from 7 on
    (r,) = guard.rescues
    assert (r.restored_step, r.lr_before) == (5, pytest.approx(0.01))
    assert r.lr_after == pytest.approx(0.05 if own_schedule else 0.005) == opt.param_groups[0]["lr"]


def test_close_detaches_the_guard_and_drops_its_snapshots():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = guard_of(model, opt, every=1)
    _train(model, opt, _batches(3), guard)
    assert guard.nbytes > 0
    guard.close()
    assert guard.nbytes == 0 and guard._snaps == []
    _train(model, opt, _batches(2), guard, poison=(0,))  # no longer watched
    assert guard.steps == 3 and guard.rescues == []


def test_half_gradients_near_the_top_of_their_range_are_not_called_non_finite():
    """The gradient check takes float32 norms of float16/bfloat16 gradients: 60,000 in each of 64 entries is a norm
    of 480,000, past float16's range, and still finite; an inf among them is found."""
    model = nn.Linear(8, 8).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = guard_of(model, opt, every=5)
    for value in (60000.0, float("inf")):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        opt.step()
    (r,) = guard.rescues
    assert (r.kind, r.onset, r.reason) == ("non_finite", 1, "non-finite gradient at step 1")


def test_the_step_hooks_live_on_the_optimizer_and_go_with_it():
    """The hooks the monitor and the guard share are kept on the optimizer: a copy of the optimizer has none (a copy
    keeps its defaults, state and groups), and once the loop's objects go, the optimizer is collected."""
    import gc
    import weakref

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = VarianceMonitor(model, optimizer=opt)
    guard = guard_of(model, opt, mon)
    twin = copy.deepcopy(opt)
    assert not twin._optimizer_step_pre_hooks and not twin._optimizer_step_post_hooks
    assert step_hooks(twin) is not step_hooks(opt)
    alive = weakref.ref(opt)
    del opt, mon, guard, twin, model
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("window", [10, 100, 300])
@pytest.mark.parametrize("keep", [2, 3, 5])
def test_a_failure_a_whole_window_back_still_has_a_snapshot_before_it(window, keep):
    """A loss window longer than ``keep`` snapshots at ``every`` reach (a window over ~1,000 examples at a small
    batch): an explosion that starts before the first window has filled, or grows through a window, is judged when the
    window's mean has grown and dated to its first exploded step, up to a window back; the guard spaces its snapshots
    so that one still lies ``margin`` steps before that, and rolls back there once."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = guard_of(model, opt, every=10, keep=keep, window=window, check_every=10)
    assert guard.snapshot_every == max(10, math.ceil((window + guard.margin) / (keep - 1)))
    start = window // 2 + 23  # the loss grows from here on the first pass, e-fold every window / 10 steps
    while guard.steps < start + 3 * window and not guard.rescues:
        opt.zero_grad()
        model(torch.randn(2, 4)).square().mean().backward()
        guard.observe_loss(math.exp(10 * max(0, guard.steps - start) / window))
        opt.step()
    assert len(guard.rescues) == 1 and guard.rescues[0].kind == "exploded"
    rescue = guard.rescues[0]
    assert start <= rescue.onset and rescue.restored_step <= rescue.onset - guard.margin, rescue
    assert guard.steps == rescue.restored_step and guard.gave_up is None
