"""What an activation-checkpoint recomputation of a BatchRenorm training forward needs: that forward's prior.

A BatchRenorm training output depends on the layer's state: r and d come from the running statistics before the
batch and from the limits at ``num_batches_tracked``, both of which the forward then advances. ``torch.utils
.checkpoint`` runs a region's forward again inside the backward pass (non-reentrant: in the unpack hook of a saved
tensor, possibly stopping early; reentrant: in ``CheckpointFunction.backward``), so the recomputation must know
which genuine forward it repeats, use that forward's prior and limits, and update nothing.

**The key: the region and the call's position in it.** Every checkpointed region is an object that lives as long as
its part of the autograd graph: a non-reentrant region is ``torch.utils.checkpoint``'s frame (the ``new_frame`` its
``checkpoint`` call holds while the forward runs, the ``frame`` of the unpack hook that recomputes it), a reentrant
region is its autograd node (the ``ctx`` of ``CheckpointFunction.forward`` and of its ``backward``; any
``autograd.Function`` that runs a forward in its ``forward`` and again in its ``backward``, as DeepSpeed's and
Megatron's checkpoints do, is recognized the same way). A recomputation replays its region in the order of the
genuine forward (torch requires it: the same saved tensors in the same order), so the k-th call of a layer while a
region is recomputed repeats the k-th call of that layer in the region's forward. :func:`checkpoint_region` finds
the regions on the Python call stack; a genuine forward keeps its record (the prior, a copy of the running
statistics, and the limits) under every region it runs in (nested checkpoints: the outer region's recomputation
runs the inner region's layers), and a recomputation takes the record at its position in the region it recomputes.
This is exact whatever the input values (equal inputs in several regions, nondeterministic kernels, a non-finite
batch), with no limit on the number of forwards before a backward; the records die with their region (after its
backward, or when its graph is freed). No device value is read: the position is a host count.

Why not the input's values: a layer can see equal values in several forwards before their backward (a batch fed
twice, R-Drop, a siamese pair, a constant border wherever a sample of values looks), and nothing in the values tells
which of them a recomputation repeats; a key made of them also has to live in a table of some size.

Records hang on the layer's ``running_mean`` buffer (a weak key): ``.to()``, ``deepcopy`` and pickling start
without them, and a ``torch.fx`` graph sharing the buffers shares them.

A recomputation that finds no record (a layer called more often in the recomputation than in the forward, a
training forward run inside a backward pass for another reason) renormalizes against the current running statistics,
updates nothing and is counted; :func:`report_misses` turns the count into a ``RuntimeWarning`` (``.eval()`` and
:func:`normlab.nn.skipped_batches` call it).

Under torch.compile the partitioner, not this module, decides what a compiled backward recomputes (see
``normlab._dispatch.kept_for_backward``); a module compiled on its own and run inside an eager checkpoint region
is the one case where a compiled step is recomputed by torch.utils.checkpoint: :func:`eager_checkpoint_active`
tells the layer, while torch.compile traces it, to run its step outside the compiled graph there.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.utils.weak import WeakIdKeyDictionary

from .._dispatch import outside_selective_checkpoint

__all__ = ["Region", "checkpoint_region", "eager_checkpoint_active", "recorded_step", "report_misses"]

_TABLES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # running_mean buffer -> _Records (dies with the buffer)


class Region(NamedTuple):
    """Where a training forward runs: ``replay`` is ``(region, run)`` when it is part of a recomputation of
    ``region`` (``run`` tells the recomputations of one region apart: torch's graph task), else None; ``genuine``
    holds the checkpointed regions whose forward it is part of (inside a recomputation: the regions the
    recomputation opens again, nested in it)."""

    replay: tuple | None
    genuine: tuple


@functools.cache
def _torch_codes() -> tuple[types.CodeType, frozenset, types.CodeType]:
    """The code objects of torch.utils.checkpoint that mark a region on the call stack: ``checkpoint`` (its local
    ``gen`` holds the non-reentrant frame), the unpack hooks of ``_checkpoint_hook`` (their ``frame`` is recomputed)
    and its pack hook (the innermost region when torch's composable ``checkpoint(module)`` runs it from hooks)."""
    from torch.utils import checkpoint as ckpt

    nested = [c for c in ckpt._checkpoint_hook.__init__.__code__.co_consts if isinstance(c, types.CodeType)]
    unpack = frozenset(c for c in nested if c.co_name == "unpack_hook")
    (pack,) = (c for c in nested if c.co_name == "pack_hook")
    return inspect.unwrap(ckpt.checkpoint).__code__, unpack, pack


def _function_ctx(frame, code) -> BackwardCFunction | None:
    """The autograd node of an ``autograd.Function``'s ``forward(ctx, ...)`` or ``backward(ctx, ...)`` frame."""
    if code.co_name not in ("forward", "backward") or code.co_varnames[:1] != ("ctx",):
        return None
    ctx = frame.f_locals.get("ctx")
    return ctx if isinstance(ctx, BackwardCFunction) else None


def _walk(frame) -> Region:
    """The regions on the call stack from ``frame`` outwards, up to the innermost recomputation."""
    run_code, unpack_codes, pack_code = _torch_codes()
    genuine = []
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__code__", None) is pack_code:  # the innermost non-reentrant region
        genuine.append(hooks[0].__closure__[pack_code.co_freevars.index("frame")].cell_contents)
    while frame is not None:
        code = frame.f_code
        if code in unpack_codes:
            local = frame.f_locals
            return Region((local["frame"], local["gid"]), tuple(genuine))
        if code is run_code:
            gen = frame.f_locals.get("gen")
            new = gen.gi_frame.f_locals.get("new_frame") if isinstance(gen, types.GeneratorType) else None
            if new is not None and new not in genuine:
                genuine.append(new)
        else:
            ctx = _function_ctx(frame, code)
            if ctx is not None and code.co_name == "backward":
                return Region((ctx, torch._C._current_graph_task_id()), tuple(genuine))
            if ctx is not None:
                genuine.append(ctx)
        frame = frame.f_back
    return Region(None, tuple(genuine))


def checkpoint_region() -> Region | None:
    """None for a plain training forward (the common case: three C calls), else the :class:`Region` it runs in. A
    forward may be in a checkpointed region when grad is disabled (a reentrant checkpoint's forward), a saved-tensor
    hook is active (a non-reentrant checkpoint's forward or recomputation) or a backward pass runs (a
    recomputation); then the call stack tells. A forward inside a backward pass in no recognized recomputation gets
    ``replay=(None, None)`` (it finds no record). Never under torch.compile, torch.jit.trace, torch.func transforms
    or inference mode (no records there)."""
    if torch.compiler.is_compiling():
        return None
    gid = torch._C._current_graph_task_id()
    if gid == -1 and torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
        return None
    if torch.jit.is_tracing() or torch._C._are_functorch_transforms_active() or torch.is_inference_mode_enabled():
        return None
    region = _walk(sys._getframe(1))
    if region.replay is None and gid != -1:
        return Region((None, None), region.genuine)
    if region.replay is None and not region.genuine:
        return None
    return region


@torch.compiler.assume_constant_result
def eager_checkpoint_active() -> bool:
    """Whether the caller runs inside an eager ``torch.utils.checkpoint`` region (or its recomputation), read while
    torch.compile traces (the real call stack below the traced frame) and kept in the graph as a constant."""
    region = _walk(sys._getframe(1))
    return region.replay is not None or bool(region.genuine)


class _Records:
    """One layer's records: per region, the records of the layer's calls in its genuine forward (in call order); per
    region and recomputation, the calls replayed so far; the misses, and the count last reported."""

    def __init__(self) -> None:
        self.genuine: WeakIdKeyDictionary = WeakIdKeyDictionary()  # region -> [(prior, limits), ...]
        self.replayed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # region -> {run: calls so far}
        self.misses = 0
        self.reported = 0


def _keep(running: tuple[Tensor, Tensor], limits: tuple) -> tuple[tuple, tuple]:
    """A record: a copy of the running statistics and of tensor limits (outside a selective-checkpoint policy's
    caches, so that a genuine forward and its recomputation show the policy the same ops)."""
    with torch.no_grad(), outside_selective_checkpoint():
        return tuple(v.clone() for v in running), tuple(v.clone() if isinstance(v, Tensor) else v for v in limits)


def recorded_step(running: tuple[Tensor, Tensor], limits: tuple, region: Region):
    """``(prior, limits, replayed)`` of a training forward in a checkpointed ``region``: for a recomputation the
    prior (running mean and variance) and limits of the genuine forward at its position, and ``replayed=True``
    (nothing may be updated; a recomputation without a record takes ``running`` and ``limits``); for a genuine
    forward ``running`` and ``limits`` themselves, recorded under each region it runs in."""
    records = _TABLES.get(running[0])
    if records is None:
        records = _TABLES[running[0]] = _Records()
    found = None if region.replay is None else _find(records, *region.replay)
    record = found if found is not None or not region.genuine else _keep(running, limits)
    for opened in region.genuine:  # every region this call is part of (nested ones: the outer region too)
        records.genuine.setdefault(opened, []).append(record)
    if found is None:
        return running, limits, region.replay is not None
    return *found, True


def _find(records: _Records, target, run):
    """The record at a recomputation's position in the region ``target`` recomputes (its k-th call of the layer in
    this run repeats the k-th call of the genuine forward), or None: a miss, counted."""
    rows, k = None, 0
    if target is not None:
        rows = records.genuine.get(target)
        calls = records.replayed.setdefault(target, {})
        k = calls[run] = calls.get(run, -1) + 1
    if rows is None or k >= len(rows):
        records.misses += 1
        return None
    return rows[k]


def report_misses(running_mean: Tensor | None, where: str) -> None:
    """Warn (one ``RuntimeWarning``) about the recomputations of the layer with this running mean that found no
    record since the last report."""
    records = None if running_mean is None else _TABLES.get(running_mean)
    if records is None:
        return
    count = records.misses
    if count > records.reported:
        warnings.warn(
            f"{where}: {count - records.reported} activation-checkpoint recomputation(s) found no record of the "
            "training forward they repeat (the layer called more often in the recomputation than in the forward, or "
            "a training forward run inside a backward pass): they renormalized against the running statistics of "
            "that moment and updated nothing",
            RuntimeWarning,
            stacklevel=4,
        )
    records.reported = count
