"""InstanceNorm1d/2d/3d against torch.nn.InstanceNorm*d and the formula of docs/design.md section 4."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from normlab.nn import instance_norm as instance_norm_module
from normlab.nn.instance_norm import InstanceNorm1d, InstanceNorm2d, InstanceNorm3d

CLASSES = {
    1: (InstanceNorm1d, nn.InstanceNorm1d),
    2: (InstanceNorm2d, nn.InstanceNorm2d),
    3: (InstanceNorm3d, nn.InstanceNorm3d),
}
SHAPES = {1: (3, 4, 9), 2: (3, 4, 5, 6), 3: (2, 4, 3, 4, 5)}


def _randomize_affine(ours, ref):
    with torch.no_grad():
        for name in ("weight", "bias"):
            if getattr(ours, name) is not None:
                val = torch.randn_like(getattr(ours, name))
                getattr(ours, name).copy_(val)
                getattr(ref, name).copy_(val)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("affine", [False, True])
def test_matches_torch_forward_backward(dim, affine):
    torch.manual_seed(0)
    ours_cls, ref_cls = CLASSES[dim]
    ours, ref = ours_cls(4, affine=affine), ref_cls(4, affine=affine)
    _randomize_affine(ours, ref)
    x = (torch.randn(SHAPES[dim]) * 3 + 1).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    if affine:
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-5)


def test_formula_float64():
    torch.manual_seed(1)
    m = InstanceNorm2d(3, affine=True, eps=1e-3).double()
    with torch.no_grad():
        m.weight.uniform_(0.5, 2)
        m.bias.normal_()
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    mean = x.mean((2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean((2, 3), keepdim=True)  # biased
    expected = (x - mean) / torch.sqrt(var + 1e-3) * m.weight.view(1, 3, 1, 1) + m.bias.view(1, 3, 1, 1)
    torch.testing.assert_close(m(x), expected, rtol=1e-12, atol=1e-12)


def test_track_running_stats_matches_torch_over_steps():
    torch.manual_seed(2)
    ours = InstanceNorm2d(4, affine=True, track_running_stats=True, momentum=0.3)
    ref = nn.InstanceNorm2d(4, affine=True, track_running_stats=True, momentum=0.3)
    _randomize_affine(ours, ref)
    for _ in range(4):
        x = torch.randn(3, 4, 5, 5) * 2 + 0.5
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    ours.eval()
    ref.eval()
    x = torch.randn(2, 4, 5, 5)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    # a torch checkpoint loads into ours (same state_dict keys)
    fresh = InstanceNorm2d(4, affine=True, track_running_stats=True).eval()
    fresh.load_state_dict(ref.state_dict())
    torch.testing.assert_close(fresh(x), ref(x), rtol=1e-5, atol=1e-5)


def test_nonfinite_batch_does_not_poison_running_stats():
    m = InstanceNorm2d(2, track_running_stats=True)
    m(torch.randn(2, 2, 3, 3))
    before = (m.running_mean.clone(), m.running_var.clone())
    bad = torch.randn(2, 2, 3, 3)
    bad[0, 1, 0, 0] = float("nan")
    m(bad)
    assert torch.equal(m.running_mean, before[0]) and torch.equal(m.running_var, before[1])
    assert int(m.skipped_batches) == 1
    with pytest.warns(RuntimeWarning, match="InstanceNorm2d: 1 training batch"):
        m.eval()


def test_center_scale_aliases():
    m = InstanceNorm2d(3, center=True, scale=False)
    assert m.weight is None and m.bias is not None and not m.affine
    m = InstanceNorm2d(3, center=False, scale=True)
    assert m.weight is not None and m.bias is None
    m = InstanceNorm2d(3, affine=True)
    assert m.center and m.scale
    x = torch.randn(2, 3, 4, 4)
    m = InstanceNorm2d(3, center=True, scale=False)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([1.0, -2.0, 3.0]))
    torch.testing.assert_close(m(x), nn.functional.instance_norm(x) + m.bias.view(1, 3, 1, 1))


def test_gradcheck_float64():
    torch.manual_seed(3)
    m = InstanceNorm2d(3, affine=True).double()
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(2, 3, 3, 4, dtype=torch.float64, requires_grad=True)

    # w.r.t. input and the affine parameters (the module's own forward, with the parameters swapped in)
    def f(t, w, b):
        return torch.func.functional_call(m, {"weight": w, "bias": b}, (t,))

    w = m.weight.detach().clone().requires_grad_()
    b = m.bias.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x, w, b))
    # the functional used for half inputs, in float64
    from normlab.functional import instance_norm

    assert torch.autograd.gradcheck(lambda t, w_, b_: instance_norm(t, w_, b_), (x, w, b))
    assert torch.autograd.gradcheck(m, (x,))


def _penalty_grad(norm):
    """Weight gradient of a WGAN-GP style gradient penalty through conv -> norm (needs double backward)."""
    g = torch.Generator().manual_seed(4)
    inp = torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=g)
    kernel = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=g).requires_grad_()
    w_out = torch.randn(2, 4, 4, 4, dtype=torch.float64, generator=g)
    x = inp.requires_grad_()
    out = (torch.tanh(norm(nn.functional.conv2d(x, kernel))) * w_out).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    (h,) = torch.autograd.grad((gx.flatten(1).norm(dim=1) - 1).square().mean(), kernel)
    return h


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_double_backward_gradient_penalty_matches_torch(fmt):
    m = InstanceNorm2d(4, affine=True).double()
    ref = _penalty_grad(nn.InstanceNorm2d(4).double())
    penalty = _penalty_grad(lambda t: m(t.contiguous(memory_format=fmt)))
    torch.testing.assert_close(penalty, ref, rtol=1e-9, atol=1e-12)
    x = torch.randn(2, 4, 3, 4, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    assert torch.autograd.gradgradcheck(m, (x,))


def test_functional_instance_norm_double_backward():
    """functional.instance_norm (used for half inputs) has exact second derivatives too (moments' correction term)."""
    from normlab.functional import instance_norm

    torch.testing.assert_close(
        _penalty_grad(instance_norm), _penalty_grad(nn.InstanceNorm2d(4).double()), rtol=1e-7, atol=1e-9
    )


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_float32_large_mean_accurate(fmt):
    """Values 1e4 +- 1 in float32: still correct in both memory formats (torch's CPU channels_last group norm
    computes E[x^2] - E[x]^2 and is off by ~1e3 here; the layer must not take that path)."""
    torch.manual_seed(11)
    x64 = torch.randn(2, 4, 16, 16, dtype=torch.float64) + 1e4
    x = x64.float().contiguous(memory_format=fmt)
    y = InstanceNorm2d(4)(x)
    ref = nn.functional.instance_norm(x.double())  # the float32-rounded input, normalized in float64
    assert (y.double() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("dim, fmt", [(2, torch.channels_last), (3, torch.channels_last_3d)])
def test_channels_last_kept(dim, fmt):
    torch.manual_seed(5)
    ours_cls, ref_cls = CLASSES[dim]
    x = torch.randn(SHAPES[dim]).to(memory_format=fmt)
    y = ours_cls(4, affine=True)(x)
    assert y.is_contiguous(memory_format=fmt)
    y_ref = ref_cls(4, affine=True)(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    x_c = x.contiguous()
    assert ours_cls(4)(x_c).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_large_values_finite(dtype):
    torch.manual_seed(6)
    base = torch.randn(2, 4, 8, 8, dtype=torch.float64) * 1e4 + 5e3
    x = base.to(dtype)
    m = InstanceNorm2d(4, affine=True).to(dtype)
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    assert m(x.contiguous(memory_format=torch.channels_last)).is_contiguous(memory_format=torch.channels_last)
    ref = nn.functional.instance_norm(x.double())
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    # with running stats as well (train and eval)
    m = InstanceNorm2d(4, track_running_stats=True).to(dtype)
    assert m.running_var.dtype == torch.float32  # buffers stay float32 after .to(half)
    assert torch.isfinite(m(x)).all()
    assert torch.isfinite(m.running_var).all() and m.running_var.min() > 65504
    m.eval()
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()


def test_unbatched_input_like_torch():
    torch.manual_seed(7)
    x = torch.randn(4, 5, 6)
    torch.testing.assert_close(InstanceNorm2d(4)(x), nn.InstanceNorm2d(4)(x), rtol=1e-5, atol=1e-5)


def test_state_dict_deepcopy_save_load():
    torch.manual_seed(8)
    m = InstanceNorm2d(4, affine=True, track_running_stats=True)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    m(torch.randn(3, 4, 5, 5))
    assert set(m.state_dict()) == set(nn.InstanceNorm2d(4, affine=True, track_running_stats=True).state_dict())
    m.eval()
    x = torch.randn(2, 4, 5, 5)
    y = m(x)
    m2 = InstanceNorm2d(4, affine=True, track_running_stats=True).eval()
    m2.load_state_dict(m.state_dict())
    torch.testing.assert_close(m2(x), y, rtol=0, atol=0)
    m3 = copy.deepcopy(m)
    torch.testing.assert_close(m3(x), y, rtol=0, atol=0)
    assert m3.running_mean.data_ptr() != m.running_mean.data_ptr()
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m4 = torch.load(buf, weights_only=False)
    assert type(m4) is InstanceNorm2d and m4._normlab_norm
    torch.testing.assert_close(m4(x), y, rtol=0, atol=0)
    m5 = m.to(torch.float64)
    assert m5.weight.dtype == torch.float64 and m5.running_var.dtype == torch.float64
    assert m5(x.double()).dtype == torch.float64


def test_torch_compile_same_output():
    torch.manual_seed(9)
    m = InstanceNorm2d(4, affine=True)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    x = torch.randn(2, 4, 6, 6)
    compiled = torch.compile(m)
    torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim, layout", [(1, None), (2, None), (2, torch.channels_last), (3, torch.channels_last_3d)])
def test_compiled_route_equals_eager_in_every_layout(dim, layout):
    """The compiled route (torch.compile: F.instance_norm's arithmetic, on contiguous input F.instance_norm itself,
    on channels_last the same arithmetic in the input's layout, the running statistics from the same var_mean) gives
    eager's output, memory format, gradients and running statistics: training with running statistics, then eval."""
    cls = {1: InstanceNorm1d, 2: InstanceNorm2d, 3: InstanceNorm3d}[dim]
    gen = torch.Generator().manual_seed(100)
    m = cls(4, affine=True, track_running_stats=True)
    with torch.no_grad():
        m.weight.normal_(generator=gen)
        m.bias.normal_(generator=gen)
    eager = copy.deepcopy(m)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    shape = (3, 4) + (5, 6, 7)[:dim]
    for _ in range(2):
        x = torch.randn(shape, generator=gen) * 3 + 2
        g = torch.randn(shape, generator=gen)
        if layout is not None:
            x = x.contiguous(memory_format=layout)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, ye = compiled(xc), eager(xe)
        (y * g).sum().backward()
        (ye * g).sum().backward()
        torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-5)
        assert y.stride() == ye.stride()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-5)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(m, name), getattr(eager, name), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.bias.grad, eager.bias.grad, rtol=1e-5, atol=1e-5)
    assert int(m.num_batches_tracked) == int(eager.num_batches_tracked) == 2
    m.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)


