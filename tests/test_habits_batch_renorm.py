"""BatchRenorm1d/2d/3d and SyncBatchRenorm (single process) under the everyday torch tools, each compared with the
torch layer it extends (nn.BatchNorm*d) or with the same layer run plainly in eager mode / a float64 reference.

Habits: activation checkpointing (reentrant and not), torch.func (grad, vmap, per-sample gradients, jacrev,
functional_call), torch.compile(fullgraph=True) and torch.export in training, compiled gradients, empty batches, the
meta device (and to_empty + reset_parameters), jit.trace, in-place ops on the output. Renormalization is active in
every training case (running statistics far from the batch's, so r and d are clipped for some channels).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from normlab.nn.batch_renorm import BatchRenorm1d, BatchRenorm2d, BatchRenorm3d, RenormSchedule, SyncBatchRenorm

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
C = 3
# (name, normlab layer, torch layer, input shape)
CASES = [
    ("1d-NC", BatchRenorm1d, nn.BatchNorm1d, (6, C)),
    ("1d-NCL", BatchRenorm1d, nn.BatchNorm1d, (4, C, 5)),
    ("2d", BatchRenorm2d, nn.BatchNorm2d, (4, C, 4, 5)),
    ("3d", BatchRenorm3d, nn.BatchNorm3d, (2, C, 3, 3, 4)),
    ("sync", SyncBatchRenorm, nn.BatchNorm2d, (4, C, 4, 5)),
]
IDS = [c[0] for c in CASES]
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _layer(cls, dtype=F32, schedule=False, **kw):
    """A layer with renormalization active: running statistics away from the data, limits that clip some channels.
    ``schedule``: identity for the first two steps, then rising (the step counter matters)."""
    if schedule == "default":  # the paper's schedule, past its warm-up
        limits = {}
    elif schedule:
        limits = {"schedule": RenormSchedule(1, 1.6, 3, 0.6, 2)}
    else:
        limits = {"rmax": 1.5, "dmax": 0.5} if kw.get("track_running_stats", True) else {}
    m = cls(C, dtype=dtype, **limits, **kw)
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_(torch.tensor([0.7, 1.3, 1.1]))
        if m.bias is not None:
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        if m.running_mean is not None:
            m.running_mean.copy_(torch.tensor([0.9, -0.05, 0.0]))
            m.running_var.copy_(torch.tensor([4.0, 1.1, 0.3]))
        if schedule == "default":
            m.num_batches_tracked.fill_(30_000)
    return m


def _batch(shape, seed, dtype=F32, fmt=None):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=F64) * 1.5 + 0.3).to(dtype)
    if fmt is not None and x.dim() in CHANNELS_LAST:
        x = x.contiguous(memory_format=CHANNELS_LAST[x.dim()])
    return x, torch.randn(shape, generator=g, dtype=F64).to(dtype)


def _state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_same_state(a, b, exact=True, rtol=1e-6):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        if exact or not sa[k].is_floating_point():
            assert torch.equal(sa[k], sb[k]), k
        else:
            torch.testing.assert_close(sa[k], sb[k], rtol=rtol, atol=rtol, msg=k)


def _reference(m, x):
    """Ioffe 2017 in float64 from the layer's current state: (y, new running mean, new running var) for one training
    step with constant limits; y is differentiable in x, weight and bias (r and d detached)."""
    dims = (0,) + tuple(range(2, x.dim()))
    shape = (1, -1) + (1,) * (x.dim() - 2)
    x = x.double()
    rm, rv = m.running_mean.double(), m.running_var.double()
    mu, var = x.mean(dims), x.var(dims, unbiased=False)
    sigma_b, sigma = torch.sqrt(var + m.eps), torch.sqrt(rv + m.eps)
    r = torch.clamp(sigma_b / sigma, 1 / m.rmax, m.rmax).detach()
    d = torch.clamp((mu - rm) / sigma, -m.dmax, m.dmax).detach()
    xhat = (x - mu.reshape(shape)) / sigma_b.reshape(shape) * r.reshape(shape) + d.reshape(shape)
    y = m.weight.double().reshape(shape) * xhat + m.bias.double().reshape(shape)
    n = x.numel() // x.shape[1]
    f = m.momentum
    return y, (1 - f) * rm + f * mu.detach(), (1 - f) * rv + f * var.detach() * n / (n - 1)


# ---------------------------------------------------------------------------------------------- 1. checkpointing
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("dtype,fmt", [(F32, None), (F64, "cl"), (BF16, None)])
@pytest.mark.parametrize("train", [True, False])
def test_checkpoint_gives_plain_gradients_and_one_update_per_forward(case, reentrant, dtype, fmt, train):
    """Under torch.utils.checkpoint the recomputation (inside backward) replays the original step: gradients equal
    the un-checkpointed run bit for bit, and the running statistics and the schedule step advance once per forward.
    Steps 0-1 are identity limits, steps 2-3 renormalize (a doubled step count would change the limits)."""
    _, cls, _, shape = case
    plain = _layer(cls, schedule=True).to(dtype).train(train)
    ckpt = copy.deepcopy(plain)
    for step in range(4):
        x, g = _batch(shape, step, dtype, fmt)
        xp, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        (plain(xp).float() * g.float()).sum().backward()
        (checkpoint(ckpt, xc, use_reentrant=reentrant).float() * g.float()).sum().backward()
        assert torch.equal(xp.grad, xc.grad), step
        _assert_same_state(plain, ckpt)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert int(ckpt.num_batches_tracked) == (4 if train else 0)
    assert ckpt.renorm_limits(2) != (1.0, 0.0)  # the last steps renormalized


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_gradient_accumulation_and_eval(reentrant):
    """Two checkpointed forwards (one of them twice through the same layer) before one backward: each recomputation
    finds its own forward. In eval mode checkpointing changes nothing either."""
    plain = nn.Sequential(_layer(BatchRenorm2d), nn.ReLU())
    ckpt = copy.deepcopy(plain)
    x1, g1 = _batch((4, C, 4, 5), 1)
    x2, g2 = _batch((4, C, 4, 5), 2)
    xs_p = [x.clone().requires_grad_() for x in (x1, x2)]
    xs_c = [x.clone().requires_grad_() for x in (x1, x2)]
    loss_p = (plain(xs_p[0]) * g1).sum() + (plain(plain(xs_p[1])) * g2).sum()
    run = lambda t: checkpoint(ckpt, t, use_reentrant=reentrant)  # noqa: E731
    loss_c = (run(xs_c[0]) * g1).sum() + (run(run(xs_c[1])) * g2).sum()
    loss_p.backward()
    loss_c.backward()
    for a, b in zip(xs_p, xs_c):
        assert torch.equal(a.grad, b.grad)
    assert torch.equal(plain[0].weight.grad, ckpt[0].weight.grad)
    _assert_same_state(plain, ckpt)
    assert int(ckpt[0].num_batches_tracked) == 3
    ckpt.eval()
    before = _state(ckpt)
    xe = x1.clone().requires_grad_()
    checkpoint(ckpt, xe, use_reentrant=reentrant).sum().backward()
    assert all(torch.equal(v, before[k]) for k, v in ckpt.state_dict().items())


def test_checkpoint_matches_float64_reference():
    """The checkpointed step is the formula (not only self-consistent)."""
    m = _layer(BatchRenorm2d, dtype=F64)
    x, g = _batch((4, C, 4, 5), 3, F64)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, rm, rv = _reference(m, xr)
    (y_ref * g).sum().backward()
    (checkpoint(m, xc, use_reentrant=False) * g).sum().backward()
    torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.running_mean, rm, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m.running_var, rv, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- 2. torch.func
def _func_grads(m, x, g):
    """torch.func.grad through functional_call (buffers cloned inside, as torch's BatchNorm needs in training):
    gradients of the parameters and the input, and the updated buffers."""
    from torch.func import functional_call, grad

    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = dict(m.named_buffers())

    def loss(p, x):
        b = {k: v.clone() for k, v in buffers.items()}
        y = functional_call(m, (p, b), (x,))
        return (y * g).sum(), b

    (gp, gx), b = grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return gp, gx, b


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype,schedule", [(F32, False), (F64, False), (F32, "default")])
def test_torch_func_grad_and_jacrev_match_autograd(case, train, dtype, schedule):
    """torch.func.grad / functional_call / jacrev give plain autograd's gradients (renorm active in training:
    constant limits, or the default schedule at step 30k) and the same buffer update, as for nn.BatchNorm*d."""
    from torch.func import jacrev

    _, cls, _, shape = case
    m = _layer(cls, dtype, schedule=schedule).train(train)
    eager = copy.deepcopy(m)
    x, g = _batch(shape, 4, dtype)
    gp, gx, buffers = _func_grads(m, x, g)
    xe = x.clone().requires_grad_()
    (eager(xe) * g).sum().backward()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == F32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(gx, xe.grad, **tol)
    torch.testing.assert_close(gp["weight"], eager.weight.grad, **tol)
    torch.testing.assert_close(gp["bias"], eager.bias.grad, **tol)
    for k, v in eager.named_buffers():
        torch.testing.assert_close(buffers[k], v, **tol)
    assert int(m.num_batches_tracked) == (30_000 if schedule else 0)  # the module's own buffers were not touched
    probe = copy.deepcopy(m)

    def channel_sums(t):
        state = {k: v.clone() for k, v in probe.state_dict().items()}
        return torch.func.functional_call(probe, state, (t,)).sum(tuple(i for i in range(t.dim()) if i != 1))

    jac = jacrev(channel_sums)(x)
    ref = torch.autograd.functional.jacobian(
        lambda t: copy.deepcopy(probe)(t).sum(tuple(i for i in range(t.dim()) if i != 1)), x
    )
    torch.testing.assert_close(jac, ref, **tol)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_per_sample_gradients_in_eval_and_vmap_rules_in_training(case):
    """vmap(grad) per-sample gradients in eval mode equal a loop of autograd calls (as for nn.BatchNorm*d); in
    training vmap over unbatched running statistics is refused as torch's BatchNorm refuses it, and works (model
    ensembling, stack_module_state) with batched ones."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    _, cls, bn_cls, shape = case
    m = _layer(cls, F64).eval()
    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = {k: v.clone() for k, v in m.named_buffers()}
    xs, gs = _batch((5, 2) + shape[1:], 5, F64)

    def loss(p, x, g):
        return (functional_call(m, (p, buffers), (x,)) * g).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, gs)
    for i in range(5):
        m.zero_grad()
        (m(xs[i]) * gs[i]).sum().backward()
        torch.testing.assert_close(per_sample["weight"][i], m.weight.grad, rtol=1e-10, atol=1e-12)
    members = [_layer(cls, F64) for _ in range(2)]
    with torch.no_grad():
        members[1].running_var.mul_(3.0)
    ref = [copy.deepcopy(k) for k in members]
    stacked_p, stacked_b = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    ys = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)))(stacked_p, stacked_b, xs[:2])
    for i in range(2):
        torch.testing.assert_close(ys[i], ref[i](xs[i]), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(stacked_b["running_var"][i], ref[i].running_var, rtol=1e-12, atol=1e-14)
    assert stacked_b["num_batches_tracked"].tolist() == [1, 1]
    with pytest.raises(RuntimeError, match="Batch norm got a batched tensor"):
        vmap(bn_cls(C, dtype=F64))(xs)
    layer = _layer(cls, F64)
    with pytest.raises(RuntimeError, match=f"{cls.__name__}: a training step under a torch.func transform"):
        vmap(layer)(xs)
    assert int(layer.num_batches_tracked) == 0


# ---------------------------------------------------------------------------------------------- 3-4. compile, export
def _compile_step(m, x, g, backend):
    y = torch.compile(m, fullgraph=True, backend=backend)(x)
    (y * g).sum().backward()
    return y.detach()


@pytest.mark.parametrize(
    "cls,shape,backend",
    [
        (BatchRenorm1d, (4, C), "aot_eager"),
        (BatchRenorm2d, (4, C, 5, 5), "aot_eager"),
        (BatchRenorm3d, (2, C, 2, 3, 3), "aot_eager"),
        (BatchRenorm1d, (4, C), "inductor"),
        (BatchRenorm2d, (4, C, 5, 5), "inductor"),
    ],
)
def test_compiled_training_matches_eager(cls, shape, backend):
    """torch.compile(fullgraph=True) in training (finite check included, no graph break): output, input, weight and
    bias gradients and running statistics equal eager's to 1e-5 (the composite path must not read the running
    statistics after their in-place update); the schedule's step tensor drives the compiled limits."""
    torch._dynamo.reset()
    for momentum in (0.1, None):
        m = _layer(cls, momentum=momentum)
        eager = copy.deepcopy(m)
        compiled = torch.compile(m, fullgraph=True, backend=backend)
        for step in range(2):
            x, g = _batch(shape, 10 + step)
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            y = compiled(xc)
            (y * g).sum().backward()
            ye = eager(xe)
            (ye * g).sum().backward()
            torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-5, atol=1e-6)
            _assert_same_state(m, eager, exact=False)
        torch.testing.assert_close(m.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.bias.grad, eager.bias.grad, rtol=1e-5, atol=1e-6)
        assert int(m.num_batches_tracked) == 2


