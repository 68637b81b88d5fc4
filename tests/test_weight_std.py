"""Tests for WSConv{1,2,3}d and PWSConv{1,2,3}d (normlab/nn/weight_std.py).

The reference formulas (docs/design.md section 1) are written out here directly in float64.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from normlab.nn.weight_std import PWSConv1d, PWSConv2d, PWSConv3d, WSConv1d, WSConv2d, WSConv3d

PWS = {1: PWSConv1d, 2: PWSConv2d, 3: PWSConv3d}
WS = {1: WSConv1d, 2: WSConv2d, 3: WSConv3d}
PLAIN = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
F64 = torch.float64


# ----------------------------------------------------------------------------------------------------------
# reference formulas, written directly from docs/design.md section 1
# ----------------------------------------------------------------------------------------------------------
def ref_pws_kernel(w, alpha, gamma, n, relative=False):
    dims = tuple(range(1, w.dim()))
    mean = w.mean(dims, keepdim=True)
    var = ((w - mean) ** 2).mean(dims, keepdim=True)  # biased (population) variance
    g = gamma * 2.0 / n if relative else gamma
    a = alpha.reshape((-1,) + (1,) * (w.dim() - 1))
    return math.sqrt(2.0 / n) * a * (w - mean) / torch.sqrt(var + g)


def ref_ws_kernel(w, eps):
    dims = tuple(range(1, w.dim()))
    mean = w.mean(dims, keepdim=True)
    var = ((w - mean) ** 2).mean(dims, keepdim=True)
    return (w - mean) / torch.sqrt(var + eps)


def fan_in(m):
    return m.in_channels // m.groups * math.prod(m.kernel_size)


def rand_input(d, n=2, c=4, size=7, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, c) + (size,) * d, generator=g, dtype=dtype)


# configurations: (dim, kwargs)
GRAD_CASES = [
    (1, dict(kernel_size=3, padding=1)),
    (2, dict(kernel_size=(3, 2), groups=2, dilation=(2, 1), padding="same")),
    (3, dict(kernel_size=(2, 3, 1), stride=(1, 2, 1))),
]


# ----------------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,kw", GRAD_CASES)
@pytest.mark.parametrize("kind", ["ws", "pws"])
def test_gradcheck_float64(d, kw, kind):
    torch.manual_seed(0)
    cls = PWS[d] if kind == "pws" else WS[d]
    m = cls(2, 4, dtype=F64, **kw)
    x = rand_input(d, c=2, size=4).requires_grad_()
    params = {k: p.detach().clone().requires_grad_() for k, p in m.named_parameters()}
    if kind == "pws":
        with torch.no_grad():
            params["alpha"].uniform_(0.5, 1.5)
    names = list(params)

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params.values()), eps=1e-6, atol=1e-5)
    if kind == "pws":
        assert "alpha" in names  # the gradient w.r.t. alpha was checked


def test_gradient_reaching_raw_weight_has_zero_mean_per_filter():
    torch.manual_seed(0)
    m = PWSConv2d(8, 5, 3, dtype=F64)
    plain = nn.Conv2d(8, 5, 3, dtype=F64)
    x = rand_input(2, n=4, c=8, size=9) + 1.0  # positive mean input: plain conv gradients have a mean shift
    target = torch.randn(4, 5, 7, 7, dtype=F64)
    for conv in (m, plain):
        F.mse_loss(conv(x), target).backward()
    per_filter = m.weight.grad.mean((1, 2, 3))
    assert per_filter.abs().max() < 1e-12 * max(1.0, m.weight.grad.abs().max().item())
    assert plain.weight.grad.mean((1, 2, 3)).abs().max() > 1e-4  # the property is not trivial


# ----------------------------------------------------------------------------------------------------------
# equality with the reference formula
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("gamma", [1e-3, 0.1])
def test_pws_kernel_and_output_equal_reference(relative, gamma):
    torch.manual_seed(1)
    m = PWSConv2d(6, 4, (3, 5), padding=(1, 2), gamma=gamma, relative_gamma=relative, dtype=F64)
    with torch.no_grad():
        m.alpha.uniform_(0.2, 2.0)
        m.bias.uniform_(-1, 1)
    x = rand_input(2, c=6, size=8)
    n = 6 * 15
    ref = ref_pws_kernel(m.weight, m.alpha, gamma, n, relative)
    torch.testing.assert_close(m.effective_weight(), ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m(x), F.conv2d(x, ref, m.bias, padding=(1, 2)), rtol=1e-12, atol=1e-12)


def test_pws_fan_out_mode_and_relative_gamma_use_the_same_n():
    torch.manual_seed(2)
    m = PWSConv2d(4, 6, 3, groups=2, fan_mode="fan_out", relative_gamma=True, gamma=0.1, dtype=F64)
    n_out = 6 // 2 * 9
    assert m.fan == n_out
    torch.testing.assert_close(m.effective_weight(), ref_pws_kernel(m.weight, m.alpha, 0.1, n_out, True))


@pytest.mark.parametrize("d", [1, 2, 3])
def test_ws_kernel_and_output_equal_reference(d):
    torch.manual_seed(3)
    m = WS[d](4, 3, 3, eps=1e-4, dtype=F64)
    x = rand_input(d, c=4, size=5)
    ref = ref_ws_kernel(m.weight, 1e-4)
    torch.testing.assert_close(m.effective_weight(), ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m(x), CONV_FN[d](x, ref, m.bias), rtol=1e-12, atol=1e-12)


def test_pws_init():
    torch.manual_seed(4)
    m = PWSConv2d(64, 128, 3)
    assert torch.equal(m.alpha, torch.ones(128)) and torch.equal(m.bias, torch.zeros(128))
    assert PWSConv2d(3, 4, 3, bias=False).bias is None
    # Kaiming normal, fan_in, ReLU gain: Var(W) = 2 / fan_in  (73,728 samples: 1.5% tolerance is > 5 sigma)
    assert abs(m.weight.var().item() * fan_in(m) / 2.0 - 1.0) < 0.03
    assert abs(m.weight.mean().item()) < 5 * math.sqrt(2.0 / 576 / m.weight.numel())
    mo = PWSConv2d(16, 8, 3, groups=4, fan_mode="fan_out")
    assert mo.fan == 8 // 4 * 9


@pytest.mark.parametrize("cls", [PWSConv3d, WSConv1d])
def test_device_and_dtype_arguments(cls):
    m = cls(2, 4, 3, device="meta", dtype=torch.float64)
    assert all(t.device.type == "meta" for t in list(m.parameters()) + list(m.buffers()))
    assert all(p.dtype == torch.float64 for p in m.parameters())
    if cls is PWSConv3d:
        assert m.alpha.shape == (4,) and m.alpha_initialized.dtype == torch.bool


# ----------------------------------------------------------------------------------------------------------
# a folded PWS conv is a plain conv, for every conv argument
# ----------------------------------------------------------------------------------------------------------
FOLD_CASES = [
    (1, dict(kernel_size=3, stride=2, padding=1)),
    (1, dict(kernel_size=4, padding="same", dilation=2, padding_mode="reflect")),
    (1, dict(kernel_size=3, padding="valid", groups=4, bias=False)),
    (2, dict(kernel_size=(3, 1), padding=(1, 0), padding_mode="circular")),
    (2, dict(kernel_size=(2, 3), stride=(2, 1), dilation=(1, 2), groups=2, padding=(1, 2), padding_mode="replicate")),
    (2, dict(kernel_size=3, padding="same", padding_mode="reflect", bias=False)),
    (2, dict(kernel_size=(1, 4), padding="same", dilation=(1, 3), groups=4)),
    (3, dict(kernel_size=(3, 1, 2), padding=(1, 0, 1), stride=(1, 1, 2), padding_mode="circular")),
    (3, dict(kernel_size=2, groups=2, dilation=2, padding="same")),
]


@pytest.mark.parametrize("d,kw", FOLD_CASES)
@pytest.mark.parametrize("kind", ["ws", "pws"])
def test_folded_kernel_is_a_plain_conv(d, kw, kind):
    torch.manual_seed(5)
    cls = PWS[d] if kind == "pws" else WS[d]
    m = cls(4, 8, dtype=F64, **kw)
    if kind == "pws":
        with torch.no_grad():
            m.alpha.uniform_(0.5, 2)
    if m.bias is not None:
        with torch.no_grad():
            m.bias.uniform_(-1, 1)
    plain = PLAIN[d](4, 8, dtype=F64, **kw)
    with torch.no_grad():
        plain.weight.copy_(m.effective_weight())
        if m.bias is not None:
            plain.bias.copy_(m.bias)
    x = rand_input(d, c=4, size=6)
    y = m(x)
    torch.testing.assert_close(y, plain(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m(x[0]), plain(x[0]), rtol=1e-12, atol=1e-12)  # unbatched input


# ----------------------------------------------------------------------------------------------------------
# variance transmission at init (docs/design.md section 1: ~0.68 per PWS conv + ReLU with alpha = 1)
# ----------------------------------------------------------------------------------------------------------
def test_variance_shrink_with_relu_inputs():
    """Z ~ N(0,1) i.i.d., X = ReLU(Z), Y = PWS(X): Var[Y] = n Var[W_hat] Var[X] (zero-mean filters remove the
    E^2[X] term) = 2 (1/2 - 1/(2 pi)) * mean_o(var_o / (var_o + g)) = (1 - 1/pi) * shrink.
    With g negligible the ratio is 1 - 1/pi = 0.682 (docs/design.md section 1). Tolerance 3% (about 1.3M output values,
    spatially correlated; observed error < 1%)."""
    torch.manual_seed(6)
    z = torch.randn(32, 64, 18, 18)
    x = F.relu(z)
    m = PWSConv2d(64, 64, 3, gamma=1e-9)
    with torch.no_grad():
        y = m(x)
    assert abs(y.var().item() / z.var().item() - (1 - 1 / math.pi)) < 0.03 * (1 - 1 / math.pi)
    # post-ReLU activations shrink by the same factor
    assert abs(F.relu(y).var().item() / x.var().item() - (1 - 1 / math.pi)) < 0.03 * (1 - 1 / math.pi)
    # with the default gamma = 1e-3 and Var(W) = 2/576 the kernel itself is shrunk further
    m.gamma = 1e-3
    with torch.no_grad():
        y = m(x)
        var_o = m.weight.var((1, 2, 3), unbiased=False)
        shrink = (var_o / (var_o + 1e-3)).mean().item()
    expected = (1 - 1 / math.pi) * shrink
    assert expected < 0.6  # the default gamma is not negligible at this fan_in
    assert abs(y.var().item() / z.var().item() - expected) < 0.03 * expected


# ----------------------------------------------------------------------------------------------------------
# data-dependent alpha init
# ----------------------------------------------------------------------------------------------------------
def test_init_alpha_makes_output_variance_two():
    torch.manual_seed(7)
    m = PWSConv2d(8, 16, 3, init_alpha=True, padding=1)
    assert not m.alpha_initialized
    x = F.relu(torch.randn(16, 8, 10, 10)) * 3.0
    y = m(x)
    assert bool(m.alpha_initialized)
    assert torch.allclose(m.alpha, m.alpha[0].expand(16))  # one value for the whole layer
    # the authors' initalpha uses the unbiased variance (torch.var's default); biased would give 2.00008 here
    assert abs(y.double().var(unbiased=True).item() - 2.0) < 1e-5
    before = m.alpha.detach().clone()
    m(torch.randn(16, 8, 10, 10) * 10)  # only the first training forward initializes
    assert torch.equal(m.alpha, before)


def test_init_alpha_not_disabled_by_eval_first():
    torch.manual_seed(8)
    m = PWSConv2d(4, 4, 3, init_alpha=True).eval()
    x = torch.randn(8, 4, 6, 6) * 5
    m(x)
    assert not m.alpha_initialized and torch.equal(m.alpha, torch.ones(4))  # eval forwards do not init
    m.train()
    y = m(x)
    assert bool(m.alpha_initialized)
    assert abs(y.double().var(unbiased=True).item() - 2.0) < 1e-5


def test_init_alpha_never_overwrites_loaded_alpha():
    torch.manual_seed(9)
    src = PWSConv2d(4, 4, 3, init_alpha=True)
    src(torch.randn(4, 4, 6, 6))
    with torch.no_grad():
        src.alpha.mul_(torch.arange(1.0, 5.0))  # "trained" alpha
    dst = PWSConv2d(4, 4, 3, init_alpha=True)
    dst.load_state_dict(src.state_dict())
    dst(torch.randn(4, 4, 6, 6) * 7)
    assert torch.equal(dst.alpha, src.alpha)
    # a checkpoint of a layer built without init_alpha also counts as initialized
    plain_src = PWSConv2d(4, 4, 3)
    with torch.no_grad():
        plain_src.alpha.fill_(0.3)
    dst2 = PWSConv2d(4, 4, 3, init_alpha=True)
    dst2.load_state_dict(plain_src.state_dict())
    dst2(torch.randn(4, 4, 6, 6))
    assert torch.equal(dst2.alpha, torch.full((4,), 0.3))
    # a foreign checkpoint without the flag but with alpha: loaded (strict) and never overwritten
    foreign = {k: v for k, v in plain_src.state_dict().items() if k != "alpha_initialized"}
    dst3 = PWSConv2d(4, 4, 3, init_alpha=True)
    dst3.load_state_dict(foreign)
    dst3(torch.randn(4, 4, 6, 6))
    assert torch.equal(dst3.alpha, torch.full((4,), 0.3))
    # a checkpoint saved before the first training forward keeps the init armed
    fresh = PWSConv2d(4, 4, 3, init_alpha=True)
    dst4 = PWSConv2d(4, 4, 3, init_alpha=True)
    dst4.load_state_dict(fresh.state_dict())
    dst4(torch.randn(4, 4, 6, 6) * 4)
    assert bool(dst4.alpha_initialized) and not torch.equal(dst4.alpha, torch.ones(4))


# ----------------------------------------------------------------------------------------------------------
# inference cache: never stale, no graph, not persistent
# ----------------------------------------------------------------------------------------------------------
def _eval_pws(seed=10, **kw):
    torch.manual_seed(seed)
    m = PWSConv2d(4, 6, 3, padding=1, **kw).eval()
    return m


def _ref_out(m, x):
    k = ref_pws_kernel(m.weight.detach().double(), m.alpha.detach().double(), m.gamma, m.fan)
    return F.conv2d(x.double(), k, m.bias.detach().double(), padding=1)


def test_cache_is_used_in_eval_and_not_in_training():
    m = _eval_pws()
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        m(x)
        first = m._weight_cache[2]
        m(x)
        assert m._weight_cache[2] is first  # reused
    assert first.grad_fn is None and not first.requires_grad  # no autograd graph kept
    m.train()
    m._weight_cache = None
    m(x)
    assert m._weight_cache is None  # training never fills or reads the cache
    m.eval()
    y = m(x)  # eval with grad enabled: no cache, gradients flow to weight and alpha
    assert m._weight_cache is None
    y.sum().backward()
    assert m.weight.grad is not None and m.alpha.grad is not None


def test_cache_under_inference_mode():
    m = _eval_pws()
    x = torch.randn(2, 4, 5, 5)
    with torch.inference_mode():
        y1, y2 = m(x), m(x)
    assert m._weight_cache is not None and torch.equal(y1, y2)
    with torch.no_grad():
        m.weight.mul_(0.5)
        m.alpha.mul_(2.0)
    with torch.inference_mode():
        y3 = m(x)
        torch.testing.assert_close(y3.double(), _ref_out(m, x), rtol=1e-5, atol=1e-6)
        created_inside = PWSConv2d(4, 6, 3, padding=1).eval()  # inference-tensor parameters: no cache, still correct
        torch.testing.assert_close(created_inside(x).double(), _ref_out(created_inside, x), rtol=1e-5, atol=1e-6)


def test_eval_under_vmap_ensemble():
    """torch.func ensembles (stacked parameters, vmap) in eval: tensors without storage bypass the cache."""
    from torch.func import stack_module_state, vmap

    torch.manual_seed(18)
    models = [PWSConv2d(3, 4, 3).eval() for _ in range(3)]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers, x)
        for i, m in enumerate(models):
            torch.testing.assert_close(y[i], m(x))


def test_weight_cache_modes():
    x = torch.randn(2, 4, 5, 5)
    with pytest.raises(ValueError, match=r"PWSConv2d: weight_cache must be one of auto, verified, identity, off"):
        PWSConv2d(4, 6, 3, weight_cache="always")
    off = _eval_pws(weight_cache="off")
    with torch.no_grad():
        off(x)
    assert off._weight_cache is None
    # identity: tracked edits (no_grad in-place, load_state_dict) are seen, `.data` edits are not (documented)
    ident = _eval_pws(weight_cache="identity")
    with torch.no_grad():
        ident(x)
        ident.weight.mul_(-1.0)
        torch.testing.assert_close(ident(x).double(), _ref_out(ident, x), rtol=1e-5, atol=1e-6)
        ident.weight.data[0].mul_(3.0)
        assert not torch.allclose(ident(x).double(), _ref_out(ident, x), rtol=1e-5, atol=1e-6)
        ident.clear_weight_cache()
        torch.testing.assert_close(ident(x).double(), _ref_out(ident, x), rtol=1e-5, atol=1e-6)
        ident(x)
        ident.weight.data[1].mul_(3.0)
        ident.weight_cache = "verified"  # switching mode never reuses an unverified entry
        torch.testing.assert_close(ident(x).double(), _ref_out(ident, x), rtol=1e-5, atol=1e-6)
    # auto: verified on CPU, off elsewhere (checked on the meta device)
    assert _eval_pws().weight_cache == "auto"
    meta = PWSConv2d(4, 6, 3, device="meta").eval()
    with torch.no_grad():
        assert meta(torch.empty(2, 4, 5, 5, device="meta")).shape == (2, 6, 3, 3)
    assert meta._weight_cache is None
    ws = WSConv2d(4, 6, 3, weight_cache="identity").eval()
    assert ws.weight_cache == "identity"


def test_cache_not_stale_after_load_state_dict_in_eval():
    m = _eval_pws()
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        m(x)
    other = PWSConv2d(4, 6, 3, padding=1)
    with torch.no_grad():
        other.alpha.fill_(0.5)
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(m(x).double(), _ref_out(other, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("edit", ["no_grad_inplace", "data_inplace", "alpha_inplace", "data_assign", "copy_", "kernel"])
def test_cache_not_stale_after_weight_edit_in_eval(edit):
    m = _eval_pws()
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        before = m(x).clone()
        if edit == "no_grad_inplace":
            m.weight.mul_(torch.linspace(-1, 1, 6).reshape(6, 1, 1, 1))
        elif edit == "data_inplace":  # bypasses the autograd version counter
            m.weight.data[0].neg_()
        elif edit == "alpha_inplace":
            m.alpha.data[2] = 3.0
        elif edit == "data_assign":
            m.weight.data = torch.randn_like(m.weight)
        elif edit == "kernel":  # a caller modifies the returned (cached) kernel in place
            m.effective_weight().mul_(3.0)
        else:
            m.weight.copy_(torch.randn_like(m.weight))
        after = m(x)
    if edit != "kernel":
        assert not torch.allclose(before, after)
    torch.testing.assert_close(after.double(), _ref_out(m, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conv", ["double", "to_f64", "half", "bfloat16"])
def test_cache_follows_dtype_conversions(conv):
    m = _eval_pws()
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        m(x)
    assert m._weight_cache is not None
    m = {"double": m.double, "to_f64": lambda: m.to(F64), "half": m.half, "bfloat16": m.bfloat16}[conv]()
    assert m._weight_cache is None  # dropped by _apply, never carried over in the old dtype/device
    dtype = m.weight.dtype
    with torch.no_grad():
        y = m(x.to(dtype))
        assert m._weight_cache[2].dtype == dtype
    assert y.dtype == dtype
    tol = 1e-12 if dtype == F64 else 3e-2
    torch.testing.assert_close(y.double(), _ref_out(m, x.to(dtype)), rtol=tol, atol=tol)


def test_cache_not_in_state_dict_and_dropped_by_deepcopy_and_pickle():
    m = _eval_pws()
    with torch.no_grad():
        m(torch.randn(1, 4, 5, 5))
    assert set(m.state_dict()) == {"weight", "bias", "alpha", "alpha_initialized"}
    assert "_weight_cache" not in dict(m.named_buffers())
    assert copy.deepcopy(m)._weight_cache is None
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False)._weight_cache is None
    assert m._weight_cache is not None  # the original keeps its own


# ----------------------------------------------------------------------------------------------------------
# module plumbing: no bound forward, deepcopy, save/load, compile, state_dict, dtypes, memory format
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [True, False])
def test_no_bound_forward_and_copies_use_their_own_parameters(train):
    m = _eval_pws().train(train)
    assert "forward" not in vars(m)
    c = copy.deepcopy(m)
    assert "forward" not in vars(c)
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        m(x)
        c.weight.mul_(-2.0)
        c.alpha.fill_(0.7)
        yc, ym = c(x), m(x)
    torch.testing.assert_close(yc.double(), _ref_out(c, x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ym.double(), _ref_out(m, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [PWSConv2d, WSConv3d])
def test_whole_module_save_load_and_state_dict_round_trip(cls):
    torch.manual_seed(11)
    model = nn.Sequential(cls(3, 4, 3), nn.ReLU(), cls(4, 2, 1))
    x = torch.randn(2, 3, 5, 5, 5)[:, :, :, :, 0] if cls is PWSConv2d else torch.randn(2, 3, 5, 5, 5)
    y = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), y, rtol=0, atol=0)
    fresh = nn.Sequential(cls(3, 4, 3), nn.ReLU(), cls(4, 2, 1))
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(x), y, rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(model)(x), y, rtol=0, atol=0)


def test_to_float64():
    torch.manual_seed(12)
    m = PWSConv1d(3, 4, 3).to(F64)
    assert m.weight.dtype == m.alpha.dtype == m.bias.dtype == F64
    x = rand_input(1, c=3)
    torch.testing.assert_close(m(x), F.conv1d(x, ref_pws_kernel(m.weight, m.alpha, 1e-3, 9), m.bias))


def test_channels_last_input_gives_channels_last_output():
    torch.manual_seed(13)
    m = PWSConv2d(8, 8, 3, padding=1)
    plain = nn.Conv2d(8, 8, 3, padding=1)
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    y, yp = m(x), plain(x)
    cl = torch.channels_last
    assert y.is_contiguous(memory_format=cl) == yp.is_contiguous(memory_format=cl) is True
    m2 = copy.deepcopy(m).to(memory_format=cl)
    torch.testing.assert_close(m2(x), y, rtol=1e-5, atol=1e-5)
    assert m2(x).is_contiguous(memory_format=cl)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["ws", "pws"])
def test_half_weights_with_large_values_use_fp32_statistics(dtype, kind):
    """Weights ~1e3: the per-filter variance ~1e6 would overflow float16 (max 65504)."""
    torch.manual_seed(14)
    m = (PWSConv2d if kind == "pws" else WSConv2d)(4, 4, 3)
    with torch.no_grad():
        m.weight.normal_(0, 1e3)
    m = m.to(dtype)
    w64 = m.weight.double()
    assert (w64.var() > 65504).item()
    k = m.effective_weight()
    assert k.dtype == dtype and torch.isfinite(k).all()
    ref = ref_pws_kernel(w64, m.alpha.double(), m.gamma, m.fan) if kind == "pws" else ref_ws_kernel(w64, m.eps)
    rtol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(k.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())
    x = torch.randn(2, 4, 6, 6, dtype=dtype) * 100
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    y_ref = F.conv2d(x.double(), ref, m.bias.double() if m.bias is not None else None)
    torch.testing.assert_close(y.double(), y_ref, rtol=3e-2, atol=3e-2 * y_ref.abs().max().item())


def test_torch_compile_matches_eager():
    torch.manual_seed(15)
    m = PWSConv2d(3, 4, (3, 2), padding=1, groups=1, padding_mode="reflect")
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(m, backend="aot_eager")
    torch.testing.assert_close(compiled(x), m(x), rtol=1e-6, atol=1e-6)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-6, atol=1e-6)
        m.weight.mul_(2.0)  # a compiled graph never bakes in a stale kernel
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-6, atol=1e-6)


def test_torch_jit_trace_matches_eager_and_does_not_capture_cache():
    """torch.jit.script is deprecated and normlab.functional is not scriptable: trace is the TorchScript path."""
    torch.manual_seed(16)
    m = PWSConv2d(3, 4, 3).eval()
    x = torch.randn(2, 3, 6, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            m(x)  # fill the eager cache first
            traced = torch.jit.trace(m, x)
            torch.testing.assert_close(traced(x), m(x))
            m.weight.mul_(-1.0)
            torch.testing.assert_close(traced(x), m(x))


# ----------------------------------------------------------------------------------------------------------
# bad arguments and inputs
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.0, -1e-3, float("nan"), float("inf")])
def test_bad_gamma(gamma):
    with pytest.raises(ValueError, match=r"PWSConv2d: gamma must be"):
        PWSConv2d(3, 4, 3, gamma=gamma)


def test_bad_arguments_and_inputs():
    with pytest.raises(ValueError, match=r"PWSConv1d: fan_mode must be one of fan_in, fan_out"):
        PWSConv1d(3, 4, 3, fan_mode="fan_avg")
    with pytest.raises(ValueError, match=r"WSConv2d: eps must be"):
        WSConv2d(3, 4, 3, eps=0)
    m = PWSConv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r"PWSConv2d: expected 4D input .* got 5D"):
        m(torch.randn(1, 3, 5, 5, 5))
    with pytest.raises(ValueError, match=r"PWSConv2d: expected input with 3 channels, got 2"):
        m(torch.randn(1, 2, 5, 5))
    with pytest.raises(ValueError, match=r"WSConv1d: expected input with 3 channels, got 5"):
        WSConv1d(3, 4, 3)(torch.randn(5, 8))


def test_autocast_bfloat16_matches_reference():
    torch.manual_seed(17)
    m = PWSConv2d(4, 4, 3, padding=1)
    x = torch.randn(2, 4, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    ref = F.conv2d(
        x.double(),
        ref_pws_kernel(m.weight.double(), m.alpha.double(), m.gamma, m.fan).detach(),
        m.bias.double(),
        padding=1,
    )
    torch.testing.assert_close(y.double(), ref.detach(), rtol=3e-2, atol=3e-2 * ref.abs().max().item())


def _ddp_init_alpha_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        m = PWSConv2d(3, 4, 3, init_alpha=True)  # same weights on every rank
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(4, 3, 6, 6, generator=g) * (1.0 + 2.0 * rank)  # different data per rank
        m(x)
        torch.save({"alpha": m.alpha.detach(), "x": x, "weight": m.weight.detach()}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_init_alpha_pools_variance_over_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_init_alpha_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(r0["alpha"], r1["alpha"])  # identical alpha on every rank
    k = ref_pws_kernel(r0["weight"].double(), torch.ones(4, dtype=F64), 1e-3, 27)
    ys = [F.conv2d(r["x"].double(), k) for r in (r0, r1)]
    pooled = torch.cat([y.reshape(-1) for y in ys]).var(unbiased=True)
    torch.testing.assert_close(
        r0["alpha"].double(), torch.full((4,), math.sqrt(2 / pooled.item()), dtype=F64), rtol=1e-5, atol=0
    )


def test_ws_pws_kernels_have_exact_second_derivatives():
    """Double backward (gradient penalties, Hessian-vector products) through the standardized kernel is exact."""
    from normlab.functional import pws_weight, standardize_weight

    torch.manual_seed(11)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    a = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda w, a: pws_weight(w, a, gamma=1e-3), (w, a))
    assert torch.autograd.gradgradcheck(lambda w: standardize_weight(w), (w,))


def test_pws_conv_compiles_fullgraph():
    torch.manual_seed(12)
    conv = PWSConv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), conv(x))
