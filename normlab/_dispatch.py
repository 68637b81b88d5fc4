"""Shared helpers of normlab's layers and functions (private): dtypes, memory formats, execution context and the
non-finite policy. Each is defined here once; ``normlab.functional``, ``normlab._functions`` and the layers of
``normlab.nn`` import them from here.

Non-finite policy (every normalization layer with running statistics, see ``docs/design.md``): a training batch
whose statistics are not finite (NaN/inf in the input, or a variance that overflows) never changes the running
statistics nor the step counter ``num_batches_tracked``, with tensor ops only (no host synchronisation, on every
device, eager or compiled: :func:`guarded_update`); the layers count such batches on the device and warn later
(:mod:`normlab.nn._non_finite`). No exception: the output carries the NaN, as torch's layers do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)
"""The half-precision dtypes whose statistics normlab computes in float32."""


def stats_dtype(x: Tensor) -> Tensor:
    """Half-precision tensors are promoted to float32 for statistics; others are returned unchanged."""
    return x.float() if x.dtype in HALF else x


def param_dtype(x: Tensor) -> torch.dtype:
    """dtype of the per-channel parameters the fused kernels take with input ``x`` (float32 for half inputs)."""
    return torch.float32 if x.dtype in HALF else x.dtype


def as_param(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype`` (a module converted with ``.half()`` has half weights; the kernels want float32)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def centered_moments(y: Tensor, dims: tuple[int, ...], count: int, correction: int) -> tuple[Tensor, Tensor]:
    """Two-pass mean and variance of ``y`` over ``dims`` (kept), the arithmetic of :func:`normlab.functional.moments`:
    the variance is centred on the detached mean, and ``(mean - stop_grad(mean))^2``, zero in value and in first
    derivative, is subtracted so that double backward is exact (``var = E[(x-c)^2] - (E[x]-c)^2`` for any c)."""
    mean = y.mean(dims, keepdim=True)
    shift = mean.detach()
    var = (y - shift).square().sum(dims, keepdim=True) / (count - correction)
    return mean, var - (mean - shift).square() * (count / (count - correction))


# ------------------------------------------------------------------------------------------ memory format
def channels_last_format(x: Tensor) -> torch.memory_format | None:
    """channels_last / channels_last_3d when ``x`` is stored that way (and not also plain contiguous), else None."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
        return fmt
    return None


def same_layout(g: Tensor, x: Tensor) -> Tensor:
    """``g`` in ``x``'s memory format (contiguous, channels_last or channels_last_3d; others: ``g`` as it is)."""
    if x.is_contiguous():
        return g.contiguous()
    fmt = channels_last_format(x)
    return g.contiguous(memory_format=fmt) if fmt is not None else g


# ------------------------------------------------------------------------------------------ execution context
def can_sync() -> bool:
    """True when a host synchronisation is allowed (eager, not torch.compile / torch.export / jit.trace)."""
    return not torch.compiler.is_compiling() and not torch.jit.is_tracing()


def plain_eager(x: Tensor) -> bool:
    """The fused paths' test: eager on CPU/CUDA, and none of torch.compile, torch.export, torch.jit.trace or a
    torch.func transform (grad, vmap, jacrev, ...), which need plain differentiable aten ops without host
    synchronisation (the composite paths). The meta device is not eager either (shapes only)."""
    if x.device.type not in ("cpu", "cuda") or not can_sync():
        return False
    return torch._C._functorch.peek_interpreter_stack() is None


def forward_ad_active() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level()``: inputs may carry tangents, and an autograd Function
    without a ``jvp`` (normlab's fused paths) would raise, so the layers take their composite paths (plain aten ops,
    each with a forward derivative). ``torch.func.jvp``/``jacfwd`` are functorch transforms (:func:`plain_eager`)."""
    return torch.autograd.forward_ad._current_level >= 0


def fx_tracing() -> bool:
    """True while ``torch.fx.symbolic_trace`` traces a forward: its values are Proxies, so a layer computes its
    kernels in the graph (no cache lookups, no reads of a value)."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def fx_node(layer: torch.nn.Module, x) -> bool:
    """True while ``torch.fx.symbolic_trace`` traces a model that holds ``layer`` below its root, with ``x`` a value
    of that trace: the layer is then recorded as one :func:`layer_step` node. The root of a trace (a layer traced
    on its own) has no name to read it back from: it is traced through, as torch's own layers are."""
    if not isinstance(x, torch.fx.Proxy):
        return False
    root = getattr(x.tracer, "root", None)
    return root is not None and root is not layer and any(m is layer for m in root.modules())


def layer_step(layer: torch.nn.Module, *args):
    """``layer._forward_step(*args)``, the layer's own forward: what a torch.fx graph calls for a normlab layer
    whose forward depends on its mode or settings (those layers ``torch.fx.wrap`` this name and call it when
    :func:`fx_node`). The graph holds the layer (a ``get_attr`` node) and runs its step when it runs, reading
    ``training``, ``momentum`` and the rest then, as the ``call_module`` node of a torch BatchNorm does: the
    GraphModule follows ``.train()``/``.eval()`` and ``update_bn``, and its ``state_dict`` has the model's keys.
    (The step, not ``forward``: a subclass's forward around it, such as a timm NormAct's activation, is traced.)"""
    return layer._forward_step(*args)


