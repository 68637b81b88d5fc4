"""PyTorch's generic module checks (what pytorch's test/test_modules.py TestModule runs over its own layers) on
normlab's 16 drop-in layers, with torch's sample inputs for the layer each replaces, on the CPU in float32 and
float64.

The layers and their inputs: tests/torch_module_info.py (torch's ModuleInfo entries from the torch wheel's
``torch.testing._internal.common_modules``). torch's own entries for the replaced layers (BatchNorm1d/2d/3d,
InstanceNorm1d/2d/3d, Conv1d/2d/3d) run through the same checks and all pass: the proof that the checks are right.
normlab's: BatchRenorm1d/2d/3d and SyncBatchRenorm on BatchNorm's inputs (also with renormalization active from step
0, rmax 3 dmax 5: ``-renorm``), SwitchableNorm1d/2d/3d on BatchNorm's, InstanceNorm1d/2d/3d on InstanceNorm's,
WSConv1d/2d/3d and PWSConv1d/2d/3d on Conv's. What torch skips for its layer is skipped (or expected to fail) for
the layer replacing it too, unless the entry runs it anyway; every normlab difference is a deviation of
docs/deviations.md, named in tests/torch_module_info.py with its reason (``LEFT_OUT``, ``CONSTRUCTOR_ERRORS``).
The checks are written here (pytorch's file is not in the wheel); each docstring says what it checks. In-place
checks (``test_check_inplace``) apply to layers with an ``inplace`` argument: none of these has one. The CUDA-only
checks (device transfer between GPUs, CPU/GPU parity) need a GPU.
"""

from __future__ import annotations

import copy
import io
import itertools
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from conftest import needs

needs("expecttest")  # torch's test utilities import it (the `dev` extra installs it)

import torch_module_info as db  # noqa: E402

ENTRIES = db.entries()
DTYPES = (torch.float32, torch.float64)
CHECKS = {}  # check name -> (function, dtypes, train_only)


def check(dtypes=DTYPES, train_only=False, when=lambda entry: True):
    """Register a check: run over every entry for which ``when`` holds, ``dtypes`` and the entry's modes."""

    def register(fn):
        CHECKS[fn.__name__] = (fn, dtypes, train_only, when)
        return fn

    return register


def _cases():
    out = []
    for name, (_, dtypes, train_only, when) in CHECKS.items():
        for entry in ENTRIES:
            if not when(entry):
                continue
            modes = (True,) if train_only or not entry.info.train_and_eval_differ else (True, False)
            for dtype, training in itertools.product(dtypes, modes):
                mode = "train" if training else "eval"
                case_id = f"{name}-{entry.name}-{str(dtype)[6:]}-{mode}"
                out.append(pytest.param(name, entry, dtype, training, id=case_id))
    return out


# ------------------------------------------------------------------------------------------------------------------
# Shared helpers (torch's TestCase.assertEqual tolerances: the dtype's defaults, at least TestModule's 1e-5 each)
# ------------------------------------------------------------------------------------------------------------------
_DEFAULT = {torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7)}


class Ctx:
    """One case: the entry, dtype and mode, and the tolerances torch declares for the check."""

    def __init__(self, entry, dtype, training, tol):
        self.entry, self.dtype, self.training = entry, dtype, training
        rtol, atol = _DEFAULT[dtype]  # TestModule's precision and rel_tol (1e-5), or the declared overrides
        self.rtol = max(rtol, tol.get("rtol", 1e-5))
        self.atol = max(atol, tol.get("atol", 1e-5))

    def equal(self, actual, expected, **tol):
        tol = {"rtol": self.rtol, "atol": self.atol, **tol}
        torch.testing.assert_close(actual, expected, equal_nan=True, **tol)

    def inputs(self, requires_grad=False, errors=False, device="cpu"):
        return self.entry.module_inputs(self.dtype, requires_grad, self.training, device=device, errors=errors)

    def build(self, module_input, to_dtype=True):
        ci = module_input.constructor_input
        m = self.entry.cls(*ci.args, **ci.kwargs)
        if to_dtype:
            m.to("cpu").to(self.dtype)
        if self.entry.stateful and self.training:  # (see torch_module_info.STATEFUL)
            m.register_forward_pre_hook(db.RestoreState(m))
        return m.train(self.training)


