"""Everyday torch habits on SwitchableNorm, InstanceNorm, WS/PWS convolutions and capsules.

Each layer must behave like the torch layer it extends under what users do every day: in-place ops on its output,
torch.func (grad, vmap, per-sample grads, jacrev, functional_call ensembling), activation checkpointing,
torch.compile (fullgraph, compiled gradients), torch.export in train mode, an empty batch, the meta device with
``to_empty()`` + ``reset_parameters()``, ``torch.jit.trace`` and deepcopy. The reference is always the same layer
run plainly (eager autograd, one forward), so every comparison is of the habit alone.
"""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from torch.utils.checkpoint import checkpoint

import normlab.nn as L
from normlab.functional import pws_weight

SHAPES = {1: (3, 3, 6), 2: (3, 3, 4, 3), 3: (3, 3, 3, 2, 3)}
CAPS_SHAPES = {"PrimaryCapsules": (2, 3, 5, 5), "RoutingCapsules": (2, 6, 4)}


class Spec:
    """A layer of the matrix: how to build it, its input shape, whether it keeps running statistics."""

    def __init__(self, name, make, shape, running=False, norm=False):
        self.name, self.make, self.shape, self.running, self.norm = name, make, shape, running, norm

    def __repr__(self):
        return self.name

    def build(self, seed=0):
        torch.manual_seed(seed)
        return self.make().double()

    def input(self, seed=1, layout="contiguous", dtype=torch.float64, n=None):
        torch.manual_seed(seed)
        shape = self.shape if n is None else (n,) + self.shape[1:]
        x = (torch.randn(shape, dtype=dtype) * 2 + 0.5).to(dtype)
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        return x.contiguous(memory_format=fmt) if layout == "channels_last" else x

    def layouts(self):
        return ("contiguous", "channels_last") if len(self.shape) in (4, 5) and self.norm else ("contiguous",)


def _specs():
    out = []
    for d in (1, 2, 3):
        sn = getattr(L, f"SwitchableNorm{d}d")
        out.append(Spec(f"SN{d}d", lambda sn=sn: sn(3), SHAPES[d], running=True, norm=True))
        if d == 2:  # IN and LN statistics only: no running statistics, per-sample grads in training too
            out.append(Spec("SN2d-nobn", lambda: L.SwitchableNorm2d(3, using_bn=False), SHAPES[2], norm=True))
        inorm = getattr(L, f"InstanceNorm{d}d")
        for track in (False, True):
            for affine in (False, True):
                out.append(
                    Spec(
                        f"IN{d}d-track{int(track)}-affine{int(affine)}",
                        lambda inorm=inorm, t=track, a=affine: inorm(3, affine=a, track_running_stats=t),
                        SHAPES[d],
                        running=track,
                        norm=True,
                    )
                )
        out.append(
            Spec(
                f"IN{d}d-cumulative",
                lambda inorm=inorm: inorm(3, momentum=None, track_running_stats=True),
                SHAPES[d],
                running=True,
                norm=True,
            )
        )  # momentum=None: no host sync (meta, compile)
        for kind in ("WSConv", "PWSConv"):
            conv = getattr(L, f"{kind}{d}d")
            out.append(Spec(f"{kind}{d}d", lambda conv=conv: conv(3, 4, 3, padding=1), SHAPES[d]))
    out.append(
        Spec(
            "PrimaryCapsules",
            lambda: L.PrimaryCapsules(3, 2, 4, kernel_size=3, stride=1),
            CAPS_SHAPES["PrimaryCapsules"],
        )
    )
    out.append(
        Spec("RoutingCapsules", lambda: L.RoutingCapsules(6, 4, 3, 5, init_std=0.5), CAPS_SHAPES["RoutingCapsules"])
    )
    return out


SPECS = _specs()
BY_NAME = {s.name: s for s in SPECS}
MODES = pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
ALL = pytest.mark.parametrize("spec", SPECS, ids=repr)


def _pair(spec, train):
    m = spec.build().train(train)
    return m, copy.deepcopy(m)


def _loss(y):
    return (y * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)).square().sum()


def _grads(m):
    return {k: p.grad for k, p in m.named_parameters()}


def _assert_state_equal(a, b, **tol):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def _plain_step(ref, x):
    """The reference: one eager forward + backward of ``_loss``; returns (output, input grad, param grads)."""
    x = x.detach().clone().requires_grad_(True)
    y = ref(x)
    _loss(y).backward()
    return y.detach(), x.grad, _grads(ref)


