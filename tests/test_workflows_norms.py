"""SwitchableNorm, InstanceNorm and the WS/PWS convolutions inside the workflows users run: torch.fx tracing,
forward-mode AD, loading a checkpoint with non-finite values, weight parametrizations (spectral_norm, weight_norm),
and constructor arguments that mean what torch's mean. Every layer, every dim, train and eval.

Each reference is independent of the code under test: the module run plainly (fx, forward AD), reverse-mode autograd
(forward AD: ``<u, J v>`` from the JVP equals ``<J^T u, v>`` from the VJP), ``nn.Conv*d`` (how often a
parametrization runs), torch's InstanceNorm (``bias=``), BatchNorm's running-statistics formula written out
(SwitchableNorm's ``momentum``).
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from test_readbacks import ReadBacks
from torch import nn
from torch.autograd import forward_ad as fwAD
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call, jacfwd, jacrev
from torch.nn.utils import parametrizations, parametrize

import normlab.nn as L
from normlab.functional import pws_weight, standardize_weight

SHAPES = {1: (3, 3, 6), 2: (3, 3, 4, 3), 3: (3, 3, 3, 2, 3)}
MODES = pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])


class Spec:
    def __init__(self, name, make, d):
        self.name, self.make, self.d = name, make, d

    def __repr__(self):
        return self.name

    def build(self, seed=100):
        torch.manual_seed(seed)
        m = self.make().double()
        with torch.no_grad():  # parameters away from their initial values (logits, gains, affine)
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        return m

    def input(self, seed=101, n=None):
        torch.manual_seed(seed)
        shape = SHAPES[self.d] if n is None else (n,) + SHAPES[self.d][1:]
        return torch.randn(shape, dtype=torch.float64) * 2 + 0.5


def _specs():
    out = []
    for d in (1, 2, 3):
        sn, inorm = getattr(L, f"SwitchableNorm{d}d"), getattr(L, f"InstanceNorm{d}d")
        out.append(Spec(f"SN{d}d", lambda sn=sn: sn(3), d))
        out.append(Spec(f"SN{d}d-cumulative", lambda sn=sn: sn(3, momentum=None), d))
        out.append(Spec(f"SN{d}d-nobn", lambda sn=sn: sn(3, using_bn=False), d))
        for track in (False, True):
            for affine in (False, True):
                name = f"IN{d}d-track{int(track)}-affine{int(affine)}"
                out.append(Spec(name, lambda i=inorm, t=track, a=affine: i(3, affine=a, track_running_stats=t), d))
        out.append(Spec(f"IN{d}d-nobias", lambda i=inorm: i(3, affine=True, bias=False, track_running_stats=True), d))
        for kind in ("WSConv", "PWSConv"):
            conv = getattr(L, f"{kind}{d}d")
            out.append(Spec(f"{kind}{d}d", lambda conv=conv: conv(3, 4, 3, padding=1), d))
        pws = getattr(L, f"PWSConv{d}d")
        out.append(Spec(f"PWSConv{d}d-initalpha", lambda pws=pws: pws(3, 4, 3, padding=1, init_alpha=True), d))
    return out


SPECS = _specs()
ALL = pytest.mark.parametrize("spec", SPECS, ids=repr)


def _grads(m):
    return {k: p.grad for k, p in m.named_parameters()}


def _assert_state_equal(a, b, **tol):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=lambda msg, k=k: f"{k}: {msg}", **tol)


# ------------------------------------------------------------------------------------------------------------------
# 1. torch.fx: the traced graph computes what the module computes, training steps included
# ------------------------------------------------------------------------------------------------------------------
@ALL
@MODES
def test_fx_graph_module_equals_the_module(spec, train):
    """symbolic_trace works, and the GraphModule (traced in the mode it then runs in) gives the module's outputs,
    gradients and buffers over three steps: the running statistics advance once per call, PWS's data-dependent
    alpha is set by the first training batch."""
    eager = spec.build().train(train)
    gm = torch.fx.symbolic_trace(copy.deepcopy(eager))
    assert isinstance(gm, torch.fx.GraphModule)
    for step in range(3):
        x = spec.input(seed=110 + step)
        xe, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yt = eager(xe), gm(xt)
        torch.testing.assert_close(yt, ye, rtol=0, atol=0)
        g = torch.randn_like(ye)
        ye.backward(g)
        yt.backward(g)
        torch.testing.assert_close(xt.grad, xe.grad, rtol=0, atol=0)
        ge, gt = _grads(eager), _grads(gm)
        assert ge.keys() == gt.keys()
        for k in ge:
            torch.testing.assert_close(gt[k], ge[k], rtol=0, atol=0, msg=k)
        # (named_buffers: a GraphModule keeps the tensors its graph reads, each buffer a persistent one there)
        state = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
        traced = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
        assert traced.keys() <= state.keys() and set(ge) <= traced.keys()
        torch.testing.assert_close(traced, {k: state[k] for k in traced}, rtol=0, atol=0)
    tracked = dict(eager.named_buffers()).get("num_batches_tracked")
    if tracked is not None:
        assert int(tracked) == (3 if train else 0)


def test_fx_feature_extraction_of_a_model_with_every_layer():
    """A model of these layers traces as a whole (what timm's and torchvision's feature extraction do), each
    normlab layer one node of the graph."""
    model = nn.Sequential(
        L.PWSConv2d(3, 4, 3, padding=1),
        L.SwitchableNorm2d(4),
        nn.ReLU(),
        L.WSConv2d(4, 4, 3, padding=1),
        L.InstanceNorm2d(4, affine=True, track_running_stats=True),
    ).double()
    gm = torch.fx.symbolic_trace(copy.deepcopy(model))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    steps = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "layer_step"]
    kinds = [type(gm.get_submodule(n.args[0].target)).__name__ for n in steps]
    assert kinds == ["SwitchableNorm2d", "InstanceNorm2d"], kinds


# ------------------------------------------------------------------------------------------------------------------
# 2. Forward-mode AD against reverse mode
# ------------------------------------------------------------------------------------------------------------------
def _dot(tensors_a, tensors_b):
    return sum((a * b).sum() for a, b in zip(tensors_a, tensors_b))


@ALL
@MODES
def test_forward_ad_equals_reverse_mode(spec, train):
    """torch.autograd.forward_ad with tangents on the input and every parameter: the primal output is the plain
    one, ``<u, J v>`` equals ``<J^T u, v>`` from reverse mode, and no tangent reaches the buffers."""
    m = spec.build().train(train)
    ref = copy.deepcopy(m)
    x = spec.input()
    torch.manual_seed(102)
    params = dict(m.named_parameters())
    tangents = {"x": torch.randn_like(x), **{k: torch.randn_like(p) for k, p in params.items()}}
    with fwAD.dual_level():
        duals = {k: fwAD.make_dual(p.detach(), tangents[k]) for k, p in params.items()}
        y = functional_call(m, duals, (fwAD.make_dual(x, tangents["x"]),))
        primal, jvp = fwAD.unpack_dual(y)
        assert all(fwAD.unpack_dual(b).tangent is None for b in m.buffers())
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    torch.testing.assert_close(primal, yr.detach(), rtol=1e-12, atol=1e-12)
    u = torch.randn_like(yr)
    inputs = [xr, *ref.parameters()]
    vjp = torch.autograd.grad(yr, inputs, u)
    expected = _dot(vjp, [tangents["x"], *(tangents[k] for k, _ in ref.named_parameters())])
    torch.testing.assert_close((u * jvp).sum(), expected, rtol=1e-9, atol=1e-10)
    _assert_state_equal(m, ref, rtol=1e-12, atol=1e-12)


@ALL
@MODES
def test_func_jacfwd_equals_jacrev(spec, train):
    """torch.func.jacfwd (forward mode) equals jacrev (reverse mode) for the input."""
    m = spec.build().train(train)
    if train and isinstance(m, L.PWSConv1d | L.PWSConv2d | L.PWSConv3d) and m.init_alpha:
        m(spec.input(seed=103))  # the data-dependent init first: a Jacobian is of a fixed function ...
        m(spec.input(seed=104))  # ... and the next eager step finds it done
    state = {k: v.detach() for k, v in {**dict(m.named_parameters()), **dict(m.named_buffers())}.items()}

    def f(x):
        return functional_call(m, state, (x,))

    x = spec.input()
    torch.testing.assert_close(jacfwd(f)(x), jacrev(f)(x), rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------------------------------------
# 3. A non-finite stored state is named at load
# ------------------------------------------------------------------------------------------------------------------
def _state_layers():
    out = []
    for d in (1, 2, 3):
        out += [
            (f"BatchRenorm{d}d", lambda d=d: getattr(L, f"BatchRenorm{d}d")(3), d),
            (f"SwitchableNorm{d}d", lambda d=d: getattr(L, f"SwitchableNorm{d}d")(3), d),
            (
                f"InstanceNorm{d}d",
                lambda d=d: getattr(L, f"InstanceNorm{d}d")(3, affine=True, track_running_stats=True),
                d,
            ),
            (f"WSConv{d}d", lambda d=d: getattr(L, f"WSConv{d}d")(3, 4, 3, padding=1), d),
            (f"PWSConv{d}d", lambda d=d: getattr(L, f"PWSConv{d}d")(3, 4, 3, padding=1), d),
        ]
    out.append(("SyncBatchRenorm", lambda: L.SyncBatchRenorm(3), 2))
    out.append(("RoutingCapsules", lambda: L.RoutingCapsules(6, 4, 3, 5), 0))
    return out


STATE_LAYERS = _state_layers()
STATE_CASES = [
    pytest.param(name, make, key, id=f"{name}-{key}")
    for name, make, _ in STATE_LAYERS
    for key, value in make().state_dict().items()
    if value.is_floating_point()
]


def _nested(layer):
    return nn.Sequential(OrderedDict(block=nn.Sequential(OrderedDict(norm=layer))))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name, make, key", STATE_CASES)
def test_non_finite_state_is_named_at_load(name, make, key, bad):
    """One RuntimeWarning, one line: the layer's class, its name in the model and the tensor; a finite state
    loads silently."""
    model = _nested(make())
    state = model.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(state)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    state[f"block.norm.{key}"].view(-1)[1] = bad
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _nested(make()).load_state_dict(state)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{name} 'block.norm': the loaded state is not finite: {key} (1 of ")
    assert "\n" not in messages[0]


@pytest.mark.parametrize("name, make, d", [c for c in STATE_LAYERS if "Norm" in c[0]], ids=lambda c: str(c))
def test_skipped_batches_blame_the_stored_state_and_the_step_reads_nothing(name, make, d):
    """After a load with a NaN running_var, training steps read nothing back to the host; where batches are then
    skipped (BatchRenorm: every update from a NaN statistic is non-finite) the warning names the stored state, not
    the input."""
    model = _nested(make())
    state = model.state_dict()
    state["block.norm.running_var"][0] = float("nan")
    with pytest.warns(RuntimeWarning, match="running_var"):
        model.load_state_dict(state)
    x = torch.randn((4, 3) + SHAPES[d][2:])
    model.train()(x)
    with ReadBacks() as reads:
        model(x).sum().backward()
    assert reads.ops == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.eval()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if name.startswith(("BatchRenorm", "SyncBatchRenorm")):
        assert len(messages) == 1, messages
        assert messages[0].startswith(f"{name} 'block.norm': 2 training batch(es) were skipped because the layer's")
        assert (
            "stored state is not finite (running_var (1 of 3 values NaN/inf)), not because of the input"
            in (messages[0])
        )
    assert not any("NaN/inf in the input" in msg for msg in messages), messages


# ------------------------------------------------------------------------------------------------------------------
# 4. One weight read per forward under a parametrization, as nn.Conv*d
# ------------------------------------------------------------------------------------------------------------------
class Scaled(nn.Module):
    """A user parametrization: the weight times 1.5; counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, w):
        self.calls += 1
        return w * 1.5