def _call(m, fi):
    return m(*fi.args, **fi.kwargs)


def _tensors(obj) -> list:
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def _assert_on(m, device, dtype):
    """Every parameter and buffer on ``device``; the floating ones in ``dtype``."""
    for name, t in itertools.chain(m.named_parameters(), m.named_buffers()):
        assert t.device == torch.device(device), f"{name} is on {t.device}, expected {device}"
        if t.dtype.is_floating_point:
            assert t.dtype == dtype, f"{name} is {t.dtype}, expected {dtype}"


# ------------------------------------------------------------------------------------------------------------------
# The checks
# ------------------------------------------------------------------------------------------------------------------
@check()
def forward(ctx):
    """The forward runs and equals the input's reference function (unbatched input: the batched output, squeezed);
    after ``.float()``/``.double()`` it runs again and every parameter and buffer has that dtype."""
    for mi in ctx.inputs():
        with torch.random.fork_rng():
            m = ctx.build(mi)
            out = _call(m, mi.forward_input)
            if mi.reference_fn is not None:
                ctx.equal(out, mi.reference_fn(m, *mi.forward_input.args, **mi.forward_input.kwargs))
            getattr(m, {torch.float32: "float", torch.float64: "double"}[ctx.dtype])()
            _call(m, mi.forward_input)
            _assert_on(m, "cpu", ctx.dtype)


@check()
def factory_kwargs(ctx):
    """``device=``/``dtype=`` given to the constructor reach every parameter and buffer it creates."""
    for mi in ctx.inputs():
        ci = mi.constructor_input
        created = _created_tensors(ctx.entry.cls, ci)
        passed = {id(t) for t in _tensors((ci.args, ci.kwargs))}
        if not any(isinstance(t, torch.Tensor) and id(t) not in passed for t in created):
            continue
        m = ctx.entry.cls(*ci.args, **{**ci.kwargs, "device": "cpu", "dtype": ctx.dtype}).train(ctx.training)
        _assert_on(m, "cpu", ctx.dtype)


def _created_tensors(cls, ci) -> list:
    """The tensors the constructor makes Parameters of or registers as buffers."""
    created = []
    new_param, register = torch.nn.Parameter.__new__, torch.nn.Module.register_buffer

    def parameter(cls, data=None, *args, **kwargs):
        created.append(data)
        return new_param(cls, data, *args, **kwargs)

    def buffer(self, name, tensor, *args, **kwargs):
        created.append(tensor)
        return register(self, name, tensor, *args, **kwargs)

    with mock.patch.object(torch.nn.Parameter, "__new__", parameter):
        with mock.patch.object(torch.nn.Module, "register_buffer", buffer):
            cls(*ci.args, **ci.kwargs)
    return created


@check()
def repr(ctx):  # noqa: A001 - torch's check name
    """``repr`` and ``str`` of the module run."""
    for mi in ctx.inputs():
        m = ctx.build(mi)
        assert type(m).__name__ in m.__repr__() and str(m)


@check()
def pickle(ctx):
    """A module saved whole with ``torch.save`` and loaded gives the same output as the original."""
    for mi in ctx.inputs():
        with torch.random.fork_rng():
            m = ctx.build(mi)
            out = _call(m, mi.forward_input)
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            ctx.equal(_call(torch.load(buf, weights_only=False), mi.forward_input), out)


@check()
def save_load(ctx):
    """As ``pickle``, and the state_dict saved and loaded (also with ``weights_only=True``) equals the original."""
    for mi in ctx.inputs():
        with torch.random.fork_rng():
            m = ctx.build(mi)
            state = m.state_dict()
            out = _call(m, mi.forward_input)
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            ctx.equal(_call(torch.load(buf, weights_only=False), mi.forward_input), out)
            buf = io.BytesIO()
            torch.save(state, buf)
            for weights_only in (False, True):
                buf.seek(0)
                ctx.equal(torch.load(buf, weights_only=weights_only), state)


