"""Tests for normlab.nn.batch_renorm (BatchRenorm1d/2d/3d, RenormSchedule, SyncBatchRenorm without a process group).

References: docs/design.md section 3 (Ioffe 2017) implemented directly in float64 below, and torch's nn.BatchNorm*d.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

from normlab.nn.batch_renorm import (
    BatchRenorm1d,
    BatchRenorm2d,
    BatchRenorm3d,
    RenormSchedule,
    SyncBatchRenorm,
)

F64 = torch.float64
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
BRN = {1: BatchRenorm1d, 2: BatchRenorm2d, 3: BatchRenorm3d}


def _randomize(m: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))


def reference_renorm(x, gamma, beta, running_mean, running_var, eps, rmax, dmax):
    """docs/design.md section 3 written out in float64: returns (y, new_running_mean, new_running_var) for momentum 0.1.

    sigma = sqrt(running_var + eps) (BatchNorm-compatible state); r, d detached; running var unbiased over N*spatial.
    """
    dims = (0,) + tuple(range(2, x.dim()))
    shape = (1, -1) + (1,) * (x.dim() - 2)
    mu_b = x.mean(dims)
    var_b = ((x - mu_b.reshape(shape)) ** 2).mean(dims)
    sigma_b = torch.sqrt(var_b + eps)
    sigma = torch.sqrt(running_var + eps)
    r = torch.clamp(sigma_b / sigma, 1 / rmax, rmax).detach()
    d = torch.clamp((mu_b - running_mean) / sigma, -dmax, dmax).detach()
    xhat = (x - mu_b.reshape(shape)) / sigma_b.reshape(shape) * r.reshape(shape) + d.reshape(shape)
    y = gamma.reshape(shape) * xhat + beta.reshape(shape)
    n = x.numel() // x.shape[1]
    with torch.no_grad():
        new_mean = 0.9 * running_mean + 0.1 * mu_b
        new_var = 0.9 * running_var + 0.1 * var_b * n / (n - 1)
    return y, new_mean, new_var, r, d


# ---------------------------------------------------------------------------------------------- BatchNorm equality
@pytest.mark.parametrize("dim,shape", [(1, (6, 4)), (1, (5, 4, 7)), (2, (4, 4, 5, 3)), (3, (3, 4, 3, 2, 4))])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kw", [{}, {"affine": False}, {"track_running_stats": False}, {"bias": False}])
def test_identity_limits_equal_batchnorm_exactly(dim, shape, momentum, kw):
    torch.manual_seed(0)
    bn = BN[dim](4, momentum=momentum, dtype=F64, **kw)
    brn = BRN[dim](4, momentum=momentum, dtype=F64, rmax=1.0, dmax=0.0, **kw)
    _randomize(bn)
    brn.load_state_dict(bn.state_dict())
    for _ in range(3):
        x = torch.randn(shape, dtype=F64) * 3 + 2
        g = torch.randn(shape, dtype=F64)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = bn(x1), brn(x2)
        (y1 * g).sum().backward()
        (y2 * g).sum().backward()
        assert torch.equal(y1, y2)
        assert torch.equal(x1.grad, x2.grad)
    for p1, p2 in zip(bn.parameters(), brn.parameters()):
        assert torch.equal(p1.grad, p2.grad)
    sd1, sd2 = bn.state_dict(), brn.state_dict()
    assert list(sd1) == list(sd2)
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    bn.eval()
    brn.eval()
    x = torch.randn(shape, dtype=F64)
    assert torch.equal(bn(x), brn(x))


# ---------------------------------------------------------------------------------------------- formula
@pytest.mark.parametrize("clipped", [True, False])
def test_matches_reference_formula(clipped):
    torch.manual_seed(1)
    c, eps = 5, 1e-3
    m = BatchRenorm2d(c, eps=eps, dtype=F64, rmax=1.5 if clipped else 50.0, dmax=0.5 if clipped else 50.0)
    _randomize(m, 3)
    with torch.no_grad():
        m.running_mean.copy_(torch.linspace(-2, 2, c, dtype=F64))
        m.running_var.copy_(torch.tensor([0.05, 0.5, 1.0, 4.0, 20.0], dtype=F64))
    x = torch.randn(4, c, 3, 5, dtype=F64) * 1.3 + 0.4
    g = torch.randn_like(x)
    rm0, rv0 = m.running_mean.clone(), m.running_var.clone()
    xa = x.clone().requires_grad_()
    y = m(xa)
    (y * g).sum().backward()

    xb = x.clone().requires_grad_()
    gamma = m.weight.detach().clone().requires_grad_()
    beta = m.bias.detach().clone().requires_grad_()
    y_ref, rm_ref, rv_ref, r, d = reference_renorm(xb, gamma, beta, rm0, rv0, eps, m.rmax, m.dmax)
    (y_ref * g).sum().backward()

    if clipped:  # the test is only meaningful if the limits bite for some channels and not for others
        assert ((r == 1.5) | (r == 1 / 1.5)).any() and ((r < 1.5) & (r > 1 / 1.5)).any()
        assert (d.abs() == 0.5).any()
    else:
        assert not ((r == 50.0) | (d.abs() == 50.0)).any()
    assert not torch.allclose(r, torch.ones_like(r))
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.weight.grad, gamma.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, beta.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.running_mean, rm_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m.running_var, rv_ref, rtol=1e-12, atol=1e-14)
    # the gradient is NOT the one that differentiates through r and d
    xc = x.clone().requires_grad_()
    dims, shape = (0, 2, 3), (1, -1, 1, 1)
    mu, var = xc.mean(dims), xc.var(dims, unbiased=False)
    sb, s = torch.sqrt(var + eps), torch.sqrt(rv0 + eps)
    r_live = torch.clamp(sb / s, 1 / m.rmax, m.rmax)
    d_live = torch.clamp((mu - rm0) / s, -m.dmax, m.dmax)
    y_live = gamma.detach().reshape(shape) * (
        (xc - mu.reshape(shape)) / sb.reshape(shape) * r_live.reshape(shape) + d_live.reshape(shape)
    ) + beta.detach().reshape(shape)
    (y_live * g).sum().backward()
    assert not torch.allclose(xa.grad, xc.grad, rtol=1e-6, atol=1e-8)


def test_inference_is_batchnorm_inference():
    torch.manual_seed(2)
    m = BatchRenorm2d(3, dtype=F64, rmax=3.0, dmax=5.0, eps=0.01)
    _randomize(m)
    with torch.no_grad():
        m.running_mean.copy_(torch.tensor([1.0, -1.0, 0.5], dtype=F64))
        m.running_var.copy_(torch.tensor([0.5, 2.0, 3.0], dtype=F64))
    m.eval()
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    s = (1, -1, 1, 1)
    ref = (x - m.running_mean.reshape(s)) / torch.sqrt(m.running_var.reshape(s) + 0.01) * m.weight.reshape(
        s
    ) + m.bias.reshape(s)
    torch.testing.assert_close(m(x), ref.detach(), rtol=1e-12, atol=1e-12)
    assert m.num_batches_tracked.item() == 0


def _clipped_module(c=3, **kw):
    m = BatchRenorm2d(c, dtype=F64, rmax=1.2, dmax=0.3, **kw)
    _randomize(m, 5)
    with torch.no_grad():  # batch std ~1 vs running std 10 or 0.1 and running means far away: r, d saturated
        m.running_mean.copy_(torch.tensor([5.0, -5.0, 5.0], dtype=F64)[:c])
        m.running_var.copy_(torch.tensor([100.0, 0.01, 100.0], dtype=F64)[:c])
    return m


def test_gradcheck_training_float64():
    """r and d carry no gradient, so finite differences agree only where they are locally constant: we use running
    statistics that saturate the clipping for every channel (and rmax=1, dmax=0, i.e. BN) and fresh copies of the
    buffers per call so the function is deterministic."""
    from torch.func import functional_call

    torch.manual_seed(3)
    for m in (_clipped_module(), BatchRenorm2d(3, dtype=F64, rmax=1.0, dmax=0.0)):
        buffers = {k: v.clone() for k, v in m.named_buffers()}

        def f(x, w, b, m=m, buffers=buffers):
            state = {k: v.clone() for k, v in buffers.items()}
            state.update(weight=w, bias=b)
            return functional_call(m, state, (x,))

        x = torch.randn(2, 3, 2, 2, dtype=F64, requires_grad=True)
        w = (torch.rand(3, dtype=F64) + 0.5).requires_grad_()
        b = torch.randn(3, dtype=F64, requires_grad=True)
        assert torch.autograd.gradcheck(f, (x, w, b))
        assert m.num_batches_tracked.item() == 0  # functional_call left the module's own buffers alone


# ---------------------------------------------------------------------------------------------- schedule
def test_schedule_values_and_validation():
    s = RenormSchedule()
    assert s(0) == (1.0, 0.0)
    assert s(5000) == (1.0, 0.0)
    r, d = s(25000)
    assert r == pytest.approx(1 + 2 * 20000 / 35000) and d == pytest.approx(5.0)
    assert s(40000) == (3.0, 5.0)
    assert s(100000) == (3.0, 5.0)
    assert s(10**15) == (3.0, 5.0)  # bounded however long training runs
    rt, dt = s(torch.tensor(25000))
    assert rt.item() == pytest.approx(r) and dt.item() == pytest.approx(5.0)
    assert RenormSchedule(warmup_steps=10, rmax_steps=10, dmax_steps=10)(10) == (3.0, 5.0)
    for kw, word in [
        ({"rmax": 0.5}, "rmax"),
        ({"dmax": -1.0}, "dmax"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"rmax_steps": 100}, "rmax_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
    ]:
        with pytest.raises(ValueError, match=f"RenormSchedule: {word}"):
            RenormSchedule(**kw)


def test_schedule_is_a_frozen_value():
    """RenormSchedule is hashable and equal by value (it defined __eq__ without __hash__: unhashable), immutable,
    picklable, with the constructor's arguments, validation and repr."""
    import dataclasses
    import pickle

    a = RenormSchedule(warmup_steps=10, rmax=2, rmax_steps=20, dmax=1, dmax_steps=15)
    b = RenormSchedule(10, 2.0, 20, 1.0, 15)
    assert a == b and hash(a) == hash(b) and len({a, b, RenormSchedule()}) == 2
    assert a != RenormSchedule(10, 2.0, 21, 1.0, 15) and a != (10, 2.0, 20, 1.0, 15)
    assert isinstance(a.rmax, float) and isinstance(a.dmax, float)  # numbers stored as floats, as before
    assert repr(a) == "RenormSchedule(warmup_steps=10, rmax=2.0, rmax_steps=20, dmax=1.0, dmax_steps=15)"
    assert pickle.loads(pickle.dumps(a)) == a and copy.deepcopy(a) == a
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rmax = 3.0
    with pytest.raises(ValueError, match="RenormSchedule: rmax"):
        RenormSchedule(rmax=0.5)
    assert RenormSchedule.scaled(80) == RenormSchedule(10, 3.0, 80, 5.0, 50)