# ------------------------------------------------------------------------------------------------------------------
# 1. In-place ops on the output (ReLU(inplace=True), relu_, residual +=)
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
def test_inplace_ops_on_output(spec, train):
    for layout in spec.layouts():
        m, ref = _pair(spec, train)
        x = spec.input(layout=layout).requires_grad_(True)
        y = m(x)
        y += 1.0  # a residual ``out += identity``, then ReLU(inplace=True), as in a ResNet block
        y = nn.ReLU(inplace=True)(y)
        z = m(x).relu_()  # the in-place op straight on the output
        _loss(y + z).backward()
        xr = x.detach().clone().requires_grad_(True)
        yr = (ref(xr) + 1.0).relu()
        yr = yr + ref(xr).relu()
        _loss(yr).backward()
        torch.testing.assert_close(y + z, yr)
        torch.testing.assert_close(x.grad, xr.grad)
        for k, g in _grads(m).items():
            torch.testing.assert_close(g, _grads(ref)[k])
        _assert_state_equal(m, ref)


@pytest.mark.parametrize("name", ["SN1d", "SN2d", "SN3d", "IN2d-track1-affine1", "PWSConv2d", "RoutingCapsules"])
@MODES
def test_inplace_ops_under_bf16_autocast(name, train):
    spec = BY_NAME[name]
    m, ref = _pair(spec, train)
    m, ref = m.float(), ref.float()
    x = spec.input(dtype=torch.float32).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        y.relu_()
    _loss(y.float()).backward()
    yr = ref(x.detach()).relu()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(y.float(), yr, atol=0.1, rtol=0.05)


# ------------------------------------------------------------------------------------------------------------------
# 2. torch.func: grad, vmap / per-sample grads, jacrev, functional_call ensembling
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
def test_func_grad_equals_autograd(spec, train):
    for layout in spec.layouts():
        m, ref = _pair(spec, train)
        x = spec.input(layout=layout)
        params = {k: p.detach() for k, p in m.named_parameters()}
        found = grad(lambda p, xx, m=m: _loss(functional_call(m, p, (xx,))), argnums=(0, 1))(params, x)
        _, gx, grads = _plain_step(ref, x)
        torch.testing.assert_close(found[1], gx)
        for k in grads:
            torch.testing.assert_close(found[0][k], grads[k])
        _assert_state_equal(m, ref)  # the running statistics are updated as by a plain step


@ALL
@MODES
def test_vmap_per_sample_grads(spec, train):
    m, ref = _pair(spec, train)
    x = spec.input()
    params = {k: p.detach() for k, p in m.named_parameters()}

    def loss(p, xi):
        return _loss(functional_call(m, p, (xi.unsqueeze(0),)))

    if train and spec.running:  # as torch's BatchNorm/InstanceNorm: no single running update from per-sample batches
        with pytest.raises(RuntimeError, match=type(m).__name__):
            vmap(grad(loss), in_dims=(None, 0))(params, x)
        return
    per_sample = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        ref.zero_grad()
        _, _, grads = _plain_step(ref, x[i : i + 1])
        for k in grads:
            torch.testing.assert_close(per_sample[k][i], grads[k])


@ALL
@MODES
def test_jacrev_equals_autograd_jacobian(spec, train):
    m, ref = _pair(spec, train)
    x = spec.input(n=2)
    jac = jacrev(m)(x)
    expected = torch.autograd.functional.jacobian(ref, x)
    torch.testing.assert_close(jac, expected)
    _assert_state_equal(m, ref)


@pytest.mark.parametrize("spec", [s for s in SPECS if len(s.build().state_dict())], ids=repr)
@MODES
def test_functional_call_ensembling(spec, train):
    models = [spec.build(seed).train(train) for seed in (0, 1)]
    refs = copy.deepcopy(models)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = spec.input()
    out = vmap(lambda p, b, xx: functional_call(base, (p, b), (xx,)), in_dims=(0, 0, None))(params, buffers, x)
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i], ref(x))
        for k, buf in ref.named_buffers():
            torch.testing.assert_close(buffers[k][i], buf)


