"""Which conv feeds which BatchNorm: the dataflow :func:`normlab.convert.fold_for_inference` relies on (and
:func:`normlab.convert.convert_norm`: which BatchNorm a PWS conversion removes, which module feeds a BatchNorm1d).

A conv -> BN pair may be folded only when the BN's only input is that conv's output, the conv's output has no
other consumer, each of them runs once per forward and nothing else reads their parameters. Two ways to establish
it, the first that works:

* :func:`fx_flow`: ``torch.fx`` symbolic tracing with convs and norms as leaves (exact for every input, since a
  symbolic trace fails on data-dependent control flow);
* :func:`hook_flow`: one eval-mode forward on an example input, with module hooks on convs and norms and a
  ``TorchFunctionMode`` that sees every tensor operation between them (exact for the path this input takes).

Both return a :class:`Flow`; :meth:`Flow.verdict` says whether a pair folds, or why not. :func:`trace_flow` tries
``torch.fx``, then hooks on ``example_input`` or on default inputs of a few sizes; :func:`one_path` says when a hook
trace holds for one path only (its forward read tensor values). For the refusals of
:func:`normlab.convert.convert_norm`: :func:`seen_shapes` (the input shapes each norm sees on one forward),
:func:`fixed_shapes` (those that do not change with the input size) and :func:`input_producers` (a ``Linear`` or a
``Conv1d`` feeds it, by ``torch.fx``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from normlab._dispatch import layer_step
from normlab.convert.recognize import unique_modules

__all__ = [
    "Flow",
    "fx_flow",
    "hook_flow",
    "trace_flow",
    "eval_mode",
    "seen_shapes",
    "fixed_shapes",
    "input_producers",
    "one_path",
]

# tensor functions that read only metadata (shape, dtype, ...): not a use of the values
_METADATA = {
    "__get__",
    "size",
    "dim",
    "numel",
    "ndimension",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "element_size",
    "stride",
    "get_device",
    "__len__",
    "data_ptr",
    "nelement",
}

# tensor methods that hand a tensor's value to Python: the forward's path may depend on it
_VALUE_READS = {"__bool__", "item", "__int__", "__float__", "__index__", "__complex__", "tolist", "numpy"}


@dataclass
class Flow:
    """What one trace saw. Modules are keyed by ``id``.

    ``calls``: times each conv/norm ran; ``bn_inputs``: per norm call, the ``(conv id, call number)`` whose output
    was its only input, or None; ``uses``: how many consumers each conv call's output had; ``param_reads``: modules
    whose parameters or buffers were read outside their own call; ``value_reads``: the tensor methods that turned
    a tensor's value into a Python value outside conv/norm calls (a hook trace: where the forward's path may depend
    on the data); ``producers``: per norm whose first call's input is not a conv's output, what made that input
    (``torch.fx`` only: "a ReLU output", "the model's input", ...); ``how``: ``"torch.fx"`` or
    ``"hooks"``.
    """

    how: str
    calls: Counter = field(default_factory=Counter)
    bn_inputs: dict[int, list[tuple[int, int] | None]] = field(default_factory=dict)
    uses: Counter = field(default_factory=Counter)
    param_reads: set[int] = field(default_factory=set)
    value_reads: Counter = field(default_factory=Counter)
    producers: dict[int, str] = field(default_factory=dict)

    def source(self, bn: nn.Module) -> int | None:
        """The id of the conv whose output is ``bn``'s input in its first call, or None."""
        ins = self.bn_inputs.get(id(bn)) or [None]
        return ins[0][0] if ins[0] is not None else None

    def verdict(self, conv: nn.Module, bn: nn.Module) -> str | None:
        """None if ``bn`` may be folded into ``conv``, else why not (a short phrase)."""
        if self.calls[id(bn)] != 1:
            return f"the BatchNorm runs {self.calls[id(bn)]} times per forward"
        src = self.bn_inputs[id(bn)][0]
        if src is None or src[0] != id(conv):
            made_by = self.producers.get(id(bn))
            return f"its input is {made_by}, not the conv's output" if made_by else "its input is not the conv's output"
        if self.calls[id(conv)] != 1:
            return f"the conv runs {self.calls[id(conv)]} times per forward"
        if self.uses[src] != 1:
            return "the conv's output is also used elsewhere"
        if id(conv) in self.param_reads or id(bn) in self.param_reads:
            return "their parameters are read outside the modules"
        return None


def one_path(flow: Flow | None, why: str, given: bool) -> str | None:
    """When ``flow`` holds for one path only: a hook trace whose forward turned tensor values into Python values
    (data-dependent control flow, which torch.fx cannot trace). Then the phrase that says so, else None."""
    if flow is None or flow.how != "hooks" or not flow.value_reads:
        return None
    reads = ", ".join(f"{name} x{n}" for name, n in sorted(flow.value_reads.items()))
    return (
        f"rest on the path {'example_input' if given else 'a default input'} took: the forward reads tensor values "
        f"({reads}), so its path may depend on the data, and the dataflow comes from hooks on that one forward ({why})"
    )


