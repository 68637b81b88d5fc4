"""Signal propagation plots data (Brock et al. 2021, NF-Nets), computed at the current weights (usually init).

For each block (or layer) output x of shape (N, C, *) on an N(0, 1) input:
    avg_sq_mean  = mean_c( mean_{N,spatial}(x)^2 )     average channel squared mean
    avg_var      = mean_c( var_{N,spatial}(x) )        average channel variance (biased)
    residual_var = avg_var of the block's residual-branch output (None where no branch is identified)
For (N, F) outputs the channels are the F features. The per-layer entries (mode "layers", and watched layers named
in ``modules``) take each layer's own channel axes (:func:`normlab.monitor.layers.input_channel_dims`): the last dim
of a linear layer's (B, T, F) output, a LayerNorm's normalized dims; blocks and other modules use dim 1.

Block convention: a module is a residual block when it has an nn.Module attribute named ``residual_branch`` or
``branch``; that attribute is the residual branch (the block output is then shortcut + branch). If the model has
such blocks, one entry per block (forward order); otherwise one entry per conv/linear/norm layer (or per module
named in ``modules``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from normlab.monitor.layers import input_channel_dims, layer_kind, supported_layers, unwrap_model
from normlab.monitor.stats import channel_matrix

__all__ = ["signal_propagation", "channel_signal_stats", "BRANCH_ATTRS"]

BRANCH_ATTRS = ("residual_branch", "branch")


def channel_signal_stats(x: Tensor, channel_dim: int | tuple[int, ...] = 1) -> tuple[float, float]:
    """(mean_c(mean(x_c)^2), mean_c(var(x_c))) with channels on ``channel_dim`` (dim 1: x (N, C, *) or (N, F);
    several dims: their entries are the channels), moments over every other dim."""
    if x.dim() < 2:
        raise ValueError(f"channel_signal_stats: expected (N, C, *) with >= 2 dims, got {x.dim()}D")
    xc = channel_matrix(x.detach().double(), channel_dim, "channel_signal_stats")
    mean = xc.mean(dim=1)
    var = xc.var(dim=1, unbiased=False)
    return float(mean.square().mean()), float(var.mean())


def _branch_of(module: nn.Module) -> nn.Module | None:
    for attr in BRANCH_ATTRS:
        b = getattr(module, attr, None)
        if isinstance(b, nn.Module):
            return b
    return None


def _targets(net: nn.Module, modules: Sequence[str] | None) -> tuple[list[tuple[str, nn.Module]], str]:
    """The modules to report and the mode: named ``modules``, else residual blocks, else every watched layer."""
    named = dict(net.named_modules())
    if modules is not None:
        missing = [m for m in modules if m not in named]
        if missing:
            raise ValueError(f"signal_propagation: modules {missing} not found in {type(net).__name__}")
        return [(m, named[m]) for m in modules], "modules"
    blocks = [(n, m) for n, m in named.items() if n and _branch_of(m) is not None]
    if blocks:
        return blocks, "blocks"
    layers = [(n, m) for n, m, _ in supported_layers(net)]
    if not layers:
        raise ValueError(f"signal_propagation: {type(net).__name__} has no blocks or supported layers to report")
    return layers, "layers"


def _output_hook(entries: dict[str, dict], name: str, mod: nn.Module, mode: str):
    """A forward hook that stores the first output's per-channel signal statistics of ``mod`` in ``entries``."""
    kind = layer_kind(mod) if mode != "blocks" else None

    def hook(_m, _args, out):
        if isinstance(out, Tensor) and out.dim() >= 2 and name not in entries:
            dims = input_channel_dims(mod, kind, out) if kind is not None else None
            sq, var = channel_signal_stats(out, dims or 1)
            entries[name] = {
                "name": name,
                "type": type(mod).__name__,
                "avg_sq_mean": sq,
                "avg_var": var,
                "residual_var": None,
            }

    return hook


def _branch_hook(branch_var: dict[str, float], name: str):
    """A forward hook that stores the first output variance of a block's residual branch in ``branch_var``."""

    def hook(_m, _args, out):
        if isinstance(out, Tensor) and out.dim() >= 2 and name not in branch_var:
            branch_var[name] = channel_signal_stats(out)[1]

    return hook


@torch.no_grad()
def signal_propagation(
    model: nn.Module,
    input_shape: Sequence[int],
    *,
    seed: int = 0,
    training: bool = True,
    modules: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Run one N(0, 1) batch of ``input_shape`` (batch dim included) through a deep copy of ``model``.

    Args:
        training: run the copy in train mode (BN uses batch statistics, as in NF-Nets SPPs). The model itself
            is never modified (running statistics included).
        modules: names of the modules to report (overrides the block/layer convention).
    Returns:
        {"input_shape": [...], "mode": "blocks" | "layers" | "modules", "entries": [{"name", "type",
        "avg_sq_mean", "avg_var", "residual_var"}, ...]} in forward order.

    Example:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
        >>> spp = signal_propagation(model, (4, 3, 16, 16))
        >>> spp["mode"], [e["name"] for e in spp["entries"]]
        ('layers', ['0', '2'])
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) < 2 or any(s <= 0 for s in shape):
        raise ValueError(
            f"signal_propagation: input_shape must be (N, C, ...) with positive sizes, got {tuple(input_shape)}"
        )
    net = copy.deepcopy(unwrap_model(model))
    net.train(training)
    if device is None:
        p = next(net.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    targets, mode = _targets(net, modules)
    entries: dict[str, dict] = {}
    branch_var: dict[str, float] = {}
    handles = []
    try:
        for name, mod in targets:
            handles.append(mod.register_forward_hook(_output_hook(entries, name, mod, mode)))
            branch = _branch_of(mod) if mode == "blocks" else None
            if branch is not None:
                handles.append(branch.register_forward_hook(_branch_hook(branch_var, name)))
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=gen, dtype=dtype).to(device)
        net.to(device=device, dtype=dtype)
        net(x)
    finally:
        for h in handles:
            h.remove()
    for name, v in branch_var.items():
        if name in entries:
            entries[name]["residual_var"] = v
    return {"input_shape": list(shape), "mode": mode, "entries": list(entries.values())}
