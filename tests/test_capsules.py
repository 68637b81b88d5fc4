"""Capsules with dynamic routing against docs/design.md section 6 (Sabour et al. 2017)."""

import pytest
import torch
from torch import nn

from normlab.functional import squash
from normlab.nn.capsules import PrimaryCapsules, RoutingCapsules, dynamic_routing, margin_loss


def reference_routing(u_hat, iterations):
    """Procedure 1 of the paper, one example at a time with explicit loops (no shared code)."""
    n, n_in, n_out, d = u_hat.shape
    vs, cs = [], []
    for e in range(n):
        b = torch.zeros(n_in, n_out, dtype=u_hat.dtype)
        for it in range(iterations):
            c = torch.stack([torch.softmax(b[i], 0) for i in range(n_in)])  # each child over the parents
            v = []
            for j in range(n_out):
                s_j = sum(c[i, j] * u_hat[e, i, j] for i in range(n_in))
                norm2 = (s_j**2).sum()
                v.append(norm2 / (1 + norm2) * s_j / norm2.sqrt())
            v = torch.stack(v)
            if it < iterations - 1:
                b = b + torch.stack([torch.stack([u_hat[e, i, j] @ v[j] for j in range(n_out)]) for i in range(n_in)])
        vs.append(v)
        cs.append(c)
    return torch.stack(vs), torch.stack(cs)


def test_mnist_configuration_shapes():
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 256, 9)
    primary = PrimaryCapsules(256, num_capsules=32, capsule_dim=8, kernel_size=9, stride=2)
    digits = RoutingCapsules(1152, 8, 10, 16, iterations=3)
    assert digits.weight.shape == (1152, 10, 16, 8)
    x = torch.randn(2, 1, 28, 28)
    h = torch.relu(conv(x))
    assert h.shape == (2, 256, 20, 20)
    u = primary(h)
    assert u.shape == (2, 1152, 8)
    v, c = digits(u, return_coupling=True)
    assert v.shape == (2, 10, 16) and c.shape == (2, 1152, 10)
    lengths = v.norm(dim=-1)
    assert (lengths < 1).all() and (lengths >= 0).all()


def test_primary_capsule_grouping_and_squash():
    torch.manual_seed(1)
    primary = PrimaryCapsules(3, num_capsules=2, capsule_dim=4, kernel_size=3, stride=1)
    x = torch.randn(2, 3, 5, 5)
    u = primary(x)
    raw = primary.conv(x)  # (2, 8, 3, 3): channel t*4 + d is component d of capsule type t
    # capsule index (type t=1, row 2, column 0) -> t*9 + 2*3 + 0
    s = raw[:, 4:8, 2, 0]
    torch.testing.assert_close(u[:, 1 * 9 + 2 * 3 + 0], squash(s), rtol=1e-6, atol=1e-7)