def test_schedule_drives_layer_from_step_counter():
    sched = RenormSchedule(warmup_steps=2, rmax=2.0, rmax_steps=4, dmax=1.0, dmax_steps=3)
    m = BatchRenorm2d(2, schedule=sched)
    seen = []
    for _ in range(6):
        seen.append(tuple(float(v) for v in m.renorm_limits()))
        m(torch.randn(4, 2, 3, 3))
    assert seen == [(1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (1.5, 1.0), (2.0, 1.0), (2.0, 1.0)]
    assert m.state_dict()["num_batches_tracked"].item() == 6
    m.eval()
    m(torch.randn(4, 2, 3, 3))
    assert m.num_batches_tracked.item() == 6  # eval does not advance the schedule
    m2 = BatchRenorm2d(2, schedule=sched)
    m2.load_state_dict(m.state_dict())
    assert m2.renorm_limits() == m.renorm_limits()
    meta = copy.deepcopy(m).to("meta")
    assert meta.num_batches_tracked.device.type == "meta"  # moved with the module
    assert m.to(F64).num_batches_tracked.dtype == torch.long


def test_default_is_paper_schedule_and_api_errors():
    assert BatchRenorm2d(4).schedule == RenormSchedule()
    m = BatchRenorm2d(4, rmax=2.0)
    assert (m.rmax, m.dmax, m.schedule) == (2.0, 0.0, None)
    with pytest.raises(ValueError, match="BatchRenorm2d: rmax must be a number >= 1"):
        BatchRenorm2d(4, rmax=0.9)
    with pytest.raises(ValueError, match="BatchRenorm1d: dmax must be a number >= 0"):
        BatchRenorm1d(4, dmax=-0.1)
    with pytest.raises(ValueError, match="BatchRenorm3d: give either schedule or rmax/dmax"):
        BatchRenorm3d(4, rmax=2.0, schedule=RenormSchedule())
    with pytest.raises(ValueError, match="BatchRenorm2d: rmax/dmax/schedule need running statistics"):
        BatchRenorm2d(4, rmax=2.0, track_running_stats=False)
    with pytest.raises(ValueError, match="BatchRenorm2d: num_features"):
        BatchRenorm2d(0)
    for eps in (0, 0.0, -1e-5, float("nan"), float("inf")):  # eps=0 used to be accepted, then fail in training
        with pytest.raises(ValueError, match="BatchRenorm2d: eps must be a finite number > 0"):
            BatchRenorm2d(3, eps=eps)
    with pytest.raises(ValueError, match="SyncBatchRenorm: eps must be a finite number > 0"):
        SyncBatchRenorm(3, eps=0)
    with pytest.raises(ValueError, match="BatchRenorm2d: momentum"):
        BatchRenorm2d(4, momentum=1.5)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"BatchRenorm2d: expected 4D input \(N, C, H, W\), got 3D input"):
        BatchRenorm2d(3)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"BatchRenorm1d: expected 2D or 3D input .*got 4D input"):
        BatchRenorm1d(3)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match=r"BatchRenorm3d: expected 5D input"):
        BatchRenorm3d(3)(torch.randn(2, 3, 4, 4))
    with pytest.raises(ValueError, match="BatchRenorm2d: expected input with num_features=3 channels"):
        BatchRenorm2d(3)(torch.randn(2, 4, 2, 2))
    with pytest.raises(ValueError, match="BatchRenorm1d: expected more than 1 value per channel when training"):
        BatchRenorm1d(3)(torch.randn(1, 3))
    m = BatchRenorm2d(3).eval()
    assert m(torch.randn(1, 3, 1, 1)).shape == (1, 3, 1, 1)  # fine in eval, as BatchNorm


