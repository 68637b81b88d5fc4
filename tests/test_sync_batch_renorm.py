"""SyncBatchRenorm across 2 gloo processes with different batch sizes equals BatchRenorm on the concatenated batch."""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from normlab.nn.batch_renorm import BatchRenorm1d, BatchRenorm2d, SyncBatchRenorm

F64 = torch.float64
WORLD = 2
SPLITS = (2, 5)  # rank 0 gets 2 samples, rank 1 gets 5
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_module(kind: str, sync: bool):
    cls = SyncBatchRenorm if sync else (BatchRenorm2d if kind == "2d" else BatchRenorm1d)
    m = cls(3, dtype=F64, rmax=1.3, dmax=0.4, momentum=None if kind == "1d" else 0.1)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        m.weight.copy_(torch.rand(3, generator=g) + 0.5)
        m.bias.copy_(torch.randn(3, generator=g))
        m.running_mean.copy_(torch.tensor([0.8, -0.1, 0.0]))  # some channels clipped, some not
        m.running_var.copy_(torch.tensor([4.0, 1.1, 0.2]))
    return m


def _data(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    shape = (sum(SPLITS), 3, 4, 3) if kind == "2d" else (sum(SPLITS), 3)
    x = torch.randn(shape, generator=g, dtype=F64) * 1.5 + 0.3
    return x, torch.randn(shape, generator=g, dtype=F64)


def _run(m, kind: str, lo: int, hi: int):
    """STEPS training steps on samples [lo, hi) of each global batch; returns what to compare."""
    outs, grads = [], []
    for step in range(STEPS):
        x, gy = _data(kind, step)
        x = x[lo:hi].clone().requires_grad_()
        y = m(x)
        (y * gy[lo:hi]).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    return {
        "out": outs,
        "grad_x": grads,
        "grad_w": m.weight.grad.clone(),
        "grad_b": m.bias.grad.clone(),
        "state": {k: v.clone() for k, v in m.state_dict().items()},
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        lo = sum(SPLITS[:rank])
        hi = lo + SPLITS[rank]
        result = {kind: _run(_make_module(kind, sync=True), kind, lo, hi) for kind in ("2d", "1d")}
        result["checks"] = _edge_cases(rank)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _edge_cases(rank: int) -> dict:
    """channels_last is kept; a NaN on one rank makes every rank warn (no deadlock, no exception: the non-finite
    policy) and leaves the state alone."""
    m = _make_module("2d", sync=True)
    x = torch.randn(SPLITS[rank], 3, 4, 3, dtype=F64).to(memory_format=torch.channels_last)
    keeps_layout = m(x).is_contiguous(memory_format=torch.channels_last)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    if rank == 1:
        x[0, 1, 2, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m(x)
        m.eval()  # the skipped batch is reported here (no host read in the step)
        m.train()
    error = " ".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    unchanged = all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    # bfloat16 with large values through the synchronized path: finite, same dtype, float32-accurate statistics
    lo = sum(SPLITS[:rank])
    xb = _half_batch()[lo : lo + SPLITS[rank]]
    mb = SyncBatchRenorm(3, rmax=2.0, dmax=1.0, momentum=1.0)
    yb = mb(xb)
    half_ok = yb.dtype == torch.bfloat16 and bool(torch.isfinite(yb).all())
    # a process group of one rank: exactly the local BatchRenorm2d
    groups = [dist.new_group([r]) for r in range(WORLD)]
    ms = _make_module("2d", sync=True)
    ms.process_group = groups[rank]
    ml = _make_module("2d", sync=False)
    xs = torch.randn(SPLITS[rank], 3, 4, 3, dtype=F64)
    solo_ok = torch.equal(ms(xs), ml(xs)) and torch.equal(ms.running_var, ml.running_var)
    return {
        "channels_last": keeps_layout,
        "error": error,
        "unchanged": unchanged,
        "half_ok": half_ok,
        "half_running": (mb.running_mean.clone(), mb.running_var.clone()),
        "solo_ok": solo_ok,
        "checkpoint": _checkpoint_case(rank),
    }


def _checkpoint_case(rank: int) -> dict:
    """torch.utils.checkpoint over the synchronized layer (both modes): the recomputation's all-reduce happens in
    backward, its global statistics match the original forward's, so gradients equal the plain run's and the running
    statistics and step counter advance once per forward."""
    lo, hi = sum(SPLITS[:rank]), sum(SPLITS[: rank + 1])
    plain = _make_module("2d", sync=True)
    ckpts = {mode: _make_module("2d", sync=True) for mode in (False, True)}
    same = True
    for step in range(STEPS):
        x, gy = _data("2d", step)
        xp = x[lo:hi].clone().requires_grad_()
        (plain(xp) * gy[lo:hi]).sum().backward()
        for reentrant, m in ckpts.items():
            xc = x[lo:hi].clone().requires_grad_()
            (checkpoint(m, xc, use_reentrant=reentrant) * gy[lo:hi]).sum().backward()
            same = same and torch.equal(xp.grad, xc.grad)
    for m in ckpts.values():
        same = same and torch.equal(plain.weight.grad, m.weight.grad) and torch.equal(plain.bias.grad, m.bias.grad)
        same = same and all(torch.equal(v, m.state_dict()[k]) for k, v in plain.state_dict().items())
    return {"same": same, "steps": int(ckpts[False].num_batches_tracked)}


def _half_batch():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(sum(SPLITS), 3, 4, 3, generator=g) * 300 + 1e4).to(torch.bfloat16)


def test_two_gloo_ranks_with_different_batch_sizes_match_single_process(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for r in ranks:
        assert r["checks"]["channels_last"]
        assert "SyncBatchRenorm: 1 training batch(es) with non-finite batch statistics" in r["checks"]["error"]
        assert r["checks"]["unchanged"]
        assert r["checks"]["half_ok"] and r["checks"]["solo_ok"]
        assert r["checks"]["checkpoint"] == {"same": True, "steps": STEPS}
        xf = _half_batch().float()
        torch.testing.assert_close(r["checks"]["half_running"][0], xf.mean((0, 2, 3)), rtol=1e-6, atol=1e-3)
        torch.testing.assert_close(r["checks"]["half_running"][1], xf.var((0, 2, 3)), rtol=1e-4, atol=1e-2)
    for kind in ("2d", "1d"):
        ref = _run(_make_module(kind, sync=False), kind, 0, sum(SPLITS))
        got = [r[kind] for r in ranks]
        for step in range(STEPS):
            out = torch.cat([g["out"][step] for g in got])
            grad_x = torch.cat([g["grad_x"][step] for g in got])
            torch.testing.assert_close(out, ref["out"][step], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(grad_x, ref["grad_x"][step], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(got[0]["grad_w"] + got[1]["grad_w"], ref["grad_w"], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(got[0]["grad_b"] + got[1]["grad_b"], ref["grad_b"], rtol=1e-9, atol=1e-10)
        for key, value in ref["state"].items():
            assert torch.equal(got[0]["state"][key], got[1]["state"][key]), key  # identical on every rank
            torch.testing.assert_close(got[0]["state"][key], value, rtol=1e-12, atol=1e-12)
        # the renorm limits were active: a plain BN reference would differ
        assert not torch.allclose(ref["out"][0], _bn_out(kind), rtol=1e-4, atol=1e-4)


def _bn_out(kind: str):
    x, _ = _data(kind, 0)
    m = _make_module(kind, sync=False)
    m.rmax, m.dmax = 1.0, 0.0
    return m(x).detach()


def _empty_rank_worker(rank: int, init: str, out_dir: str) -> None:
    """Rank 0 trains on an empty slice, rank 1 on 5 samples; a short timeout turns a hang into a failure."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30)
    )
    try:
        result = {}
        for kind in ("2d", "1d"):
            m = _make_module(kind, sync=True)
            x, gy = _data(kind, 0)
            lo, hi = (0, 0) if rank == 0 else (0, 5)
            xs = x[lo:hi].clone().requires_grad_()
            y = m(xs)
            (y * gy[lo:hi]).sum().backward()
            result[kind] = {
                "out": y.detach(),
                "grad_x": xs.grad,
                "grad_w": m.weight.grad.clone(),
                "grad_b": m.bias.grad.clone(),
                "state": {k: v.clone() for k, v in m.state_dict().items()},
            }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_empty_rank_joins_the_backward_all_reduce(tmp_path):
    """Issue: a rank with an empty batch skipped the backward all-reduce and the other ranks hung until the timeout.
    Now every rank finishes; the non-empty rank's gradients are those of BatchRenorm on its 5 samples."""
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_empty_rank_worker, args=(init, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for kind in ("2d", "1d"):
        empty, full = ranks[0][kind], ranks[1][kind]
        m = _make_module(kind, sync=False)
        x, gy = _data(kind, 0)
        xs = x[:5].clone().requires_grad_()
        y = m(xs)
        (y * gy[:5]).sum().backward()
        assert empty["out"].shape == (0,) + x.shape[1:] and empty["grad_x"].shape == empty["out"].shape
        assert torch.equal(empty["grad_w"], torch.zeros(3, dtype=F64))
        torch.testing.assert_close(full["out"], y.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(full["grad_x"], xs.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(full["grad_w"], m.weight.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(full["grad_b"], m.bias.grad, rtol=1e-9, atol=1e-10)
        for key, value in m.state_dict().items():
            assert torch.equal(empty["state"][key], full["state"][key]), key
            torch.testing.assert_close(full["state"][key], value, rtol=1e-12, atol=1e-12)