def test_squash_norm_property():
    torch.manual_seed(2)
    s = torch.randn(5, 7, 16, dtype=torch.float64) * torch.logspace(-2, 2, 7, dtype=torch.float64).view(1, 7, 1)
    n = s.norm(dim=-1)
    v = squash(s, eps=0.0)
    torch.testing.assert_close(v.norm(dim=-1), n**2 / (1 + n**2), rtol=1e-12, atol=1e-15)
    # the default eps=1e-8 (finite gradient at 0) perturbs the length by a relative eps / (2 |s|^2) at most
    v = squash(s)
    rel = (v.norm(dim=-1) / (n**2 / (1 + n**2)) - 1).abs()
    assert (rel <= 1e-8 / (2 * n**2) + 1e-12).all()
    # direction kept
    torch.testing.assert_close(v / v.norm(dim=-1, keepdim=True), s / n.unsqueeze(-1), rtol=1e-9, atol=1e-12)
    # finite at zero
    z = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    squash(z).sum().backward()
    assert torch.isfinite(z.grad).all()


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_routing_matches_loop_reference(iterations):
    torch.manual_seed(3)
    u_hat = torch.randn(3, 5, 4, 6, dtype=torch.float64)
    v, c = dynamic_routing(u_hat, iterations)
    v_ref, c_ref = reference_routing(u_hat, iterations)
    # tolerance covers squash's eps=1e-8 (the reference uses the exact formula)
    torch.testing.assert_close(v, v_ref, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(c, c_ref, rtol=1e-6, atol=1e-8)


def test_coupling_softmax_over_parent_axis():
    torch.manual_seed(4)
    layer = RoutingCapsules(12, 4, 5, 6, iterations=3, init_std=0.5)
    _, c = layer(torch.randn(3, 12, 4), return_coupling=True)
    # each child i distributes itself over the parents j: sums to 1 over the parent axis
    torch.testing.assert_close(c.sum(2), torch.ones(3, 12))
    # not over the children (the common port defect would give these sums = 1)
    assert (c.sum(1) - 1).abs().max() > 0.1
    # routing moved away from uniform after 3 iterations
    assert (c - 1 / 5).abs().max() > 1e-3


def test_logits_are_per_example():
    """Different examples get different coupling, and an example's coupling does not depend on the rest of the
    batch (logits shared across the batch would mix them)."""
    torch.manual_seed(5)
    layer = RoutingCapsules(10, 4, 3, 5, iterations=3, init_std=0.5)
    u = torch.randn(4, 10, 4)
    v, c = layer(u, return_coupling=True)
    assert (c[0] - c[1]).abs().max() > 1e-3
    v_alone, c_alone = layer(u[2:3], return_coupling=True)
    torch.testing.assert_close(c_alone[0], c[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_alone[0], v[2], rtol=1e-5, atol=1e-6)


def _weight_grad(detach_inner, iterations, seed=6):
    torch.manual_seed(seed)
    layer = RoutingCapsules(8, 4, 3, 5, iterations=iterations, detach_inner=detach_inner, init_std=0.5).double()
    u = torch.randn(2, 8, 4, dtype=torch.float64)
    v = layer(u)
    margin_loss(v.norm(dim=-1), torch.tensor([0, 2])).backward()
    return v.detach(), layer.weight.grad


def test_detach_inner_same_gradient_with_one_iteration():
    v_a, g_a = _weight_grad(False, 1)
    v_b, g_b = _weight_grad(True, 1)
    assert torch.equal(v_a, v_b)
    torch.testing.assert_close(g_a, g_b, rtol=1e-12, atol=1e-14)


def test_detach_inner_changes_gradient_with_three_iterations():
    v_a, g_a = _weight_grad(False, 3)
    v_b, g_b = _weight_grad(True, 3)
    torch.testing.assert_close(v_a, v_b, rtol=1e-12, atol=1e-14)  # the forward pass is the same
    assert (g_a - g_b).abs().max() > 1e-3 * g_a.abs().max()


def test_detach_inner_coupling_is_constant_in_backprop():
    """With detach_inner the gradient equals routing with the final coupling coefficients frozen."""
    torch.manual_seed(7)
    u_hat = torch.randn(2, 6, 3, 4, dtype=torch.float64, requires_grad=True)
    v, c = dynamic_routing(u_hat, 3, detach_inner=True)
    g = torch.randn_like(v)
    (grad,) = torch.autograd.grad(v, u_hat, g)
    v_frozen = squash(torch.einsum("nij,nijd->njd", c.detach(), u_hat))
    (grad_frozen,) = torch.autograd.grad(v_frozen, u_hat, g)
    torch.testing.assert_close(grad, grad_frozen, rtol=1e-12, atol=1e-14)


def test_margin_loss_formula():
    torch.manual_seed(8)
    lengths = torch.rand(6, 10, dtype=torch.float64)
    targets = torch.randint(0, 10, (6,))
    loss = margin_loss(lengths, targets)
    expected = 0.0
    for n in range(6):
        for k in range(10):
            if k == targets[n]:
                expected += max(0.0, 0.9 - lengths[n, k].item()) ** 2
            else:
                expected += 0.5 * max(0.0, lengths[n, k].item() - 0.1) ** 2
    expected /= 6
    assert abs(loss.item() - expected) < 1e-12
    one_hot = nn.functional.one_hot(targets, 10).double()
    torch.testing.assert_close(margin_loss(lengths, one_hot), loss)
    # perfect predictions give zero loss; squared (not linear) hinge: halving the violation quarters the loss
    perfect = one_hot * 0.95 + (1 - one_hot) * 0.05
    assert margin_loss(perfect, targets).item() == 0.0
    l1 = margin_loss(torch.full((1, 2), 0.3, dtype=torch.float64), torch.tensor([0]))
    l2 = margin_loss(torch.full((1, 2), 0.2, dtype=torch.float64), torch.tensor([0]))
    # target 0 at length 0.3: (0.6)^2; other at 0.3: 0.5 * 0.2^2
    assert abs(l1.item() - (0.6**2 + 0.5 * 0.2**2)) < 1e-12
    assert abs(l2.item() - (0.7**2 + 0.5 * 0.1**2)) < 1e-12


def test_routing_gradcheck_float64():
    torch.manual_seed(9)
    layer = RoutingCapsules(4, 3, 2, 3, iterations=3, init_std=0.5).double()
    u = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    w = layer.weight.detach().clone().requires_grad_()

    def f(x, weight):
        return torch.func.functional_call(layer, {"weight": weight}, (x,))

    assert torch.autograd.gradcheck(f, (u, w))
    # detach_inner deliberately drops part of the true gradient, so gradcheck must reject it for 3 iterations
    layer.detach_inner = True
    assert not torch.autograd.gradcheck(f, (u, w), raise_exception=False)


def test_primary_capsules_gradcheck_float64():
    torch.manual_seed(10)
    primary = PrimaryCapsules(2, num_capsules=2, capsule_dim=3, kernel_size=3, stride=2).double()
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(primary, (x,))


def test_errors():
    with pytest.raises(ValueError, match="RoutingCapsules: iterations must be an int >= 1, got 0"):
        RoutingCapsules(4, 3, 2, 3, iterations=0)
    with pytest.raises(ValueError, match="dynamic_routing: iterations"):
        dynamic_routing(torch.randn(1, 2, 3, 4), iterations=0)
    with pytest.raises(ValueError, match="dynamic_routing: expected u_hat"):
        dynamic_routing(torch.randn(2, 3, 4), iterations=1)
    layer = RoutingCapsules(4, 3, 2, 3)
    with pytest.raises(ValueError, match=r"RoutingCapsules: expected input \(N, 4, 3\)"):
        layer(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="PrimaryCapsules: expected 4D"):
        PrimaryCapsules(3)(torch.randn(3, 20, 20))
    with pytest.raises(ValueError, match="PrimaryCapsules: expected 3 input channels"):
        PrimaryCapsules(3)(torch.randn(1, 4, 20, 20))
    with pytest.raises(ValueError, match="margin_loss: targets"):
        margin_loss(torch.rand(2, 10), torch.rand(2, 5))
    with pytest.raises(ValueError, match="margin_loss: expected lengths"):
        margin_loss(torch.rand(10), torch.tensor([1]))
