"""Every kind of failure of the taxonomy, in real training loops (a pre-LN transformer under AdamW, a CNN under SGD, a
ReLU MLP under SGD): the guard rescues the run or rightly leaves it alone, and a healthy run is bit-for-bit the same
with the guard as without it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from normlab.monitor import (
    CollapseCriteria,
    CollapseGuard,
    RescueOptions,
    SnapshotOptions,
    VarianceMonitor,
    label_collapse,
)

VOCAB = 16


class TinyLM(nn.Module):
    """A pre-LN transformer (nn.TransformerEncoder, norm_first) over 16 tokens, causal."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=True))


def lm_batches(n, seed):
    """Sequences x_{t+1} = 3 x_t + 1 mod 16 from random starts: learnable to a loss near 0."""
    g = torch.Generator().manual_seed(seed)
    seq = [torch.randint(0, VOCAB, (n, 8, 1), generator=g)]
    for _ in range(16):
        seq.append((seq[-1] * 3 + 1) % VOCAB)
    s = torch.cat(seq, 2)
    return [(b[:, :-1], b[:, 1:]) for b in s]


def lm_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32, 4),
    )


def image_batches(n, seed, batch=32):
    """4 classes: the signs of the means of the top half and of the left half of an 8x8 image."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * batch, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long() * 2 + (x[:, 0, :, :4].mean((1, 2)) > 0).long()
    return list(zip(x.split(batch), y.split(batch)))


def mlp():
    layers, d = [], 16
    for _ in range(4):
        layers += [nn.Linear(d, 64), nn.ReLU()]
        d = 64
    return nn.Sequential(*layers, nn.Linear(64, 4))


def vector_batches(n, seed, batch=32):
    """4 classes: the argmax of a random linear map of 16 Gaussian features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * batch, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return list(zip(x.split(batch), y.split(batch)))


def xent(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def train(model, opt, batches, loss_fn, guard=None, sched=None):
    """The usual loop (the guard, if any, attached to ``opt``); returns the losses of the steps kept, in order."""
    kept = []
    for batch in batches:
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        if guard is not None:
            guard.observe_loss(loss)
        opt.step()
        kept.append(loss.item())
        if guard is not None and guard.rolled_back:
            kept = kept[: guard.steps]  # the steps thrown away
        if sched is not None:
            sched.step()
    return kept


def test_the_pre_ln_transformer_at_lr_1_explodes_finitely_and_the_guard_rescues_it(one_thread):
    """AdamW at lr 1 takes the loss from ~2.8 to ~1e5 without a non-finite value and without learning first: the
    label calls it an explosion with or without a chance loss (it used to call it healthy without one); the guard at
    its defaults (lr_factor 0.1) rolls it back twice, to lr 0.01, and the kept run learns."""
    batches = lm_batches(260, seed=101)
    torch.manual_seed(100)
    plain = TinyLM()
    plain_losses = train(plain, torch.optim.AdamW(plain.parameters(), lr=1.0), batches[:100], lm_loss)
    assert all(math.isfinite(v) for v in plain_losses) and max(plain_losses) > 1e3
    for criteria in (None, CollapseCriteria(chance_loss=math.log(VOCAB))):
        label = label_collapse(plain_losses, criteria)
        assert (label.kind, label.step) == ("exploded", 1)
        assert "at chance" not in label.failure.message
    torch.manual_seed(100)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    mon = VarianceMonitor(model, optimizer=opt)
    guard = CollapseGuard(model, opt, mon, rescue=RescueOptions(lr_factor=0.1))
    kept = train(model, opt, batches, lm_loss, guard)
    first = guard.rescues[0]
    assert (first.kind, first.onset, first.restored_step) == ("exploded", 1, 0)
    assert first.reason.startswith("loss exploded from step 1:") and first.lr_after == pytest.approx(0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01) and guard.gave_up is None
    assert not label_collapse(kept, CollapseCriteria(chance_loss=math.log(VOCAB))).collapsed
    assert kept[-1] < 0.1 * math.log(VOCAB)


def test_a_cnn_whose_schedule_jumps_the_rate_returns_to_chance_and_is_rolled_back_before_the_jump(one_thread):
    """SGD learns to ~0.4, then the loop's schedule (LambdaLR, owned by the guard) jumps the rate 20x at step 150:
    the loss goes back to chance. Each rescue restores a snapshot from before the jump and halves the base rate;
    at a quarter of it the jump is survivable and the kept run ends healthy."""
    batches = image_batches(300, seed=101)
    torch.manual_seed(100)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 150 else 20.0)
    guard = CollapseGuard(model, opt, schedulers=[sched], criteria=CollapseCriteria(chance_loss=math.log(4)))
    kept = train(model, opt, batches, xent, guard, sched)
    kinds = [r.kind for r in guard.rescues]
    assert kinds and set(kinds) <= {"returned_to_chance", "exploded"} and kinds[0] == "returned_to_chance"
    assert all(r.restored_step <= 150 for r in guard.rescues)  # back to before the jump every time
    assert guard.rescues[0].reason.startswith("loss back")
    assert not label_collapse(kept, CollapseCriteria(chance_loss=math.log(4))).collapsed


