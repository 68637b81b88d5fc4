"""Every number of lab/docs/gradients.md: what a stop_gradient does inside tf.nn.moments-style statistics (seed 000)
and inside dynamic routing (seed 001), measured with autograd in float64.

    .venv/bin/python lab/scripts/stop_gradient.py          # prints the tables of lab/docs/gradients.md (a few seconds)

The functions return plain dicts so that lab/tests/test_stop_gradient.py checks the same numbers the document shows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from normlab.functional import instance_norm, moments, squash
from normlab.nn import dynamic_routing

DT = torch.float64
EPS = 1e-5

# --------------------------------------------------------------------------------------------------
# moments: three ways to write the variance
# --------------------------------------------------------------------------------------------------


def _rel_diff(got, want) -> float:
    """max |got - want| / max |want|."""
    return ((got - want).abs().max() / want.abs().max()).item()


def var_naive(x, dims):
    """E[(x - E[x])^2] with the gradient through the mean."""
    m = x.mean(dims, keepdim=True)
    return (x - m).square().mean(dims, keepdim=True)


def var_tf(x, dims):
    """tf.nn.moments: E[(x - stop_gradient(E[x]))^2]."""
    m = x.mean(dims, keepdim=True).detach()
    return (x - m).square().mean(dims, keepdim=True)


def var_normlab(x, dims):
    return moments(x, dims, keepdim=True)[1]


VARIANTS = {"naive (through the mean)": var_naive, "tf (stop_gradient mean)": var_tf, "normlab moments": var_normlab}
REDUCTIONS = {  # name: (input shape, reduced dims)
    "moments over one axis (N, L) -> (N,)": ((4, 50), (1,)),
    "BatchNorm-style (N, C, H, W) over N, H, W": ((8, 3, 5, 5), (0, 2, 3)),
    "InstanceNorm-style (N, C, H, W) over H, W": ((8, 3, 5, 5), (2, 3)),
}


def mean_stationarity(seed: int = 0, n: int = 1000) -> dict[str, float]:
    """d/dmu sum_i (x_i - mu)^2 = -2 sum_i (x_i - mu): zero at the batch mean, -2 n delta at mean + delta."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=DT) * 3 + 5
    out = {}
    for name, shift in (("at the batch mean", 0.0), ("at the batch mean + 0.1", 0.1)):
        mu = (x.mean() + shift).requires_grad_()
        (d,) = torch.autograd.grad((x - mu).square().sum(), mu)
        out[name] = d.item()
    return out


def _normalize(x, dims, var_fn):
    m = x.mean(dims, keepdim=True)
    return (x - m) / torch.sqrt(var_fn(x, dims) + EPS)


def _torch_norm(x, dims):
    """torch's own BatchNorm / InstanceNorm in training mode (no affine) for the same reduction."""
    if dims == (0, 2, 3):
        return F.batch_norm(x, None, None, training=True, eps=EPS)
    if dims == (2, 3):
        return F.instance_norm(x, eps=EPS)
    return None


def first_order(seed: int = 1) -> list[dict[str, object]]:
    """Largest |gradient - naive gradient| (relative to the largest naive entry) of the variance and of the
    normalised output ``(x - mean) / sqrt(var + eps)``, for each reduction and way of writing the variance."""
    rows = []
    for red, (shape, dims) in REDUCTIONS.items():
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=DT) * 2 + 3
        w_var = torch.randn(var_naive(x, dims).shape, generator=g, dtype=DT)
        w_out = torch.randn(shape, generator=g, dtype=DT)
        grads = {}
        for name, fn in VARIANTS.items():
            xv = x.clone().requires_grad_()
            (gv,) = torch.autograd.grad((fn(xv, dims) * w_var).sum(), xv)
            (gn,) = torch.autograd.grad((_normalize(xv, dims, fn) * w_out).sum(), xv)
            grads[name] = (gv, gn)
        ref_v, ref_n = grads["naive (through the mean)"]
        for name, (gv, gn) in grads.items():
            rows.append(
                {
                    "reduction": red,
                    "variance": name,
                    "var_grad_rel_diff": _rel_diff(gv, ref_v),
                    "norm_grad_rel_diff": _rel_diff(gn, ref_n),
                }
            )
        torch_out = _torch_norm(x.clone().requires_grad_(), dims)
        if torch_out is not None:
            xt = x.clone().requires_grad_()
            (gt,) = torch.autograd.grad((_torch_norm(xt, dims) * w_out).sum(), xt)
            rows.append(
                {
                    "reduction": red,
                    "variance": "torch F.batch_norm / F.instance_norm",
                    "var_grad_rel_diff": None,
                    "norm_grad_rel_diff": _rel_diff(gt, ref_n),
                }
            )
    return rows