def _parametrize(conv, how):
    """Apply ``how`` to ``conv``; return the conv and a function counting the parametrization's work."""
    if how == "custom":
        parametrize.register_parametrization(conv, "weight", Scaled())
        p = conv.parametrizations.weight[0]
        return conv, lambda: p.calls
    if how == "spectral_norm_hook":  # torch.nn.utils.spectral_norm: a forward pre-hook computes the weight
        conv = nn.utils.spectral_norm(conv)
        hook = next(h for h in conv._forward_pre_hooks.values() if hasattr(h, "compute_weight"))
        calls = []
        original = hook.compute_weight
        hook.compute_weight = lambda module, do_power_iteration: calls.append(1) or original(module, do_power_iteration)
        return conv, lambda: len(calls)
    conv = {"spectral_norm": parametrizations.spectral_norm, "weight_norm": parametrizations.weight_norm}[how](conv)
    p = conv.parametrizations.weight[0]
    calls = []
    p.register_forward_hook(lambda *args: calls.append(1))
    return conv, lambda: len(calls)


def _expected(conv, reference_weight, x):
    """The output from the weight the parametrization gave (read from a copy in the same state)."""
    d = x.dim() - 2
    if isinstance(conv, L.PWSConv1d | L.PWSConv2d | L.PWSConv3d):
        kernel = pws_weight(reference_weight, conv.alpha, conv.gamma, conv.relative_gamma, fan=conv.fan)
    elif isinstance(conv, L.WSConv1d | L.WSConv2d | L.WSConv3d):
        kernel = standardize_weight(reference_weight, conv.eps)
    else:
        kernel = reference_weight
    return getattr(F, f"conv{d}d")(x, kernel, conv.bias, conv.stride, conv.padding)


