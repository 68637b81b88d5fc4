"""Capsules with dynamic routing (Sabour, Frosst, Hinton 2017, "Dynamic Routing Between Capsules").

- :class:`PrimaryCapsules`: a convolution whose output channels are grouped into capsule vectors, squashed.
- :class:`RoutingCapsules`: prediction vectors ``u_hat_{j|i} = W_ij u_i`` and routing-by-agreement.
- :func:`dynamic_routing`: the routing loop on given prediction vectors (returns the coupling coefficients too).
- :func:`margin_loss`: the paper's margin loss on capsule lengths.

Routing follows the paper and the authors' code: logits ``b`` start at zero **for each example**, the coupling
coefficients are a softmax over the **parent** axis (each child distributes itself over the parents), and
``b_ij += u_hat_{j|i} . v_j``. ``detach_inner=True`` reproduces naturomics/CapsNet-Tensorflow's stop_gradient
(inner iterations, including their logit updates, see a detached ``u_hat``; the last iteration uses ``u_hat``),
so the final coupling coefficients act as constants in backprop. It is not the paper's method and is off by
default; with one iteration it changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from normlab._checks import check_number
from normlab.functional import squash

from ._non_finite import FiniteState

__all__ = ["PrimaryCapsules", "RoutingCapsules", "dynamic_routing", "margin_loss"]


def dynamic_routing(u_hat: Tensor, iterations: int = 3, detach_inner: bool = False) -> tuple[Tensor, Tensor]:
    """Routing-by-agreement (Procedure 1 of the paper).

    Logits ``b`` start at zero for each example; each iteration takes the coupling coefficients
    ``c = softmax(b)`` over the parents, the parents ``v_j = squash(sum_i c_ij u_hat_{j|i})`` and, except in the
    last iteration, adds the agreement ``b_ij += u_hat_{j|i} . v_j``.

    Args:
        u_hat: prediction vectors (N, in_caps, out_caps, out_dim).
        iterations: number of routing iterations r >= 1. Default: 3.
        detach_inner: inner iterations use ``u_hat.detach()`` (naturomics' stop_gradient variant). Default: False.

    Returns:
        ``(v, c)``: parent capsules v (N, out_caps, out_dim) and the coupling coefficients of the last iteration
        c (N, in_caps, out_caps), which sum to 1 over ``out_caps`` for every example and child.

    Example:
        >>> v, c = dynamic_routing(torch.randn(2, 6, 3, 4), iterations=3)
        >>> v.shape, c.shape
        (torch.Size([2, 3, 4]), torch.Size([2, 6, 3]))
        >>> torch.allclose(c.sum(-1), torch.ones(2, 6))
        True
    """
    check_number("dynamic_routing", "iterations", iterations, integer=True, low=1)
    if u_hat.dim() != 4:
        raise ValueError(
            f"dynamic_routing: expected u_hat (N, in_caps, out_caps, out_dim) with 4 dims, got {u_hat.dim()}D"
        )
    u_inner = u_hat.detach() if detach_inner else u_hat
    b = u_hat.new_zeros(u_hat.shape[:3])  # (N, in_caps, out_caps): one set of logits per example
    for it in range(iterations):
        last = it == iterations - 1
        u = u_hat if last else u_inner
        c = torch.softmax(b, dim=2)  # over the parent axis
        s = torch.einsum("nij,nijd->njd", c, u)  # (N, out_caps, out_dim)
        v = squash(s, dim=-1)
        if not last:
            b = b + torch.einsum("nijd,njd->nij", u, v)
    return v, c


class PrimaryCapsules(nn.Module):
    """Convolutional capsules (Sabour et al. 2017): a conv whose output channels are grouped into capsule vectors.

    ``Conv2d(in_channels, num_capsules * capsule_dim, kernel_size, stride, padding)``; channel
    ``t * capsule_dim + d`` is component d of capsule type t; every spatial position and type is one capsule,
    passed through :func:`normlab.functional.squash`.

    Args:
        in_channels: channels of the input feature map.
        num_capsules: capsule types (32 in the paper). Default: 32.
        capsule_dim: components per capsule. Default: 8.
        kernel_size: kernel size of the conv. Default: 9.
        stride: stride of the conv. Default: 2.
        padding: padding of the conv. Default: 0.

    Shape:
        Input (N, in_channels, H, W); output (N, num_capsules * H_out * W_out, capsule_dim), capsules ordered by
        (type, row, column). MNIST: (N, 256, 20, 20) -> (N, 1152, 8).

    Example:
        >>> PrimaryCapsules(256)(torch.randn(2, 256, 20, 20)).shape
        torch.Size([2, 1152, 8])
    """

    def __init__(
        self,
        in_channels: int,
        num_capsules: int = 32,
        capsule_dim: int = 8,
        kernel_size: int = 9,
        stride: int = 2,
        padding: int = 0,
    ) -> None:
        super().__init__()
        for arg, val in (("in_channels", in_channels), ("num_capsules", num_capsules), ("capsule_dim", capsule_dim)):
            check_number("PrimaryCapsules", arg, val, integer=True, low=1)
        self.in_channels = in_channels
        self.num_capsules = num_capsules
        self.capsule_dim = capsule_dim
        self.conv = nn.Conv2d(in_channels, num_capsules * capsule_dim, kernel_size, stride=stride, padding=padding)

    def reset_parameters(self) -> None:
        """The conv's initialisation (``nn.Conv2d.reset_parameters``), e.g. after ``to_empty()``."""
        self.conv.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"PrimaryCapsules: expected 4D input (N, C, H, W), got {x.dim()}D")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"PrimaryCapsules: expected {self.in_channels} input channels, got {x.shape[1]}")
        y = self.conv(x)  # (N, T*D, H, W)
        n, _, h, w = y.shape
        y = y.reshape(n, self.num_capsules, self.capsule_dim, h, w).permute(0, 1, 3, 4, 2)
        return squash(y.reshape(n, self.num_capsules * h * w, self.capsule_dim), dim=-1)

    def extra_repr(self) -> str:
        return f"num_capsules={self.num_capsules}, capsule_dim={self.capsule_dim}"


