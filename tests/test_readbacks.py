"""No host read-back in a training or eval step of any normlab layer (every layer, every dim, every mode).

A read-back (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``.tolist()``, ``.numpy()``) makes the host wait
for the device: on a GPU, one synchronisation per layer per step. torch's BatchNorm has none. The count is taken on
CPU, where normlab takes the same route as on CUDA (no device-dependent branch decides whether to read back):
``aten._local_scalar_dense`` / ``aten.is_nonzero`` / ``aten.item`` / ``aten.equal`` under a ``TorchDispatchMode``,
and copies to the host, and the
``Tensor.tolist``/``Tensor.numpy`` calls (which read CPU memory without dispatching), over the forward and backward
of a training step and the forward of an eval step, after two warm-up steps.
"""

from __future__ import annotations

import pytest
import torch
from conftest import idle, step_without_update
from torch.utils._python_dispatch import TorchDispatchMode

from normlab.nn import (
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    InstanceNorm1d,
    InstanceNorm2d,
    InstanceNorm3d,
    PWSConv1d,
    PWSConv2d,
    PWSConv3d,
    RenormSchedule,
    SwitchableNorm1d,
    SwitchableNorm2d,
    SwitchableNorm3d,
    SyncBatchRenorm,
    WSConv1d,
    WSConv2d,
    WSConv3d,
)

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default, aten.equal.default}
C = 4
SPATIAL = {1: (6,), 2: (5, 6), 3: (3, 4, 5)}
CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}


