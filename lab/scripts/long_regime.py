"""The long regime of lab/docs/reproduction.md: does weight decay shrink ||W|| over ~20,000 steps at lr 0.01 until a net
without output normalization (or with BN / PWS) collapses?

The grid is trained once with ``normlab compare`` (the command is in lab/docs/reproduction.md, about 25 CPU-minutes per
run); this script reads its output directory and prints, per run, the outcome (collapsed or not, final and worst
late test accuracy) and the trajectories the paper's argument is about:

- ``raw ||W||``: the norm of the conv kernels as stored (the parameters weight decay acts on), at initialisation
  (rebuilt from the run's seed) and at the end (``checkpoint.pt``); for BN and PWS nets the output does not depend
  on it, and the effective step of SGD grows as ||W|| shrinks (lr / ||W||^2);
- ``eff ||W||``: the norm of the kernels the layers apply (``weight_norm`` of the monitor, summed in squares over the
  conv layers; the standardized kernel times alpha for PWS) at a few steps;
- ``worst loss``: the highest mean training loss over a window of steps (the collapse detector's window, from
  ``loss_trace.json``) after step 2,000, and where it was: a late spike towards ln 10 = 2.30 is the event the
  paper's argument predicts;
- ``shift``: the monitor's shift of the average weight, Var over filters of n*mean(W_o), averaged over conv layers.

    .venv/bin/python lab/scripts/long_regime.py runs/long_regime
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from normlab.monitor import load_log
from normlab.runner.data.datasets import get_dataset
from normlab.runner.grid.results import read_summary
from normlab.runner.models import build_model
from normlab.runner.training.config import TrainConfig
from normlab.runner.training.train import seed_everything

MARKS = (0, 5_000, 10_000, 15_000, 20_000)


def conv_norm(state: dict[str, torch.Tensor]) -> float:
    """sqrt of the summed squares of every stored conv kernel (parameters of 3 or more dims)."""
    return math.sqrt(
        sum(float(v.double().square().sum()) for k, v in state.items() if k.endswith("weight") and v.ndim >= 3)
    )


def init_state(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """The run's model as the trainer built it (same seed, same constructor), before any step."""
    _, _, info = get_dataset(cfg.dataset, cfg.data_dir, num_samples=cfg.num_samples, num_train=cfg.num_train)
    seed_everything(cfg.seed)
    model = build_model(
        cfg.model,
        cfg.norm,
        cfg.conv,
        info["in_channels"],
        info["num_classes"],
        info["input_shape"],
        cfg.width,
        conv_kwargs=cfg.conv_kwargs,
        **cfg.model_kwargs,
    )
    return model.state_dict()


def monitor_at(path: Path) -> dict[int, tuple[float, float]]:
    """step -> (effective ||W|| over conv layers, mean shift over conv layers) from a run's monitor.jsonl."""
    sq: dict[int, float] = {}
    shifts: dict[int, list[float]] = {}
    for r in load_log(path).records:
        if r.get("kind") != "conv" or r.get("weight_norm") is None:
            continue
        sq[r["step"]] = sq.get(r["step"], 0.0) + r["weight_norm"] ** 2
        shifts.setdefault(r["step"], []).append(r["shift"])
    return {s: (math.sqrt(sq[s]), sum(shifts[s]) / len(shifts[s])) for s in sq}


def worst_window(run: Path, after: int = 2_000) -> tuple[float, int]:
    """(highest windowed mean training loss after step ``after``, the step where that window starts)."""
    trace = json.loads((run / "loss_trace.json").read_text())
    losses, w = trace["losses"], int(trace["window"])
    means = [(sum(losses[i : i + w]) / w, i) for i in range(after, len(losses) - w + 1, w)]
    return max(means, default=(float("nan"), -1))


def nearest(series: dict[int, tuple[float, float]], step: int) -> tuple[float, float]:
    return series[min(series, key=lambda s: abs(s - step))]


def describe(run: Path) -> dict:
    summary = read_summary(run)
    cfg = TrainConfig(**summary["config"])
    late = [h["test_acc"] for h in summary["history"] if h["step"] >= 2_000]
    ck = torch.load(run / "checkpoint.pt", weights_only=True, map_location="cpu")
    series = monitor_at(run / "monitor.jsonl")
    return {
        "norm": run.name.split("_lr")[0],
        "seed": cfg.seed,
        "steps": summary["steps_run"],
        "collapsed": summary["collapsed"],
        "reason": summary["collapse_reason"],
        "final": summary["final_test_acc"],
        "worst_late": min(late, default=float("nan")),
        "worst_loss": worst_window(run),
        "raw0": conv_norm(init_state(cfg)),
        "raw_end": conv_norm(ck["model"]),
        "marks": {m: nearest(series, m) for m in MARKS},
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="runs/long_regime", help="the grid's --out directory")
    out = Path(p.parse_args().out)
    rows = [describe(d) for d in sorted((out / "runs").iterdir()) if (d / "summary.json").exists()]
    print(
        "| run | steps | collapsed | final acc | worst acc after step 2k | worst loss (step) | "
        "raw ||W|| init -> end | " + " | ".join(f"eff ||W|| / shift @{m // 1000}k" for m in MARKS) + " |"
    )
    print("|" + "---|" * (7 + len(MARKS)))
    for r in rows:
        cells = " | ".join(f"{r['marks'][m][0]:.1f} / {r['marks'][m][1]:.3g}" for m in MARKS)
        print(
            f"| {r['norm']} s{r['seed']} | {r['steps']} | {r['reason'] or 'no'} | {100 * r['final']:.2f} | "
            f"{100 * r['worst_late']:.2f} | {r['worst_loss'][0]:.3g} ({r['worst_loss'][1]}) | "
            f"{r['raw0']:.1f} -> {r['raw_end']:.1f} | {cells} |"
        )


if __name__ == "__main__":
    main()
