"""Weight-standardized convolutions: :class:`WSConv1d`/``2d``/``3d`` and :class:`PWSConv1d`/``2d``/``3d``.

Each class is the ``nn.Conv{1,2,3}d`` it stands beside, with the same constructor arguments and state, that hands
a standardized kernel to the parent's ``_conv_forward``. The logic lives once in a private base shared by both
families (forward, input checks, inference cache) and in one private base per family (the kernel); the six public
classes only name the dimension. ``isinstance`` tests: :data:`WS_CONV_TYPES`, :data:`PWS_CONV_TYPES`. Design
notes (the inference cache, ``init_alpha``): ``docs/design.md``.
"""

from __future__ import annotations

import math
from string import Template

import torch
import torch.distributed as dist
from torch import Tensor, nn

from normlab._checks import check_number
from normlab.functional import pws_weight, standardize_weight

from .._dispatch import forward_ad_active, fx_node, fx_tracing, layer_step, recomputing
from ._docs import fill
from ._non_finite import FiniteState

__all__ = [
    "WSConv1d",
    "WSConv2d",
    "WSConv3d",
    "PWSConv1d",
    "PWSConv2d",
    "PWSConv3d",
    "WS_CONV_TYPES",
    "PWS_CONV_TYPES",
    "WEIGHT_CACHE_MODES",
]

#: The values of the PWS convolutions' ``fan_mode``: the fan ``n`` of the He gain.
FAN_MODES = ("fan_in", "fan_out")
#: The values of ``weight_cache``, the eval-mode kernel cache of the WS and PWS convolutions.
WEIGHT_CACHE_MODES = ("auto", "verified", "identity", "off")


def _check_positive(where: str, name: str, value) -> float:
    return float(check_number(where, name, value, low=0, low_open=True))


def _check_cache_mode(where: str, mode: str) -> str:
    if mode not in WEIGHT_CACHE_MODES:
        raise ValueError(f"{where}: weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}, got {mode!r}")
    return mode


def _tensor_key(t: Tensor) -> tuple:
    return (t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape), t.stride())