HOWS = ["spectral_norm", "weight_norm", "custom", "spectral_norm_hook"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", ["WSConv", "PWSConv", "Conv"])
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("mode", ["train", "eval", "eval-no-grad", "eval-identity-cache"])
def test_one_parametrization_run_per_forward(mode, d, kind, how):
    """Training or eval (with or without gradients, with the eval kernel cache on): the parametrization runs (its
    power iteration, for spectral_norm) once per forward, as for ``nn.Conv*d``, and the output is the conv of the
    standardized parametrized weight."""
    torch.manual_seed(104)
    cls = getattr(nn, f"Conv{d}d") if kind == "Conv" else getattr(L, f"{kind}{d}d")
    extra = {"weight_cache": "identity"} if mode == "eval-identity-cache" and kind != "Conv" else {}
    conv = cls(3, 4, 3, padding=1, **extra).double()
    conv, count = _parametrize(conv, how)
    conv.train(mode == "train")
    x = torch.randn((2, 3) + SHAPES[d][2:], dtype=torch.float64)
    for step in range(3):
        # a parametrized weight is computed when read: from a copy in the state before the forward (spectral_norm's
        # u and v); the hook's is the attribute its pre-hook set for this forward
        reference = None if how == "spectral_norm_hook" else copy.deepcopy(conv)
        with torch.set_grad_enabled(mode != "eval-no-grad"):
            before = count()
            y = conv(x)
            runs = count() - before
        assert runs == 1, f"step {step}: {runs} runs"
        with torch.no_grad():
            expected = _expected(conv, (conv if reference is None else reference).weight, x)
        torch.testing.assert_close(y, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# 5. Constructor arguments mean what torch's mean
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("track", [False, True])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_instance_norm_takes_torch_bias_argument(d, track):
    """``affine=True, bias=False`` learns the weight only, with torch's state_dict keys; torch's state loads and the
    outputs equal torch's InstanceNorm (train, and eval with running statistics)."""
    ours = getattr(L, f"InstanceNorm{d}d")(3, 1e-3, 0.3, affine=True, bias=False, track_running_stats=track).double()
    theirs = getattr(nn, f"InstanceNorm{d}d")(3, 1e-3, 0.3, affine=True, bias=False, track_running_stats=track)
    theirs = theirs.double()
    assert ours.weight is not None and ours.bias is None and ours.affine
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
    ours.load_state_dict(theirs.state_dict())
    for _ in range(2):
        x = torch.randn((4, 3) + SHAPES[d][2:], dtype=torch.float64) * 3 + 1
        torch.testing.assert_close(ours(x), theirs(x))
    for name in ("weight", "running_mean", "running_var"):  # (torch's InstanceNorm leaves num_batches_tracked at 0)
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), msg=name)
    if track:
        ours.eval(), theirs.eval()
        torch.testing.assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match=f"^InstanceNorm{d}d: center=True learns a bias, which bias=False leaves out"):
        getattr(L, f"InstanceNorm{d}d")(3, affine=True, bias=False, center=True)