def second_order(seed: int = 2) -> list[dict[str, object]]:
    """Second derivatives of ``L = sum(w * var)``: a Hessian-vector product along a random direction (relative to
    the exact one), along the shift direction 1 (exact: 0, the variance does not change when every x moves by the
    same amount; the detached mean gives ``2/n * w``), and the gradient of a gradient penalty ``P = |dL/dx|^2``."""
    rows = []
    for red, (shape, dims) in REDUCTIONS.items():
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=DT) * 2 + 3
        w = torch.randn(var_naive(x, dims).shape, generator=g, dtype=DT)
        direction = torch.randn(shape, generator=g, dtype=DT)
        res = {}
        for name, fn in VARIANTS.items():
            xv = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad((fn(xv, dims) * w).sum(), xv, create_graph=True)
            (hvp,) = torch.autograd.grad((gx * direction).sum(), xv, retain_graph=True)
            (h1,) = torch.autograd.grad(gx.sum(), xv, retain_graph=True)
            (gp,) = torch.autograd.grad(gx.square().sum(), xv)
            res[name] = (hvp, h1, gp)
        ref_h, _, ref_p = res["naive (through the mean)"]
        for name, (h, h1, p) in res.items():
            rows.append(
                {
                    "reduction": red,
                    "variance": name,
                    "H v, random v: rel diff": _rel_diff(h, ref_h),
                    "H 1: max abs (exact 0)": h1.abs().max().item(),
                    "penalty gradient: rel diff": _rel_diff(p, ref_p),
                }
            )
    return rows


def half_precision() -> dict[str, float]:
    """A float16 input whose variance (90000) exceeds the float16 maximum 65504: the naive half computation and
    torch.var overflow, moments (float32 statistics) does not; instance normalisation likewise."""
    x = torch.tensor([300.0, -300.0] * 8, dtype=torch.float16).view(1, 1, 4, 4)
    ref = torch.var(x.double(), dim=(2, 3), correction=0).item()
    naive = var_naive(x, (2, 3)).item()
    tv = torch.var(x, dim=(2, 3), correction=0).item()
    mv = moments(x, (2, 3))[1]
    y_naive = _normalize(x, (2, 3), var_naive)
    y_nl = instance_norm(x)
    y_ref = _normalize(x.double(), (2, 3), var_naive)
    return {
        "float16 max": float(torch.finfo(torch.float16).max),
        "float64 reference": ref,
        "naive float16": naive,
        "torch.var float16": tv,
        "moments": mv.item(),
        "moments dtype": str(mv.dtype),
        "instance norm, naive float16: max abs error": (y_naive.double() - y_ref).abs().max().item(),
        "instance norm, normlab: max abs error": (y_nl.double() - y_ref).abs().max().item(),
    }


# --------------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------------


def _u_hat(seed: int, scale: float, shape=(4, 32, 10, 16)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=DT) * scale