def _capturing_graph() -> bool:
    """True while a graph is being captured (jit.trace/script, torch.compile, torch.fx): captured graphs must
    recompute the kernel."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.jit.is_scripting() or fx_tracing()


# torch.fx.symbolic_trace records these calls as one node each (their checks read shapes, which Proxies lack).
torch.fx.wrap("standardize_weight")
torch.fx.wrap("pws_weight")
torch.fx.wrap("_checked_input")
torch.fx.wrap("_init_alpha_from")
torch.fx.wrap("layer_step")  # PWS's alpha init below the root: one node that runs it in the layer's mode then


def _checked_input(input: Tensor, in_channels: int, dims: int, name: str) -> Tensor:
    """``input`` itself, once its ndim and channels are checked (one torch.fx node)."""
    if input.dim() not in (dims + 1, dims + 2):
        raise ValueError(
            f"{name}: expected {dims + 2}D input (N, C, *spatial) or {dims + 1}D unbatched input, got {input.dim()}D"
        )
    channels = input.shape[-dims - 1]
    if channels != in_channels:
        raise ValueError(f"{name}: expected input with {in_channels} channels, got {channels}")
    return input


@torch.no_grad()
def _init_alpha_from(y: Tensor, input: Tensor, alpha: Tensor, alpha_initialized: Tensor, write: bool = True) -> None:
    """Set every alpha to sqrt(2 / Var(y)) (unbiased, ``y = conv(x, W_hat(alpha=1))`` without bias, pooled over the
    ranks) and mark ``alpha_initialized``, unless the layer is initialised already or the batch cannot define it
    (fewer than 2 outputs, a non-finite variance, or a degenerate one: at most 1e-8 of the input's E[x^2], e.g. an
    all-zero or constant batch); then alpha and the flag stay as they are and the next batch initialises alpha. Tensor
    ops only (no data-dependent branch). ``write=False``: the same operations without the two writes (a layer known
    to be initialised, see ``_PWSConvNd._before_forward``)."""
    y, x_sq = y.detach().double(), input.detach().double().square()
    stats = torch.stack(
        [y.sum(), y.square().sum(), y.new_tensor(float(y.numel())), x_sq.sum(), y.new_tensor(float(x_sq.numel()))]
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    total, total_sq, count, input_sq, input_count = stats
    var = (total_sq - total.square() / count.clamp_min(1)) / (count - 1).clamp_min(1)
    scale = input_sq / input_count.clamp_min(1)  # E[x^2]: Var(y) is about 2 E[x^2] for a non-degenerate batch
    valid = (count >= 2) & torch.isfinite(var) & (var > 0) & (var > 1e-8 * scale)
    new = torch.sqrt(2.0 / torch.where(valid, var, torch.ones_like(var))).to(alpha.dtype)
    valid = valid & ~alpha_initialized  # an initialised alpha is never overwritten
    if write:
        alpha.copy_(torch.where(valid, new, alpha))
        alpha_initialized.copy_(alpha_initialized | valid)


# The docstrings of the public classes: one text per family, filled in per dimension ($conv, $input, $output,
# $example); the convolution arguments, the same in both families, are written once.
_CONV_ARGS = """in_channels: C_in, the number of channels of the input.
        out_channels: C_out, the number of filters (channels of the output).
        kernel_size: the size of the kernel (int or tuple).
        stride: the stride of the convolution (int or tuple). Default: 1.
        padding: padding added to all sides of the input: int, tuple, ``"valid"`` or ``"same"``. Default: 0.
        dilation: spacing between kernel elements (int or tuple). Default: 1.
        groups: number of blocked connections from input to output channels. Default: 1.
        bias: learn a bias (C_out,). Default: True.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"``. Default: ``"zeros"``.
        device: the device of the parameters. Default: None (torch's default device).
        dtype: the dtype of the parameters. Default: None (torch's default dtype)."""
_CACHE_ARG = """weight_cache: the eval-mode kernel cache (keyword-only): ``"auto"`` (``"verified"`` on CPU, ``"off"``
            elsewhere), ``"verified"`` (reused while the parameters are unchanged, compared by value),
            ``"identity"`` (reused while the parameter tensors and their versions are unchanged) or ``"off"``
            (recomputed every forward). Training, autograd and graph capture always recompute it. Default:
            ``"auto"``."""
_SHAPE = """Shape:
        - Input: $input
        - Output: $output, with the output sizes of ``$conv``."""

_WS_DOC = Template(r"""Weight Standardization (Qiao et al. 2019): a ``$conv`` whose filters are standardized on the fly.

    .. math::
        \hat W_o = \frac{W_o - \mathrm{mean}(W_o)}{\sqrt{\mathrm{var}(W_o) + \epsilon}}, \qquad
        y = \mathrm{conv}(x, \hat W) + b

    with the biased variance over all entries of filter o. Gradients flow through the mean and the variance.
    WS keeps unit variance per kernel entry (``n Var[W_hat] = n``): use it with an output normalization (GN). The
    constructor arguments, ``weight`` and ``bias`` (and their initialisation) are ``$conv``'s;
    :func:`normlab.convert.fold_for_inference` turns the layer into a plain ``$conv``.

    Args:
        $conv_args
        eps: added to the filter variance inside the square root (keyword-only, > 0). Default: 1e-5.
        $cache_arg

    $shape

    Example:
$example
    """)

_PWS_DOC = Template(r"""Parametric Weight Standardization (Liu et al. 2021): a ``$conv`` with a standardized kernel.

    Each filter is standardized, then scaled by the He gain and by a learned per-filter gain ``alpha``:

    .. math::
        \hat W_o = \sqrt{2/n}\;\alpha_o\,\frac{W_o - \mathrm{mean}(W_o)}{\sqrt{\mathrm{var}(W_o) + g}}, \qquad
        y = \mathrm{conv}(x, \hat W) + b

    with the biased variance over the filter, ``n`` the fan (``fan_in = C_in/groups * prod(kernel_size)`` by
    default) and ``g = gamma`` (absolute) or ``g = gamma * 2/n`` (``relative_gamma``). Mean and variance are
    differentiated through, so the gradient reaching ``weight`` has zero mean per filter. In eval mode the kernel
    is constant: :func:`normlab.convert.fold_for_inference` turns the layer into a plain ``$conv``.

    Learnable parameters: ``weight`` (C_out, C_in/groups, *kernel_size), initialised N(0, 2/n); ``bias``
    (C_out,), zeros; ``alpha`` (C_out,), ones (no weight decay in :func:`normlab.nn.param_groups`). Buffer:
    ``alpha_initialized``.

    Args:
        $conv_args
        gamma: added to the filter variance inside the square root (keyword-only, > 0). Default: 1e-3.
        relative_gamma: use ``g = gamma * 2/n`` (the authors' "equiv" mode; keyword-only). Default: False.
        fan_mode: ``"fan_in"`` or ``"fan_out"`` (``C_out/groups * prod(kernel_size)``): the ``n`` above
            (keyword-only). Default: ``"fan_in"``.
        init_alpha: at the first training forward, set every alpha to ``sqrt(2 / Var(conv(x, W_hat(alpha=1))))``
            (unbiased variance of the batch's outputs without bias, pooled over ranks), as the authors'
            ``initalpha``; a loaded ``alpha`` is never overwritten (buffer ``alpha_initialized``; keyword-only).
            Default: False.
        $cache_arg

    $shape

    Example:
$example
    """)


def _doc(template: Template, example: str, **fields: str) -> str:
    """A family's docstring for one dimension: the shared blocks, the fields and the example put in."""
    shape = Template(_SHAPE).substitute(fields)
    return fill(template, example, shape=shape, conv_args=_CONV_ARGS, cache_arg=_CACHE_ARG, **fields)


class _StdConvNd(FiniteState):
    """Forward, input checks and inference kernel cache shared by the WS and PWS convolutions.

    Subclasses (placed before ``nn.Conv{d}d`` in the bases) define ``_compute_weight(*tensors)`` (the kernel from
    the parameters it depends on, with autograd), ``_cache_tensors()`` (those parameters, read once: ``weight`` may
    be a parametrization, which runs at every read) and ``_cache_params()`` (the hyper-parameters it depends on).
    A loaded non-finite ``weight``, ``bias`` or ``alpha`` is named at load (``FiniteState``).
    """

    _weight_cache: tuple | None = None  # (key, reference copies, kernel, kernel version); set per instance
    weight_cache: str = "auto"

    def effective_weight(self) -> Tensor:
        """The kernel the convolution applies (what ``forward`` hands to ``F.conv1d/2d/3d``), in ``weight``'s dtype:
        (C_out, C_in/groups, *kernel_size).

        Computed with autograd whenever training or a gradient is needed; otherwise from the inference cache.
        """
        return self._kernel(self._cache_tensors())

    def _kernel(self, tensors: tuple[Tensor, ...]) -> Tensor:
        """The kernel from ``tensors`` (the parameters as read once by the caller): recomputed in training, under
        graph capture (jit, compile, fx), forward-mode AD, when a gradient is needed, for a parametrized or
        hook-computed ``weight`` (a new tensor at every read) and with ``weight_cache="off"``; else the cached one."""
        if _capturing_graph() or forward_ad_active():
            return self._compute_weight(*tensors)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):  # (before self.training: the output
            return self._compute_weight(*tensors)  # is the same in both modes, as nn.Conv2d's, which never reads it)
        mode = self.weight_cache
        if mode == "auto":
            mode = "verified" if tensors[0].device.type == "cpu" else "off"
        if self.training or mode == "off" or not self._registered(tensors):
            return self._compute_weight(*tensors)
        return self._cached_weight(tensors, verify=mode == "verified")

    def _registered(self, tensors: tuple[Tensor, ...]) -> bool:
        """Whether ``tensors`` are this layer's own registered parameters (what the cache keys on); not so for a
        parametrized ``weight`` or one set by a hook (``torch.nn.utils.spectral_norm``): each read makes a new
        tensor, whose address a later one may reuse."""
        return all(any(t is p for p in self._parameters.values()) for t in tensors)

    def _cache_key(self, tensors: tuple[Tensor, ...]) -> tuple | None:
        if any(t.is_inference() for t in tensors):  # parameters created under inference_mode have no versions
            return None
        try:
            return tuple(_tensor_key(t) for t in tensors), self._cache_params()
        except RuntimeError:  # tensors without storage (torch.func transforms such as vmap)
            return None

    def _cache_hit(self, key: tuple, tensors: tuple[Tensor, ...], verify: bool) -> Tensor | None:
        if self._weight_cache is None:
            return None
        old_key, refs, kernel, kernel_version = self._weight_cache
        if old_key != key or kernel._version != kernel_version:
            return None
        if verify and not (len(refs) == len(tensors) and all(map(torch.equal, refs, tensors))):
            return None  # an edit through .data keeps data_ptr and _version: only the values show it
        return kernel

    def _cached_weight(self, tensors: tuple[Tensor, ...], verify: bool = True) -> Tensor:
        """The cached kernel if the parameters are unchanged (and, with ``verify``, equal by value), else a new one."""
        key = self._cache_key(tensors)
        if key is None:
            return self._compute_weight(*tensors)
        kernel = self._cache_hit(key, tensors, verify)
        if kernel is not None:
            return kernel
        with torch.inference_mode(False), torch.no_grad():  # normal tensors (with versions) even in inference_mode
            kernel = self._compute_weight(*tensors).detach()
            refs = tuple(t.detach().clone() for t in tensors) if verify else ()
        self._weight_cache = (key, refs, kernel, kernel._version)
        return kernel

    def clear_weight_cache(self) -> None:
        """Drop the inference cache (never needed for correctness; frees its memory)."""
        self._weight_cache = None

    def _apply(self, fn, *args, **kwargs):  # .to(), .double(), .half(), .cuda(): the cache is dropped
        self._weight_cache = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # torch.save(module), pickle, deepcopy: the cache is dropped
        state = super().__getstate__().copy()
        state["_weight_cache"] = None
        return state

    def forward(self, input: Tensor) -> Tensor:
        """input (N, C_in, *spatial) or (C_in, *spatial) -> (N, C_out, *spatial') or (C_out, *spatial'). The
        parameters are read once (a parametrization of ``weight`` runs once per forward, as in ``nn.Conv2d``)."""
        input = _checked_input(input, self.in_channels, len(self.kernel_size), type(self).__name__)
        tensors = self._cache_tensors()
        input = self._before_forward(input, tensors)
        return self._conv_forward(input, self._kernel(tensors), self.bias)

    def _before_forward(self, input: Tensor, tensors: tuple[Tensor, ...]) -> Tensor:
        """A step before the convolution (PWS: the init of alpha); returns ``input``."""
        return input


class _WSConvNd(_StdConvNd):
    """The WS kernel and arguments of :class:`WSConv1d`/``2d``/``3d`` (docstring: ``_WS_DOC``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        eps: float = 1e-5,
        weight_cache: str = "auto",
    ) -> None:
        where = type(self).__name__
        self.weight_cache = _check_cache_mode(where, weight_cache)
        self.eps = _check_positive(where, "eps", eps)
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, device, dtype
        )

    def _compute_weight(self, weight: Tensor | None = None) -> Tensor:
        return standardize_weight(self.weight if weight is None else weight, self.eps)

    def _cache_tensors(self) -> tuple[Tensor, ...]:
        return (self.weight,)

    def _cache_params(self) -> tuple:
        return (self.eps,)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps}"


class _PWSConvNd(_StdConvNd):
    """The PWS kernel, ``alpha`` and arguments of :class:`PWSConv1d`/``2d``/``3d`` (docstring: ``_PWS_DOC``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        gamma: float = 1e-3,
        relative_gamma: bool = False,
        fan_mode: str = "fan_in",
        init_alpha: bool = False,
        weight_cache: str = "auto",
    ) -> None:
        where = type(self).__name__
        self.weight_cache = _check_cache_mode(where, weight_cache)
        self.gamma = _check_positive(where, "gamma", gamma)
        if fan_mode not in FAN_MODES:
            raise ValueError(f"{where}: fan_mode must be one of {', '.join(FAN_MODES)}, got {fan_mode!r}")
        self.relative_gamma = bool(relative_gamma)
        self.fan_mode = fan_mode
        self.init_alpha = bool(init_alpha)
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, device, dtype
        )
        per_filter = self.in_channels if fan_mode == "fan_in" else self.out_channels
        self.fan = per_filter // self.groups * math.prod(self.kernel_size)
        self.alpha = nn.Parameter(torch.ones(self.out_channels, device=device, dtype=dtype))
        self.register_buffer("alpha_initialized", torch.tensor(not self.init_alpha, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Raw weight ~ N(0, 2/n) (Kaiming normal, ReLU gain), bias 0, alpha 1; the data-dependent init re-armed."""
        if "alpha" not in self._parameters:  # nn.ConvNd.__init__ calls this before alpha exists
            return
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / self.fan))
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        nn.init.ones_(self.alpha)
        self.alpha_initialized.fill_(not self.init_alpha)
        self._alpha_done = False
        self._weight_cache = None

    def _compute_weight(self, weight: Tensor | None = None, alpha: Tensor | None = None) -> Tensor:
        weight, alpha = (self.weight, self.alpha) if weight is None else (weight, alpha)
        return pws_weight(weight, alpha, self.gamma, self.relative_gamma, fan=self.fan)

    def _cache_tensors(self) -> tuple[Tensor, ...]:
        return (self.weight, self.alpha)

    def _cache_params(self) -> tuple:
        return (self.gamma, self.relative_gamma, self.fan)

    def _before_forward(self, input: Tensor, tensors: tuple[Tensor, ...]) -> Tensor:
        """The data-dependent init of alpha while it is pending (``tensors``: the parameters as the forward read
        them, ``weight`` once); returns ``input``. torch.fx records it as one node, ``layer_step(layer, input,
        weight)``, whose output the convolution takes (so that no dead-code pass drops it) and which runs the init in
        the layer's mode when the graph runs; under graph capture (jit, compile) and torch.func it runs in tensor ops
        every training step until the Python flag is set (a no-op on an initialised layer); eagerly see
        :meth:`_eager_init_alpha`."""
        if fx_node(self, input) and self.init_alpha:
            return layer_step(self, input, tensors[0])
        if self.__dict__.get("_alpha_done") or not (self.init_alpha and self.training):
            return input
        if _capturing_graph() or torch._C._functorch.peek_interpreter_stack() is not None:
            self._data_init_alpha(input, tensors[0])  # tensor ops only: a no-op once initialised
        elif self.alpha_initialized.device.type != "meta":  # on meta, no data: the next real batch does it
            self._eager_init_alpha(input, tensors[0])
        return input

    def _forward_step(self, input: Tensor, weight: Tensor) -> Tensor:
        """The step a torch.fx graph runs (:func:`normlab._dispatch.layer_step`): the init of alpha, in the layer's
        mode when the graph runs; returns ``input``."""
        return self._before_forward(input, (weight,))

    def _eager_init_alpha(self, input: Tensor, weight: Tensor) -> None:
        """Whether the init is pending is read from the buffer ``alpha_initialized`` (one host read per training
        step) only until a read finds it done; from then on the Python flag ``_alpha_done`` answers and a training
        step reads nothing back. Loading a state or resetting the parameters re-arms the read. A checkpoint
        recomputation (``torch.utils.checkpoint``, inside a backward pass) of a forward that ran the init runs the
        init's operations again, reading and writing nothing: a selective-checkpoint policy that saves convolutions
        then finds the convolutions of the forward it repeats."""
        if recomputing():
            self._data_init_alpha(input, weight, write=False)
        elif bool(self.alpha_initialized):
            self._alpha_done = True
        else:
            self._data_init_alpha(input, weight)

    def _data_init_alpha(self, input: Tensor, weight: Tensor, write: bool = True) -> None:
        """Set every alpha to sqrt(2 / Var(y)), y = conv(x, W_hat(alpha=1)) without bias, unbiased variance (see
        :func:`_init_alpha_from`); ``weight`` as the forward read it. Detached: no autograd graph, also in a traced
        one. ``write=False``: the same operations, nothing written."""
        kernel = pws_weight(weight.detach(), None, self.gamma, self.relative_gamma, fan=self.fan)
        y = self._conv_forward(input.detach(), kernel, None)
        _init_alpha_from(y, input, self.alpha, self.alpha_initialized, write)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        flag = prefix + "alpha_initialized"
        if flag not in state_dict and prefix + "alpha" in state_dict:
            state_dict[flag] = torch.tensor(True)  # a checkpoint carrying alpha is never re-initialized
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._weight_cache = None
        self._alpha_done = False  # the loaded flag is read once, at the next training step

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", gamma={self.gamma}"
        if self.relative_gamma:
            s += ", relative_gamma=True"
        if self.fan_mode != "fan_in":
            s += f", fan_mode={self.fan_mode!r}"
        if self.init_alpha:
            s += ", init_alpha=True"
        return s


class WSConv1d(_WSConvNd, nn.Conv1d):
    __doc__ = _doc(
        _WS_DOC,
        conv="nn.Conv1d",
        input="(N, C_in, L_in) or (C_in, L_in)",
        output="(N, C_out, L_out) or (C_out, L_out)",
        example="""
>>> conv = WSConv1d(16, 32, 3, padding=1)
>>> conv(torch.randn(8, 16, 40)).shape
torch.Size([8, 32, 40])
""",
    )


class WSConv2d(_WSConvNd, nn.Conv2d):
    __doc__ = _doc(
        _WS_DOC,
        conv="nn.Conv2d",
        input="(N, C_in, H_in, W_in) or (C_in, H_in, W_in)",
        output="(N, C_out, H_out, W_out) or (C_out, H_out, W_out)",
        example="""
>>> model = nn.Sequential(WSConv2d(3, 64, 3, padding=1), nn.GroupNorm(32, 64), nn.ReLU())
>>> model(torch.randn(2, 3, 32, 32)).shape
torch.Size([2, 64, 32, 32])
""",
    )


class WSConv3d(_WSConvNd, nn.Conv3d):
    __doc__ = _doc(
        _WS_DOC,
        conv="nn.Conv3d",
        input="(N, C_in, D_in, H_in, W_in) or (C_in, D_in, H_in, W_in)",
        output="(N, C_out, D_out, H_out, W_out) or (C_out, D_out, H_out, W_out)",
        example="""
>>> WSConv3d(4, 8, 3)(torch.randn(2, 4, 6, 6, 6)).shape
torch.Size([2, 8, 4, 4, 4])
""",
    )


class PWSConv1d(_PWSConvNd, nn.Conv1d):
    __doc__ = _doc(
        _PWS_DOC,
        conv="nn.Conv1d",
        input="(N, C_in, L_in) or (C_in, L_in)",
        output="(N, C_out, L_out) or (C_out, L_out)",
        example="""
>>> conv = PWSConv1d(16, 32, 3, padding=1, gamma=1e-3)
>>> conv(torch.randn(8, 16, 40)).shape
torch.Size([8, 32, 40])
""",
    )


class PWSConv2d(_PWSConvNd, nn.Conv2d):
    __doc__ = _doc(
        _PWS_DOC,
        conv="nn.Conv2d",
        input="(N, C_in, H_in, W_in) or (C_in, H_in, W_in)",
        output="(N, C_out, H_out, W_out) or (C_out, H_out, W_out)",
        example="""
>>> model = nn.Sequential(PWSConv2d(3, 64, 3, padding=1), nn.ReLU(), PWSConv2d(64, 10, 1))
>>> model(torch.randn(2, 3, 32, 32)).shape
torch.Size([2, 10, 32, 32])
""",
    )


class PWSConv3d(_PWSConvNd, nn.Conv3d):
    __doc__ = _doc(
        _PWS_DOC,
        conv="nn.Conv3d",
        input="(N, C_in, D_in, H_in, W_in) or (C_in, D_in, H_in, W_in)",
        output="(N, C_out, D_out, H_out, W_out) or (C_out, D_out, H_out, W_out)",
        example="""
>>> PWSConv3d(4, 8, 3, padding=1)(torch.randn(2, 4, 6, 6, 6)).shape
torch.Size([2, 8, 6, 6, 6])
""",
    )


#: The Weight Standardization convolutions, for ``isinstance``: :class:`WSConv1d`, :class:`WSConv2d`,
#: :class:`WSConv3d` (and their subclasses).
WS_CONV_TYPES = (WSConv1d, WSConv2d, WSConv3d)
#: The Parametric Weight Standardization convolutions (the ones with a learnable ``alpha``), for ``isinstance``:
#: :class:`PWSConv1d`, :class:`PWSConv2d`, :class:`PWSConv3d` (and their subclasses).
PWS_CONV_TYPES = (PWSConv1d, PWSConv2d, PWSConv3d)