def _bn_batch_stats(x):
    """SwitchableNorm's BN statistics (official code): mean over batch and positions, and the batch mean of the
    per-instance (unbiased) variance plus squared mean, minus the squared mean."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    mean_in, var_in = flat.mean(-1), flat.var(-1)
    mean_bn = mean_in.mean(0)
    return mean_bn, (var_in + mean_in**2).mean(0) - mean_bn**2


@pytest.mark.parametrize("momentum", [0.1, 0.8, None])
@pytest.mark.parametrize("d", [1, 2, 3])
def test_switchable_momentum_is_batchnorm_momentum(d, momentum):
    """``running = (1 - momentum) * running + momentum * batch`` (torch's convention; the default 0.1 is the
    official 0.9 of the old value), ``None`` the cumulative average over ``num_batches_tracked``."""
    m = getattr(L, f"SwitchableNorm{d}d")(3, momentum=momentum).double()
    assert getattr(L, f"SwitchableNorm{d}d")(3).momentum == 0.1
    mean, var = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    batches = []
    for step in range(4):
        x = torch.randn((4, 3) + SHAPES[d][2:], dtype=torch.float64) * (step + 1) + step
        m(x)
        batches.append(_bn_batch_stats(x))
        if momentum is not None:
            mean = (1 - momentum) * mean + momentum * batches[-1][0]
            var = (1 - momentum) * var + momentum * batches[-1][1]
    if momentum is None:
        mean = torch.stack([b[0] for b in batches]).mean(0)
        var = torch.stack([b[1] for b in batches]).mean(0)
    torch.testing.assert_close(m.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.running_var, var, rtol=1e-12, atol=1e-12)
    assert int(m.num_batches_tracked) == 4


def test_switchable_loads_a_state_without_num_batches_tracked():
    """The official code's checkpoints (no num_batches_tracked, module version 1) load with the count 0, as
    BatchNorm's version-1 checkpoints; a current state must carry it."""
    m = L.SwitchableNorm2d(3)
    m(torch.randn(4, 3, 4, 4))
    state = m.state_dict()
    del state["num_batches_tracked"]
    state._metadata[""]["version"] = 1
    fresh = L.SwitchableNorm2d(3)
    fresh.num_batches_tracked.fill_(5)
    fresh.load_state_dict(state)
    assert int(fresh.num_batches_tracked) == 0
    state._metadata[""]["version"] = 2
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        fresh.load_state_dict(state)


