"""normlab.functional.moments against torch's formulas, its gradient against the naive formula, half precision."""

import pytest
import torch

from normlab.functional import moments


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dims", [(0,), (2, 3), (-1,), (-2, -1), (1, -1), 1])
def test_moments_match_torch(dims, keepdim, correction):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64) * 3 + 2
    mean, var = moments(x, dims, keepdim=keepdim, correction=correction)
    ref_var, ref_mean = torch.var_mean(x, dim=dims, keepdim=keepdim, correction=correction)  # note reversed order
    assert mean.shape == ref_mean.shape and var.shape == ref_var.shape
    torch.testing.assert_close(mean, ref_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, ref_var, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("correction", [0, 1])
def test_var_gradient_equals_naive_formula(correction):
    """The detached mean inside moments changes no gradient (d var / d mean = 0 at the true mean)."""
    torch.manual_seed(1)
    x = (torch.randn(4, 3, 7, dtype=torch.float64) * 2 + 5).requires_grad_()
    g_out_m = torch.randn(4, 3, dtype=torch.float64)
    g_out_v = torch.randn(4, 3, dtype=torch.float64)

    mean, var = moments(x, -1, correction=correction)
    (gx,) = torch.autograd.grad((mean * g_out_m).sum() + (var * g_out_v).sum(), x)

    n = x.shape[-1]
    m = x.mean(-1, keepdim=True)  # NOT detached: the gradient flows through the mean
    naive_var = (x - m).square().sum(-1) / (n - correction)
    (gx_naive,) = torch.autograd.grad((m.squeeze(-1) * g_out_m).sum() + (naive_var * g_out_v).sum(), x)
    assert (gx - gx_naive).abs().max().item() < 1e-12

    # why the detach is allowed: the contribution of the mean path through var, taken alone, is zero
    m_only = x.mean(-1, keepdim=True)
    frozen = x.detach()
    (g_mean_path,) = torch.autograd.grad(((frozen - m_only).square().sum(-1) * g_out_v).sum(), x)
    assert g_mean_path.abs().max().item() < 1e-12


def test_moments_gradcheck():
    torch.manual_seed(2)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)

    def f(t):
        m, v = moments(t, (0, 2), correction=1)
        return m, v

    assert torch.autograd.gradcheck(f, (x,))


def test_moments_gradgradcheck():
    """Second derivatives are exact too (the detached mean alone would give a Hessian 2/n*I)."""
    torch.manual_seed(2)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: moments(t, (1, 2))[1], (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_large_values_finite_float32(dtype):
    torch.manual_seed(3)
    base = torch.randn(2, 3, 8, 8, dtype=torch.float64) * 1e4
    x = base.to(dtype)
    mean, var = moments(x, (2, 3))
    assert mean.dtype == torch.float32 and var.dtype == torch.float32
    assert torch.isfinite(var).all() and var.min() > 65504  # the variance itself exceeds the fp16 range
    ref_var, ref_mean = torch.var_mean(x.double(), dim=(2, 3), correction=0)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-5, atol=0)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-2)
    if dtype == torch.float16:
        # the naive half-precision variance overflows: this is what moments avoids
        assert torch.isinf(torch.var(x, dim=(2, 3))).any()


def test_integer_like_shapes_and_scalar_dim():
    x = torch.arange(12.0).reshape(3, 4)
    mean, var = moments(x, 1)
    torch.testing.assert_close(mean, x.mean(1))
    torch.testing.assert_close(var, x.var(1, correction=0))


@pytest.mark.parametrize(
    "dims, correction, match",
    [
        ((4,), 0, "dims"),
        ((-5,), 0, "dims"),
        ((1, 1), 0, "repeat"),
        ((1, -3), 0, "repeat"),
        ((0,), 2, "correction"),
        ((0,), 3, "correction"),
    ],
)
def test_moments_errors(dims, correction, match):
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=match) as info:
        moments(x, dims, correction=correction)
    assert "moments" in str(info.value)


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 7), (2, 3, 4, 5), (2, 3, 2, 3, 4)])
def test_batch_moments_per_channel_biased_and_without_grad(shape):
    from normlab.functional import batch_moments

    torch.manual_seed(7)
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 2).requires_grad_()
    mean, var = batch_moments(x)
    dims = (0,) + tuple(range(2, x.dim()))
    ref_var, ref_mean = torch.var_mean(x.detach(), dims, correction=0)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, ref_var, rtol=1e-12, atol=1e-12)
    assert not mean.requires_grad and not var.requires_grad
    if x.dim() == 4:
        cl = x.detach().contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(batch_moments(cl)[1], ref_var, rtol=1e-12, atol=1e-12)


def test_batch_moments_half_large_values():
    from normlab.functional import batch_moments

    x = (torch.randn(8, 4, 5, 5, dtype=torch.float64) * 1e4).half()
    mean, var = batch_moments(x)
    assert mean.dtype == var.dtype == torch.float32 and torch.isfinite(var).all() and var.min() > 65504
    ref_var, _ = torch.var_mean(x.double(), (0, 2, 3), correction=0)
    torch.testing.assert_close(var.double(), ref_var, rtol=1e-5, atol=0)