def _backward(out, grads=None, seed=100):
    """Backward of every differentiable output with random (or given) output gradients; returns those."""
    outs = [o for o in _tensors(out) if o.requires_grad]
    if grads is None:
        gen = torch.Generator().manual_seed(seed)
        grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    for o, g in zip(outs, grads):
        o.backward(g, retain_graph=True)
    return grads


def _non_contiguous(t):
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    out = torch.repeat_interleave(t, 2, dim=-1)[..., ::2].detach()
    return out.requires_grad_(t.requires_grad)


@check()
def non_contiguous_tensors(ctx):
    """Non-contiguous inputs and output gradients give the contiguous ones' outputs and gradients."""
    for mi in ctx.inputs(requires_grad=True):
        args = mi.forward_input.args
        if not any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
            continue
        m = ctx.build(mi)
        with torch.random.fork_rng():
            default = m(*args)
            grads = _backward(default)
        ref_in = copy.deepcopy([a.grad for a in args if isinstance(a, torch.Tensor)])
        ref_params = copy.deepcopy([p.grad for p in m.parameters()])
        nc_args = tuple(_non_contiguous(a) for a in args)
        nc_grads = [_non_contiguous(g) for g in grads]
        for inputs, g in itertools.product((args, nc_args), (grads, nc_grads)):
            for t in list(inputs) + list(m.parameters()):
                if isinstance(t, torch.Tensor):
                    t.grad = None
            with torch.random.fork_rng():
                out = m(*inputs)
                _backward(out, [x.clone() for x in g])
            ctx.equal(out, default)
            ctx.equal([a.grad for a in inputs if isinstance(a, torch.Tensor)], ref_in, atol=1e-4, rtol=0)
            ctx.equal([p.grad for p in m.parameters()], ref_params)


def _gradients(ctx, checker):
    """``checker`` (gradcheck / gradgradcheck, with torch's test defaults: batched gradients checked, fast mode)
    over the inputs and parameters together, then each parameter alone with the inputs."""
    for mi in ctx.inputs(requires_grad=True):
        m = ctx.build(mi)
        args, params = mi.forward_input.args, tuple(m.parameters())
        fn = _flat_forward(m, args, params)
        assert checker(fn, list(args + params), check_batched_grad=True, fast_mode=True)
        old = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad = False
        for p, was in zip(params, old):
            p.requires_grad = was
            assert checker(fn, list(args + params), check_batched_grad=True, fast_mode=True)
            p.requires_grad = False
        for p, was in zip(params, old):
            p.requires_grad = was


def _flat_forward(m, args, params):
    """``fn(*args, *params)``: the module's flattened outputs, with the given tensors as input and parameters (the
    parameters are the module's own: gradcheck perturbs them in place)."""

    def fn(*flat):
        with torch.random.fork_rng():
            return pytree.tree_leaves(m(*flat[: len(args)]))

    return fn


@check(dtypes=(torch.float64,))
def grad(ctx):
    """float64 gradcheck (first derivatives, batched gradients too) over inputs and parameters."""
    _gradients(ctx, torch.autograd.gradcheck)


@check(dtypes=(torch.float64,), when=lambda entry: entry.info.supports_gradgrad)
def gradgrad(ctx):
    """float64 gradgradcheck (second derivatives, batched too) over inputs and parameters."""
    _gradients(ctx, torch.autograd.gradgradcheck)


def _memory_formats(x):
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    ins = (torch.contiguous_format,) if fmt is None else (torch.contiguous_format, fmt)
    mods = (torch.preserve_format, torch.contiguous_format) + (() if fmt is None else (fmt,))
    return ins, mods


def _check_layout(t, in_fmt, mod_fmt, affects):
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    if fmt is not None and (in_fmt == fmt or (mod_fmt == fmt and affects)):
        assert t.is_contiguous(memory_format=fmt), f"expected a {fmt} output"
    else:
        assert t.is_contiguous(), "expected a contiguous output"


