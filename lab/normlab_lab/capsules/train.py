"""One cell of the capsule routing experiment (lab/docs/capsules.md): a CapsNet of
:mod:`normlab_lab.capsules.capsnet` trained by the protocol, and what is measured on it.

Protocol (fixed before the measurements; lab/docs/capsules.md):

- A variant is (routing iterations r, gradient ``detached`` = naturomics' stop_gradient or ``full`` = the
  official code, reconstruction ``off``/``on``). With r = 1 the two gradients are the same computation (there is
  no inner iteration), so r = 1 is run once and labelled ``-``.
- Per seed, every variant starts from the same weights (the encoder is built first from ``torch.manual_seed(seed)``;
  the decoder after it) and sees the same batches in the same order (a generator seeded with the seed): the
  per-seed differences between variants are paired.
- Adam (lr 1e-3, torch defaults otherwise), batch 64, a fixed number of epochs, no learning-rate schedule, no
  early stopping; the measured quantity is the test error of the **last** epoch (never the best epoch).
- Also recorded: the test margin loss, the coupling coefficients' entropy over the parents after routing (mean over
  test examples and primary capsules; uniform is ln 10 = 2.303 nats), the entropy after each routing iteration of
  the trained model, how much detaching changes the trained model's gradient (relative difference and cosine of
  the full parameter gradient on 256 training examples, same weights, and their norm ratio), how strongly the
  reconstruction loss pushes the encoder (its gradient on the conv, primary and routing weights relative to the
  margin loss's), and the median wall time of a training step (1 torch thread per process).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from normlab.nn import dynamic_routing, margin_loss
from normlab.runner.data.datasets import get_dataset
from normlab.runner.io import atomic_write_json
from normlab_lab.capsules.capsnet import build_capsnet
from normlab_lab.capsules.stats import variant_name

__all__ = ["run_cell", "coupling_entropy", "step_benchmark", "load_data"]

_DATA_CACHE: dict[tuple[str, str | None], tuple] = {}


def load_data(name: str, data_dir: str | None):
    """(train, test, (lo, hi)) with the training inputs' range as the decoder's target range; cached per process."""
    key = (name, data_dir)
    if key not in _DATA_CACHE:
        train_ds, test_ds, _ = get_dataset(name, data_dir=data_dir)
        rng = (float(train_ds.x.min()), float(train_ds.x.max()))
        _DATA_CACHE[key] = (train_ds, test_ds, rng)
    return _DATA_CACHE[key]


def coupling_entropy(c: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each child's coupling coefficients over the parents, averaged over examples and children.

    ``H = mean_{n, i} -sum_j c_nij ln c_nij`` for c (N, in_caps, out_caps); ln(out_caps) for uniform coupling,
    0 when every child sends everything to one parent.
    """
    return -(c * torch.log(c.clamp_min(1e-30))).sum(-1).mean()


@torch.no_grad()
def _evaluate(model, ds, limit: int | None, batch_size: int = 256) -> dict[str, float]:
    """Test error, margin loss, reconstruction SSE (eval-mode mask) and coupling entropy over ``ds``."""
    model.eval()
    n = len(ds) if limit is None else min(limit, len(ds))
    wrong = margin = sse = ent = 0.0
    for start in range(0, n, batch_size):
        x, y = ds.batch(torch.arange(start, min(start + batch_size, n)))
        out = model(x)
        _, parts = model.loss(out, x, y)
        k = len(y)
        wrong += (out.lengths.argmax(1) != y).sum().item()
        margin += parts["margin"] * k
        sse += parts["recon"] * k
        ent += coupling_entropy(out.coupling).item() * k
    return {"test_err": wrong / n, "test_margin": margin / n, "test_recon": sse / n, "entropy": ent / n}


@torch.no_grad()
def _entropy_by_iteration(model, ds, limit: int | None) -> list[float]:
    """Coupling entropy after routing iteration k = 1..r of the trained model (same predictions u_hat)."""
    model.eval()
    n = len(ds) if limit is None else min(limit, len(ds))
    x, _ = ds.batch(torch.arange(n))
    u_hat = model.digits.predictions(model.primary_capsules(x))
    return [coupling_entropy(dynamic_routing(u_hat, k)[1]).item() for k in range(1, model.digits.iterations + 1)]


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """|a - b| / |b|, cosine(a, b) and |a| / |b| of two flattened gradients."""
    return {
        "rel_diff": ((a - b).norm() / b.norm()).item(),
        "cosine": torch.nn.functional.cosine_similarity(a, b, dim=0).item(),
        "norm_ratio": (a.norm() / b.norm()).item(),
    }


def _detach_effect(model, ds, n: int = 256) -> dict[str, float] | None:
    """How much the stop_gradient changes the trained model's gradient: the loss gradient over all parameters on
    the first ``n`` training examples with ``detach_inner`` on and off (same weights), compared as
    detached-vs-full by :func:`_compare`; None for one iteration."""
    if model.digits.iterations == 1:
        return None
    model.train()
    x, y = ds.batch(torch.arange(min(n, len(ds))))
    params = [p for p in model.parameters() if p.requires_grad]
    saved, grads = model.digits.detach_inner, {}
    try:
        for detach in (True, False):
            model.digits.detach_inner = detach
            grads[detach] = _flat_grad(model.loss(model(x, y), x, y)[0], params)
    finally:
        model.digits.detach_inner = saved
    return _compare(grads[True], grads[False])