class RoutingCapsules(FiniteState, nn.Module):
    """Fully connected capsule layer with dynamic routing (the paper's DigitCaps).

    ``u_hat[n, i, j] = W[i, j] @ u[n, i]``, then :func:`dynamic_routing` (softmax over the parents, logits per
    example). Parameter ``weight`` W (in_capsules, out_capsules, out_dim, in_dim), init N(0, init_std^2); a loaded
    non-finite ``weight`` is named at load, as for every normlab layer.

    Args:
        in_capsules: the number of child capsules (1152 in the paper).
        in_dim: the dimension of a child capsule (8).
        out_capsules: the number of parent capsules (10, one per class).
        out_dim: the dimension of a parent capsule (16).
        iterations: routing iterations r >= 1. Default: 3.
        detach_inner: the inner iterations see a detached u_hat (naturomics' stop_gradient, not the paper's
            method). Default: False.
        init_std: standard deviation of the initial ``weight``. Default: 0.01.

    Shape:
        Input u (N, in_capsules, in_dim); output v (N, out_capsules, out_dim); ``forward(u, return_coupling=True)``
        also returns the last coupling coefficients (N, in_capsules, out_capsules).

    Example:
        >>> caps = RoutingCapsules(1152, 8, 10, 16, iterations=3)
        >>> caps(torch.randn(2, 1152, 8)).shape
        torch.Size([2, 10, 16])
    """

    def __init__(
        self,
        in_capsules: int,
        in_dim: int,
        out_capsules: int,
        out_dim: int,
        iterations: int = 3,
        detach_inner: bool = False,
        init_std: float = 0.01,
    ) -> None:
        super().__init__()
        for arg, val in (
            ("in_capsules", in_capsules),
            ("in_dim", in_dim),
            ("out_capsules", out_capsules),
            ("out_dim", out_dim),
        ):
            check_number("RoutingCapsules", arg, val, integer=True, low=1)
        check_number("RoutingCapsules", "iterations", iterations, integer=True, low=1)
        self.in_capsules, self.in_dim = in_capsules, in_dim
        self.out_capsules, self.out_dim = out_capsules, out_dim
        self.iterations = iterations
        self.detach_inner = detach_inner
        self.init_std = float(check_number("RoutingCapsules", "init_std", init_std, low=0))
        self.weight = nn.Parameter(torch.empty(in_capsules, out_capsules, out_dim, in_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``weight ~ N(0, init_std^2)``, the constructor's initialisation (e.g. after ``to_empty()``)."""
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0).mul_(self.init_std)

    def predictions(self, u: Tensor) -> Tensor:
        """u (N, in_capsules, in_dim) -> u_hat (N, in_capsules, out_capsules, out_dim)."""
        if u.dim() != 3 or u.shape[1:] != (self.in_capsules, self.in_dim):
            raise ValueError(
                f"RoutingCapsules: expected input (N, {self.in_capsules}, {self.in_dim}), got {tuple(u.shape)}"
            )
        return torch.einsum("ijdk,nik->nijd", self.weight, u)

    def forward(self, u: Tensor, return_coupling: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        v, c = dynamic_routing(self.predictions(u), self.iterations, self.detach_inner)
        return (v, c) if return_coupling else v

    def extra_repr(self) -> str:
        return (
            f"in_capsules={self.in_capsules}, in_dim={self.in_dim}, out_capsules={self.out_capsules}, "
            f"out_dim={self.out_dim}, iterations={self.iterations}, detach_inner={self.detach_inner}"
        )


def margin_loss(
    lengths: Tensor, targets: Tensor, m_plus: float = 0.9, m_minus: float = 0.1, lam: float = 0.5
) -> Tensor:
    """The paper's margin loss on capsule lengths, summed over classes and averaged over the batch.

    ``L_k = T_k max(0, m+ - |v_k|)^2 + lam (1 - T_k) max(0, |v_k| - m-)^2`` with ``T_k = 1`` for the classes
    present in the example.

    Args:
        lengths: capsule lengths ``|v_k|``, (N, K).
        targets: class indices (N,) (integer dtype) or one-hot / multi-hot (N, K) floats.
        m_plus: the length a present class should reach (m+). Default: 0.9.
        m_minus: the length an absent class should stay below (m-). Default: 0.1.
        lam: the weight of the absent classes' term. Default: 0.5.

    Returns:
        The loss, a scalar tensor.

    Example:
        >>> lengths = torch.tensor([[0.95, 0.05], [0.5, 0.2]])
        >>> margin_loss(lengths, torch.tensor([0, 1]))   # row 1: (0.9 - 0.2)^2 + 0.5 * (0.5 - 0.1)^2; mean of 2 rows
        tensor(0.2850)
    """
    if lengths.dim() != 2:
        raise ValueError(f"margin_loss: expected lengths (N, K), got {lengths.dim()}D")
    if targets.dim() == 1 and not targets.is_floating_point():
        if targets.shape[0] != lengths.shape[0]:
            raise ValueError(f"margin_loss: targets has {targets.shape[0]} entries, lengths {lengths.shape[0]} rows")
        t = torch.nn.functional.one_hot(targets, lengths.shape[1]).to(lengths.dtype)
    elif targets.shape == lengths.shape:
        t = targets.to(lengths.dtype)
    else:
        raise ValueError(
            f"margin_loss: targets must be class indices (N,) or (N, K) like lengths {tuple(lengths.shape)}, "
            f"got {tuple(targets.shape)} {targets.dtype}"
        )
    present = t * torch.clamp(m_plus - lengths, min=0).square()
    absent = lam * (1 - t) * torch.clamp(lengths - m_minus, min=0).square()
    return (present + absent).sum(1).mean()