class _LeafTracer(torch.fx.Tracer):
    def __init__(self, leaves: set[int]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def _owner(model: nn.Module, target: str) -> list[nn.Module]:
    """Every module on the path of a ``get_attr`` target (``a.b.weight`` -> model.a, model.a.b)."""
    parts, out, m = target.split(".")[:-1], [], model
    for p in parts:
        m = getattr(m, p, None)
        if not isinstance(m, nn.Module):
            break
        out.append(m)
    return out


def fx_flow(model: nn.Module, convs: Iterable[nn.Module], norms: Iterable[nn.Module]) -> Flow:
    """The dataflow from a ``torch.fx`` symbolic trace (raises whatever tracing raises)."""
    conv_ids, norm_ids = {id(c) for c in convs}, {id(n) for n in norms}
    graph = _LeafTracer(conv_ids | norm_ids).trace(model)
    flow, call_no = Flow("torch.fx"), {}
    for node in graph.nodes:
        if node.op == "get_attr":
            flow.param_reads |= {id(m) for m in _owner(model, node.target)} & (conv_ids | norm_ids)
        if node.op != "call_module":
            continue
        mod = model.get_submodule(node.target)
        call_no[node] = (id(mod), flow.calls[id(mod)])
        flow.calls[id(mod)] += 1
        if id(mod) in conv_ids:
            flow.uses[call_no[node]] = len(node.users)
    for node in graph.nodes:
        if node.op == "call_module" and call_no[node][0] in norm_ids:
            arg = node.args[0] if len(node.args) == 1 and not node.kwargs else None
            src = call_no.get(arg) if isinstance(arg, torch.fx.Node) else None
            flow.bn_inputs.setdefault(call_no[node][0], []).append(src if src and src[0] in conv_ids else None)
            if not (src and src[0] in conv_ids) and isinstance(arg, torch.fx.Node):
                flow.producers.setdefault(call_no[node][0], _producer(model, arg))
    return flow


def _producer(model: nn.Module, node: torch.fx.Node) -> str:
    """What made the value of ``node``, in words that do not name the layer (a warning gives each reason once):
    "a ReLU output", "the output of add", "the model's input", ..."""
    if node.op == "placeholder":
        return "the model's input"
    if node.op == "call_module":
        return f"a {type(model.get_submodule(node.target)).__name__} output"
    if node.op == "get_attr":
        return "a tensor attribute of the model"
    if node.target is layer_step and node.args and getattr(node.args[0], "op", None) == "get_attr":
        return f"a {type(model.get_submodule(node.args[0].target)).__name__} output"  # a normlab layer's one node
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"the output of {name}"


class _Recorder(TorchFunctionMode):
    """Counts, outside conv/norm calls, every tensor operation that reads a conv's output."""

    def __init__(self, flow: Flow):
        super().__init__()
        self.flow, self.depth, self.made, self.keep = flow, 0, {}, []

    def consume(self, values) -> None:
        for t in tree_flatten(values)[0]:
            if isinstance(t, torch.Tensor) and id(t) in self.made:
                self.flow.uses[self.made[id(t)]] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.depth == 0 and name not in _METADATA:
            self.consume((args, kwargs))
            if name in _VALUE_READS:
                self.flow.value_reads[f"Tensor.{name}"] += 1
        return func(*args, **kwargs)

    def pre(self, m: nn.Module, args, kwargs) -> None:
        if self.depth == 0:
            self.consume((args, kwargs))
            if id(m) in self.flow.bn_inputs:
                single = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
                self.flow.bn_inputs[id(m)].append(self.made.get(id(args[0])) if single else None)
            self.flow.calls[id(m)] += 1
        self.depth += 1

    def post(self, m: nn.Module, args, kwargs, out) -> None:
        self.depth -= 1
        if self.depth == 0 and id(m) not in self.flow.bn_inputs and isinstance(out, torch.Tensor):
            self.made[id(out)] = (id(m), self.flow.calls[id(m)] - 1)
            self.keep.append(out)  # keeps ids unique while the trace runs


def hook_flow(
    model: nn.Module, convs: Iterable[nn.Module], norms: Iterable[nn.Module], x: torch.Tensor
) -> tuple[Flow, torch.Tensor]:
    """The dataflow of one forward of ``model`` on ``x`` (no_grad); returns it with the model's output."""
    flow = Flow("hooks")
    rec = _Recorder(flow)
    for n in norms:
        flow.bn_inputs[id(n)] = []
    handles = []
    for m in {id(m): m for m in [*convs, *norms]}.values():
        handles.append(m.register_forward_pre_hook(rec.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(rec.post, with_kwargs=True))
    try:
        with torch.no_grad(), rec:
            out = model(x)
            rec.consume(out)  # the model's output is a consumer too
    finally:
        for h in handles:
            h.remove()
    return flow, out


# sizes tried for a default example input, per spatial dimension (a model may accept only one)
_DEFAULT_SIZES = {1: (40, 64, 32, 128, 256), 2: (32, 28, 16, 64, 224), 3: (16, 32, 8)}


def _default_inputs(convs: list[nn.Module]):
    """Example inputs for the first conv (registration order): batch 2, a few sizes per spatial dimension."""
    first = convs[0]
    dim = first.weight.dim() - 2
    gen = torch.Generator().manual_seed(0)
    for size in _DEFAULT_SIZES.get(dim, ()):
        x = torch.randn(2, first.in_channels, *([size] * dim), generator=gen, dtype=first.weight.dtype)
        yield x.to(first.weight.device)


def trace_flow(model: nn.Module, convs, norms, example_input) -> tuple[Flow | None, Tensor | None, Tensor | None, str]:
    """(flow, input, output) of the first trace that works; input/output only for a hook trace on a default
    input (to check the result with); and what failed."""
    try:
        return fx_flow(model, convs, norms), None, None, ""
    except Exception as e:  # noqa: BLE001 - any failure of symbolic tracing means: try the hooks
        why = f"torch.fx: {type(e).__name__}"
    inputs = [example_input] if example_input is not None else _default_inputs(convs)
    last = "no input to try"
    for x in inputs:
        try:
            flow, out = hook_flow(model, convs, norms, x)
            return flow, (None if example_input is not None else x), out, why
        except Exception as e:  # noqa: BLE001 - the model refuses this input: try the next size
            last = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    given = "example_input" if example_input is not None else "a default input"
    return None, None, None, f"{why}; forward on {given} failed ({last})"


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Eval mode for a look at the dataflow (no running-statistics update); each module's mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def seen_shapes(model: nn.Module, norms: list[nn.Module], x) -> dict[int, list[torch.Size]]:
    """Input shape of every call of each norm on one eval-mode forward of ``x``."""
    seen: dict[int, list[torch.Size]] = {id(m): [] for m in norms}

    def record(m, args):
        if args and isinstance(args[0], Tensor):
            seen[id(m)].append(args[0].shape)

    handles = [m.register_forward_pre_hook(record) for m in norms]
    try:
        with torch.no_grad(), eval_mode(model):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def fixed_shapes(model: nn.Module, norms: list[nn.Module]) -> dict[int, list[torch.Size]]:
    """The input shapes of the norms whose input does not grow with the model's input (e.g. after global pooling).

    One eval-mode forward (:func:`seen_shapes`) on the first default input the model accepts (the sizes of
    :func:`trace_flow`, for its first conv) and one on an input twice as large per spatial dimension; a norm whose
    shapes agree at both sizes is fixed by the architecture. A model that accepts only the first size: every norm's
    shapes at that size. Empty when the model has no conv or accepts no default input.
    """
    convs = unique_modules(model, lambda m: isinstance(m, nn.modules.conv._ConvNd))
    if not convs or not norms:
        return {}
    for x in _default_inputs(convs):
        try:
            small = seen_shapes(model, norms, x)
        except Exception:  # noqa: BLE001 - the model refuses this size: try the next
            continue
        gen = torch.Generator().manual_seed(1)  # not the global generator: converting draws no user randomness
        large_x = torch.randn(*x.shape[:2], *(2 * s for s in x.shape[2:]), dtype=x.dtype, generator=gen)
        large_x = large_x.to(x.device)
        try:
            large = seen_shapes(model, norms, large_x)
        except Exception:  # noqa: BLE001 - it accepts one size only: that size's shapes are the ones it sees
            return small
        return {k: v for k, v in small.items() if v and v == large.get(k)}
    return {}


def input_producers(model: nn.Module, norms: list[nn.Module]) -> dict[int, str]:
    """norm id -> "conv1d" / "linear" when the torch.fx dataflow shows its only input is such a module's output."""
    kinds = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            kinds[id(m)] = "linear"
        elif isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)):
            kinds[id(m)] = "conv1d"
    mods = unique_modules(model, lambda m: id(m) in kinds)
    try:
        flow = fx_flow(model, mods, norms)
    except Exception:  # noqa: BLE001 - no symbolic trace: the producers stay unknown
        return {}
    out = {}
    for n in norms:
        srcs = flow.bn_inputs.get(id(n)) or [None]
        found = {kinds[s[0]] if s is not None else None for s in srcs}
        if len(found) == 1 and None not in found:
            out[id(n)] = found.pop()
    return out