def test_values_kept_for_backward_survive_inductor():
    """The values a compiled step keeps for its backward (``kept_for_backward``: the prior statistics, the schedule's
    limits) are the forward's also under inductor, whose joint-graph passes drop a ``clone`` as a no-op (and with it
    the mark that makes the partitioner save it): the backward would read the buffer after its in-place update.
    Here d/dx of ``x * exp(prior)`` must be ``exp(0) = 1``, not ``exp(1)`` (the buffer after the update)."""
    from normlab._dispatch import kept_for_backward

    def step(x, buf):
        (prior,) = kept_for_backward((buf,))
        y = x * prior.exp()  # cheap to recompute from buf: the partitioner would, unless the copy is saved
        with torch.no_grad():
            buf.copy_(buf + 1.0)
        return y

    torch._dynamo.reset()
    buf, x = torch.zeros(4), torch.ones(4, requires_grad=True)
    # no on-disk cache: its key is Dynamo's graph, where the copy is one opaque op whatever it decomposes to
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(step, backend="inductor", fullgraph=True)(x, buf).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4))
    torch.testing.assert_close(buf, torch.ones(4))


def _reductions_over_input(module, x) -> list[str]:
    """The reductions over the whole input in the forward graph inductor compiles for a training step of ``module``
    (its post-grad graph, after the common-subexpression pass): one per pass that takes statistics of the input."""
    graphs = []

    def capture(graph):
        nodes = [n for n in graph.nodes if n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node)]
        vals = [(str(n.target), n.args[0].meta.get("val")) for n in nodes]
        graphs.append([t for t, v in vals if isinstance(v, torch.Tensor) and v.shape == x.shape])

    torch._dynamo.reset()
    patch = torch._inductor.config.patch(post_grad_custom_pre_pass=capture, fx_graph_cache=False)
    with patch, torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(module, fullgraph=True)(x.clone().requires_grad_()).sum().backward()
    return sorted(t for t in graphs[0] if any(k in t for k in ("var_mean", "sum", "mean")))