class ReadBacks(TorchDispatchMode):
    """Counts the aten ops that copy a device value to the host."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or (func is aten._to_copy.default and _to_host(args, kwargs)):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _to_host(args, kwargs) -> bool:
    device = (kwargs or {}).get("device")
    return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"


def _brn_cases():
    modes = {
        "default": {},
        "default-past-warmup": {"steps": 30_000},
        "constant": {"rmax": 3.0, "dmax": 5.0},
        "identity": {"rmax": 1.0, "dmax": 0.0},
        "scaled": {"schedule": RenormSchedule.scaled(8)},
        "cumulative": {"momentum": None},
        "no-check": {"check_finite": False},
        "no-affine": {"affine": False},
        "no-running": {"track_running_stats": False},
    }
    shapes = [(BatchRenorm1d, (8, C)), (BatchRenorm1d, (4, C, 6))]
    shapes += [(cls, (4, C) + SPATIAL[k]) for k, cls in ((2, BatchRenorm2d), (3, BatchRenorm3d))]
    shapes += [(SyncBatchRenorm, (4, C, 5, 6))]
    for cls, shape in shapes:
        for mode, kw in modes.items():
            yield pytest.param(cls, shape, kw, id=f"{cls.__name__}-{len(shape)}D-{mode}")
        if len(shape) in (4, 5):
            yield pytest.param(cls, shape, {"fmt": True}, id=f"{cls.__name__}-channels_last")
    yield pytest.param(BatchRenorm2d, (4, C, 5, 6), {"dtype": torch.float64}, id="BatchRenorm2d-float64")
    yield pytest.param(BatchRenorm2d, (4, C, 5, 6), {"dtype": torch.bfloat16}, id="BatchRenorm2d-bfloat16")


def _norm_cases():
    for k, cls in ((1, SwitchableNorm1d), (2, SwitchableNorm2d), (3, SwitchableNorm3d)):
        modes = {"bn": {}, "no-bn": {"using_bn": False}, "sums": {"using_moving_average": False}}
        modes["cumulative"] = {"momentum": None}  # 1 / num_batches_tracked from the device count, no read
        for mode, kw in modes.items():
            yield pytest.param(cls, (4, C) + SPATIAL[k], kw, id=f"{cls.__name__}-{mode}")
    for k, cls in ((1, InstanceNorm1d), (2, InstanceNorm2d), (3, InstanceNorm3d)):
        for mode, kw in {
            "plain": {},
            "affine": {"affine": True},
            "tracked": {"track_running_stats": True, "affine": True},
            "tracked-cumulative": {"track_running_stats": True, "momentum": None},
        }.items():
            yield pytest.param(cls, (4, C) + SPATIAL[k], kw, id=f"{cls.__name__}-{mode}")
            if k > 1:
                yield pytest.param(cls, (4, C) + SPATIAL[k], dict(kw, fmt=True), id=f"{cls.__name__}-{mode}-cl")


def _conv_cases():
    for k, ws, pws in ((1, WSConv1d, PWSConv1d), (2, WSConv2d, PWSConv2d), (3, WSConv3d, PWSConv3d)):
        shape = (2, C) + SPATIAL[k]
        yield pytest.param(ws, shape, {}, id=f"{ws.__name__}")
        yield pytest.param(pws, shape, {}, id=f"{pws.__name__}")
        yield pytest.param(pws, shape, {"init_alpha": True}, id=f"{pws.__name__}-init_alpha")


def _build(cls, kw):
    kw = dict(kw)
    steps, fmt, dtype = kw.pop("steps", 0), kw.pop("fmt", False), kw.pop("dtype", torch.float32)
    if cls.__name__.startswith(("WSConv", "PWSConv")):
        # weight_cache="auto" is "off" on every device but the CPU, where the eval cache compares the parameters by
        # value (torch.equal): the route CUDA takes is "off"
        m = cls(C, 3, 3, padding=1, weight_cache="off", **kw)
    else:
        m = cls(C, **kw)
    if steps:
        m.num_batches_tracked.fill_(steps)
    return m.to(dtype), fmt, dtype


def _input(shape, fmt, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if fmt:
        x = x.contiguous(memory_format=CHANNELS_LAST[x.dim() - 2])
    return x.requires_grad_()


def _step(m, x):
    y = m(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()


@pytest.mark.parametrize("cls,shape,kw", [*_brn_cases(), *_norm_cases(), *_conv_cases()])
def test_no_read_back_in_a_training_or_eval_step(cls, shape, kw, monkeypatch):
    m, fmt, dtype = _build(cls, kw)
    for seed in (100, 101):  # warm-up: PWS's data-dependent init happens here
        _step(m, _input(shape, fmt, dtype, seed))
    calls: list[str] = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    with ReadBacks() as reads:
        _step(m, _input(shape, fmt, dtype, 102))
    assert reads.ops + calls == [], f"training step: {reads.ops + calls}"
    m.eval()
    with ReadBacks() as reads, torch.no_grad():
        m(_input(shape, fmt, dtype, 103))
        m(_input(shape, fmt, dtype, 104))
    assert reads.ops + calls == [], f"eval step: {reads.ops + calls}"


def test_weight_cache_auto_is_off_off_the_cpu():
    """The one device-dependent choice on the WS/PWS route: the value-verified eval cache only on the CPU (where a
    comparison is no device synchronisation); elsewhere "auto" recomputes the kernel, the route counted above."""
    m = WSConv2d(C, 3, 3).eval()
    m.to("meta")
    assert m.weight_cache == "auto"
    calls = []
    m._compute_weight = lambda *tensors: calls.append(1) or torch.empty(3, C, 3, 3, device="meta")
    m.effective_weight()
    m.effective_weight()
    assert calls == [1, 1]  # recomputed each time: no cache to verify


@pytest.mark.parametrize("cls", [PWSConv1d, PWSConv2d, PWSConv3d])
def test_pws_init_alpha_still_initialises_once_and_reads_again_after_a_load(cls):
    """The Python flag that ends the read-back follows the buffer: set once the init is seen done, re-armed by
    load_state_dict and reset_parameters (a loaded pending state initialises again at the next training step)."""
    m = cls(C, 3, 3, init_alpha=True)
    k = len(m.kernel_size)
    x = _input((2, C) + SPATIAL[k], False, torch.float32, 100)
    m(x)
    alpha = m.alpha.detach().clone()
    assert bool(m.alpha_initialized) and not torch.equal(alpha, torch.ones(3))
    m(x * 3)  # reads the flag once, finds it done
    m(x * 5)
    assert torch.equal(m.alpha.detach(), alpha) and m._alpha_done
    pending = cls(C, 3, 3, init_alpha=True).state_dict()
    m.load_state_dict(pending)
    assert not m._alpha_done and not bool(m.alpha_initialized)
    m(x)
    assert bool(m.alpha_initialized) and not torch.equal(m.alpha.detach(), torch.ones(3))
    m(x)
    m.reset_parameters()
    assert not m._alpha_done and not bool(m.alpha_initialized)
    m(x)
    assert bool(m.alpha_initialized) and not torch.equal(m.alpha.detach(), torch.ones(3))


COUNTING = [
    (BatchRenorm1d, "BatchNorm1d", {}),
    (BatchRenorm2d, "BatchNorm2d", {}),
    (BatchRenorm3d, "BatchNorm3d", {}),
    (SyncBatchRenorm, "SyncBatchNorm", {}),
    (InstanceNorm1d, "InstanceNorm1d", {"track_running_stats": True, "affine": True}),
    (InstanceNorm2d, "InstanceNorm2d", {"track_running_stats": True, "affine": True}),
    (InstanceNorm3d, "InstanceNorm3d", {"track_running_stats": True, "affine": True}),
]


@pytest.mark.parametrize("cls,torch_name,kw", COUNTING, ids=[c[0].__name__ for c in COUNTING])
def test_skipped_batches_is_not_in_the_state_dict(cls, torch_name, kw):
    """The count is a non-persistent buffer: state_dict keys stay torch's, checkpoints load both ways, and it moves
    with the module."""
    m, ref = cls(C, **kw), getattr(torch.nn, torch_name)(C, **kw)
    assert list(m.state_dict()) == list(ref.state_dict())
    m.load_state_dict(ref.state_dict())
    ref.load_state_dict(m.state_dict())
    assert m.skipped_batches.dtype == torch.long and m.skipped_batches.shape == ()
    assert m.double().skipped_batches.dtype == torch.long  # an integer buffer: .double() leaves it alone


@pytest.mark.parametrize("cls", [SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d])
def test_switchable_counts_only_with_its_bn_component(cls):
    assert "skipped_batches" not in cls(C).state_dict() and int(cls(C).skipped_batches) == 0
    assert cls(C, using_bn=False).skipped_batches is None
    assert InstanceNorm2d(C).skipped_batches is None  # no running statistics, nothing to skip


@pytest.mark.parametrize(
    "make",
    [
        lambda d: BatchRenorm2d(C, device=d),
        lambda d: SyncBatchRenorm(C, device=d),
        lambda d: SwitchableNorm2d(C, device=d),
        lambda d: InstanceNorm2d(C, track_running_stats=True, device=d),
    ],
    ids=["BatchRenorm2d", "SyncBatchRenorm", "SwitchableNorm2d", "InstanceNorm2d"],
)
def test_reset_running_stats_zeroes_the_count_also_after_to_empty(make):
    """Built on the meta device, to_empty() leaves uninitialised memory: reset_parameters() (which calls
    reset_running_stats) must zero the count as it zeroes the statistics; a reset also forgets what was reported."""
    m = make("meta").to_empty(device="cpu")
    m.skipped_batches.fill_(123456)
    m.reset_parameters()
    assert int(m.skipped_batches) == 0
    m(torch.full((4, C, 5, 6), float("nan")))
    assert int(m.skipped_batches) == 1 and m._report_skipped.__self__ is m
    with pytest.warns(RuntimeWarning, match="1 training batch"):
        m.eval()
    m.reset_running_stats()
    assert int(m.skipped_batches) == 0 and m._reported_skips == 0


def test_the_monitor_reads_back_once_per_monitored_step_and_never_in_the_forward(monkeypatch):
    """VarianceMonitor at every=3 with the default rules: a recorded forward keeps every layer's moments on the
    device; the optimizer step of a recorded step reads all the records back in one transfer, a light step (the
    countdown's output variances) in one, a step with no rule due not at all."""
    from normlab.monitor import VarianceMonitor

    torch.manual_seed(100)
    model = torch.nn.Sequential(
        PWSConv2d(C, 3, 3, padding=1, weight_cache="off"),
        BatchRenorm2d(3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 5 * 6, 2),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lin = torch.nn.Linear(2, 2)
    quiet = VarianceMonitor(lin, every=3, rules=[], optimizer=idle(lin))  # no rule: nothing due between its records
    mons = [VarianceMonitor(model, every=3, optimizer=opt), quiet]
    calls: list[str] = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda t, *a, _o=original, _n=name, **k: calls.append(_n) or _o(t, *a, **k)
        )
    per_step = []
    for step in range(4):
        x = _input((4, C, 5, 6), False, torch.float32, 100 + step)
        with ReadBacks() as forward_reads:
            y = model(x)
        forward = forward_reads.ops + calls
        (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        calls.clear()
        with ReadBacks() as step_reads:
            opt.step()
            opt.zero_grad()
        quiet_calls = list(calls)
        calls.clear()
        with ReadBacks() as quiet_reads:
            step_without_update(quiet)
        per_step.append((forward, step_reads.ops + quiet_calls, quiet_reads.ops + calls))
        calls.clear()
    assert [f for f, _, _ in per_step] == [[]] * 4
    assert [s for _, s, _ in per_step] == [["tolist"]] * 4  # recorded, light, light, recorded
    assert [q for _, _, q in per_step] == [["tolist"], [], [], ["tolist"]]  # its records, nothing between them
    assert {r["step"] for r in mons[0].records} == {0, 3}


# ------------------------------------------------------------------------------------------------ the guard's steps
def _count_reads(monkeypatch):
    """A function running one call under the read-back counters: (dispatch reads, tolist/numpy/item calls)."""
    calls: list[str] = []
    for name in ("tolist", "numpy", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def run(fn) -> int:
        calls.clear()
        with ReadBacks() as reads:
            fn()
        return len(reads.ops) + len(calls)

    return run


@pytest.mark.parametrize("loss_kind", ["tensor", "number"])
def test_the_guard_reads_back_only_on_the_steps_it_checks(loss_kind, monkeypatch):
    """A step through CollapseGuard keeps its loss and its non-finite-gradient flag on the device; every
    ``check_every`` steps (and at a snapshot) one transfer reads what the steps left. Steps 0-11 with checks every 5
    and snapshots every 10 read back exactly after steps 4 and 9: one read each."""
    from torch import nn

    from normlab.monitor import CollapseGuard, RescueOptions, SnapshotOptions

    torch.manual_seed(100)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = CollapseGuard(model, opt, snapshots=SnapshotOptions(every=10), rescue=RescueOptions(check_every=5))
    g = torch.Generator().manual_seed(101)
    run = _count_reads(monkeypatch)
    per_step = []
    for _ in range(12):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        value = loss.detach() if loss_kind == "tensor" else 2.0  # a number: the loop read its loss already

        def step(value=value):
            guard.observe_loss(value)
            opt.step()

        per_step.append(run(step))
    assert per_step == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]
    assert guard.rescues == [] and [s.step for s in guard._snaps] == [0, 10]
