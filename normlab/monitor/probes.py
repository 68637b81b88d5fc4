"""Probes: per-step scalars a monitor records beside its per-layer records (transformers' instabilities).

A probe watches one quantity that no conv/linear record shows. Each value is keyed ``"<probe>/<module name>"``
(the keys of ``StepContext.probes``):

- :class:`AttentionLogitProbe` (``attn_logit``): the largest attention logit :math:`\\max |q \\cdot k| \\cdot s`
  (:math:`s = 1/\\sqrt{d}` unless the call says otherwise) of every attention, over the query/key pairs its mask
  keeps. Attention-logit growth is the first of the small-scale-proxy instabilities of Wortsman et al. (2023),
  "Small-scale proxies for large-scale Transformer training instabilities".
- :class:`ResidualStreamProbe` (``residual_rms``): the rms of the input of every LayerNorm/RMSNorm, i.e. the
  residual stream of a pre-LN transformer where each block reads it.
- :class:`NormGainProbe` (``norm_gain``): the rms of every LayerNorm/RMSNorm gain (weight).
- :class:`OutputLogitProbe` (``logit_rms``, ``logit_max``): rms and largest absolute value of the model's output
  logits (output-logit divergence, the second instability of Wortsman et al.).

Probes cost nothing between recorded steps: :class:`ProbeSet` attaches their hooks when a recorded step starts
(:meth:`ProbeSet.start`) and removes them when it ends (:meth:`ProbeSet.stop`, which reads every value back in one
transfer). Several forwards in one step (gradient accumulation) keep the largest value of each key.

How attention is seen, for any model: ``nn.MultiheadAttention`` through a forward pre-hook that recomputes
:math:`q k^T` from its projections; every call of ``F.scaled_dot_product_attention`` (PyTorch and Hugging Face
"sdpa" attention) through a :class:`torch.overrides.TorchFunctionMode` active during the recorded forward, which
attributes the call to the innermost module running (forward pre/post hooks keep the module stack); and eager
attention (Hugging Face "eager" paths) as the input of a softmax called inside a module whose class name contains
``Attention`` or ``Attn``: that input is the scaled logits plus the additive mask, whose masked entries (``-inf`` or
the dtype's minimum) are left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "Probe",
    "ProbeSet",
    "AttentionLogitProbe",
    "ResidualStreamProbe",
    "NormGainProbe",
    "OutputLogitProbe",
    "DEFAULT_PROBES",
    "attention_logit_max",
]

_SOFTMAX = (F.softmax, torch.softmax, Tensor.softmax)
_ATTENTION_NAMES = ("Attention", "Attn")


def _is_layer_norm(module: nn.Module) -> bool:
    """LayerNorm and RMSNorm, torch's or any class named so (Hugging Face's LlamaRMSNorm, T5LayerNorm ...)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    name = type(module).__name__
    return "LayerNorm" in name or "RMSNorm" in name