def test_an_mlp_that_never_learns_at_its_alarm_is_confirmed_dead_and_a_later_return_is_rolled_back(one_thread):
    """A 5-layer ReLU MLP under SGD at lr 0.7: the countdown alarms at step 14 and the net does not learn; with the
    chance loss known the alarm waits while the net has not learned and is confirmed once it is judged never to have
    learned (4 windows in): back to before the alarm, at half the rate. There it learns, and comes back to chance
    (confirming a later alarm); the kept run ends healthy."""
    batches = vector_batches(300, seed=101)
    torch.manual_seed(101)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    mon = VarianceMonitor(model, every=10, optimizer=opt)
    chance = CollapseCriteria(chance_loss=math.log(4))
    guard = CollapseGuard(model, opt, mon, criteria=chance, rescue=RescueOptions(max_rescues=6))
    kept = train(model, opt, batches, xent, guard)
    first = guard.rescues[0]
    assert (first.kind, first.onset, first.restored_step) == ("never_left_chance", 14, 0)
    assert first.step == 4 * 10 - 1  # judged after 4 windows of 10 steps
    assert first.reason.startswith("never learned:") and "after the monitor alarm: collapse warning at step 14" in (
        first.reason
    )
    assert [r.kind for r in guard.rescues[1:]] == ["returned_to_chance"]
    assert any(e.rolled_back and e.step == 14 for e in mon.history)  # the alarm that started it, still readable
    assert not label_collapse(kept, chance).collapsed


def test_an_mlp_whose_loss_turns_nan_after_an_alarm_is_rolled_back_to_before_the_alarm(one_thread):
    """SGD at lr 60: the countdown alarms at step 2 and the loss is NaN two steps later; the NaN confirms the alarm
    and the rollback goes back to before it. Halving the rate each time, the guard ends on finite weights."""
    batches = vector_batches(120, seed=101)
    torch.manual_seed(100)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=60.0, momentum=0.9)
    mon = VarianceMonitor(model, every=10, optimizer=opt)
    guard = CollapseGuard(model, opt, mon, rescue=RescueOptions(max_rescues=12))
    train(model, opt, batches, xent, guard)
    first = guard.rescues[0]
    assert first.kind == "non_finite" and first.reason.startswith("non-finite loss (nan) at step")
    assert "after the monitor alarm: collapse warning at step 2" in first.reason and first.onset == 2
    assert all(torch.isfinite(p).all() for p in model.parameters()) and guard.gave_up is None


def test_a_slow_learner_without_an_alarm_is_left_alone(one_thread):
    """At lr 1e-4 the MLP barely moves: label_collapse calls it never learned at the end; the guard (no alarm to
    confirm) leaves it alone, since a live run that has not learned yet may still learn."""
    batches = vector_batches(80, seed=101)
    torch.manual_seed(100)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = CollapseGuard(model, opt, criteria=CollapseCriteria(chance_loss=math.log(4)))
    kept = train(model, opt, batches, xent, guard)
    assert guard.rescues == [] and label_collapse(kept, CollapseCriteria(chance_loss=math.log(4))).kind == (
        "never_left_chance"
    )


def _transformer_run(guarded, monitored):
    torch.manual_seed(100)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = VarianceMonitor(model, optimizer=opt) if monitored else None
    guard = CollapseGuard(model, opt, mon, snapshots=SnapshotOptions(every=7)) if guarded else None
    train(model, opt, lm_batches(40, seed=101), lm_loss, guard)
    return model, opt


def _cnn_run(guarded, monitored):
    torch.manual_seed(100)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    mon = VarianceMonitor(model, every=5, optimizer=opt) if monitored else None
    guard = CollapseGuard(model, opt, mon, snapshots=SnapshotOptions(every=7)) if guarded else None
    train(model, opt, image_batches(40, seed=101), xent, guard)
    return model, opt


def _mlp_run(guarded, monitored):
    torch.manual_seed(100)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mon = VarianceMonitor(model, every=3, optimizer=opt) if monitored else None
    rescue = RescueOptions(check_every=1)
    guard = CollapseGuard(model, opt, mon, snapshots=SnapshotOptions(every=7), rescue=rescue) if guarded else None
    train(model, opt, vector_batches(40, seed=101), xent, guard)
    return model, opt


@pytest.mark.parametrize("run", [_transformer_run, _cnn_run, _mlp_run], ids=["transformer-adamw", "cnn-sgd", "mlp-sgd"])
@pytest.mark.parametrize("monitored", [False, True])
def test_a_healthy_run_is_bit_for_bit_the_same_with_the_guard(run, monitored, one_thread):
    a, opt_a = run(guarded=False, monitored=monitored)
    b, opt_b = run(guarded=True, monitored=monitored)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    after_b = torch.rand(3)  # the guard drew no random number: the generator is where the plain run left it
    run(guarded=False, monitored=monitored)
    assert torch.equal(after_b, torch.rand(3))