# ------------------------------------------------------------------------------------------------------------------
# 3. Activation checkpointing: same gradients, running statistics updated once (as one plain forward)
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_equals_plain(spec, train, reentrant):
    for layout in spec.layouts():
        m, ref = _pair(spec, train)
        x = spec.input(layout=layout).requires_grad_(True)
        y = checkpoint(m, x, use_reentrant=reentrant)
        _loss(y).backward()
        yr, gx, grads = _plain_step(ref, x)
        torch.testing.assert_close(y, yr)
        torch.testing.assert_close(x.grad, gx)
        for k in grads:
            torch.testing.assert_close(_grads(m)[k], grads[k])
        _assert_state_equal(m, ref)  # updated once, as by one plain forward


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_pws_init_alpha_and_weight_cache(d, reentrant):
    conv = getattr(L, f"PWSConv{d}d")
    spec = Spec(f"PWSConv{d}d", lambda: conv(3, 4, 3, padding=1, init_alpha=True), SHAPES[d])
    m, ref = _pair(spec, True)
    x = spec.input().requires_grad_(True)
    _loss(checkpoint(m, x, use_reentrant=reentrant)).backward()  # the data init runs in the first forward only
    _, gx, grads = _plain_step(ref, x)
    torch.testing.assert_close(x.grad, gx)
    for k in grads:
        torch.testing.assert_close(_grads(m)[k], grads[k])
    _assert_state_equal(m, ref)
    assert bool(m.alpha_initialized)
    m.eval(), ref.eval()  # eval: the reentrant forward runs without grad and fills the inference cache
    for _ in range(2):
        x.grad = None
        _loss(checkpoint(m, x, use_reentrant=reentrant)).backward()
        torch.testing.assert_close(x.grad, _plain_step(ref, x)[1])


# ------------------------------------------------------------------------------------------------------------------
# 4. torch.compile (fullgraph): outputs, gradients and running statistics equal eager; a NaN batch is kept out
# ------------------------------------------------------------------------------------------------------------------
COMPILED = [  # a few compiles (each costs seconds); the inductor case below is SN2d train channels_last
    ("SN1d", True),
    ("SN3d", True),
    ("SN2d", False),
    ("IN3d-cumulative", True),
    ("IN3d-track1-affine0", False),
    ("IN2d-track0-affine1", True),
    ("PWSConv2d", True),
    ("RoutingCapsules", True),
]


@pytest.mark.parametrize("name, train", COMPILED, ids=[f"{n}-{'train' if t else 'eval'}" for n, t in COMPILED])
def test_compile_fullgraph_equals_eager(name, train):
    spec = BY_NAME[name]
    m, ref = _pair(spec, train)
    torch._dynamo.reset()  # a fresh cache: the many layers of this file share each forward's code object
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    x = spec.input()
    xc = x.clone().requires_grad_(True)
    y = compiled(xc)
    _loss(y).backward()
    yr, gx, grads = _plain_step(ref, x)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(xc.grad, gx)
    for k in grads:
        torch.testing.assert_close(_grads(m)[k], grads[k])
    _assert_state_equal(m, ref)
    if spec.running and train:  # a NaN batch: compiled, the running statistics are kept, as eager keeps them
        before = copy.deepcopy(m.state_dict())
        bad = x.clone()
        bad[0].view(-1)[0] = float("nan")
        with torch.no_grad():
            compiled(bad)
        for k, v in m.state_dict().items():
            torch.testing.assert_close(v, before[k], equal_nan=False)
        with torch.no_grad():
            ref(bad)
        _assert_state_equal(m, ref)
        assert int(m.skipped_batches) == int(ref.skipped_batches) == 1  # counted by the compiled graph too


def test_compile_inductor_switchable_channels_last():
    spec = BY_NAME["SN2d"]
    m, ref = _pair(spec, True)
    m, ref = m.float(), ref.float()
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    x = spec.input(layout="channels_last", dtype=torch.float32)
    xc = x.clone().requires_grad_(True)
    _loss(compiled(xc)).backward()
    _, gx, grads = _plain_step(ref, x)
    torch.testing.assert_close(xc.grad, gx, atol=1e-4, rtol=1e-4)
    for k in grads:
        torch.testing.assert_close(_grads(m)[k], grads[k], atol=1e-4, rtol=1e-4)
    _assert_state_equal(m, ref)


EXPORTED = ["SN1d", "SN3d", "IN2d-track1-affine1", "IN3d-track1-affine0", "PWSConv2d", "RoutingCapsules"]


