"""Weight-standardized convolutions: ``WSConv{1,2,3}d`` and ``PWSConv{1,2,3}d``.

Both are subclasses of ``nn.Conv{1,2,3}d`` that take every constructor argument of their parent (stride,
padding incl. ``'same'``/``'valid'``, dilation, groups, bias, padding_mode incl. reflect/replicate/circular,
tuple kernels, device, dtype). They only change the kernel handed to the parent's
``_conv_forward(input, weight, bias)``; :meth:`effective_weight` returns that kernel.

* WS (Qiao et al. 2019): ``W_hat_o = (W_o - mean(W_o)) / sqrt(var(W_o) + eps)``
  (:func:`normlab.functional.standardize_weight`).
* PWS (Liu et al., AAAI 2021, REFERENCE.md section 1):
  ``W_hat_o = sqrt(2/n) * alpha_o * (W_o - mean(W_o)) / sqrt(var(W_o) + g)``, ``n`` = fan (fan_in by default),
  ``g = gamma`` or ``gamma * 2/n`` (``relative_gamma``) (:func:`normlab.functional.pws_weight`).

Choices (documented deviations/precisions of REFERENCE.md):

* Raw PWS weight init: ``W ~ N(0, 2/n)`` with ``n`` the layer's fan, i.e. exactly
  ``nn.init.kaiming_normal_(W, mode="fan_in", nonlinearity="relu")`` for the default ``fan_mode="fan_in"``
  (the authors' ``pws_init``). ``fan_in = C_in/groups * prod(kernel)``; ``fan_out = C_out/groups * prod(kernel)``
  (the number of outputs one input value reaches; torch's own fan_out ignores ``groups``). The same ``n`` is used
  in the ``sqrt(2/n)`` scale and in the relative gamma. Note that the raw scale matters: with ``Var(W) = 2/n``
  and the absolute ``gamma=1e-3`` the kernel's norm is shrunk by ``sqrt(var/(var+gamma))`` (0.88 for n = 576).
* ``init_alpha`` ("initalpha"): at the first *training* forward (whenever it happens, also after ``.eval()``
  forwards) every alpha of the layer is set to ``sqrt(2 / Var(y))`` where ``y = conv(x, W_hat(alpha=1))``
  *without bias* and Var is the biased variance over all output values of that batch (under torch.distributed,
  pooled over all ranks), so that the output variance is 2 on that batch (exactly, as bias is 0 at init).
  The buffer ``alpha_initialized`` (bool, in the state_dict) records that alpha holds meaningful values:
  it is True from construction when ``init_alpha=False``, True after the data-dependent init, and True after
  loading any state_dict that carries an ``alpha`` (a foreign checkpoint without the flag counts as
  initialized). A loaded alpha is therefore never overwritten.
* Inference cache (``weight_cache`` keyword / attribute): in eval mode, when no gradient is needed, the kernel
  is computed once and reused while the weight (and alpha) are unchanged. The cache key is the tensors' identity
  (data_ptr, ``_version``, dtype, device, shape, stride) plus the hyper-parameters; an in-place edit of the
  returned kernel invalidates it too. Modes: ``"verified"``: on a key hit the stored copies of weight/alpha are
  also compared with ``torch.equal``, because edits through ``.data`` bypass the autograd version counter
  (cost of a hit: one comparison pass; memory: kernel + one copy of weight/alpha; on an accelerator this would
  be a host synchronisation per layer). ``"identity"``: key only (no comparison, no sync; an edit through
  ``.data`` is NOT seen: call :meth:`clear_weight_cache` after one). ``"off"``: always recompute.
  ``"auto"`` (default): ``"verified"`` for CPU weights, ``"off"`` on other devices (recomputing the kernel
  there is a few asynchronous kernels, cheaper than a sync). For deployment, :func:`normlab.convert.
  fold_for_inference` turns the layer into a plain conv (no overhead at all). The cache is a plain attribute: not a
  buffer, not in the state_dict, built under ``no_grad`` (no autograd graph), dropped by ``.to()``/``.double()``/
  ``.half()``/``.cuda()`` (``_apply``), by pickling (torch.save of the whole module) and by deepcopy. Training,
  TorchScript tracing and torch.compile never use it. ``forward`` is an ordinary class method (nothing bound on
  the instance), so DataParallel replicas and deepcopies run with their own parameters.
* TorchScript: ``torch.jit.script`` is deprecated in torch 2.x and ``normlab.functional`` is not scriptable;
  ``torch.compile`` (and ``torch.jit.trace``) are supported and tested instead.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from normlab.functional import pws_weight, standardize_weight

__all__ = ["WSConv1d", "WSConv2d", "WSConv3d", "PWSConv1d", "PWSConv2d", "PWSConv3d"]

_FAN_MODES = ("fan_in", "fan_out")
WEIGHT_CACHE_MODES = ("auto", "verified", "identity", "off")


def _check_cache_mode(where: str, mode: str) -> str:
    if mode not in WEIGHT_CACHE_MODES:
        raise ValueError(f"{where}: weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}, got {mode!r}")
    return mode


def _tensor_key(t: Tensor) -> tuple:
    return (t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape), t.stride())


def _skip_cache() -> bool:
    """True while a graph is being captured (trace/compile): captured graphs must recompute the kernel."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


