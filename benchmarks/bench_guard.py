"""What CollapseGuard costs, side by side in one run: per snapshot for each store, and per step at its defaults.

``snapshots``: for ResNet-50 (torchvision's definition, no weights) and a ~100M-parameter pre-LN transformer
(``nn.TransformerEncoder``, d 768, 13 layers, an 8,192-token embedding and head), both under AdamW (the state a
snapshot holds: parameters, buffers, two moments per parameter), and for each snapshot store (``host``, ``disk``,
``dcp``): the bytes one snapshot takes where the store keeps it, the resident memory the process gains per snapshot,
the seconds to take one (the guard's snapshot inside an optimizer step, less the same step without a guard: the
median over ``--repeats`` snapshots after a first one that allocates the buffers) and to restore one (a rollback:
``guard.report``). The optimizer step is ``opt.step()`` on zero gradients, so the timing is the snapshot's, not a
forward's. On a CUDA device the host store copies asynchronously into pinned memory; here (CPU) it is a memcpy.

``overhead``: blocks of ``--steps`` training steps (forward, backward, ``opt.step()``), interleaved across two
identical runs (the order alternates every repeat): a plain optimizer step, and the same step watched by a
``CollapseGuard`` at its defaults (a snapshot every 50 steps in host memory, a check every 10 steps) with the loss
observed. Reported: the per-step median of each and the ratio guarded / plain, of the medians and per round.

    .venv/bin/python benchmarks/bench_guard.py snapshots --out runs/bench_guard_snapshots.json  # needs ~5 GB of RAM
    .venv/bin/python benchmarks/bench_guard.py overhead --model tinylm --steps 100 --repeats 5
    .venv/bin/python benchmarks/bench_guard.py overhead --model resnet50 --size 64 --batch-size 4 --steps 50

The machine may be shared with other jobs: compare ratios, not absolute times, and rerun if noisy.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from normlab.monitor import CollapseGuard, RescueOptions, SnapshotOptions

STORES = ("host", "disk", "dcp")


class TransformerLM(nn.Module):
    """A pre-LN transformer language model: embedding, ``nn.TransformerEncoder`` (norm_first), head."""

    def __init__(self, vocab: int = 8192, d: int = 768, layers: int = 13, heads: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.enc(self.emb(x), mask=mask, is_causal=True))


def _resnet50() -> nn.Module:
    import torchvision

    return torchvision.models.resnet50(weights=None)


def _tinylm() -> nn.Module:
    return TransformerLM(vocab=64, d=64, layers=2, heads=4)  # the overhead run's small pre-LN LM


def _rss() -> int:
    """The process's resident memory in bytes (Linux), or 0."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _with_adam_state(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the moments exist now: a snapshot holds them
    return opt


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def snapshot_costs(model_name: str, store: str, repeats: int, directory: Path) -> dict:
    """One model and store: bytes and resident memory per snapshot, seconds to take and to restore one."""
    model = {"resnet50": _resnet50, "transformer100m": TransformerLM, "tinylm": _tinylm}[model_name]()
    opt = _with_adam_state(model)
    params = sum(p.numel() for p in model.parameters())
    plain = [_timed(opt.step) for _ in range(repeats)]  # the step alone (zero gradients)
    gc.collect()
    rss0 = _rss()
    opts = SnapshotOptions(every=1, keep=2, store=store, directory=None if store == "host" else directory)
    t_first = time.perf_counter()
    guard = CollapseGuard(model, opt, snapshots=opts, rescue=RescueOptions(check_every=1, max_rescues=repeats + 1))
    first = time.perf_counter() - t_first  # the first snapshot allocates its buffers
    one = guard.nbytes
    rss1 = _rss()
    guarded = [_timed(opt.step) for _ in range(repeats)]  # every step takes a snapshot (buffers reused, keep 2)
    restore = [_timed(lambda: guard.report("benchmark")) for _ in range(min(repeats, 2))]
    held = guard.nbytes
    guard.close()
    return {
        "model": model_name,
        "params": params,
        "store": store,
        "snapshot_bytes": one,
        "held_bytes_keep2": held,
        "rss_gain_first_snapshot": rss1 - rss0,
        "first_snapshot_s": first,
        "snapshot_s": statistics.median(g - p for g, p in zip(guarded, plain)),
        "restore_s": statistics.median(restore),
        "plain_step_s": statistics.median(plain),
    }


