"""The runner's CapsNet models (normlab_lab.capsules.capsnet): the MNIST configuration of the
paper, the digits and MNIST-1D presets, the masked reconstruction decoder and the stop_gradient's effect on the
model's gradient."""

from __future__ import annotations

import pytest
import torch

from normlab.functional import squash
from normlab.nn import margin_loss
from normlab.runner.errors import UsageError
from normlab_lab.capsules.capsnet import CAPSNET_PRESETS, RECON_SCALE, build_capsnet


def test_mnist_configuration_builds_and_steps(one_thread):
    """The paper's net: 1152 primary capsules, 8.2 M parameters with the decoder and 6.8 M without it."""
    torch.manual_seed(0)
    net = build_capsnet("mnist", iterations=3)
    assert net.spec.num_primary == 1152 and net.digits.weight.shape == (1152, 10, 16, 8)
    n_all = sum(p.numel() for p in net.parameters())
    n_dec = sum(p.numel() for p in net.decoder.parameters())
    assert round(n_all / 1e6, 1) == 8.2 and round((n_all - n_dec) / 1e6, 1) == 6.8
    assert [m.out_features for m in net.decoder if isinstance(m, torch.nn.Linear)] == [512, 1024, 784]
    x, y = torch.rand(2, 1, 28, 28), torch.tensor([3, 7])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    before = net.digits.weight.detach().clone()
    out = net(x, y)
    assert out.lengths.shape == (2, 10) and out.coupling.shape == (2, 1152, 10)
    assert out.reconstruction.shape == x.shape
    loss, parts = net.loss(out, x, y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and parts["recon"] > 0
    assert not torch.equal(before, net.digits.weight.detach())


@pytest.mark.parametrize("preset, shape", [("digits", (3, 1, 16, 16)), ("mnist1d", (3, 1, 40))])
def test_presets_shapes(preset, shape, one_thread):
    net = build_capsnet(preset, iterations=2)
    assert net.spec.num_primary == 128
    out = net(torch.randn(shape), torch.tensor([0, 1, 2]))
    assert out.lengths.shape == (3, 10) and out.capsules.shape == (3, 10, 16)
    assert out.reconstruction.shape == shape and ((out.reconstruction >= 0) & (out.reconstruction <= 1)).all()
    if preset == "mnist1d":
        assert isinstance(net.stem, torch.nn.Conv1d) and net.primary.conv.kernel_size == (5, 1)


def test_encoder_init_does_not_depend_on_the_variant():
    """Same seed, same encoder weights with and without the decoder and for every routing option (pairing)."""
    nets = []
    for it, det, rec in ((1, False, False), (3, True, True), (5, False, True)):
        torch.manual_seed(4)
        nets.append(build_capsnet("digits", iterations=it, detach_inner=det, reconstruction=rec))
    for other in nets[1:]:
        for name in ("stem", "primary", "digits"):
            for a, b in zip(getattr(nets[0], name).parameters(), getattr(other, name).parameters()):
                assert torch.equal(a, b)


def _decoder_input(net, x, y=None):
    seen = {}

    def hook(module, inp, out):
        seen["x"] = inp[0].detach()

    handle = net.decoder[0].register_forward_hook(hook)
    try:
        out = net(x, y)
    finally:
        handle.remove()
    return out, seen["x"].view(len(x), 10, 16)


def test_reconstruction_masked_by_label_in_training_and_longest_capsule_in_eval(one_thread):
    torch.manual_seed(1)
    net = build_capsnet("digits", iterations=2)
    with torch.no_grad():
        net.digits.weight.mul_(30)  # capsules long enough that the longest one is clear
    x = torch.randn(6, 1, 16, 16)
    out, dec = _decoder_input(net.train(), x, torch.arange(6))
    longest = out.lengths.argmax(1)
    assert (longest != torch.arange(6)).any()  # the label and the longest capsule differ somewhere
    for n in range(6):
        torch.testing.assert_close(dec[n, n], out.capsules[n].detach()[n])
        assert dec[n].abs().sum() == dec[n, n].abs().sum()  # every other capsule is zero
    out, dec = _decoder_input(net.eval(), x, torch.arange(6))  # the label is ignored in eval mode
    for n in range(6):
        k = out.lengths[n].argmax()
        torch.testing.assert_close(dec[n, k], out.capsules[n, k])
        assert dec[n].abs().sum() == dec[n, k].abs().sum()
    with pytest.raises(ValueError, match="target"):
        net.train()(x)


def test_loss_is_margin_plus_scaled_sum_squared_error():
    torch.manual_seed(2)
    net = build_capsnet("digits", iterations=1, target_range=(-1.0, 3.0)).double()
    x, y = torch.rand(4, 1, 16, 16, dtype=torch.float64) * 4 - 1, torch.tensor([1, 2, 3, 4])
    out = net(x, y)
    loss, parts = net.loss(out, x, y)
    target = (x + 1.0) / 4.0
    sse = ((out.reconstruction - target) ** 2).sum((1, 2, 3)).mean()
    expected = margin_loss(out.lengths, y) + RECON_SCALE * sse
    assert abs(loss.item() - expected.item()) < 1e-12 and RECON_SCALE == 0.0005
    off = build_capsnet("digits", iterations=1, reconstruction=False).double()
    o = off(x, y)
    assert o.reconstruction is None and off.loss(o, x, y)[0].item() == margin_loss(o.lengths, y).item()


def _primary_grad(net, x, y, frozen: bool):
    """Gradient of the model's loss at the primary capsules; ``frozen``: routing redone with the final coupling
    coefficients as constants (the reference for the stop_gradient variant)."""
    u = net.primary_capsules(x).detach().requires_grad_()
    v, c = net.digits(u, return_coupling=True)
    if frozen:
        v = squash(torch.einsum("nij,nijd->njd", c.detach(), net.digits.predictions(u)))
    lengths = v.norm(dim=-1)
    recon = net.decoder(net.mask(v, y)).view(x.shape)
    loss = margin_loss(lengths, y) + RECON_SCALE * (recon - net.recon_target(x)).square().sum((1, 2, 3)).mean()
    (g,) = torch.autograd.grad(loss, u)
    return g


def _model_primary_grad(net, x, y):
    """The same gradient taken through the model's own forward (a hook makes the primary capsules a leaf)."""
    leaf = {}

    def hook(module, inp, out):
        leaf["u"] = out.detach().requires_grad_()
        return leaf["u"]

    handle = net.primary.register_forward_hook(hook)
    try:
        out = net(x, y)
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(net.loss(out, x, y)[0], leaf["u"])
    return g


@pytest.mark.parametrize("iterations", [1, 3])
def test_detached_gradient_reaches_primary_capsules_only_through_the_last_iteration(iterations):
    """detach_inner=True: the model's gradient at the primary capsules equals routing with the final coupling
    frozen, i.e. only the last iteration's s = sum_i c_ij u_hat_j|i carries gradient; the full gradient differs
    (it also flows through the coupling), except with one iteration where both are the same computation."""
    torch.manual_seed(3)
    net = build_capsnet("digits", iterations=iterations, detach_inner=True, stem_channels=8, primary_types=2).double()
    with torch.no_grad():
        net.digits.weight.mul_(30)  # non-uniform coupling, so the two gradients can differ
    x, y = torch.randn(3, 1, 16, 16, dtype=torch.float64), torch.tensor([0, 4, 9])
    g_det = _model_primary_grad(net, x, y)
    torch.testing.assert_close(g_det, _primary_grad(net, x, y, frozen=True), rtol=1e-10, atol=1e-13)
    net.digits.detach_inner = False
    g_full = _model_primary_grad(net, x, y)
    if iterations == 1:
        assert torch.equal(g_full, g_det)
    else:
        assert (g_full - g_det).norm() > 1e-3 * g_full.norm()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"preset": "cifar"}, "unknown preset"),
        ({"preset": "digits", "iterations": 0}, "iterations must be integers >= 1"),
        ({"preset": "digits", "depth": 3}, "unknown spec field"),
        ({"preset": "digits", "input_shape": (1, 8, 8)}, "too small"),
    ],
)
def test_build_errors(kwargs, match):
    with pytest.raises(UsageError, match=match):
        build_capsnet(**kwargs)
    assert set(CAPSNET_PRESETS) == {"mnist", "digits", "mnist1d"}