@pytest.mark.parametrize(
    "make",
    [
        _clipped_module,
        lambda: BatchRenorm2d(3, dtype=F64, rmax=1.0, dmax=0.0),  # BatchNorm's own training call (its route)
        lambda: BatchRenorm2d(3, dtype=F64),  # the schedule's limits as tensors
    ],
    ids=["clipped", "identity", "schedule"],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_batch_is_counted_and_leaves_running_stats(bad, make):
    """The non-finite policy (docs/design.md): state unchanged, counted in skipped_batches without a warning in the
    step (that would need a host read), one RuntimeWarning at eval(), no exception; on every route."""
    m = make()
    m(torch.randn(4, 3, 2, 2, dtype=F64))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(4, 3, 2, 2, dtype=F64)
    x[1, 2, 0, 1] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert m(x).isnan().any()
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert int(m.skipped_batches) == 1
    m(torch.randn(4, 3, 2, 2, dtype=F64))  # still usable
    assert m.num_batches_tracked.item() == 2
    with pytest.warns(RuntimeWarning, match="BatchRenorm2d: 1 training batch.*non-finite batch statistics.*skipped"):
        m.eval()


# ---------------------------------------------------------------------------------------------- state
def test_state_dict_compatible_with_batchnorm_both_ways():
    bn = nn.BatchNorm2d(5)
    bn(torch.randn(4, 5, 3, 3) * 2 + 1)
    brn = BatchRenorm2d(5, rmax=3.0, dmax=5.0)
    assert list(brn.state_dict()) == list(bn.state_dict())
    assert set(dict(brn.named_buffers())) == {"running_mean", "running_var", "num_batches_tracked", "skipped_batches"}
    assert set(dict(brn.named_parameters())) == {"weight", "bias"}
    brn.load_state_dict(bn.state_dict())
    brn(torch.randn(4, 5, 3, 3))
    bn2 = nn.BatchNorm2d(5)
    bn2.load_state_dict(brn.state_dict())
    for k, v in brn.state_dict().items():
        assert torch.equal(bn2.state_dict()[k], v)


def test_deepcopy_save_load_dtype_channels_last():
    torch.manual_seed(4)
    m = _clipped_module()
    m(torch.randn(4, 3, 2, 2, dtype=F64))
    x = torch.randn(4, 3, 5, 5, dtype=F64)
    ref = copy.deepcopy(m)(x)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.schedule is None and (loaded.rmax, loaded.dmax) == (m.rmax, m.dmax)
    assert torch.equal(loaded(x), ref)
    sched = BatchRenorm2d(3)
    buf = io.BytesIO()
    torch.save(sched, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).schedule == RenormSchedule()
    m32 = BatchRenorm2d(3, rmax=2.0, dmax=1.0)
    m64 = copy.deepcopy(m32).to(F64)
    assert m64.weight.dtype == F64 and m64.running_var.dtype == F64
    x32 = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(m64(x32.double()).float(), m32(x32), rtol=1e-5, atol=1e-5)
    xcl = torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last)
    for mode in (True, False):
        assert m32.train(mode)(xcl).is_contiguous(memory_format=torch.channels_last)