@check()
def memory_format(ctx):
    """Inputs and module in every memory format the input's ndim allows give the contiguous case's outputs and
    gradients, in the expected layout (the input's, or the module's where ModuleInfo says it affects the output)."""
    affects = ctx.entry.info.module_memformat_affects_out
    for mi in ctx.inputs(requires_grad=True):
        args = mi.forward_input.args
        m = ctx.build(mi)
        with torch.random.fork_rng():
            desired = m(*args)
            diff_in = [t for t in _tensors(args) + list(m.parameters()) if t.requires_grad]
            gen = torch.Generator().manual_seed(101)
            g_out = torch.rand(desired.shape, generator=gen, dtype=desired.dtype)
            ref = torch.autograd.grad(desired, diff_in, g_out) if ctx.training else None
            ins, mods = _memory_formats(args[0])
            for in_fmt in ins:
                x = args[0].clone().to(memory_format=in_fmt).detach().requires_grad_(args[0].requires_grad)
                for mod_fmt in mods:
                    m.to(memory_format=mod_fmt)
                    out = m(x, *args[1:])
                    if in_fmt != torch.contiguous_format or mod_fmt != torch.contiguous_format:
                        ctx.equal(out, desired)
                    _check_layout(out, in_fmt, mod_fmt, affects)
                    if ctx.training:
                        diff = [t for t in [x, *_tensors(args[1:]), *m.parameters()] if t.requires_grad]
                        found = torch.autograd.grad(out, diff, torch.empty_like(out).copy_(g_out))
                        if in_fmt != torch.contiguous_format or mod_fmt != torch.contiguous_format:
                            ctx.equal(found, ref)
                        for t in found:
                            _check_layout(t, in_fmt, mod_fmt, affects)


@check(train_only=True)
def if_train_and_eval_modes_differ(ctx):
    """A forward that reads ``self.training`` belongs to a ModuleInfo declaring that train and eval differ."""
    for mi in ctx.inputs():
        m = ctx.build(mi)
        del m.training
        try:
            _call(m, mi.forward_input)
        except AttributeError as e:
            if "'training'" not in str(e):
                raise
            assert ctx.entry.info.train_and_eval_differ, f"{ctx.entry} reads self.training"


@check()
def device_ctx_init(ctx):
    """Built under ``torch.device('meta')``, every parameter and buffer has the metadata of the CPU one."""
    from torch._subclasses.meta_utils import assert_metadata_eq

    with torch.device("meta"):
        meta_inputs = ctx.entry.module_inputs(ctx.dtype, False, ctx.training, device=None)
    for mi, mi_meta in zip(ctx.inputs(), meta_inputs):
        cpu = ctx.build(mi, to_dtype=False)
        with torch.device("meta"):
            meta = ctx.build(mi_meta, to_dtype=False)
        pairs = itertools.chain(zip(meta.parameters(), cpu.parameters()), zip(meta.buffers(), cpu.buffers()))
        for p_meta, p_cpu in pairs:
            assert p_meta.is_meta

            def same(a, b, msg=None):
                assert a == b, msg

            assert_metadata_eq(same, p_meta, p_cpu)


@check(when=lambda entry: entry.info.module_error_inputs_func is not None)
def errors(ctx):
    """Each of torch's error inputs raises its error, at construction or in the forward as it declares; a layer
    that refuses at construction what torch refuses in the forward (``constructor_errors``) raises it there."""
    common = db.load()
    for item in ctx.inputs(errors=True):
        mi = item.module_error_input
        ci, fi = mi.constructor_input, mi.forward_input
        if ctx.entry.constructor_errors:  # a documented deviation: refused earlier, in one line naming the layer
            with pytest.raises(ValueError, match=rf"^{ctx.entry.cls.__name__}: eps must be"):
                ctx.entry.cls(*ci.args, **ci.kwargs)
        elif item.error_on == common.ModuleErrorEnum.CONSTRUCTION_ERROR:
            with pytest.raises(item.error_type, match=item.error_regex):
                ctx.entry.cls(*ci.args, **ci.kwargs)
        else:
            m = ctx.entry.cls(*ci.args, **ci.kwargs)
            with pytest.raises(item.error_type, match=item.error_regex):
                m(*fi.args, **fi.kwargs)


def _swap(value):
    """``torch.__future__`` swap-on-conversion set for the test and restored after."""
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(value)
    return old