class _StdConvMixin:
    """Shared forward, input checks and the inference weight cache of the WS/PWS convolutions.

    Subclasses implement ``_compute_weight() -> Tensor`` (the kernel, with autograd),
    ``_cache_tensors() -> tuple[Tensor, ...]`` (the parameters the kernel depends on) and
    ``_cache_params() -> tuple`` (the hyper-parameters it depends on).
    """

    _weight_cache: tuple | None = None  # (key, reference copies, kernel, kernel version); set per instance
    _spatial_dims: int = 2
    weight_cache: str = "auto"  # see the module docstring; settable per instance

    # -- the kernel ------------------------------------------------------------------------------------
    def effective_weight(self) -> Tensor:
        """The kernel passed to ``F.conv{d}d``: shape (C_out, C_in/groups, *kernel_size), dtype of ``weight``.

        With autograd in training (or whenever a gradient is needed); from the inference cache otherwise.
        """
        tensors = self._cache_tensors()
        needs_grad = torch.is_grad_enabled() and any([t.requires_grad for t in tensors])
        mode = self.weight_cache
        if mode == "auto":
            mode = "verified" if tensors[0].device.type == "cpu" else "off"
        if self.training or needs_grad or mode == "off" or torch.jit.is_scripting() or _skip_cache():
            return self._compute_weight()
        return self._cached_weight(tensors, verify=mode == "verified")

    def _cached_weight(self, tensors: tuple[Tensor, ...], verify: bool = True) -> Tensor:
        """Return the cached kernel if it is current, else recompute and cache it (no graph).

        Valid only if (1) the identities (data_ptr, _version) and metadata (dtype, device, shape, stride) of
        weight/alpha and the hyper-parameters equal the recorded ones, (2) the cached kernel was not modified in
        place, and (3) with ``verify``, the values still equal the stored copies (edits through ``.data`` keep
        data_ptr and _version, so identity alone cannot see them).
        """
        if any([t.is_inference() for t in tensors]):  # parameters created under inference_mode: no versions
            return self._compute_weight()
        try:
            key = (tuple(_tensor_key(t) for t in tensors), self._cache_params())
        except RuntimeError:  # tensors without storage (torch.func transforms such as vmap): no cache
            return self._compute_weight()
        entry = self._weight_cache
        if entry is not None:
            old_key, refs, kernel, kernel_version = entry
            if (
                old_key == key
                and kernel._version == kernel_version
                and (not verify or (len(refs) == len(tensors) and all(map(torch.equal, refs, tensors))))
            ):
                return kernel
        with torch.inference_mode(False), torch.no_grad():  # normal tensors (with versions) even in inference_mode
            kernel = self._compute_weight().detach()
            refs = tuple(t.detach().clone() for t in tensors) if verify else ()
        self._weight_cache = (key, refs, kernel, kernel._version)
        return kernel

    def clear_weight_cache(self) -> None:
        """Drop the inference cache (never needed for correctness; frees its memory)."""
        self._weight_cache = None

    # -- module plumbing ----------------------------------------------------------------------------------
    def _apply(self, fn, *args, **kwargs):  # .to(), .double(), .half(), .cuda(), ...
        self._weight_cache = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # torch.save(module) / pickle / deepcopy: the cache is dropped
        state = super().__getstate__().copy()
        state["_weight_cache"] = None
        return state

    def _check_input(self, input: Tensor) -> None:
        d = self._spatial_dims
        name = type(self).__name__
        if input.dim() not in (d + 1, d + 2):
            raise ValueError(
                f"{name}: expected {d + 2}D input (N, C, *spatial) or {d + 1}D unbatched input, got {input.dim()}D"
            )
        channels = input.shape[-d - 1]
        if channels != self.in_channels:
            raise ValueError(f"{name}: expected input with {self.in_channels} channels, got {channels}")

    def forward(self, input: Tensor) -> Tensor:
        """input (N, C_in, *spatial) or (C_in, *spatial) -> output (N, C_out, *spatial')."""
        self._check_input(input)
        self._before_forward(input)
        return self._conv_forward(input, self.effective_weight(), self.bias)

    def _before_forward(self, input: Tensor) -> None:
        pass