def _routing_grad(u_hat, iterations: int, detach: bool, w: torch.Tensor):
    u = u_hat.clone().requires_grad_()
    v, c = dynamic_routing(u, iterations, detach_inner=detach)
    (g,) = torch.autograd.grad((v * w).sum(), u)
    return v.detach(), c.detach(), g


def routing_one_iteration(seed: int = 3) -> dict[str, float | bool]:
    """With one iteration there is no inner iteration: detach_inner changes neither v nor the gradient."""
    u_hat = _u_hat(seed, 0.3)
    w = torch.randn(
        u_hat.shape[0], u_hat.shape[2], u_hat.shape[3], generator=torch.Generator().manual_seed(seed), dtype=DT
    )
    v_d, _, g_d = _routing_grad(u_hat, 1, True, w)
    v_f, _, g_f = _routing_grad(u_hat, 1, False, w)
    return {
        "v identical": bool(torch.equal(v_d, v_f)),
        "gradient identical": bool(torch.equal(g_d, g_f)),
        "max abs gradient difference": (g_d - g_f).abs().max().item(),
    }


def routing_frozen_coupling(seed: int = 4) -> list[dict[str, float]]:
    """For r = 2, 3, 5 and two sizes of u_hat: the detached gradient against routing with the final coupling
    frozen (equal: c is a constant in backprop) and against the full gradient (relative difference, cosine);
    the coupling entropy (ln 10 = 2.3026 is uniform) says how far routing moved c."""
    rows = []
    for scale in (0.03, 0.3):
        u_hat = _u_hat(seed, scale)
        w = torch.randn(
            u_hat.shape[0], u_hat.shape[2], u_hat.shape[3], generator=torch.Generator().manual_seed(seed + 1), dtype=DT
        )
        for r in (2, 3, 5):
            _, c, g_det = _routing_grad(u_hat, r, True, w)
            _, _, g_full = _routing_grad(u_hat, r, False, w)
            u = u_hat.clone().requires_grad_()
            (g_frozen,) = torch.autograd.grad((squash(torch.einsum("nij,nijd->njd", c, u)) * w).sum(), u)
            ent = -(c * c.log()).sum(-1).mean().item()
            rows.append(
                {
                    "u_hat scale": scale,
                    "iterations": r,
                    "coupling entropy": ent,
                    "detached vs frozen c: rel diff": ((g_det - g_frozen).norm() / g_frozen.norm()).item(),
                    "detached vs full: rel diff": ((g_det - g_full).norm() / g_full.norm()).item(),
                    "cosine(detached, full)": F.cosine_similarity(g_det.flatten(), g_full.flatten(), 0).item(),
                }
            )
    return rows


# --------------------------------------------------------------------------------------------------
# markdown
# --------------------------------------------------------------------------------------------------


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, str):
        return x
    if x == 0 or (math.isfinite(x) and x == int(x) and abs(x) < 1e7):
        return str(int(x))
    return f"{x:.6g}" if 1e-3 <= abs(x) < 1e7 else f"{x:.1e}"


def _table(rows: list[dict[str, object]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_num(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _kv(d: dict[str, object]) -> str:
    return _table([{"quantity": k, "value": v} for k, v in d.items()])


def markdown() -> str:
    parts = [
        "### 1. d/dmu sum (x - mu)^2 (1000 values, float64)",
        _kv(mean_stationarity()),
        "### 2. First derivatives (relative to the naive gradient)",
        _table(first_order()),
        "### 3. Second derivatives (relative to the naive, exact ones)",
        _table(second_order()),
        "### 4. Half precision (sixteen float16 values +-300, variance 90000)",
        _kv(half_precision()),
        "### 5. Routing with one iteration",
        _kv(routing_one_iteration()),
        "### 6. Routing with inner iterations (u_hat (4, 32, 10, 16), float64)",
        _table(routing_frozen_coupling()),
    ]
    return "\n\n".join(parts) + f"\n\n(ln 10 = {math.log(10):.4f})\n"


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(markdown())