def batched_backward(grad: Tensor) -> bool:
    """True when a backward runs under vmap: batched gradients (``autograd.grad(is_grads_batched=True)``,
    ``torch.autograd.functional.jacobian/hessian(vectorize=True)``: the legacy vmap) or a torch.func transform. Kernels
    called with ``out=`` have no batching rule there, so an autograd Function differentiates its composite formula
    instead."""
    ft = torch._C._functorch
    return torch._C._are_functorch_transforms_active() or ft.is_legacy_batchedtensor(grad)


def recomputing() -> bool:
    """True while autograd runs a backward pass: a forward then is activation checkpointing's recomputation
    (``torch.utils.checkpoint``, reentrant or not), which must not update the running statistics a second time."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def snapshot(running_mean: Tensor, running_var: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of the running statistics before a step updates them (:func:`kept_for_backward` under torch.compile).
    Eager: two clones."""
    with torch.no_grad():
        if not _partitioned():
            return running_mean.clone(), running_var.clone()
        mean, var = kept_for_backward((running_mean, running_var))
        return mean, var


def _partitioned() -> bool:
    """torch.compile is tracing a graph that its partitioner will split into forward and backward (not eager, not
    torch.export, whose graph keeps plain ops)."""
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def kept_for_backward(values: Sequence) -> tuple:
    """``values`` (tensors or numbers) as the backward of a compiled graph must see them: the values of the forward.

    Under torch.compile the partitioner may recompute cheap ops of the forward in the backward instead of saving their
    results, reading the graph's inputs again; inside an activation-checkpointed region it recomputes every op that
    way. A value computed from a buffer the step then updates in place (the running statistics, the step counter a
    schedule reads) would come back changed: r and d, and so the gradients, would follow the new statistics
    (pytorch/pytorch#197039). So the tensors among ``values`` are copied by ``torch.ops.normlab.kept_copy``, whose
    copies are marked ``MUST_SAVE`` while AOTAutograd traces (see :func:`_kept_copy`). Eager, under torch.export (no
    partitioner: its graph keeps plain ops) and for numbers: the values themselves."""
    if not _partitioned():
        return tuple(values)
    tensors = [v for v in values if isinstance(v, Tensor)]
    if not tensors:
        return tuple(values)
    copies = iter(torch.ops.normlab.kept_copy(tensors))
    return tuple(next(copies) if isinstance(v, Tensor) else v for v in values)


_LIBRARY = torch.library.Library("normlab", "FRAGMENT")  # kept alive: the op lives as long as this object
_LIBRARY.define("kept_copy(Tensor[] values) -> Tensor[]")


def _kept_copy(values: list[Tensor]) -> list[Tensor]:
    """Copies of ``values`` (:func:`_copy`) whose graph nodes are marked ``MUST_SAVE`` (the partitioner saves them,
    never recomputes them): an op that decomposes while AOTAutograd traces (CompositeImplicitAutograd), so this runs
    then. Inside an activation-checkpointed region the copies are traced past the region's selective-checkpoint
    modes, which would mark them for recomputation."""
    import torch.fx.traceback as fx_traceback
    from torch.utils.checkpoint import CheckpointPolicy

    with outside_selective_checkpoint():
        meta = fx_traceback.current_meta
        before = meta.get("recompute", _MISSING)
        meta["recompute"] = CheckpointPolicy.MUST_SAVE
        try:
            return [_copy(v) for v in values]
        finally:
            if before is _MISSING:
                meta.pop("recompute", None)
            else:
                meta["recompute"] = before