@pytest.mark.parametrize(
    "cls,ref,shape,fmt",
    [
        (BatchRenorm1d, nn.BatchNorm1d, (6, C), None),
        (BatchRenorm2d, nn.BatchNorm2d, (3, C, 4, 5), torch.channels_last),
        (BatchRenorm3d, nn.BatchNorm3d, (2, C, 2, 3, 4), None),
    ],
)
def test_compiled_step_takes_batchnorms_statistics_pass_only(cls, ref, shape, fmt):
    """Compiled, a training step takes the batch statistics once, in BatchNorm's own reduction: the step's
    ``batch_moments`` is the exact ``var_mean`` call of ``torch.batch_norm``'s decomposition, which the compiler
    merges with it (a different expression of the same statistics cost one more pass over the input, 10-20 %)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(100))
    x = x if fmt is None else x.contiguous(memory_format=fmt)
    ours = _reductions_over_input(_layer(cls), x)
    assert ours == _reductions_over_input(ref(C), x) == ["aten.var_mean.correction"]


def test_compiled_nan_batch_keeps_running_stats():
    """The non-finite protection compiled: a NaN batch leaves running statistics and step counter unchanged (restored
    with tensor ops, no host sync, no raise), the next finite batch trains as eager."""
    torch._dynamo.reset()
    m = _layer(BatchRenorm2d)
    eager = copy.deepcopy(m)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x, _ = _batch((4, C, 4, 5), 20)
    bad = x.clone()
    bad[1, 2, 0, 0] = float("nan")
    before = _state(m)
    compiled(bad)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert int(m.skipped_batches) == 1  # counted on the device by the compiled graph
    eager(bad)
    assert int(eager.skipped_batches) == 1
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    _assert_same_state(m, eager, exact=False)


@pytest.mark.parametrize("cls,shape", [(BatchRenorm1d, (4, C)), (BatchRenorm2d, (4, C, 4, 5))])
def test_torch_export_in_training(cls, shape):
    """torch.export of a training-mode layer: the exported program's output and buffer update equal eager's."""
    m = _layer(cls)
    eager = copy.deepcopy(m)
    x, _ = _batch(shape, 21)
    ep = torch.export.export(copy.deepcopy(m), (x,))
    exported = ep.module()
    exported.load_state_dict(m.state_dict())
    torch.testing.assert_close(exported(x), eager(x), rtol=1e-5, atol=1e-5)
    for k, v in eager.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[k], v, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- 5. empty batch
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype,fmt", [(F32, None), (F64, "cl"), (BF16, None)])
def test_empty_batch_is_batchnorms_empty_output(case, train, dtype, fmt):
    """N = 0: nn.BatchNorm*d's empty output (shape, dtype, memory format) and gradients; the running statistics are
    untouched and, unlike nn.BatchNorm*d, num_batches_tracked does not advance (no data, no schedule step)."""
    _, cls, bn_cls, shape = case
    m = _layer(cls).to(dtype).train(train)
    bn = bn_cls(C).to(dtype).train(train)
    bn.load_state_dict(m.state_dict())
    before = _state(m)
    x, _ = _batch((0,) + shape[1:], 0, dtype, fmt)
    xm, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, yb = m(xm), bn(xb)
    assert y.shape == yb.shape and y.dtype == yb.dtype and y.stride() == yb.stride()
    y.sum().backward()
    yb.sum().backward()
    assert xm.grad.shape == xb.grad.shape
    assert torch.equal(m.weight.grad, bn.weight.grad) and torch.equal(m.bias.grad, bn.bias.grad)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


# ---------------------------------------------------------------------------------------------- 7. meta device
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_meta_device_forward_and_to_empty(case, momentum):
    """A layer on the meta device runs training and eval forwards (shapes only, as nn.BatchNorm*d, and also with
    the cumulative average, where nn.BatchNorm*d calls .item()); to_empty() +
    reset_parameters() gives the freshly constructed layer, which then trains like one."""
    _, cls, bn_cls, shape = case
    m = cls(C, momentum=momentum, device="meta", rmax=1.5, dmax=0.5)
    bn = bn_cls(C, momentum=momentum, device="meta")
    x = torch.empty(shape, device="meta")
    for train in (True, False):
        y = m.train(train)(x)
        assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
        if momentum is not None or not train:  # torch's cumulative average reads the step with .item() on meta
            yb = bn.train(train)(x)
            assert y.shape == yb.shape and y.stride() == yb.stride()
    m.to_empty(device="cpu").reset_parameters()
    fresh = cls(C, momentum=momentum, rmax=1.5, dmax=0.5)
    _assert_same_state(m, fresh)
    xc, _ = _batch(shape, 6)
    assert torch.equal(m.train()(xc), fresh(xc))
    _assert_same_state(m, fresh)


# ---------------------------------------------------------------------------------------------- 8. jit.trace, in-place
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("train", [True, False])
def test_jit_trace_follows_eager(case, train):
    """torch.jit.trace in training and eval: the traced module keeps renormalizing with the schedule's step tensor
    (not the step frozen at tracing time), updates the buffers as eager does, gives eager's gradients, and saves."""
    _, cls, _, shape = case
    m = _layer(cls, schedule=True).train(train)
    eager = copy.deepcopy(m)
    x0, _ = _batch(shape, 30)
    traced = torch.jit.trace(m, (x0,), check_trace=False)
    eager(x0)
    for step in range(1, 4):
        x, g = _batch(shape, 30 + step)
        xt, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        yt, ye = traced(xt), eager(xe)
        (yt * g).sum().backward()
        (ye * g).sum().backward()
        torch.testing.assert_close(yt, ye, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xt.grad, xe.grad, rtol=1e-5, atol=1e-6)
        _assert_same_state(m, eager, exact=False)
    assert int(m.num_batches_tracked) == (4 if train else 0)
    buffer = io.BytesIO()  # plain aten ops (no Python autograd Function): the trace saves and loads
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    x, _ = _batch(shape, 39)
    torch.testing.assert_close(loaded(x), eager(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("train", [True, False])
def test_in_place_ops_on_the_output(case, train):
    """+= and relu_() on the output work and give the gradients of the out-of-place ops, as for nn.BatchNorm*d."""
    _, cls, bn_cls, shape = case
    for make in (lambda: _layer(cls), lambda: bn_cls(C)):
        a = make().train(train)
        b = copy.deepcopy(a)
        x, g = _batch(shape, 40)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = a(xa)
        ya += 1.0
        ya.relu_()
        yb = (b(xb) + 1.0).relu()
        (ya * g).sum().backward()
        (yb * g).sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
        assert torch.equal(a.weight.grad, b.weight.grad)


# ---------------------------------------------------------------------------------------------- bfloat16 autocast
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bfloat16_autocast_checkpoint_and_func(case):
    """Under CPU bfloat16 autocast (a conv/linear in front gives a bfloat16 input) checkpointing keeps the plain
    gradients and torch.func.grad works; the output follows nn.BatchNorm*d's dtype."""
    _, cls, bn_cls, shape = case
    m = _layer(cls)
    ck = copy.deepcopy(m)
    x, g = _batch(shape, 50, BF16)
    with torch.autocast("cpu", dtype=BF16):
        xa, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = m(xa)
        yc = checkpoint(ck, xc, use_reentrant=False)
        yb = bn_cls(C)(x)
    assert ya.dtype == yb.dtype == BF16
    (ya.float() * g.float()).sum().backward()
    (yc.float() * g.float()).sum().backward()
    assert torch.equal(xa.grad, xc.grad) and torch.equal(m.weight.grad, ck.weight.grad)
    _assert_same_state(m, ck)
    with torch.autocast("cpu", dtype=BF16):
        gp, gx, _ = _func_grads(_layer(cls), x, g)
    assert gx.dtype == BF16 and torch.isfinite(gp["weight"]).all()


# ---------------------------------------------------------------------------------------------- every mode
@pytest.mark.parametrize(
    "kw",
    [{"affine": False}, {"bias": False}, {"momentum": None}, {"track_running_stats": False}],
    ids=["no-affine", "no-bias", "cumulative", "no-running-stats"],
)
def test_every_mode_under_checkpoint_func_and_empty_batch(kw):
    """The habits hold in every mode of the layer (2d and 1d): checkpointing keeps the plain gradients and one update,
    torch.func.grad gives autograd's gradients, an empty batch gives BatchNorm's empty output."""
    for cls, shape in ((BatchRenorm2d, (4, C, 3, 4)), (BatchRenorm1d, (6, C))):
        plain = _layer(cls, **kw)
        ckpt, func = copy.deepcopy(plain), copy.deepcopy(plain)
        x, g = _batch(shape, 60)
        xp, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        (plain(xp) * g).sum().backward()
        (checkpoint(ckpt, xc, use_reentrant=False) * g).sum().backward()
        assert torch.equal(xp.grad, xc.grad)
        _assert_same_state(plain, ckpt)
        _, gx, buffers = _func_grads(func, x, g)
        torch.testing.assert_close(gx, xp.grad, rtol=1e-5, atol=1e-6)
        for k, v in plain.named_buffers():
            torch.testing.assert_close(buffers[k], v, rtol=1e-6, atol=1e-7)
        empty = torch.empty((0,) + shape[1:], requires_grad=True)
        before = _state(plain)
        plain(empty).sum().backward()
        assert empty.grad.shape == empty.shape
        assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())


def test_functional_fused_path_under_torch_func_grad():
    """normlab.functional.batch_renorm(fused=True) under torch.func.grad (its autograd Function has the separate
    setup_context form) equals the composite path under plain autograd."""
    from torch.func import grad

    from normlab import functional as NF

    x, _ = _batch((4, C, 3, 4), 70, F64)
    w, b = torch.tensor([0.7, 1.3, 1.1], dtype=F64), torch.tensor([0.1, -0.2, 0.3], dtype=F64)

    def loss(w, b, x, fused):
        rm, rv = torch.full((C,), 0.5, dtype=F64), torch.full((C,), 4.0, dtype=F64)
        return NF.batch_renorm(x, rm, rv, w, b, True, 0.1, 1e-5, 1.5, 0.5, fused=fused).square().sum()

    got = grad(loss, argnums=(0, 1, 2))(w, b, x, True)
    ref = [t.clone().requires_grad_() for t in (w, b, x)]
    loss(*ref, False).backward()
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- ensembles (vmap)
@pytest.mark.parametrize("case", CASES[:4], ids=IDS[:4])
@pytest.mark.parametrize("limits", [{"rmax": 1.0, "dmax": 0.0}, {}, {"rmax": 1.5, "dmax": 0.5}], ids=str)
def test_vmap_ensemble_over_stacked_layers_trains_as_each_member(case, limits):
    """An ensemble as RL code builds it (torch.func.stack_module_state + vmap(functional_call)): output, gradients
    and running statistics of every member equal that member run alone, with ``rmax=1, dmax=0`` (the backward used
    to fail: the non-finite guard wrote running statistics that F.batch_norm had saved) and with renormalization.
    A non-finite batch of one member leaves that member's statistics unchanged and counts only there."""
    from torch.func import functional_call, stack_module_state, vmap

    _, cls, _, shape = case
    members = [_layer(cls, schedule=False if limits else "default") for _ in range(3)]
    for i, m in enumerate(members):
        if limits:
            m.rmax, m.dmax = limits["rmax"], limits["dmax"]
        with torch.no_grad():
            m.running_mean.add_(0.1 * i)
    alone = copy.deepcopy(members)
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    xs = torch.stack([_batch(shape, 30 + i)[0] for i in range(3)])
    xs[2].view(-1)[0] = float("nan")
    g = torch.stack([_batch(shape, 40 + i)[1] for i in range(3)])
    y = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)))(params, buffers, xs)
    (y * g).sum().backward()
    for i, m in enumerate(alone):
        yi = m(xs[i])
        (yi * g[i]).sum().backward()
        if i < 2:
            torch.testing.assert_close(y[i], yi, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(params["weight"].grad[i], m.weight.grad, rtol=1e-5, atol=1e-5)
        for k in ("running_mean", "running_var", "num_batches_tracked", "skipped_batches"):
            torch.testing.assert_close(buffers[k][i], getattr(m, k), rtol=1e-6, atol=1e-7, msg=k)
    assert buffers["skipped_batches"].tolist() == [0, 0, 1]