def test_torch_compile_same_output():
    torch.manual_seed(5)
    m = BatchRenorm2d(3, rmax=1.5, dmax=0.5)
    with torch.no_grad():
        m.running_var.fill_(4.0)
        m.running_mean.fill_(0.5)
    eager = copy.deepcopy(m)
    compiled = torch.compile(m)
    x = torch.randn(4, 3, 4, 4)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.running_var, eager.running_var, rtol=1e-6, atol=1e-6)
    assert m.num_batches_tracked.item() == 1


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_with_large_values(dtype):
    torch.manual_seed(6)
    x = (torch.randn(8, 3, 4, 4) * 300 + 1e4).to(dtype)  # x^2 ~ 1e8 overflows float16
    m = BatchRenorm2d(3, rmax=3.0, dmax=5.0, momentum=1.0)
    with torch.no_grad():
        m.running_mean.fill_(1e4)
        m.running_var.fill_(9e4)
    ref = copy.deepcopy(m)
    y = m(x)
    y_ref = ref(x.float())
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y_ref, rtol=0.02, atol=0.05)
    xf = x.float()
    torch.testing.assert_close(m.running_mean, xf.mean((0, 2, 3)), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(m.running_var, xf.var((0, 2, 3)), rtol=1e-3, atol=1.0)
    assert m.running_mean.dtype == torch.float32 and m.weight.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- earlier ports' defects
def test_defect_eps_inside_sqrt():
    eps = 0.5  # large, so inside/outside the sqrt differ a lot
    m = BatchRenorm2d(2, eps=eps, affine=False, dtype=F64, rmax=1.0, dmax=0.0)
    x = torch.randn(3, 2, 2, 2, dtype=F64) * 0.3
    y = m(x)
    mu, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
    torch.testing.assert_close(y, (x - mu) / torch.sqrt(var + eps))
    assert not torch.allclose(y, (x - mu) / (torch.sqrt(var) + eps))


def test_defect_unbiased_factor_uses_all_reduced_elements():
    m = BatchRenorm2d(2, momentum=1.0, dtype=F64, rmax=2.0, dmax=1.0)
    x = torch.randn(2, 2, 4, 4, dtype=F64)
    m(x)
    biased = x.var((0, 2, 3), unbiased=False)
    torch.testing.assert_close(m.running_var, biased * 32 / 31)  # N*H*W / (N*H*W - 1)
    assert not torch.allclose(m.running_var, biased * 2 / 1)  # batch-size-only factor
    m3 = BatchRenorm3d(2, momentum=1.0, dtype=F64)
    x3 = torch.randn(2, 2, 2, 3, 2, dtype=F64)
    m3(x3)
    torch.testing.assert_close(m3.running_var, x3.var((0, 2, 3, 4)))


def test_defect_running_stats_init_and_buffers():
    m = BatchRenorm2d(3)
    assert torch.equal(m.running_mean, torch.zeros(3)) and torch.equal(m.running_var, torch.ones(3))
    buffers = {"running_mean", "running_var", "num_batches_tracked", "skipped_batches"}  # the last non-persistent
    assert {n for n, _ in m.named_buffers()} == buffers
    assert all(not p.requires_grad or n in ("weight", "bias") for n, p in m.named_parameters())
    m.momentum = 1.0
    x = torch.randn(4, 3, 2, 2) + 3
    m(x)
    torch.testing.assert_close(m.running_mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(m.running_var, x.var((0, 2, 3)))


def test_defect_step_counter_is_an_in_place_buffer():
    m = BatchRenorm2d(2)
    counter = m.num_batches_tracked
    for _ in range(3):
        m(torch.randn(3, 2, 2, 2))
    assert m.num_batches_tracked is counter and counter.item() == 3  # updated in place, not rebound
    assert "num_batches_tracked" in m.state_dict()
    with torch.no_grad():
        m.num_batches_tracked.fill_(10**12)
    assert m.renorm_limits()[0].item() == 3.0 and m.renorm_limits()[1].item() == 5.0
    assert torch.isfinite(m(torch.randn(3, 2, 2, 2))).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_defect_half_input_returns_half(dtype):
    m = BatchRenorm1d(4, rmax=2.0, dmax=1.0)
    x = torch.randn(8, 4).to(dtype)
    assert m(x).dtype == dtype
    assert m.eval()(x).dtype == dtype


def test_defect_no_nan_under_cpu_autocast():
    torch.manual_seed(7)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), BatchRenorm2d(4, rmax=3.0, dmax=5.0), nn.ReLU())
    with torch.no_grad():
        net[1].running_var.fill_(1e-4)  # r, d saturate
    x = torch.randn(4, 3, 8, 8) * 1e3 + 500
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = net(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())
    assert torch.isfinite(net[1].running_var).all() and torch.isfinite(net[1].running_mean).all()