def _to_by_hand(m, dtype, set_grad):
    """Parameters and buffers moved without ``.to()`` (the method under test), as torch's check does."""
    for c in m.children():
        _to_by_hand(c, dtype, set_grad)
    for n, p in list(m.named_parameters(recurse=False)):
        new = torch.nn.Parameter(p.detach().clone().to("cpu", dtype))
        setattr(m, n, new)
        if set_grad:
            new.grad = torch.randn_like(new)
    for n, b in list(m.named_buffers(recurse=False)):
        setattr(m, n, b.detach().clone().to("cpu", dtype))


@check(dtypes=(torch.float32,))
def to(ctx):
    """``.to(dtype)`` with and without swapping tensors on conversion, with and without gradients: the parameters
    stay Parameters (the same objects), in the new dtype; their data and gradients are swapped or set in place."""
    for swap, set_grad in itertools.product((True, False), (True, False)):
        old = _swap(swap)
        try:
            _to_once(ctx, swap, set_grad)
        finally:
            _swap(old)


def _to_once(ctx, swap, set_grad):
    for mi in ctx.inputs():
        m = ctx.build(mi, to_dtype=False)
        _to_by_hand(m, ctx.dtype, set_grad)
        if swap and not set_grad and list(m.parameters()):
            out = pytree.tree_leaves(_call(m, mi.forward_input))[0]
            out.sum().backward()
            m.to(dtype=torch.half)
            m.to(dtype=torch.float32)
        prev = ctx.dtype
        for dtype in ctx.entry.info.dtypes:
            same = dtype == prev
            prev = dtype
            params = list(m.parameters())
            ids, cdatas = [id(p) for p in params], [p._cdata for p in params]
            grads = [p.grad._cdata for p in params] if set_grad else []
            m.to(device="cpu", dtype=dtype)
            params = list(m.parameters())
            assert all(isinstance(p, torch.nn.Parameter) and p.dtype == dtype for p in params)
            assert [id(p) for p in params] == ids
            if swap:
                assert all(a != b for a, b in zip(cdatas, [p._cdata for p in params]))
                if set_grad:
                    assert all((a == b) == same for a, b in zip(grads, [p.grad._cdata for p in params]))
            else:
                assert [p._cdata for p in params] == cdatas
                if set_grad:
                    assert [p.grad._cdata for p in params] == grads
            assert not set_grad or all(p.grad.dtype == dtype for p in params)


@check(dtypes=(torch.float32,))
def to_empty(ctx):
    """A module built on the meta device and moved with ``to_empty(device="cpu")`` has Parameters on the CPU in
    its dtype; swapped on conversion, the same Parameter objects with new data."""
    with torch.device("meta"):
        inputs = ctx.entry.module_inputs(ctx.dtype, False, ctx.training, device=None)
    for swap in (True, False):
        old = _swap(swap)
        try:
            for mi in inputs:
                with torch.device("meta"):
                    m = ctx.build(mi, to_dtype=False)
                ids, cdatas = [id(p) for p in m.parameters()], [p._cdata for p in m.parameters()]
                m.to_empty(device="cpu")
                params = list(m.parameters())
                assert all(isinstance(p, torch.nn.Parameter) and p.device.type == "cpu" for p in params)
                assert all(p.dtype == ctx.dtype for p in params)
                assert ([id(p) for p in params] == ids) == swap or not params
                assert all(a != b for a, b in zip(cdatas, [p._cdata for p in params]))
        finally:
            _swap(old)


# ------------------------------------------------------------------------------------------------------------------
# Every check over every entry, dtype and mode (parametrized once every check is registered above)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, entry, dtype, training", _cases())
def test_module(name, entry, dtype, training):
    verdict, tol = db.declared(entry, f"test_{name}", dtype, training)
    if verdict == "skip":
        pytest.skip(f"torch's ModuleInfo for {entry.info.name} skips test_{name}")
    if training and f"test_{name}" in (entry.train_skips or {}):
        pytest.skip(f"{entry} in training: {entry.train_skips[f'test_{name}']}")
    fn = CHECKS[name][0]
    ctx = Ctx(entry, dtype, training, tol)
    if verdict == "xfail":
        with pytest.raises((AssertionError, RuntimeError)):  # torch declares an expected failure; so here
            fn(ctx)
        return
    fn(ctx)