@pytest.mark.parametrize("name", EXPORTED)
def test_export_train_mode(name):
    spec = BY_NAME[name]
    m, ref = _pair(spec, True)
    x = spec.input()
    torch._dynamo.reset()
    program = torch.export.export(m, (x,))
    exported = program.module()
    x2 = spec.input(seed=2)
    torch.testing.assert_close(exported(x2), ref(x2))
    for k, buf in ref.named_buffers():
        torch.testing.assert_close(exported.get_buffer(k), buf)
    bad = x2.clone()
    bad[0].view(-1)[0] = float("inf")
    exported(bad)  # the exported program keeps the running statistics of a non-finite batch out, as eager does
    for k, buf in ref.named_buffers():
        expected = buf + 1 if k.endswith("skipped_batches") else buf  # and counts it
        torch.testing.assert_close(exported.get_buffer(k), expected)


# ------------------------------------------------------------------------------------------------------------------
# 5. Empty batch, degenerate PWS init batches
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
def test_empty_batch(spec, train):
    m, ref = _pair(spec, train)
    x = spec.input(n=0).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = m(x)
        y.sum().backward()
    expected = ref(spec.input(n=2))[:0]
    assert y.shape == expected.shape
    _assert_state_equal(m, copy.deepcopy(spec.build()).train(train))  # running statistics untouched
    if spec.name.startswith("SN"):  # as torch's BatchNorm: an empty output, running statistics unchanged
        bn = nn.BatchNorm2d(3).train(train)
        assert bn(torch.randn(0, 3, 4, 3)).shape[0] == 0
        torch.testing.assert_close(bn.running_mean, torch.zeros(3))
    # (torch's InstanceNorm returns an empty output too, but its running statistics become NaN)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_pws_init_alpha_waits_for_a_real_batch(d):
    conv = getattr(L, f"PWSConv{d}d")
    shape = SHAPES[d]
    empty, zeros, constant = torch.zeros((0,) + shape[1:]), torch.zeros(shape), torch.full(shape, 7.0)
    for kernel, first in ((3, empty), (3, zeros), (1, constant)):  # a 1-wide kernel maps a constant to ~0
        torch.manual_seed(0)
        m = conv(3, 4, kernel, padding=kernel // 2, init_alpha=True)
        m(first)
        assert not bool(m.alpha_initialized), first.shape
        torch.testing.assert_close(m.alpha.detach(), torch.ones(4))
        x = torch.randn(shape)
        m(x)
        assert bool(m.alpha_initialized)
        with torch.no_grad():
            y = m._conv_forward(x, pws_weight(m.weight, None, m.gamma, fan=m.fan), None).double()
        torch.testing.assert_close(m.alpha.detach(), torch.full((4,), (2.0 / y.var()).sqrt().item()))


# ------------------------------------------------------------------------------------------------------------------
# 6. Meta device, to_empty + reset_parameters, jit.trace, deepcopy
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
def test_meta_device_then_to_empty_and_reset_parameters(spec, train):
    with torch.device("meta"):
        m = spec.make().train(train)
    x = spec.input(dtype=torch.float32)
    y = m(x.to("meta"))
    assert y.device.type == "meta"
    assert y.shape == spec.build().float().train(train)(x).shape
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    torch.manual_seed(0)
    _assert_state_equal(m, spec.make())  # the constructor's initialisation, from the same random stream


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True])
def test_routing_capsules_init_std_checked(bad):
    with pytest.raises(ValueError, match="RoutingCapsules: init_std"):
        L.RoutingCapsules(6, 4, 3, 5, init_std=bad)


def test_meta_device_pws_init_alpha_and_tracking_instance_norm():
    with torch.device("meta"):
        conv = L.PWSConv2d(3, 4, 3, init_alpha=True)
        inorm = L.InstanceNorm2d(3, track_running_stats=True, momentum=None)
    x = torch.randn(2, 3, 5, 5, device="meta")
    assert conv(x).shape == (2, 4, 3, 3)
    assert inorm(x).shape == x.shape