def test_input_errors():
    m = InstanceNorm2d(4)
    with pytest.raises(ValueError, match=r"InstanceNorm2d: expected 4D input \(N, C, H, W\).*got 2D"):
        m(torch.randn(2, 4))
    with pytest.raises(ValueError, match="InstanceNorm2d: expected 4D.*got 5D"):
        m(torch.randn(2, 4, 3, 3, 3))
    with pytest.raises(ValueError, match="InstanceNorm2d: expected 4 channels.*got 3"):
        m(torch.randn(2, 3, 5, 5))
    with pytest.raises(ValueError, match="InstanceNorm2d: expected more than 1 spatial value"):
        m(torch.randn(2, 4, 1, 1))
    with pytest.raises(ValueError, match="InstanceNorm1d: expected more than 1 spatial value"):
        InstanceNorm1d(4)(torch.randn(2, 4, 1))
    with pytest.raises(ValueError, match="InstanceNorm3d: expected 5D"):
        InstanceNorm3d(4)(torch.randn(2, 4, 3))
    # with running statistics, eval on a single value per channel is fine (as torch)
    m = InstanceNorm2d(4, track_running_stats=True).eval()
    assert torch.isfinite(m(torch.randn(2, 4, 1, 1))).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_features": 0}, "num_features"),
        ({"num_features": 4, "eps": 0.0}, "eps"),
        ({"num_features": 4, "momentum": 1.5}, "momentum"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=f"InstanceNorm2d: {match}"):
        InstanceNorm2d(**kwargs)


