"""Switchable Normalization modules (Luo et al. 2019) built on :func:`normlab.functional.switchable_norm`.

Each layer normalizes with a learned mixture of instance (IN, per sample and channel), layer (LN, per sample)
and batch (BN, per channel) statistics: ``mean = softmax(mean_weight) . (mean_in, mean_ln, mean_bn)`` and the
same for the variance with the separate logits ``var_weight``; then ``y = (x - mean) / sqrt(var + eps) * weight
+ bias``. Defaults are the authors' (eps 1e-5, moving average, BN on, running stats starting at 0).

Momentum is BatchNorm's (``torch.nn.BatchNorm2d``'s and every other normlab layer's): ``momentum`` weighs the NEW
value, ``running = (1 - momentum) * running + momentum * batch``; the default 0.1 is the official code's 0.9 (which
weighs the old value), and ``momentum=None`` is a cumulative average over ``num_batches_tracked``, as in torch.
With ``using_moving_average=False`` the buffers accumulate sums of batch means and of E[x^2] instead (official
behaviour; the caller is responsible for dividing by the number of batches before evaluation).

A batch whose statistics are not finite leaves the running statistics unchanged (tensor ops, no host
synchronisation, eager and compiled) and is counted in ``skipped_batches``, reported as a RuntimeWarning at
``.eval()`` or by :func:`normlab.nn.skipped_batches`: the non-finite policy of every normlab layer
(``docs/design.md``, "Non-finite batches"); an empty batch returns an empty output, leaves them unchanged and gives
zero gradients. Activation checkpointing updates them once (not again in the recomputation). The forward is one call
of ``switchable_forward`` (``normlab._functions``); ``torch.fx.symbolic_trace`` records the layer as one node that
runs it in the layer's mode when the graph runs.
"""

from __future__ import annotations

import functools
from string import Template

import torch
from torch import Tensor, nn

from .._checks import check_number, number_problem
from .._dispatch import fx_node, layer_step
from .._functions import switchable_forward
from ._docs import fill
from ._float32_stats import Float32StatsModule
from ._non_finite import SkippedBatches

__all__ = ["SwitchableNorm1d", "SwitchableNorm2d", "SwitchableNorm3d"]

torch.fx.wrap("layer_step")  # torch.fx.symbolic_trace records the layer as this one call (see forward)
torch.fx.wrap("switchable_forward")  # ... and traces a layer at the root of the trace as this one call


# The docstring of the public classes: one text, filled in per dimension ($input, $over, $details, $example).
_DOC = Template(r"""Switchable Normalization (Luo et al. 2019) over $input inputs ($over > 1).

    .. math::
        \mu = \sum_k w^\mu_k \mu_k, \quad \sigma^2 = \sum_k w^\sigma_k \sigma^2_k, \quad
        y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \gamma + \beta, \quad k \in \{IN, LN, BN\}

    with ``w = softmax(mean_weight)`` and ``softmax(var_weight)``: a learned mixture of instance (IN, per sample
    and channel over $over), layer (LN, per sample) and batch (BN, per channel) statistics, computed by
    :func:`normlab.functional.switchable_norm`. In eval mode BN uses the running statistics.$details
    Defaults are the authors' (eps 1e-5, moving average, BN on, running statistics starting at 0); ``momentum`` is
    BatchNorm's (the official 0.9 of the old value is the default 0.1 here).
    A batch whose statistics are not finite leaves the running statistics unchanged and is counted in the
    non-persistent buffer ``skipped_batches`` (no host synchronisation; a RuntimeWarning at ``.eval()`` or from
    :func:`normlab.nn.skipped_batches`; the policy of every normlab layer, ``docs/design.md`` "Non-finite
    batches").

    Learnable parameters: ``weight``, ``bias`` (C,); ``mean_weight``, ``var_weight`` (3,) logits (2 with
    ``using_bn=False``), initialised to ones. Buffers: ``running_mean``, ``running_var`` (C,), starting at zero
    (as the official code), and ``num_batches_tracked``, the finite training batches counted (BatchNorm's).

    Args:
        num_features: C, the number of channels (dim 1 of the input).
        eps: added to the mixed variance inside the square root (> 0). Default: 1e-5.
        momentum: the running-statistics update factor, BatchNorm's convention (the weight of the NEW value):
            ``running = (1 - momentum) * running + momentum * batch`` (the official 0.9 of the old value is 0.1);
            ``None``: cumulative average, as ``nn.BatchNorm2d``. Default: 0.1.
        using_moving_average: update the running statistics as a moving average; False: the buffers accumulate
            sums of batch means and of E[x^2] instead (official behaviour: divide by the number of batches before
            evaluation). Default: True.
        using_bn: mix in BN statistics; False: IN and LN only, no running statistics (nor
            ``num_batches_tracked``). Default: True.
        last_gamma: initialise ``weight`` to 0 instead of 1 (for the last norm of a residual branch).
            Default: False.
        device: the device of the parameters and buffers. Default: None (torch's default device).
        dtype: the dtype of the parameters and buffers. Default: None (torch's default dtype).

    Shape:
        - Input: $input
        - Output: the same shape, dtype and memory format as the input.

    Example:
$example
    """)