# ---------------------------------------------------------------------------------------------- sync conversion
def test_torch_convert_sync_batchnorm_refuses_batchrenorm():
    # BatchRenorm is a _BatchNorm: torch's converter would build a plain SyncBatchNorm (tests/test_batchnorm_tools.py)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), BatchRenorm2d(4, rmax=2.0), nn.BatchNorm2d(4), BatchRenorm1d(4))
    with pytest.raises(TypeError, match=r"would turn BatchRenorm2d\(4\) into a plain SyncBatchNorm"):
        nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert type(net[1]) is BatchRenorm2d
    out = SyncBatchRenorm.convert_sync_batchrenorm(net, batchnorm=True)
    assert type(out[1]) is SyncBatchRenorm and type(out[3]) is SyncBatchRenorm and out[1].rmax == 2.0
    assert type(out[2]) is nn.SyncBatchNorm


def test_convert_sync_batchrenorm_and_single_process_fallback():
    torch.manual_seed(8)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), BatchRenorm2d(4, rmax=2.0, dmax=0.5), nn.BatchNorm2d(4))
    net[1](torch.randn(2, 4, 3, 3))
    ref = copy.deepcopy(net)
    old = net[1]
    out = SyncBatchRenorm.convert_sync_batchrenorm(net)
    assert type(out[1]) is SyncBatchRenorm and type(out[2]) is nn.BatchNorm2d
    assert out[1].weight is old.weight and out[1].running_var is old.running_var  # shared, like torch
    assert (out[1].rmax, out[1].dmax, out[1].num_batches_tracked.item()) == (2.0, 0.5, 1)
    assert list(out.state_dict()) == list(ref.state_dict())
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(out(x), ref(x), rtol=0, atol=0)  # no process group: exactly BatchRenorm
    single = SyncBatchRenorm.convert_sync_batchrenorm(BatchRenorm3d(2))
    assert isinstance(single, SyncBatchRenorm) and single.schedule == RenormSchedule()
    with pytest.raises(ValueError, match="SyncBatchRenorm: expected at least 2D input"):
        single(torch.randn(3))