@pytest.mark.parametrize("cls", [InstanceNorm1d, InstanceNorm2d, InstanceNorm3d])
def test_counted_as_a_norm_layer_by_the_weight_decay_groups_and_the_monitor(cls):
    """What marking a normalization layer is for: no weight decay on its affine parameters, and the monitor records
    it as a norm (not as a layer with a weight to watch)."""
    from normlab.monitor import supported_layers
    from normlab.nn import param_groups

    dim = {InstanceNorm1d: 1, InstanceNorm2d: 2, InstanceNorm3d: 3}[cls]
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1](2, 3, 1)
    model = nn.Sequential(conv, cls(3, affine=True))
    groups = param_groups(model, weight_decay=0.1)
    no_decay = {id(p) for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert id(model[1].weight) in no_decay and id(model[1].bias) in no_decay and id(conv.weight) not in no_decay
    assert ("1", model[1], "norm") in [(n, m, k) for n, m, k in supported_layers(model)]


def test_momentum_none_is_cumulative_average():
    """momentum=None: running stats are the plain average over batches (torch's InstanceNorm silently skips the
    update in that case; normlab follows BatchNorm's cumulative-average meaning instead)."""
    torch.manual_seed(12)
    m = InstanceNorm2d(3, track_running_stats=True, momentum=None).double()
    xs = [torch.randn(2, 3, 4, 4, dtype=torch.float64) * (k + 1) + k for k in range(3)]
    for x in xs:
        m(x)
    assert int(m.num_batches_tracked) == 3
    torch.testing.assert_close(m.running_mean, sum(x.mean((0, 2, 3)) for x in xs) / 3, rtol=1e-12, atol=1e-12)
    expected_var = sum(x.flatten(2).var(-1).mean(0) for x in xs) / 3  # unbiased per instance, as torch
    torch.testing.assert_close(m.running_var, expected_var, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- every route
ROUTES = {
    "contiguous": lambda t: t,
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "channels_last_3d": lambda t: t.contiguous(memory_format=torch.channels_last_3d),
    "strided": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("center, scale", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("in_layout_from", [0, None])
def test_every_route_matches_torch_float64(route, center, scale, track, in_layout_from, monkeypatch):
    """Each route (group norm with its statistics for the running update, the channels_last Function, which these
    small inputs take with the size threshold at 0, the contiguous copy, the strided input) against torch's
    InstanceNorm in float64: output and its layout, every gradient, running statistics."""
    if in_layout_from is not None:
        monkeypatch.setattr(instance_norm_module, "_IN_LAYOUT_MIN_SAMPLE", in_layout_from)
    torch.manual_seed(13)
    dim = 3 if route == "channels_last_3d" else 2
    ours_cls, ref_cls = CLASSES[dim]
    ours = ours_cls(4, track_running_stats=track, momentum=0.3, center=center, scale=scale).double()
    ref = ref_cls(4, affine=True, track_running_stats=track, momentum=0.3).double()
    with torch.no_grad():
        ref.weight.copy_(torch.rand(4, dtype=torch.float64) + 0.5 if scale else torch.ones(4, dtype=torch.float64))
        ref.bias.copy_(torch.randn(4, dtype=torch.float64) if center else torch.zeros(4, dtype=torch.float64))
        if scale:
            ours.weight.copy_(ref.weight)
        if center:
            ours.bias.copy_(ref.bias)
    for step in range(2):
        base = torch.randn((3, 4) + (5, 6, 4)[:dim], dtype=torch.float64) * (step + 2) + 1e3
        x = ROUTES[route](base.clone()).detach().requires_grad_()
        x_ref = base.clone().requires_grad_()
        y, y_ref = ours(x), ref(x_ref)
        torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
        if route.startswith("channels_last"):
            assert y.is_contiguous(memory_format=torch.channels_last if dim == 2 else torch.channels_last_3d)
        g = torch.randn_like(y_ref)
        y.backward(ROUTES[route](g))
        y_ref.backward(g)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-8, atol=1e-9)
        if scale:
            torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-8, atol=1e-9)
        if center:
            torch.testing.assert_close(ours.bias.grad, ref.bias.grad, rtol=1e-8, atol=1e-9)
    if track:
        torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-9, atol=1e-9)
        assert int(ours.num_batches_tracked) == 2


@pytest.mark.parametrize("fmt", [torch.channels_last, torch.channels_last_3d])
def test_channels_last_gradcheck_and_gradgradcheck(fmt, monkeypatch):
    torch.manual_seed(14)
    m = (InstanceNorm2d if fmt == torch.channels_last else InstanceNorm3d)(3, affine=True).double()
    shape = (2, 3, 3, 4) if fmt == torch.channels_last else (2, 3, 2, 3, 2)
    monkeypatch.setattr(instance_norm_module, "_IN_LAYOUT_MIN_SAMPLE", 0)  # the in-layout Function at this size
    x = torch.randn(shape, dtype=torch.float64).contiguous(memory_format=fmt).requires_grad_()
    w = (torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(3, dtype=torch.float64).requires_grad_()

    def f(t, w_, b_):
        return torch.func.functional_call(m, {"weight": w_, "bias": b_}, (t,))

    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradgradcheck(f, (x, w, b))


@pytest.mark.parametrize("fmt", [torch.channels_last, torch.channels_last_3d])
@pytest.mark.parametrize("track", [False, True])
def test_channels_last_step_copies_no_layout(fmt, track):
    """A channels_last training step (forward + backward) of a sample of at least ``_IN_LAYOUT_MIN_SAMPLE`` values
    makes no layout copy of the input, the output or the gradient (torch's kernels would need contiguous ones) and no
    host read-back, and tracking takes no second statistics pass."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.ops.append((str(func.overloadpacket), first.numel() if isinstance(first, torch.Tensor) else 0))
            return out

    m = (InstanceNorm2d if fmt == torch.channels_last else InstanceNorm3d)(16, affine=True, track_running_stats=track)
    shape = (2, 16, 64, 64) if fmt == torch.channels_last else (2, 16, 16, 16, 16)  # 65536 values per sample
    assert shape[1] * math.prod(shape[2:]) >= instance_norm_module._IN_LAYOUT_MIN_SAMPLE
    x = torch.randn(shape).contiguous(memory_format=fmt).requires_grad_()
    g = torch.randn(shape).contiguous(memory_format=fmt)
    m(x).backward(g)
    with Ops() as log:
        m(x).backward(g)
    copies = [op for op, n in log.ops if op in ("aten.clone", "aten.copy_", "aten._to_copy") and n == x.numel()]
    assert copies == []
    assert "aten._local_scalar_dense" not in [op for op, _ in log.ops]  # no host read-back (tests/test_readbacks.py)
    passes = [op for op, _ in log.ops if op in ("aten.batch_norm_update_stats", "aten.mean", "aten.var_mean")]
    assert passes == ["aten.batch_norm_update_stats"] * shape[0] + ["aten.mean"] * (2 if track else 0)  # the
    # statistics per sample, then (tracking) the batch averages of the (N, C) statistics: no second pass over x