_doc = functools.partial(fill, _DOC, optional=("details",))


class _SwitchableNorm(SkippedBatches, Float32StatsModule):
    """Shared implementation; subclasses set ``_spatial_dims`` and ``_layout``."""

    _normlab_norm = True
    _spatial_dims = 2
    _layout = "(N, C, H, W)"
    _version = 2  # version 2 keeps num_batches_tracked (BatchNorm's version 2 too); see _load_from_state_dict

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        using_moving_average: bool = True,
        using_bn: bool = True,
        last_gamma: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_number(name, "num_features", num_features, integer=True, low=1)
        if not eps > 0:
            raise ValueError(f"{name}: eps must be > 0, got {eps}")
        if number_problem(momentum, low=0, high=1, optional=True) is not None:
            raise ValueError(
                f"{name}: momentum must be in [0, 1] (BatchNorm's convention: the weight of the new value; the "
                f"official 0.9 of the old value is 0.1) or None (cumulative average), got {momentum!r}"
            )
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.using_moving_average = using_moving_average
        self.using_bn = using_bn
        self.last_gamma = last_gamma
        k = 3 if using_bn else 2
        self.weight = nn.Parameter(torch.empty(num_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_features, **factory))
        self.mean_weight = nn.Parameter(torch.ones(k, **factory))
        self.var_weight = nn.Parameter(torch.ones(k, **factory))
        if using_bn:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.zeros(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
            self._init_skipped(device)
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
            self.register_buffer("skipped_batches", None, persistent=False)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.using_bn:
            self.running_mean.zero_()
            self.running_var.zero_()
            self.num_batches_tracked.zero_()
            self._reset_skipped()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        nn.init.constant_(self.weight, 0.0 if self.last_gamma else 1.0)
        nn.init.zeros_(self.bias)
        nn.init.ones_(self.mean_weight)
        nn.init.ones_(self.var_weight)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"using_moving_average={self.using_moving_average}, using_bn={self.using_bn}, "
            f"last_gamma={self.last_gamma}"
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """A state without ``num_batches_tracked`` from before version 2 (the official code's checkpoints) loads
        with the count 0, as BatchNorm's version-1 checkpoints do."""
        version = local_metadata.get("version", None)
        key = prefix + "num_batches_tracked"
        if self.using_bn and (version is None or version < 2) and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, C, *spatial) -> same shape, dtype and memory format: one call of ``switchable_forward`` (the input
        checks, the step and the running statistics). ``torch.fx.symbolic_trace`` records one node,
        ``layer_step(layer, x)``, which runs ``_forward_step`` when the graph runs (in the mode the layer is in then,
        as a BatchNorm's ``call_module``)."""
        return layer_step(self, x) if fx_node(self, x) else self._forward_step(x)

    def _forward_step(self, x: Tensor) -> Tensor:
        return switchable_forward(
            x,
            self.mean_weight,
            self.var_weight,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
            using_bn=self.using_bn,
            using_moving_average=self.using_moving_average,
            fused=None,
            where=type(self).__name__,
            counters=(self.num_batches_tracked, self.skipped_batches) if self.using_bn else None,
            layer=(self.num_features, self._spatial_dims, self._layout),
        )


class SwitchableNorm1d(_SwitchableNorm):
    __doc__ = _doc(
        input="(N, C, L)",
        over="L",
        details="""
    Unlike the official ``SwitchNorm1d`` (which takes (N, C) and mixes only LN and BN), this layer uses all three
    statistics on sequences.""",
        example="""
>>> SwitchableNorm1d(16)(torch.randn(8, 16, 40)).shape
torch.Size([8, 16, 40])
""",
    )

    _spatial_dims = 1
    _layout = "(N, C, L)"


class SwitchableNorm2d(_SwitchableNorm):
    __doc__ = _doc(
        input="(N, C, H, W)",
        over="H * W",
        details=" channels_last inputs give channels_last outputs.",
        example="""
>>> SwitchableNorm2d(64)(torch.randn(4, 64, 8, 8)).shape
torch.Size([4, 64, 8, 8])
""",
    )

    _spatial_dims = 2
    _layout = "(N, C, H, W)"


class SwitchableNorm3d(_SwitchableNorm):
    __doc__ = _doc(
        input="(N, C, D, H, W)",
        over="D * H * W",
        details=" channels_last_3d inputs give channels_last_3d outputs.",
        example="""
>>> SwitchableNorm3d(4)(torch.randn(2, 4, 3, 5, 5)).shape
torch.Size([2, 4, 3, 5, 5])
""",
    )

    _spatial_dims = 3
    _layout = "(N, C, D, H, W)"