# ---------------------------------------------------------------------------------------------- fused path
def _bn_step_pair(dim, shape, dtype, fmt, kw, seed=0):
    """nn.BatchNorm*d and normlab's fused functional (identity limits given as tensors, so nothing short-circuits
    to F.batch_norm) on the same batch: outputs, gradients and running statistics."""
    from normlab import functional as NF

    torch.manual_seed(seed)
    bn = BN[dim](shape[1], dtype=dtype, **kw)
    _randomize(bn, seed)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    x = (torch.randn(shape, dtype=dtype) * 3 + 2).contiguous(memory_format=fmt)
    g = torch.randn(shape, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = bn(x1)
    (y1 * g).sum().backward()
    params = [None if p is None else p.detach().clone().requires_grad_() for p in (bn.weight, bn.bias)]
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    y2 = NF.batch_renorm(x2, rm, rv, *params, training=True, momentum=0.1, eps=1e-5, rmax=one, dmax=zero, fused=True)
    (y2 * g).sum().backward()
    return bn, (y1, x1.grad, bn.running_mean, bn.running_var), (y2, x2.grad, rm, rv), params


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    "dim,shape,fmt",
    [
        (1, (6, 4), torch.contiguous_format),
        (1, (5, 4, 7), torch.contiguous_format),
        (2, (8, 16, 9, 7), torch.contiguous_format),
        (2, (8, 16, 9, 7), torch.channels_last),
        (2, (2, 64, 8, 8), torch.channels_last),
        (3, (3, 4, 3, 2, 4), torch.contiguous_format),
        (3, (3, 4, 3, 2, 4), torch.channels_last_3d),
    ],
)
@pytest.mark.parametrize("kw", [{}, {"affine": False}, {"bias": False}])
def test_fused_path_with_identity_limits_is_batchnorm_bit_for_bit(dim, shape, fmt, dtype, kw):
    """One statistics pass, BatchNorm's normalize and backward kernels: with r = 1 and d = 0 every number (output,
    input gradient, parameter gradients, running statistics) is BatchNorm's, in float32 too, in any layout."""
    bn, ref, got, params = _bn_step_pair(dim, shape, dtype, fmt, kw)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert got[0].is_contiguous(memory_format=fmt) and got[1].is_contiguous(memory_format=fmt)
    for p_bn, p in zip((bn.weight, bn.bias), params):
        if p is not None:
            assert torch.equal(p.grad, p_bn.grad)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("kw", [{}, {"affine": False}, {"bias": False}])