@ALL
@MODES
def test_jit_trace_equals_eager(spec, train):
    m, ref = _pair(spec, train)
    x, x2 = spec.input(), spec.input(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # jit.trace is deprecated, still used every day
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks are constants in the trace
        traced = torch.jit.trace(m, x, check_trace=False)
    ref(x)
    torch.testing.assert_close(traced(x2), ref(x2))
    _assert_state_equal(m, ref)


@ALL
@MODES
def test_deepcopy_equals_original(spec, train):
    m = spec.build().train(train)
    x = spec.input()
    m(x)  # buffers, caches and data inits filled
    twin = copy.deepcopy(m)
    torch.testing.assert_close(twin(x), m(x))
    _assert_state_equal(twin, m)


@pytest.mark.parametrize("to", ["sn", "in"])
@pytest.mark.parametrize("source", ["torchvision", "timm"])
def test_converted_resnet_trains_with_its_inplace_ops(source, to, one_thread):
    """torchvision/timm ResNets do ``out += identity`` and ReLU(inplace=True) on the norm outputs."""
    from normlab.convert import convert_norm

    torch.manual_seed(0)
    if source == "torchvision":
        import torchvision

        model = torchvision.models.resnet18(num_classes=4)
    else:
        import timm

        model = timm.create_model("resnet10t", pretrained=False, num_classes=4)
    model = convert_norm(model, to)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    x = torch.randn(2, 3, 40, 40)  # 2 x 2 in the last stage
    model(x).square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ------------------------------------------------------------------------------------------ non-finite policy
POLICY_LAYERS = [
    ("BatchRenorm1d", lambda: L.BatchRenorm1d(3, rmax=2.0, dmax=1.0), (4, 3, 5)),
    ("BatchRenorm2d", lambda: L.BatchRenorm2d(3), (4, 3, 2, 3)),
    ("BatchRenorm3d", lambda: L.BatchRenorm3d(3, rmax=2.0), (4, 3, 2, 2, 2)),
    ("SyncBatchRenorm", lambda: L.SyncBatchRenorm(3, momentum=None, dmax=1.0), (4, 3, 2, 3)),
    ("SwitchableNorm1d", lambda: L.SwitchableNorm1d(3), (4, 3, 5)),
    ("SwitchableNorm2d", lambda: L.SwitchableNorm2d(3), (4, 3, 2, 3)),
    ("SwitchableNorm3d", lambda: L.SwitchableNorm3d(3, using_moving_average=False), (4, 3, 2, 2, 2)),
    ("InstanceNorm1d", lambda: L.InstanceNorm1d(3, track_running_stats=True), (4, 3, 5)),
    ("InstanceNorm2d", lambda: L.InstanceNorm2d(3, affine=True, track_running_stats=True), (4, 3, 2, 3)),
    ("InstanceNorm3d", lambda: L.InstanceNorm3d(3, momentum=None, track_running_stats=True), (4, 3, 2, 2, 2)),
]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name,make,shape", POLICY_LAYERS, ids=[f"{n}-{len(s)}D" for n, _, s in POLICY_LAYERS])
def test_non_finite_batch_one_policy(name, make, shape, bad):
    """docs/design.md "Non-finite batches": every layer with running statistics keeps its state (running statistics
    and step counter), raises nothing, returns the NaN/inf output and counts the batch in its device-side
    ``skipped_batches`` without warning in the step (a warning there would need a host read); ``eval()`` and
    ``normlab.nn.skipped_batches`` turn the count into one RuntimeWarning naming the layer, each batch reported once."""
    m = make().double()
    assert type(m).__name__ == name
    m(torch.randn(shape, dtype=torch.float64))
    before = copy.deepcopy(m.state_dict())
    x = torch.randn(shape, dtype=torch.float64)
    x.view(-1)[7] = bad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = m(x)
        m(x)
        m(torch.randn(shape, dtype=torch.float64))
        assert not caught and int(m.skipped_batches) == 2 and "skipped_batches" not in m.state_dict()
        assert L.skipped_batches(torch.nn.Sequential(m)) == {"0": 2}
        m.eval()  # already reported: nothing new
        m.train()
        m(x)
        m.eval()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages
    # skipped_batches(model) names the layer by its name in the model; .eval() of the layer alone by its class
    assert messages[0].startswith(f"{type(m).__name__} '0': 2 training batch(es) with non-finite batch statistics")
    assert messages[1].startswith(f"{type(m).__name__}: 1 training batch(es) with non-finite batch statistics")
    assert not torch.isfinite(y).all()
    m.load_state_dict(before)
    m.train()(x)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