def run_snapshots(args) -> list[dict]:
    rows = []
    for model_name in args.models.split(","):
        for store in args.stores.split(","):
            with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
                row = snapshot_costs(model_name, store, args.repeats, Path(tmp))
            gc.collect()
            rows.append(row)
            print(
                f"{row['model']:<10} {row['store']:<5} params {row['params'] / 1e6:6.1f}M  snapshot "
                f"{row['snapshot_bytes'] / 2**20:8.1f} MiB (RSS +{row['rss_gain_first_snapshot'] / 2**20:7.1f} MiB)  "
                f"take {row['snapshot_s']:6.3f} s (first {row['first_snapshot_s']:6.3f} s)  "
                f"restore {row['restore_s']:6.3f} s",
                flush=True,
            )
    return rows


def _overhead_model(args) -> tuple:
    """The model of the overhead run and a batch maker (fixed random batches, the same for both runs)."""
    gen = torch.Generator().manual_seed(101)
    if args.model == "resnet50":
        torch.manual_seed(100)
        model = _resnet50()
        data = [
            (
                torch.randn(args.batch_size, 3, args.size, args.size, generator=gen),
                torch.randint(0, 1000, (args.batch_size,), generator=gen),
            )
            for _ in range(args.steps)
        ]
        return model, data, lambda m, b: F.cross_entropy(m(b[0]), b[1])
    torch.manual_seed(100)
    model = _tinylm()
    data = [torch.randint(0, 64, (args.batch_size, 65), generator=gen) for _ in range(args.steps)]
    return model, data, lambda m, b: F.cross_entropy(m(b[:, :-1]).reshape(-1, 64), b[:, 1:].reshape(-1))


def run_overhead(args) -> dict:
    base, data, loss_fn = _overhead_model(args)
    runs = {}
    for name in ("plain", "guard (defaults)"):
        model = copy.deepcopy(base).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        guard = CollapseGuard(model, opt) if name != "plain" else None
        runs[name] = (model, opt, guard)

    def block(model, opt, guard, batches=data) -> float:
        t0 = time.perf_counter()
        for b in batches:
            loss = loss_fn(model, b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if guard is not None:
                guard.observe_loss(loss)
            opt.step()
        return (time.perf_counter() - t0) / len(batches)

    for v in runs.values():
        block(*v, batches=data[:2])  # warm-up
    times = {k: [] for k in runs}
    names = list(runs)
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        for k in names[r % 2 :] + names[: r % 2]:
            times[k].append(block(*runs[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    rounds = sorted(g / p for g, p in zip(times["guard (defaults)"], times["plain"]))
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "repeats": args.repeats,
        "plain_ms": med["plain"] * 1e3,
        "guard_ms": med["guard (defaults)"] * 1e3,
        "ratio": med["guard (defaults)"] / med["plain"],
        "round_ratios": rounds,
        "load": [load_before, os.getloadavg()[0]],
        "rescues": len(runs["guard (defaults)"][2].rescues),
    }
    print(
        f"{args.model}, batch {args.batch_size}, {args.threads} thread(s), {args.repeats} interleaved repeats of "
        f"{args.steps} steps; load {result['load'][0]:.1f} -> {result['load'][1]:.1f}\n"
        f"plain {result['plain_ms']:.2f} ms/step, guard at its defaults {result['guard_ms']:.2f} ms/step: ratio "
        f"{result['ratio']:.3f} (per round {rounds[0]:.3f} / {statistics.median(rounds):.3f} / {rounds[-1]:.3f})"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", nargs="?", default="overhead", choices=("snapshots", "overhead"), help="default: overhead")
    p.add_argument(
        "--models",
        default="resnet50,transformer100m",
        help="snapshots: comma-separated (resnet50, transformer100m, tinylm)",
    )
    p.add_argument("--stores", default=",".join(STORES), help="snapshots: comma-separated stores")
    p.add_argument("--tmp", default=None, help="snapshots: where the disk and dcp stores write (default: the system's)")
    p.add_argument("--model", default="tinylm", choices=("tinylm", "resnet50"), help="overhead: the model")
    p.add_argument("--size", type=int, default=64, help="overhead, resnet50: image side")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100, help="overhead: steps per timed block (>= 50: a snapshot)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_snapshots(args) if args.what == "snapshots" else run_overhead(args)
    if args.out:
        meta = {
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "threads": args.threads,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "result": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