@contextlib.contextmanager
def outside_selective_checkpoint():
    """A context without selective activation checkpointing's dispatch modes (``context_fn``), which cache the outputs
    of the ops a policy saves in the forward and hand them back, in order, to the recomputation: the ops run here
    are recomputed whatever the policy says. For a BatchRenorm step in a checkpointed region (its records and its
    update of the running statistics run in the forward only; its in-place per-channel arithmetic would mutate a
    cached output) and for :func:`kept_for_backward`'s copies."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    with contextlib.ExitStack() as stack:
        while isinstance(_get_current_dispatch_mode(), (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
            stack.enter_context(_pop_mode_temporarily())
        yield


_MISSING = object()


def _copy(v: Tensor) -> Tensor:
    """A copy of ``v`` that survives inductor's joint-graph passes: they drop ``clone`` (a no-op to them) and with it
    the ``MUST_SAVE`` mark, and the backward then read the buffer after its update. ``v * 1`` is exact for every
    floating-point value (signed zeros, infinities and NaN included) and is not one of their no-ops."""
    return v.mul(1) if v.is_floating_point() else v.clone()


_LIBRARY.impl("kept_copy", _kept_copy, "CompositeImplicitAutograd")


def clip(t: Tensor, limit: float | Tensor, inverse: bool, in_place: bool = True) -> Tensor:
    """``t`` clipped (in place for a number limit unless ``in_place=False``: vmap has no batching rule for
    ``clamp_``) to ``[1/limit, limit]`` (``inverse``) or ``[-limit, limit]``."""
    if isinstance(limit, Tensor):  # a 0-dim limit: clamp casts it to t's dtype itself, as ``.to`` would ...
        if torch._C._are_functorch_transforms_active():  # ... but vmap promotes t to a batched limit's dtype
            limit = limit.to(t)
        return torch.clamp(t, limit.to(t).reciprocal() if inverse else -limit, limit)
    if not in_place:
        return torch.clamp(t, 1.0 / limit if inverse else -limit, limit)
    return t.clamp_(1.0 / limit if inverse else -limit, limit)


# ------------------------------------------------------------------------------------------ running statistics
def stats_value(t: Tensor, buffer: Tensor, where: str) -> Tensor:
    """``t`` (detached statistics) at the functorch level of the running ``buffer`` it will be written into: the
    grad wrappers of ``torch.func.grad`` are peeled (it then updates the buffers it captures, as torch's
    InstanceNorm does). Under ``vmap`` of a plain buffer the statistics differ per mapped sample, so no single
    update exists: an error, as torch's BatchNorm/InstanceNorm give (buffers batched by ensembling are updated)."""
    ft = torch._C._functorch
    if torch.compiler.is_compiling():
        return t
    floor = ft.maybe_get_level(buffer) if ft.is_functorch_wrapped_tensor(buffer) else -1
    while ft.is_functorch_wrapped_tensor(t) and ft.maybe_get_level(t) > floor:
        if ft.is_batchedtensor(t):
            raise RuntimeError(
                f"{where}: under torch.func.vmap a training step would update running_mean/running_var from "
                "per-sample batches; call .eval() (running statistics) or disable the running statistics"
            )
        if not ft.is_gradtrackingtensor(t):
            break
        t = ft.get_unwrapped(t)
    return t


def all_finite(a: Tensor, b: Tensor) -> Tensor:
    """Whether every value of ``a`` and ``b`` (the same number of elements and dtype) is finite, as a 0-dim bool
    tensor without a host read: ``a . (b * 0) == 0``, since ``x * 0`` is 0 for a finite x and NaN for inf or NaN, and
    a NaN term makes the sum NaN. Three ops (``isfinite`` over both takes six). For detached statistics (the layers
    call it in their no-grad update step: a nested ``no_grad`` would cost more than the ops)."""
    return torch.dot(a.flatten(), b.flatten().mul(0)).eq(0)


def writes_in_place() -> bool:
    """Eager outside torch.func transforms: results are written straight into the buffers (``out=``, ``add_``),
    one op per buffer; torch.compile and the transforms take :func:`write_buffer`."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


def guarded_update(buffers: Sequence[Tensor], values: Sequence[Tensor], finite: Tensor, kept=None) -> None:
    """``buffer <- value`` where ``finite`` (a 0-dim bool tensor) holds, else ``kept`` (default: the buffer itself,
    unchanged): the non-finite policy's tensor ops (no host synchronisation or data-dependent branch, so eager,
    torch.compile and torch.export protect the buffers alike, on every device). Call it under ``torch.no_grad()``
    (the layers' update steps run there)."""
    kept = buffers if kept is None else kept
    in_place = writes_in_place()
    for buf, new, old in zip(buffers, values, kept):
        if in_place:
            torch.where(finite, new.to(buf.dtype), old, out=buf)
        else:
            write_buffer(buf, torch.where(finite, new.to(buf.dtype), old))


def count_into(counter: Tensor, flag: Tensor) -> None:
    """``counter += flag`` (an integer buffer and a 0-dim bool tensor, which never requires grad; tensor ops, no host
    read)."""
    if writes_in_place():
        counter.add_(flag)
    else:
        write_buffer(counter, counter + flag.to(counter.dtype))


@torch.no_grad()
def write_buffer(buf: Tensor, new: Tensor) -> None:
    """``buf <- new`` in place (also from inside torch.func transforms, see :func:`_outside_transforms`)."""
    with _outside_transforms(buf, new):
        buf.copy_(new)


def static_numel(x: Tensor, start: int = 0, end: int | None = None) -> int:
    """The number of elements of ``x.shape[start:end]`` as a Python int. ``torch.Size.numel`` is computed from the
    static sizes, so torch.jit.trace (where ``x.shape[i]`` and ``x.numel()`` are traced tensors) gives an int and
    no TracerWarning for a shape check."""
    return x.shape[start:end].numel()


def _outside_transforms(buf: Tensor, new: Tensor):
    """A context without torch.func's transforms for writing a plain value into a plain buffer (torch.func.grad
    refuses writes to captured tensors), else a no-op."""
    ft = torch._C._functorch
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return contextlib.nullcontext()
    if ft.is_functorch_wrapped_tensor(buf) or ft.is_batchedtensor(new):  # batched buffers (ensembling): vmap writes
        return contextlib.nullcontext()
    return torch._C._DisableFuncTorch()