def test_fused_path_equals_composite_path_when_clipping(dtype, fmt, kw):
    from normlab import functional as NF

    torch.manual_seed(9)
    c = 6
    x = (torch.randn(5, c, 4, 3, dtype=dtype) * 1.3 + 0.4).contiguous(memory_format=fmt)
    g = torch.randn_like(x)
    results = []
    for fused in (True, False):
        rm, rv = torch.linspace(-1, 1, c, dtype=dtype), torch.linspace(0.1, 4, c, dtype=dtype)
        w = torch.linspace(0.5, 1.5, c, dtype=dtype).requires_grad_() if kw.get("affine", True) else None
        b = torch.linspace(-1, 1, c, dtype=dtype).requires_grad_() if w is not None and kw.get("bias", True) else None
        xx = x.clone().requires_grad_()
        y = NF.batch_renorm(xx, rm, rv, w, b, True, 0.1, 1e-3, 1.5, 0.5, fused=fused)
        (y * g).sum().backward()
        results.append([y, xx.grad, rm, rv] + [p.grad for p in (w, b) if p is not None])
    r, _ = NF.renorm_correction(
        *NF.batch_moments(x),
        torch.linspace(-1, 1, c, dtype=dtype),
        torch.linspace(0.1, 4, c, dtype=dtype),
        1e-3,
        1.5,
        0.5,
    )
    assert ((r == 1.5) | (r == 1 / 1.5)).any() and ((r < 1.5) & (r > 1 / 1.5)).any()  # clipping active and not
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert results[0][0].is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"affine": False}])
def test_fused_path_gradgradcheck_float64(kw):
    """Double backward through the fused path (BatchNorm's backward is differentiable; r and d are constants)."""
    from torch.func import functional_call

    torch.manual_seed(10)
    m = _clipped_module(**kw) if kw.get("affine", True) else BatchRenorm2d(3, dtype=F64, rmax=1.2, dmax=0.3, **kw)
    with torch.no_grad():
        m.running_mean.copy_(torch.tensor([5.0, -5.0, 5.0], dtype=F64))
        m.running_var.copy_(torch.tensor([100.0, 0.01, 100.0], dtype=F64))
    buffers = {k: v.clone() for k, v in m.named_buffers()}
    names = [n for n, _ in m.named_parameters()]

    def f(x, *ps):
        state = {k: v.clone() for k, v in buffers.items()}
        state.update(zip(names, ps))
        return functional_call(m, state, (x,))

    x = torch.randn(2, 3, 2, 2, dtype=F64, requires_grad=True)
    ps = [(p.detach() + torch.rand(p.shape, dtype=F64)).requires_grad_() for p in m.parameters()]
    assert torch.autograd.gradcheck(f, (x, *ps))
    assert torch.autograd.gradgradcheck(f, (x, *ps))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(11)
    m = BatchRenorm2d(3, rmax=1.5, dmax=0.5, check_finite=False)
    with torch.no_grad():
        m.running_var.fill_(4.0)
        m.running_mean.fill_(0.5)
    eager = copy.deepcopy(m)
    x = torch.randn(4, 3, 4, 4).to(memory_format=torch.channels_last)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = torch.compile(m, fullgraph=True)(xc)
    y.sum().backward()
    ye = eager(xe)
    ye.sum().backward()
    torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.running_var, eager.running_var, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- .half() modules
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "cls,shape",
    [
        (BatchRenorm1d, (16, 3)),
        (BatchRenorm1d, (8, 3, 5)),
        (BatchRenorm2d, (8, 3, 4, 4)),
        (BatchRenorm3d, (4, 3, 2, 3, 4)),
        (SyncBatchRenorm, (8, 3, 4, 4)),
    ],
)
def test_half_module_keeps_float32_running_stats_on_1e4_inputs(cls, shape, dtype):
    """Issue 9: a module converted with .half() (or bfloat16) keeps running statistics in float32, so a running
    variance of ~1e5 (above float16's 65504) is held; weights stay half, outputs and gradients in the input dtype."""
    torch.manual_seed(12)
    m = cls(3, rmax=3.0, dmax=5.0, momentum=0.5)
    with torch.no_grad():
        m.running_mean.fill_(1e4)
        m.running_var.fill_(9e4)
    ref = copy.deepcopy(m).double()
    m = m.to(dtype)
    assert m.weight.dtype == dtype and m.running_var.dtype == torch.float32 and m.running_mean.dtype == torch.float32
    assert m.num_batches_tracked.dtype == torch.long
    x = (torch.randn(shape) * 300 + 1e4).to(dtype).requires_grad_()
    y = m(x)
    y.float().sum().backward()
    y_ref = ref(x.detach().double())
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    assert y.dtype == dtype and torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert m.weight.grad.dtype == dtype and torch.isfinite(m.weight.grad).all()
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    assert m.running_var.min() > 65504
    torch.testing.assert_close(m.running_var.double(), ref.running_var, rtol=1e-4, atol=0)
    torch.testing.assert_close(m.running_mean.double(), ref.running_mean, rtol=1e-5, atol=0)
    m.eval()
    ref.eval()
    torch.testing.assert_close(m(x).double(), ref(x.detach().double()), rtol=tol, atol=tol)
    sd = m.state_dict()
    assert sd["running_var"].dtype == torch.float32 and sd["weight"].dtype == dtype
    back = cls(3).to(dtype)
    back.load_state_dict(sd)
    assert back.running_var.dtype == torch.float32 and torch.equal(back.running_var, m.running_var)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_training_step_runs_only_batchnorms_kernels_over_the_activations(fmt):
    """The dispatcher check of issue 10: in an eager CPU training step (clipping active) the only aten ops that read
    or write activation-sized tensors are BatchNorm's statistics, normalize and backward kernels, once each."""
    from torch.profiler import ProfilerActivity, profile

    m = BatchRenorm2d(8, rmax=2.0, dmax=1.0)
    with torch.no_grad():
        m.running_var.fill_(9.0)
    shape = [4, 8, 5, 6]
    x = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()
    g = torch.randn(shape).contiguous(memory_format=fmt)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        y = m(x)
        y.backward(g)
    bookkeeping = {
        "aten::empty_like",
        "aten::empty",
        "aten::empty_strided",
        "aten::detach",
        "detach",
        "torch::autograd::AccumulateGrad",
        "_BatchNormWithAffine",
        "_BatchNormWithAffineBackward",
    }
    big = [e.name for e in prof.events() if shape in [list(s) for s in e.input_shapes if isinstance(s, list)]]
    compute = sorted(n for n in big if n not in bookkeeping)
    assert compute == ["aten::batch_norm_update_stats", "aten::native_batch_norm", "aten::native_batch_norm_backward"]
    assert y.is_contiguous(memory_format=fmt) and x.grad.is_contiguous(memory_format=fmt)