SN = [getattr(L, f"SwitchableNorm{d}d") for d in (1, 2, 3)]


@pytest.mark.parametrize("using_bn", [True, False], ids=["bn", "nobn"])
@pytest.mark.parametrize("cls", SN, ids=lambda c: c.__name__)
@MODES
def test_switchable_empty_batch_gives_zero_gradients(cls, train, using_bn):
    """An empty batch gives an empty output and zero (finite) gradients for every parameter, as BatchNorm's; an SGD
    step after it leaves the layer finite."""
    m = cls(3, using_bn=using_bn).double().train(train)
    d = SN.index(cls) + 1
    x = torch.randn((0, 3) + SHAPES[d][2:], dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape
    y.sum().backward()
    for name, p in m.named_parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), name
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert torch.isfinite(m(torch.randn((2, 3) + SHAPES[d][2:], dtype=torch.float64))).all()


@pytest.mark.parametrize("using_bn", [True, False], ids=["bn", "nobn"])
@pytest.mark.parametrize("cls", SN, ids=lambda c: c.__name__)
@MODES
def test_switchable_batched_gradients(cls, train, using_bn):
    """``autograd.grad(is_grads_batched=True)`` equals one gradient per row, and the vectorized Jacobian and Hessian
    equal the row-by-row ones."""
    torch.manual_seed(105)
    m = cls(3, using_bn=using_bn).double().train(train)
    if using_bn:
        m.running_var.fill_(1.5)
    d = SN.index(cls) + 1
    x = torch.randn((2, 3) + SHAPES[d][2:], dtype=torch.float64, requires_grad=True)
    y = m(x)
    rows = torch.randn((3,) + y.shape, dtype=torch.float64)
    (batched,) = torch.autograd.grad(y, x, rows, is_grads_batched=True, retain_graph=True)
    one_by_one = torch.stack([torch.autograd.grad(y, x, r, retain_graph=True)[0] for r in rows])
    torch.testing.assert_close(batched, one_by_one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jacobian(m, x, vectorize=True), jacobian(m, x), rtol=1e-12, atol=1e-12)

    def loss(x):
        return (m(x) * torch.linspace(-1, 2, x.numel(), dtype=x.dtype).reshape(x.shape)).square().sum()

    torch.testing.assert_close(hessian(loss, x, vectorize=True), hessian(loss, x), rtol=1e-10, atol=1e-10)