# ------------------------------------------------------------------------------------------------------------
# Weight Standardization
# ------------------------------------------------------------------------------------------------------------
class _WSConvNd(_StdConvMixin):
    def _init_ws(self, eps: float, weight_cache: str) -> None:
        self.weight_cache = _check_cache_mode(type(self).__name__, weight_cache)
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"{type(self).__name__}: eps must be a finite number > 0, got {eps!r}")
        self.eps = float(eps)

    def _compute_weight(self) -> Tensor:
        return standardize_weight(self.weight, self.eps)

    def _cache_tensors(self) -> tuple[Tensor, ...]:
        return (self.weight,)

    def _cache_params(self) -> tuple:
        return (self.eps,)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", eps={self.eps}"


def _ws_class(base: type[nn.Module], d: int) -> type:
    class WSConv(_WSConvNd, base):
        __doc__ = f"""Weight-standardized ``nn.Conv{d}d``: ``W_hat_o = (W_o - mean(W_o)) / sqrt(var(W_o) + eps)``.

        Takes every ``nn.Conv{d}d`` argument plus keyword-only ``eps`` (default 1e-5) and ``weight_cache``
        (inference cache mode: auto, verified, identity, off; see the module docstring). Raw weight/bias init is
        ``nn.Conv{d}d``'s. Input (N, C_in, *{d} spatial) -> (N, C_out, *spatial').
        """
        _spatial_dims = d

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
            self._init_ws(eps, weight_cache)
            super().__init__(
                in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype,
            )

    WSConv.__name__ = WSConv.__qualname__ = f"WSConv{d}d"
    return WSConv


