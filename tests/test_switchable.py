"""SwitchableNorm1d/2d/3d against a direct float64 re-implementation of docs/design.md section 5."""

import copy
import io

import pytest
import torch
from torch import nn

from normlab.nn.switchable import SwitchableNorm1d, SwitchableNorm2d, SwitchableNorm3d


class ReferenceSN:
    """Section 5 written out, float64, no shared code with normlab: IN stats with the unbiased variance (x.var,
    gradient through the mean), LN/BN stats from E[x^2] = var + mean^2, softmax mixtures, running stats
    starting at zero with ``running = momentum * running + (1 - momentum) * batch``."""

    def __init__(self, c, momentum=0.9, eps=1e-5, using_bn=True):
        self.running_mean = torch.zeros(1, c, 1, dtype=torch.float64)
        self.running_var = torch.zeros(1, c, 1, dtype=torch.float64)
        self.momentum, self.eps, self.using_bn = momentum, eps, using_bn

    def __call__(self, x, weight, bias, mean_weight, var_weight, training):
        n, c = x.shape[:2]
        flat = x.reshape(n, c, -1)
        mean_in = flat.mean(-1, keepdim=True)
        var_in = flat.var(-1, keepdim=True)
        temp = var_in + mean_in**2
        mean_ln = mean_in.mean(1, keepdim=True)
        var_ln = temp.mean(1, keepdim=True) - mean_ln**2
        means, variances = [mean_in, mean_ln], [var_in, var_ln]
        if self.using_bn:
            if training:
                mean_bn = mean_in.mean(0, keepdim=True)
                var_bn = temp.mean(0, keepdim=True) - mean_bn**2
                self.running_mean = self.momentum * self.running_mean + (1 - self.momentum) * mean_bn.detach()
                self.running_var = self.momentum * self.running_var + (1 - self.momentum) * var_bn.detach()
            else:
                mean_bn, var_bn = self.running_mean, self.running_var
            means.append(mean_bn)
            variances.append(var_bn)
        mw, vw = torch.softmax(mean_weight, 0), torch.softmax(var_weight, 0)
        mean = sum(mw[k] * means[k] for k in range(len(means)))
        var = sum(vw[k] * variances[k] for k in range(len(variances)))
        y = ((flat - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        shape = (1, c) + (1,) * (x.dim() - 2)
        return y * weight.reshape(shape) + bias.reshape(shape)


def _random_params(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


@pytest.mark.parametrize(
    "cls, shape", [(SwitchableNorm1d, (4, 3, 7)), (SwitchableNorm2d, (4, 3, 5, 6)), (SwitchableNorm3d, (3, 3, 3, 4, 2))]
)
@pytest.mark.parametrize("using_bn", [True, False])
def test_matches_reference_train_and_eval(cls, shape, using_bn):
    torch.manual_seed(0)
    m = cls(3, using_bn=using_bn).double()
    _random_params(m)
    ref = ReferenceSN(3, using_bn=using_bn)
    for step in range(4):
        x = (torch.randn(shape, dtype=torch.float64) * (1 + step) + step).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y = m(x)
        y_ref = ref(x_ref, m.weight, m.bias, m.mean_weight, m.var_weight, training=True)
        torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
        g = torch.randn_like(y)
        (gx, *gp) = torch.autograd.grad(y, [x, *m.parameters()], g)
        (gx_ref, *gp_ref) = torch.autograd.grad(y_ref, [x_ref, *m.parameters()], g)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-9, atol=1e-10)
        for a, b in zip(gp, gp_ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        if using_bn:
            torch.testing.assert_close(m.running_mean, ref.running_mean.reshape(3), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(m.running_var, ref.running_var.reshape(3), rtol=1e-12, atol=1e-12)
    m.eval()
    x = torch.randn(shape, dtype=torch.float64) * 2
    torch.testing.assert_close(
        m(x), ref(x, m.weight, m.bias, m.mean_weight, m.var_weight, training=False), rtol=1e-10, atol=1e-10
    )


def test_official_defaults():
    m = SwitchableNorm2d(5)
    assert m.eps == 1e-5 and m.momentum == 0.1 and m.using_moving_average and m.using_bn and not m.last_gamma
    assert torch.equal(m.weight, torch.ones(5)) and torch.equal(m.bias, torch.zeros(5))
    assert m.mean_weight.shape == (3,) and m.var_weight.shape == (3,)
    torch.testing.assert_close(torch.softmax(m.mean_weight, 0), torch.full((3,), 1 / 3))
    torch.testing.assert_close(torch.softmax(m.var_weight, 0), torch.full((3,), 1 / 3))
    assert torch.equal(m.running_mean, torch.zeros(5)) and torch.equal(m.running_var, torch.zeros(5))
    assert set(m.state_dict()) == {
        "weight",
        "bias",
        "mean_weight",
        "var_weight",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }
    assert m._normlab_norm is True
    # momentum weighs the NEW value (BatchNorm's convention; the official 0.9 of the old): one step from zero gives
    # 0.1 * batch statistic
    x = torch.randn(4, 5, 3, 3) + 2
    m(x)
    torch.testing.assert_close(m.running_mean, 0.1 * x.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_last_gamma():
    m = SwitchableNorm2d(4, last_gamma=True)
    assert torch.equal(m.weight, torch.zeros(4))
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(m(x), torch.zeros_like(x))  # bias 0 and gamma 0: the block starts as identity
    m.reset_parameters()
    assert torch.equal(m.weight, torch.zeros(4))


def _favour(m, k):
    with torch.no_grad():
        logits = torch.full((3,), -60.0, dtype=m.mean_weight.dtype)
        logits[k] = 60.0
        m.mean_weight.copy_(logits)
        m.var_weight.copy_(logits)


def test_single_component_matches_in_ln_bn():
    """Logits strongly favouring one component give exactly that normalizer (with the official unbiased IN
    variance inside the statistics)."""
    torch.manual_seed(1)
    x = torch.randn(4, 6, 5, 5, dtype=torch.float64) * 3 + 1
    m = SwitchableNorm2d(6, eps=1e-5).double()
    _random_params(m)
    shape = (1, 6, 1, 1)
    w, b = m.weight.detach().view(shape), m.bias.detach().view(shape)
    n_sp = 25
    xn = x.reshape(4, 6, -1)
    mean_in, var_in = xn.mean(-1), xn.var(-1)  # (N, C), unbiased as the official code
    # IN: equals torch's instance norm (biased variance) after rescaling eps and the output
    _favour(m, 0)
    ratio = (n_sp - 1) / n_sp
    in_ref = nn.functional.instance_norm(x, eps=1e-5 * ratio) * ratio**0.5
    torch.testing.assert_close(m(x), in_ref * w + b, rtol=1e-9, atol=1e-9)
    # LN (= GroupNorm(1) statistics: per sample over C, H, W)
    _favour(m, 1)
    flat = x.reshape(4, -1)
    mean_ln = flat.mean(1)
    var_ln = (var_in + mean_in**2).mean(1) - mean_ln**2
    expected = ((flat - mean_ln[:, None]) / torch.sqrt(var_ln[:, None] + 1e-5)).reshape(x.shape)
    torch.testing.assert_close(m(x), expected * w + b, rtol=1e-9, atol=1e-9)
    # BN with batch statistics (training)
    _favour(m, 2)
    mean_bn = mean_in.mean(0)
    var_bn = (var_in + mean_in**2).mean(0) - mean_bn**2
    expected = (x - mean_bn.view(shape)) / torch.sqrt(var_bn.view(shape) + 1e-5)
    torch.testing.assert_close(m(x), expected * w + b, rtol=1e-9, atol=1e-9)
    # BN in eval uses the running statistics, exactly like BatchNorm inference
    m.eval()
    bn = nn.BatchNorm2d(6, affine=False, eps=1e-5).double().eval()
    bn.running_mean.copy_(m.running_mean)
    bn.running_var.copy_(m.running_var)
    torch.testing.assert_close(m(x), bn(x) * w + b, rtol=1e-9, atol=1e-9)


def test_single_component_exact_for_large_spatial():
    """With many spatial values the unbiased/biased difference vanishes and the components equal torch's layers."""
    torch.manual_seed(2)
    x = torch.randn(3, 4, 40, 40, dtype=torch.float64) * 2 + 1
    m = SwitchableNorm2d(4).double()
    refs = [nn.InstanceNorm2d(4), nn.GroupNorm(1, 4, affine=False), nn.BatchNorm2d(4, affine=False)]
    for k, ref in enumerate(refs):
        _favour(m, k)
        torch.testing.assert_close(m(x), ref.double()(x), rtol=2e-3, atol=2e-3)


def test_gradcheck_float64():
    torch.manual_seed(3)
    m = SwitchableNorm2d(3).double()
    _random_params(m)
    x = torch.randn(3, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]

    def f(t, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (t,))

    assert torch.autograd.gradcheck(f, (x, *params))
    m.eval()
    m.running_var.fill_(1.5)
    m.running_mean.fill_(0.2)
    assert torch.autograd.gradcheck(f, (x, *params))


def test_nonfinite_batch_does_not_poison_running_stats():
    m = SwitchableNorm2d(2)
    m(torch.randn(2, 2, 3, 3))
    before = (m.running_mean.clone(), m.running_var.clone())
    bad = torch.randn(2, 2, 3, 3)
    bad[1, 0, 2, 2] = float("inf")
    m(bad)
    assert torch.equal(m.running_mean, before[0]) and torch.equal(m.running_var, before[1])
    assert int(m.skipped_batches) == 1
    with pytest.warns(RuntimeWarning, match="SwitchableNorm2d: 1 training batch"):
        m.eval()


def test_input_errors():
    m = SwitchableNorm2d(4)
    with pytest.raises(ValueError, match=r"SwitchableNorm2d: expected 4D input \(N, C, H, W\), got 3D"):
        m(torch.randn(4, 5, 5))
    with pytest.raises(ValueError, match="SwitchableNorm2d: expected 4 channels.*got 5"):
        m(torch.randn(2, 5, 5, 5))
    with pytest.raises(ValueError, match="SwitchableNorm2d: instance statistics need more than 1 spatial value"):
        m(torch.randn(2, 4, 1, 1))
    with pytest.raises(ValueError, match="SwitchableNorm1d: expected 3D input"):
        SwitchableNorm1d(4)(torch.randn(2, 4))
    with pytest.raises(ValueError, match="SwitchableNorm3d: expected 5D"):
        SwitchableNorm3d(4)(torch.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match="SwitchableNorm2d: momentum"):
        SwitchableNorm2d(4, momentum=1.1)
    with pytest.raises(ValueError, match="SwitchableNorm2d: num_features"):
        SwitchableNorm2d(0)
    with pytest.raises(ValueError, match="SwitchableNorm2d: eps"):
        SwitchableNorm2d(3, eps=-1.0)


def test_state_dict_deepcopy_save_load_to_float64():
    torch.manual_seed(4)
    m = SwitchableNorm2d(4)
    _random_params(m)
    for _ in range(3):
        m(torch.randn(3, 4, 5, 5))
    m.eval()
    x = torch.randn(2, 4, 5, 5)
    y = m(x)
    m2 = SwitchableNorm2d(4).eval()
    m2.load_state_dict(m.state_dict())
    torch.testing.assert_close(m2(x), y, rtol=0, atol=0)
    m3 = copy.deepcopy(m)
    torch.testing.assert_close(m3(x), y, rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m4 = torch.load(buf, weights_only=False)
    assert type(m4) is SwitchableNorm2d
    torch.testing.assert_close(m4(x), y, rtol=0, atol=0)
    m5 = copy.deepcopy(m).to(torch.float64)
    assert all(t.dtype == torch.float64 for t in list(m5.parameters()) + list(m5.buffers()) if t.is_floating_point())
    torch.testing.assert_close(m5(x.double()), y.double(), rtol=1e-5, atol=1e-5)


def test_channels_last_kept():
    torch.manual_seed(5)
    m = SwitchableNorm2d(4)
    x = torch.randn(3, 4, 5, 6)
    y = m(x)
    y_cl = copy.deepcopy(m)(x.to(memory_format=torch.channels_last))
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y_cl, y, rtol=1e-6, atol=1e-6)
    x3 = torch.randn(2, 4, 3, 4, 5).to(memory_format=torch.channels_last_3d)
    assert SwitchableNorm3d(4)(x3).is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_large_values(dtype):
    torch.manual_seed(6)
    x64 = torch.randn(4, 3, 8, 8, dtype=torch.float64) * 1e4 + 3e3
    x = x64.to(dtype)
    m = SwitchableNorm2d(3)
    _random_params(m)
    ref = copy.deepcopy(m).double()
    m = m.to(dtype)
    assert m.running_var.dtype == torch.float32  # running statistics stay float32
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    y_ref = ref(x.double())
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(y.double(), y_ref, rtol=tol, atol=tol)
    assert torch.isfinite(m.running_var).all() and m.running_var.min() > 65504
    torch.testing.assert_close(m.running_var.double(), ref.running_var, rtol=1e-3, atol=0)
    m.eval()
    ref.eval()
    torch.testing.assert_close(m(x).double(), ref(x.double()), rtol=tol, atol=tol)


def test_torch_compile_same_output():
    torch.manual_seed(7)
    m = SwitchableNorm2d(4)
    _random_params(m)
    m_c = copy.deepcopy(m)
    x = torch.randn(3, 4, 6, 6)
    compiled = torch.compile(m_c)
    torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m_c.running_mean, m.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m_c.running_var, m.running_var, rtol=1e-6, atol=1e-7)


def test_without_moving_average_buffers_accumulate_sums():
    """using_moving_average=False (official option): running_mean sums batch means, running_var sums E[x^2]."""
    torch.manual_seed(8)
    m = SwitchableNorm2d(3, using_moving_average=False).double()
    xs = [torch.randn(4, 3, 5, 5, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    for x in xs:
        m(x)
    sum_mean = sum(x.mean((0, 2, 3)) for x in xs)
    # E[x^2] from the official per-instance unbiased variance: mean_n(var_in + mean_in^2)
    sum_sq = sum((x.flatten(2).var(-1) + x.flatten(2).mean(-1) ** 2).mean(0) for x in xs)
    torch.testing.assert_close(m.running_mean, sum_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_var, sum_sq, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- fused path
def _sn_functional_step(x, fused, training, using_bn, affine, seed=1):
    """One forward+backward of normlab.functional.switchable_norm; returns everything it computes or updates."""
    from normlab import functional as NF

    c, k = x.shape[1], 3 if using_bn else 2
    g = torch.Generator().manual_seed(seed)
    dt = x.dtype if x.dtype == torch.float64 else torch.float32
    mw = torch.randn(k, generator=g, dtype=dt).requires_grad_()
    vw = torch.randn(k, generator=g, dtype=dt).requires_grad_()
    w = (torch.rand(c, generator=g, dtype=dt) + 0.5).requires_grad_() if affine else None
    b = torch.randn(c, generator=g, dtype=dt).requires_grad_() if affine else None
    rm, rv = torch.randn(c, generator=g, dtype=dt), torch.rand(c, generator=g, dtype=dt) + 0.5
    xx = x.clone().requires_grad_()
    y = NF.switchable_norm(xx, mw, vw, w, b, rm, rv, training=training, using_bn=using_bn, fused=fused)
    y.backward(torch.randn(y.shape, generator=g, dtype=y.dtype))
    return y, [y, xx.grad, mw.grad, vw.grad, rm, rv] + ([w.grad, b.grad] if affine else [])


LAYOUTS = {
    "nchw": lambda dt: torch.randn(4, 3, 5, 6, dtype=dt) * 2 + 1,
    "channels_last": lambda dt: (torch.randn(4, 3, 5, 6, dtype=dt) * 2 + 1).to(memory_format=torch.channels_last),
    "ncdhw": lambda dt: torch.randn(3, 3, 2, 3, 4, dtype=dt) * 2 + 1,
    "channels_last_3d": lambda dt: (torch.randn(3, 3, 2, 3, 4, dtype=dt) * 2 + 1).to(
        memory_format=torch.channels_last_3d
    ),
    "ncl": lambda dt: torch.randn(4, 3, 7, dtype=dt) * 2 + 1,
    "strided": lambda dt: (torch.randn(4, 3, 6, 5, dtype=dt) * 2 + 1).transpose(2, 3),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("using_bn,affine", [(True, True), (False, True), (True, False)])
def test_fused_backward_equals_autograd_of_the_formula(layout, dtype, training, using_bn, affine):
    """The explicit backward (and the one-pass forward) against the composite implementation differentiated by
    autograd (the implementation before the fused path): outputs, every gradient, running statistics."""
    torch.manual_seed(0)
    x = LAYOUTS[layout](dtype)
    y, fused = _sn_functional_step(x, True, training, using_bn, affine)
    _, reference = _sn_functional_step(x, False, training, using_bn, affine)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if layout.startswith("channels_last"):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        assert y.is_contiguous(memory_format=fmt)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_fused_gradcheck_and_gradgradcheck_float64(fmt):
    torch.manual_seed(9)
    m = SwitchableNorm2d(3).double()
    _random_params(m)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]

    def f(t, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (t,))

    x = torch.randn(3, 3, 3, 2, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))
    m.eval()
    m.running_var.fill_(1.5)
    assert torch.autograd.gradgradcheck(f, (x, *params))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(10)
    m = SwitchableNorm2d(4)
    _random_params(m)
    m_c = copy.deepcopy(m)
    x = torch.randn(3, 4, 6, 6).to(memory_format=torch.channels_last)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = torch.compile(m_c, fullgraph=True)(xa)
    y.sum().backward()
    ye = m(xb)
    ye.sum().backward()
    torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(m_c.running_var, m.running_var, rtol=1e-6, atol=1e-7)