def _recon_share(model, ds, n: int = 256) -> dict[str, float] | None:
    """How much the reconstruction loss pushes the encoder (conv stem, primary and routing weights) of the trained
    model: its gradient there compared with the margin loss's (:func:`_compare`, recon vs margin) on the first
    ``n`` training examples; None without a decoder."""
    if model.decoder is None:
        return None
    model.train()
    x, y = ds.batch(torch.arange(min(n, len(ds))))
    encoder = [p for m in (model.stem, model.primary, model.digits) for p in m.parameters()]
    out = model(x, y)
    total, _ = model.loss(out, x, y)
    margin = margin_loss(out.lengths, y)
    return _compare(_flat_grad(total - margin, encoder), _flat_grad(margin, encoder))


def _step(model, opt, x: torch.Tensor, y: torch.Tensor):
    """One training step (forward, loss, backward, Adam); returns the output, the loss and its parts."""
    out = model(x, y)
    loss, parts = model.loss(out, x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return out, loss, parts


def step_benchmark(spec, rounds: int = 15, warmup: int = 3, threads: int = 1) -> dict[str, float]:
    """Median seconds per training step of every variant of ``spec`` (a ``CapsSpec``), measured **round-robin** in
    this process (one step of each variant in turn, on one fixed batch, ``threads`` torch threads): a busy machine
    slows every variant alike, so the ratios between variants hold even when the absolute times do not."""
    train_ds, _, rng = load_data(spec.dataset, spec.data_dir)
    x, y = train_ds.batch(torch.arange(min(spec.batch_size, len(train_ds))))
    models = {}
    for r, g, rec in spec.variants():
        torch.manual_seed(0)
        m = build_capsnet(
            spec.dataset, iterations=r, detach_inner=g == "detached", reconstruction=rec == "on", target_range=rng
        )
        models[variant_name(r, g, rec)] = (m.train(), torch.optim.Adam(m.parameters(), lr=spec.lr))
    times: dict[str, list[float]] = {name: [] for name in models}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in range(warmup + rounds):
            for name, (m, opt) in models.items():
                t0 = time.perf_counter()
                _step(m, opt, x, y)
                if k >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _train_epoch(model, opt, ds, perm: torch.Tensor, cfg) -> dict[str, Any]:
    """One pass over ``perm`` in batches; returns the mean losses, train error and each step's seconds."""
    model.train()
    bs, cap = cfg.batch_size, cfg.max_steps_per_epoch
    starts = list(range(0, len(perm), bs))[: cap or None]
    totals = {"loss": 0.0, "margin": 0.0, "recon": 0.0, "wrong": 0.0, "seen": 0}
    times = []
    for start in starts:
        x, y = ds.batch(perm[start : start + bs])
        t0 = time.perf_counter()
        out, loss, parts = _step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
        k = len(y)
        totals["loss"] += loss.item() * k
        totals["margin"] += parts["margin"] * k
        totals["recon"] += parts["recon"] * k
        totals["wrong"] += (out.lengths.detach().argmax(1) != y).sum().item()
        totals["seen"] += k
    seen = max(totals["seen"], 1)
    return {
        "train_loss": totals["loss"] / seen,
        "train_margin": totals["margin"] / seen,
        "train_recon": totals["recon"] / seen,
        "train_err": totals["wrong"] / seen,
        "step_times": times,
    }


def run_cell(cfg, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Train one cell of config ``cfg`` (a :class:`~normlab_lab.capsules.experiment.CapsConfig`;
    see the protocol); write and return ``out_dir/summary.json``."""
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    train_ds, test_ds, rng = load_data(cfg.dataset, cfg.data_dir)
    torch.manual_seed(cfg.seed)
    model = build_capsnet(
        cfg.dataset,
        iterations=cfg.iterations,
        detach_inner=cfg.detach_inner,
        reconstruction=cfg.reconstruction,
        target_range=rng,
    )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    order = torch.Generator().manual_seed(cfg.seed)  # same batches in the same order for every variant
    history, step_times = [], []
    for epoch in range(1, cfg.epochs + 1):
        rec = _train_epoch(model, opt, train_ds, torch.randperm(len(train_ds), generator=order), cfg)
        step_times += rec.pop("step_times")
        rec.update(_evaluate(model, test_ds, cfg.test_subset))
        if not math.isfinite(rec["train_loss"]):
            history.append({"epoch": epoch, **rec})
            break
        history.append({"epoch": epoch, **rec})
    last = history[-1]
    summary = {
        "config": cfg.to_dict(),
        "history": history,
        "epochs_run": len(history),
        "final_test_err": last["test_err"],
        "final_test_margin": last["test_margin"],
        "final_train_loss": last["train_loss"],
        "final_entropy": last["entropy"],
        "entropy_by_iteration": _entropy_by_iteration(model, test_ds, cfg.test_subset),
        "detach_effect": _detach_effect(model, train_ds),
        "recon_share": _recon_share(model, train_ds),
        "diverged": not math.isfinite(last["train_loss"]),
        "step_time_s": statistics.median(step_times[1:] or step_times),  # the first step warms up
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_primary": model.spec.num_primary,
        "wall_s": time.perf_counter() - t_wall,
        "cpu_s": time.process_time() - t_cpu,
    }
    atomic_write_json(Path(out_dir) / "summary.json", summary)
    return summary