def attention_logit_max(
    q: Tensor, k: Tensor, scale: float | None = None, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """The largest attention logit :math:`\\max_{ij} |q_i \\cdot k_j| \\cdot s` over the pairs the mask keeps.

    Args:
        q: queries ``(..., L, d)``.
        k: keys ``(..., S, d)``; fewer heads than ``q`` (grouped-query attention) are repeated.
        scale: :math:`s`; default :math:`1/\\sqrt{d}` (as ``F.scaled_dot_product_attention``).
        attn_mask: a boolean mask (True = attend) or an additive float mask (entries at ``-inf`` or below half the
            dtype's minimum are left out), broadcastable to ``(..., L, S)``.
        is_causal: leave out the pairs j > i.

    Returns:
        A 0-dim float32 tensor (0 when every pair is masked).

    Example:
        >>> q = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
        >>> float(attention_logit_max(q, q, scale=1.0))
        4.0
    """
    q, k = q.detach().float(), k.detach().float()
    if q.dim() >= 3 and k.dim() == q.dim() and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = (q @ k.transpose(-2, -1)).abs() * s
    keep = None
    if is_causal:
        L, S = logits.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        m = attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2
        keep = m if keep is None else keep & m
    if keep is not None:
        logits = logits.masked_fill(~keep, 0.0)
    return logits.amax() if logits.numel() else logits.new_zeros(())


class Probe:
    """A per-step scalar source. Subclasses set ``name`` and override :meth:`attach` (register hooks on the model,
    keep values with :meth:`keep`) and optionally :meth:`weights` (values read without a forward).

    Example:
        >>> class Depth(Probe):
        ...     name = "depth"
        ...     def weights(self, model):
        ...         return {"model": torch.tensor(float(len(list(model.modules()))))}
        >>> ps = ProbeSet(nn.Sequential(nn.Linear(2, 2)), [Depth()])
        >>> ps.start(); ps.stop()
        {'depth/model': 2.0}
    """

    name: ClassVar[str] = "probe"

    def __init__(self) -> None:
        self._handles: list = []
        self.values: dict[str, Tensor] = {}

    def keep(self, key: str, value: Tensor) -> None:
        """Keep ``value`` (a 0-dim tensor) under ``"<name>/<key>"``; the largest of a step's values stays."""
        full = f"{self.name}/{key or 'model'}"
        old = self.values.get(full)
        value = value.detach().float()
        self.values[full] = value if old is None else torch.maximum(old, value)

    def attach(self, model: nn.Module) -> None:
        """Register this probe's hooks on ``model`` (the handles go in ``self._handles``)."""

    def weights(self, model: nn.Module) -> Mapping[str, Tensor]:
        """Values read from the parameters at the end of the step, keyed by module name."""
        return {}

    def detach(self) -> None:
        """Remove every hook."""
        for h in self._handles:
            h.remove()
        self._handles = []


class _AttentionMode(TorchFunctionMode):
    """Sees every ``F.scaled_dot_product_attention`` and, inside attention modules, every softmax."""

    def __init__(self, probe: AttentionLogitProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.probe._on_sdpa(args, kwargs)
        elif func in _SOFTMAX:
            self.probe._on_softmax(args[0] if args else kwargs.get("input"))
        return func(*args, **kwargs)


class AttentionLogitProbe(Probe):
    """``attn_logit/<module>``: the largest attention logit of every attention module of the recorded step.

    .. math::
        \\text{attn\\_logit} = \\max_{b, h, i, j} \\frac{|q_{bhi} \\cdot k_{bhj}|}{\\sqrt{d}}

    over the query/key pairs the attention mask keeps; the mechanisms are listed in :mod:`normlab.monitor.probes`.

    Example:
        >>> mha = nn.MultiheadAttention(8, 2, batch_first=True)
        >>> ps = ProbeSet(mha, [AttentionLogitProbe()])
        >>> ps.start(); x = torch.randn(2, 5, 8); _ = mha(x, x, x); v = ps.stop()
        >>> list(v)
        ['attn_logit/model']
    """

    name = "attn_logit"

    def __init__(self) -> None:
        super().__init__()
        self._stack: list[tuple[str, nn.Module]] = []
        self._mode: _AttentionMode | None = None

    def attach(self, model: nn.Module) -> None:
        self._stack = []
        for mod_name, mod in model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._push(mod_name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._pop, always_call=True))
            if isinstance(mod, nn.MultiheadAttention):
                self._handles.append(mod.register_forward_pre_hook(self._mha(mod_name), with_kwargs=True))

    def detach(self) -> None:
        super().detach()
        self._exit_mode()
        self._stack = []

    def _push(self, mod_name: str):
        def hook(module, args, kwargs):
            if not self._stack:
                self._mode = _AttentionMode(self)
                self._mode.__enter__()
            self._stack.append((mod_name, module))

        return hook

    def _pop(self, module, args, output) -> None:
        if self._stack:
            self._stack.pop()
        if not self._stack:
            self._exit_mode()

    def _exit_mode(self) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _owner(self, attention_only: bool) -> str | None:
        for mod_name, mod in reversed(self._stack):
            if any(a in type(mod).__name__ for a in _ATTENTION_NAMES):
                return mod_name
        if attention_only or not self._stack:
            return None
        return self._stack[-1][0]

    @torch.no_grad()
    def _on_sdpa(self, args, kwargs) -> None:
        owner = self._owner(attention_only=False)
        if owner is None:
            return
        q, k = args[0], args[1] if len(args) > 1 else kwargs["key"]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        scale = kwargs.get("scale")
        self.keep(owner, attention_logit_max(q, k, scale, mask, bool(causal)))

    @torch.no_grad()
    def _on_softmax(self, x) -> None:
        owner = self._owner(attention_only=True)
        if owner is None or not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
            return
        x = x.detach().float()
        keep = x > torch.finfo(x.dtype).min / 2
        self.keep(owner, x.abs().masked_fill(~keep, 0.0).amax())

    def _mha(self, mod_name: str):
        def hook(mha: nn.MultiheadAttention, args, kwargs):
            with torch.no_grad():
                self.keep(mod_name, _mha_logit_max(mha, args, kwargs))

        return hook


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _mha_logit_max(mha: nn.MultiheadAttention, args, kwargs) -> Tensor:
    """max |q.k|/sqrt(d) of one ``nn.MultiheadAttention`` call, recomputed from its input projections."""
    query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    pad, mask = _arg(args, kwargs, 3, "key_padding_mask"), _arg(args, kwargs, 5, "attn_mask")
    causal = bool(_arg(args, kwargs, 7, "is_causal", False))
    if query.dim() == 2:
        query, key = query.unsqueeze(1 if not mha.batch_first else 0), key.unsqueeze(1 if not mha.batch_first else 0)
        pad = None if pad is None else pad.unsqueeze(0)
    if not mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    E, H = mha.embed_dim, mha.num_heads
    if mha._qkv_same_embed_dim:
        w_q, w_k = mha.in_proj_weight[:E], mha.in_proj_weight[E : 2 * E]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b = mha.in_proj_bias
    q = F.linear(query, w_q, None if b is None else b[:E])
    k = F.linear(key, w_k, None if b is None else b[E : 2 * E])
    N, L, S = q.shape[0], q.shape[1], k.shape[1]
    q = q.reshape(N, L, H, E // H).transpose(1, 2)
    k = k.reshape(N, S, H, E // H).transpose(1, 2)
    keep = None
    if mask is not None:
        keep = ~mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        keep = keep.reshape(N, H, L, S) if keep.dim() == 3 else keep
    if pad is not None:
        pad_keep = ~pad if pad.dtype == torch.bool else pad > torch.finfo(pad.dtype).min / 2
        pad_keep = pad_keep[:, None, None, :]
        keep = pad_keep if keep is None else keep & pad_keep
    return attention_logit_max(q, k, attn_mask=keep, is_causal=causal and mask is None)


class ResidualStreamProbe(Probe):
    """``residual_rms/<norm>``: :math:`\\sqrt{\\mathrm{mean}(x^2)}` of the input of every LayerNorm/RMSNorm.

    In a pre-LN transformer each block's norm reads the residual stream, which no layer renormalizes as a whole.

    Example:
        >>> ln = nn.LayerNorm(4)
        >>> ps = ProbeSet(ln, [ResidualStreamProbe()])
        >>> ps.start(); _ = ln(torch.full((2, 4), 3.0)); ps.stop()
        {'residual_rms/model': 3.0}
    """

    name = "residual_rms"

    def attach(self, model: nn.Module) -> None:
        for mod_name, mod in model.named_modules():
            if _is_layer_norm(mod):
                self._handles.append(mod.register_forward_pre_hook(self._hook(mod_name)))

    def _hook(self, mod_name: str):
        def hook(module, args):
            if args and isinstance(args[0], Tensor):
                with torch.no_grad():
                    self.keep(mod_name, args[0].detach().float().square().mean().sqrt())

        return hook


class NormGainProbe(Probe):
    """``norm_gain/<norm>``: the rms of every LayerNorm/RMSNorm gain :math:`\\sqrt{\\mathrm{mean}(\\gamma^2)}`.

    Example:
        >>> ps = ProbeSet(nn.LayerNorm(4), [NormGainProbe()])
        >>> ps.start(); ps.stop()
        {'norm_gain/model': 1.0}
    """

    name = "norm_gain"

    def weights(self, model: nn.Module) -> Mapping[str, Tensor]:
        out = {}
        for mod_name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if _is_layer_norm(mod) and isinstance(w, Tensor):
                out[mod_name] = w.detach().float().square().mean().sqrt()
        return out


class OutputLogitProbe(Probe):
    """``logit_rms/output`` and ``logit_max/output``: rms and largest absolute value of the model's output logits.

    The output is the model's return value: a tensor, the ``logits`` of a Hugging Face output, or the first element
    of a tuple.

    Example:
        >>> lin = nn.Linear(2, 3)
        >>> ps = ProbeSet(lin, [OutputLogitProbe()])
        >>> ps.start(); _ = lin(torch.zeros(1, 2)); sorted(ps.stop())
        ['logit_max/output', 'logit_rms/output']
    """

    name = "logit"

    def attach(self, model: nn.Module) -> None:
        self._handles.append(model.register_forward_hook(self._hook))

    def _hook(self, module, args, output) -> None:
        y = getattr(output, "logits", output)
        if isinstance(y, (tuple, list)) and y:
            y = y[0]
        if isinstance(y, Tensor) and y.is_floating_point():
            with torch.no_grad():
                y = y.detach().float()
                self._keep_as("logit_rms/output", y.square().mean().sqrt())
                self._keep_as("logit_max/output", y.abs().amax())

    def _keep_as(self, full: str, value: Tensor) -> None:
        old = self.values.get(full)
        self.values[full] = value if old is None else torch.maximum(old, value)


def DEFAULT_PROBES() -> list[Probe]:
    """Fresh instances of every probe: attention logits, residual stream, norm gains, output logits."""
    return [AttentionLogitProbe(), ResidualStreamProbe(), NormGainProbe(), OutputLogitProbe()]


class ProbeSet:
    """Runs probes on a model for the steps a monitor records.

    Call :meth:`start` before a recorded step's forward and :meth:`stop` after its optimizer step: ``stop`` removes
    every hook and returns ``{"<probe>/<module>": float}``, read back to the host in one transfer.

    Args:
        model: the model (wrappers such as DDP are the caller's to unwrap).
        probes: the probes; default :func:`DEFAULT_PROBES`.

    Example:
        >>> model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3))
        >>> ps = ProbeSet(model)
        >>> ps.start(); _ = model(torch.randn(2, 4)); sorted(ps.stop())
        ['logit_max/output', 'logit_rms/output', 'norm_gain/0', 'residual_rms/0']
    """

    def __init__(self, model: nn.Module, probes: Iterable[Probe] | None = None) -> None:
        self.model = model
        self.probes = list(DEFAULT_PROBES() if probes is None else probes)
        for p in self.probes:
            if not isinstance(p, Probe):
                raise TypeError(f"ProbeSet: every probe must be a normlab Probe, got {type(p).__name__}")
        self.active = False

    def start(self) -> None:
        """Attach every probe's hooks (idempotent within a step)."""
        if self.active:
            return
        for p in self.probes:
            p.values = {}
            p.attach(self.model)
        self.active = True

    def stop(self) -> dict[str, float]:
        """Remove the hooks and return this step's values (an empty dict when :meth:`start` was not called)."""
        if not self.active:
            return {}
        self.active = False
        values: dict[str, Tensor] = {}
        for p in self.probes:
            p.detach()
            values.update(p.values)
            values.update({f"{p.name}/{k or 'model'}": v for k, v in p.weights(self.model).items()})
            p.values = {}
        if not values:
            return {}
        numbers = torch.stack([v.reshape(()) for v in values.values()]).tolist()
        return dict(zip(values, numbers))