# ------------------------------------------------------------------------------------------------------------
# Parametric Weight Standardization
# ------------------------------------------------------------------------------------------------------------
class _PWSConvNd(_StdConvMixin):
    def _init_pws(self, gamma, relative_gamma, fan_mode, init_alpha, weight_cache) -> None:
        name = type(self).__name__
        self.weight_cache = _check_cache_mode(name, weight_cache)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not math.isfinite(gamma) or gamma <= 0:
            raise ValueError(f"{name}: gamma must be a finite number > 0, got {gamma!r}")
        if fan_mode not in _FAN_MODES:
            raise ValueError(f"{name}: fan_mode must be one of {', '.join(_FAN_MODES)}, got {fan_mode!r}")
        self.gamma = float(gamma)
        self.relative_gamma = bool(relative_gamma)
        self.fan_mode = fan_mode
        self.init_alpha = bool(init_alpha)

    def _finish_init(self, factory_kwargs: dict) -> None:
        k = math.prod(self.kernel_size)
        fan_in = self.in_channels // self.groups * k
        fan_out = self.out_channels // self.groups * k
        self.fan = fan_in if self.fan_mode == "fan_in" else fan_out
        self.alpha = nn.Parameter(torch.ones(self.out_channels, **factory_kwargs))
        self.register_buffer(
            "alpha_initialized", torch.tensor(not self.init_alpha, device=factory_kwargs.get("device"))
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Raw weight ~ N(0, 2/fan) (Kaiming normal, ReLU gain), bias 0, alpha 1; data init re-armed."""
        if "alpha" not in self._parameters:  # called by nn.ConvNd.__init__ before alpha exists
            return
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / self.fan))
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        nn.init.ones_(self.alpha)
        self.alpha_initialized.fill_(not self.init_alpha)
        self._weight_cache = None

    def _compute_weight(self) -> Tensor:
        return pws_weight(self.weight, self.alpha, self.gamma, self.relative_gamma, fan=self.fan)

    def _cache_tensors(self) -> tuple[Tensor, ...]:
        return (self.weight, self.alpha)

    def _cache_params(self) -> tuple:
        return (self.gamma, self.relative_gamma, self.fan)

    def _before_forward(self, input: Tensor) -> None:
        if self.training and self.init_alpha and not bool(self.alpha_initialized):
            self._data_init_alpha(input)

    @torch.no_grad()
    def _data_init_alpha(self, input: Tensor) -> None:
        """Set every alpha to sqrt(2 / Var(conv(x, W_hat(alpha=1)))) so the batch's output variance is 2."""
        kernel = pws_weight(self.weight, None, self.gamma, self.relative_gamma, fan=self.fan)
        y = self._conv_forward(input, kernel, None).float()
        stats = torch.stack([y.mean(), y.square().mean()]).double()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
            stats /= dist.get_world_size()
        var = (stats[1] - stats[0].square()).clamp_min(1e-12)
        self.alpha.fill_(float(torch.sqrt(2.0 / var)))
        self.alpha_initialized.fill_(True)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        flag = prefix + "alpha_initialized"
        if flag not in state_dict and prefix + "alpha" in state_dict:
            state_dict[flag] = torch.tensor(True)  # a checkpoint carrying alpha is never re-initialized
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._weight_cache = None

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", gamma={self.gamma}"
        if self.relative_gamma:
            s += ", relative_gamma=True"
        if self.fan_mode != "fan_in":
            s += f", fan_mode={self.fan_mode!r}"
        if self.init_alpha:
            s += ", init_alpha=True"
        return s


def _pws_class(base: type[nn.Module], d: int) -> type:
    class PWSConv(_PWSConvNd, base):
        __doc__ = f"""Parametric Weight Standardization ``nn.Conv{d}d`` (Liu et al., AAAI 2021).

        ``W_hat_o = sqrt(2/n) * alpha_o * (W_o - mean(W_o)) / sqrt(var(W_o) + g)``, ``y = conv(x, W_hat) + b``.
        Takes every ``nn.Conv{d}d`` argument (bias=True by default) plus keyword-only ``gamma`` (1e-3, > 0),
        ``relative_gamma`` (g = gamma * 2/n), ``fan_mode`` ("fan_in" or "fan_out": n) and ``init_alpha``
        (data-dependent alpha at the first training forward) and ``weight_cache`` (inference cache mode: auto,
        verified, identity, off; see the module docstring). Parameters: ``weight`` (C_out, C_in/groups,
        *kernel), ``bias`` (C_out,), ``alpha`` (C_out,); buffer ``alpha_initialized`` (bool scalar).
        Input (N, C_in, *{d} spatial) -> (N, C_out, *spatial').
        """
        _spatial_dims = d

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
            self._init_pws(gamma, relative_gamma, fan_mode, init_alpha, weight_cache)
            super().__init__(
                in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
                groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype,
            )
            self._finish_init({"device": device, "dtype": dtype})

    PWSConv.__name__ = PWSConv.__qualname__ = f"PWSConv{d}d"
    return PWSConv


WSConv1d = _ws_class(nn.Conv1d, 1)
WSConv2d = _ws_class(nn.Conv2d, 2)
WSConv3d = _ws_class(nn.Conv3d, 3)
PWSConv1d = _pws_class(nn.Conv1d, 1)
PWSConv2d = _pws_class(nn.Conv2d, 2)
PWSConv3d = _pws_class(nn.Conv3d, 3)
